//! Test helpers: a small deterministic PRNG and random but valid weights of every type.

use std::sync::Arc;

use super::dequantize_row;
use crate::tensor::{Bytes, DType, Weight};

/// SplitMix64: deterministic, no dependencies.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub(crate) fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.unit() * 2.0).collect()
    }
}

/// Byte offsets of the f16 scale fields in one block of `dtype`.
fn scale_offsets(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => &[],
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
    }
}

/// A `rows x cols` weight of random blocks with finite scales of sane magnitude.
pub(crate) fn random_weight(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Weight {
    let n = rows * cols;
    let nbytes = dtype.bytes_for(n).expect("whole blocks");
    let mut bytes = Vec::with_capacity(nbytes);
    match dtype {
        DType::F32 => (0..n).for_each(|_| bytes.extend_from_slice(&rng.unit().to_le_bytes())),
        DType::F16 => (0..n)
            .for_each(|_| bytes.extend_from_slice(&half::f16::from_f32(rng.unit()).to_le_bytes())),
        DType::BF16 => (0..n)
            .for_each(|_| bytes.extend_from_slice(&half::bf16::from_f32(rng.unit()).to_le_bytes())),
        _ => {
            bytes.extend((0..nbytes).map(|_| rng.next_u64() as u8));
            for block in bytes.chunks_exact_mut(dtype.block_bytes()) {
                for &off in scale_offsets(dtype) {
                    let mag = 10f32.powf(-2.0 + 1.5 * (rng.unit() + 1.0) / 2.0);
                    let v = if rng.unit() < 0.0 { -mag } else { mag };
                    block[off..off + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                }
            }
        }
    }
    Weight {
        dtype,
        rows,
        cols,
        data: Bytes::Owned(Arc::new(bytes)),
    }
}

/// The weight dequantized to f32, row-major.
pub(crate) fn dequantized(w: &Weight) -> Vec<f32> {
    let mut out = vec![0f32; w.rows * w.cols];
    let rb = w.row_bytes();
    for (r, row) in out.chunks_exact_mut(w.cols.max(1)).enumerate().take(w.rows) {
        dequantize_row(w.dtype, &w.bytes()[r * rb..(r + 1) * rb], row);
    }
    out
}
