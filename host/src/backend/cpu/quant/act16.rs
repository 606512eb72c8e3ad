//! 16-bit activations for the 32-element formats with a 16-bit kernel (Q4_0, Q4_1, Q8_0),
//! quantized once per matmul call into the interleaved pair layout the `a16*` kernels read.
//!
//! Per token, blocks go in pairs `(a, b) = (2p, 2p + 1)`; an odd last block pairs with a zero
//! block. A pair is 64 i16 (128 bytes): 32 "low" words (elements 0..16 of both blocks), then
//! 32 "high" words (elements 16..32). Within each half the words go in groups of four, two
//! consecutive elements of block a, then the same two of block b:
//! `[a0 a1 b0 b1 a2 a3 b2 b3 .. a14 a15 b14 b15]`. A pairwise i16 dot (`vpmaddwd`,
//! `vpdpwssd`) then leaves block a's partial sums in the even i32 lanes and block b's in the odd
//! ones at any vector width, so one f32 vector `[d_a, d_b, d_a, d_b, ..]` scales both blocks.
//! Per pair also `d = [d_a, d_b]` (`x ≈ d * q`, `d = max|x| / 32767`, round half to even)
//! and `s = [d_a * sum(q_a), d_b * sum(q_b)]` (for the weights' offset terms).
//!
//! With `octets`, the first `8 * (blocks / 8)` blocks go in octets of 8 blocks instead (256
//! words, the 512-bit Q4 kernels' form: one float scaling per 256 elements instead of 64).
//! An octet is 8 registers of 32 words; register k holds elements `2u, 2u + 1` of every block
//! for `u = 2k, 2k + 1`, as `[b0 b1 .. b7]` for `u = 2k` then the same for `u = 2k + 1`, so
//! lane l of a pairwise dot belongs to block `l % 8`; its `d`, `s` are the 8 blocks' values.
//! The pairs of the remaining blocks follow. `d` and `s` are always in block order.
//!
//! Sixteen bits per block keep the products within about 1e-5 of f32 (the 8-bit form flips
//! near-tied greedy choices), at one integer pass: the same arithmetic as two 8-bit passes.

use super::super::pool::ThreadPool;
use super::act::SyncPtr;
use super::Isa;

/// Elements per block, i16 words per block pair.
pub(crate) const BLOCK: usize = 32;
pub(crate) const PAIR_WORDS: usize = 64;

/// Reusable storage for 16-bit activations.
#[derive(Default)]
pub(crate) struct Acts16 {
    q: Vec<i16>,
    d: Vec<f32>,
    s: Vec<f32>,
}

/// Words per octet of blocks.
pub(crate) const OCTET_WORDS: usize = 256;

/// What a kernel reads for token `t`: words `q[t * q_stride..]` (octets, then pairs), scales
/// and sums `d[t * f_stride..]`, `s[t * f_stride..]` (block order).
#[derive(Clone, Copy)]
pub(crate) struct Act16View<'a> {
    pub q: &'a [i16],
    pub d: &'a [f32],
    pub s: &'a [f32],
    pub octets: usize,
    pub pairs: usize,
    pub n_tokens: usize,
}

impl Act16View<'_> {
    pub(crate) fn q_stride(&self) -> usize {
        self.octets * OCTET_WORDS + self.pairs * PAIR_WORDS
    }

    pub(crate) fn f_stride(&self) -> usize {
        self.octets * 8 + self.pairs * 2
    }
}

/// Quantizing more elements than this is split across the pool.
const PARALLEL_QUANT_ELEMS: usize = 32 * 1024;

impl Acts16 {
    /// Quantizes `n_tokens` rows of `cols` activations (a multiple of 32) from `x`, with
    /// octets if `octets`; `isa` above `Scalar` uses AVX2 (the same words either way).
    pub(crate) fn quantize<'a>(
        &'a mut self,
        pool: &ThreadPool,
        isa: Isa,
        x: &[f32],
        n_tokens: usize,
        cols: usize,
        octets: bool,
    ) -> Act16View<'a> {
        assert!(cols.is_multiple_of(BLOCK) && x.len() >= n_tokens * cols);
        let nb = cols / BLOCK;
        let no = if octets { nb / 8 } else { 0 };
        let pairs = (nb - 8 * no).div_ceil(2);
        let (qn, fn_) = (no * OCTET_WORDS + pairs * PAIR_WORDS, no * 8 + pairs * 2);
        grow(&mut self.q, n_tokens * qn);
        grow(&mut self.d, n_tokens * fn_);
        grow(&mut self.s, n_tokens * fn_);
        let (q, d, s) = (
            SyncPtr(self.q.as_mut_ptr()),
            SyncPtr(self.d.as_mut_ptr()),
            SyncPtr(self.s.as_mut_ptr()),
        );
        let simd = isa != Isa::Scalar;
        let one = |t: usize| {
            // SAFETY: token t owns rows t of each buffer, sized by `grow` above; tasks handle
            // distinct tokens; the buffers outlive this call.
            let (qt, dt, st) = unsafe {
                (
                    std::slice::from_raw_parts_mut(q.get().add(t * qn), qn),
                    std::slice::from_raw_parts_mut(d.get().add(t * fn_), fn_),
                    std::slice::from_raw_parts_mut(s.get().add(t * fn_), fn_),
                )
            };
            quantize_token(&x[t * cols..(t + 1) * cols], qt, dt, st, simd, no);
        };
        if n_tokens > 1 && n_tokens * cols >= PARALLEL_QUANT_ELEMS {
            pool.parallel_for(n_tokens, &one);
        } else {
            (0..n_tokens).for_each(one);
        }
        Act16View {
            q: &self.q[..n_tokens * qn],
            d: &self.d[..n_tokens * fn_],
            s: &self.s[..n_tokens * fn_],
            octets: no,
            pairs,
            n_tokens,
        }
    }
}

