//! The native sampler: greedy, temperature, top-k, top-p, min-p, penalties and logit bias,
//! drawing from a counter-based random stream keyed by (seed, step) so that a sequence's
//! samples never depend on the batch it runs in.

use super::SamplingParams;
use crate::ids::TokenId;

/// A token and its (processed) logit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub id: TokenId,
    pub logit: f32,
}

/// The `k` highest logits, highest first (ties broken by the lower id, so the order is total).
pub fn top_k_candidates(logits: &[f32], k: usize) -> Vec<Candidate> {
    let k = k.min(logits.len());
    if k == 0 {
        return Vec::new();
    }
    let better = |a: &Candidate, b: &Candidate| {
        b.logit
            .partial_cmp(&a.logit)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.id.cmp(&b.id))
    };
    let mut all: Vec<Candidate> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| Candidate {
            id: i as TokenId,
            logit: if l.is_nan() { f32::NEG_INFINITY } else { l },
        })
        .collect();
    if k < all.len() {
        all.select_nth_unstable_by(k - 1, better);
        all.truncate(k);
    }
    all.sort_by(better);
    all
}

/// A uniform draw in [0, 1) from the stream (seed, step): SplitMix64 over the mixed counter.
pub fn uniform(seed: u64, step: u64) -> f64 {
    let mut z = seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Samples one token from full logits. `history` is the sequence's tokens so far (prompt and
/// output), used by the penalties.
pub fn sample_native(
    logits: &[f32],
    params: &SamplingParams,
    seed: u64,
    step: u64,
    history: &[TokenId],
) -> TokenId {
    let needs_processing = params.repetition_penalty != 1.0
        || params.presence_penalty != 0.0
        || params.frequency_penalty != 0.0
        || !params.logit_bias.is_empty();
    let processed;
    let logits = if needs_processing {
        let mut l = logits.to_vec();
        apply_penalties(&mut l, params, history);
        processed = l;
        &processed[..]
    } else {
        logits
    };
    if params.is_greedy() {
        return top_k_candidates(logits, 1).first().map_or(0, |c| c.id);
    }
    let k = if params.top_k == 0 {
        logits.len()
    } else {
        params.top_k as usize
    };
    let mut cands = top_k_candidates(logits, k);
    let t = params.temperature;
    let max = cands[0].logit;
    let mut probs: Vec<f64> = cands
        .iter()
        .map(|c| (((c.logit - max) / t) as f64).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    // min-p: drop tokens below min_p times the top probability.
    let mut keep = probs.len();
    if params.min_p > 0.0 {
        let floor = probs[0] * params.min_p as f64;
        keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
    }
    // top-p: the smallest prefix whose mass reaches top_p.
    if params.top_p < 1.0 {
        let mut acc = 0.0;
        let mut n = 0;
        for p in &probs[..keep] {
            acc += p;
            n += 1;
            if acc >= params.top_p as f64 {
                break;
            }
        }
        keep = n.max(1);
    }
    cands.truncate(keep);
    probs.truncate(keep);
    let mass: f64 = probs.iter().sum();
    let mut u = uniform(seed, step) * mass;
    for (c, p) in cands.iter().zip(&probs) {
        if u < *p {
            return c.id;
        }
        u -= p;
    }
    cands[keep - 1].id
}

/// Repetition (multiplicative, CTRL-style), presence and frequency penalties, then logit bias.
pub fn apply_penalties(logits: &mut [f32], params: &SamplingParams, history: &[TokenId]) {
    if params.repetition_penalty != 1.0
        || params.presence_penalty != 0.0
        || params.frequency_penalty != 0.0
    {
        let mut counts = std::collections::HashMap::<TokenId, u32>::new();
        for &t in history {
            *counts.entry(t).or_default() += 1;
        }
        for (&t, &n) in &counts {
            let Some(l) = logits.get_mut(t as usize) else {
                continue;
            };
            if params.repetition_penalty != 1.0 {
                *l = if *l > 0.0 {
                    *l / params.repetition_penalty
                } else {
                    *l * params.repetition_penalty
                };
            }
            *l -= params.presence_penalty + params.frequency_penalty * n as f32;
        }
    }
    for &(t, b) in &params.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_orders_and_breaks_ties_by_id() {
        let c = top_k_candidates(&[1.0, 3.0, 3.0, -1.0, f32::NAN], 3);
        let ids: Vec<_> = c.iter().map(|c| c.id).collect();
        assert_eq!(ids, vec![1, 2, 0]);
    }

    #[test]
    fn greedy_picks_argmax() {
        let p = SamplingParams::default();
        assert_eq!(sample_native(&[0.1, 0.5, 0.2], &p, 0, 0, &[]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_varies_with_step() {
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let logits = vec![0.0f32; 100];
        let a: Vec<_> = (0..50)
            .map(|s| sample_native(&logits, &p, 7, s, &[]))
            .collect();
        let b: Vec<_> = (0..50)
            .map(|s| sample_native(&logits, &p, 7, s, &[]))
            .collect();
        assert_eq!(a, b);
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(
            distinct.len() > 20,
            "uniform logits should give varied samples"
        );
    }

    #[test]
    fn top_k_one_is_greedy() {
        let p = SamplingParams {
            temperature: 5.0,
            top_k: 1,
            ..Default::default()
        };
        for s in 0..20 {
            assert_eq!(sample_native(&[0.0, 2.0, 1.0], &p, 3, s, &[]), 1);
        }
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let p = SamplingParams {
            repetition_penalty: 10.0,
            ..Default::default()
        };
        assert_eq!(sample_native(&[1.0, 2.0, 1.5], &p, 0, 0, &[1]), 2);
    }
}
