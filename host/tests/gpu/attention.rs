//! Rotary embeddings and paged attention through the same trait calls on the CPU and CUDA
//! backends: scattered block tables, grouped-query heads (groups of 1 to 16), sliding windows,
//! several sequences per step, prefill (the tensor-core kernel), chunked prefill mixed with
//! decode, and split-KV decode over long contexts; every prefill kernel on odd shapes
//! (query counts off the 64/128-row tiles, prefixes already cached, GQA groups of 1, 4 and 8),
//! and a timing of them at Llama-3-8B's shape (ignored by default).

use deepinfer::backend::cpu::CpuBackend;
use deepinfer::backend::cuda::{Act, CudaBackend, CudaOptions, PrefillKernel};
use deepinfer::backend::{AttnParams, Backend, KvShape};
use deepinfer::model::batch::Batch;
use deepinfer::model::hparams::{RopeSpec, RopeStyle};

use super::util::{assert_close, backend, tol, upload, Rng};

/// (pos, len) of each sequence, per step.
type Plan = Vec<Vec<(usize, usize)>>;

/// Runs `plan` through one backend: per step, random Q/K/V (drawn in `data` order) go in,
/// the attention output comes out.
fn run<B: Backend>(
    be: &B,
    p: &AttnParams,
    bs: usize,
    tables: &[Vec<u32>],
    plan: &Plan,
    data: &[Vec<f32>],
) -> Vec<Vec<f32>> {
    let blocks = tables.iter().flatten().max().map_or(1, |&b| b as usize + 1);
    let mut kv = be
        .new_kv(KvShape {
            layers: 2,
            num_blocks: blocks,
            block_size: bs,
            kv_heads: p.n_kv_heads,
            head_dim: p.head_dim,
        })
        .unwrap();
    let (qw, kw) = (p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim);
    let mut outs = Vec::new();
    for (si, step) in plan.iter().enumerate() {
        let mut b = Batch::default();
        for (s, &(pos, len)) in step.iter().enumerate() {
            b.push(&vec![0; len], pos, tables[s].clone(), true);
        }
        let n = b.n_tokens();
        let st = be.prepare_step(&b, bs).unwrap();
        let d = &data[si];
        let q = upload(be, n, qw, &d[..n * qw]);
        let k = upload(be, n, kw, &d[n * qw..n * (qw + kw)]);
        let v = upload(be, n, kw, &d[n * (qw + kw)..n * (qw + 2 * kw)]);
        let mut out = be.zeros(n * qw).unwrap();
        be.attention(&st, &mut kv, 1, p, &q, &k, &v, &mut out)
            .unwrap();
        outs.push(be.to_host(&out).unwrap());
    }
    outs
}

