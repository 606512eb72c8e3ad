//! DeepSeek-V3 on the CUDA backend against the CPU backend (and HF transformers' fp32
//! references): the tiny checkpoints of tests/data/deepseek through a prompt and 16 decode steps
//! (q_lora on/off, group-limited routing on/off, FP8 weights, the MTP layer, a bf16 copy), and
//! the MLA and MoE operations on fresh random inputs of odd sizes. Without the `cuda` feature
//! or a device the tests print why and pass.

#[cfg(feature = "cuda")]
#[path = "../../tests/common/deepseek_ref.rs"]
mod deepseek_ref;

#[cfg(feature = "cuda")]
#[allow(dead_code)]
#[path = "gpu/util.rs"]
mod util;

#[cfg(feature = "cuda")]
mod gpu {
    use std::path::Path;

    use deepinfer::backend::cpu::CpuBackend;
    use deepinfer::backend::cuda::{unavailable_reason, Act, CudaBackend, CudaOptions, Ds2};
    use deepinfer::backend::Backend;
    use deepinfer::model::arch::deepseek_v3::DeepseekV3;
    use deepinfer::model::batch::Batch;
    use deepinfer::model::mla::{MlaDims, MlaParams, MlaPath, MlaWeights};
    use deepinfer::model::moe::{Mlp, MoeLayer, Router, RouterConfig, ScoreFunc};
    use deepinfer::model::CausalLm;
    use deepinfer::tensor::{Bytes, DType, Weight};

    use super::deepseek_ref::{
        bf16_copy, data, max_err, mtp_against_reference, prefill, reference, Reference,
    };
    use super::util::Rng;

    fn cuda(act: Option<Act>) -> Option<CudaBackend> {
        cuda_with(act, true)
    }

    /// A backend with the MoE decode kernels on or off.
    fn cuda_with(act: Option<Act>, fuse_moe: bool) -> Option<CudaBackend> {
        cuda_opts(act, fuse_moe, true)
    }

    /// A backend with the MoE decode kernels and the `ds2` kernel variants on or off.
    fn cuda_opts(act: Option<Act>, fuse_moe: bool, ds2: bool) -> Option<CudaBackend> {
        cuda_mla(act, fuse_moe, ds2, true)
    }

    /// ... and the fused MLA decode kernel on or off.
    fn cuda_mla(
        act: Option<Act>,
        fuse_moe: bool,
        ds2: bool,
        fuse_mla: bool,
    ) -> Option<CudaBackend> {
        cuda_layer(act, fuse_moe, ds2, fuse_mla, false)
    }

    /// ... and the fused attention half of a layer on or off.
    fn cuda_layer(
        act: Option<Act>,
        fuse_moe: bool,
        ds2: bool,
        fuse_mla: bool,
        fuse_layer: bool,
    ) -> Option<CudaBackend> {
        if let Some(why) = unavailable_reason() {
            eprintln!("skipped: {why}");
            return None;
        }
        let opts = CudaOptions {
            act,
            fuse_moe,
            ds2: if ds2 { Ds2::ALL } else { Ds2::NONE },
            fuse_mla,
            fuse_layer,
            ..CudaOptions::from_env().expect("CUDA options")
        };
        Some(CudaBackend::new(0, opts).expect("the CUDA backend starts"))
    }

    /// A further backend (the device is there: an earlier one started) with the environment's
    /// options, `act`, and what `set` changes.
    fn cuda_set(act: Act, set: impl FnOnce(&mut CudaOptions)) -> CudaBackend {
        let mut o = CudaOptions {
            act: Some(act),
            ..CudaOptions::from_env().expect("CUDA options")
        };
        set(&mut o);
        CudaBackend::new(0, o).expect("a further CUDA backend")
    }

    /// The prompt in one pass, then 16 decode steps through the cache: every row's logits.
    fn drive<B: Backend>(m: &DeepseekV3<B>, r: &Reference) -> Vec<f32> {
        let mut kv = m.new_kv(4, 16).unwrap();
        let p = r.prompt_len;
        let mut out = m.forward(&prefill(&r.tokens[..p], 0), &mut kv).unwrap();
        for i in p..r.tokens.len() {
            let mut b = Batch::default();
            b.push(&r.tokens[i..i + 1], i, vec![0, 1, 2, 3], true);
            out.extend(m.forward(&b, &mut kv).unwrap());
        }
        out
    }

    fn check_checkpoint(dir: &Path, name: &str, act: Option<Act>, tol_cpu: f64, tol_hf: f64) {
        let Some(be) = cuda(act) else { return };
        let r = reference(name);
        let gpu = DeepseekV3::open(dir, be).expect("loads on CUDA");
        let cpu = DeepseekV3::open(dir, CpuBackend::new(2)).expect("loads on the CPU");
        let (g, c) = (drive(&gpu, &r), drive(&cpu, &r));
        let p = r.prompt_len * r.vocab;
        let (ep, ed) = (
            max_err(&g[..p], &c[..p], r.vocab),
            max_err(&g[p..], &c[p..], r.vocab),
        );
        let hf = max_err(&g, &r.logits, r.vocab);
        eprintln!(
            "{} {name}: CUDA vs CPU prompt {ep:.2e}, 16 decode steps {ed:.2e}; CUDA vs HF {hf:.2e}",
            dir.display()
        );
        assert!(
            ep < tol_cpu && ed < tol_cpu,
            "{name}: CUDA vs CPU {ep:e} / {ed:e}"
        );
        assert!(hf < tol_hf, "{name}: CUDA vs HF {hf:e}");
        // the routing agrees: the same tokens per expert in every MoE layer
        let (lg, lc) = (gpu.expert_load(), cpu.expert_load());
        assert_eq!(lg.len(), lc.len());
        for ((i, a), (_, b)) in lg.iter().zip(&lc) {
            assert_eq!(a.total, b.total, "layer {i} expert totals");
            assert_eq!(a.last_step, b.last_step, "layer {i} last step");
            assert_eq!(a.steps, b.steps, "layer {i} steps");
        }
        assert!(lg[0].1.total.iter().sum::<u64>() > 0);
    }

    #[test]
    fn q_lora_and_group_limited_routing_match_the_cpu() {
        check_checkpoint(&data().join("qlora_group"), "qlora_group", None, 1e-4, 2e-4);
    }

    #[test]
    fn no_q_lora_and_no_group_limit_match_the_cpu() {
        let dir = data().join("noqlora_nogroup");
        check_checkpoint(&dir, "noqlora_nogroup", None, 1e-4, 2e-4);
    }

    #[test]
    fn fp8_checkpoint_matches_the_cpu() {
        check_checkpoint(&data().join("fp8"), "fp8", None, 1e-4, 2e-4);
    }

    #[test]
    fn bf16_copy_runs_bf16_on_the_device_and_stays_close() {
        // every tensor rounded to bf16: bf16 activations and a bf16 latent cache on CUDA
        let dir = tempfile::tempdir().unwrap();
        bf16_copy("qlora_group", dir.path());
        check_checkpoint(dir.path(), "qlora_group", None, 5e-2, 6e-2);
    }

