//! Matrix products of (possibly quantized) weights with f32 activations, split across the
//! thread pool.
//!
//! One call quantizes the activations once (into the layout the weight type's kernel reads),
//! splits the weight rows into equal chunks for the pool, and inside each chunk walks tokens
//! in groups of 4 and rows in groups of 4 so a chunk's weights stay in L2 and a tile's
//! unpacked weights are reused across its tokens. Every output is computed by one tile call
//! with the same operation order whatever the tile shape, thread count or batch size, so a
//! token's result does not depend on the batch it is in.

use std::cell::RefCell;

use super::pool::ThreadPool;
use super::quant::act::{ActView, Acts, SyncPtr};
use super::quant::kernel::{self, Kernel};
use super::quant::{dequantize_row, Isa};
use crate::tensor::Weight;

/// Target weight bytes per task: small enough to stay in L2 while the task's token groups
/// pass over it, large enough that claiming a task is negligible.
const TASK_BYTES: usize = 96 * 1024;

thread_local! {
    /// The caller's reusable quantized-activation buffers.
    static ACTS: RefCell<Acts> = RefCell::new(Acts::default());
    /// A worker's rows dequantized to f32 (types without a direct kernel).
    static ROWS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// y[t * w.rows + r] = sum_c W[r, c] * x[t * w.cols + c] for t in 0..n_tokens.
///
/// Uses the fastest kernels this CPU supports ([`Isa::detect`]).
///
/// # Panics
/// If `x` is shorter than `n_tokens * w.cols`, `y` shorter than `n_tokens * w.rows`, `w.cols`
/// is not a whole number of blocks, or the weight's bytes do not hold `rows x cols` elements of
/// its type. These are programming errors: loaders validate shapes before.
pub fn matmul(pool: &ThreadPool, w: &Weight, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    matmul_with_isa(pool, Isa::detect(), w, x, n_tokens, y);
}

/// [`matmul`] with the kernels of a given instruction-set level (tests and benchmarks compare
/// levels on the same inputs).
///
/// # Panics
/// As [`matmul`], and if `isa` is not available on this CPU.
pub fn matmul_with_isa(
    pool: &ThreadPool,
    isa: Isa,
    w: &Weight,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
) {
    if !check_product("matmul", w, x, n_tokens, y) {
        return;
    }
    let k = kernel::select(w.dtype, isa);
    let x = &x[..n_tokens * w.cols];
    ACTS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut acts) => run(pool, isa, &k, w, x, n_tokens, y, &mut acts),
        // Re-entered on this thread (a matmul inside a pool task): use fresh buffers.
        Err(_) => run(pool, isa, &k, w, x, n_tokens, y, &mut Acts::default()),
    });
}

/// The shape contract of a product `y = W x` over `n_tokens` tokens, shared by [`matmul`] and
/// `matmul16`: panics naming `op` when `w`, `x` or `y` do not fit (callers check shapes at the
/// safe boundary), writes the zero result of a product with no columns, and returns whether
/// anything is left to compute.
pub(super) fn check_product(
    op: &str,
    w: &Weight,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
) -> bool {
    let (rows, cols) = (w.rows, w.cols);
    let be = w.dtype.block_elems();
    assert!(
        cols % be == 0,
        "{op}: {cols} columns is not a whole number of {} blocks",
        w.dtype
    );
    let rb = w.row_bytes();
    assert!(
        w.bytes().len() >= rows * rb,
        "{op}: {} weight of {rows}x{cols} needs {} bytes, has {}",
        w.dtype,
        rows * rb,
        w.bytes().len()
    );
    assert!(
        x.len() >= n_tokens * cols,
        "{op}: x has {} values, needs {}",
        x.len(),
        n_tokens * cols
    );
    assert!(
        y.len() >= n_tokens * rows,
        "{op}: y has {} values, needs {}",
        y.len(),
        n_tokens * rows
    );
    if rows == 0 || n_tokens == 0 {
        return false;
    }
    if cols == 0 {
        y[..n_tokens * rows].fill(0.0);
        return false;
    }
    true
}

#[allow(clippy::too_many_arguments)]
fn run(
    pool: &ThreadPool,
    isa: Isa,
    k: &Kernel,
    w: &Weight,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
    acts: &mut Acts,
) {
    acts.quantize(pool, isa, k.act, x, n_tokens, w.cols);
    let view = acts.view(x, n_tokens, w.cols);
    let plan = Plan::new(pool.n_threads(), w.rows, w.row_bytes());
    let yp = SyncPtr(y.as_mut_ptr());
    pool.parallel_for(plan.n_tasks, &|task| {
        let rows = plan.rows(task);
        if k.dequantize_first {
            run_dequantized(k, w, &view, rows, yp);
        } else {
            run_direct(k, w, &view, rows, yp);
        }
    });
}

/// How the rows are split into tasks: whole groups of 4 rows, equal counts, a multiple of
/// the thread count where there are enough rows.
pub(super) struct Plan {
    pub(super) n_tasks: usize,
    rows_per_task: usize,
    rows: usize,
}

