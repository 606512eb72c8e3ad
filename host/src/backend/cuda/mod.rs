//! The CUDA backend (feature `cuda`): NVRTC-compiled kernels from `kernels/`, cuBLAS for
//! wide matrix products, paged bf16 KV caches, and a deferred queue that fuses neighbouring
//! operations and replays repeated forward passes as CUDA graphs.
//!
//! Activations live on the device as f32 or bf16 ([`Act`]): bf16 when every matrix weight is
//! bf16/f16 (so cuBLAS reads them directly), f32 otherwise; `to_host` always returns f32. The
//! driver, NVRTC and cuBLAS are loaded at run time, so building this needs no CUDA toolkit.
//! This module owns device resources and launches; models never see them.

mod attention;
mod blas;
mod device;
mod matmul;
mod mla;
pub mod module;
mod moe;
mod ops;
mod queue;
mod readback;
mod sample;
mod step;
mod stream;
mod trace;
mod weights;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::{sys, CudaContext, CudaStream};

use super::{AttnParams, Backend, KvShape};
use crate::error::{Error, Result};
use crate::ids::TokenId;
use crate::model::batch::Batch;
use crate::model::hparams::RopeSpec;
use crate::tensor::Weight;
use blas::Blas;
use device::{cuda_err, DevMem, Pool};
use module::Module;
use queue::{Op, Queue};

pub use mla::CudaMlaKv;
pub use queue::QueueStats;
pub use step::{bucket, CudaStep};
pub use stream::{StreamPoint, FILLS as STREAM_FILLS};
pub use weights::{CudaKv, CudaWeight};

/// Element type of activations on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Act {
    F32,
    Bf16,
}

impl Act {
    pub fn size(self) -> usize {
        match self {
            Act::F32 => 4,
            Act::Bf16 => 2,
        }
    }
}

/// The prefill attention kernel (`kernels/attention_prefill.cu`); all take the same work
/// items and give the same results up to rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillKernel {
    /// `attn_prefill`: 64 queries per block of 4 warps, plain loads.
    Plain,
    /// `attn_prefill2`: 64 queries per block, K/V tiles double-buffered with cp.async.
    Pipelined,
    /// `attn_prefill3`: 128 queries per block of 4 warps (32 rows each, so every K/V fragment
    /// feeds two MMAs), two blocks per SM, masks only on diagonal tiles. Falls back to
    /// `Pipelined` where the device lacks the shared memory (96 KB at head dim 128), the step
    /// has more than 65,535 work items or the scale is not positive.
    Wide,
}

