//! Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11): a draw is a pure
//! function of (key, counter), so a sequence's samples depend only on its seed and step, never
//! on the batch it runs in or on the order rows are processed.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

#[inline]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

/// The Philox4x32 block function with 10 rounds.
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// Four 32-bit words of the stream keyed by `seed` at position (`step`, `lane`).
pub fn words(seed: u64, step: u64, lane: u32) -> [u32; 4] {
    philox4x32(
        [step as u32, (step >> 32) as u32, lane, 0],
        [seed as u32, (seed >> 32) as u32],
    )
}

/// A uniform draw in [0, 1) with 53 random bits, from the stream keyed by `seed` at
/// position (`step`, `lane`). Use `lane` 0 for the token draw and other lanes for extra draws
/// within one step.
pub fn uniform(seed: u64, step: u64, lane: u32) -> f64 {
    let w = words(seed, step, lane);
    let bits = ((w[0] as u64) << 32 | w[1] as u64) >> 11;
    bits as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    // Known-answer vectors from the Random123 distribution (kat_vectors, philox4x32 10).
    #[test]
    fn matches_random123_known_answers() {
        assert_eq!(
            philox4x32([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn uniform_is_in_range_and_spread() {
        let draws: Vec<f64> = (0..10_000).map(|s| uniform(42, s, 0)).collect();
        assert!(draws.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
        assert_ne!(uniform(42, 7, 0), uniform(43, 7, 0));
        assert_ne!(uniform(42, 7, 0), uniform(42, 7, 1));
    }
}