#[test]
fn paged_attention_matches_the_cpu_backend() {
    let mut rng = Rng::fresh("attention");
    let cpu = CpuBackend::new(2);
    // (heads, kv heads, head dim, window, block size)
    let shapes = [
        (8usize, 2usize, 64usize, None, 16usize),
        (12, 4, 128, Some(24), 16),
        (4, 1, 16, None, 4),
        (6, 6, 32, Some(7), 8),
        (32, 2, 64, None, 32),
        (4, 2, 256, None, 16),
        (9, 3, 64, None, 16),
    ];
    // Prefill, then chunked prefill mixed with decode, then decode, then a long decode.
    let plan: Plan = vec![
        vec![(0, 70), (0, 37), (0, 5)],
        vec![(70, 1), (37, 20), (5, 1)],
        vec![(71, 1), (57, 1), (6, 1)],
        vec![(72, 3), (58, 500), (7, 1)],
        vec![(75, 1), (558, 1), (8, 1)],
    ];
    for act in [Act::F32, Act::Bf16] {
        let Some(be) = backend(act) else { return };
        for &(h, kvh, hd, window, bs) in &shapes {
            let p = AttnParams {
                n_heads: h,
                n_kv_heads: kvh,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                window,
            };
            let per_seq = 600usize.div_ceil(bs);
            // Scattered tables: a random permutation of all blocks, dealt out per sequence.
            let mut ids: Vec<u32> = (0..(3 * per_seq) as u32).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, rng.below(i + 1));
            }
            let tables: Vec<Vec<u32>> = ids.chunks(per_seq).map(|c| c.to_vec()).collect();
            let data: Vec<Vec<f32>> = plan
                .iter()
                .map(|s| {
                    let n: usize = s.iter().map(|x| x.1).sum();
                    rng.vec(n * (h + 2 * kvh) * hd, 2.0)
                })
                .collect();
            let want = run(&cpu, &p, bs, &tables, &plan, &data);
            let got = run(&be, &p, bs, &tables, &plan, &data);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let row = h * hd;
                let mut worst: Vec<(f64, usize)> = g
                    .chunks(row)
                    .zip(w.chunks(row))
                    .map(|(a, b)| super::util::rel_err(a, b))
                    .zip(0..)
                    .collect();
                worst.sort_by(|a, b| b.0.total_cmp(&a.0));
                eprintln!(
                    "  worst tokens (error, index): {:?}",
                    &worst[..worst.len().min(4)]
                );
                // The CUDA cache holds K/V in bf16.
                assert_close(
                    &format!("{act:?} h={h} kv={kvh} d={hd} window={window:?} bs={bs} step {i}"),
                    g,
                    w,
                    tol(act, 1e-2),
                );
            }
        }
    }
}

#[test]
fn rope_matches_the_cpu_backend_for_both_styles() {
    let mut rng = Rng::fresh("rope");
    let cpu = CpuBackend::new(2);
    let specs = [
        RopeSpec {
            theta: 10000.0,
            dims: 64,
            style: RopeStyle::Interleaved,
            scale: 1.0,
        },
        RopeSpec {
            theta: 500000.0,
            dims: 64,
            style: RopeStyle::Half,
            scale: 1.0,
        },
        RopeSpec {
            theta: 100000.0,
            dims: 32,
            style: RopeStyle::Half,
            scale: 2.0,
        },
        RopeSpec {
            theta: 10000.0,
            dims: 18,
            style: RopeStyle::Interleaved,
            scale: 1.0,
        },
    ];
    fn go<B: Backend>(
        be: &B,
        b: &Batch,
        specs: &[RopeSpec],
        x: &[f32],
        heads: usize,
        hd: usize,
    ) -> Vec<Vec<f32>> {
        let mut st = be.prepare_step(b, 16).unwrap();
        specs
            .iter()
            .map(|&s| {
                let mut xb = upload(be, b.n_tokens(), heads * hd, x);
                be.rope(&mut st, s, &mut xb, heads, hd).unwrap();
                be.to_host(&xb).unwrap()
            })
            .collect()
    }
    for act in [Act::F32, Act::Bf16] {
        let Some(be) = backend(act) else { return };
        let mut b = Batch::default();
        b.push(&[0; 5], 0, vec![0], true);
        b.push(&[0; 3], 4000, (0..251).collect(), true);
        b.push(&[0; 1], 131_000, (0..8200).collect(), true);
        let (heads, hd) = (3, 64);
        let x = rng.vec(b.n_tokens() * heads * hd, 1.0);
        let want = go(&cpu, &b, &specs, &x, heads, hd);
        let got = go(&be, &b, &specs, &x, heads, hd);
        for (s, (g, w)) in specs.iter().zip(got.iter().zip(&want)) {
            assert_close(&format!("{act:?} rope {s:?}"), g, w, tol(act, 1e-5));
        }
    }
}