impl Plan {
    pub(super) fn new(n_threads: usize, rows: usize, row_bytes: usize) -> Plan {
        let quads = rows.div_ceil(4);
        let by_size = (rows * row_bytes).div_ceil(TASK_BYTES);
        let wanted = by_size
            .max(n_threads)
            .next_multiple_of(n_threads)
            .min(quads);
        let quads_per_task = quads.div_ceil(wanted.max(1));
        Plan {
            n_tasks: quads.div_ceil(quads_per_task),
            rows_per_task: 4 * quads_per_task,
            rows,
        }
    }

    pub(super) fn rows(&self, task: usize) -> std::ops::Range<usize> {
        let start = task * self.rows_per_task;
        start..(start + self.rows_per_task).min(self.rows)
    }
}

/// How far ahead of the tile being computed a task's first pass prefetches weight bytes:
/// enough to cover DRAM latency at a core's streaming rate, so each new task (a new address
/// stream the hardware prefetcher has not learnt yet) does not stall.
pub(super) const PREFETCH_BYTES: usize = 4096;

/// Prefetches `len` bytes of `b` from offset `at` (clipped to `b`) into the cache.
#[inline]
pub(super) fn prefetch(b: &[u8], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let end = (at + len).min(b.len());
        let mut i = at;
        while i < end {
            // SAFETY: a prefetch is a hint that never faults, and `i` is inside `b` anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().add(i).cast()) };
            i += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (b, at, len);
}

/// `(start, len)` tiles covering `n` items: 4 while at least 4 remain, then 2 (if `pairs`)
/// and 1. Tokens use pairs (two-token batches are common: a decode step with a draft, or
/// two-pass activations); rows only 4 and 1.
fn steps(n: usize, pairs: bool) -> impl Iterator<Item = (usize, usize)> {
    let mut at = 0;
    std::iter::from_fn(move || {
        (at < n).then(|| {
            let left = n - at;
            let len = if left >= 4 {
                4
            } else if pairs && left >= 2 {
                2
            } else {
                1
            };
            at += len;
            (at - len, len)
        })
    })
}

/// Writes a tile's results: `out[i * 4 + j]` is row `r0 + i`, token `t0 + j`.
///
/// # Safety
/// `y` points to `n_tokens * rows` values and no other thread writes these rows.
#[inline]
unsafe fn scatter(
    y: SyncPtr<f32>,
    rows: usize,
    r0: usize,
    rn: usize,
    t0: usize,
    tn: usize,
    out: &[f32; 16],
) {
    for i in 0..rn {
        for j in 0..tn {
            *y.get().add((t0 + j) * rows + r0 + i) = out[i * 4 + j];
        }
    }
}

fn run_direct(
    k: &Kernel,
    w: &Weight,
    a: &ActView<'_>,
    rows: std::ops::Range<usize>,
    y: SyncPtr<f32>,
) {
    let (bytes, rb) = (w.bytes(), w.row_bytes());
    let mut out = [0f32; 16];
    let token_steps = steps(a.n_tokens, true);
    walk_tiles(
        bytes,
        rb,
        rows,
        token_steps,
        |n| steps(n, false),
        |r0, rn, t0, tn| {
            // SAFETY: `select` checked the ISA; rows r0..r0+rn lie within the weight, whose
            // byte length `matmul_with_isa` checked; `a` was built for this weight's columns
            // and n_tokens >= t0 + tn; this task alone writes rows `rows` of y.
            unsafe {
                (k.tile(rn, tn))(&bytes[r0 * rb..], rb, a, t0, &mut out);
                scatter(y, w.rows, r0, rn, t0, tn, &out);
            }
        },
    );
}

/// Walks a task's tiles of weight rows `rows` (row bytes `rb` of `bytes`): token steps
/// outermost, row steps (`row_steps(rows.len())`, offsets within the task) inside, calling
/// `tile(r0, rn, t0, tn)` with absolute rows. On the first token pass the weight rows are
/// prefetched PREFETCH_BYTES ahead of the tile being computed.
pub(super) fn walk_tiles<S: Iterator<Item = (usize, usize)>>(
    bytes: &[u8],
    rb: usize,
    rows: std::ops::Range<usize>,
    token_steps: impl Iterator<Item = (usize, usize)>,
    row_steps: impl Fn(usize) -> S,
    mut tile: impl FnMut(usize, usize, usize, usize),
) {
    let task_bytes = &bytes[rows.start * rb..rows.end * rb];
    for (t0, tn) in token_steps {
        for (dr, rn) in row_steps(rows.len()) {
            if t0 == 0 {
                // First pass over these rows: keep PREFETCH_BYTES of weights in flight.
                if dr == 0 {
                    prefetch(task_bytes, 0, PREFETCH_BYTES);
                }
                prefetch(task_bytes, dr * rb + PREFETCH_BYTES, rn * rb);
            }
            tile(rows.start + dr, rn, t0, tn);
        }
    }
}

fn run_dequantized(
    k: &Kernel,
    w: &Weight,
    a: &ActView<'_>,
    rows: std::ops::Range<usize>,
    y: SyncPtr<f32>,
) {
    let (bytes, rb, cols) = (w.bytes(), w.row_bytes(), w.cols);
    let go = |buf: &mut Vec<f32>| {
        if buf.len() < 4 * cols {
            buf.resize(4 * cols, 0.0);
        }
        let mut out = [0f32; 16];
        for (dr, rn) in steps(rows.len(), false) {
            let r0 = rows.start + dr;
            for i in 0..rn {
                let src = &bytes[(r0 + i) * rb..(r0 + i + 1) * rb];
                dequantize_row(w.dtype, src, &mut buf[i * cols..(i + 1) * cols]);
            }
            // SAFETY: any f32 is 4 initialised bytes; the view covers `rn * cols` values.
            let rows_bytes =
                unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), rn * cols * 4) };
            for (t0, tn) in steps(a.n_tokens, true) {
                // SAFETY: as in `run_direct`, with F32 kernels reading the dequantized rows.
                unsafe {
                    (k.tile(rn, tn))(rows_bytes, cols * 4, a, t0, &mut out);
                    scatter(y, w.rows, r0, rn, t0, tn, &out);
                }
            }
        }
    };
    ROWS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => go(&mut buf),
        Err(_) => go(&mut Vec::new()),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::quant::test_util::{random_weight, Rng};
    use crate::tensor::DType;

    #[test]
    fn results_do_not_depend_on_batch_threads_or_tiling() {
        let mut rng = Rng::new(5);
        let (one, three) = (ThreadPool::new(1), ThreadPool::new(3));
        for dtype in [
            DType::Q4_1,
            DType::Q8_0,
            DType::Q6_K,
            DType::F16,
            DType::Q3_K,
        ] {
            let cols = dtype.block_elems().max(32) * 2;
            let rows = 23;
            let w = random_weight(&mut rng, dtype, rows, cols);
            let n = 7; // tiles of 4, 2 and 1 tokens
            let x = rng.vec(n * cols);
            for isa in Isa::available() {
                let mut batched = vec![0f32; n * rows];
                matmul_with_isa(&three, isa, &w, &x, n, &mut batched);
                for t in 0..n {
                    let mut single = vec![0f32; rows];
                    matmul_with_isa(&one, isa, &w, &x[t * cols..(t + 1) * cols], 1, &mut single);
                    assert_eq!(
                        single[..],
                        batched[t * rows..(t + 1) * rows],
                        "{dtype} {isa:?} t {t}"
                    );
                }
            }
        }
    }

    #[test]
    fn plan_covers_rows_in_equal_groups_of_four() {
        for (threads, rows, rb) in [
            (2, 576, 360),
            (2, 1, 20),
            (3, 37, 34),
            (2, 49152, 612),
            (1, 5, 4),
        ] {
            let p = Plan::new(threads, rows, rb);
            let covered: Vec<usize> = (0..p.n_tasks).flat_map(|t| p.rows(t)).collect();
            assert_eq!(covered, (0..rows).collect::<Vec<_>>());
            assert_eq!(p.rows_per_task % 4, 0);
            if rows >= 4 * threads {
                assert_eq!(p.n_tasks % threads, 0, "threads {threads} rows {rows}");
            }
        }
    }

    #[test]
    fn empty_shapes_are_fine() {
        let pool = ThreadPool::new(2);
        let w = Weight::from_f32(3, 0, &[]);
        let mut y = vec![1f32; 6];
        matmul(&pool, &w, &[], 2, &mut y);
        assert_eq!(y, vec![0f32; 6]);
        let w = Weight::from_f32(0, 4, &[]);
        matmul(&pool, &w, &[1.0; 4], 1, &mut []);
        let w = Weight::from_f32(2, 2, &[1.0, 2.0, 3.0, 4.0]);
        matmul(&pool, &w, &[], 0, &mut []);
    }

    #[test]
    fn f32_matmul_by_hand() {
        let pool = ThreadPool::new(2);
        let w = Weight::from_f32(2, 3, &[1.0, 2.0, 3.0, -1.0, 0.5, 0.0]);
        let x = [1.0, 1.0, 1.0, 2.0, 0.0, -1.0];
        let mut y = [0f32; 4];
        matmul(&pool, &w, &x, 2, &mut y);
        assert_eq!(y, [6.0, -0.5, -1.0, -2.0]);
    }

    #[test]
    #[should_panic(expected = "x has")]
    fn short_input_panics() {
        let pool = ThreadPool::new(1);
        let w = Weight::from_f32(2, 3, &[0.0; 6]);
        matmul(&pool, &w, &[0.0; 5], 2, &mut [0.0; 4]);
    }

    #[test]
    #[should_panic(expected = "whole number")]
    fn partial_block_columns_panic() {
        let pool = ThreadPool::new(1);
        let mut w = random_weight(&mut Rng::new(1), DType::Q4_0, 1, 32);
        w.cols = 31;
        matmul(&pool, &w, &[0.0; 31], 1, &mut [0.0; 1]);
    }
}
