//! Linear layers `y = x W^T`. Up to [`GEMV_MAX_N`] tokens run through the GEMV kernels (one
//! weight read for all tokens, any weight type; consecutive products of the same input share a
//! launch). More tokens go to cuBLAS in the activations' type: bf16 activations take bf16
//! weights (other types expanded to a bf16 scratch first); f32 activations, chosen for
//! quantized and f32 models where accuracy comes first, run plain f32 GEMMs (weights expanded
//! to an f32 scratch), so no product rounds its inputs to bf16.

use std::sync::Arc;

use super::blas::{Gemm, GemmType};
use super::module::{KernelId, GEMVB_SHAPES, GEMVB_TOKENS};
use super::ops::check;
use super::queue::{elementwise_grid, Gemv, Op, GEMV_SEGMENTS, GEMV_THREADS};
use super::weights::WType;
use super::{Act, CudaBuf, CudaWeight, Inner};
use crate::error::Result;

/// Most tokens the GEMV kernels take (`GEMV_MAX_N` in `kernels/gemv.cu`).
pub const GEMV_MAX_N: usize = 8;

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
    check("matmul input", x.len(), n * w.cols)?;
    check("matmul output", y.len(), n * w.rows)?;
    let act = inner.act();
    if n <= GEMV_MAX_N {
        gemv(inner, act, w, x, n, y);
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

/// The GEMV kernel for `rows` output rows of `n` tokens and its rows per block. Long bf16/f16
/// rows (k >= 2048) go to the block-cooperative kernels, which kept 4.0 TB/s over a whole
/// Llama-3-8B batch-1 step on the H200 against 2.8 TB/s for the warp-per-row ones
/// (doc/benchmarks.md): 4 rows x 2 loads per thread for k <= 4096, 2 x 4 up to 8192, 1 x 8
/// beyond; several tokens always take 4 rows x 2 loads.
fn pick(inner: &Inner, act: Act, wt: WType, n: usize, k: usize, _rows: usize) -> (KernelId, usize) {
    let kernels = inner.module.act(act);
    let wi = match wt {
        WType::Bf16 => Some(0),
        WType::F16 => Some(1),
        _ => None,
    };
    if let (Some(wi), true) = (wi, inner.opts.gemvb && k.is_multiple_of(8) && k >= 2048) {
        let ni = GEMVB_TOKENS.iter().position(|&t| t >= n);
        let si = match (n, k) {
            (1, k) if k > 8192 => 2,
            (1, k) if k > 4096 => 1,
            _ => 0,
        };
        if let Some(ni) = ni {
            return (kernels.gemvb[wi][ni][si], GEMVB_SHAPES[si].0);
        }
    }
    (kernels.gemv[wt as usize], (GEMV_THREADS / 32) as usize)
}

/// Queues a GEMV, or appends it as a segment to the GEMV just queued when that one reads the
/// same input with the same weight type and shape (the kernel is then chosen again for the
/// rows of all segments).
fn gemv(inner: &Arc<Inner>, act: Act, w: &CudaWeight, x: &CudaBuf, n: usize, y: &CudaBuf) {
    let seg = (w.ptr(), y.ptr(), w.rows);
    let mut q = inner.queue();
    if inner.opts.fuse {
        if let Some(Op::Gemv(g)) = q.last_mut() {
            let outputs_clash = g.segs.iter().any(|s| s.1 == y.ptr()) || y.ptr() == g.x;
            if g.wtype == w.wtype
                && g.x == x.ptr()
                && g.n == n
                && g.k == w.cols
                && g.row_bytes == w.row_bytes
                && g.segs.len() < GEMV_SEGMENTS
                && !outputs_clash
            {
                g.segs.push(seg);
                let rows = g.segs.iter().map(|s| s.2).sum();
                (g.kernel, g.rows_per_block) = pick(inner, act, w.wtype, n, w.cols, rows);
                return;
            }
        }
    }
    drop(q);
    let (kernel, rows_per_block) = pick(inner, act, w.wtype, n, w.cols, w.rows);
    inner.push(Op::Gemv(Gemv {
        kernel,
        x: x.ptr(),
        n,
        k: w.cols,
        row_bytes: w.row_bytes,
        segs: vec![seg],
        wtype: w.wtype,
        rows_per_block,
    }));
}