/// RoPE of queries and keys followed by attention: the two RoPE launches and the K/V write
/// fold into one launch (`rope_kv_*`); outputs bit-identical to the unfolded launches, two
/// launches fewer per step, and within rounding of the CPU backend (prefill, then decode;
/// the attention output to the bf16 cache's rounding).
#[test]
fn rope_and_kv_write_fold_into_one_launch() {
    use deepinfer::backend::cuda::{CudaBackend, CudaOptions};
    let mut rng = Rng::fresh("rope_kv");
    let cpu = CpuBackend::new(2);
    let p = AttnParams {
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 64,
        scale: 0.125,
        window: None,
    };
    let spec = RopeSpec {
        theta: 10000.0,
        dims: 64,
        style: RopeStyle::Half,
        scale: 1.0,
    };
    let tables = [vec![5u32, 1, 2], vec![3u32, 0]];
    let plan: Plan = vec![
        vec![(0, 21), (0, 9)],
        vec![(21, 1), (9, 1)],
        vec![(22, 1), (10, 1)],
    ];
    let (qw, kw) = (p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim);
    let data: Vec<Vec<f32>> = plan
        .iter()
        .map(|s| {
            let n: usize = s.iter().map(|x| x.1).sum();
            rng.vec(n * (qw + 2 * kw), 1.0)
        })
        .collect();
    fn go<B: Backend>(
        be: &B,
        p: &AttnParams,
        spec: RopeSpec,
        tables: &[Vec<u32>],
        plan: &Plan,
        data: &[Vec<f32>],
    ) -> Vec<Vec<f32>> {
        let mut kv = be
            .new_kv(KvShape {
                layers: 1,
                num_blocks: 6,
                block_size: 16,
                kv_heads: p.n_kv_heads,
                head_dim: p.head_dim,
            })
            .unwrap();
        let (qw, kw) = (p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim);
        let mut outs = Vec::new();
        for (si, step) in plan.iter().enumerate() {
            let mut b = Batch::default();
            for (s, &(pos, len)) in step.iter().enumerate() {
                b.push(&vec![0; len], pos, tables[s].clone(), true);
            }
            let n = b.n_tokens();
            let mut st = be.prepare_step(&b, 16).unwrap();
            let d = &data[si];
            let mut q = upload(be, n, qw, &d[..n * qw]);
            let mut k = upload(be, n, kw, &d[n * qw..n * (qw + kw)]);
            let v = upload(be, n, kw, &d[n * (qw + kw)..]);
            let mut out = be.zeros(n * qw).unwrap();
            be.rope(&mut st, spec, &mut q, p.n_heads, p.head_dim)
                .unwrap();
            be.rope(&mut st, spec, &mut k, p.n_kv_heads, p.head_dim)
                .unwrap();
            be.attention(&st, &mut kv, 0, p, &q, &k, &v, &mut out)
                .unwrap();
            outs.extend([out, q, k].iter().map(|b| be.to_host(b).unwrap()));
        }
        outs
    }
    for act in [Act::F32, Act::Bf16] {
        if backend(act).is_none() {
            return;
        }
        // The decode steps' fold into the attention kernel itself is tested below.
        let with = |fuse_rope_kv| {
            CudaBackend::new(
                0,
                CudaOptions {
                    act: Some(act),
                    fuse_rope_kv,
                    fuse_attn: false,
                    ..CudaOptions::from_env().unwrap()
                },
            )
            .unwrap()
        };
        let (be, plain) = (with(true), with(false));
        let got = go(&be, &p, spec, &tables, &plan, &data);
        let unfolded = go(&plain, &p, spec, &tables, &plan, &data);
        let want = go(&cpu, &p, spec, &tables, &plan, &data);
        let (a, b) = (be.stats().ops, plain.stats().ops);
        eprintln!("{act:?} rope+kv: {a} ops folded, {b} unfolded");
        assert_eq!(a + 2 * plan.len() as u64, b, "{act:?}: not folded");
        for (i, ((g, u), w)) in got.iter().zip(&unfolded).zip(&want).enumerate() {
            let what = format!(
                "{act:?} rope+kv step {} {}",
                i / 3,
                ["out", "q", "k"][i % 3]
            );
            assert!(
                g.iter().zip(u).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{what}: folded and unfolded launches differ"
            );
            // The attention output reads a bf16 cache (the CPU's is f32), as in the paged
            // attention test above; the rotated q and k are plain f32 arithmetic.
            let t = if i % 3 == 0 { 1e-2 } else { 1e-4 };
            assert_close(&what, g, w, tol(act, t));
        }
    }
}

