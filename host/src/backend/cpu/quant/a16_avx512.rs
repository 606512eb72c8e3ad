//! AVX-512 VNNI tiles of the 32-element formats against 16-bit activations (`act16`).
//!
//! A block pair unpacks into two registers of 32 i16 weights in the activation layout's word
//! order; two `vpdpwssd` leave block a's sums in the even i32 lanes and block b's in the odd
//! ones, which one `vcvtdq2ps` and one FMA scale by `[d_wa d_xa, d_wb d_xb, ..]`. Q4_1's
//! minimum goes through the activation sums (`m * s_x`, spread over 8 lanes per block); Q4_0's
//! offset is subtracted in i16 and Q8_0 is sign-extended, so neither has an offset term.
//!
//! All three read activations in octets: 8 blocks (144, 160 or 272 bytes, three or five
//! loads) are gathered into the octet's word order with two or three `vpermt2w` per register
//! pair, so eight `vpdpwssd` share one conversion, one scale product and one FMA (lane l is
//! block l % 8).

use std::arch::x86_64::*;

use super::a16::{tiles16, Format, Kernel16};
use super::act16::{Act16View, OCTET_WORDS, PAIR_WORDS};

pub(crate) fn tiles(f: Format) -> Kernel16 {
    let (tiles, octets) = match f {
        Format::Q4_0 => (tiles16!(tile::<Q4_0>), Q4_0::OCTETS),
        Format::Q4_1 => (tiles16!(tile::<Q4_1>), Q4_1::OCTETS),
        Format::Q8_0 => (tiles16!(tile::<Q8_0>), Q8_0::OCTETS),
    };
    Kernel16 { tiles, octets }
}

/// `vpermt2w` indices and masks that gather an octet's words from three loads `z0, z1, z2`
/// (words 0..32, 32..64, 64..96 of the octet's bytes): a word below 64 comes from `(z0, z1)`,
/// the others from `(z1, z2)`.
struct Gather {
    idx_a: [u16; 32],
    idx_b: [u16; 32],
    mask_a: u32,
    mask_b: u32,
}

impl Gather {
    /// `src[pos]` is the word (of the octet's bytes) that goes to position `pos`.
    const fn new(src: [u16; 32]) -> Gather {
        let mut g = Gather {
            idx_a: [0; 32],
            idx_b: [0; 32],
            mask_a: 0,
            mask_b: 0,
        };
        let mut pos = 0;
        while pos < 32 {
            if src[pos] < 64 {
                g.idx_a[pos] = src[pos];
                g.mask_a |= 1 << pos;
            } else {
                g.idx_b[pos] = src[pos] - 32;
                g.mask_b |= 1 << pos;
            }
            pos += 1;
        }
        g
    }

    /// Quant words for registers `2h, 2h + 1`: position `16 r + 8 m + blk` takes the block's
    /// quant word `2 (2h + r) + m`.
    const fn quants(bytes: usize, qs_off: usize, h: usize) -> Gather {
        let mut src = [0u16; 32];
        let mut pos = 0;
        while pos < 32 {
            let (r, m, blk) = (pos / 16, (pos / 8) % 2, pos % 8);
            src[pos] = ((blk * bytes + qs_off) / 2 + 2 * (2 * h + r) + m) as u16;
            pos += 1;
        }
        Gather::new(src)
    }

    /// Scale words: `d` of block `pos % 8` at positions 0..16, `m` (the next word) at 16..32.
    const fn scales(bytes: usize) -> Gather {
        let mut src = [0u16; 32];
        let mut pos = 0;
        while pos < 32 {
            src[pos] = ((pos % 8) * bytes / 2 + pos / 16) as u16;
            pos += 1;
        }
        Gather::new(src)
    }

