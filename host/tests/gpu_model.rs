//! Whole models on the CUDA backend against the CPU backend: a generated tiny Llama (f32
//! weights, f32 activations on the device), a random-weight SmolLM2-shaped model (bf16
//! weights and activations, cuBLAS for prefill), CUDA-graph replay of decode steps, and the
//! default model (logits and greedy agreement with the numpy reference) when its file is
//! present. Without the `cuda` feature or a device the tests print why and pass.

#[cfg(feature = "cuda")]
mod gpu {
    use std::path::PathBuf;
    use std::sync::Arc;

    use deepinfer::backend::cuda::{unavailable_reason, CudaBackend, CudaOptions};
    use deepinfer::backend::Device;
    use deepinfer::model::arch::llama::Llama;
    use deepinfer::model::batch::Batch;
    use deepinfer::model::{
        gguf, gguf_config, gguf_writer, random, tiny::TinyLlama, CausalLm, Logits, LogitsWant,
    };
    use deepinfer::runtime::{EngineOptions, Llm, Request};
    use deepinfer::sampling::{NativeSampler, SamplingParams};

    fn skip() -> bool {
        match unavailable_reason() {
            Some(why) => {
                eprintln!("skipped: {why}");
                true
            }
            None => false,
        }
    }

    fn rel_err(a: &[f32], b: &[f32]) -> f64 {
        assert_eq!(a.len(), b.len());
        let d: f64 = a
            .iter()
            .zip(b)
            .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
            .sum();
        let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        assert!(a.iter().all(|v| v.is_finite()), "non-finite logits");
        (d / n).sqrt()
    }