/// Decode steps through the fused kernel (`attn_dec1_*`: the RoPE of q and k, the K/V write,
/// attention and the split merge in one cluster launch) against the same calls with it off
/// (`rope_kv`, attention, combine): bit-identical outputs, rotated q and k, and later steps
/// reading the keys it cached; 1, 2, 4 and 8 key splits and a longer context (16 splits:
/// not fused), chunked prefill steps between them, GQA groups of 1, 3, 4 and 8, head dims 64
/// and 128, both rotary styles and a window; fewer launches, and within rounding of the CPU.
#[test]
fn decode_attention_folds_rope_kv_write_and_split_merge() {
    let mut rng = Rng::fresh("attn_dec1");
    let cpu = CpuBackend::new(2);
    // (heads, kv heads, head dim, window, style)
    let shapes = [
        (8usize, 2usize, 64usize, None, RopeStyle::Half),
        (12, 4, 128, Some(40), RopeStyle::Interleaved),
        (8, 1, 128, None, RopeStyle::Half),
        (6, 6, 64, None, RopeStyle::Interleaved),
    ];
    // Two sequences; decode steps at contexts of 1, 2, 4, 8 and 16 splits.
    let plan: Plan = vec![
        vec![(0, 20), (0, 5)],
        vec![(20, 1), (5, 1)],
        vec![(21, 30), (6, 50)],
        vec![(51, 1), (56, 1)],
        vec![(52, 60), (57, 10)],
        vec![(112, 1), (67, 1)],
        vec![(113, 100), (68, 1)],
        vec![(213, 1), (69, 1)],
        vec![(214, 200), (70, 1)],
        vec![(414, 1), (71, 1)],
        vec![(415, 1), (72, 1)],
    ];
    let bs = 16;
    for act in [Act::F32, Act::Bf16] {
        let Some(fused) = backend(act) else { return };
        let plain = CudaBackend::new(
            0,
            CudaOptions {
                act: Some(act),
                fuse_attn: false,
                ..CudaOptions::from_env().unwrap()
            },
        )
        .unwrap();
        for &(h, kvh, hd, window, style) in &shapes {
            let p = AttnParams {
                n_heads: h,
                n_kv_heads: kvh,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                window,
            };
            let spec = RopeSpec {
                theta: 10000.0,
                dims: hd,
                style,
                scale: 1.0,
            };
            let per_seq = 420usize.div_ceil(bs);
            let mut ids: Vec<u32> = (0..(2 * per_seq) as u32).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, rng.below(i + 1));
            }
            let tables: Vec<Vec<u32>> = ids.chunks(per_seq).map(|c| c.to_vec()).collect();
            let (qw, kw) = (h * hd, kvh * hd);
            let data: Vec<Vec<f32>> = plan
                .iter()
                .map(|s| {
                    let n: usize = s.iter().map(|x| x.1).sum();
                    rng.vec(n * (qw + 2 * kw), 1.0)
                })
                .collect();
            macro_rules! steps {
                ($be:expr) => {{
                    let be = $be;
                    let mut kv = be
                        .new_kv(KvShape {
                            layers: 1,
                            num_blocks: 2 * per_seq,
                            block_size: bs,
                            kv_heads: kvh,
                            head_dim: hd,
                        })
                        .unwrap();
                    let mut outs = Vec::new();
                    for (si, step) in plan.iter().enumerate() {
                        let mut b = Batch::default();
                        for (s, &(pos, len)) in step.iter().enumerate() {
                            b.push(&vec![0; len], pos, tables[s].clone(), true);
                        }
                        let n = b.n_tokens();
                        let mut st = be.prepare_step(&b, bs).unwrap();
                        let d = &data[si];
                        let mut q = upload(be, n, qw, &d[..n * qw]);
                        let mut k = upload(be, n, kw, &d[n * qw..n * (qw + kw)]);
                        let v = upload(be, n, kw, &d[n * (qw + kw)..]);
                        let mut out = be.zeros(n * qw).unwrap();
                        be.rope(&mut st, spec, &mut q, h, hd).unwrap();
                        be.rope(&mut st, spec, &mut k, kvh, hd).unwrap();
                        be.attention(&st, &mut kv, 0, &p, &q, &k, &v, &mut out)
                            .unwrap();
                        outs.extend([out, q, k].iter().map(|b| be.to_host(b).unwrap()));
                    }
                    outs
                }};
            }
            let ops0 = (fused.stats().ops, plain.stats().ops);
            let got = steps!(&fused);
            let unfused = steps!(&plain);
            let ops = (fused.stats().ops - ops0.0, plain.stats().ops - ops0.1);
            let want = steps!(&cpu);
            let shape = format!("{act:?} h={h} kv={kvh} d={hd} window={window:?} {style:?}");
            eprintln!("{shape}: {} ops fused, {} not", ops.0, ops.1);
            assert!(ops.0 < ops.1, "{shape}: nothing was fused");
            for (i, ((g, u), w)) in got.iter().zip(&unfused).zip(&want).enumerate() {
                let what = format!("{shape} step {} {}", i / 3, ["out", "q", "k"][i % 3]);
                assert!(
                    g.iter().zip(u).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{what}: fused and unfused launches differ"
                );
                let t = if i % 3 == 0 { 1e-2 } else { 1e-4 };
                assert_close(&what, g, w, tol(act, t));
            }
        }
    }
}