    #[inline(always)]
    unsafe fn apply(&self, z0: __m512i, z1: __m512i, z2: __m512i) -> __m512i {
        let ia = _mm512_loadu_si512(self.idx_a.as_ptr().cast());
        let ib = _mm512_loadu_si512(self.idx_b.as_ptr().cast());
        _mm512_or_si512(
            _mm512_maskz_permutex2var_epi16(self.mask_a, z0, ia, z1),
            _mm512_maskz_permutex2var_epi16(self.mask_b, z1, ib, z2),
        )
    }
}

/// An octet of Q4 blocks (`bytes` per block, nibbles at `qs_off`): the 8 word registers (see
/// `act16`), `[d_0 .. d_7] x 2` and `[m_0 / 2 .. m_7 / 2] x 2`; `offset` is subtracted from the
/// nibbles.
#[inline(always)]
unsafe fn q4_octet<const OFFSET: i16>(
    p: *const u8,
    bytes: usize,
    q: &[Gather; 2],
    sc: &Gather,
) -> ([__m512i; 8], __m512, __m512) {
    let z0 = _mm512_loadu_si512(p.cast());
    let z1 = _mm512_loadu_si512(p.add(64).cast());
    let z2 = _mm512_maskz_loadu_epi8((1u64 << (8 * bytes - 128)) - 1, p.add(128).cast());
    let mut regs = [_mm512_setzero_si512(); 8];
    let (nib, off) = (_mm512_set1_epi16(0x0F), _mm512_set1_epi16(OFFSET));
    for h in 0..2 {
        let g = q[h].apply(z0, z1, z2);
        let w0 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(g));
        let w1 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64::<1>(g));
        regs[2 * h] = _mm512_sub_epi16(_mm512_and_si512(w0, nib), off);
        regs[2 * h + 1] = _mm512_sub_epi16(_mm512_and_si512(w1, nib), off);
        regs[2 * h + 4] = _mm512_sub_epi16(_mm512_srli_epi16::<4>(w0), off);
        regs[2 * h + 5] = _mm512_sub_epi16(_mm512_srli_epi16::<4>(w1), off);
    }
    let s = sc.apply(z0, z1, z2);
    let d = _mm512_cvtph_ps(_mm512_castsi512_si256(s));
    let m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(s));
    (regs, d, _mm512_mul_ps(m, _mm512_set1_ps(0.5)))
}

/// [`Gather`] over three tables `(z0, z1)`, `(z2, z3)`, `(z4, z5)` (words 0..64, 64..128,
/// 128..192 of the octet's bytes), for Q8_0's 272-byte octets.
struct Gather3 {
    idx: [[u16; 32]; 3],
    mask: [u32; 3],
}

impl Gather3 {
    const fn new(src: [u16; 32]) -> Gather3 {
        let mut g = Gather3 {
            idx: [[0; 32]; 3],
            mask: [0; 3],
        };
        let mut pos = 0;
        while pos < 32 {
            let t = src[pos] as usize / 64;
            g.idx[t][pos] = src[pos] % 64;
            g.mask[t] |= 1 << pos;
            pos += 1;
        }
        g
    }

    /// Q8_0 quant words for registers `2h, 2h + 1`: position `16 r + 8 m + blk` takes the
    /// block's quant word (two values) `2 (2h + r) + m`.
    const fn q8_quants(h: usize) -> Gather3 {
        let mut src = [0u16; 32];
        let mut pos = 0;
        while pos < 32 {
            let (r, m, blk) = (pos / 16, (pos / 8) % 2, pos % 8);
            src[pos] = (17 * blk + 1 + 2 * (2 * h + r) + m) as u16;
            pos += 1;
        }
        Gather3::new(src)
    }

    /// Q8_0 scales: `d` of block `pos % 8` at every position.
    const fn q8_scales() -> Gather3 {
        let mut src = [0u16; 32];
        let mut pos = 0;
        while pos < 32 {
            src[pos] = (17 * (pos % 8)) as u16;
            pos += 1;
        }
        Gather3::new(src)
    }