/// Backend settings, resolved once at construction.
#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// Activation type; `None` picks bf16 when every matrix weight is bf16/f16, else f32.
    pub act: Option<Act>,
    /// Replay repeated forward passes as CUDA graphs.
    pub graphs: bool,
    /// Fuse neighbouring operations in the queue.
    pub fuse: bool,
    /// Which prefill attention kernel runs (`DEEPINFER_CUDA_PREFILL`).
    pub prefill: PrefillKernel,
    /// Programmatic dependent launch where the device has it (sm_90+).
    pub pdl: bool,
    /// Block-cooperative GEMVs for long bf16/f16 rows (see `matmul::pick`).
    pub gemvb: bool,
    /// One-token GEMVs over rows of at most 2048 bf16 weights stream a block's rows into shared
    /// memory before the programmatic wait (`gemvp*` in `kernels/gemv.cu`); `DEEPINFER_CUDA_GEMVP=0`
    /// gives them to the block-cooperative kernels.
    pub gemvp: bool,
    /// Those GEMVs in blocks of 32 rows (136 KB of shared memory) when the matrix has at most
    /// 32 rows an SM: one block an SM, so every block can be resident and copying its rows
    /// while the kernel before it runs; `DEEPINFER_CUDA_GEMVPW=0` keeps 8-row blocks.
    pub gemvp_wide: bool,
    /// Which of those take the wide blocks, by fold (bit 0 plain, 1 RMSNorm, 2 residual add):
    /// `DEEPINFER_CUDA_GEMVPW=norm` / `add` for one kind only, all by default.
    pub gemvp_wide_folds: u8,
    /// One-token gate/up GEMVs with SwiGLU folded in over rows of 2048 take the staged kernels
    /// too (`gemvps*`, 4 gate/up row pairs a block in 41 KB of shared memory: 5 blocks an SM,
    /// 160 KB asked for), where the block GEMVs hold 16 KB a block in flight at 64 registers a
    /// thread (4 blocks an SM, 64 KB). Off by default: no faster on an H100 (llama3-1b
    /// 0.998x, Moonlight within the spread; `DEEPINFER_CUDA_GEMVPS=1` turns it on;
    /// doc/benchmarks.md, sessions 41–42).
    pub gemvp_swiglu: bool,
    /// The cluster scheduling policy cluster launches ask for (`CU_LAUNCH_ATTRIBUTE_CLUSTER_
    /// SCHEDULING_POLICY_PREFERENCE`): none (the driver's default), spread (a cluster's blocks
    /// on distinct SMs) or load balancing (`DEEPINFER_CUDA_CLUSTER_POLICY=default|spread|
    /// balance`). Session 42: spread left `mla_dec1`'s placement as it was (its doubled SMs hold
    /// blocks of two clusters, which a per-cluster preference does not govern), so the default.
    pub cluster_policy: Option<sys::CUclusterSchedulingPolicy>,
    /// Query and key RoPE in one launch, and split-KV decode attention merging its own splits
    /// (no combine launch). Off by default: on the H200 it made Llama-3-8B decode steps slower
    /// (batch 1: 4.62 -> 4.69 ms, batch 32: 7.73 -> 7.96 ms).
    pub fuse2: bool,
    /// Pad decode steps to a bucket of batch sizes ([`step::bucket`]) so that one CUDA graph
    /// serves all the batch sizes of a bucket (only with `graphs`).
    pub buckets: bool,
    /// Fold an RMSNorm into the block-cooperative GEMV that reads its output (bf16 weights
    /// and activations, up to 8 tokens).
    pub fuse_norm: bool,
    /// Fold a residual add into the block-cooperative GEMV that writes its addend (likewise).
    pub fuse_add: bool,
    /// Fold the RoPE of queries and keys into the K/V cache write of attention (one launch).
    pub fuse_rope_kv: bool,
    /// Fold SwiGLU into the block-cooperative gate/up GEMV (bf16 weights and activations, up
    /// to 8 tokens): no `silu_mul` launch, the up rows are never written.
    pub fuse_silu: bool,
    /// Decode steps (one token a sequence) with head dims 64 and 128, up to 8 query heads
    /// per KV head and up to 8 key splits: the RoPE of queries and keys, the K/V cache write
    /// and the split merge in the attention kernel (`attn_dec1_*`: one launch instead of
    /// three; sm_90+, the splits of a row form a thread-block cluster).
    pub fuse_attn: bool,
    /// Skinny tensor-core GEMMs (`kernels/gemt.cu`) instead of cuBLAS for 9..=64 tokens of
    /// bf16 weights and activations. Off by default: on the H200 a Llama-3-8B batch-32 step
    /// took 6.57 ms with them (4 splits) against 6.18 ms through cuBLAS.
    pub gemt: bool,
    /// Blocks (a thread-block cluster) splitting k for each row tile of those GEMMs: 1, 2, 4
    /// or 8 (batch-32 step: 7.80, 6.57 and 7.87 ms for 2, 4 and 8).
    pub gemt_splits: u32,
    /// MoE layers of decode steps in three launches (routing with the norm before it and the
    /// plan; expert gate/up with the shared experts; down with the combine and the residual
    /// add), see `moe::forward_decode`.
    pub fuse_moe: bool,
    /// Which of the later DeepSeek decode kernel variants run (`DEEPINFER_CUDA_DS2`).
    pub ds2: Ds2,
    /// Decode steps (one token a sequence, a few tokens) run MLA in one cluster launch
    /// (`mla_dec1`: query absorption, the cache write, attention, the split merge and the V
    /// up-projection) instead of three (sm_90+).
    pub fuse_mla: bool,
    /// One-token bf16 decode steps run a layer's whole attention half in that launch
    /// (`mla_layer1`: the RMSNorm and the q / kv_a products before it, the o product and the
    /// residual add after it) where the device holds all its clusters at once. Off by
    /// default: on the H200 it is slower than the three launches (doc/benchmarks.md).
    pub fuse_layer: bool,
    /// MoE layers of steps past the decode kernels' token bound (batched decode, prefill)
    /// multiply each selected expert's rows with its tokens on tensor cores (`moe_gu_mma`,
    /// `moe_dn_mma`; bf16 weights and activations) instead of one warp a row
    /// (`moe_gateup` / `moe_down`); `DEEPINFER_CUDA_MOE_MMA=0` turns it off.
    pub moe_mma: bool,
    /// Among those, steps whose experts average at least 4 assignments each (prefill, decode
    /// batches from 43 sequences of a 64-expert top-6 model) take
    /// tiled GEMMs (`moe_gu_gemm`, `moe_dn_gemm`: 128 rows by 64 assignments a block, both
    /// staged in shared memory) instead of the row-streaming products, which read an expert's
    /// rows again for every 32 of its assignments; `DEEPINFER_CUDA_MOE_GEMM=0` turns it off.
    pub moe_gemm: bool,
    /// The average assignments an expert from which `moe_gemm` takes a step (4; on the H200
    /// the tiled GEMMs were slower at 1.5 and faster from 6, doc/benchmarks.md;
    /// `DEEPINFER_CUDA_MOE_GEMM_MIN=N` sets another).
    pub moe_gemm_min: usize,
    /// The tiled GEMMs on Hopper's warpgroup MMA (`moe_gu_wg`, `moe_dn_wg`: 128 assignments
    /// by 256 weight rows a block, 4 stages) where the module is an `sm_90a` image;
    /// `DEEPINFER_CUDA_MOE_WG=0` keeps `moe_gu_gemm` / `moe_dn_gemm`.
    pub moe_wg: bool,
    /// One-token bf16 decode steps run a MoE layer (routing, gate/up, down) in one persistent
    /// launch of a block an SM (`moe_ffn1`: the phases meet at grid-wide counters while each
    /// warp keeps its own weights streaming into shared memory by bulk copies) instead of
    /// three launches, where the device is sm_90+ and holds every block at once; the same
    /// outputs to the bit; `DEEPINFER_CUDA_MOE_FFN1=0` turns it off. Its blocks wait on each
    /// other, so one backend a device in a process runs it (the others take the three
    /// launches), and it assumes no other process's grid holds SMs meanwhile (MPS); a wait
    /// past 5 s traps, failing the launch instead of hanging.
    pub moe_ffn1: bool,
    /// A `moe_ffn1` launch whose residual stream the next layer's RMSNorm and one-token q/kv_a
    /// product (a staged `gemvp` NORM launch) read next takes that product in too
    /// (`moe::fold_next_norm_gemv`): its blocks copy the product's rows into their pages while
    /// the down rows finish and compute them after one more grid-wide count, so the product's
    /// weights stream while the layer ends instead of after it; the same outputs to the bit;
    /// `DEEPINFER_CUDA_FFN1_NEXT=1` turns it on, `0` off.
    pub ffn1_next: bool,
    /// A `moe_ffn1` launch whose RMSNorm reads the residual stream that a one-token staged
    /// `gemvp` residual-add launch (the attention's o product) just wrote takes that product
    /// in too (`moe::fold_prev_acc_gemv`): its warps copy the product's rows first, before the
    /// programmatic wait, compute them once the attention's output is there and meet at one
    /// more grid-wide count before the routing reads the stream; the same outputs to the bit;
    /// `DEEPINFER_CUDA_FFN1_PREV=1` turns it on, `0` off.
    pub ffn1_prev: bool,
    /// A one-token step that `moe_ffn1` would take runs `moe_fk1` instead: the down product
    /// split by expert row, so each warp adds its expert rows' down contributions into its own
    /// partial sums right after their gate/up values and the blocks meet once, at the end,
    /// instead of between gate/up and down. Needs every down matrix transposed (made when the
    /// layer first runs: the layer's down bytes again in device memory); the sums run in
    /// another order than `moe_ffn1`'s, so outputs differ by rounding;
    /// `DEEPINFER_CUDA_MOE_SPLITK=1` turns it on, `0` off.
    pub moe_splitk: bool,
    /// A `moe_fk1` launch followed by a one-token staged GEMV (the next layer's q/kv_a
    /// product) asks that GEMV's weights into L2 once its blocks' units are done, while the
    /// memory would idle (`moe::link_next_weights`); off by default (measured 0.5% slower on an
    /// H100, doc/benchmarks.md); `DEEPINFER_CUDA_FK1_L2=1` turns it on.
    pub fk1_l2: bool,
    /// A `moe_ffn1` launch followed by a one-token staged GEMV (the next layer's q/kv_a
    /// product) asks that GEMV's weights into L2 as its warps finish their down rows, so the
    /// memory streams through the layer's tail, where the GEMV's blocks cannot yet start their
    /// copies (`moe::link_next_weights`; 0.991x / 0.984x / 1.004x a Moonlight step in three
    /// H100 calls, doc/benchmarks.md); `DEEPINFER_CUDA_FFN1_NEXT_L2=0` turns it off.
    pub ffn1_next_l2: bool,
    /// How a `moe_ffn1` block asks L2 for its down rows of the shared experts while the grid
    /// waits for the router's logits (the memory idles then: the rings are full): 0, not at
    /// all; 1, as any line; 2 (the default), marked evict-last, kept before the evict-first
    /// weight streams (measured 1.0% faster a step than 0 on H100s: 12 processes each way over
    /// four calls; 1 less consistently; doc/benchmarks.md); `DEEPINFER_CUDA_FFN1_L2=N`.
    pub ffn1_l2: u32,
    /// Most ring pages of a `moe_ffn1` block (0: as many as its shared memory holds, today 24
    /// of 8 KB for Moonlight); fewer leave room for a block of the kernel before or after it
    /// beside it (`mla_dec1`'s) (`DEEPINFER_CUDA_FFN1_PAGES=N`, a multiple of 8).
    pub ffn1_pages: usize,
    /// Blocks of a `moe_ffn1` / `moe_fk1` launch (0: one an SM). Fewer can deal the layer's
    /// units out evenly (Moonlight on 128 blocks: 11 gate/up and 8 down units a warp, where
    /// 132 leave a third of the warps a unit short at each phase's tail) and leave SMs free for
    /// the next launch's first blocks; measured 1.005x slower on an H100 (doc/benchmarks.md),
    /// so not the default (`DEEPINFER_CUDA_FFN1_BLOCKS=N`, at least the layer's experts, at
    /// most the SMs).
    pub ffn1_blocks: usize,
    /// MLA's V up-projection for steps of more than 8 tokens (bf16) merges the key splits
    /// into bf16 latents and multiplies every token's with the V rows on tensor cores
    /// (`mla_merge`, `mla_v_mma`) instead of a block a token and head (`mla_v_up`);
    /// `DEEPINFER_CUDA_MLA_MMA=0` turns it off.
    pub mla_mma: bool,
    /// The query absorption of such steps (bf16, nope at most 128) on tensor cores too
    /// (`mla_q_absorb_mma`: a block stages 64 latent columns' K rows once for 64 tokens)
    /// instead of `mla_q_absorb2` (a block per 8 tokens and 64 columns);
    /// `DEEPINFER_CUDA_ABSORB_MMA=0` turns it off (as does `DEEPINFER_CUDA_MLA_MMA=0`).
    pub absorb_mma: bool,
    /// The split-KV attention of such steps (bf16 cache, latent a multiple of 128, latent +
    /// rope a multiple of 32) on tensor cores too (`mla_decode_mma`: 16 heads as the M
    /// dimension, 32-key tiles) instead of `mla_decode2`; `DEEPINFER_CUDA_DECODE_MMA=0` turns
    /// it off (as does `DEEPINFER_CUDA_MLA_MMA=0`).
    pub decode_mma: bool,
    /// Steps whose sequences run 4 tokens or more on average (prompts) take that attention
    /// with 4 tokens a block (`mla_decode_mma4`: 64 rows share each key tile, so a prompt's
    /// latent rows are read a quarter as often); `DEEPINFER_CUDA_DECODE_MMA4=0` turns it off.
    pub decode_mma4: bool,
    /// Prompts' MLA in the expanded form (bf16, DeepSeek-V3's head shape: nope 128, rope 64,
    /// v 128) where it costs less than the absorbed one (`mla::expanded_pays`): the context's
    /// latents expanded through kv_b by cuBLAS, then flash attention over K rows of 192 and V
    /// rows of 128 values (`mla_x_*`); `DEEPINFER_CUDA_MLA_EXPAND=0` turns it off
    /// (`MlaPath::Expanded` still asks for it).
    pub mla_expand: bool,
    /// Steps of more than 8 tokens plan their experts' assignments with a block an expert
    /// (`moe_plan2`) instead of one block walking every expert, and steps of `route8_min`
    /// tokens or more route 8 tokens a block (`moe_route8`, 256 experts at most) instead of one;
    /// both give the same results. `DEEPINFER_CUDA_MOE_MANY=0` turns both off,
    /// `DEEPINFER_CUDA_ROUTE8_MIN=N` sets the bound (256 by default).
    pub moe_many: bool,
    pub route8_min: usize,
}

