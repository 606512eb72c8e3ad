//! Scalar dequantization of the float types and the 32-element block formats (Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0). These are the format definitions every SIMD kernel is tested against.

use half::{bf16, f16};

/// Reads the little-endian f16 at `b[at..at + 2]` as f32.
#[inline]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Reads the little-endian u32 at `b[at..at + 4]`.
#[inline]
pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

pub(crate) fn f32_row(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

pub(crate) fn f16_row(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
    }
}

pub(crate) fn bf16_row(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
    }
}

/// Q4_0: `d: f16, qs[16]`; element j is `d * (nibble - 8)`, low nibbles first.
pub(crate) fn q4_0_block(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = d * ((q & 0x0F) as i32 - 8) as f32;
        y[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
    }
}

/// Q4_1: `d: f16, m: f16, qs[16]`; element j is `d * nibble + m`.
pub(crate) fn q4_1_block(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..16 {
        let q = b[4 + j];
        y[j] = d * (q & 0x0F) as f32 + m;
        y[j + 16] = d * (q >> 4) as f32 + m;
    }
}

/// The 5-bit value of element `j` of a Q5 block: nibble plus bit j of `qh` as bit 4.
#[inline]
fn q5_value(qs: &[u8], qh: u32, j: usize) -> u8 {
    let nib = if j < 16 {
        qs[j] & 0x0F
    } else {
        qs[j - 16] >> 4
    };
    nib | ((((qh >> j) & 1) as u8) << 4)
}

/// Q5_0: `d: f16, qh: u32, qs[16]`; element j is `d * (q5 - 16)`.
pub(crate) fn q5_0_block(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32_at(b, 2);
    for (j, v) in y.iter_mut().enumerate().take(32) {
        *v = d * (q5_value(&b[6..22], qh, j) as i32 - 16) as f32;
    }
}

/// Q5_1: `d: f16, m: f16, qh: u32, qs[16]`; element j is `d * q5 + m`.
pub(crate) fn q5_1_block(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32_at(b, 4);
    for (j, v) in y.iter_mut().enumerate().take(32) {
        *v = d * q5_value(&b[8..24], qh, j) as f32 + m;
    }
}

/// Q8_0: `d: f16, qs: [i8; 32]`; element j is `d * qs[j]`.
pub(crate) fn q8_0_block(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = d * (b[2 + j] as i8) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_bits().to_le_bytes()
    }

    #[test]
    fn q4_1_hand_block() {
        let mut b = vec![0u8; 20];
        b[0..2].copy_from_slice(&f16_bytes(0.5));
        b[2..4].copy_from_slice(&f16_bytes(-1.0));
        b[4] = 0xA3; // element 0 = 3, element 16 = 10
        let mut y = [0f32; 32];
        q4_1_block(&b, &mut y);
        assert_eq!(y[0], 0.5 * 3.0 - 1.0);
        assert_eq!(y[16], 0.5 * 10.0 - 1.0);
        assert_eq!(y[1], -1.0);
    }

    #[test]
    fn q5_0_high_bits_come_from_qh() {
        let mut b = vec![0u8; 22];
        b[0..2].copy_from_slice(&f16_bytes(1.0));
        b[2..6].copy_from_slice(&(1u32 << 17 | 1).to_le_bytes());
        b[6 + 1] = 0x20; // element 1 = 0, element 17 = 2
        let mut y = [0f32; 32];
        q5_0_block(&b, &mut y);
        assert_eq!(y[0], 0.0); // 16 - 16
        assert_eq!(y[1], -16.0);
        assert_eq!(y[17], (2 + 16 - 16) as f32);
    }
}
