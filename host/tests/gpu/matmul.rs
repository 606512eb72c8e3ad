//! Linear layers of every weight type the CUDA backend reads, through the GEMV path (up to 8
//! tokens) and the cuBLAS path (more), against an f64 product of the dequantized weights.

use std::sync::Arc;

use deepinfer::backend::cpu::quant::dequantize_row;
use deepinfer::backend::cuda::Act;
use deepinfer::backend::Backend;
use deepinfer::tensor::{Bytes, DType, Weight};
use half::{bf16, f16};

use super::util::{assert_close, backend, upload, Rng};

/// A random weight of `dtype` (block scales kept in a sane range).
pub fn random_weight(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Weight {
    let n = rows * cols;
    let h = |v: f32| f16::from_f32(v).to_bits().to_le_bytes();
    let mut b = Vec::new();
    match dtype {
        DType::F32 => return Weight::from_f32(rows, cols, &rng.vec(n, 0.5)),
        DType::F16 => (0..n).for_each(|_| b.extend(h(rng.f32() * 0.5))),
        DType::BF16 => {
            (0..n).for_each(|_| b.extend(bf16::from_f32(rng.f32() * 0.5).to_bits().to_le_bytes()))
        }
        _ => {
            let blocks = n / dtype.block_elems();
            for _ in 0..blocks {
                let start = b.len();
                let d = 0.01 + 0.04 * rng.f32().abs();
                match dtype {
                    DType::Q4_0 | DType::Q8_0 => b.extend(h(d)),
                    DType::Q4_1 | DType::Q4_K => {
                        b.extend(h(d));
                        b.extend(h(if dtype == DType::Q4_K {
                            d
                        } else {
                            -0.1 * rng.f32().abs()
                        }));
                    }
                    _ => unreachable!("no generator for {dtype}"),
                }
                while b.len() < start + dtype.block_bytes() {
                    b.push(rng.next_u64() as u8);
                }
            }
        }
    }
    Weight {
        dtype,
        rows,
        cols,
        data: Bytes::Owned(Arc::new(b)),
    }
}

fn dequant(w: &Weight) -> Vec<f32> {
    let mut out = vec![0f32; w.rows * w.cols];
    let rb = w.row_bytes();
    for r in 0..w.rows {
        dequantize_row(
            w.dtype,
            &w.bytes()[r * rb..(r + 1) * rb],
            &mut out[r * w.cols..(r + 1) * w.cols],
        );
    }
    out
}

fn reference(wf: &[f32], x: &[f32], rows: usize, cols: usize, n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n * rows];
    for t in 0..n {
        for r in 0..rows {
            let s: f64 = (0..cols)
                .map(|c| wf[r * cols + c] as f64 * x[t * cols + c] as f64)
                .sum();
            y[t * rows + r] = s as f32;
        }
    }
    y
}

#[test]
fn matmul_matches_the_dequantized_product_for_every_type_and_token_count() {
    let mut rng = Rng::fresh("matmul");
    for act in [Act::F32, Act::Bf16] {
        let Some(be) = backend(act) else { return };
        for dtype in [
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q8_0,
            DType::Q4_K,
        ] {
            let shapes: &[(usize, usize)] = match dtype {
                DType::Q4_K => &[(37, 256), (300, 512)],
                DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => &[(37, 64), (300, 96), (129, 576)],
                // (77, 2048): the block GEMVs of 16-bit weights.
                _ => &[(37, 64), (300, 96), (45, 13), (130, 100), (77, 2048)],
            };
            for &(rows, cols) in shapes {
                let w = random_weight(&mut rng, dtype, rows, cols);
                let wf = dequant(&w);
                let gw = be.prepare_weight(&w).expect("weight uploads");
                for n in [1usize, 3, 8, 9, 33] {
                    let x = rng.vec(n * cols, 1.0);
                    let xb = upload(&be, n, cols, &x);
                    let mut y = be.zeros(n * rows).unwrap();
                    be.matmul(&gw, &xb, n, &mut y).unwrap();
                    let got = be.to_host(&y).unwrap();
                    let want = reference(&wf, &x, rows, cols, n);
                    // bf16 inputs to cuBLAS (n > 8) or bf16 activations round to 8 bits.
                    // Q4_K is expanded to bf16 at load.
                    let rounded = dtype == DType::Q4_K || (n > 8 && dtype != DType::F32);
                    let tol = match (act, rounded) {
                        (Act::Bf16, _) => 1.5e-2,
                        (Act::F32, true) => 8e-3,
                        (Act::F32, false) => 2e-5,
                    };
                    assert_close(
                        &format!("{act:?} {dtype} {rows}x{cols} n={n}"),
                        &got,
                        &want,
                        tol,
                    );
                }
            }
        }
    }
}