/// The later variants of the DeepSeek (MLA and MoE decode) kernels, each on or off, so one
/// binary measures them against the earlier kernels (`kernels/mla.cu`, `kernels/moe.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ds2 {
    /// `mla_decode2`: a tile's 16 keys scored together, the first tile's rows of earlier
    /// steps loaded before the programmatic wait.
    pub decode: bool,
    /// `mla_q_absorb2`: the rope's sines and cosines before the wait, the cache rows in a
    /// block of their own.
    pub absorb: bool,
    /// `mla_v_up2`: the split outputs loaded together with their (max, sum) pairs.
    pub v_up: bool,
    /// `moe_route_dec` with the bias and the experts' addresses loaded before the wait.
    pub route: bool,
    /// `moe_down_dec` asking every later step's rows into L2 once their addresses are known.
    /// Off by default: on the H200 the Moonlight-shape batch-1 step took 2.29 / 2.36 ms
    /// without it against 2.41 / 2.45 ms with it (two pairs of runs, one call).
    pub down_prefetch: bool,
    /// `moe_gu_dec`'s shared experts not waiting for the routing (they normalize the layer's
    /// input themselves).
    pub shared: bool,
    /// `moe_route_decc`: the routing of up to 64 experts as one thread-block cluster (block 0
    /// gathers the logits from the others' shared memory; no fence and arrival counter).
    pub cluster: bool,
    /// `moe_route_decc` asking for the rest of its SMs' shared memory, so no other kernel's
    /// blocks (the shared experts' gate/up) share them while it routes.
    pub own_sm: bool,
    /// The decode down projection asking the next layer's q/kv_a weights into L2 as its
    /// blocks finish (`moe::link_next_weights`).
    pub next_l2: bool,
    /// `moe_route1c` for one token (with `cluster`, within its bounds): 2.176 against 2.346 /
    /// 2.363 ms a Moonlight-shape batch-1 step on the H200 (one call).
    pub route1: bool,
    /// `moe_gu_dec` for one token in one wave of blocks (`gu_wave` an SM, 0: off), each
    /// taking several row chunks of its slot and reading the slot table once, instead of a
    /// block a chunk.
    pub gu_wave: u8,
}

