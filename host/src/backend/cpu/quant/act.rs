//! Activations quantized once per matmul call into the 8-bit blocks the integer kernels read.
//!
//! Two layouts, both symmetric (`d = max|x| / 127`, values in -127..=127):
//! - `Q8`, for the 32-element weight formats: per token, `qs` padded to an even number of
//!   blocks (the 512-bit kernels read blocks in pairs; the pad block is zero), and per block its
//!   scale `d` and `d * sum(qs) / 8`, each repeated 8 times so a SIMD lane group loads them as is.
//! - `Q8K`, for the 256-element K formats: per super-block `d`, `qs[256]` and the sums of each
//!   16 consecutive `qs` (for the min / offset terms).
//!
//! Buffers are kept between calls; nothing is allocated once they are large enough.

use super::super::pool::ThreadPool;
use super::Isa;

/// The activation layout a kernel consumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum ActKind {
    /// Plain f32 (float weights and the dequantize-then-dot fallback).
    #[default]
    F32,
    Q8,
    Q8K,
}

/// Elements per Q8 block and per Q8K super-block.
pub(crate) const Q8_BLOCK: usize = 32;
pub(crate) const Q8K_BLOCK: usize = 256;
/// Lanes each Q8 block scale is repeated over.
pub(crate) const LANES: usize = 8;

/// Reusable storage for quantized activations.
#[derive(Default)]
pub(crate) struct Acts {
    kind: ActKind,
    qs: Vec<i8>,
    scale: Vec<f32>,
    sum: Vec<f32>,
    bsums: Vec<i16>,
    qs_stride: usize,
    f_stride: usize,
    bsums_stride: usize,
}

/// What a tile kernel reads for token `t`:
/// - F32: `x[t * cols..]`.
/// - Q8: `qs[t * qs_stride + 32 b..]`, `scale` / `sum` at `t * f_stride + 8 b` (8 copies each).
/// - Q8K: `qs[t * qs_stride + 256 s..]`, `scale[t * f_stride + s]`,
///   `bsums[t * bsums_stride + 16 s..]`.
#[derive(Clone, Copy)]
pub(crate) struct ActView<'a> {
    pub x: &'a [f32],
    pub cols: usize,
    pub n_tokens: usize,
    pub qs: &'a [i8],
    pub qs_stride: usize,
    pub scale: &'a [f32],
    pub sum: &'a [f32],
    pub f_stride: usize,
    pub bsums: &'a [i16],
    pub bsums_stride: usize,
}

/// A raw pointer that tasks writing disjoint parts of one buffer may share.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr<T>(pub *mut T);
// SAFETY: users only write disjoint index ranges from different threads, and the buffer
// outlives the `parallel_for` call that shares the pointer.
unsafe impl<T: Send> Sync for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// The pointer. (A method, so closures capture the whole `Sync` wrapper, not the field.)
    #[inline]
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// Quantizing more elements than this is split across the pool.
const PARALLEL_QUANT_ELEMS: usize = 32 * 1024;

