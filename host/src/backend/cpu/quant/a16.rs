//! Tile kernels of 32-element weight formats against 16-bit activations (`act16`), and the
//! choice of one for a weight type and an [`Isa`]; the portable kernels live here too.
//!
//! A tile computes up to 2 weight rows x 8 tokens, reading the quantized weight bytes in
//! place: each unpacked block pair is reused across the tile's tokens from registers. Every
//! shape runs the same operations per output in the same order, so a token's result does not
//! depend on the tile (hence the batch) it is computed in.

use super::act16::{word, Act16View, PAIR_WORDS};
use super::dequant::f16_at;
use super::Isa;
use crate::tensor::DType;

/// Largest tile: rows x tokens.
pub(crate) const MAX_ROWS: usize = 2;
pub(crate) const MAX_TOKENS: usize = 8;

/// Computes `out[i * 8 + j] = dot(row i, token t0 + j)` for the kernel's tile shape `R x T`.
///
/// # Safety
/// The kernel's [`Isa`] must be available on this CPU; `w` holds at least `R` rows of
/// `row_bytes` bytes (a whole number of blocks of the kernel's type) starting at row 0 of the
/// tile; `a` holds `t0 + T <= a.n_tokens` tokens quantized for this kernel (octets as its
/// [`Kernel16::octets`] says) from rows of the weight's column count.
pub(crate) type Tile16Fn =
    unsafe fn(w: &[u8], row_bytes: usize, a: &Act16View<'_>, t0: usize, out: &mut [f32; 16]);

/// The 16-bit-activation kernels for one weight type on one ISA: tiles of 2 or 1 rows by 8,
/// 4, 2 or 1 tokens.
#[derive(Clone, Copy)]
pub(crate) struct Kernel16 {
    pub tiles: [Tile16Fn; 8],
    /// The tiles read activations with octets (`act16`); otherwise pairs only.
    pub octets: bool,
}

impl Kernel16 {
    /// The tile function for `r` in {1, 2} rows and `t` in {1, 2, 4, 8} tokens.
    #[inline]
    pub(crate) fn tile(&self, r: usize, t: usize) -> Tile16Fn {
        let col = match t {
            8 => 0,
            4 => 1,
            2 => 2,
            _ => 3,
        };
        self.tiles[usize::from(r != 2) * 4 + col]
    }
}

/// Fills a `[Tile16Fn; 8]` from a kernel generic over `<F, const R, const T>`.
macro_rules! tiles16 {
    ($f:ident :: <$g:ty>) => {
        [
            $f::<$g, 2, 8> as $crate::backend::cpu::quant::a16::Tile16Fn,
            $f::<$g, 2, 4>,
            $f::<$g, 2, 2>,
            $f::<$g, 2, 1>,
            $f::<$g, 1, 8>,
            $f::<$g, 1, 4>,
            $f::<$g, 1, 2>,
            $f::<$g, 1, 1>,
        ]
    };
}
pub(crate) use tiles16;

/// The weight formats these kernels cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl Format {
    pub(crate) fn of(dtype: DType) -> Option<Format> {
        match dtype {
            DType::Q4_0 => Some(Format::Q4_0),
            DType::Q4_1 => Some(Format::Q4_1),
            DType::Q8_0 => Some(Format::Q8_0),
            _ => None,
        }
    }
}

/// The kernel for `dtype` on `isa`, if that weight type has one.
///
/// # Panics
/// If `isa` is not available on this CPU (running its kernels would be undefined behaviour).
pub(crate) fn select(dtype: DType, isa: Isa) -> Option<Kernel16> {
    assert!(
        isa.is_available(),
        "ISA {} is not available on this CPU",
        isa.name()
    );
    let f = Format::of(dtype)?;
    Some(match isa {
        Isa::Scalar => scalar_tiles(f),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => super::a16_avx256::avx2::tiles(f),
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni => super::a16_avx256::avxvnni::tiles(f),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => super::a16_avx512::tiles(f),
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the scalar ISA is available off x86-64"),
    })
}

/// A block format as the portable kernels read it.
trait Block {
    const BYTES: usize;
    /// The block's 32 integer values and `(d, m)`: element e is `d * v[e] + m`.
    fn decode(b: &[u8], v: &mut [i32; 32]) -> (f32, f32);
}

struct Q4_0;
struct Q4_1;
struct Q8_0;

fn nibbles(qs: &[u8], v: &mut [i32; 32], offset: i32) {
    for j in 0..16 {
        v[j] = (qs[j] & 0x0F) as i32 - offset;
        v[j + 16] = (qs[j] >> 4) as i32 - offset;
    }
}

impl Block for Q4_0 {
    const BYTES: usize = 18;
    fn decode(b: &[u8], v: &mut [i32; 32]) -> (f32, f32) {
        nibbles(&b[2..18], v, 8);
        (f16_at(b, 0), 0.0)
    }
}

impl Block for Q4_1 {
    const BYTES: usize = 20;
    fn decode(b: &[u8], v: &mut [i32; 32]) -> (f32, f32) {
        nibbles(&b[4..20], v, 0);
        (f16_at(b, 0), f16_at(b, 2))
    }
}

impl Block for Q8_0 {
    const BYTES: usize = 34;
    fn decode(b: &[u8], v: &mut [i32; 32]) -> (f32, f32) {
        for (o, &q) in v.iter_mut().zip(&b[2..34]) {
            *o = q as i8 as i32;
        }
        (f16_at(b, 0), 0.0)
    }
}

fn scalar_tiles(f: Format) -> Kernel16 {
    Kernel16 {
        tiles: match f {
            Format::Q4_0 => tiles16!(tile::<Q4_0>),
            Format::Q4_1 => tiles16!(tile::<Q4_1>),
            Format::Q8_0 => tiles16!(tile::<Q8_0>),
        },
        octets: false,
    }
}

/// See [`Tile16Fn`]. Safe in itself: slices are bounds-checked.
unsafe fn tile<B: Block, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &Act16View<'_>,
    t0: usize,
    out: &mut [f32; 16],
) {
    for i in 0..R {
        let row = &w[i * row_bytes..(i + 1) * row_bytes];
        for j in 0..T {
            out[i * 8 + j] = dot::<B>(row, a, t0 + j);
        }
    }
}

/// Block b contributes `d_w * d_x * sum(v * q) + m * s_x`, accumulated in f32 in block order.
fn dot<B: Block>(row: &[u8], a: &Act16View<'_>, t: usize) -> f32 {
    assert_eq!(a.octets, 0, "the portable kernels read pairs only");
    let q = &a.q[t * a.q_stride()..(t + 1) * a.q_stride()];
    let (d, s) = (&a.d[t * a.f_stride()..], &a.s[t * a.f_stride()..]);
    let mut v = [0i32; 32];
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(B::BYTES).enumerate() {
        let (dw, m) = B::decode(blk, &mut v);
        let (p, h) = (b / 2, b % 2);
        let isum: i32 = (0..32)
            .map(|e| v[e] * q[p * PAIR_WORDS + word(e, h)] as i32)
            .sum();
        acc += dw * d[b] * isum as f32;
        acc += m * s[b];
    }
    acc
}
