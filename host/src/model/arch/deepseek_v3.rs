//! DeepSeek-V3 (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report"; also DeepSeek-R1, Kimi K2,
//! Moonlight): multi-head latent attention over a compressed latent cache, the first
//! `first_k_dense_replace` layers dense and the rest DeepSeekMoE (sigmoid routing with a
//! correction bias, group-limited top-k, shared experts), and MTP ("nextn") layers that turn the
//! main model's hidden state and the next token's embedding into next-next-token logits.
//!
//! Weight names stay the checkpoint's (`model.layers.N.self_attn.kv_a_proj_with_mqa.weight`,
//! `model.layers.N.mlp.experts.E.gate_proj.weight`, MTP layer `L` at index `num_hidden_layers + L`
//! with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`). Everything runs through the
//! [`Backend`] trait: MLA attention over the backend's latent cache
//! ([`Backend::mla_attention`]), the MoE layers through [`Backend::moe`]; the same file drives
//! the CPU and the CUDA backend.

use std::path::Path;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::kv_cache::{KvCacheLayout, KvCacheSpec, LayerGroup};
use crate::model::batch::Batch;
use crate::model::deepseek_config::DeepseekV3Config;
use crate::model::hparams::{rope_inv_freq, ModelConfig};
use crate::model::mla::{MlaDims, MlaParams, MlaPath, MlaWeights};
use crate::model::moe::{ExpertLoad, Mlp, MoeLayer, Router};
use crate::model::{CausalLm, KvCache, Logits, LogitsWant, WeightSource};

/// Epsilon of the latent RMSNorms (`q_a_layernorm`, `kv_a_layernorm`): the reference builds
/// them with its default, not `rms_norm_eps`.
const LATENT_NORM_EPS: f32 = 1e-6;

enum QProj<W> {
    Direct(W),
    Lora { a: W, norm: W, b: W, rank: usize },
}

struct Attn<W> {
    q: QProj<W>,
    kv_a: W,
    /// `kv_a_layernorm` gain.
    kv_a_norm: W,
    /// `kv_b_proj`, `[heads * (nope + v), kv_lora_rank]` (both MLA forms read it).
    kv_b: W,
    o: W,
}

enum Ffn<W> {
    Dense(Mlp<W>),
    Moe(MoeLayer<W>),
}

struct Block<W> {
    attn_norm: W,
    attn: Attn<W>,
    ffn_norm: W,
    ffn: Ffn<W>,
}

struct Mtp<W> {
    enorm: W,
    hnorm: W,
    eh_proj: W,
    block: Block<W>,
    norm: W,
}

/// A loaded DeepSeek-V3 model on backend `B`.
pub struct DeepseekV3<B: Backend> {
    cfg: DeepseekV3Config,
    model_cfg: ModelConfig,
    backend: B,
    embed: B::Weight,
    blocks: Vec<Block<B::Weight>>,
    norm: B::Weight,
    lm_head: Option<B::Weight>,
    mtp: Vec<Mtp<B::Weight>>,
    /// Rotary inverse frequencies (YaRN-corrected), a vector weight.
    inv_freq: B::Weight,
    rope_scale: f32,
    softmax_scale: f32,
    path: MlaPath,
}

fn host_f32(w: &crate::tensor::Weight) -> Vec<f32> {
    let mut v = vec![0.0f32; w.rows * w.cols];
    for (r, out) in v.chunks_exact_mut(w.cols).enumerate() {
        let row = &w.bytes()[r * w.row_bytes()..(r + 1) * w.row_bytes()];
        crate::backend::cpu::quant::dequantize_row(w.dtype, row, out);
    }
    v
}

struct Loader<'a, B: Backend> {
    cfg: &'a DeepseekV3Config,
    src: &'a dyn WeightSource,
    be: &'a B,
}

