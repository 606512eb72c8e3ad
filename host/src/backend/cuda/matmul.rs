//! Linear layers `y = x W^T`. Up to [`GEMV_MAX_N`] tokens run through the GEMV kernels (one
//! weight read for all tokens, any weight type; consecutive products of the same input share a
//! launch). Up to [`GEMT_MAX_N`] tokens of bf16 weights and activations run through the skinny
//! tensor-core GEMM (likewise one weight read, shared launches, and SwiGLU folded into the
//! gate/up launch). More tokens go to cuBLAS in the activations' type: bf16 activations take bf16
//! weights (other types expanded to a bf16 scratch first); f32 activations, chosen for
//! quantized and f32 models where accuracy comes first, run plain f32 GEMMs (weights expanded
//! to an f32 scratch), so no product rounds its inputs to bf16.

use std::sync::Arc;

use super::blas::{Gemm, GemmType};
use super::module::{
    gemt_smem, KernelId, GEMT_TOKENS, GEMVB_SHAPES, GEMVB_TOKENS, GEMVP_MAXK, GEMVP_ROWS,
    GEMVP_WIDE_ROWS,
};
use super::ops::check;
use super::queue::{elementwise_grid, Gemt, Gemv, Op, Product, GEMV_THREADS};
use super::weights::WType;
use super::{Act, CudaBuf, CudaWeight, Inner};
use crate::error::Result;

/// Most tokens the GEMV kernels take (`GEMV_MAX_N` in `kernels/gemv.cu`).
pub const GEMV_MAX_N: usize = 8;
/// Most tokens the skinny tensor-core GEMMs take (`kernels/gemt.cu`).
pub const GEMT_MAX_N: usize = 64;

pub(crate) fn matmul(
    inner: &Arc<Inner>,
    w: &CudaWeight,
    x: &CudaBuf,
    n: usize,
    y: &mut CudaBuf,
) -> Result<()> {
    if n == 0 || w.rows == 0 {
        return Ok(());
    }
    check("matmul input", x.len, n * w.cols)?;
    check("matmul output", y.len, n * w.rows)?;
    // A padded step's buffers run their padding rows too (same kernel as the real rows alone
    // up to 8 tokens, so the real rows come out bit-identical there).
    let n = if x.len > x.host_len
        && x.host_len == n * w.cols
        && x.len.is_multiple_of(w.cols)
        && y.len >= x.len / w.cols * w.rows
    {
        x.len / w.cols
    } else {
        n
    };
    let act = inner.act();
    // The product writes every row it runs: when that is all of `y`, its zeroing is dropped,
    // the same way for padded and unpadded steps (so both fold the same neighbours).
    if y.len == n * w.rows {
        inner.drop_zeroing(y.ptr(), y.len * act.size());
    }
    if n <= GEMV_MAX_N {
        gemv(inner, act, w, x, n, y);
        return Ok(());
    }
    if inner.opts.gemt
        && n <= GEMT_MAX_N
        && act == Act::Bf16
        && w.wtype == WType::Bf16
        && w.cols.is_multiple_of(8)
        && w.cols <= i32::MAX as usize
        && w.rows <= i32::MAX as usize
    {
        gemt(inner, w, x, n, y);
        return Ok(());
    }
    let (ty, direct, expand, size) = match act {
        Act::F32 => (
            GemmType::F32,
            w.wtype == WType::F32,
            inner.module.weight_to_f32,
            4,
        ),
        Act::Bf16 => (
            GemmType::Bf16,
            w.wtype == WType::Bf16,
            inner.module.weight_to_bf16,
            2,
        ),
    };
    let (wptr, _scratch) = if direct {
        (w.ptr(), None)
    } else {
        let s = inner.scratch(w.rows * w.cols, size)?;
        inner.push(Op::Launch {
            kernel: expand,
            grid: [elementwise_grid(w.rows * w.cols.div_ceil(32)), 1, 1],
            block: 256,
            smem: 0,
            args: vec![
                s.ptr(),
                w.ptr(),
                w.wtype as u64,
                w.rows as u64,
                w.cols as u64,
                w.row_bytes as u64,
            ],
        });
        (s.ptr(), Some(s))
    };
    inner.push(Op::Gemm(Gemm {
        m: w.rows,
        n,
        k: w.cols,
        w: wptr,
        x: x.ptr(),
        y: y.ptr(),
        ab: ty,
        c: ty,
    }));
    Ok(())
}