fn grow<T: Default + Clone>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

/// Index of element `e` (0..32) of block `h` (0: a, 1: b) within its pair's 64 words.
#[inline]
pub(crate) fn word(e: usize, h: usize) -> usize {
    (e / 16) * 32 + ((e % 16) / 2) * 4 + h * 2 + (e % 2)
}

/// Index of element `e` (0..32) of block `h` (0..8) within its octet's 256 words.
#[inline]
pub(crate) fn word8(e: usize, h: usize) -> usize {
    let u = e / 2;
    2 * ((u / 2) * 16 + (u % 2) * 8 + h) + e % 2
}

/// The scale and inverse scale of a block whose largest magnitude is `amax`.
#[inline]
fn scales(amax: f32) -> (f32, f32) {
    (
        amax / 32767.0,
        if amax > 0.0 { 32767.0 / amax } else { 0.0 },
    )
}

/// One block's 32 values (element order), scale and value sum; portable.
fn quantize_block(xb: &[f32], v: &mut [i16; 32]) -> (f32, i32) {
    // Adding and removing 1.5 * 2^23 rounds to nearest even for |v| <= 2^22.
    const MAGIC: f32 = 12_582_912.0;
    let (d, id) = scales(xb.iter().fold(0f32, |m, v| m.max(v.abs())));
    let mut sum = 0i32;
    for (o, &x) in v.iter_mut().zip(xb) {
        *o = ((x * id + MAGIC) - MAGIC) as i16;
        sum += *o as i32;
    }
    (d, sum)
}

