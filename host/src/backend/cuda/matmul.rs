//! Linear layers `y = x W^T`. Up to [`GEMV_MAX_N`] tokens run through the GEMV kernels (one
//! weight read for all tokens, any weight type; consecutive products of the same input share a
//! launch). More tokens go to cuBLAS in the activations' type: bf16 activations take bf16
//! weights (other types expanded to a bf16 scratch first); f32 activations, chosen for
//! quantized and f32 models where accuracy comes first, run plain f32 GEMMs (weights expanded
//! to an f32 scratch), so no product rounds its inputs to bf16.

use std::sync::Arc;

use super::blas::{Gemm, GemmType};
use super::ops::check;
use super::queue::{elementwise_grid, Gemv, Op, GEMV_SEGMENTS};
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

/// Queues a GEMV, or appends it as a segment to the GEMV just queued when that one reads the
/// same input with the same kernel and shape.
fn gemv(inner: &Arc<Inner>, act: Act, w: &CudaWeight, x: &CudaBuf, n: usize, y: &CudaBuf) {
    let kernel = inner.module.act(act).gemv[w.wtype as usize];
    let seg = (w.ptr(), y.ptr(), w.rows);
    let mut q = inner.queue();
    if inner.opts.fuse {
        if let Some(Op::Gemv(g)) = q.last_mut() {
            let outputs_clash = g.segs.iter().any(|s| s.1 == y.ptr()) || y.ptr() == g.x;
            if g.kernel == kernel
                && g.x == x.ptr()
                && g.n == n
                && g.k == w.cols
                && g.row_bytes == w.row_bytes
                && g.segs.len() < GEMV_SEGMENTS
                && !outputs_clash
            {
                g.segs.push(seg);
                return;
            }
        }
    }
    drop(q);
    inner.push(Op::Gemv(Gemv {
        kernel,
        x: x.ptr(),
        n,
        k: w.cols,
        row_bytes: w.row_bytes,
        segs: vec![seg],
    }));
}
