//! AVX-512 VNNI tile kernels for the float types and the 32-element block formats.
//!
//! 32-element formats are read two blocks at a time: one 512-bit register holds 64 unsigned
//! weight values in element order, `vpdpbusd` multiplies them with the Q8 activations, and
//! each half of the 16 i32 lanes is scaled by its own block's `d_w * d_x` in f32. Offsets and
//! mins (Q4_0's -8, Q4_1's `m`, Q8_0 read as unsigned with -128) go through the activation
//! block sums: `m * d_x * sum(x_q)`. The K formats live in `avx512_k`.

use std::arch::x86_64::*;

use super::act::{ActKind, ActView};
use super::avx512_k::{q4_k, q6_k};
use super::kernel::{tiles, TileFn};
use crate::tensor::DType;

/// The kernels for `dtype` (never a fallback type).
pub(crate) fn tiles(dtype: DType) -> (ActKind, [TileFn; 6]) {
    match dtype {
        DType::F32 => (ActKind::F32, tiles!(float::<F32>)),
        DType::F16 => (ActKind::F32, tiles!(float::<F16>)),
        DType::BF16 => (ActKind::F32, tiles!(float::<BF16>)),
        DType::Q4_0 => (ActKind::Q8, tiles!(legacy::<Q4_0>)),
        DType::Q4_1 => (ActKind::Q8, tiles!(legacy::<Q4_1>)),
        DType::Q5_0 => (ActKind::Q8, tiles!(legacy::<Q5_0>)),
        DType::Q5_1 => (ActKind::Q8, tiles!(legacy::<Q5_1>)),
        DType::Q8_0 => (ActKind::Q8, tiles!(legacy::<Q8_0>)),
        DType::Q4_K => (ActKind::Q8K, tiles!(q4_k)),
        DType::Q6_K => (ActKind::Q8K, tiles!(q6_k)),
        DType::Q2_K | DType::Q3_K | DType::Q5_K => unreachable!("{dtype} is dequantized first"),
    }
}

/// Two consecutive blocks of a 32-element format, unpacked for `vpdpbusd`.
trait Pair {
    const BYTES: usize;
    /// The 64 values of blocks `a` and `b` as unsigned bytes, in element order.
    unsafe fn unpack(a: *const u8, b: *const u8) -> __m512i;
    /// `([d_a x8, d_b x8], [m_a x8, m_b x8])`: each value is `d * q + m` with `q` as unpacked.
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m512, __m512);
}

/// The four f16 at `a`, `a + 2`, `b`, `b + 2` as f32.
#[inline(always)]
unsafe fn halves(a: *const u8, b: *const u8) -> __m128 {
    let lo = (a as *const i32).read_unaligned();
    let hi = (b as *const i32).read_unaligned();
    _mm_cvtph_ps(_mm_setr_epi32(lo, hi, 0, 0))
}

/// Spreads lanes `la` and `lb` of `v` over the low and high 8 lanes.
#[inline(always)]
unsafe fn spread(v: __m128, la: i32, lb: i32) -> __m512 {
    let idx = _mm512_setr_epi32(
        la, la, la, la, la, la, la, la, lb, lb, lb, lb, lb, lb, lb, lb,
    );
    _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v))
}

/// 16 bytes of packed nibbles at `a` and at `b` as `[a lo, a hi, b lo, b hi]` (64 values).
#[inline(always)]
unsafe fn nibbles(a: *const u8, b: *const u8) -> __m512i {
    let qa = _mm256_broadcastsi128_si256(_mm_loadu_si128(a.cast()));
    let qb = _mm256_broadcastsi128_si256(_mm_loadu_si128(b.cast()));
    let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qa), qb);
    let shifted = _mm512_mask_srli_epi16(both, 0xFF00_FF00, both, 4);
    _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F))
}

/// Adds 16 to the values whose bit is set in the two blocks' 32-bit `qh` masks.
#[inline(always)]
unsafe fn fifth_bits(q: __m512i, qh_a: *const u8, qh_b: *const u8) -> __m512i {
    let ka = (qh_a as *const u32).read_unaligned() as u64;
    let kb = (qh_b as *const u32).read_unaligned() as u64;
    _mm512_mask_add_epi8(q, ka | kb << 32, q, _mm512_set1_epi8(16))
}

/// Only the `d` of each block (at offset 0); `m = offset * d`.
#[inline(always)]
unsafe fn d_only(a: *const u8, b: *const u8, offset: f32) -> (__m512, __m512) {
    let d = spread(halves(a, b), 0, 2);
    (d, _mm512_mul_ps(d, _mm512_set1_ps(offset)))
}

struct Q4_0;
struct Q4_1;
struct Q5_0;
struct Q5_1;
struct Q8_0;

impl Pair for Q4_0 {
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn unpack(a: *const u8, b: *const u8) -> __m512i {
        nibbles(a.add(2), b.add(2))
    }
    #[inline(always)]
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m512, __m512) {
        d_only(a, b, -8.0)
    }
}

impl Pair for Q4_1 {
    const BYTES: usize = 20;
    #[inline(always)]
    unsafe fn unpack(a: *const u8, b: *const u8) -> __m512i {
        nibbles(a.add(4), b.add(4))
    }
    #[inline(always)]
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m512, __m512) {
        let h = halves(a, b);
        (spread(h, 0, 2), spread(h, 1, 3))
    }
}