#[test]
fn products_sharing_an_input_fuse_and_stay_correct() {
    let mut rng = Rng::fresh("fused gemv");
    let Some(be) = backend(Act::F32) else { return };
    let cols = 128;
    let ws: Vec<Weight> = [64usize, 32, 32, 200]
        .iter()
        .map(|&r| random_weight(&mut rng, DType::BF16, r, cols))
        .collect();
    let gws: Vec<_> = ws.iter().map(|w| be.prepare_weight(w).unwrap()).collect();
    for n in [1usize, 2, 20] {
        let x = rng.vec(n * cols, 1.0);
        let xb = upload(&be, n, cols, &x);
        let mut ys: Vec<_> = ws.iter().map(|w| be.zeros(n * w.rows).unwrap()).collect();
        for (g, y) in gws.iter().zip(ys.iter_mut()) {
            be.matmul(g, &xb, n, y).unwrap();
        }
        for (w, y) in ws.iter().zip(&ys) {
            let want = reference(&dequant(w), &x, w.rows, cols, n);
            assert_close(
                &format!("fused n={n} rows={}", w.rows),
                &be.to_host(y).unwrap(),
                &want,
                if n > 8 { 8e-3 } else { 2e-5 },
            );
        }
    }
}

/// The block GEMVs with an RMSNorm folded in before them and a residual add after them
/// (`gemvbn_*`, `gemvba_*`: bf16 weights and activations, up to 8 tokens, rows of at least
/// 2048) against the same trait calls on the CPU backend, and against the CUDA backend with
/// folding off (which must flush two launches more): the norm output, three segments of odd
/// row counts sharing the normalized input, and a residual sum, for every token bound and row
/// shape. One token over 2048-wide rows takes the staged `gemvp*` kernels, in 32-row blocks
/// folded and 8-row blocks unfolded.
#[test]
fn rms_norm_and_residual_add_fold_into_block_gemvs() {
    let Some(be) = backend(Act::Bf16) else {
        return;
    };
    let plain = deepinfer::backend::cuda::CudaBackend::new(
        0,
        deepinfer::backend::cuda::CudaOptions {
            act: Some(Act::Bf16),
            fuse_norm: false,
            fuse_add: false,
            // one token over 2048-wide rows: the 8-row staged blocks here, the 32-row ones
            // (the default) folded
            gemvp_wide: false,
            ..deepinfer::backend::cuda::CudaOptions::from_env().unwrap()
        },
    )
    .unwrap();
    let cpu = deepinfer::backend::cpu::CpuBackend::new(2);
    let mut rng = Rng::fresh("fold");
    for &(k, n) in &[
        (2056usize, 1usize),
        (4096, 3),
        (4104, 1),
        (8200, 1),
        (2048, 5),
        (2048, 1),
        (6144, 8),
    ] {
        let rows = [37usize, 11, 13];
        let ws: Vec<Weight> = rows
            .iter()
            .map(|&r| random_weight(&mut rng, DType::BF16, r, k))
            .collect();
        let wo = random_weight(&mut rng, DType::BF16, 29, k);
        let gain = Weight::from_f32(1, k, &rng.vec(k, 1.0));
        let x = rng.vec(n * k, 2.0);
        let res0 = rng.vec(n * 29, 1.0);
        // The same calls on every backend, buffers made first as a model makes them:
        // h = norm(x); y_i = W_i h; o = Wo h; res += o.
        macro_rules! run {
            ($b:expr) => {{
                let b = $b;
                let gw: Vec<_> = ws.iter().map(|w| b.prepare_weight(w).unwrap()).collect();
                let gwo = b.prepare_weight(&wo).unwrap();
                let g = b.prepare_weight(&gain).unwrap();
                let xb = upload(b, n, k, &x);
                let mut res = upload(b, n, 29, &res0);
                let mut h = b.zeros(n * k).unwrap();
                let mut ys: Vec<_> = rows.iter().map(|&r| b.zeros(n * r).unwrap()).collect();
                let mut o = b.zeros(n * 29).unwrap();
                b.rms_norm(&xb, &g, 1e-5, &mut h).unwrap();
                for (w, y) in gw.iter().zip(ys.iter_mut()) {
                    b.matmul(w, &h, n, y).unwrap();
                }
                b.matmul(&gwo, &h, n, &mut o).unwrap();
                b.add_assign(&mut res, &o).unwrap();
                let mut out = vec![b.to_host(&h).unwrap(), b.to_host(&res).unwrap()];
                out.extend(ys.iter().map(|y| b.to_host(y).unwrap()));
                out
            }};
        }
        let ops0 = (be.stats().ops, plain.stats().ops);
        let got = run!(&be);
        let unfolded = run!(&plain);
        let ops = (be.stats().ops - ops0.0, plain.stats().ops - ops0.1);
        let want = run!(&cpu);
        let what = format!("folded gemv k={k} n={n}");
        eprintln!("{what}: {} ops flushed folded, {} unfolded", ops.0, ops.1);
        assert_eq!(
            ops.0 + 2,
            ops.1,
            "{what}: the norm and the add were not folded"
        );
        for (name, i, t) in [("norm output", 0, 1e-2), ("residual", 1, 1.5e-2)] {
            assert_close(&format!("{what}: {name}"), &got[i], &want[i], t);
            assert_close(
                &format!("{what}: {name} (unfolded)"),
                &unfolded[i],
                &want[i],
                t,
            );
        }
        for (i, (g, w)) in got[2..].iter().zip(&want[2..]).enumerate() {
            assert_close(&format!("{what}: segment {i}"), g, w, 1.5e-2);
        }
    }
}