impl Ds2 {
    pub const ALL: Ds2 = Ds2 {
        decode: true,
        absorb: true,
        v_up: true,
        route: true,
        down_prefetch: true,
        shared: true,
        cluster: true,
        own_sm: true,
        next_l2: true,
        route1: true,
        gu_wave: 4,
    };
    /// What runs unless `DEEPINFER_CUDA_DS2` says otherwise: all but the down projection's
    /// L2 prefetches and the routing's SM reservation, none of which measured faster on the
    /// H200 (Moonlight shape, batch 1, one call: `nextl2` 2.332, `ownsm` 2.324 against 2.346 /
    /// 2.363 ms without either; `route1` 2.176 ms, the three with `DI_X_EVICT` 2.191 ms), nor
    /// `guwave` (2.294 against 2.194 ms without it, one call).
    pub const DEFAULT: Ds2 = Ds2 {
        down_prefetch: false,
        own_sm: false,
        next_l2: false,
        gu_wave: 0,
        ..Ds2::ALL
    };
    pub const NONE: Ds2 = Ds2 {
        decode: false,
        absorb: false,
        v_up: false,
        route: false,
        down_prefetch: false,
        shared: false,
        cluster: false,
        own_sm: false,
        next_l2: false,
        route1: false,
        gu_wave: 0,
    };

    /// Unset, empty or `1`: [`Ds2::DEFAULT`]; `all`: all; `0` / `none`: none; else a comma-separated list of
    /// `decode`, `absorb`, `vup`, `route`, `prefetch`, `shared`, `cluster`, `ownsm`, `nextl2`,
    /// `route1`, `guwave` (`guwave3`, `guwave2`: 3 or 2 blocks an SM): those only.
    pub fn parse(v: &str) -> Result<Ds2> {
        match v {
            "" | "1" => return Ok(Ds2::DEFAULT),
            "all" => return Ok(Ds2::ALL),
            "0" | "none" => return Ok(Ds2::NONE),
            _ => {}
        }
        let mut d = Ds2::NONE;
        for part in v.split(',') {
            match part.trim() {
                "decode" => d.decode = true,
                "absorb" => d.absorb = true,
                "vup" => d.v_up = true,
                "route" => d.route = true,
                "prefetch" => d.down_prefetch = true,
                "shared" => d.shared = true,
                "cluster" => d.cluster = true,
                "ownsm" => d.own_sm = true,
                "nextl2" => d.next_l2 = true,
                "route1" => d.route1 = true,
                "guwave" => d.gu_wave = 4,
                "guwave3" => d.gu_wave = 3,
                "guwave2" => d.gu_wave = 2,
                other => {
                    return Err(Error::BadConfig(format!(
                        "DEEPINFER_CUDA_DS2={v}: `{other}` is none of decode, absorb, vup, route, prefetch, shared, cluster, ownsm, nextl2, route1, guwave[3|2] \
                         (or use 1 / all, 0 / none)"
                    )))
                }
            }
        }
        Ok(d)
    }
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            act: None,
            graphs: true,
            fuse: true,
            prefill: PrefillKernel::Wide,
            pdl: true,
            gemvb: true,
            gemvp: true,
            gemvp_wide: true,
            gemvp_wide_folds: 0b111,
            gemvp_swiglu: false,
            cluster_policy: None,
            fuse2: false,
            buckets: true,
            fuse_norm: true,
            fuse_add: true,
            fuse_rope_kv: true,
            fuse_silu: true,
            fuse_attn: true,
            gemt: false,
            gemt_splits: 4,
            fuse_moe: true,
            ds2: Ds2::DEFAULT,
            fuse_mla: true,
            fuse_layer: false,
            moe_mma: true,
            mla_mma: true,
            absorb_mma: true,
            moe_gemm: true,
            moe_gemm_min: 4,
            moe_wg: true,
            moe_ffn1: true,
            moe_splitk: false,
            fk1_l2: false,
            ffn1_next_l2: true,
            ffn1_l2: 2,
            ffn1_next: false,
            ffn1_prev: false,
            ffn1_pages: 0,
            ffn1_blocks: 0,
            decode_mma: true,
            decode_mma4: true,
            mla_expand: true,
            moe_many: true,
            route8_min: 256,
        }
    }
}

