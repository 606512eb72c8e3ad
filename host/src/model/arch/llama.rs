//! Llama-family decoder (Touvron et al., 2023, "LLaMA: Open and Efficient Foundation Language
//! Models"): RMSNorm, rotary positions, grouped-query attention, SwiGLU feed-forward. Covers
//! Llama 2/3, SmolLM2 and Mistral (sliding window via the per-layer spec).
//!
//! Weight names stay the checkpoint's: GGUF (`blk.N.attn_q.weight`) or HF
//! (`model.layers.N.self_attn.q_proj.weight`).

use crate::backend::{AttnParams, Backend, KvShape};
use crate::error::{Error, Result};
use crate::model::batch::Batch;
use crate::model::hparams::{AttentionKind, ModelConfig};
use crate::model::{CausalLm, KvCache, Logits, LogitsWant, Naming, WeightSource};

struct Layer<W> {
    attn_norm: W,
    wq: W,
    wk: W,
    wv: W,
    wo: W,
    ffn_norm: W,
    w_gate: W,
    w_up: W,
    w_down: W,
}

/// A loaded Llama-family model on backend `B`.
pub struct Llama<B: Backend> {
    cfg: ModelConfig,
    backend: B,
    embed: B::Weight,
    layers: Vec<Layer<B::Weight>>,
    norm: B::Weight,
    /// `None`: tied to the embedding.
    lm_head: Option<B::Weight>,
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

impl<B: Backend> Llama<B> {
    pub fn load(cfg: ModelConfig, src: &dyn WeightSource, backend: B) -> Result<Llama<B>> {
        cfg.validate()?;
        let naming = src.naming();
        let n = |l: Option<usize>, k: &str| tensor_name(naming, l, k);
        let (d, q, kv, f) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.ffn);
        let get = |name: String, shape: &[usize]| -> Result<B::Weight> {
            backend.prepare_weight(&src.weight(&name, shape)?)
        };
        let embed = get(n(None, "embed"), &[cfg.vocab, d])?;
        let lm_name = n(None, "lm_head");
        let lm_head = if src.has(&lm_name) {
            Some(get(lm_name, &[cfg.vocab, d])?)
        } else if cfg.tie_embeddings {
            None
        } else {
            return Err(Error::MissingTensor(lm_name));
        };
        let layers = (0..cfg.n_layers)
            .map(|i| {
                let l = Some(i);
                Ok(Layer {
                    attn_norm: get(n(l, "attn_norm"), &[d])?,
                    wq: get(n(l, "q"), &[q, d])?,
                    wk: get(n(l, "k"), &[kv, d])?,
                    wv: get(n(l, "v"), &[kv, d])?,
                    wo: get(n(l, "o"), &[d, q])?,
                    ffn_norm: get(n(l, "ffn_norm"), &[d])?,
                    w_gate: get(n(l, "gate"), &[f, d])?,
                    w_up: get(n(l, "up"), &[f, d])?,
                    w_down: get(n(l, "down"), &[d, f])?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = get(n(None, "norm"), &[d])?;
        Ok(Llama {
            cfg,
            backend,
            embed,
            layers,
            norm,
            lm_head,
        })
    }
}

impl<B: Backend> CausalLm for Llama<B> {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn device_name(&self) -> String {
        self.backend.device_name()
    }

    fn new_kv(&self, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        let c = &self.cfg;
        let kv = self.backend.new_kv(KvShape {
            layers: c.n_layers,
            num_blocks,
            block_size,
            kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        })?;
        Ok(KvCache::new(kv, block_size))
    }

    fn forward(&self, batch: &Batch, kv: &mut KvCache) -> Result<Vec<f32>> {
        let logits = self.logits(batch, kv)?;
        self.backend.to_host(&logits)
    }

    fn forward_select(&self, batch: &Batch, kv: &mut KvCache, want: LogitsWant) -> Result<Logits> {
        let logits = self.logits(batch, kv)?;
        Logits::from_backend(&self.backend, &logits, self.cfg.vocab, want)
    }
}

impl<B: Backend> Llama<B> {
    /// Runs `batch` and leaves the logits of `batch.logits_for` on the backend.
    fn logits(&self, batch: &Batch, kv: &mut KvCache) -> Result<B::Buf> {
        let c = &self.cfg;
        let be = &self.backend;
        let n = batch.n_tokens();
        let (d, qd, kvd, f) = (c.hidden, c.q_dim(), c.kv_dim(), c.ffn);
        let block_size = kv.block_size();
        let kv = kv.get_mut::<B::Kv>()?;
        let mut step = be.prepare_step(batch, block_size)?;
        let mut x = be.zeros(n * d)?;
        be.embed(&self.embed, &batch.tokens, &mut x)?;
        let mut h = be.zeros(n * d)?;
        let mut q = be.zeros(n * qd)?;
        let mut k = be.zeros(n * kvd)?;
        let mut v = be.zeros(n * kvd)?;
        let mut att = be.zeros(n * qd)?;
        let mut o = be.zeros(n * d)?;
        let mut g = be.zeros(n * f)?;
        let mut u = be.zeros(n * f)?;
        for (li, (layer, spec)) in self.layers.iter().zip(&c.layers).enumerate() {
            be.rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h)?;
            be.matmul(&layer.wq, &h, n, &mut q)?;
            be.matmul(&layer.wk, &h, n, &mut k)?;
            be.matmul(&layer.wv, &h, n, &mut v)?;
            be.rope(&mut step, spec.rope, &mut q, c.n_heads, c.head_dim)?;
            be.rope(&mut step, spec.rope, &mut k, c.n_kv_heads, c.head_dim)?;
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
            be.attention(&step, kv, li, &params, &q, &k, &v, &mut att)?;
            be.matmul(&layer.wo, &att, n, &mut o)?;
            be.add_assign(&mut x, &o)?;
            be.rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h)?;
            be.matmul(&layer.w_gate, &h, n, &mut g)?;
            be.matmul(&layer.w_up, &h, n, &mut u)?;
            be.silu_mul(&mut g, &u)?;
            be.matmul(&layer.w_down, &g, n, &mut o)?;
            be.add_assign(&mut x, &o)?;
        }
        let m = batch.logits_for.len();
        let mut sel = be.zeros(m * d)?;
        be.gather_rows(&x, d, &batch.logits_for, &mut sel)?;
        let mut normed = be.zeros(m * d)?;
        // The logits buffer first, so that the norm's launch directly precedes the head's
        // product (a backend may fold the two).
        let mut logits = be.zeros(m * c.vocab)?;
        be.rms_norm(&sel, &self.norm, c.rms_eps, &mut normed)?;
        be.matmul(
            self.lm_head.as_ref().unwrap_or(&self.embed),
            &normed,
            m,
            &mut logits,
        )?;
        Ok(logits)
    }
}
