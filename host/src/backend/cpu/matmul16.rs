//! Matrix products of 32-element-format weights (Q4_0, Q4_1, Q8_0) with 16-bit activations
//! (`quant::act16`), split across the thread pool: the CPU backend's default precision for
//! these types.
//!
//! The plan is `matmul`'s: activations quantized once per call, weight rows split into equal
//! tasks; inside a task, tokens go in tiles of 8 (then 4, 2, 1) outside rows in tiles of 2,
//! so a token tile's activations stay in L1 while the task's weights come from L2 and each
//! unpacked weight pair serves 8 tokens. Every output is computed by one tile call with the
//! same operations whatever the tile shape, thread count or batch, so a token's result does
//! not depend on the batch it is in.

use std::cell::RefCell;

use super::matmul::{check_product, walk_tiles, Plan};
use super::pool::ThreadPool;
use super::quant::a16::{self, Kernel16, MAX_ROWS, MAX_TOKENS};
use super::quant::act::SyncPtr;
use super::quant::act16::{Act16View, Acts16};
use super::quant::Isa;
use crate::tensor::{DType, Weight};

thread_local! {
    /// The caller's reusable 16-bit activations.
    static ACTS16: RefCell<Acts16> = RefCell::new(Acts16::default());
}

/// Whether [`matmul16`] has kernels for weights of this type.
pub fn supports(dtype: DType) -> bool {
    a16::Format::of(dtype).is_some()
}

/// y[t * w.rows + r] = sum_c W[r, c] * x[t * w.cols + c] for t in 0..n_tokens, with the
/// activations quantized to 16 bits per 32-element block; the fastest kernels this CPU has.
///
/// # Panics
/// If [`supports`] is false for the weight's type, or on the shape errors of
/// [`super::matmul::matmul`].
pub fn matmul16(pool: &ThreadPool, w: &Weight, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    matmul16_with_isa(pool, Isa::detect(), w, x, n_tokens, y);
}

/// [`matmul16`] with the kernels of a given instruction-set level.
///
/// # Panics
/// As [`matmul16`], and if `isa` is not available on this CPU.
pub fn matmul16_with_isa(
    pool: &ThreadPool,
    isa: Isa,
    w: &Weight,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
) {
    let k = a16::select(w.dtype, isa)
        .unwrap_or_else(|| panic!("matmul16: no 16-bit-activation kernel for {}", w.dtype));
    if !check_product("matmul16", w, x, n_tokens, y) {
        return;
    }
    let x = &x[..n_tokens * w.cols];
    ACTS16.with(|cell| match cell.try_borrow_mut() {
        Ok(mut acts) => run(pool, isa, &k, w, x, n_tokens, y, &mut acts),
        // Re-entered on this thread (a matmul inside a pool task): use fresh buffers.
        Err(_) => run(pool, isa, &k, w, x, n_tokens, y, &mut Acts16::default()),
    });
}

#[allow(clippy::too_many_arguments)]
fn run(
    pool: &ThreadPool,
    isa: Isa,
    k: &Kernel16,
    w: &Weight,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
    acts: &mut Acts16,
) {
    let view = acts.quantize(pool, isa, x, n_tokens, w.cols, k.octets);
    let plan = Plan::new(pool.n_threads(), w.rows, w.row_bytes());
    let yp = SyncPtr(y.as_mut_ptr());
    pool.parallel_for(plan.n_tasks, &|task| {
        run_task(k, w, &view, plan.rows(task), yp)
    });
}

/// `(start, len)` tiles covering `n` items, `max` long while that many remain, then halving.
fn steps(n: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut at = 0;
    std::iter::from_fn(move || {
        (at < n).then(|| {
            let mut len = max;
            while len > n - at {
                len /= 2;
            }
            at += len;
            (at - len, len)
        })
    })
}

fn run_task(
    k: &Kernel16,
    w: &Weight,
    a: &Act16View<'_>,
    rows: std::ops::Range<usize>,
    y: SyncPtr<f32>,
) {
    let (bytes, rb) = (w.bytes(), w.row_bytes());
    let mut out = [0f32; 16];
    let token_steps = steps(a.n_tokens, MAX_TOKENS);
    walk_tiles(
        bytes,
        rb,
        rows,
        token_steps,
        |n| steps(n, MAX_ROWS),
        |r0, rn, t0, tn| {
            // SAFETY: `select` checked the ISA; rows r0..r0+rn lie within the weight, whose
            // byte length `matmul16_with_isa` checked; `a` was quantized from this weight's
            // columns (pairs = blocks.div_ceil(2)) with n_tokens >= t0 + tn; this task alone
            // writes rows `rows` of y, which holds n_tokens * w.rows values.
            unsafe {
                (k.tile(rn, tn))(&bytes[r0 * rb..], rb, a, t0, &mut out);
                for i in 0..rn {
                    for j in 0..tn {
                        *y.get().add((t0 + j) * w.rows + r0 + i) = out[i * 8 + j];
                    }
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_cover_in_halving_tiles() {
        let v: Vec<_> = steps(15, 8).collect();
        assert_eq!(v, [(0, 8), (8, 4), (12, 2), (14, 1)]);
        let v: Vec<_> = steps(5, 2).collect();
        assert_eq!(v, [(0, 2), (2, 2), (4, 1)]);
        assert_eq!(steps(0, 8).count(), 0);
    }
}
