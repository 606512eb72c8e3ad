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
    use deepinfer::model::{gguf, gguf_config, gguf_writer, random, tiny::TinyLlama, CausalLm};
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