impl CudaOptions {
    /// Defaults overridden by `DEEPINFER_CUDA_ACT` (`f32` | `bf16`), `DEEPINFER_CUDA_GRAPHS`,
    /// `DEEPINFER_CUDA_FUSE`, `DEEPINFER_CUDA_PDL`, `DEEPINFER_CUDA_GEMVB`, `DEEPINFER_CUDA_GEMVP`,
    /// `DEEPINFER_CUDA_BUCKETS`, `DEEPINFER_CUDA_FUSE_NORM`, `DEEPINFER_CUDA_FUSE_ADD` and
    /// `DEEPINFER_CUDA_FUSE_ROPE_KV`, `DEEPINFER_CUDA_FUSE_SILU`, `DEEPINFER_CUDA_FUSE_ATTN`,
    /// `DEEPINFER_CUDA_FUSE_MOE`, `DEEPINFER_CUDA_FUSE_MLA`, `DEEPINFER_CUDA_MOE_MMA`, `DEEPINFER_CUDA_MLA_MMA` (`0` turns them off), `DEEPINFER_CUDA_FUSE_LAYER` (`1` turns it on), `DEEPINFER_CUDA_DS2` (see [`Ds2::parse`]),
    /// `DEEPINFER_CUDA_GEMVPW` (`0`, or `norm` / `add`: see [`CudaOptions::gemvp_wide_folds`]),
    /// `DEEPINFER_CUDA_GEMT` (`1` turns it on), `DEEPINFER_CUDA_GEMT_SPLITS` (`1`, `2`, `4`,
    /// `8`), `DEEPINFER_CUDA_FUSE2` (`1` turns it on), `DEEPINFER_CUDA_PREFILL` (`1`: plain,
    /// `2`: double-buffered, `3`: wide, the default; see [`PrefillKernel`]),
    /// `DEEPINFER_CUDA_FFN1_PREV` / `DEEPINFER_CUDA_FFN1_NEXT` (`1` on, `0` off),
    /// `DEEPINFER_CUDA_FFN1_PAGES` (a multiple of 8), `DEEPINFER_CUDA_FFN1_L2` (`0`, `1`, `2`),
    /// among others named at their fields. The
    /// kernels' `DEEPINFER_CUDA_DEFINE` list (see [`module::kernel_defines`]) is checked here too.
    pub fn from_env() -> Result<CudaOptions> {
        let mut o = CudaOptions::default();
        module::kernel_defines()?;
        match std::env::var("DEEPINFER_CUDA_ACT").ok().as_deref() {
            None | Some("") | Some("auto") => {}
            Some("f32") => o.act = Some(Act::F32),
            Some("bf16") => o.act = Some(Act::Bf16),
            Some(other) => {
                return Err(Error::BadConfig(format!(
                    "DEEPINFER_CUDA_ACT={other}: expected f32, bf16 or auto"
                )))
            }
        }
        let off = |k: &str| std::env::var(k).map(|v| v == "0").unwrap_or(false);
        // a whole-number bound from `k` where it is set (`what`: its unit, for the error)
        let count = |k: &str, what: &str, into: &mut usize| -> Result<()> {
            if let Ok(v) = std::env::var(k) {
                *into = v.parse().map_err(|_| {
                    Error::BadConfig(format!("{k}={v}: expected a whole number of {what}"))
                })?;
            }
            Ok(())
        };
        o.graphs = !off("DEEPINFER_CUDA_GRAPHS");
        o.fuse = !off("DEEPINFER_CUDA_FUSE");
        o.pdl = !off("DEEPINFER_CUDA_PDL");
        o.gemvb = !off("DEEPINFER_CUDA_GEMVB");
        o.gemvp = !off("DEEPINFER_CUDA_GEMVP");
        match std::env::var("DEEPINFER_CUDA_GEMVPW").ok().as_deref() {
            None | Some("") | Some("1") => {}
            Some("0") => o.gemvp_wide = false,
            Some("norm") => o.gemvp_wide_folds = 0b010,
            Some("add") => o.gemvp_wide_folds = 0b100,
            Some(other) => {
                return Err(Error::BadConfig(format!(
                    "DEEPINFER_CUDA_GEMVPW={other}: expected 1, 0, norm or add"
                )))
            }
        }
        o.buckets = !off("DEEPINFER_CUDA_BUCKETS");
        o.fuse_norm = !off("DEEPINFER_CUDA_FUSE_NORM");
        o.fuse_add = !off("DEEPINFER_CUDA_FUSE_ADD");
        o.fuse_rope_kv = !off("DEEPINFER_CUDA_FUSE_ROPE_KV");
        o.fuse_silu = !off("DEEPINFER_CUDA_FUSE_SILU");
        o.fuse_attn = !off("DEEPINFER_CUDA_FUSE_ATTN");
        o.gemt = std::env::var("DEEPINFER_CUDA_GEMT").is_ok_and(|v| v == "1");
        if let Ok(v) = std::env::var("DEEPINFER_CUDA_GEMT_SPLITS") {
            o.gemt_splits = match v.as_str() {
                "1" => 1,
                "2" => 2,
                "4" => 4,
                "8" => 8,
                _ => {
                    return Err(Error::BadConfig(format!(
                        "DEEPINFER_CUDA_GEMT_SPLITS={v}: expected 1, 2, 4 or 8"
                    )))
                }
            };
        }
        o.fuse_moe = !off("DEEPINFER_CUDA_FUSE_MOE");
        o.fuse_mla = !off("DEEPINFER_CUDA_FUSE_MLA");
        o.moe_mma = !off("DEEPINFER_CUDA_MOE_MMA");
        o.mla_mma = !off("DEEPINFER_CUDA_MLA_MMA");
        o.absorb_mma = !off("DEEPINFER_CUDA_ABSORB_MMA");
        o.moe_gemm = !off("DEEPINFER_CUDA_MOE_GEMM");
        o.moe_wg = !off("DEEPINFER_CUDA_MOE_WG");
        o.moe_ffn1 = !off("DEEPINFER_CUDA_MOE_FFN1");
        let switch = |k: &str, into: &mut bool| -> Result<()> {
            *into = parse_switch(k, std::env::var(k).ok().as_deref(), *into)?;
            Ok(())
        };
        switch("DEEPINFER_CUDA_GEMVPS", &mut o.gemvp_swiglu)?;
        match std::env::var("DEEPINFER_CUDA_CLUSTER_POLICY")
            .ok()
            .as_deref()
        {
            None | Some("") | Some("default") => {}
            Some("spread") => {
                o.cluster_policy =
                    Some(sys::CUclusterSchedulingPolicy::CU_CLUSTER_SCHEDULING_POLICY_SPREAD)
            }
            Some("balance") => {
                o.cluster_policy = Some(
                    sys::CUclusterSchedulingPolicy::CU_CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING,
                )
            }
            Some(other) => {
                return Err(Error::BadConfig(format!(
                    "DEEPINFER_CUDA_CLUSTER_POLICY={other}: expected default, spread or balance"
                )))
            }
        }
        switch("DEEPINFER_CUDA_FFN1_NEXT", &mut o.ffn1_next)?;
        switch("DEEPINFER_CUDA_FFN1_PREV", &mut o.ffn1_prev)?;
        switch("DEEPINFER_CUDA_MOE_SPLITK", &mut o.moe_splitk)?;
        switch("DEEPINFER_CUDA_FK1_L2", &mut o.fk1_l2)?;
        switch("DEEPINFER_CUDA_FFN1_NEXT_L2", &mut o.ffn1_next_l2)?;
        count("DEEPINFER_CUDA_FFN1_PAGES", "ring pages", &mut o.ffn1_pages)?;
        count("DEEPINFER_CUDA_FFN1_BLOCKS", "blocks", &mut o.ffn1_blocks)?;
        if o.ffn1_pages % 8 != 0 {
            return Err(Error::BadConfig(format!(
                "DEEPINFER_CUDA_FFN1_PAGES={}: expected a multiple of 8 (a whole number of pages each of the 8 warps)",
                o.ffn1_pages
            )));
        }
        let mut l2 = o.ffn1_l2 as usize;
        count("DEEPINFER_CUDA_FFN1_L2", "modes", &mut l2)?;
        if l2 > 2 {
            return Err(Error::BadConfig(format!(
                "DEEPINFER_CUDA_FFN1_L2={l2}: expected 0 (off), 1 (as any line) or 2 (evict-last)"
            )));
        }
        o.ffn1_l2 = l2 as u32;
        count(
            "DEEPINFER_CUDA_MOE_GEMM_MIN",
            "assignments",
            &mut o.moe_gemm_min,
        )?;
        o.decode_mma = !off("DEEPINFER_CUDA_DECODE_MMA");
        o.decode_mma4 = !off("DEEPINFER_CUDA_DECODE_MMA4");
        o.mla_expand = !off("DEEPINFER_CUDA_MLA_EXPAND");
        o.moe_many = !off("DEEPINFER_CUDA_MOE_MANY");
        count("DEEPINFER_CUDA_ROUTE8_MIN", "tokens", &mut o.route8_min)?;
        o.fuse_layer = std::env::var("DEEPINFER_CUDA_FUSE_LAYER").is_ok_and(|v| v == "1");
        if let Ok(v) = std::env::var("DEEPINFER_CUDA_DS2") {
            o.ds2 = Ds2::parse(&v)?;
        }
        o.fuse2 = std::env::var("DEEPINFER_CUDA_FUSE2").is_ok_and(|v| v == "1");
        match std::env::var("DEEPINFER_CUDA_PREFILL").ok().as_deref() {
            None | Some("") => {}
            Some("1") => o.prefill = PrefillKernel::Plain,
            Some("2") => o.prefill = PrefillKernel::Pipelined,
            Some("3") => o.prefill = PrefillKernel::Wide,
            Some(other) => {
                return Err(Error::BadConfig(format!(
                    "DEEPINFER_CUDA_PREFILL={other}: expected 1 (plain), 2 (double-buffered), \
                     or 3 (wide, the default)"
                )))
            }
        }
        Ok(o)
    }
}

