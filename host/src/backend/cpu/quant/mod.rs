//! GGML block formats: dequantization and dot products computed directly on quantized blocks.
//!
//! `dequant*` define each format (scalar, the reference); `act` quantizes f32 activations to
//! the 8-bit blocks the integer kernels consume; `scalar`, `avx2`/`avxvnni` (256-bit) and
//! `avx512` hold the tile kernels; `kernel` picks one for a weight type and an [`Isa`]. This
//! module never allocates weights: kernels read the quantized bytes where they lie.
//!
//! The default precision of the 32-element formats Q4_0, Q4_1 and Q8_0 is 16-bit activations:
//! `act16` quantizes them, `a16` (portable), `a16_avx256` and `a16_avx512` hold their tiles.

pub(crate) mod a16;
#[cfg(target_arch = "x86_64")]
mod a16_avx256;
#[cfg(target_arch = "x86_64")]
mod a16_avx512;
pub(crate) mod act;
pub(crate) mod act16;
#[cfg(target_arch = "x86_64")]
mod act_avx2;
#[cfg(target_arch = "x86_64")]
mod avx256;
#[cfg(target_arch = "x86_64")]
mod avx256_k;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_k;
pub(crate) mod dequant;
pub(crate) mod dequant_k;
mod isa;
pub(crate) mod kernel;
mod scalar;

#[cfg(target_arch = "x86_64")]
use avx256::{avx2, avxvnni};

pub use isa::Isa;

use crate::tensor::DType;

/// Dequantizes `out.len()` elements (a whole number of blocks) stored as `dtype` in `bytes`.
///
/// # Panics
/// If `out.len()` is not a whole number of `dtype` blocks or `bytes` is shorter than those
/// blocks: both are programming errors (loaders validate tensor sizes).
pub fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    let n = out.len();
    let need = dtype
        .bytes_for(n)
        .unwrap_or_else(|| panic!("dequantize_row: {n} is not a whole number of {dtype} blocks"));
    assert!(
        bytes.len() >= need,
        "dequantize_row: {n} {dtype} elements need {need} bytes, got {}",
        bytes.len()
    );
    let bytes = &bytes[..need];
    let block: fn(&[u8], &mut [f32]) = match dtype {
        DType::F32 => return dequant::f32_row(bytes, out),
        DType::F16 => return dequant::f16_row(bytes, out),
        DType::BF16 => return dequant::bf16_row(bytes, out),
        DType::Q4_0 => dequant::q4_0_block,
        DType::Q4_1 => dequant::q4_1_block,
        DType::Q5_0 => dequant::q5_0_block,
        DType::Q5_1 => dequant::q5_1_block,
        DType::Q8_0 => dequant::q8_0_block,
        DType::Q2_K => dequant_k::q2_k_block,
        DType::Q3_K => dequant_k::q3_k_block,
        DType::Q4_K => dequant_k::q4_k_block,
        DType::Q5_K => dequant_k::q5_k_block,
        DType::Q6_K => dequant_k::q6_k_block,
    };
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    for (y, b) in out.chunks_exact_mut(be).zip(bytes.chunks_exact(bb)) {
        block(b, y);
    }
}

#[cfg(test)]
mod a16_tests;
#[cfg(test)]
mod fixture_tests;
#[cfg(test)]
mod kernel_tests;
#[cfg(test)]
pub(crate) mod test_util;
