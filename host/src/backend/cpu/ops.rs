//! Element-wise and row-wise kernels: dot/axpy, RMSNorm, RoPE, SwiGLU, softmax.
//!
//! The hot loops are written once as plain Rust with independent accumulators and compiled
//! twice: for the baseline target and with AVX2+FMA enabled, picked at run time.

use crate::model::hparams::{RopeSpec, RopeStyle};

#[inline(always)]
pub(super) fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 16;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; L];
    let chunks = n / L;
    for c in 0..chunks {
        let (x, y) = (&a[c * L..c * L + L], &b[c * L..c * L + L]);
        for i in 0..L {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut s = 0.0;
    for i in chunks * L..n {
        s += a[i] * b[i];
    }
    acc.iter().sum::<f32>() + s
}

#[inline(always)]
pub(super) fn axpy_body(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y = x.mul_add(a, *y);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_body(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(y: &mut [f32], a: f32, x: &[f32]) {
    axpy_body(y, a, x)
}

#[cfg(target_arch = "x86_64")]
pub(super) fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// Dot product of the common prefix of `a` and `b`.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { dot_avx2(a, b) };
    }
    dot_body(a, b)
}

/// `y += a * x` over the common prefix.
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { axpy_avx2(y, a, x) };
    }
    axpy_body(y, a, x)
}

/// RMSNorm of each row of `x` (rows of `w.len()`), written to `out`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ms = dot(xr, xr) / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * r * g;
        }
    }
}

/// `x += y` element-wise.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    axpy(x, 1.0, y)
}

/// SwiGLU in place: `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Cos/sin tables for a set of positions: `[positions.len(), dims / 2]` each.
#[derive(Debug, Clone)]
pub struct RopeTable {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub spec: RopeSpec,
}

impl RopeTable {
    pub fn new(spec: RopeSpec, positions: &[u32]) -> RopeTable {
        let half = spec.dims / 2;
        let inv: Vec<f64> = (0..half)
            .map(|i| 1.0 / (spec.theta as f64).powf(2.0 * i as f64 / spec.dims as f64))
            .collect();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            let p = p as f64 / spec.scale as f64;
            for &f in &inv {
                let (s, c) = (p * f).sin_cos();
                cos.push(c as f32);
                sin.push(s as f32);
            }
        }
        RopeTable {
            half,
            cos,
            sin,
            spec,
        }
    }

    /// Rotates every head of every token in `x` (`[tokens, n_heads, head_dim]`).
    pub fn apply(&self, x: &mut [f32], n_heads: usize, head_dim: usize) {
        let half = self.half;
        let n_tok = x.len() / (n_heads * head_dim);
        for t in 0..n_tok {
            let (c, s) = (
                &self.cos[t * half..t * half + half],
                &self.sin[t * half..t * half + half],
            );
            for h in 0..n_heads {
                let base = (t * n_heads + h) * head_dim;
                let v = &mut x[base..base + head_dim];
                match self.spec.style {
                    RopeStyle::Interleaved => {
                        for i in 0..half {
                            let (a, b) = (v[2 * i], v[2 * i + 1]);
                            v[2 * i] = a * c[i] - b * s[i];
                            v[2 * i + 1] = a * s[i] + b * c[i];
                        }
                    }
                    RopeStyle::Half => {
                        for i in 0..half {
                            let (a, b) = (v[i], v[i + half]);
                            v[i] = a * c[i] - b * s[i];
                            v[i + half] = a * s[i] + b * c[i];
                        }
                    }
                }
            }
        }
    }
}

/// `e^x` for the finite `x <= 0` of a softmax (after subtracting the maximum): Cody-Waite
/// reduction to `2^n e^r`, `|r| <= ln 2 / 2`, and a degree-6 Taylor polynomial (relative error
/// about 2e-7); `0` below -87. Plain arithmetic, so a loop over it vectorizes.
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and removing 1.5 * 2^23 rounds to nearest.
    const MAGIC: f32 = 12_582_912.0;
    let below = x < -87.0;
    let x = if below { -87.0 } else { x };
    let n = (x * LOG2E + MAGIC) - MAGIC;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0 / 720.0;
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p * r + c;
    }
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if below {
        0.0
    } else {
        p * scale
    }
}