impl<B: Backend> Loader<'_, B> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<B::Weight> {
        self.be.prepare_weight(&self.src.weight(name, shape)?)
    }

    fn mlp(&self, p: &str, inter: usize) -> Result<Mlp<B::Weight>> {
        let d = self.cfg.hidden;
        Ok(Mlp {
            gate: self.get(&format!("{p}.gate_proj.weight"), &[inter, d])?,
            up: self.get(&format!("{p}.up_proj.weight"), &[inter, d])?,
            down: self.get(&format!("{p}.down_proj.weight"), &[d, inter])?,
            inter,
        })
    }

    fn attn(&self, p: &str) -> Result<Attn<B::Weight>> {
        let c = self.cfg;
        let (d, h) = (c.hidden, c.n_heads);
        let qw = h * c.qk_head_dim();
        let q = match c.q_lora_rank {
            None => QProj::Direct(self.get(&format!("{p}.q_proj.weight"), &[qw, d])?),
            Some(rank) => QProj::Lora {
                a: self.get(&format!("{p}.q_a_proj.weight"), &[rank, d])?,
                norm: self.get(&format!("{p}.q_a_layernorm.weight"), &[rank])?,
                b: self.get(&format!("{p}.q_b_proj.weight"), &[qw, rank])?,
                rank,
            },
        };
        let r = c.kv_lora_rank;
        let kv_b = self.get(
            &format!("{p}.kv_b_proj.weight"),
            &[h * (c.qk_nope_head_dim + c.v_head_dim), r],
        )?;
        let kv_a_norm = self.get(&format!("{p}.kv_a_layernorm.weight"), &[r])?;
        Ok(Attn {
            q,
            kv_a: self.get(
                &format!("{p}.kv_a_proj_with_mqa.weight"),
                &[r + c.qk_rope_head_dim, d],
            )?,
            kv_a_norm,
            kv_b,
            o: self.get(&format!("{p}.o_proj.weight"), &[d, h * c.v_head_dim])?,
        })
    }

    fn moe(&self, p: &str) -> Result<MoeLayer<B::Weight>> {
        let c = self.cfg;
        let e = c.router.n_experts;
        let gate = self.get(&format!("{p}.gate.weight"), &[e, c.hidden])?;
        let bias_name = format!("{p}.gate.e_score_correction_bias");
        let bias = if self.src.has(&bias_name) {
            Some(host_f32(&self.src.weight(&bias_name, &[e])?))
        } else {
            None
        };
        let experts = (0..e)
            .map(|j| self.mlp(&format!("{p}.experts.{j}"), c.moe_intermediate))
            .collect::<Result<Vec<_>>>()?;
        let shared = match c.n_shared_experts {
            0 => None,
            k => Some(self.mlp(&format!("{p}.shared_experts"), k * c.moe_intermediate)?),
        };
        MoeLayer::new(
            c.router.clone(),
            Router::Learned { gate, bias },
            experts,
            shared,
        )
    }

    fn block(&self, i: usize) -> Result<Block<B::Weight>> {
        let p = format!("model.layers.{i}");
        let d = self.cfg.hidden;
        let ffn = if self.cfg.is_moe_layer(i) {
            Ffn::Moe(self.moe(&format!("{p}.mlp"))?)
        } else {
            Ffn::Dense(self.mlp(&format!("{p}.mlp"), self.cfg.intermediate)?)
        };
        Ok(Block {
            attn_norm: self.get(&format!("{p}.input_layernorm.weight"), &[d])?,
            attn: self.attn(&format!("{p}.self_attn"))?,
            ffn_norm: self.get(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
            ffn,
        })
    }
}

