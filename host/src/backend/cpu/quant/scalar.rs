//! Portable tile kernels: the reference the SIMD kernels are tested against, and the path on
//! CPUs without AVX2. Same arithmetic as the SIMD kernels (integer block dots on 8-bit
//! activations), written plainly.

use super::act::{ActKind, ActView, LANES, Q8K_BLOCK, Q8_BLOCK};
use super::dequant::{f16_at, u32_at};
use super::dequant_k::{k4_scales_mins, q6_k_value};
use super::kernel::{tiles, TileFn};
use crate::tensor::DType;
use half::{bf16, f16};

/// The kernels for `dtype` (never a fallback type).
pub(crate) fn tiles(dtype: DType) -> (ActKind, [TileFn; 6]) {
    match dtype {
        DType::F32 => (ActKind::F32, tiles!(tile::<F32>)),
        DType::F16 => (ActKind::F32, tiles!(tile::<F16>)),
        DType::BF16 => (ActKind::F32, tiles!(tile::<BF16>)),
        DType::Q4_0 => (ActKind::Q8, tiles!(tile::<Q4_0>)),
        DType::Q4_1 => (ActKind::Q8, tiles!(tile::<Q4_1>)),
        DType::Q5_0 => (ActKind::Q8, tiles!(tile::<Q5_0>)),
        DType::Q5_1 => (ActKind::Q8, tiles!(tile::<Q5_1>)),
        DType::Q8_0 => (ActKind::Q8, tiles!(tile::<Q8_0>)),
        DType::Q4_K => (ActKind::Q8K, tiles!(tile::<Q4K>)),
        DType::Q6_K => (ActKind::Q8K, tiles!(tile::<Q6K>)),
        DType::Q2_K | DType::Q3_K | DType::Q5_K => unreachable!("{dtype} is dequantized first"),
    }
}

/// The dot product of one weight row with token `t`.
trait RowDot {
    fn dot(row: &[u8], a: &ActView<'_>, t: usize) -> f32;
}

/// See [`TileFn`]. Safe in itself: slices are bounds-checked.
unsafe fn tile<D: RowDot, const R: usize, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    a: &ActView<'_>,
    t0: usize,
    out: &mut [f32; 16],
) {
    for i in 0..R {
        let row = &w[i * row_bytes..(i + 1) * row_bytes];
        for j in 0..T {
            out[i * 4 + j] = D::dot(row, a, t0 + j);
        }
    }
}

struct F32;
struct F16;
struct BF16;

fn float_dot(row: &[u8], a: &ActView<'_>, t: usize, width: usize, f: fn(&[u8]) -> f32) -> f32 {
    let x = &a.x[t * a.cols..(t + 1) * a.cols];
    row.chunks_exact(width).zip(x).map(|(c, &v)| f(c) * v).sum()
}

impl RowDot for F32 {
    fn dot(row: &[u8], a: &ActView<'_>, t: usize) -> f32 {
        float_dot(row, a, t, 4, |c| {
            f32::from_le_bytes([c[0], c[1], c[2], c[3]])
        })
    }
}

impl RowDot for F16 {
    fn dot(row: &[u8], a: &ActView<'_>, t: usize) -> f32 {
        float_dot(row, a, t, 2, |c| {
            f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()
        })
    }
}

impl RowDot for BF16 {
    fn dot(row: &[u8], a: &ActView<'_>, t: usize) -> f32 {
        float_dot(row, a, t, 2, |c| {
            bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()
        })
    }
}

/// A 32-element format: block `b` contributes `d * dx * sum(v * xq) + m * sx`, with `v` the
/// block's integer values, `dx` the activation scale and `sx = dx * sum(xq)`.
trait Legacy {
    const BYTES: usize;
    /// Writes the block's integer values and returns `(d, m)`.
    fn decode(b: &[u8], v: &mut [i8; 32]) -> (f32, f32);
}

fn legacy_dot<L: Legacy>(row: &[u8], a: &ActView<'_>, t: usize) -> f32 {
    let qs = &a.qs[t * a.qs_stride..];
    let (scale, sum) = (&a.scale[t * a.f_stride..], &a.sum[t * a.f_stride..]);
    let mut v = [0i8; 32];
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(L::BYTES).enumerate() {
        let (d, m) = L::decode(blk, &mut v);
        let xq = &qs[b * Q8_BLOCK..(b + 1) * Q8_BLOCK];
        let isum: i32 = v.iter().zip(xq).map(|(&w, &x)| w as i32 * x as i32).sum();
        acc += d * scale[b * LANES] * isum as f32 + m * (sum[b * LANES] * LANES as f32);
    }
    acc
}

