//! Shared helpers of the GPU tests: a backend or a printed skip reason, fresh random inputs
//! (the seed is printed so a failure can be replayed with `DEEPINFER_TEST_SEED`), uploads
//! through the `Backend` trait itself, and norm-wise comparison.

use deepinfer::backend::cuda::{unavailable_reason, Act, CudaBackend, CudaOptions};
use deepinfer::backend::Backend;
use deepinfer::tensor::Weight;

/// The CUDA backend with activations of type `act`, or `None` (and why, on stderr).
pub fn backend(act: Act) -> Option<CudaBackend> {
    if let Some(why) = unavailable_reason() {
        eprintln!("skipped: {why}");
        return None;
    }
    let opts = CudaOptions {
        act: Some(act),
        ..CudaOptions::from_env().expect("CUDA options")
    };
    Some(CudaBackend::new(0, opts).expect("the CUDA backend starts"))
}

pub struct Rng(pub u64);

impl Rng {
    /// Seeded from `DEEPINFER_TEST_SEED` or the clock (printed).
    pub fn fresh(test: &str) -> Rng {
        let seed = std::env::var("DEEPINFER_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            });
        eprintln!("{test}: DEEPINFER_TEST_SEED={seed}");
        Rng(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32() * scale).collect()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Uploads `rows x cols` values through the trait (an F32 table read by `embed`).
pub fn upload<B: Backend>(be: &B, rows: usize, cols: usize, data: &[f32]) -> B::Buf {
    let table = be
        .prepare_weight(&Weight::from_f32(rows, cols, data))
        .expect("table");
    let mut out = be.zeros(rows * cols).expect("buffer");
    let ids: Vec<u32> = (0..rows as u32).collect();
    be.embed(&table, &ids, &mut out).expect("embed");
    out
}

/// ‖got − want‖ / ‖want‖ in f64.
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let (mut d, mut n) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        assert!(g.is_finite(), "non-finite output {g}");
        d += (*g as f64 - *w as f64).powi(2);
        n += (*w as f64).powi(2);
    }
    (d / n.max(1e-30)).sqrt()
}

pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = rel_err(got, want);
    eprintln!("{what}: relative error {e:.2e} (tolerance {tol:.0e})");
    assert!(e <= tol, "{what}: relative error {e:.3e} > {tol:.0e}");
}

/// Tolerance for results computed with activations of type `act`.
pub fn tol(act: Act, f32_tol: f64) -> f64 {
    match act {
        Act::F32 => f32_tol,
        Act::Bf16 => 1.5e-2,
    }
}
