//! Scalar dequantization of the 256-element "K" super-block formats (Q2_K .. Q6_K), plus the
//! 6-bit scale unpacking that Q4_K and Q5_K share with their dot-product kernels.

use super::dequant::f16_at;

/// Unpacks the eight 6-bit (scale, min) pairs of a Q4_K / Q5_K super-block from its 12 bytes.
pub(crate) fn k4_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

/// Q2_K (84 bytes): `scales[16], qs[64], d: f16, dmin: f16`; 16 groups of 16 two-bit values,
/// each group with a 4-bit scale (low nibble) and 4-bit min (high nibble).
pub(crate) fn q2_k_block(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let scales = &b[0..16];
    let mut group = 0;
    for half in 0..2 {
        let q = &b[16 + 32 * half..16 + 32 * half + 32];
        for shift in [0u32, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[group];
                let (dl, ml) = (d * (sc & 0x0F) as f32, dmin * (sc >> 4) as f32);
                let base = 16 * group;
                for l in 0..16 {
                    y[base + l] = dl * ((q[16 * part + l] >> shift) & 3) as f32 - ml;
                }
                group += 1;
            }
        }
    }
}

/// Unpacks the sixteen 6-bit scales of a Q3_K super-block (stored with a +32 bias).
fn q3_k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for j in 0..16 {
        let low = if j < 8 { s[j] & 0x0F } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        out[j] = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// Q3_K (110 bytes): `hmask[32], qs[64], scales[12], d: f16`; 3-bit values (2 low bits in `qs`,
/// the third in `hmask`, set meaning "no -4"), 16 groups of 16 with signed 6-bit scales.
pub(crate) fn q3_k_block(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 108);
    let hmask = &b[0..32];
    let scales = q3_k_scales(&b[96..108]);
    let mut group = 0;
    let mut bit = 0u32;
    for half in 0..2 {
        let q = &b[32 + 32 * half..32 + 32 * half + 32];
        for shift in [0u32, 2, 4, 6] {
            for part in 0..2 {
                let dl = d * scales[group] as f32;
                let base = 16 * group;
                for l in 0..16 {
                    let i = 16 * part + l;
                    let low = ((q[i] >> shift) & 3) as i32;
                    let sub = if hmask[i] >> bit & 1 == 1 { 0 } else { 4 };
                    y[base + l] = dl * (low - sub) as f32;
                }
                group += 1;
            }
            bit += 1;
        }
    }
}

/// Q4_K (144 bytes): `d: f16, dmin: f16, scales[12], qs[128]`; 8 groups of 32 four-bit values.
/// Bytes `32c..32c+32` of `qs` hold group `2c` in their low nibbles and `2c+1` in the high ones.
pub(crate) fn q4_k_block(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = k4_scales_mins(&b[4..16]);
    for c in 0..4 {
        let q = &b[16 + 32 * c..16 + 32 * c + 32];
        for (g, shift) in [(2 * c, 0u32), (2 * c + 1, 4)] {
            let (dl, ml) = (d * sc[g] as f32, dmin * mn[g] as f32);
            for l in 0..32 {
                y[32 * g + l] = dl * ((q[l] >> shift) & 0x0F) as f32 - ml;
            }
        }
    }
}

/// Q5_K (176 bytes): `d, dmin, scales[12], qh[32], qs[128]`; Q4_K plus a fifth bit per value,
/// bit `g` of `qh[l]` for element `l` of group `g`.
pub(crate) fn q5_k_block(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = k4_scales_mins(&b[4..16]);
    let qh = &b[16..48];
    for c in 0..4 {
        let q = &b[48 + 32 * c..48 + 32 * c + 32];
        for (g, shift) in [(2 * c, 0u32), (2 * c + 1, 4)] {
            let (dl, ml) = (d * sc[g] as f32, dmin * mn[g] as f32);
            for l in 0..32 {
                let v = ((q[l] >> shift) & 0x0F) | (((qh[l] >> g) & 1) << 4);
                y[32 * g + l] = dl * v as f32 - ml;
            }
        }
    }
}

/// The unsigned 6-bit value (0..=63, stored with a +32 bias) of element `e` of a Q6_K block.
#[inline]
pub(crate) fn q6_k_value(ql: &[u8], qh: &[u8], e: usize) -> u8 {
    let (half, r) = (e / 128, e % 128);
    let (quarter, l) = (r / 32, r % 32);
    let lo_byte = ql[64 * half + 32 * (quarter & 1) + l];
    let lo = if quarter < 2 {
        lo_byte & 0x0F
    } else {
        lo_byte >> 4
    };
    let hi = (qh[32 * half + l] >> (2 * quarter)) & 3;
    lo | (hi << 4)
}

/// Q6_K (210 bytes): `ql[128], qh[64], scales: [i8; 16], d: f16`; 16 groups of 16 six-bit
/// values with signed 8-bit scales; element e uses scale e / 16.
pub(crate) fn q6_k_block(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    let (ql, qh) = (&b[0..128], &b[128..192]);
    for (e, v) in y.iter_mut().enumerate().take(256) {
        let sc = b[192 + e / 16] as i8;
        *v = d * sc as f32 * (q6_k_value(ql, qh, e) as i32 - 32) as f32;
    }
}
