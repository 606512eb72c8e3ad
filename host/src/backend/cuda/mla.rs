//! Multi-head latent attention on the device (`kernels/mla.cu`): the paged latent cache and
//! the launcher of one layer's attention (query absorption with the cache write, split-KV
//! decode over the latents, merge + V up-projection). It checks shapes and queues launches;
//! it must not know about checkpoints.
//!
//! The cache holds, per layer, `[(1 + num_blocks) * block_size, latent + rope]` values of the
//! activation type: f32 for f32 models (so the tiny fp32 checkpoints agree with the CPU to
//! f32 rounding), bf16 for bf16 models (half the bytes the decode kernel streams; the latent
//! is the product of a bf16 projection anyway).

use std::sync::Arc;

use super::blas::{Gemm, GemmType};
use super::device::DevMem;
use super::module::{
    MLA_DECODE4_SMEM, MLA_DECODE_MMA_SMEM, MLA_DECODE_THREADS, MLA_X_SMEM, ROWMMA_ROWS,
    ROWMMA_THREADS,
};
use super::ops::{check, launch};
use super::queue::Op;
use super::step::CudaStep;
use super::weights::WType;
use super::{Act, CudaBuf, CudaWeight, Inner};
use crate::error::{Error, Result};
use crate::model::mla::{MlaParams, MlaPath, MlaWeights};

/// Most latent + rope values per token the decode kernel takes (`MLA_MAXW`).
pub const MLA_MAX_WIDTH: usize = 576;
/// Most nope query values per head the absorption kernel stages (`MLA_MAXNOPE`).
pub const MLA_MAX_NOPE: usize = 256;
/// Query heads per decode block (`MLA_HEADS`).
const MLA_HEADS: usize = 16;
/// Output rows per V up-projection block (`MLA_VROWS`).
const V_ROWS: usize = 32;
/// Steps of more tokens than this (bf16) take MLA's tensor-core kernels (`CudaOptions::mla_mma`);
/// tokens a block of the V up-projection (`MLA_VT`) and threads of its split merge
/// (`MLA_MERGE_THREADS`).
const MMA_MIN_TOKENS: usize = 8;
const MMA_TOKENS: usize = 16;
const MERGE_THREADS: u32 = 128;
/// The tensor-core query absorption (`CudaOptions::absorb_mma`): latent columns and tokens a
/// block (`MLA_QC`, `MLA_QT`), most nope values a head (`MLA_QMAXNOPE`).
const ABSORB_COLS: usize = 64;
const ABSORB_TOKENS: usize = 64;
const ABSORB_MAX_NOPE: usize = 128;
/// Tokens a block of the tensor-core attention for prompts (`MLA_D4T`).
const DECODE4_TOKENS: usize = 4;
/// Blocks the decode kernel aims to launch (two waves of 132 SMs).
const TARGET_BLOCKS: usize = 264;

/// The paged latent cache on the device. Like [`super::CudaKv`] it keeps one scratch block in
/// front of block 0 (block -1), where the padding rows of a padded decode step write and read.
pub struct CudaMlaKv {
    layers: Vec<DevMem>,
    pub num_blocks: usize,
    pub block_size: usize,
    pub width: usize,
    pub act: Act,
    inner: Arc<Inner>,
}

impl CudaMlaKv {
    /// The address of block 0 of `layer` (the scratch block lies just before it).
    fn layer(&self, layer: usize) -> Option<u64> {
        let block = (self.block_size * self.width * self.act.size()) as u64;
        self.layers.get(layer).map(|m| m.ptr + block)
    }
}

impl Drop for CudaMlaKv {
    fn drop(&mut self) {
        for m in self.layers.drain(..) {
            self.inner.retire(m);
        }
    }
}

pub(crate) fn new_kv(
    inner: &Arc<Inner>,
    layers: usize,
    num_blocks: usize,
    block_size: usize,
    width: usize,
) -> Result<CudaMlaKv> {
    if block_size == 0 {
        return Err(Error::BadConfig("KV block_size must be at least 1".into()));
    }
    let act = inner.act();
    let bytes = (num_blocks + 1)
        .checked_mul(block_size)
        .and_then(|x| x.checked_mul(width))
        .and_then(|x| x.checked_mul(act.size()))
        .ok_or_else(|| Error::BadConfig("MLA cache size overflows".into()))?;
    let mut mems = Vec::with_capacity(layers);
    for _ in 0..layers {
        let m = DevMem::alloc(&inner.ctx, bytes)?;
        m.zero(&inner.stream)?;
        mems.push(m);
    }
    Ok(CudaMlaKv {
        layers: mems,
        num_blocks,
        block_size,
        width,
        act,
        inner: inner.clone(),
    })
}