impl Pair for Q5_0 {
    const BYTES: usize = 22;
    #[inline(always)]
    unsafe fn unpack(a: *const u8, b: *const u8) -> __m512i {
        fifth_bits(nibbles(a.add(6), b.add(6)), a.add(2), b.add(2))
    }
    #[inline(always)]
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m512, __m512) {
        d_only(a, b, -16.0)
    }
}

impl Pair for Q5_1 {
    const BYTES: usize = 24;
    #[inline(always)]
    unsafe fn unpack(a: *const u8, b: *const u8) -> __m512i {
        fifth_bits(nibbles(a.add(8), b.add(8)), a.add(4), b.add(4))
    }
    #[inline(always)]
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m512, __m512) {
        let h = halves(a, b);
        (spread(h, 0, 2), spread(h, 1, 3))
    }
}

impl Pair for Q8_0 {
    const BYTES: usize = 34;
    /// Signed bytes read as unsigned by flipping the sign bit (`q + 128`); `m = -128 d`.
    #[inline(always)]
    unsafe fn unpack(a: *const u8, b: *const u8) -> __m512i {
        let qa = _mm256_loadu_si256(a.add(2).cast());
        let qb = _mm256_loadu_si256(b.add(2).cast());
        let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qa), qb);
        _mm512_xor_si512(both, _mm512_set1_epi8(i8::MIN))
    }
    #[inline(always)]
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m512, __m512) {
        d_only(a, b, -128.0)
    }
}

/// See [`TileFn`]; `P` is the block format.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn legacy<P: Pair, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &ActView<'_>,
    t0: usize,
    out: &mut [f32; 16],
) {
    let nb = row_bytes / P::BYTES;
    let wp = w.as_ptr();
    let (qs, scale, sum) = (a.qs.as_ptr(), a.scale.as_ptr(), a.sum.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for p in 0..nb.div_ceil(2) {
        let ba = 2 * p;
        // An odd last block pairs with itself; its activation partner is the zero pad block.
        let bb = if ba + 1 < nb { ba + 1 } else { ba };
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let row = wp.add(i * row_bytes);
            let (pa, pb) = (row.add(ba * P::BYTES), row.add(bb * P::BYTES));
            let q = P::unpack(pa, pb);
            let (dw, mw) = P::scales(pa, pb);
            for (j, acc_ij) in acc_i.iter_mut().enumerate() {
                let t = t0 + j;
                let xq = _mm512_loadu_si512(qs.add(t * a.qs_stride + 64 * p).cast());
                let dx = _mm512_loadu_ps(scale.add(t * a.f_stride + 16 * p));
                let sx = _mm512_loadu_ps(sum.add(t * a.f_stride + 16 * p));
                let isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xq);
                let s = _mm512_mul_ps(dw, dx);
                *acc_ij = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, *acc_ij);
                *acc_ij = _mm512_fmadd_ps(mw, sx, *acc_ij);
            }
        }
    }
    for (i, acc_i) in acc.iter().enumerate() {
        for (j, v) in acc_i.iter().enumerate() {
            out[i * 4 + j] = _mm512_reduce_add_ps(*v);
        }
    }
}

/// A float weight type: loads 16 (or the first `n` of 16) values as f32.
trait Float16 {
    const WIDTH: usize;
    unsafe fn load(p: *const u8) -> __m512;
    unsafe fn load_first(p: *const u8, k: __mmask16) -> __m512;
}

struct F32;
struct F16;
struct BF16;

impl Float16 for F32 {
    const WIDTH: usize = 4;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512 {
        _mm512_loadu_ps(p.cast())
    }
    #[inline(always)]
    unsafe fn load_first(p: *const u8, k: __mmask16) -> __m512 {
        _mm512_maskz_loadu_ps(k, p.cast())
    }
}

impl Float16 for F16 {
    const WIDTH: usize = 2;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
    #[inline(always)]
    unsafe fn load_first(p: *const u8, k: __mmask16) -> __m512 {
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p.cast()))
    }
}

impl Float16 for BF16 {
    const WIDTH: usize = 2;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512 {
        let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))
    }
    #[inline(always)]
    unsafe fn load_first(p: *const u8, k: __mmask16) -> __m512 {
        let v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p.cast()));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))
    }
}

/// See [`TileFn`]; `F` is the float weight type, activations are plain f32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn float<F: Float16, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &ActView<'_>,
    t0: usize,
    out: &mut [f32; 16],
) {
    let cols = a.cols;
    let (wp, xp) = (w.as_ptr(), a.x.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let full = cols / 16 * 16;
    for c in (0..full).step_by(16) {
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let wv = F::load(wp.add(i * row_bytes + c * F::WIDTH));
            for (j, acc_ij) in acc_i.iter_mut().enumerate() {
                let xv = _mm512_loadu_ps(xp.add((t0 + j) * cols + c));
                *acc_ij = _mm512_fmadd_ps(wv, xv, *acc_ij);
            }
        }
    }
    if full < cols {
        let k: __mmask16 = (1u16 << (cols - full)) - 1;
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let wv = F::load_first(wp.add(i * row_bytes + full * F::WIDTH), k);
            for (j, acc_ij) in acc_i.iter_mut().enumerate() {
                let xv = _mm512_maskz_loadu_ps(k, xp.add((t0 + j) * cols + full));
                *acc_ij = _mm512_fmadd_ps(wv, xv, *acc_ij);
            }
        }
    }
    for (i, acc_i) in acc.iter().enumerate() {
        for (j, v) in acc_i.iter().enumerate() {
            out[i * 4 + j] = _mm512_reduce_add_ps(*v);
        }
    }
}
