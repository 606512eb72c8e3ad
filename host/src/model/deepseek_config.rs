//! DeepSeek-V3 `config.json`, resolved once: MLA dimensions, MoE routing, dense/MoE layer
//! split, MTP layer count, YaRN rope scaling and the FP8 block size. Raw JSON in, a validated
//! [`DeepseekV3Config`] out; every error names the key. No tensors are touched here.

use serde_json::Value;

use super::hparams::{
    check_layer_count, AttentionKind, LayerSpec, ModelConfig, RopeSpec, RopeStyle, Yarn,
};
use super::moe::{RouterConfig, ScoreFunc};
use crate::error::{Error, Result};

/// Architectures (HF `model_type`) that load through the DeepSeek-V3 code.
pub const MODEL_TYPES: &[&str] = &["deepseek_v3", "kimi_k2"];

/// A resolved DeepSeek-V3 configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepseekV3Config {
    pub model_type: String,
    pub vocab: usize,
    pub hidden: usize,
    /// Width of the dense layers' SwiGLU.
    pub intermediate: usize,
    /// Width of one routed expert.
    pub moe_intermediate: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    /// `None`: queries come straight from `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub n_shared_experts: usize,
    pub router: RouterConfig,
    /// Layers `0..first_k_dense_replace` use a dense SwiGLU, the rest MoE.
    pub first_k_dense_replace: usize,
    /// MTP ("nextn") layers stored after the main layers.
    pub num_nextn_predict_layers: usize,
    pub context_len: usize,
    pub rms_eps: f32,
    pub tie_embeddings: bool,
    pub rope_theta: f32,
    /// YaRN scaling, if the config asks for it.
    pub yarn: Option<Yarn>,
    /// Rotary pairs are adjacent dimensions (DeepSeek's layout) rather than halves.
    pub rope_interleave: bool,
    /// FP8 (e4m3) weights with block scales `[rows, cols]` per block.
    pub fp8_block: Option<[usize; 2]>,
}

fn bad(key: &str, what: impl std::fmt::Display) -> Error {
    Error::BadConfig(format!("config.json: `{key}` {what}"))
}

fn get<'a>(cfg: &'a Value, key: &str) -> Option<&'a Value> {
    cfg.get(key).filter(|v| !v.is_null())
}

fn usize_req(cfg: &Value, key: &str) -> Result<usize> {
    let v = get(cfg, key).ok_or_else(|| bad(key, "is missing"))?;
    v.as_u64()
        .map(|x| x as usize)
        .ok_or_else(|| bad(key, format!("must be a non-negative integer, got {v}")))
}

fn usize_or(cfg: &Value, key: &str, default: usize) -> Result<usize> {
    match get(cfg, key) {
        None => Ok(default),
        Some(v) => v
            .as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| bad(key, format!("must be a non-negative integer, got {v}"))),
    }
}

fn f64_or(cfg: &Value, key: &str, default: f64) -> Result<f64> {
    match get(cfg, key) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| bad(key, format!("must be a number, got {v}"))),
    }
}

fn bool_or(cfg: &Value, key: &str, default: bool) -> Result<bool> {
    match get(cfg, key) {
        None => Ok(default),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| bad(key, format!("must be true or false, got {v}"))),
    }
}

fn str_or<'a>(cfg: &'a Value, key: &str, default: &'a str) -> Result<&'a str> {
    match get(cfg, key) {
        None => Ok(default),
        Some(v) => v
            .as_str()
            .ok_or_else(|| bad(key, format!("must be a string, got {v}"))),
    }
}