impl<B: Backend> DeepseekV3<B> {
    /// Loads the model from `src`. MTP layers are loaded when their tensors are present.
    pub fn load(cfg: DeepseekV3Config, src: &dyn WeightSource, backend: B) -> Result<Self> {
        let l = Loader {
            cfg: &cfg,
            src,
            be: &backend,
        };
        let (d, v) = (cfg.hidden, cfg.vocab);
        let embed = l.get("model.embed_tokens.weight", &[v, d])?;
        let blocks = (0..cfg.n_layers)
            .map(|i| l.block(i))
            .collect::<Result<Vec<_>>>()?;
        let norm = l.get("model.norm.weight", &[d])?;
        let lm_head = if src.has("lm_head.weight") {
            Some(l.get("lm_head.weight", &[v, d])?)
        } else if cfg.tie_embeddings {
            None
        } else {
            return Err(Error::MissingTensor("lm_head.weight".into()));
        };
        let mut mtp = Vec::new();
        for k in 0..cfg.num_nextn_predict_layers {
            let i = cfg.n_layers + k;
            let p = format!("model.layers.{i}");
            if !src.has(&format!("{p}.eh_proj.weight")) {
                tracing::warn!(
                    "config lists {} MTP layers, the checkpoint has {k}",
                    cfg.num_nextn_predict_layers
                );
                break;
            }
            mtp.push(Mtp {
                enorm: l.get(&format!("{p}.enorm.weight"), &[d])?,
                hnorm: l.get(&format!("{p}.hnorm.weight"), &[d])?,
                eh_proj: l.get(&format!("{p}.eh_proj.weight"), &[d, 2 * d])?,
                block: l.block(i)?,
                norm: l.get(&format!("{p}.shared_head.norm.weight"), &[d])?,
            });
        }
        let (inv_freq, rope_scale) = match &cfg.yarn {
            Some(y) => (
                y.inv_freq(cfg.rope_theta as f64, cfg.qk_rope_head_dim),
                y.cos_sin_scale() as f32,
            ),
            None => (
                rope_inv_freq(cfg.rope_theta as f64, cfg.qk_rope_head_dim),
                1.0,
            ),
        };
        // the MTP layers take host hidden states: fail now rather than mid-forward (after the
        // weights, which may fix the backend's activation type)
        if !mtp.is_empty() {
            backend.upload(&[0.0])?;
        }
        let inv_freq = backend.prepare_weight(&crate::tensor::Weight::from_f32(
            1,
            inv_freq.len(),
            &inv_freq,
        ))?;
        Ok(DeepseekV3 {
            model_cfg: cfg.model_config(),
            softmax_scale: cfg.softmax_scale(),
            cfg,
            backend,
            embed,
            blocks,
            norm,
            lm_head,
            mtp,
            inv_freq,
            rope_scale,
            path: MlaPath::Auto,
        })
    }

    /// Reads `config.json` and the safetensors of an HF folder.
    pub fn open(dir: &Path, backend: B) -> Result<Self> {
        let json = crate::model::hf::read_json(&dir.join("config.json"))?;
        let cfg = DeepseekV3Config::from_json(&json)?;
        let mut st = crate::model::hf::SafetensorsFolder::open(dir)?;
        if let Some(b) = cfg.fp8_block {
            st.set_fp8_block(b);
        }
        Self::load(cfg, &st, backend)
    }

    /// Forces one MLA form (tests compare them); [`MlaPath::Auto`] by default.
    pub fn set_mla_path(&mut self, path: MlaPath) {
        self.path = path;
    }

    pub fn deepseek_config(&self) -> &DeepseekV3Config {
        &self.cfg
    }

    /// MTP layers loaded.
    pub fn num_mtp_layers(&self) -> usize {
        self.mtp.len()
    }

    /// Expert-load counters of each MoE layer (main layers, then MTP layers).
    pub fn expert_load(&self) -> Vec<(usize, ExpertLoad)> {
        let blocks = self.blocks.iter().chain(self.mtp.iter().map(|m| &m.block));
        blocks
            .enumerate()
            .filter_map(|(i, b)| match &b.ffn {
                Ffn::Moe(m) => match self.backend.expert_load(m) {
                    Ok(l) => Some((i, l)),
                    Err(e) => {
                        tracing::warn!("expert load of layer {i}: {e}");
                        None
                    }
                },
                Ffn::Dense(_) => None,
            })
            .collect()
    }

