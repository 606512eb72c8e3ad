//! Compute backends. An architecture is written once against [`Backend`]; the CPU backend is
//! always built, the CUDA backend sits behind the `cuda` feature so CPU builds never need a
//! CUDA toolkit.
//!
//! A backend owns its buffers, prepared weights and paged KV storage; the model only strings
//! operations together. Operations take the step's [`Backend::Step`] (positions, block tables,
//! slot offsets — uploaded once per step) where they need batch layout.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::error::Result;
use crate::ids::TokenId;
use crate::model::batch::Batch;
use crate::model::hparams::RopeSpec;
use crate::model::mla::{MlaParams, MlaWeights};
use crate::model::moe::{ExpertLoad, MoeLayer};
use crate::tensor::Weight;

/// Shape and masking of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnParams {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Sliding window (keys within the last `window` positions, the query's own included).
    pub window: Option<usize>,
}

/// Shape of a paged KV store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// The operations a decoder needs, over backend-owned buffers of f32 activations.
///
/// Shapes are `[n_tokens, width]` row-major; a `Buf` of a given length is made by
/// [`Backend::zeros`] and reused across layers.
pub trait Backend: Send + Sync + 'static {
    /// Activations (`n` floats).
    type Buf: Send;
    /// A weight prepared for this backend (uploaded, converted or kept as is).
    type Weight: Send + Sync;
    /// Paged KV storage.
    type Kv: Send + 'static;
    /// Per-step batch layout, prepared once per forward pass.
    type Step;
    /// Paged latent cache of multi-head latent attention (per token and layer: the
    /// normalized latent and the rotated rope key).
    type MlaKv: Send + 'static;

    /// Human-readable device description (for benchmark records).
    fn device_name(&self) -> String;

    fn prepare_weight(&self, w: &Weight) -> Result<Self::Weight>;
    fn zeros(&self, n: usize) -> Result<Self::Buf>;
    fn new_kv(&self, shape: KvShape) -> Result<Self::Kv>;
    fn prepare_step(&self, batch: &Batch, block_size: usize) -> Result<Self::Step>;

    /// `out[t] = table[tokens[t]]` (rows of `table.cols` floats).
    fn embed(&self, table: &Self::Weight, tokens: &[TokenId], out: &mut Self::Buf) -> Result<()>;
    /// `y[t, r] = sum_c W[r, c] x[t, c]`.
    fn matmul(
        &self,
        w: &Self::Weight,
        x: &Self::Buf,
        n_tokens: usize,
        y: &mut Self::Buf,
    ) -> Result<()>;
    /// Row-wise RMSNorm of `x` with gain `w` (a vector weight).
    fn rms_norm(
        &self,
        x: &Self::Buf,
        w: &Self::Weight,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf) -> Result<()>;
    /// `gate = silu(gate) * up`.
    fn silu_mul(&self, gate: &mut Self::Buf, up: &Self::Buf) -> Result<()>;
    /// Rotates `x` (`[n_tokens, n_heads, head_dim]`) by each token's position.
    fn rope(
        &self,
        step: &mut Self::Step,
        spec: RopeSpec,
        x: &mut Self::Buf,
        n_heads: usize,
        head_dim: usize,
    ) -> Result<()>;
    /// Writes the step's K and V into their slots of `layer`, then attends every query token
    /// over its sequence's cached keys (causal, optional window), writing `out` (`q`'s shape).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        step: &Self::Step,
        kv: &mut Self::Kv,
        layer: usize,
        p: &AttnParams,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// A latent cache of `layers` layers in `num_blocks` blocks of `block_size` tokens, each
    /// token `width` (= latent + rope) values.
    fn new_mla_kv(
        &self,
        layers: usize,
        num_blocks: usize,
        block_size: usize,
        width: usize,
    ) -> Result<Self::MlaKv>;
    /// Bytes per value of the latent cache (for the KV manager's sizing).
    fn mla_kv_value_bytes(&self) -> usize {
        4
    }
    /// One multi-head latent attention layer: normalizes the latents of `kva`
    /// (`[n, latent + rope]`, the `kv_a_proj_with_mqa` output), rotates the rope key and the
    /// queries' rope parts (`q`: `[n, heads, nope + rope]`, rotated in place) by position,
    /// writes latent and rope key into `layer` of the cache, then attends every query token
    /// over its sequence's cached tokens (absorbed or expanded form, `p.path`), writing
    /// `out` (`[n, heads * v]`).
    #[allow(clippy::too_many_arguments)]
    fn mla_attention(
        &self,
        step: &mut Self::Step,
        kv: &mut Self::MlaKv,
        layer: usize,
        p: &MlaParams,
        w: &MlaWeights<'_, Self::Weight>,
        q: &mut Self::Buf,
        kva: &Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// `out = moe(x)` for `n` rows of width `d` (routed experts weighted by the router plus
    /// the shared experts). The default routes on the host and runs one product per expert
    /// through [`Backend::matmul`] ([`MoeLayer::forward`]).
    fn moe(
        &self,
        layer: &MoeLayer<Self::Weight>,
        x: &Self::Buf,
        tokens: &[TokenId],
        n: usize,
        d: usize,
        out: &mut Self::Buf,
    ) -> Result<()>
    where
        Self: Sized,
    {
        layer.forward(self, x, tokens, n, d, out)
    }
    /// The expert-load counters of `layer` (see [`MoeLayer::load`]).
    fn expert_load(&self, layer: &MoeLayer<Self::Weight>) -> Result<ExpertLoad> {
        Ok(layer.load())
    }
    /// Copies rows `rows` (each `width` floats) of `x` into `out`, in order.
    fn gather_rows(
        &self,
        x: &Self::Buf,
        width: usize,
        rows: &[usize],
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// Copies a buffer to host memory.
    fn to_host(&self, x: &Self::Buf) -> Result<Vec<f32>>;

    /// A new buffer holding `x` (host fallbacks of the operations below use it). The default
    /// says the backend has no such upload yet.
    fn upload(&self, x: &[f32]) -> Result<Self::Buf> {
        let _ = x;
        Err(crate::error::Error::BadConfig(format!(
            "backend {} cannot upload host data yet (needed by MoE and MLA layers)",
            self.device_name()
        )))
    }

    /// `out[rows[j]] += scales[j] * src[j]` for rows of `width` floats (the combine step of a
    /// mixture-of-experts layer). The default runs on the host through [`Backend::upload`].
    fn scatter_add_rows(
        &self,
        out: &mut Self::Buf,
        src: &Self::Buf,
        width: usize,
        rows: &[usize],
        scales: &[f32],
    ) -> Result<()> {
        let mut o = self.to_host(out)?;
        let s = self.to_host(src)?;
        select::scatter_add_rows(&mut o, &s, width, rows, scales);
        *out = self.upload(&o)?;
        Ok(())
    }

    /// Index of the largest value of each `width`-wide row of `x` (ties: the lowest index).
    fn argmax_rows(&self, x: &Self::Buf, width: usize) -> Result<Vec<u32>> {
        Ok(select::argmax_rows(&self.to_host(x)?, width))
    }

    /// The `k` largest values of each `width`-wide row of `x` with their indices, largest first
    /// (ties: the lower index first).
    fn top_k_rows(&self, x: &Self::Buf, width: usize, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        Ok(select::top_k_rows(&self.to_host(x)?, width, k))
    }
}

/// Host versions of the candidate selections (the trait's default methods).
pub mod select {
    /// See [`super::Backend::argmax_rows`].
    pub fn argmax_rows(x: &[f32], width: usize) -> Vec<u32> {
        if width == 0 {
            return Vec::new();
        }
        x.chunks_exact(width)
            .map(|r| {
                let mut best = 0;
                for (i, &v) in r.iter().enumerate() {
                    if v > r[best] {
                        best = i;
                    }
                }
                best as u32
            })
            .collect()
    }

    /// See [`super::Backend::scatter_add_rows`].
    pub fn scatter_add_rows(
        out: &mut [f32],
        src: &[f32],
        width: usize,
        rows: &[usize],
        scales: &[f32],
    ) {
        for (j, (&r, &s)) in rows.iter().zip(scales).enumerate() {
            let o = &mut out[r * width..(r + 1) * width];
            for (o, &v) in o.iter_mut().zip(&src[j * width..(j + 1) * width]) {
                *o += s * v;
            }
        }
    }

    /// See [`super::Backend::top_k_rows`]: one pass over each row that keeps only contenders
    /// (`sampling::top_k_into`, the samplers' own selection: NaN counts as -inf).
    pub fn top_k_rows(x: &[f32], width: usize, k: usize) -> Vec<Vec<(u32, f32)>> {
        if width == 0 {
            return Vec::new();
        }
        let mut top = Vec::new();
        x.chunks_exact(width)
            .map(|r| {
                crate::sampling::top_k_into(r, k, &mut top);
                top.iter().map(|c| (c.id, c.logit)).collect()
            })
            .collect()
    }
}

/// Where a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU with this many compute threads (the caller's thread included).
    Cpu { threads: usize },
    /// A CUDA device by ordinal (needs the `cuda` feature).
    Cuda { ordinal: usize },
}

impl std::str::FromStr for Device {
    type Err = String;

    /// `cpu` (every core), `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> std::result::Result<Device, String> {
        match s {
            "cpu" => Ok(Device::cpu_all()),
            "cuda" | "gpu" => Ok(Device::Cuda { ordinal: 0 }),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(ordinal)) => Ok(Device::Cuda { ordinal }),
                _ => Err(format!(
                    "unknown device `{s}` (expected cpu, cuda or cuda:N)"
                )),
            },
        }
    }
}

impl Device {
    /// The CPU with every available core.
    pub fn cpu_all() -> Device {
        Device::Cpu {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}
