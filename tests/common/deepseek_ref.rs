//! The DeepSeek-V3 fixtures of tests/data/deepseek and the error measures shared by the CPU
//! (`tests/deepseek_v3.rs`) and CUDA (`host/tests/gpu_deepseek.rs`) tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use deepinfer::backend::Backend;
use deepinfer::model::arch::deepseek_v3::DeepseekV3;
use deepinfer::model::batch::Batch;
use deepinfer::model::KvCache;
use safetensors::SafeTensors;

/// The fixtures: beside the sources this was built from, else under the working folder (the
/// device machine runs packed test binaries from another checkout's root).
pub fn data() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/deepseek");
    if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/data/deepseek")
    }
}

/// HF transformers' fp32 outputs for one checkpoint (scripts/deepseek_v3_reference.py).
pub struct Reference {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub vocab: usize,
    pub hidden_dim: usize,
    pub logits: Vec<f32>,
    pub hidden: Vec<f32>,
    pub mtp_logits: Vec<f32>,
}

pub fn reference(name: &str) -> Reference {
    let bytes = std::fs::read(data().join(format!("reference/{name}.safetensors"))).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |n: &str| -> (Vec<f32>, Vec<usize>) {
        let t = st.tensor(n).unwrap();
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (v, t.shape().to_vec())
    };
    let i64s = |n: &str| -> Vec<i64> {
        let t = st.tensor(n).unwrap();
        t.data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let (logits, shape) = f32s("logits");
    let (hidden, hshape) = f32s("hidden");
    Reference {
        tokens: i64s("tokens").iter().map(|&t| t as u32).collect(),
        prompt_len: i64s("prompt_len")[0] as usize,
        vocab: shape[1],
        hidden_dim: hshape[1],
        logits,
        hidden,
        mtp_logits: f32s("mtp_logits").0,
    }
}

/// Largest difference over the row, relative to the row's largest reference magnitude.
pub fn row_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|v| v.is_finite()), "non-finite values");
    let scale = want.iter().fold(0f64, |m, &v| m.max(v.abs() as f64));
    let diff = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()));
    diff / scale.max(1e-30)
}

/// The largest [`row_err`] over rows of `width`.
pub fn max_err(got: &[f32], want: &[f32], width: usize) -> f64 {
    assert_eq!(got.len(), want.len());
    got.chunks(width)
        .zip(want.chunks(width))
        .map(|(a, b)| row_err(a, b))
        .fold(0.0, f64::max)
}

/// A prompt of one sequence (blocks 0..4) with the logits of every token.
pub fn prefill(tokens: &[u32], pos: usize) -> Batch {
    let mut b = Batch::default();
    b.push(tokens, pos, vec![0, 1, 2, 3], false);
    b.logits_for = (0..tokens.len()).collect();
    b
}

/// The MTP layer over the reference: the main model's final-norm hidden states of the whole
/// sequence, then the MTP input at position i (token i+1 with hidden state i) — the first 15
/// positions as one prefill, then one position at a time through the MTP layer's cache.
/// Returns the hidden states and the MTP logits' largest row error against HF.
pub fn mtp_against_reference<B: Backend>(
    m: &DeepseekV3<B>,
    r: &Reference,
    kv: &mut KvCache,
) -> (Vec<f32>, f64) {
    let (_, hidden) = m.forward_with_hidden(&prefill(&r.tokens, 0), kv).unwrap();
    let d = r.hidden_dim;
    let split = 15;
    let (logits, _) = m
        .mtp_forward(
            0,
            &prefill(&r.tokens[1..=split], 0),
            &hidden[..split * d],
            kv,
        )
        .unwrap();
    let mut err = max_err(&logits, &r.mtp_logits[..split * r.vocab], r.vocab);
    for i in split..r.tokens.len() - 1 {
        let mut b = Batch::default();
        b.push(&r.tokens[i + 1..i + 2], i, vec![0, 1, 2, 3], true);
        let (l, _) = m
            .mtp_forward(0, &b, &hidden[i * d..(i + 1) * d], kv)
            .unwrap();
        err = err.max(row_err(&l, &r.mtp_logits[i * r.vocab..(i + 1) * r.vocab]));
    }
    (hidden, err)
}

/// Copies checkpoint `name` into `to`.
pub fn copy_fixture(name: &str, to: &Path) {
    for e in std::fs::read_dir(data().join(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Copies checkpoint `name` into `to` with every tensor of its fp32 `model.safetensors`
/// rounded to bf16.
pub fn bf16_copy(name: &str, to: &Path) {
    copy_fixture(name, to);
    let p = to.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let converted: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            let data = t
                .data()
                .chunks_exact(4)
                .flat_map(|c| {
                    let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    half::bf16::from_f32(v).to_le_bytes()
                })
                .collect();
            (n, t.shape().to_vec(), data)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = converted
        .iter()
        .map(|(n, s, d)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), d);
            (n.clone(), v.unwrap())
        })
        .collect();
    let meta: Option<std::collections::HashMap<String, String>> = None;
    safetensors::serialize_to_file(views, meta, &p).unwrap();
}