/// Why no CUDA device can be used here, or `None` when one can.
pub fn unavailable_reason() -> Option<String> {
    // SAFETY: these only try to dlopen the libraries.
    let (driver, nvrtc, cublas) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
        )
    };
    if !driver {
        return Some("no CUDA driver library (libcuda) found".into());
    }
    if !nvrtc {
        return Some("no NVRTC library (libnvrtc) found".into());
    }
    if !cublas {
        return Some("no cuBLAS library (libcublas) found".into());
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => None,
        Ok(_) => Some("the CUDA driver reports no device".into()),
        Err(e) => Some(format!("the CUDA driver failed to start: {e:?}")),
    }
}

/// Attention counters allocated (see `Inner::counters`).
const ATTN_COUNTERS: usize = 1 << 18;

/// Shared state of one backend and everything made from it.
pub(crate) struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Module,
    blas: Blas,
    pool: Mutex<Pool>,
    queue: Mutex<Queue>,
    opts: CudaOptions,
    act: OnceLock<Act>,
    /// Every matrix weight prepared so far is bf16 or f16.
    all_half: AtomicBool,
    /// The latest step's token ids and logits rows, and where they are on the device.
    step_cache: Mutex<Option<step::StepCache>>,
    /// Staging buffer of large reads.
    pinned: Mutex<Option<readback::Pinned>>,
    /// Zeroed arrival counters of the decode attention's in-kernel split merge (each launch
    /// leaves them zero); `None` inside when the allocation failed.
    counters: OnceLock<Option<DevMem>>,
    /// This backend's hold on its device's grid-waiting kernels (`moe_ffn1`, `mla_layer1`),
    /// where its options asked for them and no other backend of the process holds them.
    _grid_wait: Option<GridWaitClaim>,
    name: String,
}

/// Devices (ordinals) on which a backend of this process may launch kernels whose blocks wait
/// on each other's progress (`moe_ffn1`, `mla_layer1`). Two such grids running at once on
/// one device (two backends' streams share the device's primary context) could each hold
/// part of the SMs and wait forever for their other blocks, so one backend a device at a
/// time may use them; the others take the kernels that do not wait.
static GRID_WAIT_DEVICES: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// A backend's hold on one device's grid-waiting kernels, given back when it is dropped.
struct GridWaitClaim(usize);

impl GridWaitClaim {
    fn take(ordinal: usize) -> Option<GridWaitClaim> {
        let mut held = GRID_WAIT_DEVICES.lock().unwrap_or_else(|p| p.into_inner());
        if held.contains(&ordinal) {
            return None;
        }
        held.push(ordinal);
        Some(GridWaitClaim(ordinal))
    }
}

impl Drop for GridWaitClaim {
    fn drop(&mut self) {
        let mut held = GRID_WAIT_DEVICES.lock().unwrap_or_else(|p| p.into_inner());
        held.retain(|&o| o != self.0);
    }
}

impl Inner {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pool(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn act(&self) -> Act {
        *self.act.get_or_init(|| {
            self.opts
                .act
                .unwrap_or(if self.all_half.load(Ordering::Relaxed) {
                    Act::Bf16
                } else {
                    Act::F32
                })
        })
    }

    fn push(&self, op: Op) {
        self.queue().push(op);
    }

    /// Runs all queued work (without waiting for it).
    fn flush(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        self.queue().flush(&self.module, &self.blas, &self.stream)
    }

    fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("synchronizing the stream", e))
    }

    /// A pooled buffer of `len` elements of `elem` bytes (contents undefined).
    fn scratch(self: &Arc<Self>, len: usize, elem: usize) -> Result<CudaBuf> {
        let mem = self.pool().take(&self.ctx, (len * elem).max(1))?;
        Ok(CudaBuf {
            mem: Some(mem),
            len,
            host_len: len,
            inner: self.clone(),
        })
    }

    /// Drops the zeroing of a fresh buffer `[ptr, ptr + bytes)` that the op about to be
    /// queued overwrites whole (the memset `zeros` queued, if only memsets came after it).
    fn drop_zeroing(&self, ptr: u64, bytes: usize) {
        if self.opts.fuse {
            self.queue().drop_memset(ptr, bytes);
        }
    }

    /// Device length of a new per-token buffer of `n` values: while a padded step lives, a
    /// buffer of whole rows of the real tokens gets the padding rows too.
    fn padded_len(&self, n: usize) -> usize {
        let pad = self
            .step_cache
            .lock()
            .ok()
            .and_then(|c| c.as_ref().and_then(|c| c.pad));
        match pad {
            Some(p) if n > 0 && n.is_multiple_of(p.real) => n / p.real * p.padded,
            _ => n,
        }
    }

    /// The device address of at least `n` zeroed attention counters, if there are that many.
    fn counters(&self, n: usize) -> Option<u64> {
        let mem = self.counters.get_or_init(|| {
            let bytes = ATTN_COUNTERS * 4;
            let mem = DevMem::alloc(&self.ctx, bytes).ok()?;
            // SAFETY: a fresh allocation of `bytes` bytes, zeroed before any kernel sees it.
            unsafe { cudarc::driver::result::memset_d8_sync(mem.ptr, 0, bytes) }.ok()?;
            Some(mem)
        });
        mem.as_ref()
            .filter(|_| n <= ATTN_COUNTERS - mla::LAYER_COUNTERS)
            .map(|m| m.ptr)
    }

    /// The fused MLA layer launch's counters (`mla::LAYER_COUNTERS` of them, zeroed, kept
    /// apart from the attention counters at the end of the same allocation).
    fn layer_counters(&self) -> Option<u64> {
        let base = self.counters(0)?;
        Some(base + ((ATTN_COUNTERS - mla::LAYER_COUNTERS) * 4) as u64)
    }

    /// Frees `mem` once queued work that may use it has run.
    fn retire(&self, mem: DevMem) {
        let _ = self.flush();
        let _ = self.sync();
        self.queue().drop_graphs();
        drop(mem);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let q = self.queue.get_mut().unwrap_or_else(|p| p.into_inner());
        let _ = q.flush(&self.module, &self.blas, &self.stream);
        let _ = self.stream.synchronize();
        q.drop_graphs();
        self.pool
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .release_all();
    }
}