/// One token into the layout with `octets` octets; `x.len()` is a multiple of 32, `q`, `d`
/// and `s` hold the token's words and values. `simd` uses AVX2 (valid only where AVX2 is
/// available); the words are the same.
pub(crate) fn quantize_token(
    x: &[f32],
    q: &mut [i16],
    d: &mut [f32],
    s: &mut [f32],
    simd: bool,
    octets: usize,
) {
    let nb = x.len() / BLOCK;
    assert!(8 * octets <= nb);
    let pairs = (nb - 8 * octets).div_ceil(2);
    let nf = 8 * octets + 2 * pairs;
    assert!(q.len() >= octets * OCTET_WORDS + pairs * PAIR_WORDS && d.len() >= nf && s.len() >= nf);
    let mut v = [0i16; 32];
    for b in 0..nf {
        let (db, sum) = if b >= nb {
            v = [0; 32];
            (0.0, 0)
        } else {
            let xb = &x[b * BLOCK..(b + 1) * BLOCK];
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: `simd` is set only for ISA levels that include AVX2.
                unsafe { avx2::quantize_block(xb, &mut v) }
            } else {
                quantize_block(xb, &mut v)
            }
            #[cfg(not(target_arch = "x86_64"))]
            quantize_block(xb, &mut v)
        };
        (d[b], s[b]) = (db, db * sum as f32);
        if b < 8 * octets {
            let base = (b / 8) * OCTET_WORDS;
            for (e, &val) in v.iter().enumerate() {
                q[base + word8(e, b % 8)] = val;
            }
        } else {
            let r = b - 8 * octets;
            let base = octets * OCTET_WORDS + (r / 2) * PAIR_WORDS;
            for (e, &val) in v.iter().enumerate() {
                q[base + word(e, r % 2)] = val;
            }
        }
    }
    let _ = simd;
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{scales, BLOCK};

    /// `max |x|` over the 32 values at `p`.
    #[inline(always)]
    unsafe fn abs_max(p: *const f32) -> f32 {
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let mut m = _mm256_setzero_ps();
        for i in (0..BLOCK).step_by(8) {
            m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(p.add(i)), abs));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)))
    }

    #[inline(always)]
    unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)))
    }

    /// See `act16::quantize_block` (32 values at `x`).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_block(x: &[f32], v: &mut [i16; 32]) -> (f32, i32) {
        assert!(x.len() >= BLOCK);
        let p = x.as_ptr();
        let (d, id) = scales(abs_max(p));
        let id = _mm256_set1_ps(id);
        // `cvtps` rounds to nearest even, as the portable code does.
        let q = |k: usize| _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p.add(8 * k)), id));
        let (a, b, c, e) = (q(0), q(1), q(2), q(3));
        let sum = _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, e));
        // `packs` interleaves 128-bit lanes; restore element order.
        let lo = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(a, b));
        let hi = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(c, e));
        _mm256_storeu_si256(v.as_mut_ptr().cast(), lo);
        _mm256_storeu_si256(v.as_mut_ptr().add(16).cast(), hi);
        (d, hsum_i32(sum))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_places_every_element_once() {
        let mut seen = [false; PAIR_WORDS];
        for h in 0..2 {
            for e in 0..BLOCK {
                assert!(!std::mem::replace(&mut seen[word(e, h)], true));
            }
        }
        assert_eq!(word(1, 0), 1);
        assert_eq!(word(0, 1), 2);
        assert_eq!(word(2, 0), 4);
        assert_eq!(word(16, 0), 32);
        let mut seen = [false; OCTET_WORDS];
        for h in 0..8 {
            for e in 0..BLOCK {
                assert!(!std::mem::replace(&mut seen[word8(e, h)], true));
            }
        }
        // Register 0: elements 0, 1 of blocks 0..8, then elements 2, 3.
        assert_eq!(
            [word8(0, 0), word8(1, 0), word8(0, 1), word8(2, 0)],
            [0, 1, 2, 16]
        );
        assert_eq!(word8(4, 0), 32);
        assert_eq!(word8(16, 7), 4 * 32 + 14);
    }

    #[test]
    fn roundtrip_error_is_within_half_a_step_and_sums_match() {
        for cols in [32usize, 96, 128] {
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let pairs = cols.div_ceil(64);
            let mut q = vec![7i16; pairs * 64];
            let (mut d, mut s) = (vec![1f32; 2 * pairs], vec![1f32; 2 * pairs]);
            quantize_token(&x, &mut q, &mut d, &mut s, false, 0);
            for b in 0..2 * pairs {
                let (p, h) = (b / 2, b % 2);
                let vals: Vec<i16> = (0..32).map(|e| q[p * 64 + word(e, h)]).collect();
                if b * 32 >= cols {
                    assert!(vals.iter().all(|&v| v == 0) && d[b] == 0.0 && s[b] == 0.0);
                    continue;
                }
                assert!(vals.iter().any(|&v| v.abs() == 32767));
                let sum: i32 = vals.iter().map(|&v| v as i32).sum();
                assert_eq!(s[b], d[b] * sum as f32);
                for (e, &v) in vals.iter().enumerate() {
                    let err = (x[b * 32 + e] - d[b] * v as f32).abs();
                    assert!(err <= d[b] * 0.5001, "block {b} elem {e}: {err}");
                }
            }
        }
    }

    #[test]
    fn simd_quantization_gives_the_same_words() {
        if !Isa::Avx2.is_available() {
            return;
        }
        for (cols, octets) in [(32usize, 0), (64, 0), (96, 0), (576, 0), (576, 2), (512, 2)] {
            let mut x: Vec<f32> = (0..cols)
                .map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 37.0)
                .collect();
            // Ties: with max 32767 the scale is 1.
            x[..4].copy_from_slice(&[32767.0, 2.5, -3.5, 0.5]);
            let nb = cols / 32;
            let pairs = (nb - 8 * octets).div_ceil(2);
            let nf = 8 * octets + 2 * pairs;
            let mut out = Vec::new();
            for simd in [false, true] {
                let mut q = vec![0i16; octets * OCTET_WORDS + pairs * 64];
                let (mut d, mut s) = (vec![0f32; nf], vec![0f32; nf]);
                quantize_token(&x, &mut q, &mut d, &mut s, simd, octets);
                out.push((q, d, s));
            }
            assert!(out[0] == out[1], "cols {cols}");
            let q = &out[0].0;
            let w = |e: usize| if octets > 0 { word8(e, 0) } else { word(e, 0) };
            assert_eq!(
                [q[w(0)], q[w(1)], q[w(2)], q[w(3)]],
                [32767, 2, -4, 0],
                "ties to even"
            );
        }
    }

    #[test]
    fn octets_hold_the_same_values_as_pairs() {
        let x: Vec<f32> = (0..576).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let (mut qp, mut dp, mut sp) = (vec![0i16; 9 * 64], vec![0f32; 18], vec![0f32; 18]);
        quantize_token(&x, &mut qp, &mut dp, &mut sp, false, 0);
        let (mut qo, mut d8, mut s8) = (vec![0i16; 2 * 256 + 64], vec![0f32; 18], vec![0f32; 18]);
        quantize_token(&x, &mut qo, &mut d8, &mut s8, false, 2);
        assert_eq!((&dp, &sp), (&d8, &s8));
        for b in 0..18 {
            for e in 0..32 {
                let at = if b < 16 {
                    (b / 8) * 256 + word8(e, b % 8)
                } else {
                    512 + word(e, b % 2)
                };
                assert_eq!(
                    qo[at],
                    qp[(b / 2) * 64 + word(e, b % 2)],
                    "block {b} elem {e}"
                );
            }
        }
    }
}
