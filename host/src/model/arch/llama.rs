//! Llama-family decoder (Touvron et al., 2023, "LLaMA: Open and Efficient Foundation Language
//! Models"): RMSNorm, rotary positions, grouped-query attention, SwiGLU feed-forward. Covers
//! Llama 2/3, SmolLM2 and Mistral (sliding window via the per-layer spec).
//!
//! Weight names stay the checkpoint's: GGUF (`blk.N.attn_q.weight`) or HF
//! (`model.layers.N.self_attn.q_proj.weight`).

use crate::backend::cpu::attention::{paged_attention, write_kv, AttnParams};
use crate::backend::cpu::kv::PagedKv;
use crate::backend::cpu::matmul::matmul;
use crate::backend::cpu::ops::{add_assign, rms_norm, silu_mul, RopeTable};
use crate::backend::cpu::pool::ThreadPool;
use crate::backend::cpu::quant::dequantize_row;
use crate::error::{Error, Result};
use crate::model::batch::Batch;
use crate::model::hparams::{AttentionKind, ModelConfig};
use crate::model::{CausalLm, Naming, WeightSource};
use crate::tensor::Weight;

struct Layer {
    attn_norm: Vec<f32>,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: Weight,
    ffn_norm: Vec<f32>,
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
}

/// A loaded Llama-family model.
pub struct Llama {
    cfg: ModelConfig,
    embed: Weight,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Weight,
}

/// Tensor names of the two checkpoint formats.
fn tensor_name(naming: Naming, layer: Option<usize>, key: &str) -> String {
    match (naming, layer) {
        (Naming::Gguf, None) => match key {
            "embed" => "token_embd.weight".into(),
            "norm" => "output_norm.weight".into(),
            _ => "output.weight".into(),
        },
        (Naming::Gguf, Some(i)) => format!(
            "blk.{i}.{}.weight",
            match key {
                "attn_norm" => "attn_norm",
                "q" => "attn_q",
                "k" => "attn_k",
                "v" => "attn_v",
                "o" => "attn_output",
                "ffn_norm" => "ffn_norm",
                "gate" => "ffn_gate",
                "up" => "ffn_up",
                _ => "ffn_down",
            }
        ),
        (Naming::Hf, None) => match key {
            "embed" => "model.embed_tokens.weight".into(),
            "norm" => "model.norm.weight".into(),
            _ => "lm_head.weight".into(),
        },
        (Naming::Hf, Some(i)) => format!(
            "model.layers.{i}.{}.weight",
            match key {
                "attn_norm" => "input_layernorm",
                "q" => "self_attn.q_proj",
                "k" => "self_attn.k_proj",
                "v" => "self_attn.v_proj",
                "o" => "self_attn.o_proj",
                "ffn_norm" => "post_attention_layernorm",
                "gate" => "mlp.gate_proj",
                "up" => "mlp.up_proj",
                _ => "mlp.down_proj",
            }
        ),
    }
}

/// A norm weight as f32.
fn vector(src: &dyn WeightSource, name: &str, len: usize) -> Result<Vec<f32>> {
    let w = src.weight(name, &[len])?;
    let mut out = vec![0.0; len];
    dequantize_row(w.dtype, w.bytes(), &mut out);
    Ok(out)
}