/// A device buffer of activations (or scratch), returned to the pool when dropped.
///
/// `len` is what the kernels run over; `host_len` (at most `len`) is what the model asked
/// for and what reaches the host. They differ for the per-token buffers of a padded decode
/// step (`step::bucket`), whose extra rows belong to padding sequences: operations take their
/// row counts from `len`, reads to the host stop at `host_len`.
pub struct CudaBuf {
    mem: Option<DevMem>,
    len: usize,
    host_len: usize,
    inner: Arc<Inner>,
}

impl CudaBuf {
    /// Elements held (padding rows not counted: the field `len` is the device length, which
    /// counts them).
    #[allow(clippy::misnamed_getters)]
    pub fn len(&self) -> usize {
        self.host_len
    }

    pub fn is_empty(&self) -> bool {
        self.host_len == 0
    }

    /// Elements the device holds and kernels run over (padding rows included).
    pub fn device_len(&self) -> usize {
        self.len
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.mem.as_ref().map_or(0, |m| m.ptr)
    }
}

impl Drop for CudaBuf {
    fn drop(&mut self) {
        if let Some(m) = self.mem.take() {
            self.inner.pool().give(m);
        }
    }
}

/// The CUDA backend: one device, one stream. Cheap to clone (shared state).
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

impl CudaBackend {
    /// Opens device `ordinal`, compiles (or loads cached) kernels and creates the cuBLAS handle.
    pub fn new(ordinal: usize, mut opts: CudaOptions) -> Result<CudaBackend> {
        if let Some(why) = unavailable_reason() {
            return Err(Error::Cuda(why));
        }
        let grid_wait = if opts.moe_ffn1 || opts.fuse_layer {
            let claim = GridWaitClaim::take(ordinal);
            if claim.is_none() {
                tracing::info!(
                    "cuda:{ordinal}: another backend of this process runs the grid-waiting kernels \
                     (moe_ffn1, mla_layer1) on this device; this one takes the kernels that do not wait"
                );
                opts.moe_ffn1 = false;
                opts.fuse_layer = false;
            }
            claim
        } else {
            None
        };
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| cuda_err(&format!("opening CUDA device {ordinal}"), e))?;
        // SAFETY: this backend never uses cudarc's tracked slices, only raw allocations
        // ordered on its one stream, so cudarc's per-slice event tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("creating a stream", e))?;
        let mut module = Module::load(&ctx)?;
        module.pdl &= opts.pdl;
        module.cluster_policy = opts.cluster_policy;
        let mut queue = Queue::new(opts.graphs);
        queue.next_l2 = opts.ds2.next_l2;
        queue.ffn1_next = opts.moe_ffn1 && opts.ffn1_next;
        queue.ffn1_prev = opts.moe_ffn1 && opts.ffn1_prev;
        queue.fk1_l2 = opts.moe_ffn1 && opts.moe_splitk && opts.fk1_l2;
        queue.ffn1_next_l2 = opts.moe_ffn1 && opts.ffn1_next_l2;
        if let (Some(path), Some(table)) = (trace::requested(), module.trace_table) {
            queue.tracer = Some(trace::Tracer::new(path, table)?.with_blocks(module.trace_blocks)?);
        }
        let blas = Blas::new(&ctx, &stream)?;
        let name = format!(
            "cuda:{ordinal} ({})",
            ctx.name().unwrap_or_else(|_| "unknown GPU".into())
        );
        let inner = Inner {
            queue: Mutex::new(queue),
            ctx,
            stream,
            module,
            blas,
            pool: Mutex::new(Pool::default()),
            act: OnceLock::new(),
            all_half: AtomicBool::new(true),
            step_cache: Mutex::new(None),
            pinned: Mutex::new(None),
            counters: OnceLock::new(),
            opts,
            _grid_wait: grid_wait,
            name,
        };
        Ok(CudaBackend {
            inner: Arc::new(inner),
        })
    }

    /// The activation type (fixed by the first buffer made).
    pub fn act(&self) -> Act {
        self.inner.act()
    }

    /// Whether the loaded kernels include Hopper's warpgroup-MMA ones (an `sm_90a` image).
    pub fn has_wgmma(&self) -> bool {
        self.inner.module.moe_wg.is_some()
    }

    /// Whether this backend runs one-token MoE layers in one persistent launch (`moe_ffn1`:
    /// asked for by its options, an sm_90+ device holding one of its blocks on every SM, and
    /// no other backend of the process running it on the device).
    pub fn runs_moe_ffn1(&self) -> bool {
        self.inner.opts.moe_ffn1 && self.inner.module.deepseek[1].moe_ffn1.is_some()
    }

    /// Whether a `moe_ffn1` launch takes in the next layer's norm and q/kv_a product after it
    /// (`CudaOptions::ffn1_next`).
    pub fn folds_ffn1_next(&self) -> bool {
        self.runs_moe_ffn1() && self.inner.opts.ffn1_next
    }

    /// Whether a `moe_ffn1` launch takes in the o product with its residual add before it
    /// (`CudaOptions::ffn1_prev`).
    pub fn folds_ffn1_prev(&self) -> bool {
        self.runs_moe_ffn1() && self.inner.opts.ffn1_prev
    }

    /// Uploads f32 values as an activation buffer (tests, tools).
    pub fn from_host(&self, values: &[f32]) -> Result<CudaBuf> {
        ops::from_host(&self.inner, values)
    }

    /// Queue counters so far.
    pub fn stats(&self) -> QueueStats {
        self.inner.queue().stats
    }

    /// Measure the device time of flushed work (synchronizes every flush).
    pub fn set_timing(&self, on: bool) {
        self.inner.queue().timing = on;
    }

    /// Runs queued work and waits for it.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.flush()?;
        self.inner.sync()
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Weight = CudaWeight;
    type Kv = CudaKv;
    type Step = CudaStep;
    type MlaKv = CudaMlaKv;

    fn device_name(&self) -> String {
        self.inner.name.clone()
    }

    fn prepare_weight(&self, w: &Weight) -> Result<CudaWeight> {
        weights::prepare(&self.inner, w)
    }

    fn zeros(&self, n: usize) -> Result<CudaBuf> {
        let act = self.inner.act();
        let dev = self.inner.padded_len(n);
        let mut b = self.inner.scratch(dev, act.size())?;
        b.host_len = n;
        if dev > 0 {
            self.inner.push(Op::Memset {
                ptr: b.ptr(),
                bytes: dev * act.size(),
            });
        }
        Ok(b)
    }

    fn new_kv(&self, shape: KvShape) -> Result<CudaKv> {
        weights::new_kv(&self.inner, shape)
    }

    fn prepare_step(&self, batch: &Batch, block_size: usize) -> Result<CudaStep> {
        step::prepare(&self.inner, batch, block_size)
    }

    fn embed(&self, table: &CudaWeight, tokens: &[TokenId], out: &mut CudaBuf) -> Result<()> {
        ops::embed(&self.inner, table, tokens, out)
    }

    fn matmul(&self, w: &CudaWeight, x: &CudaBuf, n_tokens: usize, y: &mut CudaBuf) -> Result<()> {
        matmul::matmul(&self.inner, w, x, n_tokens, y)
    }

    fn rms_norm(&self, x: &CudaBuf, w: &CudaWeight, eps: f32, out: &mut CudaBuf) -> Result<()> {
        // the norm writes every row of `out`
        if w.rows == 1 && w.cols > 0 && x.len > 0 && out.len == x.len / w.cols * w.cols {
            let size = self.inner.act().size();
            self.inner.drop_zeroing(out.ptr(), out.len * size);
        }
        ops::rms_norm(&self.inner, x, w, eps, out)
    }

    fn add_assign(&self, x: &mut CudaBuf, y: &CudaBuf) -> Result<()> {
        ops::add_assign(&self.inner, x, y)
    }

    fn silu_mul(&self, gate: &mut CudaBuf, up: &CudaBuf) -> Result<()> {
        ops::silu_mul(&self.inner, gate, up)
    }

    fn rope(
        &self,
        step: &mut CudaStep,
        spec: RopeSpec,
        x: &mut CudaBuf,
        n_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        ops::rope(&self.inner, step, spec, x, n_heads, head_dim)
    }

    fn attention(
        &self,
        step: &CudaStep,
        kv: &mut CudaKv,
        layer: usize,
        p: &AttnParams,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<()> {
        attention::attention(&self.inner, step, kv, layer, p, q, k, v, out)
    }

    fn gather_rows(
        &self,
        x: &CudaBuf,
        width: usize,
        rows: &[usize],
        out: &mut CudaBuf,
    ) -> Result<()> {
        ops::gather_rows(&self.inner, x, width, rows, out)
    }

    fn to_host(&self, x: &CudaBuf) -> Result<Vec<f32>> {
        ops::to_host(&self.inner, x)
    }

    fn new_mla_kv(
        &self,
        layers: usize,
        num_blocks: usize,
        block_size: usize,
        width: usize,
    ) -> Result<CudaMlaKv> {
        mla::new_kv(&self.inner, layers, num_blocks, block_size, width)
    }

    fn mla_kv_value_bytes(&self) -> usize {
        self.inner.act().size()
    }

    fn mla_attention(
        &self,
        step: &mut CudaStep,
        kv: &mut CudaMlaKv,
        layer: usize,
        p: &crate::model::mla::MlaParams,
        w: &crate::model::mla::MlaWeights<'_, CudaWeight>,
        q: &mut CudaBuf,
        kva: &CudaBuf,
        out: &mut CudaBuf,
    ) -> Result<()> {
        mla::attention(&self.inner, step, kv, layer, p, w, q, kva, out)
    }

    fn moe(
        &self,
        layer: &crate::model::moe::MoeLayer<CudaWeight>,
        x: &CudaBuf,
        tokens: &[TokenId],
        n: usize,
        d: usize,
        out: &mut CudaBuf,
    ) -> Result<()> {
        moe::forward(self, layer, x, tokens, n, d, out)
    }

    fn expert_load(
        &self,
        layer: &crate::model::moe::MoeLayer<CudaWeight>,
    ) -> Result<crate::model::moe::ExpertLoad> {
        moe::load(&self.inner, layer)
    }

    fn upload(&self, x: &[f32]) -> Result<CudaBuf> {
        // While a padded step lives, per-token data gets zero padding rows, as `zeros` does.
        let dev = self.inner.padded_len(x.len());
        if dev == x.len() {
            return ops::from_host(&self.inner, x);
        }
        let mut padded = Vec::with_capacity(dev);
        padded.extend_from_slice(x);
        padded.resize(dev, 0.0);
        let mut b = ops::from_host(&self.inner, &padded)?;
        b.host_len = x.len();
        Ok(b)
    }

    fn argmax_rows(&self, x: &CudaBuf, width: usize) -> Result<Vec<u32>> {
        sample::argmax_rows(&self.inner, x, width)
    }

    fn top_k_rows(&self, x: &CudaBuf, width: usize, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        sample::top_k_rows(&self.inner, x, width, k)
    }
}

