//! Random-weight models of named full-size shapes (`--random-weights llama3-8b`), so that speed
//! can be measured where no checkpoint can be downloaded. The [`RandomWeights`] source makes
//! deterministic pseudo-random bf16 matrices (magnitudes near 1/sqrt(fan-in), random signs)
//! and unit norm gains; the tokenizer is the tiny byte-level one (ids above it decode to
//! nothing). The numbers mean nothing; the shapes, bytes and FLOPs are the real model's.

use std::path::PathBuf;
use std::sync::Arc;

use super::hparams::{AttentionKind, LayerSpec, ModelConfig, RopeSpec, RopeStyle};
use super::{arch, gguf, gguf_writer, tiny, LoadedModel, Naming, WeightSource};
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{Bytes, DType, Weight};

/// A named decoder shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub name: &'static str,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub rope_theta: f32,
    pub tie_embeddings: bool,
}

/// The shapes `--random-weights` knows.
pub const SHAPES: &[Shape] = &[
    Shape {
        name: "llama3-8b",
        hidden: 4096,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        ffn: 14336,
        vocab: 128256,
        rope_theta: 500000.0,
        tie_embeddings: false,
    },
    Shape {
        name: "llama3-1b",
        hidden: 2048,
        layers: 16,
        heads: 32,
        kv_heads: 8,
        ffn: 8192,
        vocab: 128256,
        rope_theta: 500000.0,
        tie_embeddings: true,
    },
    Shape {
        name: "smollm2-135m",
        hidden: 576,
        layers: 30,
        heads: 9,
        kv_heads: 3,
        ffn: 1536,
        vocab: 49152,
        rope_theta: 100000.0,
        tie_embeddings: true,
    },
    Shape {
        name: "tiny",
        hidden: 256,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        ffn: 512,
        vocab: 1024,
        rope_theta: 10000.0,
        tie_embeddings: false,
    },
];

/// DeepSeek-V3-architecture shapes `--random-weights` knows, as HF `config.json` values.
/// `moonlight-16b-a3b`: moonshotai/Moonlight-16B-A3B (27 layers, the first dense; 64 routed
/// experts, top 6 without group limit, 2 shared; MLA with kv_lora_rank 512 and no q_lora).
pub const DEEPSEEK_SHAPES: &[&str] = &["moonlight-16b-a3b"];

/// The `config.json` of a DeepSeek-V3-architecture shape.
pub fn deepseek_shape(name: &str) -> Option<serde_json::Value> {
    match name {
        "moonlight-16b-a3b" => Some(serde_json::json!({
            "model_type": "deepseek_v3",
            "hidden_size": 2048,
            "num_hidden_layers": 27,
            "first_k_dense_replace": 1,
            "intermediate_size": 11264,
            "moe_intermediate_size": 1408,
            "n_routed_experts": 64,
            "num_experts_per_tok": 6,
            "n_shared_experts": 2,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": true,
            "routed_scaling_factor": 2.446,
            "moe_layer_freq": 1,
            "kv_lora_rank": 512,
            "q_lora_rank": null,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "vocab_size": 163840,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 50000.0,
            "tie_word_embeddings": false,
            "num_nextn_predict_layers": 0,
            "hidden_act": "silu",
        })),
        _ => None,
    }
}

/// Weight bytes one token reads in a decode step of a bf16 DeepSeek-V3 model (every weight
/// a token touches once: embedding row, attention projections, the dense FFNs, router gates,
/// `top_k` routed and the shared experts of each MoE layer, the output head; f32 norm gains),
/// the KV cache excluded. This is the numerator of the batch-1 memory floor.
pub fn deepseek_active_bytes(c: &super::deepseek_config::DeepseekV3Config) -> usize {
    deepseek_bytes(c, false)
}

/// Bytes of all the weights of a bf16 DeepSeek-V3 model (every expert, the whole embedding).
pub fn deepseek_total_bytes(c: &super::deepseek_config::DeepseekV3Config) -> usize {
    deepseek_bytes(c, true)
}

