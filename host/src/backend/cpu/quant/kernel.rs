//! Chooses the tile kernel for a weight type and an instruction-set level.
//!
//! A tile kernel computes the dot products of up to 4 weight rows with up to 4 activation
//! tokens, reading the quantized weight bytes in place, so unpacked weights are reused across
//! tokens from registers. Kernels come in six fixed tile shapes (4 or 1 rows x 4, 2 or 1
//! tokens); the driver in `matmul` covers any shape with them.

use super::act::{ActKind, ActView};
use super::Isa;
use crate::tensor::DType;

/// Computes `out[i * 4 + j] = dot(row i, token t0 + j)` for the kernel's tile shape `R x T`.
///
/// # Safety
/// The kernel's [`Isa`] must be available on this CPU; `w` holds at least `R` rows of
/// `row_bytes` bytes (a whole number of blocks of the kernel's type) starting at row 0 of the
/// tile; `a` is laid out as the kernel's [`ActKind`] with `t0 + T <= a.n_tokens` and `a.cols`
/// equal to the row's element count.
pub(crate) type TileFn =
    unsafe fn(w: &[u8], row_bytes: usize, a: &ActView<'_>, t0: usize, out: &mut [f32; 16]);

/// The kernels for one weight type on one ISA.
#[derive(Clone, Copy)]
pub(crate) struct Kernel {
    /// Activation layout the tiles read.
    pub act: ActKind,
    /// Tiles of 4x4, 4x2, 4x1, 1x4, 1x2 and 1x1 rows x tokens.
    pub tiles: [TileFn; 6],
    /// The weight type has no direct kernel: rows are dequantized to f32 and `tiles` are the
    /// F32 kernels.
    pub dequantize_first: bool,
}

impl Kernel {
    /// The tile function for `r` in {1, 4} rows and `t` in {1, 2, 4} tokens.
    #[inline]
    pub(crate) fn tile(&self, r: usize, t: usize) -> TileFn {
        let col = match t {
            4 => 0,
            2 => 1,
            _ => 2,
        };
        self.tiles[usize::from(r != 4) * 3 + col]
    }
}

/// Fills a `[TileFn; 6]` from a kernel generic over `<const R, const T>` (plus any leading
/// generic arguments).
macro_rules! tiles {
    ($f:ident $(:: <$($g:ty),*>)?) => {
        [
            $f::<$($($g,)*)? 4, 4> as $crate::backend::cpu::quant::kernel::TileFn,
            $f::<$($($g,)*)? 4, 2>,
            $f::<$($($g,)*)? 4, 1>,
            $f::<$($($g,)*)? 1, 4>,
            $f::<$($($g,)*)? 1, 2>,
            $f::<$($($g,)*)? 1, 1>,
        ]
    };
}
pub(crate) use tiles;

/// Types that are dequantized to f32 rows before the dot (no direct kernel yet).
fn needs_fallback(dtype: DType) -> bool {
    matches!(dtype, DType::Q2_K | DType::Q3_K | DType::Q5_K)
}

/// The kernel for `dtype` on `isa`.
///
/// # Panics
/// If `isa` is not available on this CPU (running its kernels would be undefined behaviour).
pub(crate) fn select(dtype: DType, isa: Isa) -> Kernel {
    assert!(
        isa.is_available(),
        "ISA {} is not available on this CPU",
        isa.name()
    );
    let direct = if needs_fallback(dtype) {
        DType::F32
    } else {
        dtype
    };
    let (act, tiles) = match isa {
        Isa::Scalar => super::scalar::tiles(direct),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => super::avx2::tiles(direct),
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni => super::avxvnni::tiles(direct),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => super::avx512::tiles(direct),
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the scalar ISA is available off x86-64"),
    };
    Kernel {
        act,
        tiles,
        dequantize_first: needs_fallback(dtype),
    }
}
