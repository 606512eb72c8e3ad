//! AVX2 activation quantization: whole tokens into the `Q8` and `Q8K` layouts of `act`,
//! byte-for-byte identical to the portable code (same max, same round-half-to-even, the same
//! f32 operations in the same order).

use std::arch::x86_64::*;

use super::act::{LANES, Q8K_BLOCK, Q8_BLOCK};

/// `max |x|` over `n` values at `p` (a multiple of 8).
#[inline(always)]
unsafe fn abs_max(p: *const f32, n: usize) -> f32 {
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let mut m = _mm256_setzero_ps();
    for i in (0..n).step_by(8) {
        m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(p.add(i)), abs));
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)))
}

/// Sum of the 8 i32 lanes.
#[inline(always)]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)))
}

/// Quantizes 32 values at `p` with inverse scale `id` into `o`; returns the 4 i32 vectors'
/// values (for block sums) as two sums of 16: elements 0..16 and 16..32.
#[inline(always)]
unsafe fn quantize32(p: *const f32, id: __m256, o: *mut i8) -> (__m256i, __m256i) {
    let v = |k: usize| _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p.add(8 * k)), id));
    let (a, b, c, d) = (v(0), v(1), v(2), v(3));
    let lo = _mm256_packs_epi32(a, b);
    let hi = _mm256_packs_epi32(c, d);
    // `packs` interleaves 128-bit lanes; put the dwords back in element order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order);
    _mm256_storeu_si256(o.cast(), bytes);
    (_mm256_add_epi32(a, b), _mm256_add_epi32(c, d))
}

/// The scale and inverse scale for a block whose largest magnitude is `amax`.
#[inline(always)]
fn scales(amax: f32) -> (f32, f32) {
    (amax / 127.0, if amax > 0.0 { 127.0 / amax } else { 0.0 })
}

/// See `act::quantize_q8`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn quantize_q8(x: &[f32], qs: &mut [i8], scale8: &mut [f32], sum8: &mut [f32]) {
    let nb = x.len() / Q8_BLOCK;
    let total = qs.len() / Q8_BLOCK;
    assert!(scale8.len() >= total * LANES && sum8.len() >= total * LANES);
    for b in 0..total {
        let (d, s) = if b < nb {
            let p = x.as_ptr().add(b * Q8_BLOCK);
            let (d, id) = scales(abs_max(p, Q8_BLOCK));
            let (s0, s1) = quantize32(p, _mm256_set1_ps(id), qs.as_mut_ptr().add(b * Q8_BLOCK));
            let isum = hsum_i32(_mm256_add_epi32(s0, s1));
            (d, d * isum as f32 / LANES as f32)
        } else {
            qs[b * Q8_BLOCK..(b + 1) * Q8_BLOCK].fill(0);
            (0.0, 0.0)
        };
        _mm256_storeu_ps(scale8.as_mut_ptr().add(b * LANES), _mm256_set1_ps(d));
        _mm256_storeu_ps(sum8.as_mut_ptr().add(b * LANES), _mm256_set1_ps(s));
    }
}

/// See `act::quantize_q8k`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn quantize_q8k(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16]) {
    let nsb = x.len() / Q8K_BLOCK;
    assert!(qs.len() >= nsb * Q8K_BLOCK && d.len() >= nsb && bsums.len() >= nsb * 16);
    for s in 0..nsb {
        let p = x.as_ptr().add(s * Q8K_BLOCK);
        let (ds, id) = scales(abs_max(p, Q8K_BLOCK));
        d[s] = ds;
        let id = _mm256_set1_ps(id);
        for c in 0..Q8K_BLOCK / 32 {
            let o = qs.as_mut_ptr().add(s * Q8K_BLOCK + 32 * c);
            let (s0, s1) = quantize32(p.add(32 * c), id, o);
            bsums[s * 16 + 2 * c] = hsum_i32(s0) as i16;
            bsums[s * 16 + 2 * c + 1] = hsum_i32(s1) as i16;
        }
    }
}
