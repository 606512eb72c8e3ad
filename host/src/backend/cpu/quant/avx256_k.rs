//! 256-bit Q4_K and Q6_K bodies shared by the AVX2 and AVX-VNNI levels (entry points are
//! generated in `avx256`). Group scales are applied in the integer domain (`vpmaddubsw` then
//! an i16 dot with the scales), one f32 multiply per super-block; mins (Q4_K) and the -32
//! offset (Q6_K) go through the activation's 16-element sums.

use std::arch::x86_64::*;

use super::act::{ActView, Q8K_BLOCK};
use super::avx256::{f16_at, store, Dot256};
use super::dequant_k::k4_scales_mins;

/// Q4_K against Q8K activations (see `kernel::TileFn`).
#[inline(always)]
pub(crate) unsafe fn q4_k<D: Dot256, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &ActView<'_>,
    t0: usize,
    out: &mut [f32; 16],
) {
    const BYTES: usize = 144;
    let wp = w.as_ptr();
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for s in 0..row_bytes / BYTES {
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let b = wp.add(i * row_bytes + s * BYTES);
            let (d, dmin) = (f16_at(b), f16_at(b.add(2)));
            let (sc, mn) = k4_scales_mins(std::slice::from_raw_parts(b.add(4), 12));
            let m8 = _mm_loadl_epi64(mn.as_ptr().cast());
            let mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
            let mut q = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let raw = _mm256_loadu_si256(b.add(16 + 32 * c).cast());
                q[2 * c] = _mm256_and_si256(raw, low);
                q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low);
            }
            for (j, acc_ij) in acc_i.iter_mut().enumerate() {
                let t = t0 + j;
                let x = a.qs.as_ptr().add(t * a.qs_stride + s * Q8K_BLOCK);
                let mut p = _mm256_setzero_si256();
                for g in 0..8 {
                    let xv = _mm256_loadu_si256(x.add(32 * g).cast());
                    let prod = _mm256_maddubs_epi16(q[g], xv);
                    p = D::dot_i16(p, prod, _mm256_set1_epi16(sc[g] as i16));
                }
                let bs =
                    _mm256_loadu_si256(a.bsums.as_ptr().add(t * a.bsums_stride + 16 * s).cast());
                let msum = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins16));
                let dx = *a.scale.get_unchecked(t * a.f_stride + s);
                *acc_ij = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx), *acc_ij);
                *acc_ij = _mm256_fmadd_ps(msum, _mm256_set1_ps(-dmin * dx), *acc_ij);
            }
        }
    }
    store(&acc, out);
}

/// Q6_K against Q8K activations (see `kernel::TileFn`).
#[inline(always)]
pub(crate) unsafe fn q6_k<D: Dot256, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &ActView<'_>,
    t0: usize,
    out: &mut [f32; 16],
) {
    const BYTES: usize = 210;
    let wp = w.as_ptr();
    let (low4, bits45, low2) = (
        _mm256_set1_epi8(0x0F),
        _mm256_set1_epi8(0x30),
        _mm256_set1_epi8(0x03),
    );
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for s in 0..row_bytes / BYTES {
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let b = wp.add(i * row_bytes + s * BYTES);
            let d = f16_at(b.add(208));
            let scales = std::slice::from_raw_parts(b.add(192), 16);
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192).cast()));
            let mut q = [_mm256_setzero_si256(); 8];
            let mut scv = [_mm256_setzero_si256(); 8];
            for h in 0..2 {
                let ql0 = _mm256_loadu_si256(b.add(64 * h).cast());
                let ql1 = _mm256_loadu_si256(b.add(64 * h + 32).cast());
                let qh = _mm256_loadu_si256(b.add(128 + 32 * h).cast());
                let qh2 = _mm256_srli_epi16::<2>(qh);
                let hi0 = _mm256_slli_epi16::<4>(_mm256_and_si256(qh, low2));
                let hi1 = _mm256_slli_epi16::<4>(_mm256_and_si256(qh2, low2));
                q[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, low4), hi0);
                q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), hi1);
                let lo2 = _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low4);
                let lo3 = _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low4);
                q[4 * h + 2] = _mm256_or_si256(lo2, _mm256_and_si256(qh, bits45));
                q[4 * h + 3] = _mm256_or_si256(lo3, _mm256_and_si256(qh2, bits45));
            }
            for (k, v) in scv.iter_mut().enumerate() {
                let (sa, sb) = (scales[2 * k] as i8 as i16, scales[2 * k + 1] as i8 as i16);
                *v = _mm256_set_m128i(_mm_set1_epi16(sb), _mm_set1_epi16(sa));
            }
            for (j, acc_ij) in acc_i.iter_mut().enumerate() {
                let t = t0 + j;
                let x = a.qs.as_ptr().add(t * a.qs_stride + s * Q8K_BLOCK);
                let mut p = _mm256_setzero_si256();
                for k in 0..8 {
                    let xv = _mm256_loadu_si256(x.add(32 * k).cast());
                    p = D::dot_i16(p, _mm256_maddubs_epi16(q[k], xv), scv[k]);
                }
                let bs =
                    _mm256_loadu_si256(a.bsums.as_ptr().add(t * a.bsums_stride + 16 * s).cast());
                let off = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bs, sc16));
                p = _mm256_sub_epi32(p, off);
                let dx = *a.scale.get_unchecked(t * a.f_stride + s);
                *acc_ij = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx), *acc_ij);
            }
        }
    }
    store(&acc, out);
}