/// The skinny tensor-core GEMMs (`gemt_*`: 9..=64 tokens, bf16 weights and activations) as a
/// model calls them — Q/K/V-like products of odd row counts sharing an input (one launch),
/// gate/up followed by `silu_mul` (folded into that launch) and a lone product whose k is not
/// a multiple of the 256-wide chunks — against the same calls on the CPU backend and on CUDA
/// with the kernels off (cuBLAS). A token's outputs must not depend on how many tokens ride
/// along (padded batch steps): the first 9 rows come out bit-identical at every token count.
#[test]
fn skinny_tensor_core_gemms_match_the_cpu_and_fold_swiglu() {
    if backend(Act::Bf16).is_none() {
        return;
    }
    let be = deepinfer::backend::cuda::CudaBackend::new(
        0,
        deepinfer::backend::cuda::CudaOptions {
            act: Some(Act::Bf16),
            gemt: true,
            ..deepinfer::backend::cuda::CudaOptions::from_env().unwrap()
        },
    )
    .unwrap();
    let cublas = deepinfer::backend::cuda::CudaBackend::new(
        0,
        deepinfer::backend::cuda::CudaOptions {
            act: Some(Act::Bf16),
            gemt: false,
            ..deepinfer::backend::cuda::CudaOptions::from_env().unwrap()
        },
    )
    .unwrap();
    let cpu = deepinfer::backend::cpu::CpuBackend::new(2);
    let mut rng = Rng::fresh("gemt");
    for &(k, kl, f) in &[(264usize, 1000usize, 136usize), (2056, 4104, 300)] {
        let rows = [203usize, 37, 129];
        let ws: Vec<Weight> = rows
            .iter()
            .map(|&r| random_weight(&mut rng, DType::BF16, r, k))
            .collect();
        let wg = random_weight(&mut rng, DType::BF16, f, k);
        let wu = random_weight(&mut rng, DType::BF16, f, k);
        let wl = random_weight(&mut rng, DType::BF16, 77, kl);
        let x_all = rng.vec(64 * k, 1.0);
        let xl_all = rng.vec(64 * kl, 1.0);
        let mut first: Option<Vec<Vec<f32>>> = None;
        for n in [9usize, 17, 24, 40, 64] {
            let (x, xl) = (&x_all[..n * k], &xl_all[..n * kl]);
            // y_i = W_i x; g = silu(Wg x) * (Wu x); l = Wl xl.
            macro_rules! run {
                ($b:expr) => {{
                    let b = $b;
                    let gw: Vec<_> = ws.iter().map(|w| b.prepare_weight(w).unwrap()).collect();
                    let (gg, gu, gl) = (
                        b.prepare_weight(&wg).unwrap(),
                        b.prepare_weight(&wu).unwrap(),
                        b.prepare_weight(&wl).unwrap(),
                    );
                    let xb = upload(b, n, k, x);
                    let xlb = upload(b, n, kl, xl);
                    let mut ys: Vec<_> = rows.iter().map(|&r| b.zeros(n * r).unwrap()).collect();
                    let mut g = b.zeros(n * f).unwrap();
                    let mut u = b.zeros(n * f).unwrap();
                    let mut l = b.zeros(n * 77).unwrap();
                    for (w, y) in gw.iter().zip(ys.iter_mut()) {
                        b.matmul(w, &xb, n, y).unwrap();
                    }
                    b.matmul(&gg, &xb, n, &mut g).unwrap();
                    b.matmul(&gu, &xb, n, &mut u).unwrap();
                    b.silu_mul(&mut g, &u).unwrap();
                    b.matmul(&gl, &xlb, n, &mut l).unwrap();
                    let mut out: Vec<Vec<f32>> = ys.iter().map(|y| b.to_host(y).unwrap()).collect();
                    out.push(b.to_host(&g).unwrap());
                    out.push(b.to_host(&l).unwrap());
                    out
                }};
            }
            let ops0 = (be.stats().ops, cublas.stats().ops);
            let got = run!(&be);
            let other = run!(&cublas);
            let ops = (be.stats().ops - ops0.0, cublas.stats().ops - ops0.1);
            let want = run!(&cpu);
            let what = format!("gemt k={k} n={n}");
            eprintln!("{what}: {} ops flushed, {} with cuBLAS", ops.0, ops.1);
            assert_eq!(
                ops.0 + 4,
                ops.1,
                "{what}: Q/K/V-like products or gate/up + SwiGLU did not share a launch"
            );
            for (i, name) in ["y0", "y1", "y2", "silu(gate) * up", "lone"]
                .iter()
                .enumerate()
            {
                assert_close(&format!("{what}: {name}"), &got[i], &want[i], 1.5e-2);
                assert_close(
                    &format!("{what}: {name} (cuBLAS)"),
                    &other[i],
                    &want[i],
                    1.5e-2,
                );
            }
            let head: Vec<Vec<f32>> = got.iter().map(|v| v[..9 * v.len() / n].to_vec()).collect();
            match &first {
                None => first = Some(head),
                Some(f0) => {
                    for (i, (a, b)) in head.iter().zip(f0).enumerate() {
                        assert!(
                            a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()),
                            "{what}: output {i} of the first 9 tokens differs from n=9"
                        );
                    }
                }
            }
        }
    }
}

