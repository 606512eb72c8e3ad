//! Every weight type on every available ISA: matmul against "dequantize, then dot in f64",
//! and each SIMD level against the scalar kernels on the same inputs.

use super::test_util::{dequantized, random_weight, Rng};
use super::Isa;
use crate::backend::cpu::matmul::matmul_with_isa;
use crate::backend::cpu::pool::ThreadPool;
use crate::tensor::{DType, Weight};

const TYPES: [DType; 13] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
];

/// Column counts of a few blocks: odd block counts (the 512-bit kernels pair blocks) and, for
/// float types, counts that leave a SIMD tail.
fn col_cases(dtype: DType) -> &'static [usize] {
    match dtype.block_elems() {
        1 => &[40, 64, 13],
        32 => &[96, 128, 32],
        _ => &[512, 256],
    }
}

/// How the kernel for `dtype` sees activations: quantized in blocks of this many elements
/// (0: plain f32).
fn act_block(dtype: DType) -> usize {
    match dtype {
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => 32,
        DType::Q4_K | DType::Q6_K => 256,
        _ => 0,
    }
}

/// Error bounds for output (row r, token x): `quant` is what 8-bit activation rounding can
/// cost (each activation moves by at most half a step, `max|x_block| / 254`, so the dot moves
/// by at most that times the block's `sum |w|`); `scale` sizes the f32 rounding of sums that
/// may pass through offset terms up to ~4x the largest weight magnitude.
fn bounds(w: &[f32], x: &[f32], block: usize) -> (f64, f64) {
    let (mut quant, mut scale) = (0f64, 0f64);
    for (wc, xc) in w.chunks(32).zip(x.chunks(32)) {
        let wmax = wc.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        scale += wmax * xc.iter().map(|v| v.abs() as f64).sum::<f64>();
    }
    if block > 0 {
        for (wc, xc) in w.chunks(block).zip(x.chunks(block)) {
            let amax = xc.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
            quant += amax / 254.0 * wc.iter().map(|v| v.abs() as f64).sum::<f64>();
        }
    }
    (quant, 4.0 * scale)
}

fn run(pool: &ThreadPool, isa: Isa, w: &Weight, x: &[f32], n: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; n * w.rows];
    matmul_with_isa(pool, isa, w, x, n, &mut y);
    y
}

#[test]
fn matmul_matches_f64_reference_on_every_isa() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng::new(7);
    for dtype in TYPES {
        for &cols in col_cases(dtype) {
            for rows in [1, 5, 37] {
                let w = random_weight(&mut rng, dtype, rows, cols);
                let wf = dequantized(&w);
                for n in [1, 3, 7, 16] {
                    let x = rng.vec(n * cols);
                    for isa in Isa::available() {
                        let y = run(&pool, isa, &w, &x, n);
                        for t in 0..n {
                            let xt = &x[t * cols..(t + 1) * cols];
                            for r in 0..rows {
                                let wr = &wf[r * cols..(r + 1) * cols];
                                let want: f64 =
                                    wr.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum();
                                let (quant, scale) = bounds(wr, xt, act_block(dtype));
                                let tol = 1.02 * quant + 1e-5 * scale + 1e-6;
                                let got = y[t * rows + r] as f64;
                                assert!(
                                    (got - want).abs() <= tol,
                                    "{dtype} {} rows {rows} cols {cols} n {n}: y[{t},{r}] = {got}, \
                                     want {want} (tol {tol})",
                                    isa.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn simd_levels_agree_with_scalar() {
    let pool = ThreadPool::new(1);
    let mut rng = Rng::new(11);
    for dtype in TYPES {
        for &cols in col_cases(dtype) {
            let (rows, n) = (9, 6);
            let w = random_weight(&mut rng, dtype, rows, cols);
            let wf = dequantized(&w);
            let x = rng.vec(n * cols);
            let reference = run(&pool, Isa::Scalar, &w, &x, n);
            for isa in Isa::available().into_iter().filter(|&i| i != Isa::Scalar) {
                let y = run(&pool, isa, &w, &x, n);
                for t in 0..n {
                    for r in 0..rows {
                        let (_, scale) = bounds(
                            &wf[r * cols..(r + 1) * cols],
                            &x[t * cols..(t + 1) * cols],
                            0,
                        );
                        let (a, b) = (y[t * rows + r], reference[t * rows + r]);
                        assert!(
                            ((a - b) as f64).abs() <= 1e-5 * scale + 1e-6,
                            "{dtype} {} vs scalar at [{t},{r}]: {a} vs {b}",
                            isa.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn quantized_kernels_are_exact_on_representable_inputs() {
    // Activations that are exactly k * 2^-4 with max 127 * 2^-4 quantize without loss, so the
    // integer kernels must match the f64 reference up to f32 rounding alone.
    let pool = ThreadPool::new(2);
    let mut rng = Rng::new(3);
    for dtype in [
        DType::Q4_1,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q6_K,
        DType::Q5_0,
    ] {
        let cols = dtype.block_elems() * 4;
        let w = random_weight(&mut rng, dtype, 6, cols);
        let wf = dequantized(&w);
        let mut x: Vec<f32> = (0..2 * cols)
            .map(|_| ((rng.next_u64() % 255) as i32 - 127) as f32 / 16.0)
            .collect();
        for b in x.chunks_mut(32) {
            b[0] = 127.0 / 16.0;
        }
        for isa in Isa::available() {
            let y = run(&pool, isa, &w, &x, 2);
            for t in 0..2 {
                for r in 0..6 {
                    let (wr, xt) = (&wf[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                    let want: f64 = wr.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let (_, scale) = bounds(wr, xt, 0);
                    let got = y[t * 6 + r] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * scale + 1e-6,
                        "{dtype} {}: {got} vs {want}",
                        isa.name()
                    );
                }
            }
        }
    }
}