/// Key splits per (token, head group): enough blocks to fill the GPU, at least 16 keys (one
/// shared-memory tile) each; depends on the context only through its power-of-two bucket
/// (decode steps keep one shape).
pub fn splits_for(blocks: usize, max_ctx: usize) -> usize {
    let by_gpu = TARGET_BLOCKS.div_ceil(blocks.max(1));
    let by_ctx = max_ctx.next_power_of_two().div_ceil(16);
    by_gpu.min(by_ctx).clamp(1, 64)
}

/// Blocks of a cluster of the fused decode kernel (`mla_dec1`), or `None` where the step
/// keeps the three launches. It takes steps of one token a sequence on devices with clusters,
/// of at most [`FUSED_MAX_BLOCKS`] blocks and contexts of at most [`FUSED_MAX_CTX`], and shapes
/// it was written for ([`cluster_for`]; so latents of at most 8 x 64 = 512), rope values at
/// most 128, and cache rows of whole 16-byte units.
fn fused_cluster(inner: &Inner, step: &CudaStep, p: &MlaParams) -> Option<usize> {
    let d = p.dims;
    let (r, dr) = (d.latent, d.rope);
    if !(inner.opts.fuse && inner.opts.fuse_mla && inner.module.clusters)
        || step.max_len != 1
        || step.max_ctx > FUSED_MAX_CTX
        || dr > 128
        || !((r + dr) * inner.act().size()).is_multiple_of(16)
    {
        return None;
    }
    let c = cluster_for(&d)?;
    (step.n_tokens * d.heads * c <= FUSED_MAX_BLOCKS).then_some(c)
}

/// The blocks a head of the fused decode kernel splits into for these dimensions (8, 4 or 2,
/// the largest that fits), or `None` for shapes it was not written for: each block absorbs
/// r / C latent columns (a multiple of 8, at most 64, in 1, 2, 4 or 8 chunks of 8, at most
/// 1,024 chunks of weights) and projects v / C rows (at most 16) of those r columns.
fn cluster_for(d: &crate::model::mla::MlaDims) -> Option<usize> {
    let r = d.latent;
    [8usize, 4, 2].into_iter().find(|&c| {
        let rc = r / c;
        r.is_multiple_of(c)
            && rc.is_multiple_of(8)
            && rc <= 64
            && [1, 2, 4, 8].contains(&(rc / 8))
            && d.nope * (rc / 8) <= 1024
            && d.v.is_multiple_of(c)
            && d.v / c <= 16
    })
}

/// Most blocks of a fused decode launch (4 waves of the H200's 132 SMs; so at most 264
/// tokens, well inside a grid's z).
const FUSED_MAX_BLOCKS: usize = 4 * 132;
/// Longest context the fused decode kernel takes: it walks a split's keys one 32-key tile (16
/// for f32 caches) at a time without double buffering. On the H200 it still beat the three
/// launches at contexts 897..1024 (Moonlight step 2.81 against 3.00 ms), by less than at 256.
const FUSED_MAX_CTX: usize = 1024;

/// The fused layer launch (`mla_layer1`, `CudaOptions::fuse_layer`) in place of `mla_dec1`:
/// its kernel, dynamic shared memory and the arguments after `mla_dec1`'s (see `Mla1Layer` in
/// `kernels/mla.cu`), with the o product and the residual add left out until
/// [`fold_o`] and [`fold_add`] fold them in.
struct LayerLaunch {
    kernel: super::module::KernelId,
    smem: u32,
    args: Vec<u64>,
}