/// Reads the rope settings: new-style `rope_parameters` or old-style `rope_theta` +
/// `rope_scaling`.
fn rope(cfg: &Value, max_pos: usize) -> Result<(f32, Option<Yarn>)> {
    let params = get(cfg, "rope_parameters");
    let scaling = params.or_else(|| get(cfg, "rope_scaling"));
    let key = if params.is_some() {
        "rope_parameters"
    } else {
        "rope_scaling"
    };
    let theta = match params.and_then(|p| get(p, "rope_theta")) {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| bad("rope_parameters.rope_theta", "must be a number"))?,
        None => f64_or(cfg, "rope_theta", 10000.0)?,
    };
    if theta.is_nan() || theta <= 0.0 {
        return Err(bad("rope_theta", format!("must be positive, got {theta}")));
    }
    let Some(s) = scaling else {
        return Ok((theta as f32, None));
    };
    let kind = get(s, "rope_type").or_else(|| get(s, "type"));
    let kind = kind.and_then(|v| v.as_str()).unwrap_or("default");
    match kind {
        "default" => Ok((theta as f32, None)),
        "yarn" => {
            let orig = usize_or(s, "original_max_position_embeddings", max_pos)?;
            let factor = match get(s, "factor") {
                Some(v) => v
                    .as_f64()
                    .ok_or_else(|| bad(&format!("{key}.factor"), "must be a number"))?,
                None => max_pos as f64 / orig.max(1) as f64,
            };
            if factor.is_nan() || factor <= 0.0 || orig == 0 {
                return Err(bad(
                    key,
                    format!("yarn factor {factor} and original_max_position_embeddings {orig} must be positive"),
                ));
            }
            let num = |k: &str| -> Result<Option<f64>> {
                match get(s, k) {
                    None => Ok(None),
                    Some(v) => v
                        .as_f64()
                        .map(Some)
                        .ok_or_else(|| bad(&format!("{key}.{k}"), "must be a number")),
                }
            };
            Ok((
                theta as f32,
                Some(Yarn {
                    factor,
                    original_max_position: orig,
                    beta_fast: num("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
                    beta_slow: num("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
                    mscale: num("mscale")?,
                    mscale_all_dim: num("mscale_all_dim")?,
                    attention_factor: num("attention_factor")?,
                    truncate: get(s, "truncate").and_then(|v| v.as_bool()).unwrap_or(true),
                }),
            ))
        }
        other => Err(bad(
            &format!("{key}.rope_type"),
            format!("`{other}` is not supported for DeepSeek (default, yarn)"),
        )),
    }
}

fn fp8_block(cfg: &Value) -> Result<Option<[usize; 2]>> {
    let Some(q) = get(cfg, "quantization_config") else {
        return Ok(None);
    };
    let method = str_or(q, "quant_method", "")?;
    if method != "fp8" {
        return Err(bad(
            "quantization_config.quant_method",
            format!("`{method}` is not supported (fp8)"),
        ));
    }
    let fmt = str_or(q, "fmt", "e4m3")?;
    if fmt != "e4m3" {
        return Err(bad(
            "quantization_config.fmt",
            format!("`{fmt}` is not supported (e4m3)"),
        ));
    }
    let block = match get(q, "weight_block_size") {
        None => [128, 128],
        Some(Value::Array(a)) if a.len() == 2 => {
            let d = |v: &Value| v.as_u64().filter(|&x| x > 0).map(|x| x as usize);
            match (d(&a[0]), d(&a[1])) {
                (Some(r), Some(c)) => [r, c],
                _ => {
                    return Err(bad(
                        "quantization_config.weight_block_size",
                        "must be two positive integers",
                    ))
                }
            }
        }
        Some(v) => {
            return Err(bad(
                "quantization_config.weight_block_size",
                format!("must be [rows, cols], got {v}"),
            ))
        }
    };
    Ok(Some(block))
}

impl DeepseekV3Config {
    /// Resolves and validates a `config.json`.
    pub fn from_json(cfg: &Value) -> Result<DeepseekV3Config> {
        let model_type = str_or(cfg, "model_type", "")?.to_string();
        if !MODEL_TYPES.contains(&model_type.as_str()) {
            return Err(bad(
                "model_type",
                format!("`{model_type}` is not a DeepSeek-V3 model type"),
            ));
        }
        let act = str_or(cfg, "hidden_act", "silu")?;
        if act != "silu" {
            return Err(bad(
                "hidden_act",
                format!("`{act}` is not supported (silu)"),
            ));
        }
        if bool_or(cfg, "attention_bias", false)? {
            return Err(bad("attention_bias", "true is not supported"));
        }
        let n_heads = usize_req(cfg, "num_attention_heads")?;
        if let Some(kv) = get(cfg, "num_key_value_heads").and_then(|v| v.as_u64()) {
            if kv as usize != n_heads {
                return Err(bad(
                    "num_key_value_heads",
                    format!("{kv} differs from num_attention_heads {n_heads} (MLA has one KV head per query head)"),
                ));
            }
        }
        let max_pos = usize_or(cfg, "max_position_embeddings", 4096)?;
        let (rope_theta, yarn) = rope(cfg, max_pos)?;
        let q_lora_rank = match usize_or(cfg, "q_lora_rank", 0)? {
            0 => None,
            r => Some(r),
        };
        let n_experts = usize_req(cfg, "n_routed_experts")?;
        let topk_method = str_or(cfg, "topk_method", "noaux_tc")?;
        let (n_group, topk_group) = match topk_method {
            "noaux_tc" | "group_limited_greedy" => (
                usize_or(cfg, "n_group", 1)?,
                usize_or(cfg, "topk_group", 1)?,
            ),
            "greedy" => (1, 1),
            other => {
                return Err(bad(
                    "topk_method",
                    format!("`{other}` is not supported (noaux_tc, group_limited_greedy, greedy)"),
                ))
            }
        };
        let router = RouterConfig {
            n_experts,
            top_k: usize_req(cfg, "num_experts_per_tok")?,
            score: ScoreFunc::parse(str_or(cfg, "scoring_func", "sigmoid")?)?,
            n_group,
            topk_group,
            norm_topk_prob: bool_or(cfg, "norm_topk_prob", true)?,
            scaling: f64_or(cfg, "routed_scaling_factor", 1.0)? as f32,
        };
        router.validate()?;
        if usize_or(cfg, "moe_layer_freq", 1)? != 1 {
            return Err(bad("moe_layer_freq", "other than 1 is not supported"));
        }
        let c = DeepseekV3Config {
            model_type,
            vocab: usize_req(cfg, "vocab_size")?,
            hidden: usize_req(cfg, "hidden_size")?,
            intermediate: usize_req(cfg, "intermediate_size")?,
            moe_intermediate: usize_req(cfg, "moe_intermediate_size")?,
            n_layers: check_layer_count(
                usize_req(cfg, "num_hidden_layers")?,
                "config.json: `num_hidden_layers`",
            )?,
            n_heads,
            q_lora_rank,
            kv_lora_rank: usize_req(cfg, "kv_lora_rank")?,
            qk_nope_head_dim: usize_req(cfg, "qk_nope_head_dim")?,
            qk_rope_head_dim: usize_req(cfg, "qk_rope_head_dim")?,
            v_head_dim: usize_req(cfg, "v_head_dim")?,
            n_shared_experts: usize_or(cfg, "n_shared_experts", 0)?,
            router,
            first_k_dense_replace: usize_or(cfg, "first_k_dense_replace", 0)?,
            num_nextn_predict_layers: usize_or(cfg, "num_nextn_predict_layers", 0)?,
            context_len: max_pos,
            rms_eps: f64_or(cfg, "rms_norm_eps", 1e-6)? as f32,
            tie_embeddings: bool_or(cfg, "tie_word_embeddings", false)?,
            rope_theta,
            yarn,
            rope_interleave: bool_or(cfg, "rope_interleave", true)?,
            fp8_block: fp8_block(cfg)?,
        };
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<()> {
        for (k, v) in [
            ("vocab_size", self.vocab),
            ("hidden_size", self.hidden),
            ("intermediate_size", self.intermediate),
            ("moe_intermediate_size", self.moe_intermediate),
            ("num_hidden_layers", self.n_layers),
            ("num_attention_heads", self.n_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("v_head_dim", self.v_head_dim),
            ("max_position_embeddings", self.context_len),
        ] {
            if v == 0 {
                return Err(bad(k, "must be positive"));
            }
        }
        if self.qk_rope_head_dim == 0 || !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(bad(
                "qk_rope_head_dim",
                format!("must be positive and even, got {}", self.qk_rope_head_dim),
            ));
        }
        if self.first_k_dense_replace > self.n_layers {
            return Err(bad(
                "first_k_dense_replace",
                format!(
                    "{} exceeds num_hidden_layers {}",
                    self.first_k_dense_replace, self.n_layers
                ),
            ));
        }
        if self.rms_eps.is_nan() || self.rms_eps < 0.0 {
            return Err(bad("rms_norm_eps", "must be non-negative"));
        }
        Ok(())
    }

    /// Query/key head width (`nope + rope`).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Softmax scale: `1/sqrt(qk_head_dim)`, times YaRN's `mscale(factor, mscale_all_dim)^2`.
    pub fn softmax_scale(&self) -> f32 {
        let base = 1.0 / (self.qk_head_dim() as f64).sqrt();
        let m = match &self.yarn {
            Some(y) => match y.mscale_all_dim {
                Some(a) if a != 0.0 => Yarn::get_mscale(y.factor, a),
                _ => 1.0,
            },
            None => 1.0,
        };
        (base * m * m) as f32
    }

    /// The rope of the rotary part of each head.
    pub fn rope_spec(&self) -> RopeSpec {
        RopeSpec {
            theta: self.rope_theta,
            dims: self.qk_rope_head_dim,
            style: if self.rope_interleave {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Half
            },
            scale: 1.0,
        }
    }

    /// The architecture-neutral view the engine uses (heads of `qk_head_dim`, one KV head per
    /// query head; the MLA cache itself is smaller, see [`DeepseekV3Config::mla_cache_width`]).
    pub fn model_config(&self) -> ModelConfig {
        let spec = LayerSpec {
            attention: AttentionKind::Full,
            rope: self.rope_spec(),
        };
        ModelConfig {
            arch: self.model_type.clone(),
            n_layers: self.n_layers,
            hidden: self.hidden,
            n_heads: self.n_heads,
            n_kv_heads: self.n_heads,
            head_dim: self.qk_head_dim(),
            ffn: self.intermediate,
            vocab: self.vocab,
            context_len: self.context_len,
            rms_eps: self.rms_eps,
            tie_embeddings: self.tie_embeddings,
            layers: vec![spec; self.n_layers],
        }
    }

    /// Floats one token takes in one layer of the MLA cache: latent + shared rope key.
    pub fn mla_cache_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Whether layer `i` (main layers, then MTP layers) is a MoE layer.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        i >= self.first_k_dense_replace
    }
}