    #[test]
    fn decode_batches_of_several_sequences_match_the_cpu() {
        // three sequences prefilled apart, then decoded together: a batch of 3 that the CUDA
        // backend pads to its bucket of 4 (a padding row writing the scratch block -1)
        let Some(be) = cuda(None) else { return };
        let name = "qlora_group";
        let r = reference(name);
        let gpu = DeepseekV3::open(&data().join(name), be).unwrap();
        let cpu = DeepseekV3::open(&data().join(name), CpuBackend::new(2)).unwrap();
        let prompts: [&[u32]; 3] = [&r.tokens[..5], &r.tokens[3..20], &r.tokens[..1]];
        let run = |m: &dyn CausalLm| -> Vec<f32> {
            let mut kv = m.new_kv(12, 16).unwrap();
            let table = |i: usize| (4 * i as u32..4 * i as u32 + 4).collect::<Vec<u32>>();
            let mut out = Vec::new();
            for (i, p) in prompts.iter().enumerate() {
                let mut b = Batch::default();
                b.push(p, 0, table(i), true);
                out.extend(m.forward(&b, &mut kv).unwrap());
            }
            for step in 0..4 {
                let mut b = Batch::default();
                for (i, p) in prompts.iter().enumerate() {
                    b.push(&[r.tokens[20 + step + i]], p.len() + step, table(i), true);
                }
                out.extend(m.forward(&b, &mut kv).unwrap());
            }
            out
        };
        let (g, c) = (run(&gpu), run(&cpu));
        let err = max_err(&g, &c, r.vocab);
        eprintln!("{name}: 3-sequence decode batches, CUDA vs CPU {err:.2e}");
        assert!(err < 1e-4, "batched decode: {err:e}");
    }

    #[test]
    fn mtp_layer_matches_hf_on_cuda() {
        let Some(be) = cuda(None) else { return };
        let name = "qlora_group";
        let m = DeepseekV3::open(&data().join(name), be).unwrap();
        let r = reference(name);
        let mut kv = m.new_kv(4, 16).unwrap();
        let (_, err) = mtp_against_reference(&m, &r, &mut kv);
        eprintln!("{name}: CUDA MTP logits vs HF {err:.2e}");
        assert!(err < 2e-4, "MTP on CUDA: {err:e}");
    }

    // ---- operations on fresh random inputs ------------------------------------------------

    #[derive(Clone)]
    struct MlaCase {
        p: MlaParams,
        kv_a_norm: Weight,
        kv_b: Weight,
        inv_freq: Weight,
        /// (prefill batch, its q, its kva), then (decode batch, q, kva).
        steps: Vec<(Batch, Vec<f32>, Vec<f32>)>,
    }

    /// Three sequences in a paged cache of 8-token blocks: prompts of 1, 67 and 300 tokens
    /// (the last spans several decode splits), then one decode token each.
    fn mla_case(rng: &mut Rng, heads: usize, latent: usize) -> MlaCase {
        mla_case_of(rng, small_heads(heads, latent))
    }

    /// Heads of 24 nope, 8 rope and 40 V values.
    fn small_heads(heads: usize, latent: usize) -> MlaDims {
        MlaDims {
            heads,
            nope: 24,
            rope: 8,
            v: 40,
            latent,
        }
    }

    /// Moonlight-16B-A3B's attention: 16 heads of 128 nope, 64 rope and 128 V values over a
    /// latent of 512.
    fn moonlight_heads() -> MlaDims {
        MlaDims {
            heads: 16,
            nope: 128,
            rope: 64,
            v: 128,
            latent: 512,
        }
    }

    fn mla_case_of(rng: &mut Rng, dims: MlaDims) -> MlaCase {
        let (heads, latent) = (dims.heads, dims.latent);
        let p = MlaParams {
            dims,
            scale: 0.2,
            rope_scale: 1.1,
            interleaved: true,
            eps: 1e-6,
            path: MlaPath::Absorbed,
        };
        let w = latent + dims.rope;
        let inv: Vec<f32> = (0..dims.rope / 2)
            .map(|i| 10000f32.powf(-(2.0 * i as f32) / dims.rope as f32))
            .collect();
        let lens = [1usize, 67, 300];
        let tables: Vec<Vec<u32>> = vec![vec![3], (10..20).rev().collect(), (20..60).collect()];
        let mut steps = Vec::new();
        let mut pre = Batch::default();
        for (l, t) in lens.iter().zip(&tables) {
            pre.push(&vec![1; *l], 0, t.clone(), true);
        }
        let mut dec = Batch::default();
        for (l, t) in lens.iter().zip(&tables) {
            dec.push(&[2], *l, t.clone(), true);
        }
        // then a chunk of 5 tokens a sequence after its cached ones (a prompt's later chunk)
        let mut chunk = Batch::default();
        for (l, t) in lens.iter().zip(&tables) {
            chunk.push(&[3; 5], *l + 1, t.clone(), true);
        }
        for b in [pre, dec, chunk] {
            let n = b.n_tokens();
            let q = rng.vec(n * dims.q_width(), 1.0);
            let kva = rng.vec(n * w, 1.0);
            steps.push((b, q, kva));
        }
        MlaCase {
            p,
            kv_a_norm: Weight::from_f32(1, latent, &rng.vec(latent, 1.0)),
            kv_b: Weight::from_f32(
                heads * (dims.nope + dims.v),
                latent,
                &rng.vec(heads * (dims.nope + dims.v) * latent, 0.3),
            ),
            inv_freq: Weight::from_f32(1, inv.len(), &inv),
            steps,
        }
    }

    /// The case's kv_a norm, kv_b and rotary frequencies prepared for `be`.
    fn prepare_mla<B: Backend>(be: &B, c: &MlaCase) -> [B::Weight; 3] {
        [&c.kv_a_norm, &c.kv_b, &c.inv_freq].map(|w| be.prepare_weight(w).unwrap())
    }