/// Arguments of `mla_dec1` (the fused layer launch's first ones), where its head count and
/// V width are, and where the fused launch's hidden width is.
const DEC1_ARGS: usize = 22;
const A_HEADS: usize = 13;
const A_V: usize = 16;
const L_K: usize = DEC1_ARGS + 7;
/// Where the fused layer launch's o weights, their row bytes, the o output, the residual
/// stream, the partial sums and the counters go.
const L_WO: usize = DEC1_ARGS + 10;
const L_OY: usize = L_WO + 2;
const L_RES: usize = L_WO + 3;
const L_ARGS: usize = L_WO + 6;
/// Most query rows, q + kv_a rows and V values a block of the fused layer launch takes
/// (`MLA1_MAXQR`, `MLA1_MAXLR`, `MLA1_MAXV`).
const L_MAX_QROWS: usize = 192;
const L_MAX_ROWS: usize = 64;
const L_MAX_V: usize = 256;
/// Counters of the fused layer launch: the kv_a rows, the blocks done, one per row chunk.
pub(crate) const LAYER_COUNTERS: usize = 2 + 8;

/// Takes back the q / kv_a GEMV just queued (the RMSNorm folded in, one token, bf16) into the
/// fused layer launch of these `c`-block clusters when everything it needs holds: bf16
/// activations and kv_b, both products in that GEMV writing `q` and `kva`, the block's rows
/// in the shared memory the device has, and the device holding every cluster at once (a
/// block waits for the others' kv_a rows). `None` leaves the queue as it was.
fn fold_qkv(
    inner: &Arc<Inner>,
    step: &CudaStep,
    p: &MlaParams,
    w: &MlaWeights<'_, CudaWeight>,
    q: &CudaBuf,
    kva: &CudaBuf,
    c: usize,
) -> Result<Option<LayerLaunch>> {
    // why a one-token step does not take it (`DEEPINFER_LOG=deepinfer=debug` shows it)
    fn skip(why: &str) -> Result<Option<LayerLaunch>> {
        tracing::debug!("the fused layer launch is not used: {why}");
        Ok(None)
    }
    let d = p.dims;
    let k = &inner.module.deepseek[1];
    if !inner.opts.fuse_layer || step.n_tokens != 1 {
        return Ok(None);
    }
    let Some(kernel) = k.mla_layer1 else {
        return skip("no bf16 kernel");
    };
    let ci = match c {
        2 => 0,
        4 => 1,
        8 => 2,
        _ => return skip("clusters of another size"),
    };
    let (qk, width) = (d.nope + d.rope, d.latent + d.rope);
    if inner.act() != Act::Bf16 || w.kv_b.wtype != WType::Bf16 {
        return skip("f32 activations or kv_b weights");
    }
    if (k.mla_layer1_clusters[ci] as usize) < d.heads {
        return skip(&format!(
            "the device holds {} clusters of {c} at once, {} heads need as many",
            k.mla_layer1_clusters[ci], d.heads
        ));
    }
    if !d.v.is_multiple_of(8) || d.v > L_MAX_V {
        return skip("v not a multiple of 8 up to 256");
    }
    let (rq, rk) = (qk.div_ceil(c), width.div_ceil(d.heads * c));
    let mut queue = inner.queue();
    let Some(Op::Gemv(g)) = queue.last_mut() else {
        return skip("the q / kv_a product is not the last op");
    };
    let Some((raw, gain, eps)) = g.norm else {
        return skip("no RMSNorm folded into the q / kv_a product");
    };
    let hidden = g.p.k;
    let s = &g.p.segs;
    // the input in f32
    let smem = hidden * 4;
    if g.p.n != 1
        || g.wtype != WType::Bf16
        || g.res != 0
        || g.swiglu
        || s.len() != 2
        || s[0].1 != q.ptr()
        || s[0].2 != d.heads * qk
        || s[1].1 != kva.ptr()
        || s[1].2 != width
        || !hidden.is_multiple_of(8)
        || !g.p.row_bytes.is_multiple_of(16)
    {
        return skip("the last op is not one bf16 product of q and kv_a");
    }
    if rq > L_MAX_QROWS || rq + rk > L_MAX_ROWS || smem > k.mla_layer1_smem as usize {
        return skip(&format!(
            "{rq} + {rk} rows a block, {smem} bytes of shared memory (at most {})",
            k.mla_layer1_smem
        ));
    }
    let Some(cnt) = inner.layer_counters() else {
        return skip("no counters");
    };
    let (wq, wk, row_bytes, hn) = (s[0].0, s[1].0, g.p.row_bytes, g.p.x);
    drop(queue);
    // allocated before the GEMV is taken back, so a failure leaves the queue as it was
    let part = inner.scratch(d.heads * hidden, 4)?;
    inner.queue().pop();
    let mut args = vec![
        raw,
        gain,
        eps as u64,
        hn,
        wq,
        wk,
        row_bytes as u64,
        hidden as u64,
        rq as u64,
        rk as u64,
    ];
    // o weights, row bytes, output, residual: [`fold_o`], [`fold_add`]
    args.extend_from_slice(&[0, 0, 0, 0, part.ptr(), cnt]);
    debug_assert_eq!(DEC1_ARGS + args.len(), L_ARGS);
    Ok(Some(LayerLaunch {
        kernel,
        smem: smem as u32,
        args,
    }))
}

