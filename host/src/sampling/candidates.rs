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
const LANES: usize = 16;

/// The largest value of `chunk`, ignoring NaN (-inf if there is none); written with independent
/// lanes so that it vectorizes.
fn chunk_max(chunk: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut it = chunk.chunks_exact(LANES);
    for v in &mut it {
        let v: &[f32; LANES] = v.try_into().expect("chunks_exact yields whole lanes");
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

/// The sparse path splits the row into groups and takes each group's maximum. A group is one
/// lane of a block: block `b` holds logits `b*BLOCK .. (b+1)*BLOCK` as rows of `GROUP_LANES`,
/// and lane `l` of it is every `GROUP_LANES`-th logit from `b*BLOCK + l` (`BLOCK_ROWS` of
/// them). Column maxima of a block need no horizontal reduction, so the pass vectorizes. The
/// tail after the last whole block is cut into contiguous groups of `GROUP_LANES`.
const GROUP_LANES: usize = 16;
const BLOCK_ROWS: usize = 32;
const BLOCK: usize = GROUP_LANES * BLOCK_ROWS;
const SPARSE_MIN_RATIO: usize = 4;

/// Each group's maximum, NaN ignored (-inf when it has no other value).
fn group_maxima(logits: &[f32], maxima: &mut Vec<f32>) {
    let mut blocks = logits.chunks_exact(BLOCK);
    for block in &mut blocks {
        let mut acc = [f32::NEG_INFINITY; GROUP_LANES];
        for row in block.chunks_exact(GROUP_LANES) {
            let row: &[f32; GROUP_LANES] = row.try_into().expect("chunks_exact yields whole rows");
            for k in 0..GROUP_LANES {
                if row[k] > acc[k] {
                    acc[k] = row[k];
                }
            }
        }
        maxima.extend_from_slice(&acc);
    }
    maxima.extend(blocks.remainder().chunks(GROUP_LANES).map(chunk_max));
}

/// Calls `f(id, logit)` for every logit of group `g`.
fn for_group(logits: &[f32], g: usize, mut f: impl FnMut(usize, f32)) {
    let whole_groups = logits.len() / BLOCK * GROUP_LANES;
    if g < whole_groups {
        let start = g / GROUP_LANES * BLOCK + g % GROUP_LANES;
        for i in (start..start + BLOCK).step_by(GROUP_LANES) {
            f(i, logits[i]);
        }
    } else {
        let start = logits.len() / BLOCK * BLOCK + (g - whole_groups) * GROUP_LANES;
        for (i, &l) in logits
            .iter()
            .enumerate()
            .take(start + GROUP_LANES)
            .skip(start)
        {
            f(i, l);
        }
    }
}

/// The fast path for a large vocabulary: the k-th largest group maximum is a lower bound of
/// the k-th largest logit (those k maxima are k distinct logits at least that large), so only
/// groups whose maximum reaches it are scanned. Returns false (leaving `out` empty) when the
/// bound is useless (-inf), and the caller falls back to the one-pass scan.
fn sparse_top_k(logits: &[f32], k: usize, out: &mut Vec<Candidate>) -> bool {
    let mut maxima = Vec::with_capacity(logits.len() / BLOCK_ROWS + GROUP_LANES);
    group_maxima(logits, &mut maxima);
    let mut order = maxima.clone();
    order.select_nth_unstable_by(k - 1, |a, b| b.partial_cmp(a).unwrap_or(Ordering::Equal));
    let bound = order[k - 1];
    if bound == f32::NEG_INFINITY {
        return false;
    }
    for (g, &m) in maxima.iter().enumerate() {
        if m >= bound {
            for_group(logits, g, |i, l| {
                if l >= bound {
                    out.push(Candidate {
                        id: i as TokenId,
                        logit: l,
                    });
                }
            });
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
    if logits.len() >= SPARSE_MIN_RATIO * k * BLOCK_ROWS && sparse_top_k(logits, k, out) {
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
            out.push(Candidate {
                id: (c * CHUNK + j) as TokenId,
                logit: l,
            });
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
        let ties: Vec<f32> = (0..49_152u32)
            .map(|i| ((i * 7919) % 10007) as f32)
            .collect();
        let mut z = 7u64;
        let random: Vec<f32> = (0..49_152)
            .map(|_| {
                z = z
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
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
