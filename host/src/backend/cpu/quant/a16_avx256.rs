//! 256-bit tiles of the 32-element formats against 16-bit activations (`act16`), shared by
//! the AVX2 (`vpmaddwd` + add) and AVX-VNNI (`vpdpwssd`) levels through [`Dot256`].
//!
//! A block pair unpacks into four registers of 16 i16 weights in the activation layout's word
//! order; four pairwise dots leave block a's sums in the even i32 lanes and block b's in the odd
//! ones (see `a16_avx512`, whose scheme this is at half the width).

use std::arch::x86_64::*;

use super::act16::{Act16View, PAIR_WORDS};
use super::avx256::Dot256;

/// One block pair of a format, unpacked for 256-bit i16 dots.
pub(crate) trait Pair {
    const BYTES: usize;
    const MIN: bool;
    /// Words 0..16, 16..32 (elements 0..16) and 32..48, 48..64 (elements 16..32) of the pair.
    unsafe fn unpack(a: *const u8, b: *const u8) -> [__m256i; 4];
    /// `([d_a, d_b] x 4, [m_a / 4, m_b / 4] x 4)`.
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m256, __m256);
}

pub(crate) struct Q4_0;
pub(crate) struct Q4_1;
pub(crate) struct Q8_0;

#[inline(always)]
unsafe fn nibbles(a: *const u8, b: *const u8) -> [__m256i; 4] {
    let qa = _mm_loadu_si128(a.cast());
    let qb = _mm_loadu_si128(b.cast());
    let w0 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi16(qa, qb));
    let w1 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi16(qa, qb));
    let m = _mm256_set1_epi16(0x0F);
    [
        _mm256_and_si256(w0, m),
        _mm256_and_si256(w1, m),
        _mm256_srli_epi16::<4>(w0),
        _mm256_srli_epi16::<4>(w1),
    ]
}

/// The f16 pairs at `a` and `b` as f32 `[a0, a1, b0, b1]` in the low lanes.
#[inline(always)]
unsafe fn halves(a: *const u8, b: *const u8) -> __m256 {
    let lo = (a as *const i32).read_unaligned();
    let hi = (b as *const i32).read_unaligned();
    _mm256_castps128_ps256(_mm_cvtph_ps(_mm_setr_epi32(lo, hi, 0, 0)))
}

#[inline(always)]
unsafe fn alternate(v: __m256, la: i32, lb: i32) -> __m256 {
    _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(la, lb, la, lb, la, lb, la, lb))
}

impl Pair for Q4_0 {
    const BYTES: usize = 18;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn unpack(a: *const u8, b: *const u8) -> [__m256i; 4] {
        let eight = _mm256_set1_epi16(8);
        nibbles(a.add(2), b.add(2)).map(|v| _mm256_sub_epi16(v, eight))
    }
    #[inline(always)]
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m256, __m256) {
        (alternate(halves(a, b), 0, 2), _mm256_setzero_ps())
    }
}

impl Pair for Q4_1 {
    const BYTES: usize = 20;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn unpack(a: *const u8, b: *const u8) -> [__m256i; 4] {
        nibbles(a.add(4), b.add(4))
    }
    #[inline(always)]
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m256, __m256) {
        let h = halves(a, b);
        let m = _mm256_mul_ps(alternate(h, 1, 3), _mm256_set1_ps(0.25));
        (alternate(h, 0, 2), m)
    }
}

impl Pair for Q8_0 {
    const BYTES: usize = 34;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn unpack(a: *const u8, b: *const u8) -> [__m256i; 4] {
        let qa = _mm256_loadu_si256(a.add(2).cast());
        let qb = _mm256_loadu_si256(b.add(2).cast());
        let ul = _mm256_unpacklo_epi16(qa, qb);
        let uh = _mm256_unpackhi_epi16(qa, qb);
        [
            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(ul)),
            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(uh)),
            _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(ul)),
            _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(uh)),
        ]
    }
    #[inline(always)]
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m256, __m256) {
        (alternate(halves(a, b), 0, 2), _mm256_setzero_ps())
    }
}

#[inline(always)]
unsafe fn pair_at(p: *const f32) -> __m256 {
    _mm256_castpd_ps(_mm256_set1_pd((p as *const f64).read_unaligned()))
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// See [`super::a16::Tile16Fn`]; `D` is the level's dot, `P` the block format.
#[inline(always)]
pub(crate) unsafe fn tile<D: Dot256, P: Pair, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &Act16View<'_>,
    t0: usize,
    out: &mut [f32; 16],
) {
    let nb = row_bytes / P::BYTES;
    debug_assert_eq!(a.octets, 0);
    let np = a.pairs;
    let wp = w.as_ptr();
    let (q, d, s) = (a.q.as_ptr(), a.d.as_ptr(), a.s.as_ptr());
    let (qstride, fstride) = (a.q_stride(), a.f_stride());
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for p in 0..np {
        let ba = 2 * p;
        let bb = if ba + 1 < nb { ba + 1 } else { ba };
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let row = wp.add(i * row_bytes);
            let (pa, pb) = (row.add(ba * P::BYTES), row.add(bb * P::BYTES));
            let wv = P::unpack(pa, pb);
            let (dw, mw) = P::scales(pa, pb);
            for (j, acc_ij) in acc_i.iter_mut().enumerate() {
                let t = t0 + j;
                let xq = q.add(t * qstride + p * PAIR_WORDS);
                let mut c = _mm256_setzero_si256();
                for (k, &wk) in wv.iter().enumerate() {
                    c = D::dot_i16(c, wk, _mm256_loadu_si256(xq.add(16 * k).cast()));
                }
                let sc = _mm256_mul_ps(dw, pair_at(d.add(t * fstride + 2 * p)));
                *acc_ij = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), sc, *acc_ij);
                if P::MIN {
                    *acc_ij = _mm256_fmadd_ps(mw, pair_at(s.add(t * fstride + 2 * p)), *acc_ij);
                }
            }
        }
    }
    for (i, acc_i) in acc.iter().enumerate() {
        for (j, v) in acc_i.iter().enumerate() {
            out[i * 8 + j] = hsum(*v);
        }
    }
}

/// Stamps out one 256-bit level's `#[target_feature]` entry points and its kernel table.
macro_rules! isa_kernels16 {
    ($module:ident, $features:literal, $dot:ty) => {
        pub(crate) mod $module {
            //! Entry points of one 256-bit level (generated by `a16_avx256::isa_kernels16!`).
            use super::*;
            use crate::backend::cpu::quant::a16::{tiles16, Format, Kernel16};

            #[target_feature(enable = $features)]
            unsafe fn tile_t<P: Pair, const R: usize, const T: usize>(
                w: &[u8],
                rb: usize,
                a: &Act16View<'_>,
                t0: usize,
                out: &mut [f32; 16],
            ) {
                tile::<$dot, P, R, T>(w, rb, a, t0, out)
            }

            pub(crate) fn tiles(f: Format) -> Kernel16 {
                Kernel16 {
                    tiles: match f {
                        Format::Q4_0 => tiles16!(tile_t::<Q4_0>),
                        Format::Q4_1 => tiles16!(tile_t::<Q4_1>),
                        Format::Q8_0 => tiles16!(tile_t::<Q8_0>),
                    },
                    octets: false,
                }
            }
        }
    };
}

isa_kernels16!(avx2, "avx2,fma,f16c", super::super::avx256::MaddDot);
isa_kernels16!(
    avxvnni,
    "avx2,fma,f16c,avxvnni",
    super::super::avx256::VnniDot
);