impl Llama {
    pub fn load(cfg: ModelConfig, src: &dyn WeightSource) -> Result<Llama> {
        cfg.validate()?;
        let naming = src.naming();
        let n = |l: Option<usize>, k: &str| tensor_name(naming, l, k);
        let (d, q, kv, f) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.ffn);
        let embed = src.weight(&n(None, "embed"), &[cfg.vocab, d])?;
        let lm_name = n(None, "lm_head");
        let lm_head = if src.has(&lm_name) {
            src.weight(&lm_name, &[cfg.vocab, d])?
        } else if cfg.tie_embeddings {
            embed.clone()
        } else {
            return Err(Error::MissingTensor(lm_name));
        };
        let layers = (0..cfg.n_layers)
            .map(|i| {
                let l = Some(i);
                Ok(Layer {
                    attn_norm: vector(src, &n(l, "attn_norm"), d)?,
                    wq: src.weight(&n(l, "q"), &[q, d])?,
                    wk: src.weight(&n(l, "k"), &[kv, d])?,
                    wv: src.weight(&n(l, "v"), &[kv, d])?,
                    wo: src.weight(&n(l, "o"), &[d, q])?,
                    ffn_norm: vector(src, &n(l, "ffn_norm"), d)?,
                    w_gate: src.weight(&n(l, "gate"), &[f, d])?,
                    w_up: src.weight(&n(l, "up"), &[f, d])?,
                    w_down: src.weight(&n(l, "down"), &[d, f])?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = vector(src, &n(None, "norm"), d)?;
        Ok(Llama { cfg, embed, layers, norm, lm_head })
    }
}

impl CausalLm for Llama {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn forward(&self, pool: &ThreadPool, batch: &Batch, kv: &mut PagedKv) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let n = batch.n_tokens();
        let (d, qd, kvd, f) = (c.hidden, c.q_dim(), c.kv_dim(), c.ffn);
        for &t in &batch.tokens {
            if t as usize >= c.vocab {
                return Err(Error::BadRequest(format!("token id {t} is outside the vocabulary ({})", c.vocab)));
            }
        }
        let mut x = vec![0.0f32; n * d];
        for (i, &t) in batch.tokens.iter().enumerate() {
            let row = self.embed.row_bytes();
            let bytes = &self.embed.bytes()[t as usize * row..(t as usize + 1) * row];
            dequantize_row(self.embed.dtype, bytes, &mut x[i * d..(i + 1) * d]);
        }
        let positions = batch.positions();
        let mut tables: Vec<RopeTable> = Vec::new();
        let mut h = vec![0.0f32; n * d];
        let mut q = vec![0.0f32; n * qd];
        let mut k = vec![0.0f32; n * kvd];
        let mut v = vec![0.0f32; n * kvd];
        let mut att = vec![0.0f32; n * qd];
        let mut o = vec![0.0f32; n * d];
        let mut g = vec![0.0f32; n * f];
        let mut u = vec![0.0f32; n * f];
        for (li, (layer, spec)) in self.layers.iter().zip(&c.layers).enumerate() {
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h);
            matmul(pool, &layer.wq, &h, n, &mut q);
            matmul(pool, &layer.wk, &h, n, &mut k);
            matmul(pool, &layer.wv, &h, n, &mut v);
            let table = match tables.iter().position(|t| t.spec == spec.rope) {
                Some(i) => &tables[i],
                None => {
                    tables.push(RopeTable::new(spec.rope, &positions));
                    tables.last().expect("just pushed")
                }
            };
            table.apply(&mut q, c.n_heads, c.head_dim);
            table.apply(&mut k, c.n_kv_heads, c.head_dim);
            write_kv(kv, li, batch, &k, &v);
            let params = AttnParams {
                n_heads: c.n_heads,
                n_kv_heads: c.n_kv_heads,
                head_dim: c.head_dim,
                scale: 1.0 / (c.head_dim as f32).sqrt(),
                window: match spec.attention {
                    AttentionKind::Full => None,
                    AttentionKind::Sliding { window } => Some(window),
                },
            };
            paged_attention(pool, &params, batch, &q, kv, li, &mut att);
            matmul(pool, &layer.wo, &att, n, &mut o);
            add_assign(&mut x, &o);
            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h);
            matmul(pool, &layer.w_gate, &h, n, &mut g);
            matmul(pool, &layer.w_up, &h, n, &mut u);
            silu_mul(&mut g, &u);
            matmul(pool, &layer.w_down, &g, n, &mut o);
            add_assign(&mut x, &o);
        }
        let m = batch.logits_for.len();
        let mut sel = vec![0.0f32; m * d];
        for (j, &t) in batch.logits_for.iter().enumerate() {
            rms_norm(&x[t * d..(t + 1) * d], &self.norm, c.rms_eps, &mut sel[j * d..(j + 1) * d]);
        }
        let mut logits = vec![0.0f32; m * c.vocab];
        matmul(pool, &self.lm_head, &sel, m, &mut logits);
        Ok(logits)
    }
}