/// What a block-cooperative GEMV folds in (see `kernels/gemv.cu`, `GEMVB_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fold {
    Plain,
    Norm,
    Acc,
    /// SwiGLU after a gate/up pair.
    Swiglu,
    /// The RMSNorm before a gate/up pair and SwiGLU after it.
    NormSwiglu,
}

impl Fold {
    fn of(g: &Gemv) -> Fold {
        match (g.norm.is_some(), g.res != 0, g.swiglu) {
            (true, _, true) => Fold::NormSwiglu,
            (false, _, true) => Fold::Swiglu,
            (true, _, false) => Fold::Norm,
            (false, true, false) => Fold::Acc,
            _ => Fold::Plain,
        }
    }

    fn swiglu(self) -> bool {
        matches!(self, Fold::Swiglu | Fold::NormSwiglu)
    }
}

/// The block-cooperative GEMV of `fold` for `n` tokens over rows of `k` weights, when there
/// is one. Long bf16/f16 rows (k >= 2048) go to these kernels, which kept 4.0 TB/s over a
/// whole Llama-3-8B batch-1 step on the H200 against 2.8 TB/s for the warp-per-row ones
/// (doc/benchmarks.md): 4 rows x 2 loads per thread for k <= 4096, 2 x 4 up to 8192, 1 x 8
/// beyond; several tokens always take 4 rows x 2 loads. Folded variants: bf16 weights only.
/// One token over bf16 rows of at most 2048 (bf16 activations) takes `gemvp*` instead, 8
/// rows a block staged in shared memory (`CudaOptions::gemvp`; with SwiGLU, 4 gate/up pairs,
/// `CudaOptions::gemvp_swiglu`).
fn block_kernel(
    inner: &Inner,
    act: Act,
    wt: WType,
    n: usize,
    k: usize,
    fold: Fold,
) -> Option<(KernelId, usize)> {
    let kernels = inner.module.act(act);
    let wi = match wt {
        WType::Bf16 => 0,
        WType::F16 if fold == Fold::Plain => 1,
        _ => return None,
    };
    if !(inner.opts.gemvb && k.is_multiple_of(8) && k >= 2048) {
        return None;
    }
    // one token over bf16 rows of at most GEMVP_MAXK: the shared-memory kernels, by fold (a
    // gate/up pair with SwiGLU, 4 pairs a block, where that option is on)
    if inner.opts.gemvp && n == 1 && wi == 0 && k <= GEMVP_MAXK {
        let sw = kernels.gemvp_swiglu.filter(|_| inner.opts.gemvp_swiglu);
        let staged = match fold {
            Fold::Plain => kernels.gemvp.map(|p| p[0]),
            Fold::Norm => kernels.gemvp.map(|p| p[1]),
            Fold::Acc => kernels.gemvp.map(|p| p[2]),
            Fold::Swiglu => sw.map(|p| p[0]),
            Fold::NormSwiglu => sw.map(|p| p[1]),
        };
        if let Some(id) = staged {
            return Some((id, GEMVP_ROWS));
        }
    }
    let ni = GEMVB_TOKENS.iter().position(|&t| t >= n)?;
    let si = match (n, k) {
        // SwiGLU pairs a gate row with an up row: at least 2 rows a block.
        (1, k) if k > 8192 && !fold.swiglu() => 2,
        (1, k) if k > 4096 => 1,
        _ => 0,
    };
    let id = match fold {
        Fold::Plain => kernels.gemvb[wi][ni][si],
        Fold::Norm => kernels.gemvb_norm.as_ref()?[ni][si],
        Fold::Acc => kernels.gemvb_acc.as_ref()?[ni][si],
        Fold::Swiglu => kernels.gemvb_swiglu.as_ref()?[ni][si],
        Fold::NormSwiglu => kernels.gemvb_norm_swiglu.as_ref()?[ni][si],
    };
    Some((id, GEMVB_SHAPES[si].0))
}

