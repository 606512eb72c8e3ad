//! Reads a decoder's hyper-parameters from GGUF metadata (`{arch}.block_count` and friends).

use super::arch;
use super::gguf::GgufFile;
use super::hparams::{
    check_layer_count, AttentionKind, LayerSpec, ModelConfig, RopeSpec, RopeStyle,
};
use crate::error::{Error, Result};

/// Builds the [`ModelConfig`] of a GGUF file, refusing architectures this build cannot run.
pub fn model_config(g: &GgufFile) -> Result<ModelConfig> {
    let arch_name = g.str("general.architecture")?.to_string();
    if !arch::SUPPORTED.contains(&arch_name.as_str()) {
        return Err(arch::unknown(&arch_name));
    }
    let key = |k: &str| format!("{arch_name}.{k}");
    let usize_of = |k: &str| -> Result<usize> { Ok(g.u64(&key(k))? as usize) };
    let n_layers = check_layer_count(
        usize_of("block_count")?,
        &format!("GGUF metadata `{}`", key("block_count")),
    )?;
    let hidden = usize_of("embedding_length")?;
    let n_heads = usize_of("attention.head_count")?;
    let n_kv_heads = g
        .u64_opt(&key("attention.head_count_kv"))?
        .map_or(n_heads, |v| v as usize);
    if n_heads == 0 {
        return Err(Error::BadMetadata {
            key: key("attention.head_count"),
            reason: "is zero".into(),
        });
    }
    let head_dim = g
        .u64_opt(&key("attention.key_length"))?
        .map_or(hidden / n_heads, |v| v as usize);
    let ffn = usize_of("feed_forward_length")?;
    let context_len = usize_of("context_length")?;
    let rms_eps = g
        .f64_opt(&key("attention.layer_norm_rms_epsilon"))?
        .unwrap_or(1e-5) as f32;
    let theta = g.f64_opt(&key("rope.freq_base"))?.unwrap_or(10000.0) as f32;
    let rope_dims = g
        .u64_opt(&key("rope.dimension_count"))?
        .map_or(head_dim, |v| v as usize);
    let scale = match g.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
        None | Some("none") => 1.0,
        Some("linear") => g.f64_opt(&key("rope.scaling.factor"))?.unwrap_or(1.0) as f32,
        Some(other) => {
            return Err(Error::BadMetadata {
                key: key("rope.scaling.type"),
                reason: format!("rope scaling `{other}` is not supported"),
            })
        }
    };
    let attention = match g.u64_opt(&key("attention.sliding_window"))? {
        Some(w) if w > 0 => AttentionKind::Sliding { window: w as usize },
        _ => AttentionKind::Full,
    };
    let embd = g
        .tensors
        .get("token_embd.weight")
        .ok_or_else(|| Error::MissingTensor("token_embd.weight".into()))?;
    let vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
    let spec = LayerSpec {
        attention,
        rope: RopeSpec {
            theta,
            dims: rope_dims,
            // GGUF's llama converter permutes Q/K rows so adjacent pairs rotate together.
            style: RopeStyle::Interleaved,
            scale,
        },
    };
    let cfg = ModelConfig {
        arch: arch_name,
        n_layers,
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        ffn,
        vocab,
        context_len,
        rms_eps,
        tie_embeddings: !g.tensors.contains_key("output.weight"),
        layers: vec![spec; n_layers],
    };
    cfg.validate()?;
    Ok(cfg)
}
