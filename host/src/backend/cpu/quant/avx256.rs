//! 256-bit tile kernels shared by the AVX2 and AVX-VNNI levels; they differ only in the
//! integer dot instruction ([`Dot256`]): `vpmaddubsw` + `vpmaddwd` or `vpdpbusd` / `vpdpwssd`.
//!
//! Each 32-element block is one register in element order, scaled in f32 by `d_w * d_x`
//! (offsets and mins through the activation block sums, as in `avx512`); Q8_0 uses the
//! sign trick (`|w|` times `x` with `w`'s sign) because `vpmaddubsw` saturates at i16. The
//! K formats (in `avx256_k`) apply their group scales in the integer domain. The bodies are
//! generic and `#[inline(always)]`; `isa_kernels!` stamps them out under each level's target
//! features.

use std::arch::x86_64::*;

use super::act::ActView;
use super::avx256_k::{q4_k, q6_k};

/// The integer dot instruction of a 256-bit level.
pub(crate) trait Dot256 {
    /// Sums of 4 products of unsigned `a` and signed `b` bytes, as 8 i32.
    unsafe fn dot_u8i8(a: __m256i, b: __m256i) -> __m256i;
    /// `acc` plus the sums of 2 products of i16 pairs.
    unsafe fn dot_i16(acc: __m256i, a: __m256i, b: __m256i) -> __m256i;
}

pub(crate) struct MaddDot;
pub(crate) struct VnniDot;

impl Dot256 for MaddDot {
    #[inline(always)]
    unsafe fn dot_u8i8(a: __m256i, b: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
    }
    #[inline(always)]
    unsafe fn dot_i16(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
    }
}

impl Dot256 for VnniDot {
    #[inline(always)]
    unsafe fn dot_u8i8(a: __m256i, b: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b)
    }
    #[inline(always)]
    unsafe fn dot_i16(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_dpwssd_avx_epi32(acc, a, b)
    }
}

#[inline(always)]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

#[inline(always)]
pub(crate) unsafe fn store<const R: usize, const T: usize>(
    acc: &[[__m256; T]; R],
    out: &mut [f32; 16],
) {
    for (i, acc_i) in acc.iter().enumerate() {
        for (j, v) in acc_i.iter().enumerate() {
            out[i * 4 + j] = hsum(*v);
        }
    }
}