/// The GEMV kernel for `n` tokens over `rows` rows and its rows per block: a
/// block-cooperative one where there is one, else one warp per weight row (which folds
/// nothing in).
fn pick(
    inner: &Inner,
    act: Act,
    wt: WType,
    n: usize,
    k: usize,
    rows: usize,
    fold: Fold,
) -> (KernelId, usize) {
    match block_kernel(inner, act, wt, n, k, fold) {
        Some(kr) => widen(inner, act, kr, rows),
        None => (
            inner.module.act(act).gemv[wt as usize],
            (GEMV_THREADS / 32) as usize,
        ),
    }
}

/// A staged one-token GEMV (`gemvp*`) of at most [`GEMVP_WIDE_ROWS`] rows an SM in its wide
/// blocks (`CudaOptions::gemvp_wide`), else `kr` as it is.
fn widen(inner: &Inner, act: Act, kr: (KernelId, usize), rows: usize) -> (KernelId, usize) {
    let kernels = inner.module.act(act);
    if let (Some(p), Some(w)) = (kernels.gemvp.as_ref(), kernels.gemvp_wide.as_ref()) {
        if let Some(i) = p.iter().position(|&k| k == kr.0) {
            if inner.opts.gemvp_wide
                && inner.opts.gemvp_wide_folds & (1 << i) != 0
                && rows <= GEMVP_WIDE_ROWS * inner.module.sms
            {
                return (w[i], GEMVP_WIDE_ROWS);
            }
        }
    }
    kr
}

/// Queues a GEMV, or appends it as a segment to the GEMV just queued when that one reads the
/// same input with the same weight type and shape (the kernel is then chosen again for the
/// rows of all segments). An RMSNorm queued just before whose output is this input is folded
/// into the launch where a block-cooperative kernel takes it.
fn gemv(inner: &Arc<Inner>, act: Act, w: &CudaWeight, x: &CudaBuf, n: usize, y: &CudaBuf) {
    let seg = (w.ptr(), y.ptr(), w.rows);
    let mut q = inner.queue();
    if inner.opts.fuse && super::mla::fold_o(inner, &mut q, w, x.ptr(), n, y.ptr()) {
        return;
    }
    if inner.opts.fuse {
        if let Some(Op::Gemv(g)) = q.last_mut() {
            if g.wtype == w.wtype
                && g.p.can_join(x.ptr(), n, w.cols, w.row_bytes, y.ptr())
                && g.norm.is_none_or(|nm| nm.0 != y.ptr())
                && g.res == 0
                && !g.swiglu
            {
                g.p.segs.push(seg);
                let rows = g.p.segs.iter().map(|s| s.2).sum();
                (g.kernel, g.rows_per_block) =
                    pick(inner, act, w.wtype, n, w.cols, rows, Fold::of(g));
                return;
            }
        }
    }
    let mut norm = None;
    if inner.opts.fuse
        && inner.opts.fuse_norm
        && block_kernel(inner, act, w.wtype, n, w.cols, Fold::Norm).is_some()
    {
        let rms = inner.module.act(act).rms_norm;
        norm = q
            .take_norm(rms, x.ptr(), w.cols, n)
            .map(|(raw, gain, eps)| (raw, gain, eps as u32));
    }
    let fold = if norm.is_some() {
        Fold::Norm
    } else {
        Fold::Plain
    };
    let (kernel, rows_per_block) = pick(inner, act, w.wtype, n, w.cols, w.rows, fold);
    q.push(Op::Gemv(Gemv {
        kernel,
        p: Product::new(x.ptr(), n, w.cols, w.row_bytes, seg),
        wtype: w.wtype,
        rows_per_block,
        norm,
        res: 0,
        swiglu: false,
    }));
}