    fn dims(&self) -> MlaDims {
        MlaDims {
            heads: self.cfg.n_heads,
            nope: self.cfg.qk_nope_head_dim,
            rope: self.cfg.qk_rope_head_dim,
            v: self.cfg.v_head_dim,
            latent: self.cfg.kv_lora_rank,
        }
    }

    fn mla_params(&self) -> MlaParams {
        MlaParams {
            dims: self.dims(),
            scale: self.softmax_scale,
            rope_scale: self.rope_scale,
            interleaved: self.cfg.rope_interleave,
            eps: LATENT_NORM_EPS,
            path: self.path,
        }
    }

    fn mla(
        &self,
        a: &Attn<B::Weight>,
        layer: usize,
        h: &B::Buf,
        step: &mut B::Step,
        n: usize,
        kv: &mut B::MlaKv,
    ) -> Result<B::Buf> {
        let be = &self.backend;
        let c = &self.cfg;
        let dims = self.dims();
        let (r, dr) = (c.kv_lora_rank, c.qk_rope_head_dim);
        // Both products of `h` back to back (a backend may fuse them and the norm before them
        // into one launch), then the rest of the query path. Each output is made just before
        // the op that writes it (a backend may then skip zeroing it).
        let (mut q, kva) = match &a.q {
            QProj::Direct(w) => {
                let mut q = be.zeros(n * dims.q_width())?;
                be.matmul(w, h, n, &mut q)?;
                let mut kva = be.zeros(n * (r + dr))?;
                be.matmul(&a.kv_a, h, n, &mut kva)?;
                (q, kva)
            }
            QProj::Lora {
                a: qa_w,
                norm,
                b,
                rank,
            } => {
                let mut qa = be.zeros(n * rank)?;
                be.matmul(qa_w, h, n, &mut qa)?;
                let mut kva = be.zeros(n * (r + dr))?;
                be.matmul(&a.kv_a, h, n, &mut kva)?;
                let mut qn = be.zeros(n * rank)?;
                be.rms_norm(&qa, norm, LATENT_NORM_EPS, &mut qn)?;
                let mut q = be.zeros(n * dims.q_width())?;
                be.matmul(b, &qn, n, &mut q)?;
                (q, kva)
            }
        };
        let mut att = be.zeros(n * c.n_heads * c.v_head_dim)?;
        let w = MlaWeights {
            kv_a_norm: &a.kv_a_norm,
            kv_b: &a.kv_b,
            inv_freq: &self.inv_freq,
        };
        be.mla_attention(
            step,
            kv,
            layer,
            &self.mla_params(),
            &w,
            &mut q,
            &kva,
            &mut att,
        )?;
        let mut o = be.zeros(n * c.hidden)?;
        be.matmul(&a.o, &att, n, &mut o)?;
        Ok(o)
    }

    fn block(
        &self,
        b: &Block<B::Weight>,
        layer: usize,
        x: &mut B::Buf,
        batch: &Batch,
        step: &mut B::Step,
        kv: &mut B::MlaKv,
    ) -> Result<()> {
        let be = &self.backend;
        let (n, d) = (batch.n_tokens(), self.cfg.hidden);
        let mut h = be.zeros(n * d)?;
        be.rms_norm(x, &b.attn_norm, self.cfg.rms_eps, &mut h)?;
        let o = self.mla(&b.attn, layer, &h, step, n, kv)?;
        be.add_assign(x, &o)?;
        be.rms_norm(x, &b.ffn_norm, self.cfg.rms_eps, &mut h)?;
        let f = match &b.ffn {
            Ffn::Dense(m) => m.apply(be, &h, n, d)?,
            Ffn::Moe(m) => {
                let mut f = be.zeros(n * d)?;
                be.moe(m, &h, &batch.tokens, n, d, &mut f)?;
                f
            }
        };
        be.add_assign(x, &f)
    }