fn nibbles(qs: &[u8], v: &mut [i8; 32], offset: i8) {
    for j in 0..16 {
        v[j] = (qs[j] & 0x0F) as i8 - offset;
        v[j + 16] = (qs[j] >> 4) as i8 - offset;
    }
}

fn with_high_bits(qh: u32, v: &mut [i8; 32], offset: i8) {
    for (j, x) in v.iter_mut().enumerate() {
        *x += ((qh >> j & 1) << 4) as i8 - offset;
    }
}

struct Q4_0;
struct Q4_1;
struct Q5_0;
struct Q5_1;
struct Q8_0;

impl Legacy for Q4_0 {
    const BYTES: usize = 18;
    fn decode(b: &[u8], v: &mut [i8; 32]) -> (f32, f32) {
        nibbles(&b[2..18], v, 8);
        (f16_at(b, 0), 0.0)
    }
}

impl Legacy for Q4_1 {
    const BYTES: usize = 20;
    fn decode(b: &[u8], v: &mut [i8; 32]) -> (f32, f32) {
        nibbles(&b[4..20], v, 0);
        (f16_at(b, 0), f16_at(b, 2))
    }
}

impl Legacy for Q5_0 {
    const BYTES: usize = 22;
    fn decode(b: &[u8], v: &mut [i8; 32]) -> (f32, f32) {
        nibbles(&b[6..22], v, 0);
        with_high_bits(u32_at(b, 2), v, 16);
        (f16_at(b, 0), 0.0)
    }
}

impl Legacy for Q5_1 {
    const BYTES: usize = 24;
    fn decode(b: &[u8], v: &mut [i8; 32]) -> (f32, f32) {
        nibbles(&b[8..24], v, 0);
        with_high_bits(u32_at(b, 4), v, 0);
        (f16_at(b, 0), f16_at(b, 2))
    }
}

impl Legacy for Q8_0 {
    const BYTES: usize = 34;
    fn decode(b: &[u8], v: &mut [i8; 32]) -> (f32, f32) {
        for (x, &q) in v.iter_mut().zip(&b[2..34]) {
            *x = q as i8;
        }
        (f16_at(b, 0), 0.0)
    }
}

macro_rules! legacy_row_dot {
    ($($t:ty),*) => {$(
        impl RowDot for $t {
            fn dot(row: &[u8], a: &ActView<'_>, t: usize) -> f32 {
                legacy_dot::<$t>(row, a, t)
            }
        }
    )*};
}
legacy_row_dot!(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0);

struct Q4K;
struct Q6K;

impl RowDot for Q4K {
    fn dot(row: &[u8], a: &ActView<'_>, t: usize) -> f32 {
        let mut acc = 0f32;
        for (s, b) in row.chunks_exact(144).enumerate() {
            let xq = &a.qs[t * a.qs_stride + s * Q8K_BLOCK..][..Q8K_BLOCK];
            let bsums = &a.bsums[t * a.bsums_stride + s * 16..][..16];
            let dx = a.scale[t * a.f_stride + s];
            let (sc, mn) = k4_scales_mins(&b[4..16]);
            let (mut isum, mut msum) = (0i32, 0i32);
            for g in 0..8 {
                let q = &b[16 + 32 * (g / 2)..][..32];
                let shift = 4 * (g % 2);
                let dot: i32 = (0..32)
                    .map(|l| ((q[l] >> shift) & 0x0F) as i32 * xq[32 * g + l] as i32)
                    .sum();
                isum += sc[g] as i32 * dot;
                msum += mn[g] as i32 * (bsums[2 * g] as i32 + bsums[2 * g + 1] as i32);
            }
            acc += dx * (f16_at(b, 0) * isum as f32 - f16_at(b, 2) * msum as f32);
        }
        acc
    }
}

impl RowDot for Q6K {
    fn dot(row: &[u8], a: &ActView<'_>, t: usize) -> f32 {
        let mut acc = 0f32;
        for (s, b) in row.chunks_exact(210).enumerate() {
            let xq = &a.qs[t * a.qs_stride + s * Q8K_BLOCK..][..Q8K_BLOCK];
            let dx = a.scale[t * a.f_stride + s];
            let (ql, qh) = (&b[0..128], &b[128..192]);
            let mut isum = 0i32;
            for g in 0..16 {
                let dot: i32 = (16 * g..16 * g + 16)
                    .map(|e| (q6_k_value(ql, qh, e) as i32 - 32) * xq[e] as i32)
                    .sum();
                isum += (b[192 + g] as i8) as i32 * dot;
            }
            acc += dx * f16_at(b, 208) * isum as f32;
        }
        acc
    }
}