fn deepseek_bytes(c: &super::deepseek_config::DeepseekV3Config, all: bool) -> usize {
    let (d, h) = (c.hidden, c.n_heads);
    let qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    let q = match c.q_lora_rank {
        None => h * qk * d,
        Some(r) => r * d + h * qk * r,
    };
    let kv_a = (c.kv_lora_rank + c.qk_rope_head_dim) * d;
    let kv_b = h * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank;
    let o = d * h * c.v_head_dim;
    let attn = 2 * (q + kv_a + kv_b + o);
    let norms = 4 * (2 * d + c.kv_lora_rank + c.q_lora_rank.unwrap_or(0));
    let embed = if all { 2 * c.vocab * d } else { 2 * d };
    let mut total = embed + 2 * c.vocab * d + 4 * d;
    for i in 0..c.n_layers {
        let ffn = if c.is_moe_layer(i) {
            let e = c.router.n_experts;
            let experts = if all { e } else { c.router.top_k } + c.n_shared_experts;
            2 * (e * d + 3 * d * c.moe_intermediate * experts) + 4 * e
        } else {
            2 * 3 * d * c.intermediate
        };
        total += attn + norms + ffn;
    }
    total
}

/// Refuses to build `bytes` of random weights in host memory when the system says less is
/// available (the process would be killed part-way instead of failing with a message).
fn check_host_memory(name: &str, bytes: usize, device: Device) -> Result<()> {
    if !matches!(device, Device::Cpu { .. }) {
        return Ok(());
    }
    let avail = crate::runtime::available_memory()?;
    if bytes as u64 > avail {
        return Err(Error::BadConfig(format!(
            "random-weights shape `{name}` needs {:.1} GB of bf16 weights in memory on the CPU, \
             {:.1} GB is available; use a smaller shape or --device cuda",
            bytes as f64 / 1e9,
            avail as f64 / 1e9
        )));
    }
    Ok(())
}

/// Looks a shape up by name.
pub fn shape(name: &str) -> Result<Shape> {
    SHAPES
        .iter()
        .copied()
        .find(|s| s.name == name)
        .ok_or_else(|| {
            let mut known: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
            known.extend(DEEPSEEK_SHAPES);
            Error::BadConfig(format!(
                "unknown random-weights shape `{name}` (known: {})",
                known.join(", ")
            ))
        })
}

impl Shape {
    /// Parameters, embedding and output head included.
    pub fn params(&self) -> usize {
        let hd = self.hidden / self.heads;
        let attn = self.hidden * hd * (2 * self.heads + 2 * self.kv_heads);
        let per_layer = attn + 3 * self.hidden * self.ffn + 2 * self.hidden;
        let head = if self.tie_embeddings {
            0
        } else {
            self.vocab * self.hidden
        };
        self.layers * per_layer + self.vocab * self.hidden + head + self.hidden
    }

    pub fn config(&self) -> ModelConfig {
        let head_dim = self.hidden / self.heads;
        let spec = LayerSpec {
            attention: AttentionKind::Full,
            rope: RopeSpec {
                theta: self.rope_theta,
                dims: head_dim,
                style: RopeStyle::Half,
                scale: 1.0,
            },
        };
        ModelConfig {
            arch: "llama".into(),
            n_layers: self.layers,
            hidden: self.hidden,
            n_heads: self.heads,
            n_kv_heads: self.kv_heads,
            head_dim,
            ffn: self.ffn,
            vocab: self.vocab,
            context_len: 131072,
            rms_eps: 1e-5,
            tie_embeddings: self.tie_embeddings,
            layers: vec![spec; self.layers],
        }
    }
}