    /// The logits of rows `rows` of `x`, left on the backend.
    fn logits(&self, x: &B::Buf, norm: &B::Weight, rows: &[usize]) -> Result<B::Buf> {
        let be = &self.backend;
        let (m, d) = (rows.len(), self.cfg.hidden);
        let mut sel = be.zeros(m * d)?;
        be.gather_rows(x, d, rows, &mut sel)?;
        let mut normed = be.zeros(m * d)?;
        be.rms_norm(&sel, norm, self.cfg.rms_eps, &mut normed)?;
        self.head(&normed, m)
    }

    /// The output head over `m` normed rows.
    fn head(&self, normed: &B::Buf, m: usize) -> Result<B::Buf> {
        let be = &self.backend;
        let mut logits = be.zeros(m * self.cfg.vocab)?;
        be.matmul(
            self.lm_head.as_ref().unwrap_or(&self.embed),
            normed,
            m,
            &mut logits,
        )?;
        Ok(logits)
    }

    /// Every row of `x` normed by `norm` (to the host), and the logits of `rows` from those
    /// normed rows (each row normalized once).
    fn logits_and_hidden(
        &self,
        x: &B::Buf,
        n: usize,
        norm: &B::Weight,
        rows: &[usize],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let be = &self.backend;
        let d = self.cfg.hidden;
        let mut normed = be.zeros(n * d)?;
        be.rms_norm(x, norm, self.cfg.rms_eps, &mut normed)?;
        let mut sel = be.zeros(rows.len() * d)?;
        be.gather_rows(&normed, d, rows, &mut sel)?;
        let logits = self.head(&sel, rows.len())?;
        Ok((be.to_host(&logits)?, be.to_host(&normed)?))
    }

    /// Runs the main layers over `batch`: the residual stream after the last layer, and the
    /// step, which the caller keeps alive while it makes the step's remaining buffers (on
    /// CUDA a padded decode step pads every buffer made while it lives).
    fn layers(&self, batch: &Batch, kv: &mut KvCache) -> Result<(B::Buf, B::Step)> {
        let be = &self.backend;
        let (n, d) = (batch.n_tokens(), self.cfg.hidden);
        let mut step = be.prepare_step(batch, kv.block_size())?;
        let kv = kv.get_mut::<B::MlaKv>()?;
        let mut x = be.zeros(n * d)?;
        be.embed(&self.embed, &batch.tokens, &mut x)?;
        for (i, b) in self.blocks.iter().enumerate() {
            self.block(b, i, &mut x, batch, &mut step, kv)?;
        }
        Ok((x, step))
    }

    /// Runs the main layers over `batch`; the logits of `batch.logits_for` stay on the backend.
    fn main_logits(&self, batch: &Batch, kv: &mut KvCache) -> Result<B::Buf> {
        let (x, _step) = self.layers(batch, kv)?;
        self.logits(&x, &self.norm, &batch.logits_for)
    }

    /// Runs the main layers; returns the logits of `batch.logits_for` and the final-norm hidden
    /// state of every token (`[n, hidden]`, what the MTP layers take).
    pub fn forward_with_hidden(
        &self,
        batch: &Batch,
        kv: &mut KvCache,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        // the step lives on while the head's buffers are made (see `layers`)
        let (x, _step) = self.layers(batch, kv)?;
        self.logits_and_hidden(&x, batch.n_tokens(), &self.norm, &batch.logits_for)
    }