/// The f16 at `p` as f32.
#[inline(always)]
pub(crate) unsafe fn f16_at(p: *const u8) -> f32 {
    let h = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// One block of a 32-element format, unpacked for a 256-bit dot.
pub(crate) trait Block {
    const BYTES: usize;
    /// Values are signed bytes (Q8_0): the kernel uses the sign trick and ignores `m`.
    const SIGNED: bool = false;
    /// The 32 values in element order (unsigned unless `SIGNED`).
    unsafe fn unpack(b: *const u8) -> __m256i;
    /// `(d, m)`: each value is `d * q + m` with `q` as unpacked.
    unsafe fn scales(b: *const u8) -> (f32, f32);
}

/// 16 bytes of packed nibbles as 32 values, low nibbles first.
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let q = _mm_loadu_si128(p.cast());
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// Sets bit 4 of value j where bit j of the 32-bit mask at `qh` is set.
#[inline(always)]
unsafe fn fifth_bits(q: __m256i, qh: *const u8) -> __m256i {
    let bits = (qh as *const i32).read_unaligned();
    // Byte j takes byte j / 8 of the mask, then tests its bit j % 8.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits),
        _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
}

pub(crate) struct Q4_0;
pub(crate) struct Q4_1;
pub(crate) struct Q5_0;
pub(crate) struct Q5_1;
pub(crate) struct Q8_0;

impl Block for Q4_0 {
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn unpack(b: *const u8) -> __m256i {
        nibbles(b.add(2))
    }
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> (f32, f32) {
        let d = f16_at(b);
        (d, -8.0 * d)
    }
}

impl Block for Q4_1 {
    const BYTES: usize = 20;
    #[inline(always)]
    unsafe fn unpack(b: *const u8) -> __m256i {
        nibbles(b.add(4))
    }
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> (f32, f32) {
        (f16_at(b), f16_at(b.add(2)))
    }
}

impl Block for Q5_0 {
    const BYTES: usize = 22;
    #[inline(always)]
    unsafe fn unpack(b: *const u8) -> __m256i {
        fifth_bits(nibbles(b.add(6)), b.add(2))
    }
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> (f32, f32) {
        let d = f16_at(b);
        (d, -16.0 * d)
    }
}

impl Block for Q5_1 {
    const BYTES: usize = 24;
    #[inline(always)]
    unsafe fn unpack(b: *const u8) -> __m256i {
        fifth_bits(nibbles(b.add(8)), b.add(4))
    }
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> (f32, f32) {
        (f16_at(b), f16_at(b.add(2)))
    }
}

impl Block for Q8_0 {
    const BYTES: usize = 34;
    const SIGNED: bool = true;
    #[inline(always)]
    unsafe fn unpack(b: *const u8) -> __m256i {
        _mm256_loadu_si256(b.add(2).cast())
    }
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> (f32, f32) {
        (f16_at(b), 0.0)
    }
}

/// The 32-element block formats (see `kernel::TileFn`).
#[inline(always)]
pub(crate) unsafe fn legacy<D: Dot256, B: Block, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &ActView<'_>,
    t0: usize,
    out: &mut [f32; 16],
) {
    let nb = row_bytes / B::BYTES;
    let wp = w.as_ptr();
    let (qs, scale, sum) = (a.qs.as_ptr(), a.scale.as_ptr(), a.sum.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for blk in 0..nb {
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let p = wp.add(i * row_bytes + blk * B::BYTES);
            let q = B::unpack(p);
            let (d, m) = B::scales(p);
            let (dw, mw) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
            let uq = if B::SIGNED { _mm256_sign_epi8(q, q) } else { q };
            for (j, acc_ij) in acc_i.iter_mut().enumerate() {
                let t = t0 + j;
                let mut xq = _mm256_loadu_si256(qs.add(t * a.qs_stride + 32 * blk).cast());
                if B::SIGNED {
                    xq = _mm256_sign_epi8(xq, q);
                }
                let isum = D::dot_u8i8(uq, xq);
                let dx = _mm256_loadu_ps(scale.add(t * a.f_stride + 8 * blk));
                *acc_ij = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, dx), *acc_ij);
                if !B::SIGNED {
                    let sx = _mm256_loadu_ps(sum.add(t * a.f_stride + 8 * blk));
                    *acc_ij = _mm256_fmadd_ps(mw, sx, *acc_ij);
                }
            }
        }
    }
    store(&acc, out);
}

/// A float weight type: 8 values as f32, and one value for the scalar tail.
pub(crate) trait Float8 {
    const WIDTH: usize;
    unsafe fn load(p: *const u8) -> __m256;
    unsafe fn one(p: *const u8) -> f32;
}

pub(crate) struct F32;
pub(crate) struct F16;
pub(crate) struct BF16;

impl Float8 for F32 {
    const WIDTH: usize = 4;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256 {
        _mm256_loadu_ps(p.cast())
    }
    #[inline(always)]
    unsafe fn one(p: *const u8) -> f32 {
        (p as *const f32).read_unaligned()
    }
}

impl Float8 for F16 {
    const WIDTH: usize = 2;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
    #[inline(always)]
    unsafe fn one(p: *const u8) -> f32 {
        f16_at(p)
    }
}

impl Float8 for BF16 {
    const WIDTH: usize = 2;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256 {
        let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v))
    }
    #[inline(always)]
    unsafe fn one(p: *const u8) -> f32 {
        f32::from_bits(((p as *const u16).read_unaligned() as u32) << 16)
    }
}

