//! Choosing a row's candidates on the host: the top-K logits in one pass over the vocabulary,
//! with the same order as `sampling::top_k_candidates` (highest first, ties by lower id, NaN
//! as -inf) but without sorting or copying the whole vocabulary.

use std::cmp::Ordering;

use crate::ids::TokenId;
use crate::sampling::Candidate;

fn better(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit
        .partial_cmp(&a.logit)
        .unwrap_or(Ordering::Equal)
        .then(a.id.cmp(&b.id))
}

const CHUNK: usize = 64;
const LANES: usize = 8;

/// The largest value of `chunk`, ignoring NaN (-inf if there is none); written with independent
/// lanes so that it vectorizes.
fn chunk_max(chunk: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut it = chunk.chunks_exact(LANES);
    for v in &mut it {
        for k in 0..LANES {
            if v[k] > acc[k] {
                acc[k] = v[k];
            }
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &x in acc.iter().chain(it.remainder()) {
        if x > m {
            m = x;
        }
    }
    m
}

const SCAN_CHUNK: usize = 16;
const SPARSE_MIN_RATIO: usize = 4;

/// The fast path for a large vocabulary: the k-th largest of the per-chunk maxima is a lower
/// bound of the k-th largest logit (those k maxima are k distinct logits at least that large),
/// so only chunks whose maximum reaches it are scanned. Returns false (leaving `out` empty)
/// when the bound is useless (-inf), and the caller falls back to the one-pass scan.
fn sparse_top_k(logits: &[f32], k: usize, out: &mut Vec<Candidate>) -> bool {
    let maxima: Vec<f32> = logits.chunks(SCAN_CHUNK).map(chunk_max).collect();
    let mut order = maxima.clone();
    order.select_nth_unstable_by(k - 1, |a, b| b.partial_cmp(a).unwrap_or(Ordering::Equal));
    let bound = order[k - 1];
    if bound == f32::NEG_INFINITY {
        return false;
    }
    for (c, (chunk, &m)) in logits.chunks(SCAN_CHUNK).zip(&maxima).enumerate() {
        if m < bound {
            continue;
        }
        for (j, &l) in chunk.iter().enumerate() {
            if l >= bound {
                out.push(Candidate { id: (c * SCAN_CHUNK + j) as TokenId, logit: l });
            }
        }
    }
    if out.len() > k {
        out.select_nth_unstable_by(k - 1, better);
        out.truncate(k);
    }
    out.sort_unstable_by(better);
    true
}

/// Writes the `k` best candidates of `logits` into `out` (cleared first), best first.
pub fn top_k_into(logits: &[f32], k: usize, out: &mut Vec<Candidate>) {
    out.clear();
    let k = k.min(logits.len());
    if k == 0 {
        return;
    }
    if logits.len() >= SPARSE_MIN_RATIO * k * SCAN_CHUNK && sparse_top_k(logits, k, out) {
        return;
    }
    // Keep a buffer of up to `cap` contenders; when it fills, cut it to the best k and raise
    // the bar to the k-th logit. A later token at or under the bar has a higher id than every
    // kept token with that logit, so it can never enter.
    let cap = (2 * k).max(k + 64);
    let mut bar = f32::NEG_INFINITY;
    let mut cut = false;
    for (c, chunk) in logits.chunks(CHUNK).enumerate() {
        // Once the bar is set, most chunks hold nothing above it: skip them on their maximum.
        if cut && chunk_max(chunk) <= bar {
            continue;
        }
        for (j, &l) in chunk.iter().enumerate() {
            let l = if l.is_nan() { f32::NEG_INFINITY } else { l };
            if cut && l <= bar {
                continue;
            }
            out.push(Candidate { id: (c * CHUNK + j) as TokenId, logit: l });
            if out.len() == cap {
                out.select_nth_unstable_by(k - 1, better);
                out.truncate(k);
                bar = out[k - 1].logit;
                cut = true;
            }
        }
    }
    if out.len() > k {
        out.select_nth_unstable_by(k - 1, better);
        out.truncate(k);
    }
    out.sort_unstable_by(better);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::top_k_candidates;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn matches_the_reference_selection(
            logits in prop::collection::vec(prop_oneof![
                -4i32..4i32, // many ties
                Just(i32::MIN), // stands for NaN
            ], 0..700),
            k in 0usize..300,
        ) {
            let logits: Vec<f32> = logits.iter().map(|&v| if v == i32::MIN { f32::NAN } else { v as f32 * 0.5 }).collect();
            let mut out = Vec::new();
            top_k_into(&logits, k, &mut out);
            prop_assert_eq!(out, top_k_candidates(&logits, k));
        }
    }

    proptest! {
        // Long rows and small k take the sparse path (chunk maxima as a bound).
        #[test]
        fn the_sparse_path_matches_the_reference(
            logits in prop::collection::vec(prop_oneof![
                8 => -3i32..3i32,
                1 => Just(i32::MIN),     // NaN
                1 => Just(i32::MIN + 1), // -inf
            ], 500..3000),
            k in 1usize..12,
        ) {
            let logits: Vec<f32> = logits.iter().map(|&v| match v {
                i32::MIN => f32::NAN,
                v if v == i32::MIN + 1 => f32::NEG_INFINITY,
                v => v as f32,
            }).collect();
            let mut out = Vec::new();
            top_k_into(&logits, k, &mut out);
            prop_assert_eq!(out, top_k_candidates(&logits, k));
        }
    }

    #[test]
    fn handles_a_large_vocabulary() {
        let ties: Vec<f32> = (0..49_152u32).map(|i| ((i * 7919) % 10007) as f32).collect();
        let mut z = 7u64;
        let random: Vec<f32> = (0..49_152)
            .map(|_| {
                z = z.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (z >> 40) as f32
            })
            .collect();
        let mut all_neg_inf = vec![f32::NEG_INFINITY; 49_152];
        all_neg_inf[777] = f32::NAN;
        let mut out = Vec::new();
        for logits in [&ties, &random, &all_neg_inf] {
            for k in [1, 50, 256, 1000] {
                top_k_into(logits, k, &mut out);
                assert_eq!(out, top_k_candidates(logits, k), "k = {k}");
            }
        }
    }
}