    /// MTP layer `depth`: token `i` of `batch` is combined with `prev_hidden[i]` (the main
    /// model's final-norm hidden state of the token before it, or the previous MTP layer's
    /// output) as `eh_proj([enorm(embed(t)), hnorm(h)])`, run through the layer's decoder block
    /// (its own cache layer), normed by `shared_head.norm` and projected by the shared head.
    /// Returns the logits of `batch.logits_for` and the normed output of every token.
    pub fn mtp_forward(
        &self,
        depth: usize,
        batch: &Batch,
        prev_hidden: &[f32],
        kv: &mut KvCache,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let m = self.mtp.get(depth).ok_or_else(|| {
            Error::BadRequest(format!(
                "MTP layer {depth} asked, the model has {}",
                self.mtp.len()
            ))
        })?;
        let be = &self.backend;
        let (n, d) = (batch.n_tokens(), self.cfg.hidden);
        if prev_hidden.len() != n * d {
            return Err(Error::BadRequest(format!(
                "MTP input has {} hidden floats for {n} tokens of {d}",
                prev_hidden.len()
            )));
        }
        let mut step = be.prepare_step(batch, kv.block_size())?;
        let kv = kv.get_mut::<B::MlaKv>()?;
        let mut e = be.zeros(n * d)?;
        be.embed(&self.embed, &batch.tokens, &mut e)?;
        let mut en = be.zeros(n * d)?;
        be.rms_norm(&e, &m.enorm, self.cfg.rms_eps, &mut en)?;
        let mut hn = be.zeros(n * d)?;
        be.rms_norm(
            &be.upload(prev_hidden)?,
            &m.hnorm,
            self.cfg.rms_eps,
            &mut hn,
        )?;
        let (en, hn) = (be.to_host(&en)?, be.to_host(&hn)?);
        let mut cat = Vec::with_capacity(2 * n * d);
        for t in 0..n {
            cat.extend_from_slice(&en[t * d..(t + 1) * d]);
            cat.extend_from_slice(&hn[t * d..(t + 1) * d]);
        }
        let mut x = be.zeros(n * d)?;
        be.matmul(&m.eh_proj, &be.upload(&cat)?, n, &mut x)?;
        self.block(
            &m.block,
            self.cfg.n_layers + depth,
            &mut x,
            batch,
            &mut step,
            kv,
        )?;
        self.logits_and_hidden(&x, n, &m.norm, &batch.logits_for)
    }
}

impl<B: Backend> CausalLm for DeepseekV3<B> {
    fn config(&self) -> &ModelConfig {
        &self.model_cfg
    }

    fn device_name(&self) -> String {
        self.backend.device_name()
    }

    fn new_kv(&self, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        let layers = self.cfg.n_layers + self.mtp.len();
        let kv =
            self.backend
                .new_mla_kv(layers, num_blocks, block_size, self.cfg.mla_cache_width())?;
        Ok(KvCache::new(kv, block_size))
    }

    /// One latent-MLA group over the main and MTP layers: per token and layer, the latent and
    /// the shared rope key (f32 on the CPU; the activation type on CUDA).
    fn kv_layout(&self, block_size: usize) -> KvCacheLayout {
        KvCacheLayout {
            block_size,
            groups: vec![LayerGroup {
                layers: (0..self.cfg.n_layers + self.mtp.len()).collect(),
                spec: KvCacheSpec::LatentMla {
                    latent_dim: self.cfg.kv_lora_rank,
                    rope_dim: self.cfg.qk_rope_head_dim,
                    dtype_bytes: self.backend.mla_kv_value_bytes(),
                },
            }],
        }
    }

    fn forward(&self, batch: &Batch, kv: &mut KvCache) -> Result<Vec<f32>> {
        let logits = self.main_logits(batch, kv)?;
        self.backend.to_host(&logits)
    }

    /// Like [`CausalLm::forward`], but only what the samplers need leaves the backend.
    fn forward_select(&self, batch: &Batch, kv: &mut KvCache, want: LogitsWant) -> Result<Logits> {
        let logits = self.main_logits(batch, kv)?;
        Logits::from_backend(&self.backend, &logits, self.cfg.vocab, want)
    }
}
