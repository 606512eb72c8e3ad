//! Row- and element-wise operations run through the same trait calls on the CPU and CUDA
//! backends: embedding lookups of every table type, RMSNorm alone and fused with the residual
//! add before it, SwiGLU, the residual add, row gathers and plain uploads.

use deepinfer::backend::cpu::CpuBackend;
use deepinfer::backend::cuda::Act;
use deepinfer::backend::Backend;
use deepinfer::tensor::{DType, Weight};

use super::matmul::random_weight;
use super::util::{assert_close, backend, tol, upload, Rng};

/// Every operation of this file on one backend; returns each result in order.
#[allow(clippy::too_many_arguments)]
fn ops<B: Backend>(
    be: &B,
    rows: usize,
    d: usize,
    x: &[f32],
    y: &[f32],
    gain: &[f32],
    tables: &[Weight],
    ids: &[u32],
) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    let g = be.prepare_weight(&Weight::from_f32(1, d, gain)).unwrap();
    // RMSNorm alone.
    let xb = upload(be, rows, d, x);
    let mut h = be.zeros(rows * d).unwrap();
    be.rms_norm(&xb, &g, 1e-5, &mut h).unwrap();
    out.push(be.to_host(&h).unwrap());
    // x += y, then RMSNorm of x (the CUDA queue fuses the two): both results checked.
    let mut xb = upload(be, rows, d, x);
    let yb = upload(be, rows, d, y);
    be.add_assign(&mut xb, &yb).unwrap();
    be.rms_norm(&xb, &g, 1e-6, &mut h).unwrap();
    out.push(be.to_host(&h).unwrap());
    out.push(be.to_host(&xb).unwrap());
    // SwiGLU.
    let mut gate = upload(be, rows, d, x);
    be.silu_mul(&mut gate, &yb).unwrap();
    out.push(be.to_host(&gate).unwrap());
    // Row gather (rows in a scrambled order, one repeated).
    let pick: Vec<usize> = (0..rows).rev().chain([0]).collect();
    let mut sel = be.zeros(pick.len() * d).unwrap();
    be.gather_rows(&xb, d, &pick, &mut sel).unwrap();
    out.push(be.to_host(&sel).unwrap());
    // Embedding lookups.
    for t in tables {
        let w = be.prepare_weight(t).unwrap();
        let mut e = be.zeros(ids.len() * t.cols).unwrap();
        be.embed(&w, ids, &mut e).unwrap();
        out.push(be.to_host(&e).unwrap());
    }
    out
}

#[test]
fn elementwise_ops_match_the_cpu_backend() {
    let mut rng = Rng::fresh("elementwise");
    let cpu = CpuBackend::new(2);
    for act in [Act::F32, Act::Bf16] {
        let Some(be) = backend(act) else { return };
        for (rows, d) in [(1usize, 64usize), (5, 100), (3, 577), (17, 4096)] {
            let x = rng.vec(rows * d, 2.0);
            let y = rng.vec(rows * d, 1.0);
            let gain = rng.vec(d, 1.5);
            let tables: Vec<Weight> = if d % 32 == 0 {
                [
                    DType::F32,
                    DType::F16,
                    DType::BF16,
                    DType::Q4_0,
                    DType::Q4_1,
                    DType::Q8_0,
                ]
                .iter()
                .map(|&t| random_weight(&mut rng, t, 50, d))
                .collect()
            } else {
                [DType::F32, DType::BF16]
                    .iter()
                    .map(|&t| random_weight(&mut rng, t, 50, d))
                    .collect()
            };
            let ids: Vec<u32> = (0..7).map(|_| rng.below(50) as u32).collect();
            let want = ops(&cpu, rows, d, &x, &y, &gain, &tables, &ids);
            let got = ops(&be, rows, d, &x, &y, &gain, &tables, &ids);
            let names = [
                "rms_norm",
                "add+rms_norm",
                "add (residual)",
                "silu_mul",
                "gather_rows",
            ];
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let name = names.get(i).map_or_else(
                    || format!("embed {}", tables[i - names.len()].dtype),
                    |s| s.to_string(),
                );
                assert_close(&format!("{act:?} {rows}x{d} {name}"), g, w, tol(act, 1e-5));
            }
        }
    }
}

#[test]
fn zeros_are_zero_and_out_of_vocabulary_ids_are_refused() {
    let Some(be) = backend(Act::F32) else { return };
    for n in [1usize, 1000, 100_003] {
        let z = be.to_host(&be.zeros(n).unwrap()).unwrap();
        assert!(z.len() == n && z.iter().all(|&v| v == 0.0));
    }
    let t = be
        .prepare_weight(&Weight::from_f32(4, 8, &[0.5; 32]))
        .unwrap();
    let mut out = be.zeros(8).unwrap();
    assert!(be.embed(&t, &[4], &mut out).is_err());
}