    #[inline(always)]
    unsafe fn apply(&self, z: &[__m512i; 6]) -> __m512i {
        let mut out = _mm512_setzero_si512();
        for t in 0..3 {
            let idx = _mm512_loadu_si512(self.idx[t].as_ptr().cast());
            let part = _mm512_maskz_permutex2var_epi16(self.mask[t], z[2 * t], idx, z[2 * t + 1]);
            out = _mm512_or_si512(out, part);
        }
        out
    }
}

const Q8_0_QUANTS: [Gather3; 4] = [
    Gather3::q8_quants(0),
    Gather3::q8_quants(1),
    Gather3::q8_quants(2),
    Gather3::q8_quants(3),
];
const Q8_0_SCALES: Gather3 = Gather3::q8_scales();

/// An octet of Q8_0 blocks: the 8 sign-extended word registers and `[d_0 .. d_7] x 2`.
#[inline(always)]
unsafe fn q8_octet(p: *const u8) -> ([__m512i; 8], __m512, __m512) {
    let z = [
        _mm512_loadu_si512(p.cast()),
        _mm512_loadu_si512(p.add(64).cast()),
        _mm512_loadu_si512(p.add(128).cast()),
        _mm512_loadu_si512(p.add(192).cast()),
        _mm512_maskz_loadu_epi8((1u64 << (8 * 34 - 256)) - 1, p.add(256).cast()),
        _mm512_setzero_si512(),
    ];
    let mut regs = [_mm512_setzero_si512(); 8];
    for h in 0..4 {
        let g = Q8_0_QUANTS[h].apply(&z);
        regs[2 * h] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(g));
        regs[2 * h + 1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(g));
    }
    let d = _mm512_cvtph_ps(_mm512_castsi512_si256(Q8_0_SCALES.apply(&z)));
    (regs, d, _mm512_setzero_ps())
}

const Q4_0_QUANTS: [Gather; 2] = [Gather::quants(18, 2, 0), Gather::quants(18, 2, 1)];
const Q4_0_SCALES: Gather = Gather::scales(18);
const Q4_1_QUANTS: [Gather; 2] = [Gather::quants(20, 4, 0), Gather::quants(20, 4, 1)];
const Q4_1_SCALES: Gather = Gather::scales(20);

/// One block pair of a format, unpacked for `vpdpwssd`.
trait Pair {
    const BYTES: usize;
    /// The format has a per-block minimum (`m * s_x` terms).
    const MIN: bool;
    /// (elements 0..16, elements 16..32) of blocks `a` and `b` as i16 in the `act16` order.
    unsafe fn unpack(a: *const u8, b: *const u8) -> (__m512i, __m512i);
    /// `([d_a, d_b] x 8, [m_a / 8, m_b / 8] x 8)`.
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m512, __m512);
    /// Reads activations in octets ([`Pair::octet`] is implemented).
    const OCTETS: bool;
    /// The octet of blocks at `p`: word registers, `d` and `m / 2` of `q4_octet`.
    unsafe fn octet(_p: *const u8) -> ([__m512i; 8], __m512, __m512) {
        unreachable!("no octet kernel")
    }
}

struct Q4_0;
struct Q4_1;
struct Q8_0;

/// 16 bytes of packed nibbles at `a` and at `b` as (low nibbles, high nibbles), i16 words in
/// the `act16` order.
#[inline(always)]
unsafe fn nibbles(a: *const u8, b: *const u8) -> (__m512i, __m512i) {
    let qa = _mm_loadu_si128(a.cast());
    let qb = _mm_loadu_si128(b.cast());
    // [a0 a1 b0 b1 a2 a3 b2 b3 ..]: the words' byte sources in order.
    let bytes = _mm256_set_m128i(_mm_unpackhi_epi16(qa, qb), _mm_unpacklo_epi16(qa, qb));
    let w = _mm512_cvtepu8_epi16(bytes);
    (
        _mm512_and_si512(w, _mm512_set1_epi16(0x0F)),
        _mm512_srli_epi16::<4>(w),
    )
}