/// Folds `res += y` (`n` values) into the GEMV just queued when that GEMV alone writes `y`
/// and a block-cooperative kernel takes the add; true when it did.
pub(crate) fn fold_add(inner: &Arc<Inner>, res: u64, y: u64, n: usize) -> bool {
    if !(inner.opts.fuse && inner.opts.fuse_add) {
        return false;
    }
    let act = inner.act();
    let mut q = inner.queue();
    let Some(Op::Gemv(g)) = q.last_mut() else {
        return false;
    };
    if g.p.segs.len() != 1
        || g.p.segs[0].1 != y
        || g.p.segs[0].2 * g.p.n != n
        || g.res != 0
        || g.norm.is_some()
        || res == g.p.x
        || res == y
    {
        return false;
    }
    match block_kernel(inner, act, g.wtype, g.p.n, g.p.k, Fold::Acc) {
        Some(kr) => {
            let (kernel, rows_per_block) = widen(inner, act, kr, g.p.segs[0].2);
            g.kernel = kernel;
            g.rows_per_block = rows_per_block;
            g.res = res;
            true
        }
        None => false,
    }
}

/// The skinny GEMM for `n` tokens (9..=[`GEMT_MAX_N`]): its token bound's index.
fn gemt_bound(n: usize) -> usize {
    GEMT_TOKENS
        .iter()
        .position(|&t| t >= n)
        .unwrap_or(GEMT_TOKENS.len() - 1)
}

/// Queues a skinny GEMM, or appends it as a segment to the one just queued when that reads the
/// same input with the same shape (Q/K/V, gate/up in one launch).
fn gemt(inner: &Arc<Inner>, w: &CudaWeight, x: &CudaBuf, n: usize, y: &CudaBuf) {
    let seg = (w.ptr(), y.ptr(), w.rows);
    let mut q = inner.queue();
    if inner.opts.fuse {
        if let Some(Op::Gemt(g)) = q.last_mut() {
            if !g.swiglu && g.p.can_join(x.ptr(), n, w.cols, w.row_bytes, y.ptr()) {
                g.p.segs.push(seg);
                return;
            }
        }
    }
    let b = gemt_bound(n);
    q.push(Op::Gemt(Gemt {
        kernel: inner.module.gemt[b],
        p: Product::new(x.ptr(), n, w.cols, w.row_bytes, seg),
        swiglu: false,
        smem: gemt_smem(GEMT_TOKENS[b]) as u32,
        splits: inner.opts.gemt_splits,
    }));
}

/// Folds `gate = silu(gate) * up` (`n` values) into the GEMV or skinny GEMM just queued when
/// that one computes exactly `gate` and `up` from one input; true when it did.
pub(crate) fn fold_silu(inner: &Arc<Inner>, gate: u64, up: u64, n: usize) -> bool {
    if !inner.opts.fuse {
        return false;
    }
    let mut q = inner.queue();
    let g = match q.last_mut() {
        Some(Op::Gemt(g)) => g,
        Some(Op::Gemv(g)) => return inner.opts.fuse_silu && fold_silu_gemv(inner, g, gate, up, n),
        _ => return false,
    };
    if g.swiglu || !g.p.is_gate_up(gate, up, n) {
        return false;
    }
    g.swiglu = true;
    g.kernel = inner.module.gemt_swiglu[gemt_bound(g.p.n)];
    true
}

/// [`fold_silu`] for a GEMV: a block-cooperative kernel with SwiGLU must exist for its shape.
fn fold_silu_gemv(inner: &Inner, g: &mut Gemv, gate: u64, up: u64, n: usize) -> bool {
    if g.swiglu || g.res != 0 || !g.p.is_gate_up(gate, up, n) {
        return false;
    }
    let fold = if g.norm.is_some() {
        Fold::NormSwiglu
    } else {
        Fold::Swiglu
    };
    match block_kernel(inner, inner.act(), g.wtype, g.p.n, g.p.k, fold) {
        Some((kernel, rows_per_block)) => {
            g.kernel = kernel;
            g.rows_per_block = rows_per_block;
            g.swiglu = true;
            true
        }
        None => false,
    }
}