#[inline(always)]
pub(super) fn softmax_body(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        x.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    x.iter_mut().for_each(|v| *v = exp_neg(*v - max));
    // Eight partial sums in a fixed order: vectorizes and stays deterministic.
    let mut part = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (p, v) in part.iter_mut().zip(c) {
            *p += v;
        }
    }
    let inv = 1.0 / (part.iter().sum::<f32>() + tail);
    x.iter_mut().for_each(|v| *v *= inv);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(x: &mut [f32]) {
    softmax_body(x)
}

/// In-place softmax; returns nothing and leaves an all-`-inf` row as all zeros.
pub fn softmax(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { softmax_avx2(x) };
    }
    softmax_body(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_close_to_libm_and_softmax_sums_to_one() {
        for i in 0..2000 {
            let x = -(i as f32) * 0.05;
            let (a, b) = (exp_neg(x), x.exp());
            let want = if x < -87.0 { 0.0 } else { b };
            assert!((a - want).abs() <= 4e-7 * b, "exp({x}): {a} vs {b}");
        }
        assert_eq!(exp_neg(-100.0), 0.0);
        assert_eq!(exp_neg(0.0), 1.0);
        for n in [1usize, 7, 8, 19, 300] {
            let mut x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7).sin() * 20.0).collect();
            let want: Vec<f64> = {
                let m = x.iter().cloned().fold(f32::MIN, f32::max) as f64;
                let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
                let z: f64 = e.iter().sum();
                e.iter().map(|v| v / z).collect()
            };
            softmax(&mut x);
            for (a, b) in x.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-6, "n {n}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn dot_matches_naive_on_odd_lengths() {
        for n in [0usize, 1, 7, 16, 33, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let naive: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - naive).abs() < 1e-4, "n={n}");
            assert!((dot_body(&a, &b) as f64 - naive).abs() < 1e-4, "n={n}");
        }
    }

    #[test]
    fn rms_norm_unit_rows() {
        let x = [3.0, 4.0, 0.0, 0.0];
        let mut o = [0.0; 4];
        rms_norm(&x, &[1.0, 1.0], 1e-12, &mut o);
        let r = (12.5f32).sqrt();
        assert!((o[0] - 3.0 / r).abs() < 1e-6 && (o[1] - 4.0 / r).abs() < 1e-6);
        assert_eq!(&o[2..], &[0.0, 0.0], "a zero row stays zero");
    }

    #[test]
    fn rope_styles_agree_up_to_permutation_and_keep_norm() {
        let spec = |style| RopeSpec {
            theta: 10000.0,
            dims: 8,
            style,
            scale: 1.0,
        };
        let x: Vec<f32> = (0..8).map(|i| i as f32 + 1.0).collect();
        // interleaved pairs (0,1),(2,3).. equal half-style pairs (0,4),(1,5).. after permuting.
        let perm = [0, 4, 1, 5, 2, 6, 3, 7];
        let xi: Vec<f32> = perm.iter().map(|&p| x[p]).collect();
        let mut a = xi.clone();
        RopeTable::new(spec(RopeStyle::Interleaved), &[5]).apply(&mut a, 1, 8);
        let mut b = x.clone();
        RopeTable::new(spec(RopeStyle::Half), &[5]).apply(&mut b, 1, 8);
        for (i, &p) in perm.iter().enumerate() {
            assert!((a[i] - b[p]).abs() < 1e-5);
        }
        let n0: f32 = x.iter().map(|v| v * v).sum();
        let n1: f32 = b.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-3);
    }

    #[test]
    fn rope_at_position_zero_is_identity() {
        let spec = RopeSpec {
            theta: 1e5,
            dims: 4,
            style: RopeStyle::Interleaved,
            scale: 1.0,
        };
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        RopeTable::new(spec, &[0]).apply(&mut x, 1, 6);
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[1] > x[0]);
    }
}