/// The f16 pairs at `a` and `b` as f32 `[a0, a1, b0, b1]` in the low lanes.
#[inline(always)]
unsafe fn halves(a: *const u8, b: *const u8) -> __m512 {
    let lo = (a as *const i32).read_unaligned();
    let hi = (b as *const i32).read_unaligned();
    _mm512_castps128_ps512(_mm_cvtph_ps(_mm_setr_epi32(lo, hi, 0, 0)))
}

/// Lanes `la`, `lb` of `v` alternating over 16 lanes.
#[inline(always)]
unsafe fn alternate(v: __m512, la: i32, lb: i32) -> __m512 {
    let idx = _mm512_setr_epi32(
        la, lb, la, lb, la, lb, la, lb, la, lb, la, lb, la, lb, la, lb,
    );
    _mm512_permutexvar_ps(idx, v)
}

impl Pair for Q4_0 {
    const BYTES: usize = 18;
    const MIN: bool = false;
    const OCTETS: bool = true;
    #[inline(always)]
    unsafe fn octet(p: *const u8) -> ([__m512i; 8], __m512, __m512) {
        q4_octet::<8>(p, 18, &Q4_0_QUANTS, &Q4_0_SCALES)
    }
    #[inline(always)]
    unsafe fn unpack(a: *const u8, b: *const u8) -> (__m512i, __m512i) {
        let (lo, hi) = nibbles(a.add(2), b.add(2));
        let eight = _mm512_set1_epi16(8);
        (_mm512_sub_epi16(lo, eight), _mm512_sub_epi16(hi, eight))
    }
    #[inline(always)]
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m512, __m512) {
        // Only `d` (offset 0); lanes 1 and 3 hold the first quant bytes and are not used.
        (alternate(halves(a, b), 0, 2), _mm512_setzero_ps())
    }
}

impl Pair for Q4_1 {
    const BYTES: usize = 20;
    const MIN: bool = true;
    const OCTETS: bool = true;
    #[inline(always)]
    unsafe fn octet(p: *const u8) -> ([__m512i; 8], __m512, __m512) {
        q4_octet::<0>(p, 20, &Q4_1_QUANTS, &Q4_1_SCALES)
    }
    #[inline(always)]
    unsafe fn unpack(a: *const u8, b: *const u8) -> (__m512i, __m512i) {
        nibbles(a.add(4), b.add(4))
    }
    #[inline(always)]
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m512, __m512) {
        let h = halves(a, b);
        let m = _mm512_mul_ps(alternate(h, 1, 3), _mm512_set1_ps(0.125));
        (alternate(h, 0, 2), m)
    }
}

impl Pair for Q8_0 {
    const BYTES: usize = 34;
    const MIN: bool = false;
    const OCTETS: bool = true;
    #[inline(always)]
    unsafe fn octet(p: *const u8) -> ([__m512i; 8], __m512, __m512) {
        q8_octet(p)
    }
    #[inline(always)]
    unsafe fn unpack(a: *const u8, b: *const u8) -> (__m512i, __m512i) {
        let qa = _mm256_loadu_si256(a.add(2).cast());
        let qb = _mm256_loadu_si256(b.add(2).cast());
        // Per 128-bit lane: elements 0..8 | 16..24 and 8..16 | 24..32, interleaved.
        let ul = _mm256_unpacklo_epi16(qa, qb);
        let uh = _mm256_unpackhi_epi16(qa, qb);
        let lo = _mm256_permute2x128_si256::<0x20>(ul, uh);
        let hi = _mm256_permute2x128_si256::<0x31>(ul, uh);
        (_mm512_cvtepi8_epi16(lo), _mm512_cvtepi8_epi16(hi))
    }
    #[inline(always)]
    unsafe fn scales(a: *const u8, b: *const u8) -> (__m512, __m512) {
        (alternate(halves(a, b), 0, 2), _mm512_setzero_ps())
    }
}