const PREFILL_KERNELS: [PrefillKernel; 3] = [
    PrefillKernel::Plain,
    PrefillKernel::Pipelined,
    PrefillKernel::Wide,
];

/// The CUDA backend with activations `act` and prefill kernel `k`, or `None` (skip printed).
fn backend_with(act: Act, k: PrefillKernel) -> Option<CudaBackend> {
    if let Some(why) = deepinfer::backend::cuda::unavailable_reason() {
        eprintln!("skipped: {why}");
        return None;
    }
    let opts = CudaOptions {
        act: Some(act),
        prefill: k,
        ..CudaOptions::from_env().expect("CUDA options")
    };
    Some(CudaBackend::new(0, opts).expect("the CUDA backend starts"))
}

/// Every prefill kernel against the CPU backend: three sequences whose prompts arrive in
/// chunks (later chunks start mid-context, on and off the 64-key tiles and the cache blocks),
/// query counts that are no multiple of 64 or 128, a decode row inside a prefill step, GQA
/// groups of 1, 4 and 8, head dims 64 and 128, with and without a sliding window.
#[test]
fn prefill_kernels_match_the_cpu_backend_on_odd_shapes() {
    let mut rng = Rng::fresh("prefill_kernels");
    let cpu = CpuBackend::new(2);
    // (heads, kv heads, head dim, window, block size)
    let shapes = [
        (4usize, 4usize, 64usize, None, 16usize),
        (16, 4, 128, None, 16),
        (16, 2, 128, None, 32),
        (8, 1, 64, Some(45), 8),
        (8, 2, 128, Some(130), 16),
    ];
    let plan: Plan = vec![
        vec![(0, 150), (0, 37), (0, 300)],
        vec![(150, 200), (37, 129), (300, 1)],
        vec![(350, 9), (166, 256), (301, 77)],
    ];
    for &(h, kvh, hd, window, bs) in &shapes {
        let p = AttnParams {
            n_heads: h,
            n_kv_heads: kvh,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window,
        };
        let per_seq = 440usize.div_ceil(bs);
        let mut ids: Vec<u32> = (0..(3 * per_seq) as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i + 1));
        }
        let tables: Vec<Vec<u32>> = ids.chunks(per_seq).map(|c| c.to_vec()).collect();
        let data: Vec<Vec<f32>> = plan
            .iter()
            .map(|s| {
                let n: usize = s.iter().map(|x| x.1).sum();
                rng.vec(n * (h + 2 * kvh) * hd, 2.0)
            })
            .collect();
        let want = run(&cpu, &p, bs, &tables, &plan, &data);
        for act in [Act::F32, Act::Bf16] {
            for k in PREFILL_KERNELS {
                let Some(be) = backend_with(act, k) else {
                    return;
                };
                let got = run(&be, &p, bs, &tables, &plan, &data);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_close(
                        &format!("{k:?} {act:?} h={h} kv={kvh} d={hd} window={window:?} bs={bs} step {i}"),
                        g,
                        w,
                        tol(act, 1e-2),
                    );
                }
            }
        }
    }
}