impl Acts {
    /// Quantizes `n_tokens` rows of `cols` activations from `x` into the `kind` layout.
    /// `isa` picks the quantization code (levels above `Scalar` use AVX2); all produce the same
    /// bytes.
    pub(crate) fn quantize(
        &mut self,
        pool: &ThreadPool,
        isa: Isa,
        kind: ActKind,
        x: &[f32],
        n_tokens: usize,
        cols: usize,
    ) {
        self.kind = kind;
        let (qs_stride, f_stride, bsums_stride) = match kind {
            ActKind::F32 => return,
            ActKind::Q8 => {
                let blocks = cols.div_ceil(2 * Q8_BLOCK) * 2;
                (blocks * Q8_BLOCK, blocks * LANES, 0)
            }
            ActKind::Q8K => {
                let sbs = cols / Q8K_BLOCK;
                (sbs * Q8K_BLOCK, sbs, sbs * 16)
            }
        };
        (self.qs_stride, self.f_stride, self.bsums_stride) = (qs_stride, f_stride, bsums_stride);
        grow(&mut self.qs, n_tokens * qs_stride);
        grow(&mut self.scale, n_tokens * f_stride);
        grow(&mut self.bsums, n_tokens * bsums_stride);
        if kind == ActKind::Q8 {
            grow(&mut self.sum, n_tokens * f_stride);
        }
        let qs = SyncPtr(self.qs.as_mut_ptr());
        let scale = SyncPtr(self.scale.as_mut_ptr());
        let sum = SyncPtr(self.sum.as_mut_ptr());
        let bsums = SyncPtr(self.bsums.as_mut_ptr());
        let simd = isa != Isa::Scalar;
        let one = |t: usize| {
            let xt = &x[t * cols..(t + 1) * cols];
            // SAFETY: token t owns rows t of each buffer, which `grow` sized above; tasks
            // handle distinct tokens, and the buffers outlive this call.
            unsafe {
                let q = std::slice::from_raw_parts_mut(qs.get().add(t * qs_stride), qs_stride);
                let s = std::slice::from_raw_parts_mut(scale.get().add(t * f_stride), f_stride);
                match kind {
                    ActKind::Q8 => {
                        let m =
                            std::slice::from_raw_parts_mut(sum.get().add(t * f_stride), f_stride);
                        quantize_q8(xt, q, s, m, simd);
                    }
                    _ => {
                        let b = std::slice::from_raw_parts_mut(
                            bsums.get().add(t * bsums_stride),
                            bsums_stride,
                        );
                        quantize_q8k(xt, q, s, b, simd);
                    }
                }
            }
        };
        if n_tokens > 1 && n_tokens * cols >= PARALLEL_QUANT_ELEMS {
            pool.parallel_for(n_tokens, &one);
        } else {
            (0..n_tokens).for_each(one);
        }
    }

    /// The layout last produced by [`Acts::quantize`] (`x` is used by the F32 kind).
    pub(crate) fn view<'a>(&'a self, x: &'a [f32], n_tokens: usize, cols: usize) -> ActView<'a> {
        let q = self.kind != ActKind::F32;
        ActView {
            x,
            cols,
            n_tokens,
            qs: if q {
                &self.qs[..n_tokens * self.qs_stride]
            } else {
                &[]
            },
            qs_stride: self.qs_stride,
            scale: if q {
                &self.scale[..n_tokens * self.f_stride]
            } else {
                &[]
            },
            sum: if self.kind == ActKind::Q8 {
                &self.sum[..n_tokens * self.f_stride]
            } else {
                &[]
            },
            f_stride: self.f_stride,
            bsums: if self.kind == ActKind::Q8K {
                &self.bsums[..n_tokens * self.bsums_stride]
            } else {
                &[]
            },
            bsums_stride: self.bsums_stride,
        }
    }
}

fn grow<T: Default + Clone>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

/// Symmetric 8-bit quantization of `x` (a multiple of 32 values) with one scale: returns `d`
/// and fills `q`, rounding halves to even.
#[inline]
fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    // Adding and removing 1.5 * 2^23 rounds to nearest even for |v| <= 127 without a libm call.
    const MAGIC: f32 = 12_582_912.0;
    for (o, v) in q.iter_mut().zip(x) {
        *o = ((v * id + MAGIC) - MAGIC) as i8;
    }
    d
}

/// One token into the Q8 layout (see the module docs); `x.len()` is a multiple of 32. `simd`
/// uses the AVX2 code (only valid where AVX2 is available); the bytes are the same.
pub(crate) fn quantize_q8(
    x: &[f32],
    qs: &mut [i8],
    scale8: &mut [f32],
    sum8: &mut [f32],
    simd: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is set only for ISA levels that include AVX2 (see `Acts::quantize`).
        return unsafe { super::act_avx2::quantize_q8(x, qs, scale8, sum8) };
    }
    let _ = simd;
    let nb = x.len() / Q8_BLOCK;
    for b in 0..qs.len() / Q8_BLOCK {
        let q = &mut qs[b * Q8_BLOCK..(b + 1) * Q8_BLOCK];
        let (d, s) = if b < nb {
            let d = quantize_block(&x[b * Q8_BLOCK..(b + 1) * Q8_BLOCK], q);
            let isum: i32 = q.iter().map(|&v| v as i32).sum();
            (d, d * isum as f32 / LANES as f32)
        } else {
            q.fill(0);
            (0.0, 0.0)
        };
        scale8[b * LANES..(b + 1) * LANES].fill(d);
        sum8[b * LANES..(b + 1) * LANES].fill(s);
    }
}