/// `acc + ` the pairwise i16 dot of `a` and `b` (`vpdpwssd`). Written as assembly because
/// LLVM's generic tuning splits the intrinsic into `vpmaddwd` + `vpaddd`, twice the uops.
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let mut acc = acc;
    std::arch::asm!(
        "vpdpwssd {acc}, {a}, {b}",
        acc = inout(zmm_reg) acc,
        a = in(zmm_reg) a,
        b = in(zmm_reg) b,
        options(pure, nomem, nostack, preserves_flags)
    );
    acc
}

/// The 8 values at `p` over the low and the high 8 lanes.
#[inline(always)]
unsafe fn eight_at(p: *const f32) -> __m512 {
    _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))))
}

/// `[v0, v1]` at `p` repeated over 16 lanes.
#[inline(always)]
unsafe fn pair_at(p: *const f32) -> __m512 {
    _mm512_castpd_ps(_mm512_set1_pd((p as *const f64).read_unaligned()))
}

/// See [`super::a16::Tile16Fn`]; `P` is the block format.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<P: Pair, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &Act16View<'_>,
    t0: usize,
    out: &mut [f32; 16],
) {
    let nb = row_bytes / P::BYTES;
    let (no, np) = (a.octets, a.pairs);
    let wp = w.as_ptr();
    let (q, d, s) = (a.q.as_ptr(), a.d.as_ptr(), a.s.as_ptr());
    let (qstride, fstride) = (a.q_stride(), a.f_stride());
    // Rows one after the other: a row's 8 accumulators and unpacked octet fit in registers.
    for i in 0..R {
        let row = wp.add(i * row_bytes);
        let mut acc = [_mm512_setzero_ps(); T];
        for o in 0..no {
            let (regs, dw, mw) = P::octet(row.add(8 * o * P::BYTES));
            for (j, acc_j) in acc.iter_mut().enumerate() {
                let t = t0 + j;
                let xq = q.add(t * qstride + o * OCTET_WORDS);
                let mut c = _mm512_setzero_si512();
                for (k, &r) in regs.iter().enumerate() {
                    c = dpwssd(c, r, _mm512_loadu_si512(xq.add(32 * k).cast()));
                }
                let f = t * fstride + 8 * o;
                let sc = _mm512_mul_ps(dw, eight_at(d.add(f)));
                *acc_j = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), sc, *acc_j);
                if P::MIN {
                    *acc_j = _mm512_fmadd_ps(mw, eight_at(s.add(f)), *acc_j);
                }
            }
        }
        for p in 0..np {
            let ba = 8 * no + 2 * p;
            // An odd last block pairs with itself; its activation partner is the zero pad.
            let bb = if ba + 1 < nb { ba + 1 } else { ba };
            let (pa, pb) = (row.add(ba * P::BYTES), row.add(bb * P::BYTES));
            let (lo, hi) = P::unpack(pa, pb);
            let (dw, mw) = P::scales(pa, pb);
            for (j, acc_j) in acc.iter_mut().enumerate() {
                let t = t0 + j;
                let xq = q.add(t * qstride + no * OCTET_WORDS + p * PAIR_WORDS);
                let xlo = _mm512_loadu_si512(xq.cast());
                let xhi = _mm512_loadu_si512(xq.add(32).cast());
                let c = dpwssd(dpwssd(_mm512_setzero_si512(), lo, xlo), hi, xhi);
                let f = t * fstride + 8 * no + 2 * p;
                let sc = _mm512_mul_ps(dw, pair_at(d.add(f)));
                *acc_j = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), sc, *acc_j);
                if P::MIN {
                    *acc_j = _mm512_fmadd_ps(mw, pair_at(s.add(f)), *acc_j);
                }
            }
        }
        for (j, v) in acc.iter().enumerate() {
            out[i * 8 + j] = _mm512_reduce_add_ps(*v);
        }
    }
}