    fn argmax(l: &[f32]) -> usize {
        (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b })
    }

    /// Prefill of two sequences (one longer than a prefill tile), a mixed step, then `decode`
    /// plain decode steps; returns each step's logits. Decode inputs avoid the lowest ids (the
    /// default model's control tokens, whose activations make the logits ill-conditioned).
    fn drive(m: &dyn CausalLm, decode: usize) -> Vec<Vec<f32>> {
        let vocab = m.config().vocab as u32;
        let mut kv = m.new_kv(64, 16).unwrap();
        let (t0, t1): (Vec<u32>, Vec<u32>) = (
            (0..100).map(|i| (i * 7 + 3) % vocab).collect(),
            (0..37).map(|i| (i * 11 + 5) % vocab).collect(),
        );
        let (a, b) = (
            (0..32).collect::<Vec<u32>>(),
            (32..64).collect::<Vec<u32>>(),
        );
        let mut out = Vec::new();
        let mut batch = Batch::default();
        batch.push(&t0, 0, a.clone(), true);
        batch.push(&t1[..30], 0, b.clone(), true);
        out.push(m.forward(&batch, &mut kv).unwrap());
        let mut batch = Batch::default();
        batch.push(&[5], 100, a.clone(), true);
        batch.push(&t1[30..], 30, b.clone(), true);
        out.push(m.forward(&batch, &mut kv).unwrap());
        for s in 0..decode {
            let mut batch = Batch::default();
            batch.push(&[(s as u32 * 13 + 200) % vocab], 101 + s, a.clone(), true);
            batch.push(&[(s as u32 * 17 + 150) % vocab], 37 + s, b.clone(), true);
            out.push(m.forward(&batch, &mut kv).unwrap());
        }
        out
    }

    /// Logits within `tol` (norm-wise) per step, and the same top-1 token in at least
    /// `min_agree` of the rows.
    fn compare(
        what: &str,
        got: &[Vec<f32>],
        want: &[Vec<f32>],
        vocab: usize,
        tol: f64,
        min_agree: f64,
    ) {
        let (mut same, mut total) = (0, 0);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let e = rel_err(g, w);
            eprintln!("{what} step {i}: logits relative error {e:.2e}");
            assert!(
                e < tol,
                "{what} step {i}: logits relative error {e:.3e} >= {tol}"
            );
            for (gr, wr) in g.chunks(vocab).zip(w.chunks(vocab)) {
                same += (argmax(gr) == argmax(wr)) as usize;
                total += 1;
            }
        }
        eprintln!("{what}: top-1 agreement {same}/{total}");
        assert!(
            same as f64 >= total as f64 * min_agree,
            "{what}: top-1 agreement {same}/{total}"
        );
    }

    #[test]
    fn tiny_llama_matches_the_cpu_and_replays_decode_as_a_graph() {
        if skip() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        let (meta, tensors) = TinyLlama {
            layers: 3,
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            ffn: 512,
            context: 1024,
            seed: 9,
        }
        .build();
        gguf_writer::write(&path, &meta, &tensors).unwrap();
        let cpu = deepinfer::model::load(&path, Device::Cpu { threads: 2 }).unwrap();
        let g = gguf::GgufFile::open(&path).unwrap();
        let be = CudaBackend::new(0, CudaOptions::from_env().unwrap()).unwrap();
        let gpu = Llama::load(gguf_config::model_config(&g).unwrap(), &g, be.clone()).unwrap();
        let vocab = cpu.model.config().vocab;
        let want = drive(cpu.model.as_ref(), 6);
        let got = drive(&gpu, 6);
        compare("tiny llama (f32)", &got, &want, vocab, 1e-2, 0.9);
        let s = be.stats();
        eprintln!("queue: {s:?}");
        assert!(
            s.graph_captures >= 1 && s.graph_launches >= 4,
            "decode steps were not replayed as a graph: {s:?}"
        );
    }

    #[test]
    fn random_smollm2_shape_in_bf16_matches_the_cpu() {
        if skip() {
            return;
        }
        let shape = random::shape("smollm2-135m").unwrap();
        let src = random::RandomWeights {
            seed: 3,
            tie_embeddings: shape.tie_embeddings,
        };
        let cpu = deepinfer::model::arch::build(shape.config(), &src, Device::Cpu { threads: 2 })
            .unwrap();
        let be = CudaBackend::new(0, CudaOptions::from_env().unwrap()).unwrap();
        let gpu = Llama::load(shape.config(), &src, be.clone()).unwrap();
        assert_eq!(
            be.act(),
            deepinfer::backend::cuda::Act::Bf16,
            "bf16 weights give bf16 activations"
        );
        compare(
            "random smollm2-135m (bf16)",
            &drive(&gpu, 3),
            &drive(cpu.as_ref(), 3),
            shape.vocab,
            6e-2,
            0.0,
        );
    }

    /// A bf16 Llama shape whose rows are long enough (k >= 2048) for the block-cooperative
    /// GEMVs, small enough to load in a moment.
    fn wide_bf16_shape() -> random::Shape {
        random::Shape {
            name: "wide-test",
            hidden: 2048,
            layers: 2,
            heads: 16,
            kv_heads: 4,
            ffn: 2304,
            vocab: 4096,
            rope_theta: 10000.0,
            tie_embeddings: false,
        }
    }

    /// Two backends, decode steps padded to a bucket or not (graphs on in both).
    fn backends() -> (CudaBackend, CudaBackend) {
        let opts = CudaOptions::from_env().unwrap();
        let make = |buckets| {
            CudaBackend::new(
                0,
                CudaOptions {
                    graphs: true,
                    buckets,
                    ..opts.clone()
                },
            )
            .unwrap()
        };
        (make(true), make(false))
    }

    /// `n` sequences each prefilled with 5..=7 tokens (blocks of 16, 4 per sequence), then
    /// `steps` decode steps of all of them; each decode step's logits.
    fn decode_run(m: &dyn CausalLm, n: usize, steps: usize) -> Vec<Vec<f32>> {
        let vocab = m.config().vocab;
        let mut kv = m.new_kv(4 * n, 16).unwrap();
        let table = |i: usize| (4 * i as u32..4 * i as u32 + 4).collect::<Vec<u32>>();
        let plen = |i: usize| 5 + i % 3;
        let mut b = Batch::default();
        for i in 0..n {
            let t: Vec<u32> = (0..plen(i))
                .map(|j| ((i * 31 + j * 7 + 11) % vocab) as u32)
                .collect();
            b.push(&t, 0, table(i), true);
        }
        m.forward(&b, &mut kv).unwrap();
        (0..steps)
            .map(|s| {
                let mut b = Batch::default();
                for i in 0..n {
                    let t = ((i * 13 + s * 17 + 40) % vocab) as u32;
                    b.push(&[t], plen(i) + s, table(i), true);
                }
                m.forward(&b, &mut kv).unwrap()
            })
            .collect()
    }

    /// Decode steps of 3, 5 and 17 sequences padded to their buckets (4, 8, 24) against the
    /// same steps unpadded: the real rows must be bit-identical where the products run
    /// through the GEMV kernels (up to 8 tokens, the same kernel for the real and the padded
    /// count); through cuBLAS (17 -> 24 tokens) cuBLAS may pick another kernel for another
    /// size, so there the rows must agree to rounding. All against the CPU backend too.
    fn padded_against_unpadded(
        what: &str,
        gpu: impl Fn(CudaBackend) -> Box<dyn CausalLm>,
        cpu: &dyn CausalLm,
        gemm_tol: f64,
        cpu_tol: f64,
    ) {
        let (on, off) = backends();
        let (padded, plain) = (gpu(on.clone()), gpu(off.clone()));
        let vocab = cpu.config().vocab;
        for n in [3usize, 5, 17] {
            let before = on.stats();
            let a = decode_run(padded.as_ref(), n, 3);
            let b = decode_run(plain.as_ref(), n, 3);
            let after = on.stats();
            assert!(
                after.graph_launches > before.graph_launches,
                "{what} n={n}: padded decode steps were not replayed as a graph"
            );
            for (s, (x, y)) in a.iter().zip(&b).enumerate() {
                assert_eq!(
                    x.len(),
                    n * vocab,
                    "{what} n={n}: logits of the real rows only"
                );
                let same = x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
                let e = rel_err(x, y);
                eprintln!("{what} n={n} step {s}: padded vs unpadded bit-identical {same}, relative error {e:.2e}");
                if n <= 8 {
                    assert!(
                        same,
                        "{what} n={n} step {s}: padded rows differ from the unpadded run ({e:.2e})"
                    );
                } else {
                    assert!(e < gemm_tol, "{what} n={n} step {s}: {e:.3e}");
                }
            }
            compare(
                &format!("{what} n={n} padded vs cpu"),
                &a,
                &decode_run(cpu, n, 3),
                vocab,
                cpu_tol,
                0.0,
            );
        }
    }

    #[test]
    fn padded_decode_steps_match_unpadded_ones() {
        if skip() {
            return;
        }
        // f32 weights and activations: warp-per-row GEMVs, f32 cuBLAS.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        let (meta, tensors) = TinyLlama {
            layers: 2,
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            ffn: 512,
            context: 1024,
            seed: 5,
        }
        .build();
        gguf_writer::write(&path, &meta, &tensors).unwrap();
        let cpu = deepinfer::model::load(&path, Device::Cpu { threads: 2 }).unwrap();
        let g = gguf::GgufFile::open(&path).unwrap();
        let cfg = gguf_config::model_config(&g).unwrap();
        padded_against_unpadded(
            "tiny llama (f32)",
            |be| Box::new(Llama::load(cfg.clone(), &g, be).unwrap()),
            cpu.model.as_ref(),
            1e-5,
            1e-2,
        );
        // bf16 weights and activations: block-cooperative GEMVs, bf16 cuBLAS.
        let shape = wide_bf16_shape();
        let src = random::RandomWeights {
            seed: 7,
            tie_embeddings: false,
        };
        let cpu = deepinfer::model::arch::build(shape.config(), &src, Device::Cpu { threads: 2 })
            .unwrap();
        padded_against_unpadded(
            "wide random llama (bf16)",
            |be| Box::new(Llama::load(shape.config(), &src, be).unwrap()),
            cpu.as_ref(),
            2e-2,
            6e-2,
        );
    }

    /// `forward_select` on the device (the argmax and top-K kernels; padded decode rows
    /// dropped) against the same step's full logits selected on the host: the same ids in the
    /// same order (ties by the lower id: bf16 logits tie often) and the same values.
    #[test]
    fn device_selection_matches_host_selection_of_the_same_logits() {
        if skip() {
            return;
        }
        let shape = wide_bf16_shape();
        let src = random::RandomWeights {
            seed: 9,
            tie_embeddings: false,
        };
        let be = CudaBackend::new(0, CudaOptions::from_env().unwrap()).unwrap();
        let m = Llama::load(shape.config(), &src, be).unwrap();
        let vocab = m.config().vocab;
        for n in [1usize, 3, 5] {
            let mut kv = m.new_kv(4 * n, 16).unwrap();
            let table = |i: usize| (4 * i as u32..4 * i as u32 + 4).collect::<Vec<u32>>();
            let mut b = Batch::default();
            for i in 0..n {
                b.push(&[(i * 7 + 3) as u32, 5, 9], 0, table(i), true);
            }
            m.forward(&b, &mut kv).unwrap();
            // The same decode step each time: it rewrites its own K/V slot with the same values.
            let mut step = |want| {
                let mut b = Batch::default();
                for i in 0..n {
                    b.push(&[(i * 11 + 1) as u32], 3, table(i), true);
                }
                m.forward_select(&b, &mut kv, want).unwrap()
            };
            let Logits::Full(full) = step(LogitsWant::Full) else {
                panic!("full rows asked, something else returned");
            };
            assert_eq!(full.len(), n * vocab);
            for want in [
                LogitsWant::Argmax,
                LogitsWant::TopK(1),
                LogitsWant::TopK(40),
                LogitsWant::TopK(1024),
            ] {
                let host = Logits::select(full.clone(), vocab, want).unwrap();
                let device = step(want);
                assert_eq!(device.rows(vocab), n, "{want:?}, {n} sequences");
                assert_eq!(device, host, "{want:?}, {n} sequences");
            }
            eprintln!("device selection, {n} sequences: argmax and top-1/40/1024 equal the host's");
        }
    }

    /// Decode steps whose batch size changes every step (3..=24 sequences, three rounds):
    /// with buckets, graphs are captured in the first round only (one per bucket that saw two
    /// steps in a row) and every step of the later rounds replays one.
    #[test]
    fn graph_count_stays_bounded_when_the_batch_size_varies() {
        if skip() {
            return;
        }
        let shape = wide_bf16_shape();
        let src = random::RandomWeights {
            seed: 8,
            tie_embeddings: false,
        };
        let (on, off) = backends();
        let sizes = [3usize, 4, 5, 6, 7, 8, 9, 12, 16, 17, 20, 24];
        let buckets: std::collections::BTreeSet<usize> = sizes
            .iter()
            .map(|&n| deepinfer::backend::cuda::bucket(n).unwrap())
            .collect();
        for (be, padded) in [(on, true), (off, false)] {
            let m = Llama::load(shape.config(), &src, be.clone()).unwrap();
            let mut kv = m.new_kv(8 * 24, 16).unwrap();
            // Contexts stay within (64, 128], one block-table width and split count.
            let mut pos = [66usize; 24];
            let mut rounds = Vec::new();
            for round in 0..3 {
                for &n in &sizes {
                    let mut b = Batch::default();
                    for (i, p) in pos.iter_mut().enumerate().take(n) {
                        let table: Vec<u32> = (8 * i as u32..8 * i as u32 + 8).collect();
                        b.push(
                            &[((i * 7 + round * 3 + n) % shape.vocab) as u32],
                            *p,
                            table,
                            true,
                        );
                        *p += 1;
                    }
                    let logits = m.forward(&b, &mut kv).unwrap();
                    assert_eq!(logits.len(), n * shape.vocab);
                    assert!(logits.iter().all(|v| v.is_finite()));
                }
                rounds.push(be.stats());
            }
            eprintln!("buckets {padded}: queue after each round {rounds:?}");
            if padded {
                let (first, last) = (rounds[0], rounds[2]);
                assert!(
                    first.graph_captures <= buckets.len() as u64,
                    "{} captures for {} buckets",
                    first.graph_captures,
                    buckets.len()
                );
                assert_eq!(
                    last.graph_captures, first.graph_captures,
                    "graphs captured after the first round"
                );
                assert_eq!(
                    last.graph_launches - first.graph_launches,
                    2 * sizes.len() as u64,
                    "every later step replays a graph"
                );
            }
        }
    }

    fn default_model_path() -> Option<PathBuf> {
        let p = match std::env::var_os("DEEPINFER_MODEL") {
            Some(p) => PathBuf::from(p),
            None => deepinfer::model::fetch::cache_dir()
                .join("models")
                .join(deepinfer::model::fetch::FILE_NAME),
        };
        p.exists().then_some(p)
    }

    fn reference_cases() -> Option<Vec<(String, Vec<u32>)>> {
        let rel = "tests/data/smollm2_greedy.json";
        let text = [
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join(rel),
            PathBuf::from(rel),
        ]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        let ids = |x: &serde_json::Value| {
            x.as_array().map(|a| {
                a.iter()
                    .filter_map(|t| t.as_u64())
                    .map(|t| t as u32)
                    .collect::<Vec<u32>>()
            })
        };
        v.as_array()?
            .iter()
            .map(|c| Some((c["prompt"].as_str()?.to_string(), ids(&c["greedy_ids"])?)))
            .collect()
    }

    #[test]
    fn default_model_on_the_gpu_matches_the_cpu_and_the_reference() {
        if skip() {
            return;
        }
        let (Some(path), Some(cases)) = (default_model_path(), reference_cases()) else {
            eprintln!("skipped: the default model file (DEEPINFER_MODEL or the cache) or tests/data/smollm2_greedy.json is missing");
            return;
        };
        let gpu = deepinfer::model::load(&path, Device::Cuda { ordinal: 0 }).unwrap();
        let llm = Llm::new(gpu, Arc::new(NativeSampler), EngineOptions::default()).unwrap();
        let requests: Vec<Request> = cases
            .iter()
            .enumerate()
            .map(|(i, (p, g))| {
                Request::text(
                    i.to_string(),
                    p.clone(),
                    SamplingParams {
                        max_tokens: g.len().max(1),
                        ..Default::default()
                    },
                )
            })
            .collect();
        let outs = llm.generate(&requests, &mut |_| {});
        let (mut matched, mut total) = (0, 0);
        for ((p, want), o) in cases.iter().zip(&outs) {
            assert!(o.error.is_none(), "{p:?}: {:?}", o.error);
            let m = o
                .token_ids
                .iter()
                .zip(want)
                .take_while(|(a, b)| a == b)
                .count();
            eprintln!(
                "{p:?}: {m}/{} greedy tokens agree: {:?}",
                want.len(),
                o.text
            );
            matched += m;
            total += want.len();
        }
        eprintln!("GPU greedy agreement with the numpy reference: {matched}/{total}");
        assert!(
            matched * 10 >= total * 9,
            "only {matched}/{total} reference greedy tokens matched"
        );
        let cpu = deepinfer::model::load(&path, Device::Cpu { threads: 2 }).unwrap();
        let gpu = deepinfer::model::load(&path, Device::Cuda { ordinal: 0 }).unwrap();
        let vocab = cpu.model.config().vocab;
        compare(
            "default model",
            &drive(gpu.model.as_ref(), 4),
            &drive(cpu.model.as_ref(), 4),
            vocab,
            5e-2,
            0.75,
        );
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_model_tests_skipped_without_the_cuda_feature() {
    eprintln!("skipped: built without `--features cuda`");
}