/// The arguments of the fused layer launch just queued, if that is the last op.
fn last_layer<'a>(inner: &Inner, queue: &'a mut super::queue::Queue) -> Option<&'a mut Vec<u64>> {
    let kernel = inner.module.deepseek[1].mla_layer1?;
    match queue.last_mut() {
        Some(Op::Cluster {
            kernel: k, args, ..
        }) if *k == kernel && args.len() == L_ARGS => Some(args),
        _ => None,
    }
}

/// Folds the o product `y = w x` (one token) into the fused layer launch just queued when `x`
/// is its attention output and `w` the bf16 matrix of its shape; true when it did.
pub(crate) fn fold_o(
    inner: &Inner,
    queue: &mut super::queue::Queue,
    w: &CudaWeight,
    x: u64,
    n: usize,
    y: u64,
) -> bool {
    let Some(args) = last_layer(inner, queue) else {
        return false;
    };
    let (heads, v, hidden) = (
        args[A_HEADS] as usize,
        args[A_V] as usize,
        args[L_K] as usize,
    );
    if n != 1
        || args[L_WO] != 0
        || args[0] != x
        || w.wtype != WType::Bf16
        || w.rows != hidden
        || w.cols != heads * v
        || !w.row_bytes.is_multiple_of(16)
        || y == x
    {
        return false;
    }
    args[L_WO] = w.ptr();
    args[L_WO + 1] = w.row_bytes as u64;
    args[L_OY] = y;
    true
}

/// Folds `res += y` (`n` values) into the fused layer launch just queued when `y` is its o
/// product; true when it did.
pub(crate) fn fold_add(inner: &Arc<Inner>, res: u64, y: u64, n: usize) -> bool {
    if !(inner.opts.fuse && inner.opts.fuse_add) {
        return false;
    }
    let mut queue = inner.queue();
    let Some(args) = last_layer(inner, &mut queue) else {
        return false;
    };
    if args[L_OY] != y || args[L_RES] != 0 || n != args[L_K] as usize || res == y {
        return false;
    }
    args[L_RES] = res;
    true
}

