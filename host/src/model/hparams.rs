//! Architecture-neutral hyper-parameters of a decoder-only model, with a per-layer attention
//! spec (full or sliding window, and its rope settings) so that architectures that mix layer
//! kinds (Gemma-3, Mistral, DeepSeek-V4) describe themselves in the same shape.

use crate::error::{Error, Result};

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (x0, x1), (x2, x3), ...: GGUF's llama layout (its converter permutes Q/K).
    Interleaved,
    /// First half against second half ("rotate half"): HF transformers' layout.
    Half,
}

/// Rotary position embedding settings of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeSpec {
    pub theta: f32,
    /// Number of leading head dimensions that rotate (the rest pass through).
    pub dims: usize,
    pub style: RopeStyle,
    /// Linear position scaling factor (1.0 = none).
    pub scale: f32,
}

/// Which keys a layer's queries may see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// Every earlier position (causal).
    Full,
    /// Only the last `window` positions, the query's own included.
    Sliding { window: usize },
}

/// Per-layer attention spec.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerSpec {
    pub attention: AttentionKind,
    pub rope: RopeSpec,
}

/// Most decoder layers a model may declare (the deepest published models have ≈ 130), checked
/// before a per-layer table is sized by a count read from a file.
pub const MAX_LAYERS: usize = 1024;

/// Refuses a layer count read from a file beyond [`MAX_LAYERS`]; `source` names the field.
pub fn check_layer_count(n: usize, source: &str) -> Result<usize> {
    if n > MAX_LAYERS {
        return Err(Error::BadConfig(format!(
            "{source}: {n} layers is more than the {MAX_LAYERS} this engine supports"
        )));
    }
    Ok(n)
}

/// Hyper-parameters shared by the decoder-only architectures.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: String,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub context_len: usize,
    pub rms_eps: f32,
    pub tie_embeddings: bool,
    pub layers: Vec<LayerSpec>,
}

impl ModelConfig {
    /// Checks the relations the kernels rely on; the message names the offending field.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::BadConfig(m));
        if self.n_layers == 0 || self.hidden == 0 || self.n_heads == 0 || self.vocab == 0 {
            return bad(format!(
                "n_layers ({}), hidden ({}), n_heads ({}) and vocab ({}) must be positive",
                self.n_layers, self.hidden, self.n_heads, self.vocab
            ));
        }
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "head count {} is not a multiple of the KV head count {}",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be positive and even",
                self.head_dim
            ));
        }
        if self.layers.len() != self.n_layers {
            return bad(format!(
                "{} layer specs for {} layers",
                self.layers.len(),
                self.n_layers
            ));
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.rope.dims > self.head_dim || l.rope.dims % 2 != 0 {
                return bad(format!(
                    "layer {i}: rope dims {} must be even and at most head_dim {}",
                    l.rope.dims, self.head_dim
                ));
            }
            // Written so that a NaN theta fails too.
            #[allow(clippy::neg_cmp_op_on_partial_ord)]
            if !(l.rope.theta > 0.0) {
                return bad(format!(
                    "layer {i}: rope theta {} must be positive",
                    l.rope.theta
                ));
            }
            if let AttentionKind::Sliding { window: 0 } = l.attention {
                return bad(format!("layer {i}: sliding window of 0"));
            }
        }
        if self.context_len == 0 {
            return bad("context length must be positive".into());
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// YaRN rope scaling (Peng et al., 2023, "YaRN: Efficient Context Window Extension of Large
/// Language Models"), with the `mscale` / `mscale_all_dim` attention correction DeepSeek uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    /// Explicit cos/sin scale; derived from the mscales when absent.
    pub attention_factor: Option<f64>,
    /// Round the correction range to whole dimensions.
    pub truncate: bool,
}

impl Yarn {
    /// `0.1 * mscale * ln(scale) + 1` for `scale > 1`, else 1.
    pub fn get_mscale(scale: f64, mscale: f64) -> f64 {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * mscale * scale.ln() + 1.0
        }
    }

    /// The factor applied to cos and sin.
    pub fn cos_sin_scale(&self) -> f64 {
        if let Some(a) = self.attention_factor {
            return a;
        }
        match (self.mscale, self.mscale_all_dim) {
            (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                Self::get_mscale(self.factor, m) / Self::get_mscale(self.factor, a)
            }
            _ => Self::get_mscale(self.factor, 1.0),
        }
    }

    /// Inverse frequencies of the `dims / 2` rotary pairs: interpolated (divided by `factor`)
    /// for long wavelengths, extrapolated (unchanged) for short ones, blended linearly between
    /// the `beta_fast` and `beta_slow` correction dimensions.
    pub fn inv_freq(&self, theta: f64, dims: usize) -> Vec<f32> {
        let d = dims as f64;
        let corr = |rot: f64| {
            d * (self.original_max_position as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (corr(self.beta_fast), corr(self.beta_slow));
        if self.truncate {
            low = low.floor();
            high = high.ceil();
        }
        let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
        if low == high {
            high += 0.001;
        }
        (0..dims / 2)
            .map(|i| {
                let pos_freq = theta.powf(2.0 * i as f64 / d) as f32;
                let extra = 1.0 / pos_freq;
                let inter = 1.0 / (self.factor as f32 * pos_freq);
                let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                inter * (1.0 - keep) + extra * keep
            })
            .collect()
    }
}

/// Plain rope inverse frequencies, `theta^(-2i/dims)`.
pub fn rope_inv_freq(theta: f64, dims: usize) -> Vec<f32> {
    (0..dims / 2)
        .map(|i| 1.0 / (theta.powf(2.0 * i as f64 / dims as f64) as f32))
        .collect()
}
