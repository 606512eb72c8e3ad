//! AVX-512 VNNI tile kernels for Q4_K and Q6_K against Q8K activations.
//!
//! A super-block is read as four 64-value registers in element order. `vpmaddubsw` multiplies
//! weights with activations into i16 pairs, and `vpdpwssd` applies the per-group scales while
//! summing into i32, so a whole super-block is one integer sum per (row, token) and a single
//! f32 multiply by `d_w * d_x`. Mins (Q4_K) and the -32 offset (Q6_K) use the activation's
//! 16-element sums.

use std::arch::x86_64::*;

use super::act::{ActView, Q8K_BLOCK};
use super::dequant_k::k4_scales_mins;

/// Lane `l` of `[v[2c] x16, v[2c + 1] x16]`: the i16 index vector picking group scales for
/// chunk `c` of a Q4_K super-block (64 values, two groups of 32).
#[inline(always)]
unsafe fn q4k_scale_index(c: i16) -> __m512i {
    let (a, b) = (2 * c, 2 * c + 1);
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_set1_epi16(a)),
        _mm256_set1_epi16(b),
    )
}

/// f16 at `p` as f32.
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    let h = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// Sums `acc` into `out` for every (row, token) of the tile.
#[inline(always)]
unsafe fn store<const R: usize, const T: usize>(acc: &[[__m512; T]; R], out: &mut [f32; 16]) {
    for (i, acc_i) in acc.iter().enumerate() {
        for (j, v) in acc_i.iter().enumerate() {
            out[i * 4 + j] = _mm512_reduce_add_ps(*v);
        }
    }
}

/// Q4_K (144-byte super-blocks: `d, dmin, scales[12], qs[128]`). See `kernel::TileFn`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q4_k<const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &ActView<'_>,
    t0: usize,
    out: &mut [f32; 16],
) {
    const BYTES: usize = 144;
    let nsb = row_bytes / BYTES;
    let wp = w.as_ptr();
    let low = _mm512_set1_epi8(0x0F);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for s in 0..nsb {
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let b = wp.add(i * row_bytes + s * BYTES);
            let (d, dmin) = (f16_at(b), f16_at(b.add(2)));
            let (sc, mn) = k4_scales_mins(std::slice::from_raw_parts(b.add(4), 12));
            let sc16 =
                _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(sc.as_ptr().cast())));
            let m8 = _mm_loadl_epi64(mn.as_ptr().cast());
            // [m0, m0, m1, m1, ..] to pair with the sixteen 16-element activation sums.
            let mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
            let mut q = [_mm512_setzero_si512(); 4];
            let mut scv = [_mm512_setzero_si512(); 4];
            for c in 0..4 {
                let raw = _mm256_loadu_si256(b.add(16 + 32 * c).cast());
                let both = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(raw),
                    _mm256_srli_epi16::<4>(raw),
                );
                q[c] = _mm512_and_si512(both, low);
                scv[c] = _mm512_permutexvar_epi16(q4k_scale_index(c as i16), sc16);
            }
            for (j, acc_ij) in acc_i.iter_mut().enumerate() {
                let t = t0 + j;
                let x = a.qs.as_ptr().add(t * a.qs_stride + s * Q8K_BLOCK);
                let mut p = _mm512_setzero_si512();
                for c in 0..4 {
                    let xv = _mm512_loadu_si512(x.add(64 * c).cast());
                    p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(q[c], xv), scv[c]);
                }
                let bs =
                    _mm256_loadu_si256(a.bsums.as_ptr().add(t * a.bsums_stride + 16 * s).cast());
                let msum = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins16));
                let dx = *a.scale.get_unchecked(t * a.f_stride + s);
                *acc_ij = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(d * dx), *acc_ij);
                *acc_ij = _mm512_fmadd_ps(
                    _mm512_zextps256_ps512(msum),
                    _mm512_set1_ps(-dmin * dx),
                    *acc_ij,
                );
            }
        }
    }
    store(&acc, out);
}

/// Q6_K (210-byte super-blocks: `ql[128], qh[64], scales: [i8; 16], d`). See `kernel::TileFn`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q6_k<const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &ActView<'_>,
    t0: usize,
    out: &mut [f32; 16],
) {
    const BYTES: usize = 210;
    let nsb = row_bytes / BYTES;
    let wp = w.as_ptr();
    let (low4, bits45, low2) = (
        _mm512_set1_epi8(0x0F),
        _mm512_set1_epi8(0x30),
        _mm512_set1_epi8(0x03),
    );
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for s in 0..nsb {
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let b = wp.add(i * row_bytes + s * BYTES);
            let d = f16_at(b.add(208));
            // Sixteen signed group scales as i16; chunk c (64 values) uses groups 4c..4c+4.
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192).cast()));
            let sc_wide = _mm512_castsi256_si512(sc16);
            let mut q = [_mm512_setzero_si512(); 4];
            let mut scv = [_mm512_setzero_si512(); 4];
            for h in 0..2 {
                let ql = _mm512_loadu_si512(b.add(64 * h).cast());
                let qh = _mm256_loadu_si256(b.add(128 + 32 * h).cast());
                let qh2 =
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qh), _mm256_srli_epi16::<2>(qh));
                let hi_a = _mm512_slli_epi16::<4>(_mm512_and_si512(qh2, low2));
                q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), hi_a);
                let lo_b = _mm512_and_si512(_mm512_srli_epi16::<4>(ql), low4);
                q[2 * h + 1] = _mm512_or_si512(lo_b, _mm512_and_si512(qh2, bits45));
            }
            for (c, v) in scv.iter_mut().enumerate() {
                let g = 4 * c as i16;
                let idx = _mm512_setr_epi64(
                    0x0001_0001_0001_0001 * g as i64,
                    0x0001_0001_0001_0001 * g as i64,
                    0x0001_0001_0001_0001 * (g + 1) as i64,
                    0x0001_0001_0001_0001 * (g + 1) as i64,
                    0x0001_0001_0001_0001 * (g + 2) as i64,
                    0x0001_0001_0001_0001 * (g + 2) as i64,
                    0x0001_0001_0001_0001 * (g + 3) as i64,
                    0x0001_0001_0001_0001 * (g + 3) as i64,
                );
                *v = _mm512_permutexvar_epi16(idx, sc_wide);
            }
            for (j, acc_ij) in acc_i.iter_mut().enumerate() {
                let t = t0 + j;
                let x = a.qs.as_ptr().add(t * a.qs_stride + s * Q8K_BLOCK);
                let mut p = _mm512_setzero_si512();
                for c in 0..4 {
                    let xv = _mm512_loadu_si512(x.add(64 * c).cast());
                    p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(q[c], xv), scv[c]);
                }
                // The stored values are q + 32: subtract 32 * sum(scale * group sum of x).
                let bs =
                    _mm256_loadu_si256(a.bsums.as_ptr().add(t * a.bsums_stride + 16 * s).cast());
                let off = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bs, sc16));
                p = _mm512_sub_epi32(p, _mm512_zextsi256_si512(off));
                let dx = *a.scale.get_unchecked(t * a.f_stride + s);
                *acc_ij = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(d * dx), *acc_ij);
            }
        }
    }
    store(&acc, out);
}