    fn mla_weights<W>(w: &[W; 3]) -> MlaWeights<'_, W> {
        MlaWeights {
            kv_a_norm: &w[0],
            kv_b: &w[1],
            inv_freq: &w[2],
        }
    }

    /// Runs the case's steps on `be`; returns each step's output.
    fn run_mla<B: Backend>(be: &B, c: &MlaCase, path: MlaPath) -> Vec<Vec<f32>> {
        let d = c.p.dims;
        let mut kv = be.new_mla_kv(2, 64, 8, d.latent + d.rope).unwrap();
        let prepared = prepare_mla(be, c);
        let w = mla_weights(&prepared);
        let p = MlaParams { path, ..c.p };
        c.steps
            .iter()
            .map(|(b, q, kva)| {
                let n = b.n_tokens();
                let mut step = be.prepare_step(b, 8).unwrap();
                let mut qb = be.upload(q).unwrap();
                let kb = be.upload(kva).unwrap();
                let mut out = be.zeros(n * d.heads * d.v).unwrap();
                be.mla_attention(&mut step, &mut kv, 1, &p, &w, &mut qb, &kb, &mut out)
                    .unwrap();
                be.to_host(&out).unwrap()
            })
            .collect()
    }

    #[test]
    fn mla_absorbed_kernel_matches_the_cpu_on_random_inputs() {
        for act in [Act::F32, Act::Bf16] {
            let Some(be) = cuda(Some(act)) else { return };
            let old = cuda_opts(Some(act), true, false).expect("a second backend");
            let unfused = cuda_mla(Some(act), true, true, false).expect("a third backend");
            let mut rng = Rng::fresh("mla");
            // 5 heads (a partial head group) and 21 heads (two groups); odd latent widths
            // (the three-launch kernels only); latents of 64 and 32, whose decode steps take
            // the fused kernel (clusters of 8 and 4), and Moonlight's head shape; the ds2
            // kernels (the default), the earlier ones, and the three launches instead of the
            // fused one
            let moon = moonlight_heads();
            let shapes = [
                small_heads(5, 40),
                small_heads(21, 72),
                small_heads(5, 64),
                small_heads(3, 32),
                // a nope of 32 over a latent of 128, 3 heads: the tensor-core kernels' smaller
                // shapes and a partial head group
                MlaDims {
                    heads: 3,
                    nope: 32,
                    rope: 32,
                    v: 48,
                    latent: 128,
                },
                moon,
            ];
            let mma_off = cuda_set(act, |o| o.mla_mma = false);
            let absorb_off = cuda_set(act, |o| o.absorb_mma = false);
            let decode_off = cuda_set(act, |o| o.decode_mma = false);
            // the prompt variant (4 tokens a block) is the default for the prefill's 368 tokens
            // of 3 sequences (its first block spanning two of them); without it, a token a block
            let decode1 = cuda_set(act, |o| o.decode_mma4 = false);
            for dims in shapes {
                let (heads, latent) = (dims.heads, dims.latent);
                let c = mla_case_of(&mut rng, dims);
                let mut cases = vec![(c.clone(), "f32 kv_b")];
                if act == Act::Bf16 {
                    // bf16 kv_b rows too (the prefill's 368 tokens take the V up-projection
                    // on tensor cores, and where the shapes allow the query absorption and the
                    // attention; `mma_off` none of them, `absorb_off` and `decode_off` all but one)
                    let v: Vec<f32> = c
                        .kv_b
                        .bytes()
                        .chunks(4)
                        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                        .collect();
                    let kv_b = bf16_weight(c.kv_b.rows, c.kv_b.cols, &v);
                    cases.push((MlaCase { kv_b, ..c }, "bf16 kv_b"));
                }
                for (c, kvb) in &cases {
                    let cpu = CpuBackend::new(2);
                    let a = run_mla(&cpu, c, MlaPath::Absorbed);
                    let e = run_mla(&cpu, c, MlaPath::Expanded);
                    let tol = if act == Act::F32 { 1e-4 } else { 3e-2 };
                    let absorbed = MlaPath::Absorbed;
                    let mut runs = vec![
                        (&be, absorbed, "ds2"),
                        (&old, absorbed, "earlier kernels"),
                        (&unfused, absorbed, "not fused"),
                        (&mma_off, absorbed, "V up-projection without tensor cores"),
                        (&absorb_off, absorbed, "absorption without tensor cores"),
                        (&decode_off, absorbed, "attention without tensor cores"),
                        (&decode1, absorbed, "attention 1 token a block"),
                        // the model's choice: the expanded form for the bf16 prefill of
                        // Moonlight's heads (every context row new), the absorbed one elsewhere
                        (&be, MlaPath::Auto, "form by cost"),
                    ];
                    if act == Act::Bf16 && *kvb == "bf16 kv_b" && dims.nope == 128 {
                        // the expanded form for every step: the chunk's gathers its cached rows
                        runs.push((&be, MlaPath::Expanded, "expanded form"));
                    }
                    for (b, path, which) in runs {
                        let g = run_mla(b, c, path);
                        for (i, what) in ["prefill", "decode", "chunk"].iter().enumerate() {
                            let width = heads * c.p.dims.v;
                            let (eg, ee) =
                                (max_err(&g[i], &a[i], width), max_err(&g[i], &e[i], width));
                            eprintln!(
                                "{act:?} {which}, {kvb}, {heads} heads, latent {latent}, {what}: CUDA vs CPU absorbed {eg:.2e}, vs CPU expanded {ee:.2e}"
                            );
                            assert!(
                                eg < tol && ee < tol,
                                "{act:?} {which} {kvb} {what}: {eg:e} {ee:e}"
                            );
                        }
                    }
                }
            }
            // the expanded form on CUDA takes DeepSeek-V3's head shape only: asking it of another
            // is an error, not a wrong answer
            let c = mla_case(&mut rng, 3, 16);
            let d = c.p.dims;
            let mut kv = be.new_mla_kv(1, 64, 8, d.latent + d.rope).unwrap();
            let prepared = prepare_mla(&be, &c);
            let w = mla_weights(&prepared);
            let (b, q, kva) = &c.steps[0];
            let mut step = be.prepare_step(b, 8).unwrap();
            let mut qb = be.upload(q).unwrap();
            let kvb = be.upload(kva).unwrap();
            let mut out = be.zeros(b.n_tokens() * d.heads * d.v).unwrap();
            let p = MlaParams {
                path: MlaPath::Expanded,
                ..c.p
            };
            assert!(be
                .mla_attention(&mut step, &mut kv, 0, &p, &w, &mut qb, &kvb, &mut out)
                .is_err());
            // a layer outside the cache is an error too
            let p = c.p;
            assert!(be
                .mla_attention(&mut step, &mut kv, 5, &p, &w, &mut qb, &kvb, &mut out)
                .is_err());
        }
    }

    /// The attention half of a decoder layer as the model queues it, on bf16 weights: the
    /// RMSNorm of the residual stream, the q and kv_a products, the attention, the o product
    /// and the residual add (one decode token of it is a single launch with `fuse_layer`).
    struct AttnHalf<W> {
        gain: W,
        wq: W,
        wkva: W,
        wo: W,
        mla: [W; 3],
    }

    fn prepare_half<B: Backend>(be: &B, w: &AttnHalf<Weight>) -> AttnHalf<B::Weight> {
        let p = |w: &Weight| be.prepare_weight(w).unwrap();
        AttnHalf {
            gain: p(&w.gain),
            wq: p(&w.wq),
            wkva: p(&w.wkva),
            wo: p(&w.wo),
            mla: [p(&w.mla[0]), p(&w.mla[1]), p(&w.mla[2])],
        }
    }

    /// Runs one step of the attention half on `x` (the residual stream, updated); returns
    /// the stream, the normalized input, the o product and the queue ops it flushed.
    #[allow(clippy::too_many_arguments)]
    fn attn_half<B: Backend>(
        be: &B,
        w: &AttnHalf<B::Weight>,
        p: &MlaParams,
        kv: &mut B::MlaKv,
        batch: &Batch,
        x: &[f32],
        hidden: usize,
        ops: &dyn Fn() -> u64,
    ) -> ([Vec<f32>; 3], u64) {
        let d = p.dims;
        let n = batch.n_tokens();
        let before = ops();
        let mut step = be.prepare_step(batch, 8).unwrap();
        let mut xb = be.upload(x).unwrap();
        let mut h = be.zeros(n * hidden).unwrap();
        be.rms_norm(&xb, &w.gain, 1e-6, &mut h).unwrap();
        let mut q = be.zeros(n * d.q_width()).unwrap();
        be.matmul(&w.wq, &h, n, &mut q).unwrap();
        let mut kva = be.zeros(n * (d.latent + d.rope)).unwrap();
        be.matmul(&w.wkva, &h, n, &mut kva).unwrap();
        let mut att = be.zeros(n * d.heads * d.v).unwrap();
        be.mla_attention(
            &mut step,
            kv,
            0,
            p,
            &mla_weights(&w.mla),
            &mut q,
            &kva,
            &mut att,
        )
        .unwrap();
        let mut o = be.zeros(n * hidden).unwrap();
        be.matmul(&w.wo, &att, n, &mut o).unwrap();
        be.add_assign(&mut xb, &o).unwrap();
        let out = [&xb, &h, &o].map(|b| be.to_host(b).unwrap());
        (out, ops() - before)
    }

    #[test]
    fn fused_attention_half_matches_the_separate_launches_and_the_cpu() {
        let Some(fused) = cuda_layer(Some(Act::Bf16), true, true, true, true) else {
            return;
        };
        let apart = cuda_layer(Some(Act::Bf16), true, true, true, false).expect("a second backend");
        // why a step would not take the fused launch, if it does not
        let _ = tracing_subscriber::fmt()
            .with_env_filter("deepinfer::backend::cuda=debug")
            .with_test_writer()
            .try_init();
        let mut rng = Rng::fresh("attn_half");
        let moon = moonlight_heads();
        // Moonlight's attention (clusters of 8); small heads of 5 over a hidden width of 257
        // chunks of 8 (the q / kv_a product folds the norm in from 2,048) and a latent of 32
        // (clusters of 4)
        for (dims, hidden) in [(moon, 2048), (small_heads(5, 32), 2056)] {
            let c = mla_case_of(&mut rng, dims);
            let p = c.p;
            let width = dims.latent + dims.rope;
            let gain: Vec<f32> = rng.vec(hidden, 0.5).iter().map(|g| 1.0 + g).collect();
            let wq = rng.vec(dims.q_width() * hidden, 1.0 / (hidden as f32).sqrt());
            let wkva = rng.vec(width * hidden, 1.0 / (hidden as f32).sqrt());
            let wo = rng.vec(hidden * dims.heads * dims.v, 0.5 / (dims.v as f32).sqrt());
            let kv_b = rng.vec(dims.heads * (dims.nope + dims.v) * dims.latent, 0.1);
            let host = AttnHalf {
                gain: Weight::from_f32(1, hidden, &gain),
                wq: bf16_weight(dims.q_width(), hidden, &wq),
                wkva: bf16_weight(width, hidden, &wkva),
                wo: bf16_weight(hidden, dims.heads * dims.v, &wo),
                mla: [
                    c.kv_a_norm.clone(),
                    bf16_weight(dims.heads * (dims.nope + dims.v), dims.latent, &kv_b),
                    c.inv_freq.clone(),
                ],
            };
            let cpu = CpuBackend::new(2);
            let (wc, wf, wa) = (
                prepare_half(&cpu, &host),
                prepare_half(&fused, &host),
                prepare_half(&apart, &host),
            );
            let mut kvc = cpu.new_mla_kv(1, 64, 8, width).unwrap();
            let mut kvf = fused.new_mla_kv(1, 64, 8, width).unwrap();
            let mut kva = apart.new_mla_kv(1, 64, 8, width).unwrap();
            let table: Vec<u32> = (10..24).rev().collect();
            // a prompt of 67 tokens (the separate launches in both), then 5 decode steps
            let mut steps = vec![(0usize, 67usize)];
            steps.extend((67..72).map(|pos| (pos, 1)));
            let (no_ops, of, oa) = (|| 0, || fused.stats().ops, || apart.stats().ops);
            for (pos, n) in steps {
                let mut b = Batch::default();
                b.push(&vec![1; n], pos, table.clone(), true);
                let x = rng.vec(n * hidden, 1.0);
                let (want, _) = attn_half(&cpu, &wc, &p, &mut kvc, &b, &x, hidden, &no_ops);
                let (got, nf) = attn_half(&fused, &wf, &p, &mut kvf, &b, &x, hidden, &of);
                let (base, na) = attn_half(&apart, &wa, &p, &mut kva, &b, &x, hidden, &oa);
                for (i, what) in ["stream", "normalized input", "o product"]
                    .iter()
                    .enumerate()
                {
                    let (e, ec) = (
                        max_err(&got[i], &base[i], hidden),
                        max_err(&got[i], &want[i], hidden),
                    );
                    eprintln!(
                        "{} heads, hidden {hidden}, {n} tokens at {pos}, {what}: fused vs separate {e:.2e}, vs CPU {ec:.2e} ({nf} against {na} ops)",
                        dims.heads
                    );
                    assert!(
                        e < 3e-2 && ec < 5e-2,
                        "{what}, {n} tokens at {pos}: {e:e} {ec:e}"
                    );
                }
                if n == 1 {
                    // one launch in place of the q / kv_a product, the attention and the o
                    // product (and the add, where the o product could not take it)
                    assert!(
                        nf + 2 <= na,
                        "{n} tokens at {pos}: the fused layer launch ran"
                    );
                } else {
                    assert_eq!(nf, na, "a prompt takes the separate launches");
                }
            }
        }
    }

    /// A bf16 weight of these values (rounded).
    fn bf16_weight(rows: usize, cols: usize, v: &[f32]) -> Weight {
        let bytes = v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect();
        Weight {
            dtype: DType::BF16,
            rows,
            cols,
            data: Bytes::Owned(std::sync::Arc::new(bytes)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn moe_layer<B: Backend>(
        be: &B,
        cfg: &RouterConfig,
        host: &[(Vec<f32>, Vec<f32>, Vec<f32>)],
        gate: &[f32],
        bias: Option<Vec<f32>>,
        shared: Option<&(Vec<f32>, Vec<f32>, Vec<f32>)>,
        d: usize,
        inter: usize,
    ) -> MoeLayer<B::Weight> {
        moe_layer_of(
            be,
            cfg,
            host,
            gate,
            bias,
            shared,
            d,
            inter,
            2,
            Weight::from_f32,
        )
    }

    /// A layer whose expert matrices are made by `make` (rows, cols, values); the shared
    /// experts are `shared_mult` experts wide.
    #[allow(clippy::too_many_arguments)]
    fn moe_layer_of<B: Backend>(
        be: &B,
        cfg: &RouterConfig,
        host: &[(Vec<f32>, Vec<f32>, Vec<f32>)],
        gate: &[f32],
        bias: Option<Vec<f32>>,
        shared: Option<&(Vec<f32>, Vec<f32>, Vec<f32>)>,
        d: usize,
        inter: usize,
        shared_mult: usize,
        make: fn(usize, usize, &[f32]) -> Weight,
    ) -> MoeLayer<B::Weight> {
        let mlp = |m: &(Vec<f32>, Vec<f32>, Vec<f32>), w: usize| Mlp {
            gate: be.prepare_weight(&make(w, d, &m.0)).unwrap(),
            up: be.prepare_weight(&make(w, d, &m.1)).unwrap(),
            down: be.prepare_weight(&make(d, w, &m.2)).unwrap(),
            inter: w,
        };
        MoeLayer::new(
            cfg.clone(),
            Router::Learned {
                gate: be
                    .prepare_weight(&Weight::from_f32(cfg.n_experts, d, gate))
                    .unwrap(),
                bias,
            },
            host.iter().map(|m| mlp(m, inter)).collect(),
            shared.map(|m| mlp(m, shared_mult * inter)),
        )
        .unwrap()
    }

    /// Random matrices of a MoE layer: `e` experts of `inter` rows over `d` and shared experts
    /// `shared_mult` times as wide (values of scale 0.2), the router gate and its bias.
    struct MoeHost {
        experts: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>,
        shared: (Vec<f32>, Vec<f32>, Vec<f32>),
        gate: Vec<f32>,
        bias: Option<Vec<f32>>,
    }

    fn random_moe(rng: &mut Rng, e: usize, d: usize, inter: usize, shared_mult: usize) -> MoeHost {
        let mut mlp = |w: usize| {
            (
                rng.vec(w * d, 0.2),
                rng.vec(w * d, 0.2),
                rng.vec(d * w, 0.2),
            )
        };
        let experts = (0..e).map(|_| mlp(inter)).collect();
        let shared = mlp(shared_mult * inter);
        MoeHost {
            experts,
            shared,
            gate: rng.vec(e * d, 0.3),
            bias: Some(rng.vec(e, 0.1)),
        }
    }

    impl MoeHost {
        /// The layer on `be`, its expert matrices in bf16 (no shared experts when
        /// `shared_mult` is 0).
        fn bf16_layer<B: Backend>(
            &self,
            be: &B,
            cfg: &RouterConfig,
            d: usize,
            inter: usize,
            shared_mult: usize,
        ) -> MoeLayer<B::Weight> {
            moe_layer_of(
                be,
                cfg,
                &self.experts,
                &self.gate,
                self.bias.clone(),
                (shared_mult > 0).then_some(&self.shared),
                d,
                inter,
                shared_mult,
                bf16_weight,
            )
        }

        /// [`Self::bf16_layer`] and the norm's `gain` before it, on `be`.
        fn bf16_layer_gain<B: Backend>(
            &self,
            be: &B,
            cfg: &RouterConfig,
            (d, inter, shared_mult): (usize, usize, usize),
            gain: &[f32],
        ) -> (MoeLayer<B::Weight>, B::Weight) {
            let g = be.prepare_weight(&Weight::from_f32(1, d, gain)).unwrap();
            (self.bf16_layer(be, cfg, d, inter, shared_mult), g)
        }
    }

    /// Sigmoid routing without a group limit, normalized and scaled.
    fn sigmoid_router(n_experts: usize, top_k: usize, scaling: f32) -> RouterConfig {
        RouterConfig {
            n_experts,
            top_k,
            score: ScoreFunc::Sigmoid,
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: true,
            scaling,
        }
    }

    #[test]
    fn moe_routing_and_grouped_experts_match_the_cpu_on_random_inputs() {
        let Some(be) = cuda(Some(Act::F32)) else {
            return;
        };
        // the routing of 8 tokens a block from 9 tokens on, and the plan of one block for all
        // experts (`moe_many` off): the same results as the default's bit for bit
        let many = cuda_set(Act::F32, |o| o.route8_min = 9);
        let few = cuda_set(Act::F32, |o| o.moe_many = false);
        let mut rng = Rng::fresh("moe");
        let (d, inter, e) = (40, 24, 12);
        for (score, n_group, topk_group, top_k, norm) in [
            (ScoreFunc::Sigmoid, 4, 2, 3, true),
            (ScoreFunc::Sigmoid, 1, 1, 5, false),
            (ScoreFunc::Softmax, 3, 1, 2, false),
            (ScoreFunc::SqrtSoftplus, 2, 1, 4, true),
        ] {
            let cfg = RouterConfig {
                n_experts: e,
                top_k,
                score,
                n_group,
                topk_group,
                norm_topk_prob: norm,
                scaling: 1.7,
            };
            let experts: Vec<_> = (0..e)
                .map(|_| {
                    (
                        rng.vec(inter * d, 0.3),
                        rng.vec(inter * d, 0.3),
                        rng.vec(d * inter, 0.3),
                    )
                })
                .collect();
            let shared = (
                rng.vec(2 * inter * d, 0.3),
                rng.vec(2 * inter * d, 0.3),
                rng.vec(d * 2 * inter, 0.3),
            );
            let gate = rng.vec(e * d, 0.5);
            let bias = (score == ScoreFunc::Sigmoid).then(|| rng.vec(e, 0.1));
            let cpu = CpuBackend::new(2);
            let layer = |b| {
                moe_layer(
                    b,
                    &cfg,
                    &experts,
                    &gate,
                    bias.clone(),
                    Some(&shared),
                    d,
                    inter,
                )
            };
            let (lg, lm, lf) = (layer(&be), layer(&many), layer(&few));
            let lc = moe_layer(&cpu, &cfg, &experts, &gate, bias, Some(&shared), d, inter);
            for n in [1usize, 2, 5, 8, 37, 100] {
                let x = rng.vec(n * d, 1.0);
                let tokens = vec![0u32; n];
                let xg = be.upload(&x).unwrap();
                let mut og = be.zeros(n * d).unwrap();
                be.moe(&lg, &xg, &tokens, n, d, &mut og).unwrap();
                let got = be.to_host(&og).unwrap();
                let mut want = vec![0.0; n * d];
                cpu.moe(&lc, &x, &tokens, n, d, &mut want).unwrap();
                let err = max_err(&got, &want, d);
                eprintln!(
                    "{score:?} groups {n_group}/{topk_group} top {top_k}, {n} tokens: {err:.2e}"
                );
                assert!(err < 1e-4, "{score:?} {n} tokens: {err:e}");
                let (a, b) = (be.expert_load(&lg).unwrap(), cpu.expert_load(&lc).unwrap());
                assert_eq!(a.last_step, b.last_step, "last step's tokens per expert");
                assert_eq!(a.total, b.total);
                assert_eq!(a.last_step.iter().sum::<u64>(), (n * top_k) as u64);
                for (b, l, what) in [
                    (&many, &lm, "8 tokens a block"),
                    (&few, &lf, "one-block plan"),
                ] {
                    let xb = b.upload(&x).unwrap();
                    let mut o = b.zeros(n * d).unwrap();
                    b.moe(l, &xb, &tokens, n, d, &mut o).unwrap();
                    assert!(b.to_host(&o).unwrap() == got, "{what}: {n} tokens differ");
                    assert_eq!(b.expert_load(l).unwrap().last_step, a.last_step, "{what}");
                }
            }
        }
    }

    /// Steps past the decode kernels' 8 tokens: the grouped expert products on tensor cores
    /// (bf16) against the one-warp-a-row kernels and the CPU, with rows that are not a multiple
    /// of the kernels' 16-row tiles, row lengths that are not a multiple of their 32-wide k
    /// steps, and experts with more assignments than one group of 32 takes.
    #[test]
    fn moe_grouped_experts_on_tensor_cores_match_the_warp_kernels_and_the_cpu() {
        let Some(mma) = cuda(Some(Act::Bf16)) else {
            return;
        };
        let warp = cuda_set(Act::Bf16, |o| o.moe_mma = false);
        let rowmma = cuda_set(Act::Bf16, |o| o.moe_gemm = false);
        // the tiled GEMMs on mma.sync where the default takes them on warpgroup MMA
        let tiled = cuda_set(Act::Bf16, |o| o.moe_wg = false);
        if mma.has_wgmma() {
            eprintln!("the default's tiled GEMMs run on warpgroup MMA (sm_90a image)");
        } else {
            eprintln!("no sm_90a image: the default's tiled GEMMs run on mma.sync, as `tiled`");
        }
        let cpu = CpuBackend::new(2);
        let mut rng = Rng::fresh("moe_mma");
        // the last two shapes' steps of 4 assignments an expert or more (rows of whole 64-value
        // stages) take the tiled GEMMs, the last with partial row tiles; `rowmma` never does;
        // 600 tokens give experts more than one tile of 128 assignments
        for (d, inter, e, top_k) in [(200, 72, 12, 5), (256, 128, 8, 2), (320, 192, 8, 2)] {
            let cfg = sigmoid_router(e, top_k, 2.0);
            let host = random_moe(&mut rng, e, d, inter, 2);
            let lm = host.bf16_layer(&mma, &cfg, d, inter, 2);
            let lw = host.bf16_layer(&warp, &cfg, d, inter, 2);
            let lr = host.bf16_layer(&rowmma, &cfg, d, inter, 2);
            let lt = host.bf16_layer(&tiled, &cfg, d, inter, 2);
            let lc = host.bf16_layer(&cpu, &cfg, d, inter, 2);
            for n in [9usize, 24, 70, 150, 300, 600] {
                // bf16 inputs, so every backend multiplies the same values
                let x: Vec<f32> = rng
                    .vec(n * d, 1.0)
                    .iter()
                    .map(|v| half::bf16::from_f32(*v).to_f32())
                    .collect();
                let tokens = vec![0u32; n];
                let run = |b: &CudaBackend, l: &MoeLayer<<CudaBackend as Backend>::Weight>| {
                    let xg = b.upload(&x).unwrap();
                    let mut o = b.zeros(n * d).unwrap();
                    b.moe(l, &xg, &tokens, n, d, &mut o).unwrap();
                    b.to_host(&o).unwrap()
                };
                let (got, want) = (run(&mma, &lm), run(&warp, &lw));
                let rows = run(&rowmma, &lr);
                let tile = run(&tiled, &lt);
                let mut host = vec![0.0; n * d];
                cpu.moe(&lc, &x, &tokens, n, d, &mut host).unwrap();
                let (ew, ec) = (max_err(&got, &want, d), max_err(&got, &host, d));
                let (er, et) = (max_err(&got, &rows, d), max_err(&got, &tile, d));
                eprintln!(
                    "d {d}, inter {inter}, {e} experts top {top_k}, {n} tokens: tensor cores vs one warp a row {ew:.2e}, vs the CPU {ec:.2e}, vs the row-streaming products {er:.2e}, vs the mma.sync GEMMs {et:.2e} (one warp a row vs the CPU {:.2e})",
                    max_err(&want, &host, d)
                );
                assert!(
                    ew < 2e-2 && ec < 3e-2 && er < 2e-2 && et < 2e-2,
                    "{n} tokens: {ew:e} {ec:e} {er:e} {et:e}"
                );
                // the same routing kernel on both devices' backends (the CPU's routing can
                // differ on a near tie of bf16 inputs; its outputs are checked above)
                let (a, b) = (
                    mma.expert_load(&lm).unwrap(),
                    warp.expert_load(&lw).unwrap(),
                );
                assert_eq!(a.last_step, b.last_step, "tokens per expert");
                assert_eq!(a.last_step.iter().sum::<u64>(), (n * top_k) as u64);
                // more assignments than 32 a selected expert: some expert takes two groups
                assert!(
                    n * top_k <= 32 * e || a.last_step.iter().any(|&t| t > 32),
                    "an expert with more than one group of assignments: {:?}",
                    a.last_step
                );
            }
        }
    }

    /// One decode-sized MoE block as the model queues it: RMSNorm of the residual, the layer,
    /// the residual add (on CUDA the decode kernels fold the norm and the add in).
    #[allow(clippy::too_many_arguments)]
    fn moe_block<B: Backend>(
        be: &B,
        layer: &MoeLayer<B::Weight>,
        gain: &B::Weight,
        raw: &[f32],
        res: &[f32],
        n: usize,
        d: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let x = be.upload(raw).unwrap();
        let mut r = be.upload(res).unwrap();
        let mut h = be.zeros(n * d).unwrap();
        be.rms_norm(&x, gain, 1e-6, &mut h).unwrap();
        let mut f = be.zeros(n * d).unwrap();
        be.moe(layer, &h, &vec![0; n], n, d, &mut f).unwrap();
        be.add_assign(&mut r, &f).unwrap();
        (be.to_host(&r).unwrap(), be.to_host(&f).unwrap())
    }

    /// The products around a MoE layer in a decoder layer's second half: the attention's o
    /// product (`ko` columns), then the next layer's RMSNorm gain and its q and kv_a products
    /// (`mq`, `mk` rows), random.
    struct NextCase {
        vo: Vec<f32>,
        gain: Vec<f32>,
        vq: Vec<f32>,
        vk: Vec<f32>,
        mq: usize,
        mk: usize,
        ko: usize,
        d: usize,
    }

    impl NextCase {
        fn random(rng: &mut Rng, d: usize, (mq, mk, ko): (usize, usize, usize)) -> NextCase {
            let gain = rng.vec(d, 0.5).iter().map(|g| 1.0 + g).collect();
            let (vq, vk) = (rng.vec(mq * d, 0.05), rng.vec(mk * d, 0.05));
            let vo = rng.vec(d * ko, 0.05);
            NextCase {
                vo,
                gain,
                vq,
                vk,
                mq,
                mk,
                ko,
                d,
            }
        }

        /// The products' weights on `b` (o, gain, q, kv_a), bf16.
        fn weights<B: Backend>(&self, b: &B) -> [B::Weight; 4] {
            let d = self.d;
            [
                b.prepare_weight(&bf16_weight(d, self.ko, &self.vo))
                    .unwrap(),
                b.prepare_weight(&Weight::from_f32(1, d, &self.gain))
                    .unwrap(),
                b.prepare_weight(&bf16_weight(self.mq, d, &self.vq))
                    .unwrap(),
                b.prepare_weight(&bf16_weight(self.mk, d, &self.vk))
                    .unwrap(),
            ]
        }

        /// The second half as it queues its work: the o product of `att` added into the
        /// residual stream `res`, the RMSNorm of the stream, the MoE layer and its add, then the
        /// next layer's RMSNorm of the stream and its two products (q and kv_a): (residual, q,
        /// kv_a, normalized row, o product).
        fn run<B: Backend>(
            &self,
            be: &B,
            layer: &MoeLayer<B::Weight>,
            gain: &B::Weight,
            [wo, gain2, wq, wk]: &[B::Weight; 4],
            att: &[f32],
            res: &[f32],
        ) -> [Vec<f32>; 5] {
            let d = self.d;
            let a = be.upload(att).unwrap();
            let mut r = be.upload(res).unwrap();
            let mut o = be.zeros(d).unwrap();
            be.matmul(wo, &a, 1, &mut o).unwrap();
            be.add_assign(&mut r, &o).unwrap();
            let mut h = be.zeros(d).unwrap();
            be.rms_norm(&r, gain, 1e-6, &mut h).unwrap();
            let mut f = be.zeros(d).unwrap();
            be.moe(layer, &h, &[0], 1, d, &mut f).unwrap();
            be.add_assign(&mut r, &f).unwrap();
            let mut h2 = be.zeros(d).unwrap();
            be.rms_norm(&r, gain2, 1e-6, &mut h2).unwrap();
            let mut q = be.zeros(self.mq).unwrap();
            be.matmul(wq, &h2, 1, &mut q).unwrap();
            let mut kv = be.zeros(self.mk).unwrap();
            be.matmul(wk, &h2, 1, &mut kv).unwrap();
            [
                be.to_host(&r).unwrap(),
                be.to_host(&q).unwrap(),
                be.to_host(&kv).unwrap(),
                be.to_host(&h2).unwrap(),
                be.to_host(&o).unwrap(),
            ]
        }
    }

    /// What [`NextCase::run`] returns, by name.
    const NEXT_OUTPUTS: [&str; 5] = ["residual", "q", "kv_a", "normalized row", "o product"];

    #[test]
    fn moe_decode_kernels_with_bf16_experts_fold_the_norm_and_the_add() {
        let Some(be) = cuda(Some(Act::F32)) else {
            return;
        };
        let bf = cuda(Some(Act::Bf16)).expect("a second backend");
        let bf_plain = cuda_with(Some(Act::Bf16), false).expect("a third backend");
        let bf_old = cuda_opts(Some(Act::Bf16), true, false).expect("a fourth backend");
        let mut rng = Rng::fresh("moe_decode");
        // odd widths: 33 chunks of 8 per row, 5 per expert row, 3 shared slots
        let (d, inter, e) = (264, 40, 20);
        let cfg = sigmoid_router(e, 6, 2.4);
        let host = random_moe(&mut rng, e, d, inter, 3);
        let gain: Vec<f32> = rng.vec(d, 0.5).iter().map(|g| 1.0 + g).collect();
        let cpu = CpuBackend::new(2);
        let (lc, gc) = host.bf16_layer_gain(&cpu, &cfg, (d, inter, 3), &gain);
        let gpu: Vec<_> = [&be, &bf, &bf_plain, &bf_old]
            .into_iter()
            .map(|b| host.bf16_layer_gain(b, &cfg, (d, inter, 3), &gain))
            .collect();
        for n in [1usize, 3, 8] {
            let raw = rng.vec(n * d, 1.0);
            let res = rng.vec(n * d, 1.0);
            let (want, want_f) = moe_block(&cpu, &lc, &gc, &raw, &res, n, d);
            // f32 activations: against the CPU
            let (got, got_f) = moe_block(&be, &gpu[0].0, &gpu[0].1, &raw, &res, n, d);
            let (err, err_f) = (max_err(&got, &want, d), max_err(&got_f, &want_f, d));
            eprintln!("bf16 experts, f32 activations, {n} tokens: {err:.2e} (layer {err_f:.2e})");
            assert!(err < 1e-4 && err_f < 1e-4, "{n} tokens: {err:e} {err_f:e}");
            let (a, c) = (
                be.expert_load(&gpu[0].0).unwrap(),
                cpu.expert_load(&lc).unwrap(),
            );
            assert_eq!(a.last_step, c.last_step, "tokens per expert");
            assert_eq!(a.total, c.total);
            // bf16 activations: the decode kernels against the general ones
            let (got, got_f) = moe_block(&bf, &gpu[1].0, &gpu[1].1, &raw, &res, n, d);
            let (plain, plain_f) = moe_block(&bf_plain, &gpu[2].0, &gpu[2].1, &raw, &res, n, d);
            let (err, err_f) = (max_err(&got, &plain, d), max_err(&got_f, &plain_f, d));
            eprintln!("bf16 activations, {n} tokens, fused vs not: {err:.2e} (layer {err_f:.2e}); vs the CPU {:.2e}", max_err(&got, &want, d));
            assert!(err < 3e-2 && err_f < 3e-2, "{n} tokens: {err:e} {err_f:e}");
            assert_eq!(
                bf.expert_load(&gpu[1].0).unwrap().last_step,
                bf_plain.expert_load(&gpu[2].0).unwrap().last_step
            );
            // the ds2 routing and down kernels only load earlier: the same bits
            let (old, old_f) = moe_block(&bf_old, &gpu[3].0, &gpu[3].1, &raw, &res, n, d);
            assert!(
                old == got && old_f == got_f,
                "{n} tokens: ds2 vs earlier kernels differ"
            );
            assert_eq!(
                bf.expert_load(&gpu[1].0).unwrap().total,
                bf_old.expert_load(&gpu[3].0).unwrap().total
            );
        }
    }

    /// A backend running `moe_ffn1` with `set`'s options and one taking the three decode
    /// launches; `None`, with a note, where this device or process runs no `moe_ffn1`.
    fn ffn1_pair(set: impl FnOnce(&mut CudaOptions)) -> Option<(CudaBackend, CudaBackend)> {
        cuda(Some(Act::Bf16))?;
        let one = cuda_set(Act::Bf16, |o| {
            o.moe_ffn1 = true;
            set(o);
        });
        if !one.runs_moe_ffn1() {
            eprintln!(
                "skipped: this backend does not run moe_ffn1 (a device below sm_90, no block an \
                 SM fits, or another backend of this process runs it)"
            );
            return None;
        }
        Some((one, cuda_set(Act::Bf16, |o| o.moe_ffn1 = false)))
    }

    #[test]
    fn one_launch_moe_layer_equals_the_three_decode_launches() {
        // (the products before and after the layer folded in whatever the defaults)
        let Some((one, bf)) = ffn1_pair(|o| {
            o.ffn1_prev = true;
            o.ffn1_next = true;
        }) else {
            return;
        };
        assert!(!bf.runs_moe_ffn1());
        let cpu = CpuBackend::new(2);
        let mut rng = Rng::fresh("moe_ffn1");
        // (hidden, expert width, experts, top k, shared slots): odd chunk counts; Moonlight's
        // hidden width and expert count; a wide expert row (176 chunks of 8)
        for (d, inter, e, k, sh) in [
            (264, 40, 20, 6, 3),
            (2048, 64, 64, 6, 2),
            (512, 1408, 8, 2, 1),
        ] {
            let cfg = sigmoid_router(e, k, 2.4);
            let host = random_moe(&mut rng, e, d, inter, sh);
            let gain: Vec<f32> = rng.vec(d, 0.5).iter().map(|g| 1.0 + g).collect();
            let (lc, gc) = host.bf16_layer_gain(&cpu, &cfg, (d, inter, sh), &gain);
            let (l3, g3) = host.bf16_layer_gain(&bf, &cfg, (d, inter, sh), &gain);
            let (l1, g1) = host.bf16_layer_gain(&one, &cfg, (d, inter, sh), &gain);
            // several steps: each launch must find its counters zeroed by the one before
            for step in 0..4 {
                let raw = rng.vec(d, 1.0);
                let res = rng.vec(d, 1.0);
                let (want, _) = moe_block(&cpu, &lc, &gc, &raw, &res, 1, d);
                let (three, three_f) = moe_block(&bf, &l3, &g3, &raw, &res, 1, d);
                let (got, got_f) = moe_block(&one, &l1, &g1, &raw, &res, 1, d);
                let diff = max_err(&got_f, &three_f, d);
                eprintln!(
                    "d {d}, inter {inter}, {e} experts top {k}, {sh} shared slots, step {step}: one launch vs three {diff:.2e}, vs the CPU {:.2e}",
                    max_err(&got, &want, d)
                );
                assert!(
                    got == three && got_f == three_f,
                    "step {step}: the one-launch layer differs from the three launches ({diff:e})"
                );
                let (a, c) = (bf.expert_load(&l3).unwrap(), one.expert_load(&l1).unwrap());
                assert_eq!(a.last_step, c.last_step, "tokens per expert");
                assert_eq!(a.total, c.total);
            }
            if d != 2048 {
                continue;
            }
            // The attention's o product and its residual add before the layer and the next
            // layer's norm and q / kv_a product after it (one-token bf16 products over rows of
            // 2048 take the staged GEMV, which the one launch takes in): Moonlight's rows, then
            // odd row counts (a block's last unit of one row) after an o product over rows of
            // 1032, which the staged GEMV does not take, so it stays a launch of its own
            for shape in [(3072, 576, 2048), (201, 75, 1032)] {
                let case = NextCase::random(&mut rng, d, shape);
                let (mq, mk, ko) = shape;
                let (n3, n1) = (case.weights(&bf), case.weights(&one));
                for step in 0..3 {
                    let att = rng.vec(ko, 1.0);
                    let res = rng.vec(d, 1.0);
                    let before = one.stats();
                    let three = case.run(&bf, &l3, &g3, &n3, &att, &res);
                    let got = case.run(&one, &l1, &g1, &n1, &att, &res);
                    let after = one.stats();
                    let prev = after.ffn1_prev_folds - before.ffn1_prev_folds;
                    let next = after.ffn1_next_folds - before.ffn1_next_folds;
                    let names = NEXT_OUTPUTS;
                    let errs: Vec<f64> = (0..names.len())
                        .map(|i| max_err(&got[i], &three[i], d))
                        .collect();
                    eprintln!(
                        "o {d} x {ko}, next product {mq} + {mk} rows, step {step}: folded {prev} before, {next} after; residual / q / kv_a / norm / o vs the separate launches {:.2e} / {:.2e} / {:.2e} / {:.2e} / {:.2e}",
                        errs[0], errs[1], errs[2], errs[3], errs[4]
                    );
                    assert_eq!(
                        prev,
                        u64::from(one.folds_ffn1_prev() && ko == 2048),
                        "the o product's fold"
                    );
                    assert_eq!(
                        next,
                        u64::from(one.folds_ffn1_next()),
                        "the next product was not folded"
                    );
                    for (i, what) in names.iter().enumerate() {
                        assert!(
                            got[i] == three[i],
                            "step {step}: the {what} differs ({:e})",
                            errs[i]
                        );
                    }
                }
            }
        }
    }

    /// `CudaOptions::ffn1_blocks`: `moe_ffn1` on fewer blocks than SMs (64, so every shape's
    /// units are dealt out otherwise than on one block an SM) gives the three launches' outputs
    /// to the bit: no sum's order depends on the grid.
    #[test]
    fn one_launch_moe_layer_on_fewer_blocks_equals_the_three_decode_launches() {
        let Some((one, bf)) = ffn1_pair(|o| {
            o.ffn1_prev = false;
            o.ffn1_next = false;
            o.ffn1_blocks = 64;
        }) else {
            return;
        };
        let mut rng = Rng::fresh("moe_ffn1_blocks");
        for (d, inter, e, k, sh) in [(264, 40, 20, 6, 3), (2048, 1408, 64, 6, 2)] {
            let cfg = sigmoid_router(e, k, 2.4);
            let host = random_moe(&mut rng, e, d, inter, sh);
            let gain: Vec<f32> = rng.vec(d, 0.5).iter().map(|g| 1.0 + g).collect();
            let (l3, g3) = host.bf16_layer_gain(&bf, &cfg, (d, inter, sh), &gain);
            let (l1, g1) = host.bf16_layer_gain(&one, &cfg, (d, inter, sh), &gain);
            for step in 0..3 {
                let raw = rng.vec(d, 1.0);
                let res = rng.vec(d, 1.0);
                let before = one.stats().ffn1_launches;
                let (three, three_f) = moe_block(&bf, &l3, &g3, &raw, &res, 1, d);
                let (got, got_f) = moe_block(&one, &l1, &g1, &raw, &res, 1, d);
                let stats = one.stats();
                assert_eq!(stats.ffn1_launches - before, 1, "moe_ffn1 did not run");
                assert_eq!(stats.ffn1_blocks, 64, "moe_ffn1's grid");
                assert!(
                    got == three && got_f == three_f,
                    "d {d}, inter {inter}, {e} experts, step {step}: 64 blocks differ from the three launches ({:e})",
                    max_err(&got_f, &three_f, d)
                );
            }
        }
    }

    /// `CudaOptions::ffn1_next_l2`: a `moe_ffn1` launch followed by the next layer's staged
    /// q/kv_a product is given that product's weights to ask into L2, and every output stays
    /// the separate launches' to the bit.
    #[test]
    fn one_launch_moe_layer_asking_the_next_rows_into_l2_keeps_its_outputs() {
        let Some((one, bf)) = ffn1_pair(|o| {
            o.ffn1_prev = false;
            o.ffn1_next = false;
            o.ffn1_next_l2 = true;
        }) else {
            return;
        };
        let mut rng = Rng::fresh("moe_ffn1_l2");
        let (d, inter, e, k, sh) = (2048, 64, 64, 6, 2);
        let cfg = sigmoid_router(e, k, 2.4);
        let host = random_moe(&mut rng, e, d, inter, sh);
        let gain: Vec<f32> = rng.vec(d, 0.5).iter().map(|g| 1.0 + g).collect();
        let (l3, g3) = host.bf16_layer_gain(&bf, &cfg, (d, inter, sh), &gain);
        let (l1, g1) = host.bf16_layer_gain(&one, &cfg, (d, inter, sh), &gain);
        let case = NextCase::random(&mut rng, d, (3072, 576, 2048));
        let (n3, n1) = (case.weights(&bf), case.weights(&one));
        for step in 0..3 {
            let att = rng.vec(d, 1.0);
            let res = rng.vec(d, 1.0);
            let before = one.stats().l2_links;
            let three = case.run(&bf, &l3, &g3, &n3, &att, &res);
            let got = case.run(&one, &l1, &g1, &n1, &att, &res);
            let links = one.stats().l2_links - before;
            eprintln!("step {step}: {links} launch(es) given the next rows to ask into L2");
            assert_eq!(links, 1, "the moe_ffn1 launch was not given the next rows");
            for (i, what) in NEXT_OUTPUTS.iter().enumerate() {
                assert!(
                    got[i] == three[i],
                    "step {step}: the {what} differs ({:e})",
                    max_err(&got[i], &three[i], d)
                );
            }
        }
    }

    #[test]
    fn split_k_moe_layer_matches_the_three_decode_launches() {
        if cuda(Some(Act::Bf16)).is_none() {
            return;
        }
        let fk = cuda_set(Act::Bf16, |o| {
            o.moe_ffn1 = true;
            o.moe_splitk = true;
        });
        if !fk.runs_moe_ffn1() {
            eprintln!(
                "skipped: this backend does not run moe_ffn1 or moe_fk1 (a device below sm_90, no \
                 block an SM fits, or another backend of this process runs it)"
            );
            return;
        }
        let bf = cuda_set(Act::Bf16, |o| o.moe_ffn1 = false);
        let cpu = CpuBackend::new(2);
        let mut rng = Rng::fresh("moe_fk1");
        // the shapes of the one-launch test: odd chunk counts, Moonlight's hidden width and
        // expert count, a wide expert row; and one without shared experts
        for (d, inter, e, k, sh) in [
            (264, 40, 20, 6, 3),
            (2048, 64, 64, 6, 2),
            (512, 1408, 8, 2, 1),
            (256, 48, 16, 4, 0),
        ] {
            let cfg = sigmoid_router(e, k, 2.4);
            let host = random_moe(&mut rng, e, d, inter, sh.max(1));
            let gain: Vec<f32> = rng.vec(d, 0.5).iter().map(|g| 1.0 + g).collect();
            let (lc, gc) = host.bf16_layer_gain(&cpu, &cfg, (d, inter, sh), &gain);
            let (l3, g3) = host.bf16_layer_gain(&bf, &cfg, (d, inter, sh), &gain);
            let (l1, g1) = host.bf16_layer_gain(&fk, &cfg, (d, inter, sh), &gain);
            // several steps: each launch must find its counters zeroed by the one before
            let mut first = None;
            for step in 0..4 {
                let raw = rng.vec(d, 1.0);
                let res = rng.vec(d, 1.0);
                let (_, want_f) = moe_block(&cpu, &lc, &gc, &raw, &res, 1, d);
                let (three, three_f) = moe_block(&bf, &l3, &g3, &raw, &res, 1, d);
                let before = fk.stats().fk1_launches;
                let (got, got_f) = moe_block(&fk, &l1, &g1, &raw, &res, 1, d);
                assert_eq!(fk.stats().fk1_launches, before + 1, "moe_fk1 did not run");
                let (err, err_f) = (max_err(&got, &three, d), max_err(&got_f, &three_f, d));
                let (cpu_err, three_cpu) =
                    (max_err(&got_f, &want_f, d), max_err(&three_f, &want_f, d));
                eprintln!(
                    "d {d}, inter {inter}, {e} experts top {k}, {sh} shared slots, step {step}: split-k vs three launches {err:.2e} (layer {err_f:.2e}); layer vs the CPU {cpu_err:.2e} (three launches {three_cpu:.2e})"
                );
                assert!(err < 3e-2 && err_f < 3e-2, "step {step}: {err:e} {err_f:e}");
                assert!(
                    cpu_err < 2.0 * three_cpu + 1e-2,
                    "step {step}: {cpu_err:e} from the CPU against {three_cpu:e}"
                );
                let (a, c) = (bf.expert_load(&l3).unwrap(), fk.expert_load(&l1).unwrap());
                assert_eq!(a.last_step, c.last_step, "tokens per expert");
                assert_eq!(a.total, c.total);
                // the same input gives the same bits again (the sums' order is fixed)
                if step == 0 {
                    first = Some((raw, res, got, got_f));
                }
            }
            if d == 2048 {
                // followed by the next layer's norm and q/kv_a product, whose rows the launch
                // asks into L2 at its end: the same results as without
                let case = NextCase::random(&mut rng, d, (3072, 576, d));
                let (n3, n1) = (case.weights(&bf), case.weights(&fk));
                let att = rng.vec(d, 1.0);
                let res = rng.vec(d, 1.0);
                let three = case.run(&bf, &l3, &g3, &n3, &att, &res);
                let got = case.run(&fk, &l1, &g1, &n1, &att, &res);
                for (i, what) in NEXT_OUTPUTS.iter().enumerate() {
                    let err = max_err(&got[i], &three[i], d);
                    eprintln!("next product after moe_fk1: {what} vs the three launches {err:.2e}");
                    assert!(err < 3e-2, "the {what} differs ({err:e})");
                }
            }
            let (raw, res, got, got_f) = first.unwrap();
            let again = moe_block(&fk, &l1, &g1, &raw, &res, 1, d);
            assert!(
                again.0 == got && again.1 == got_f,
                "moe_fk1 is not deterministic"
            );
        }
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_deepseek_tests_skipped_without_the_cuda_feature() {
    eprintln!("skipped: built without `--features cuda`");
}