fn weight_index(w: &CudaWeight, what: &str) -> Result<usize> {
    match w.wtype {
        WType::F32 => Ok(0),
        WType::Bf16 => Ok(1),
        other => Err(Error::BadConfig(format!(
            "MLA on CUDA reads {what} as f32 or bf16, not {other:?}"
        ))),
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    inner: &Arc<Inner>,
    step: &CudaStep,
    kv: &mut CudaMlaKv,
    layer: usize,
    p: &MlaParams,
    w: &MlaWeights<'_, CudaWeight>,
    q: &mut CudaBuf,
    kva: &CudaBuf,
    out: &mut CudaBuf,
) -> Result<()> {
    let n = step.n_tokens;
    if n == 0 {
        return Ok(());
    }
    let d = p.dims;
    let (r, dr, heads) = (d.latent, d.rope, d.heads);
    let width = r + dr;
    if width != kv.width
        || width > MLA_MAX_WIDTH
        || dr % 2 != 0
        || heads == 0
        || d.nope > MLA_MAX_NOPE
    {
        return Err(Error::BadConfig(format!(
            "MLA on CUDA: latent {r} + rope {dr} (cache width {}) must be at most {MLA_MAX_WIDTH} with an even rope part, nope {} at most {MLA_MAX_NOPE}",
            kv.width, d.nope
        )));
    }
    if kv.act != inner.act() {
        return Err(Error::BadRequest(
            "MLA cache was made for another activation type".into(),
        ));
    }
    if step.block_size != kv.block_size || step.max_block as usize >= kv.num_blocks {
        return Err(Error::BadRequest(format!(
            "MLA step uses blocks of {} up to id {}, the cache has {} blocks of {}",
            step.block_size, step.max_block, kv.num_blocks, kv.block_size
        )));
    }
    let cache = kv.layer(layer).ok_or_else(|| {
        Error::BadRequest(format!(
            "MLA cache has {} layers, layer {layer} asked",
            kv.layers.len()
        ))
    })?;
    let kvb_rows = heads * (d.nope + d.v);
    if w.kv_b.rows != kvb_rows || w.kv_b.cols != r {
        return Err(Error::BadConfig(format!(
            "kv_b_proj is {}x{}, MLA needs {kvb_rows}x{r}",
            w.kv_b.rows, w.kv_b.cols
        )));
    }
    if w.kv_a_norm.rows != 1 || w.kv_a_norm.cols != r || w.inv_freq.cols * 2 != dr {
        return Err(Error::BadConfig(format!(
            "MLA vectors disagree with latent {r}, rope {dr}: kv_a_layernorm {}, {} rotary frequencies",
            w.kv_a_norm.cols, w.inv_freq.cols
        )));
    }
    let wi = weight_index(w.kv_b, "kv_b_proj")?;
    // device lengths: a padded decode step runs its padding rows too
    check("MLA q", q.len, n * d.q_width())?;
    check("MLA kv_a output", kva.len, n * width)?;
    check("MLA output", out.len, n * heads * d.v)?;
    let k = &inner.module.deepseek[match inner.act() {
        Act::F32 => 0,
        Act::Bf16 => 1,
    }];
    // the V up-projection writes every row of `out`
    if out.len == n * heads * d.v {
        inner.drop_zeroing(out.ptr(), out.len * inner.act().size());
    }
    let f = |v: f32| v.to_bits() as u64;
    let expand = match p.path {
        MlaPath::Absorbed => false,
        MlaPath::Expanded if !expanded_fits(inner, step, p, wi) => {
            return Err(Error::BadConfig(format!(
                "MLA's expanded form on CUDA takes bf16 activations and kv_b, heads of {X_NOPE} nope, {X_ROPE} rope and {X_V} V values and a positive scale (asked: {:?} activations, nope {}, rope {dr}, v {}, scale {})",
                inner.act(),
                d.nope,
                d.v,
                p.scale
            )))
        }
        MlaPath::Expanded => true,
        MlaPath::Auto => {
            inner.opts.mla_expand
                && n > MMA_MIN_TOKENS
                && expanded_fits(inner, step, p, wi)
                && d.expanded_pays(step.ctx_rows, n, step.pairs)
        }
    };
    if expand {
        return expanded(inner, step, cache, p, w, q, kva, out);
    }
    if let Some(c) = fused_cluster(inner, step, p) {
        let layer = fold_qkv(inner, step, p, w, q, kva, c)?;
        let mut args = vec![
            out.ptr(),
            q.ptr(),
            kva.ptr(),
            w.kv_b.ptr(),
            cache,
            w.kv_a_norm.ptr(),
            w.inv_freq.ptr(),
            step.slots(),
            step.positions(),
            step.tok_seq(),
            step.tables(),
            step.width as u64,
            step.block_size as u64,
            heads as u64,
            d.nope as u64,
            dr as u64,
            d.v as u64,
            r as u64,
            f(p.eps),
            f(p.rope_scale),
            p.interleaved as u64,
            f(p.scale * std::f32::consts::LOG2_E),
        ];
        debug_assert_eq!(args.len(), DEC1_ARGS);
        let (kernel, smem) = match layer {
            Some(l) => {
                args.extend_from_slice(&l.args);
                (l.kernel, l.smem)
            }
            None => (k.mla_dec1[wi], 0),
        };
        inner.push(Op::Cluster {
            kernel,
            grid: [c as u32, heads as u32, n as u32],
            block: 256,
            cluster: c as u32,
            smem,
            args,
        });
        return Ok(());
    }
    let qf = inner.scratch(n * heads * width, 4)?;
    // steps past the decode kernels' tokens with a bf16 cache (and for the products, bf16 kv_b)
    let mma_step = inner.opts.mla_mma && n > MMA_MIN_TOKENS && inner.act() == Act::Bf16;
    let bf16_mma = mma_step && wi == 1;
    let (absorb, grid) = if inner.opts.absorb_mma
        && bf16_mma
        && d.nope <= ABSORB_MAX_NOPE
        && d.nope.is_multiple_of(16)
        && r.is_multiple_of(ABSORB_COLS)
    {
        // the latent columns' blocks take ABSORB_TOKENS tokens each; the rope queries' and
        // the cache rows' blocks, 8 tokens each, follow them
        let grid = [
            heads as u32,
            (r / ABSORB_COLS + 2 * ABSORB_TOKENS / 8) as u32,
            n.div_ceil(ABSORB_TOKENS) as u32,
        ];
        (inner.module.mla_mma[2], grid)
    } else {
        // ds2: one more block column, which writes the cache rows
        let (kernel, extra) = if inner.opts.ds2.absorb {
            (k.mla_q_absorb2[wi], 2)
        } else {
            (k.mla_q_absorb[wi], 1)
        };
        let grid = [
            heads as u32,
            n.div_ceil(8) as u32,
            (r.div_ceil(64) + extra) as u32,
        ];
        (kernel, grid)
    };
    launch(
        inner,
        absorb,
        grid,
        256,
        vec![
            qf.ptr(),
            q.ptr(),
            w.kv_b.ptr(),
            n as u64,
            heads as u64,
            d.nope as u64,
            dr as u64,
            d.v as u64,
            r as u64,
            cache,
            kva.ptr(),
            w.kv_a_norm.ptr(),
            w.inv_freq.ptr(),
            step.slots(),
            step.positions(),
            f(p.eps),
            f(p.rope_scale),
            p.interleaved as u64,
        ],
    );
    let groups = heads.div_ceil(MLA_HEADS);
    let decode_mma = mma_step
        && inner.opts.decode_mma
        && r.is_multiple_of(128)
        && width.is_multiple_of(32)
        && MLA_DECODE_MMA_SMEM <= inner.module.max_smem;
    // sequences of DECODE4_TOKENS tokens or more on average (prompts): a block of that many
    // tokens shares each key tile
    let four = decode_mma
        && inner.opts.decode_mma4
        && n >= DECODE4_TOKENS * step.n_seqs
        && r <= 512
        && MLA_DECODE4_SMEM <= inner.module.max_smem;
    let blocks = if four { n.div_ceil(DECODE4_TOKENS) } else { n };
    let splits = splits_for(blocks * groups, step.max_ctx);
    let part_o = inner.scratch(n * heads * splits * r, 4)?;
    let part_ml = inner.scratch(n * heads * splits * 2, 4)?;
    let (kernel, threads, smem) = if four {
        (
            inner.module.mla_mma[4],
            MLA_DECODE_THREADS,
            MLA_DECODE4_SMEM as u32,
        )
    } else if decode_mma {
        (
            inner.module.mla_mma[3],
            MLA_DECODE_THREADS,
            MLA_DECODE_MMA_SMEM as u32,
        )
    } else if inner.opts.ds2.decode {
        (k.mla_decode2, 256, 0)
    } else {
        (k.mla_decode, 256, 0)
    };
    let mut args = vec![
        part_o.ptr(),
        part_ml.ptr(),
        qf.ptr(),
        cache,
        step.tok_seq(),
        step.positions(),
        step.tables(),
        step.width as u64,
        step.block_size as u64,
        heads as u64,
        r as u64,
        dr as u64,
        f(p.scale * std::f32::consts::LOG2_E),
        splits as u64,
    ];
    if four {
        args.push(n as u64);
    }
    inner.push(Op::Launch {
        kernel,
        grid: [blocks as u32, groups as u32, splits as u32],
        block: threads,
        smem,
        args,
    });
    if bf16_mma && r.is_multiple_of(8) {
        // the merged latent outputs in bf16, then every token's V rows on tensor cores
        let [merge, v_up, ..] = inner.module.mla_mma;
        let ol = inner.scratch(n * heads * r, 2)?;
        launch(
            inner,
            merge,
            [heads as u32, n as u32, 1],
            MERGE_THREADS,
            vec![
                ol.ptr(),
                part_o.ptr(),
                part_ml.ptr(),
                heads as u64,
                r as u64,
                splits as u64,
            ],
        );
        launch(
            inner,
            v_up,
            [
                heads as u32,
                d.v.div_ceil(ROWMMA_ROWS) as u32,
                n.div_ceil(MMA_TOKENS) as u32,
            ],
            ROWMMA_THREADS,
            vec![
                out.ptr(),
                ol.ptr(),
                w.kv_b.ptr(),
                n as u64,
                heads as u64,
                d.nope as u64,
                d.v as u64,
                r as u64,
            ],
        );
        return Ok(());
    }
    launch(
        inner,
        if inner.opts.ds2.v_up {
            k.mla_v_up2[wi]
        } else {
            k.mla_v_up[wi]
        },
        [heads as u32, n as u32, d.v.div_ceil(V_ROWS) as u32],
        256,
        vec![
            out.ptr(),
            part_o.ptr(),
            part_ml.ptr(),
            w.kv_b.ptr(),
            heads as u64,
            d.nope as u64,
            d.v as u64,
            r as u64,
            splits as u64,
        ],
    );
    Ok(())
}

/// The head shape the expanded-form kernels take (`MLX_NOPE`, `MLX_DR`, `MLX_DV`:
/// DeepSeek-V3's, which its successors keep).
const X_NOPE: usize = 128;
const X_ROPE: usize = 64;
const X_V: usize = 128;
/// Threads of a `mla_x_attn` block (`MLX_THREADS`) and of the gather's; most gather blocks
/// an SM.
const X_THREADS: u32 = 128;
const GATHER_THREADS: usize = 256;
const GATHER_BLOCKS_PER_SM: usize = 16;

/// Whether the expanded-form kernels take this step: bf16 activations and kv_b, the head
/// shape above, a positive scale (the flash-attention kernel scales raw maxima), work items
/// within a grid's y limit, context rows within the kernels' ints.
fn expanded_fits(inner: &Inner, step: &CudaStep, p: &MlaParams, wi: usize) -> bool {
    let d = p.dims;
    inner.act() == Act::Bf16
        && wi == 1
        && (d.nope, d.rope, d.v) == (X_NOPE, X_ROPE, X_V)
        && d.latent.is_multiple_of(8)
        && p.scale > 0.0
        && step.n_tiles <= 65_535
        && step.ctx_rows <= i32::MAX as usize
        && MLA_X_SMEM <= inner.module.max_smem
}

/// One layer's attention in the expanded form (`kernels/mla.cu`, "Prompts in the expanded
/// form"): the queries' rope parts rotated in place with the cache rows written, the step's
/// context rows gathered from the cache, their latents expanded through kv_b by cuBLAS, then
/// flash attention over the expanded rows.
#[allow(clippy::too_many_arguments)]
fn expanded(
    inner: &Arc<Inner>,
    step: &CudaStep,
    cache: u64,
    p: &MlaParams,
    w: &MlaWeights<'_, CudaWeight>,
    q: &mut CudaBuf,
    kva: &CudaBuf,
    out: &mut CudaBuf,
) -> Result<()> {
    let d = p.dims;
    let (n, r, dr, heads) = (step.n_tokens, d.latent, d.rope, d.heads);
    let ctx = step.ctx_rows;
    let f = |v: f32| v.to_bits() as u64;
    let [rope, gather, attn] = inner.module.mla_x;
    let lat = inner.scratch(ctx * r, 2)?;
    let kr = inner.scratch(ctx * dr, 2)?;
    let kvx = inner.scratch(ctx * heads * (d.nope + d.v), 2)?;
    launch(
        inner,
        rope,
        [2, n.div_ceil(8) as u32, 1],
        256,
        vec![
            q.ptr(),
            cache,
            kva.ptr(),
            w.kv_a_norm.ptr(),
            w.inv_freq.ptr(),
            step.slots(),
            step.positions(),
            n as u64,
            heads as u64,
            d.nope as u64,
            dr as u64,
            r as u64,
            f(p.eps),
            f(p.rope_scale),
            p.interleaved as u64,
        ],
    );
    let chunks = ctx * (r + dr) / 8;
    launch(
        inner,
        gather,
        [
            chunks
                .div_ceil(GATHER_THREADS)
                .clamp(1, GATHER_BLOCKS_PER_SM * inner.module.sms.max(1)) as u32,
            1,
            1,
        ],
        GATHER_THREADS as u32,
        vec![
            lat.ptr(),
            kr.ptr(),
            cache,
            step.ctx_start(),
            step.n_seqs as u64,
            ctx as u64,
            step.tables(),
            step.width as u64,
            step.block_size as u64,
            r as u64,
            dr as u64,
        ],
    );
    inner.push(Op::Gemm(Gemm {
        m: heads * (d.nope + d.v),
        n: ctx,
        k: r,
        w: w.kv_b.ptr(),
        x: lat.ptr(),
        y: kvx.ptr(),
        ab: GemmType::Bf16,
        c: GemmType::Bf16,
    }));
    inner.push(Op::Launch {
        kernel: attn,
        grid: [heads as u32, step.n_tiles as u32, 1],
        block: X_THREADS,
        smem: MLA_X_SMEM as u32,
        args: vec![
            out.ptr(),
            q.ptr(),
            kvx.ptr(),
            kr.ptr(),
            step.tiles(),
            step.n_tiles as u64,
            step.seq_start(),
            step.seq_len(),
            step.seq_pos(),
            step.ctx_start(),
            heads as u64,
            f(p.scale * std::f32::consts::LOG2_E),
        ],
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::Ds2;
    use super::{cluster_for, splits_for};

    #[test]
    fn ds2_switches_parse() {
        assert_eq!(Ds2::parse("1").unwrap(), Ds2::DEFAULT);
        const { assert!(!Ds2::DEFAULT.down_prefetch && Ds2::DEFAULT.route) };
        assert_eq!(Ds2::parse("all").unwrap(), Ds2::ALL);
        assert_eq!(Ds2::parse("0").unwrap(), Ds2::NONE);
        let d = Ds2::parse("decode, vup,route").unwrap();
        assert!(d.decode && d.v_up && d.route && !d.absorb && !d.down_prefetch);
        assert!(Ds2::parse("decode,fast").is_err());
        let d = Ds2::parse("shared").unwrap();
        assert!(d.shared && !d.decode && !d.down_prefetch);
        const { assert!(Ds2::DEFAULT.route1 && !Ds2::DEFAULT.next_l2 && !Ds2::DEFAULT.own_sm) };
        let d = Ds2::parse("cluster,route1,nextl2,ownsm").unwrap();
        assert!(d.cluster && d.route1 && d.next_l2 && d.own_sm && !d.route);
        let e = Ds2::parse("all,route1").unwrap_err().to_string();
        assert!(e.contains("`all`"), "{e}");
    }

    #[test]
    fn fused_kernel_cluster_sizes() {
        use crate::model::mla::MlaDims;
        let dims = |heads, nope, v, latent| MlaDims {
            heads,
            nope,
            rope: 64,
            v,
            latent,
        };
        // DeepSeek-V3 / Moonlight heads: 8 blocks of 64 latent columns and 16 V rows
        assert_eq!(cluster_for(&dims(16, 128, 128, 512)), Some(8));
        // the tiny checkpoints: latent 32 in 4 blocks of one 8-value chunk
        assert_eq!(cluster_for(&dims(4, 16, 16, 32)), Some(4));
        assert_eq!(cluster_for(&dims(5, 24, 40, 64)), Some(8));
        // odd latents, too many V rows a block, too many absorption chunks: the three launches
        assert_eq!(cluster_for(&dims(5, 24, 40, 40)), None);
        assert_eq!(cluster_for(&dims(5, 24, 40, 72)), None);
        assert_eq!(cluster_for(&dims(16, 128, 256, 512)), None);
        assert_eq!(cluster_for(&dims(16, 256, 128, 512)), None);
        assert_eq!(cluster_for(&dims(16, 128, 128, 1024)), None);
    }

    #[test]
    fn splits_follow_the_context_bucket() {
        assert_eq!(splits_for(1, 128), 8);
        assert_eq!(splits_for(1, 100), 8);
        assert_eq!(splits_for(1, 4096), 64);
        assert_eq!(splits_for(64, 4096), 5);
        assert_eq!(splits_for(1000, 4096), 1);
    }
}