/// Deterministic random weights in HF naming.
#[derive(Debug, Clone)]
pub struct RandomWeights {
    pub seed: u64,
    pub tie_embeddings: bool,
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// The bf16 values of quads `q0..` (4 values, 8 bytes a quad) of a random tensor into `dst`:
/// each quad's bits come from its own index (SplitMix64 at `seed + (q + 1) * gamma`), so any
/// split of a tensor into slices fills the same values.
fn fill_bf16(dst: &mut [u8], q0: usize, e0: i32, seed: u64) {
    for (k, quad) in dst.chunks_mut(8).enumerate() {
        let s = splitmix(seed.wrapping_add(((q0 + k) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        let mut v = 0u64;
        for j in 0..4 {
            let c = (s >> (16 * j)) as u16;
            let exp = (e0 - ((c >> 7) & 3) as i32).clamp(1, 254) as u16;
            v |= u64::from((c & 0x8000) | (exp << 7) | (c & 0x7f)) << (16 * j);
        }
        let n = quad.len();
        quad.copy_from_slice(&v.to_le_bytes()[..n]);
    }
}

/// `n` bf16 values (little-endian bytes): sign, 7 random mantissa bits and one of four
/// exponents, so magnitudes spread over [scale/8, 2 scale). Every thread of the machine fills
/// a slice (a full-size model's expert tensors are a few million values each); the values do
/// not depend on the thread count.
pub fn random_bf16(n: usize, scale: f32, seed: u64) -> Vec<u8> {
    let e0 = scale.max(1e-30).log2().floor() as i32 + 127;
    let mut out = vec![0u8; n * 2];
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(64);
    // whole quads a slice, at least 64 K of them (smaller tensors take fewer threads)
    let quads = n.div_ceil(4);
    let per = quads.div_ceil(threads).max(1 << 16);
    if quads <= per {
        fill_bf16(&mut out, 0, e0, seed);
        return out;
    }
    std::thread::scope(|sc| {
        for (i, dst) in out.chunks_mut(per * 8).enumerate() {
            sc.spawn(move || fill_bf16(dst, i * per, e0, seed));
        }
    });
    out
}

impl WeightSource for RandomWeights {
    fn naming(&self) -> Naming {
        Naming::Hf
    }

    fn has(&self, name: &str) -> bool {
        !(self.tie_embeddings && name == "lm_head.weight")
    }

    fn weight(&self, name: &str, shape: &[usize]) -> Result<Weight> {
        let (rows, cols) = match *shape {
            [c] => (1, c),
            [r, c] => (r, c),
            _ => {
                return Err(Error::BadConfig(format!(
                    "random weight `{name}`: unsupported shape {shape:?}"
                )))
            }
        };
        if rows == 1 {
            return Ok(Weight::from_f32(1, cols, &vec![1.0; cols]));
        }
        let data = random_bf16(
            rows * cols,
            1.0 / (cols as f32).sqrt(),
            self.seed ^ name_hash(name),
        );
        Ok(Weight {
            dtype: DType::BF16,
            rows,
            cols,
            data: Bytes::Owned(Arc::new(data)),
        })
    }
}

/// The tiny byte-level tokenizer (written to a temporary GGUF and read back).
fn byte_tokenizer() -> Result<super::tokenizer::Tokenizer> {
    let (meta, _) = tiny::TinyLlama {
        layers: 0,
        ..Default::default()
    }
    .build();
    let path: PathBuf = std::env::temp_dir().join(format!(
        "deepinfer-random-tokenizer-{}.gguf",
        std::process::id()
    ));
    gguf_writer::write(&path, &meta, &[])?;
    let g = gguf::GgufFile::open(&path);
    let _ = std::fs::remove_file(&path);
    super::tokenizer::Tokenizer::from_gguf(&g?)
}

/// Builds a random-weight model of shape `name` on `device`.
pub fn load(name: &str, seed: u64, device: Device) -> Result<LoadedModel> {
    if let Some(json) = deepseek_shape(name) {
        let cfg = super::deepseek_config::DeepseekV3Config::from_json(&json)?;
        check_host_memory(name, deepseek_total_bytes(&cfg), device)?;
        let src = RandomWeights {
            seed,
            tie_embeddings: false,
        };
        tracing::info!(
            "{name}: {:.3} GB of bf16 weights active per decode token",
            deepseek_active_bytes(&cfg) as f64 / 1e9
        );
        return Ok(LoadedModel {
            path: PathBuf::from(format!("random:{name}")),
            model: arch::build_deepseek_v3(cfg, &src, device)?,
            tokenizer: byte_tokenizer()?,
            chat_template: None,
        });
    }
    let s = shape(name)?;
    check_host_memory(name, 2 * s.params(), device)?;
    let src = RandomWeights {
        seed,
        tie_embeddings: s.tie_embeddings,
    };
    let model = arch::build(s.config(), &src, device)?;
    Ok(LoadedModel {
        path: PathBuf::from(format!("random:{name}")),
        model,
        tokenizer: byte_tokenizer()?,
        chat_template: None,
    })
}

/// The model a CLI command runs: the random-weight shape `random` when given, else the
/// checkpoint `model` (or the default model) resolved as usual.
pub fn load_cli_model(
    model: Option<&std::path::Path>,
    random: Option<&str>,
    device: Device,
    log: &mut dyn FnMut(&str),
) -> Result<LoadedModel> {
    match random {
        Some(name) => {
            log(&format!("building random {name} weights on {device:?}"));
            load(name, 0, device)
        }
        None => {
            let path = super::fetch::resolve_model(model, log)?;
            super::load(&path, device)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_8b_has_eight_billion_parameters() {
        let p = shape("llama3-8b").unwrap().params();
        assert!((8_000_000_000..8_100_000_000).contains(&p), "{p}");
        assert!(shape("nope").is_err());
    }

    #[test]
    fn moonlight_shape_parses_and_counts_its_active_bytes() {
        let json = deepseek_shape("moonlight-16b-a3b").unwrap();
        let c = crate::model::deepseek_config::DeepseekV3Config::from_json(&json).unwrap();
        assert_eq!(
            (c.n_layers, c.router.n_experts, c.router.top_k),
            (27, 64, 6)
        );
        assert_eq!(c.q_lora_rank, None);
        // per MoE layer: 8 x 3 x 2048 x 1408 expert weights + the 64 x 2048 gate (bf16) and
        // 16 x 192 x 2048 + 576 x 2048 + 16 x 256 x 512 + 2048 x 2048 attention weights
        let b = deepseek_active_bytes(&c);
        eprintln!("moonlight-16b-a3b: {b} active bytes per decode token");
        assert!((5_100_000_000..5_200_000_000).contains(&b), "{b}");
        // all 64 routed experts, the whole embedding: about 16 B parameters
        let t = deepseek_total_bytes(&c);
        assert!((30_000_000_000..34_000_000_000).contains(&t), "{t}");
        assert!(deepseek_shape("nope").is_none());
    }

    #[test]
    fn shapes_larger_than_host_memory_are_refused_on_the_cpu() {
        let cpu = Device::Cpu { threads: 1 };
        let err = check_host_memory("huge", usize::MAX / 2, cpu).unwrap_err();
        assert!(err.to_string().contains("`huge` needs"), "{err}");
        assert!(check_host_memory("small", 1 << 20, cpu).is_ok());
    }

    #[test]
    fn random_bf16_is_deterministic_signed_and_scaled() {
        let a = random_bf16(3_000_001, 0.01, 7);
        assert_eq!(a, random_bf16(3_000_001, 0.01, 7));
        assert_ne!(a, random_bf16(3_000_001, 0.01, 8));
        // slices filled apart hold what one pass fills
        let e0 = 0.01f32.log2().floor() as i32 + 127;
        let mut halves = vec![0u8; a.len()];
        let (lo, hi) = halves.split_at_mut(500_000 * 8);
        fill_bf16(lo, 0, e0, 7);
        fill_bf16(hi, 500_000, e0, 7);
        assert_eq!(a, halves);
        let vals: Vec<f32> = a
            .chunks(2)
            .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect();
        let neg = vals.iter().filter(|v| **v < 0.0).count();
        assert!((neg as f64 / vals.len() as f64 - 0.5).abs() < 0.01);
        assert!(vals
            .iter()
            .all(|v| v.abs() >= 0.01 / 16.0 && v.abs() < 0.02 && v.is_finite()));
    }

    #[test]
    fn tiny_random_model_runs_on_the_cpu() {
        let m = load("tiny", 1, Device::Cpu { threads: 1 }).unwrap();
        let mut kv = m.model.new_kv(4, 16).unwrap();
        let mut b = crate::model::batch::Batch::default();
        b.push(&[1, 2, 3], 0, vec![0], true);
        let logits = m.model.forward(&b, &mut kv).unwrap();
        assert_eq!(logits.len(), 1024);
        assert!(logits.iter().all(|v| v.is_finite()));
        assert!(m.tokenizer.encode("hello").unwrap().len() > 1);
    }
}
