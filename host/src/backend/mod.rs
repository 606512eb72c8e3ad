//! Compute backends. An architecture is written once against [`Backend`]; the CPU backend is
//! always built, the CUDA backend sits behind the `cuda` feature so CPU builds never need a
//! CUDA toolkit.
//!
//! A backend owns its buffers, prepared weights and paged KV storage; the model only strings
//! operations together. Operations take the step's [`Backend::Step`] (positions, block tables,
//! slot offsets — uploaded once per step) where they need batch layout.

pub mod cpu;

use crate::error::Result;
use crate::ids::TokenId;
use crate::model::batch::Batch;
use crate::model::hparams::RopeSpec;
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

    /// Human-readable device description (for benchmark records).
    fn device_name(&self) -> String;

    fn prepare_weight(&self, w: &Weight) -> Result<Self::Weight>;
    fn zeros(&self, n: usize) -> Result<Self::Buf>;
    fn new_kv(&self, shape: KvShape) -> Result<Self::Kv>;
    fn prepare_step(&self, batch: &Batch, block_size: usize) -> Result<Self::Step>;

    /// `out[t] = table[tokens[t]]` (rows of `table.cols` floats).
    fn embed(&self, table: &Self::Weight, tokens: &[TokenId], out: &mut Self::Buf) -> Result<()>;
    /// `y[t, r] = sum_c W[r, c] x[t, c]`.
    fn matmul(&self, w: &Self::Weight, x: &Self::Buf, n_tokens: usize, y: &mut Self::Buf) -> Result<()>;
    /// Row-wise RMSNorm of `x` with gain `w` (a vector weight).
    fn rms_norm(&self, x: &Self::Buf, w: &Self::Weight, eps: f32, out: &mut Self::Buf) -> Result<()>;
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf) -> Result<()>;
    /// `gate = silu(gate) * up`.
    fn silu_mul(&self, gate: &mut Self::Buf, up: &Self::Buf) -> Result<()>;
    /// Rotates `x` (`[n_tokens, n_heads, head_dim]`) by each token's position.
    fn rope(&self, step: &mut Self::Step, spec: RopeSpec, x: &mut Self::Buf, n_heads: usize, head_dim: usize) -> Result<()>;
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
    /// Copies rows `rows` (each `width` floats) of `x` into `out`, in order.
    fn gather_rows(&self, x: &Self::Buf, width: usize, rows: &[usize], out: &mut Self::Buf) -> Result<()>;
    /// Copies a buffer to host memory.
    fn to_host(&self, x: &Self::Buf) -> Result<Vec<f32>>;
}

/// Where a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU with this many compute threads (the caller's thread included).
    Cpu { threads: usize },
    /// A CUDA device by ordinal (needs the `cuda` feature).
    Cuda { ordinal: usize },
}

impl Device {
    /// The CPU with every available core.
    pub fn cpu_all() -> Device {
        Device::Cpu { threads: std::thread::available_parallelism().map_or(1, |n| n.get()) }
    }
}