/// Device time of each prefill kernel on one prompt at Llama-3-8B's attention shape (32 query
/// heads, 8 KV heads, head dim 128, bf16), with each output against the double-buffered
/// kernel's. `DEEPINFER_PREFILL_LENS` (comma-separated, default 8192,2048) sets the lengths.
#[test]
#[ignore = "timing; run on the device with --ignored"]
fn prefill_kernel_speed_at_llama3_8b_shape() {
    let mut rng = Rng::fresh("prefill_speed");
    let p = AttnParams {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        scale: 1.0 / (128f32).sqrt(),
        window: None,
    };
    let lens: Vec<usize> = std::env::var("DEEPINFER_PREFILL_LENS")
        .unwrap_or_else(|_| "8192,2048".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let bs = 16;
    for n in lens {
        let (qw, kw) = (p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim);
        let data = rng.vec(n * (qw + 2 * kw), 2.0);
        let table: Vec<u32> = (0..n.div_ceil(bs) as u32).rev().collect();
        let flop = 4.0 * (p.n_heads * p.head_dim) as f64 * (n as f64) * (n as f64 + 1.0) / 2.0;
        let mut base: Option<Vec<f32>> = None;
        let mut kernels = PREFILL_KERNELS.to_vec();
        kernels.swap(0, 1); // the double-buffered kernel first: the others are compared to it
        for k in kernels {
            let Some(be) = backend_with(Act::Bf16, k) else {
                return;
            };
            be.set_timing(true);
            let mut kv = be
                .new_kv(KvShape {
                    layers: 1,
                    num_blocks: table.len(),
                    block_size: bs,
                    kv_heads: p.n_kv_heads,
                    head_dim: p.head_dim,
                })
                .unwrap();
            let mut b = Batch::default();
            b.push(&vec![0; n], 0, table.clone(), true);
            let st = be.prepare_step(&b, bs).unwrap();
            let q = upload(&be, n, qw, &data[..n * qw]);
            let kb = upload(&be, n, kw, &data[n * qw..n * (qw + kw)]);
            let vb = upload(&be, n, kw, &data[n * (qw + kw)..]);
            let mut out = be.zeros(n * qw).unwrap();
            be.synchronize().unwrap();
            let mut times = Vec::new();
            for _ in 0..5 {
                let t0 = be.stats().device_s;
                be.attention(&st, &mut kv, 0, &p, &q, &kb, &vb, &mut out)
                    .unwrap();
                be.synchronize().unwrap();
                times.push(be.stats().device_s - t0);
            }
            times.sort_by(f64::total_cmp);
            let t = times[times.len() / 2];
            let got = be.to_host(&out).unwrap();
            let err = base.as_ref().map_or(0.0, |w| super::util::rel_err(&got, w));
            eprintln!(
                "prefill attention n={n} {k:?}: {:.3} ms ({:.1} TFLOP/s), vs Pipelined {err:.2e}",
                t * 1e3,
                flop / t / 1e12
            );
            assert!(
                err < 1e-2,
                "{k:?} n={n}: differs from the double-buffered kernel by {err:.2e}"
            );
            if base.is_none() {
                base = Some(got);
            }
        }
    }
}