/// A switch variable's value: `1` on, `0` off, unset or empty `default`; anything else is an
/// error naming the variable.
fn parse_switch(name: &str, value: Option<&str>, default: bool) -> Result<bool> {
    match value {
        None | Some("") => Ok(default),
        Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(v) => Err(Error::BadConfig(format!("{name}={v}: expected 0 or 1"))),
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_switch, GridWaitClaim};

    #[test]
    fn switch_variables_take_0_or_1_and_name_themselves_otherwise() {
        assert!(parse_switch("X", Some("1"), false).unwrap());
        assert!(!parse_switch("X", Some("0"), true).unwrap());
        assert!(parse_switch("X", None, true).unwrap());
        assert!(!parse_switch("X", Some(""), false).unwrap());
        let e = parse_switch("DEEPINFER_CUDA_FFN1_PREV", Some("yes"), false).unwrap_err();
        assert!(
            e.to_string().contains("DEEPINFER_CUDA_FFN1_PREV=yes"),
            "{e}"
        );
    }

    #[test]
    fn one_backend_a_device_holds_the_grid_waiting_kernels() {
        // ordinals no other test claims
        let first = GridWaitClaim::take(1001).expect("a free device is claimed");
        assert!(
            GridWaitClaim::take(1001).is_none(),
            "a held device is not claimed twice"
        );
        let other = GridWaitClaim::take(1002);
        assert!(other.is_some(), "another device is claimed on its own");
        drop(first);
        assert!(
            GridWaitClaim::take(1001).is_some(),
            "a dropped claim frees its device"
        );
    }
}