/// One token into the Q8K layout; `x.len()` is a multiple of 256. `simd` as in
/// [`quantize_q8`].
pub(crate) fn quantize_q8k(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16], simd: bool) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: as in `quantize_q8`.
        return unsafe { super::act_avx2::quantize_q8k(x, qs, d, bsums) };
    }
    let _ = simd;
    for (s, ds) in d.iter_mut().enumerate() {
        let q = &mut qs[s * Q8K_BLOCK..(s + 1) * Q8K_BLOCK];
        *ds = quantize_block(&x[s * Q8K_BLOCK..(s + 1) * Q8K_BLOCK], q);
        for (g, bs) in bsums[s * 16..(s + 1) * 16].iter_mut().enumerate() {
            *bs = q[g * 16..(g + 1) * 16].iter().map(|&v| v as i16).sum();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_roundtrip_error_is_within_half_a_step() {
        let x: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut qs = vec![0i8; 128];
        let mut sc = vec![0f32; 32];
        let mut sm = vec![0f32; 32];
        quantize_q8(&x, &mut qs, &mut sc, &mut sm, false);
        for b in 0..3 {
            let d = sc[b * 8];
            assert!(sc[b * 8..b * 8 + 8].iter().all(|&v| v == d));
            let isum: i32 = qs[b * 32..b * 32 + 32].iter().map(|&v| v as i32).sum();
            assert_eq!(sm[b * 8] * 8.0, d * isum as f32);
            for i in 0..32 {
                let e = (x[b * 32 + i] - d * qs[b * 32 + i] as f32).abs();
                assert!(e <= d * 0.5001, "block {b} elem {i}: error {e} step {d}");
            }
        }
        // The pad block (4th) is zero.
        assert!(qs[96..].iter().all(|&v| v == 0));
        assert_eq!(sc[24], 0.0);
        assert_eq!(sm[31], 0.0);
    }

    #[test]
    fn q8k_block_sums_match_values() {
        let x: Vec<f32> = (0..512).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut qs = vec![0i8; 512];
        let mut d = vec![0f32; 2];
        let mut bs = vec![0i16; 32];
        quantize_q8k(&x, &mut qs, &mut d, &mut bs, false);
        for g in 0..32 {
            let s: i16 = qs[g * 16..g * 16 + 16].iter().map(|&v| v as i16).sum();
            assert_eq!(bs[g], s);
        }
        assert!(qs.iter().any(|&v| v == 127 || v == -127));
    }

    #[test]
    fn zero_input_gives_zero_scale() {
        let x = vec![0f32; 32];
        let (mut qs, mut sc, mut sm) = (vec![1i8; 64], vec![1f32; 16], vec![1f32; 16]);
        quantize_q8(&x, &mut qs, &mut sc, &mut sm, false);
        assert!(qs.iter().all(|&v| v == 0) && sc.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn simd_quantization_gives_the_same_bytes() {
        if !Isa::Avx2.is_available() {
            return;
        }
        // Includes exact halves (ties) and values at the block maximum.
        let mut x: Vec<f32> = (0..512)
            .map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 37.0)
            .collect();
        // First block: amax 127 makes the scale exactly 1, so these are exact ties.
        x[..6].copy_from_slice(&[127.0, 2.5, -3.5, 0.5, 1.5, -0.5]);
        x[6..32].fill(0.25);
        let mut out = Vec::new();
        for simd in [false, true] {
            let mut qs = vec![0i8; 512];
            let mut d = vec![0f32; 2];
            let mut bs = vec![0i16; 32];
            quantize_q8k(&x, &mut qs, &mut d, &mut bs, simd);
            let (mut q8, mut sc, mut sm) = (vec![0i8; 512], vec![0f32; 128], vec![0f32; 128]);
            quantize_q8(&x, &mut q8, &mut sc, &mut sm, simd);
            out.push((qs, d, bs, q8, sc, sm));
        }
        assert!(out[0] == out[1]);
        assert_eq!(out[0].3[..6], [127, 2, -4, 0, 2, 0], "ties round to even");
    }
}
