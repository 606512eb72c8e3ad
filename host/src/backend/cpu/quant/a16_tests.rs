//! The 16-bit-activation kernels on every available ISA: against "dequantize, then dot in
//! f64", against the scalar kernels, and alone against batched (bit for bit).

use super::test_util::{dequantized, random_weight, Rng};
use super::Isa;
use crate::backend::cpu::matmul16::{matmul16_with_isa, supports};
use crate::backend::cpu::pool::ThreadPool;
use crate::tensor::{DType, Weight};

const TYPES: [DType; 3] = [DType::Q4_0, DType::Q4_1, DType::Q8_0];

fn run(pool: &ThreadPool, isa: Isa, w: &Weight, x: &[f32], n: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; n * w.rows];
    matmul16_with_isa(pool, isa, w, x, n, &mut y);
    y
}

/// `(quant, scale)` error bounds for one output: 16-bit rounding moves each activation by at
/// most `max|x_block| / 65534`; `scale` sizes f32 rounding (as in `kernel_tests`).
fn bounds(w: &[f32], x: &[f32]) -> (f64, f64) {
    let (mut quant, mut scale) = (0f64, 0f64);
    for (wc, xc) in w.chunks(32).zip(x.chunks(32)) {
        let amax = xc.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        let wabs: f64 = wc.iter().map(|v| v.abs() as f64).sum();
        let wmax = wc.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        quant += amax / 65534.0 * wabs;
        scale += wmax * xc.iter().map(|v| v.abs() as f64).sum::<f64>();
    }
    (quant, 4.0 * scale)
}

fn want(wf: &[f32], x: &[f32], cols: usize, r: usize, t: usize) -> (f64, f64) {
    let (wr, xt) = (&wf[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
    let v: f64 = wr.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum();
    let (quant, scale) = bounds(wr, xt);
    (v, 1.02 * quant + 1e-5 * scale + 1e-6)
}

#[test]
fn only_the_32_element_formats_with_kernels_are_supported() {
    for dt in TYPES {
        assert!(supports(dt));
    }
    for dt in [DType::F32, DType::Q5_0, DType::Q4_K, DType::Q6_K] {
        assert!(!supports(dt));
    }
}

#[test]
fn matches_f64_reference_on_every_isa() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng::new(17);
    for dtype in TYPES {
        // Odd block counts (3, 5, 9) pair the last block with the zero pad block; 8 blocks
        // and more start with octets on the 512-bit level.
        for cols in [32, 96, 160, 256, 288, 576] {
            for rows in [1, 5, 37] {
                let w = random_weight(&mut rng, dtype, rows, cols);
                let wf = dequantized(&w);
                for n in [1, 3, 9, 16] {
                    let x = rng.vec(n * cols);
                    for isa in Isa::available() {
                        let y = run(&pool, isa, &w, &x, n);
                        for t in 0..n {
                            for r in 0..rows {
                                let (v, tol) = want(&wf, &x, cols, r, t);
                                let got = y[t * rows + r] as f64;
                                assert!(
                                    (got - v).abs() <= tol,
                                    "{dtype} {} rows {rows} cols {cols} n {n}: y[{t},{r}] = \
                                     {got}, want {v} (tol {tol})",
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
    let mut rng = Rng::new(19);
    for dtype in TYPES {
        for cols in [96, 576] {
            let (rows, n) = (9, 13);
            let w = random_weight(&mut rng, dtype, rows, cols);
            let wf = dequantized(&w);
            let x = rng.vec(n * cols);
            let reference = run(&pool, Isa::Scalar, &w, &x, n);
            for isa in Isa::available().into_iter().skip(1) {
                let y = run(&pool, isa, &w, &x, n);
                for t in 0..n {
                    for r in 0..rows {
                        let (_, scale) =
                            bounds(&wf[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
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
fn results_do_not_depend_on_batch_threads_or_tiling() {
    let mut rng = Rng::new(23);
    let (one, three) = (ThreadPool::new(1), ThreadPool::new(3));
    for dtype in TYPES {
        let (rows, cols, n) = (23, 288, 15); // token tiles 8, 4, 2, 1; row tiles 2, 1
        let w = random_weight(&mut rng, dtype, rows, cols);
        let x = rng.vec(n * cols);
        for isa in Isa::available() {
            let batched = run(&three, isa, &w, &x, n);
            for t in 0..n {
                let single = run(&one, isa, &w, &x[t * cols..(t + 1) * cols], 1);
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
fn exact_on_representable_inputs() {
    // Activations k * 2^-12 with a block maximum of 32767 * 2^-12 quantize without loss, so
    // the kernels must match the f64 reference up to f32 rounding alone.
    let pool = ThreadPool::new(2);
    let mut rng = Rng::new(29);
    for dtype in TYPES {
        let cols = 32 * 9;
        let w = random_weight(&mut rng, dtype, 6, cols);
        let wf = dequantized(&w);
        let mut x: Vec<f32> = (0..3 * cols)
            .map(|_| ((rng.next_u64() % 65535) as i32 - 32767) as f32 / 4096.0)
            .collect();
        for b in x.chunks_mut(32) {
            b[7] = -32767.0 / 4096.0;
        }
        for isa in Isa::available() {
            let y = run(&pool, isa, &w, &x, 3);
            for t in 0..3 {
                for r in 0..6 {
                    let (v, _) = want(&wf, &x, cols, r, t);
                    let (_, scale) =
                        bounds(&wf[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                    let got = y[t * 6 + r] as f64;
                    assert!(
                        (got - v).abs() <= 1e-5 * scale + 1e-6,
                        "{dtype} {}: {got} vs {v}",
                        isa.name()
                    );
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "no 16-bit")]
fn unsupported_type_panics() {
    let pool = ThreadPool::new(1);
    let w = random_weight(&mut Rng::new(1), DType::Q4_K, 1, 256);
    matmul16_with_isa(&pool, Isa::Scalar, &w, &[0.0; 256], 1, &mut [0.0]);
}