/// SwiGLU folded into the block gate/up GEMV (`gemvbs_*`, and `gemvbns_*` with the RMSNorm
/// before it: bf16 weights and activations, up to 8 tokens, rows of at least 2048) against
/// the CPU backend and against CUDA with the fold off (`fuse_silu: false`), which must flush
/// one launch more and give bit-identical outputs: odd row counts (a block's last gate rows
/// past the end), every token bound, the (4, 2) and (2, 4) row shapes and k beyond 8192 (whose
/// unfolded kernel takes one row a block). Each case runs twice: with the block GEMVs, and
/// with one token over 2048-wide rows on the staged kernels (`gemvps*`,
/// `CudaOptions::gemvp_swiglu`: 4 pairs a block, a block's last pairs past the end for 37 and
/// 21 rows), whose unfolded side takes the staged `gemvp*` too: they add a row's products in
/// the same order, where the block GEMVs add them in another (so their bf16 outputs differ from
/// the staged ones' now and then), and the block GEMVs on both sides otherwise.
#[test]
fn swiglu_folds_into_block_gate_up_gemvs() {
    use deepinfer::backend::cuda::{CudaBackend, CudaOptions};
    if backend(Act::Bf16).is_none() {
        return;
    }
    let env = CudaOptions::from_env().unwrap();
    // (folded, unfolded) backends without and with the staged SwiGLU kernels
    let pairs: Vec<(bool, CudaBackend, CudaBackend)> = [false, true]
        .into_iter()
        .map(|staged| {
            let opts = |fuse_silu: bool, gemvp: bool| CudaOptions {
                act: Some(Act::Bf16),
                fuse_silu,
                gemvp,
                gemvp_swiglu: staged,
                ..env.clone()
            };
            (
                staged,
                CudaBackend::new(0, opts(true, env.gemvp)).unwrap(),
                CudaBackend::new(0, opts(false, env.gemvp && staged)).unwrap(),
            )
        })
        .collect();
    let cpu = deepinfer::backend::cpu::CpuBackend::new(2);
    let mut rng = Rng::fresh("swiglu fold");
    for &(k, n, f, norm) in &[
        (2056usize, 1usize, 37usize, true),
        (2056, 1, 37, false),
        (4104, 1, 19, true),
        (8200, 1, 23, true),
        (2048, 3, 29, true),
        (2048, 1, 37, true),
        (2048, 1, 21, false),
        (6144, 8, 11, false),
        (4096, 2, 5, true),
    ] {
        let wg = random_weight(&mut rng, DType::BF16, f, k);
        let wu = random_weight(&mut rng, DType::BF16, f, k);
        let gain = Weight::from_f32(1, k, &rng.vec(k, 1.0));
        let x = rng.vec(n * k, 2.0);
        // h = norm(x) (or x itself); g = silu(Wg h) * (Wu h).
        macro_rules! run {
            ($b:expr) => {{
                let b = $b;
                let (gg, gu, gn) = (
                    b.prepare_weight(&wg).unwrap(),
                    b.prepare_weight(&wu).unwrap(),
                    b.prepare_weight(&gain).unwrap(),
                );
                let xb = upload(b, n, k, &x);
                let mut h = b.zeros(n * k).unwrap();
                let mut g = b.zeros(n * f).unwrap();
                let mut u = b.zeros(n * f).unwrap();
                let input = if norm {
                    b.rms_norm(&xb, &gn, 1e-5, &mut h).unwrap();
                    &h
                } else {
                    &xb
                };
                b.matmul(&gg, input, n, &mut g).unwrap();
                b.matmul(&gu, input, n, &mut u).unwrap();
                b.silu_mul(&mut g, &u).unwrap();
                b.to_host(&g).unwrap()
            }};
        }
        let want = run!(&cpu);
        for (staged, be, plain) in &pairs {
            let ops0 = (be.stats().ops, plain.stats().ops);
            let got = run!(be);
            let unfolded = run!(plain);
            let ops = (be.stats().ops - ops0.0, plain.stats().ops - ops0.1);
            let what = format!("swiglu gemv k={k} n={n} rows={f} norm={norm} staged={staged}");
            eprintln!("{what}: {} ops flushed folded, {} unfolded", ops.0, ops.1);
            assert_eq!(ops.0 + 1, ops.1, "{what}: SwiGLU was not folded");
            assert_close(&what, &got, &want, 1.5e-2);
            let same = got
                .iter()
                .zip(&unfolded)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: folded and unfolded outputs differ");
        }
    }
}