/// Float weights against plain f32 activations (see `kernel::TileFn`).
#[inline(always)]
pub(crate) unsafe fn float<F: Float8, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &ActView<'_>,
    t0: usize,
    out: &mut [f32; 16],
) {
    let cols = a.cols;
    let (wp, xp) = (w.as_ptr(), a.x.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let full = cols / 8 * 8;
    for c in (0..full).step_by(8) {
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let wv = F::load(wp.add(i * row_bytes + c * F::WIDTH));
            for (j, acc_ij) in acc_i.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(xp.add((t0 + j) * cols + c));
                *acc_ij = _mm256_fmadd_ps(wv, xv, *acc_ij);
            }
        }
    }
    store(&acc, out);
    for i in 0..R {
        for j in 0..T {
            for c in full..cols {
                let wv = F::one(wp.add(i * row_bytes + c * F::WIDTH));
                out[i * 4 + j] += wv * *xp.add((t0 + j) * cols + c);
            }
        }
    }
}

/// Stamps out one 256-bit level: `#[target_feature]` entry points over the generic bodies
/// above, and its `tiles` table.
macro_rules! isa_kernels {
    ($module:ident, $features:literal, $dot:ty) => {
        pub(crate) mod $module {
            //! Entry points of one 256-bit level (generated by `avx256::isa_kernels!`).
            use super::*;
            use crate::backend::cpu::quant::act::ActKind;
            use crate::backend::cpu::quant::kernel::{tiles, TileFn};
            use crate::tensor::DType;

            #[target_feature(enable = $features)]
            unsafe fn legacy_t<B: Block, const R: usize, const T: usize>(
                w: &[u8],
                rb: usize,
                a: &ActView<'_>,
                t0: usize,
                out: &mut [f32; 16],
            ) {
                legacy::<$dot, B, R, T>(w, rb, a, t0, out)
            }

            #[target_feature(enable = $features)]
            unsafe fn float_t<F: Float8, const R: usize, const T: usize>(
                w: &[u8],
                rb: usize,
                a: &ActView<'_>,
                t0: usize,
                out: &mut [f32; 16],
            ) {
                float::<F, R, T>(w, rb, a, t0, out)
            }

            #[target_feature(enable = $features)]
            unsafe fn q4_k_t<const R: usize, const T: usize>(
                w: &[u8],
                rb: usize,
                a: &ActView<'_>,
                t0: usize,
                out: &mut [f32; 16],
            ) {
                q4_k::<$dot, R, T>(w, rb, a, t0, out)
            }

            #[target_feature(enable = $features)]
            unsafe fn q6_k_t<const R: usize, const T: usize>(
                w: &[u8],
                rb: usize,
                a: &ActView<'_>,
                t0: usize,
                out: &mut [f32; 16],
            ) {
                q6_k::<$dot, R, T>(w, rb, a, t0, out)
            }

            /// The kernels for `dtype` (never a fallback type).
            pub(crate) fn tiles(dtype: DType) -> (ActKind, [TileFn; 6]) {
                match dtype {
                    DType::F32 => (ActKind::F32, tiles!(float_t::<F32>)),
                    DType::F16 => (ActKind::F32, tiles!(float_t::<F16>)),
                    DType::BF16 => (ActKind::F32, tiles!(float_t::<BF16>)),
                    DType::Q4_0 => (ActKind::Q8, tiles!(legacy_t::<Q4_0>)),
                    DType::Q4_1 => (ActKind::Q8, tiles!(legacy_t::<Q4_1>)),
                    DType::Q5_0 => (ActKind::Q8, tiles!(legacy_t::<Q5_0>)),
                    DType::Q5_1 => (ActKind::Q8, tiles!(legacy_t::<Q5_1>)),
                    DType::Q8_0 => (ActKind::Q8, tiles!(legacy_t::<Q8_0>)),
                    DType::Q4_K => (ActKind::Q8K, tiles!(q4_k_t)),
                    DType::Q6_K => (ActKind::Q8K, tiles!(q6_k_t)),
                    DType::Q2_K | DType::Q3_K | DType::Q5_K => {
                        unreachable!("{dtype} is dequantized first")
                    }
                }
            }
        }
    };
}

isa_kernels!(avx2, "avx2,fma,f16c", MaddDot);
isa_kernels!(avxvnni, "avx2,fma,f16c,avxvnni", VnniDot);
