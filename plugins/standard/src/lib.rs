//! The `standard` sampler plugin: repetition / presence / frequency penalties and logit bias,
//! then greedy or temperature sampling with top-k, min-p and top-p cuts, drawing from a
//! Philox stream keyed by (seed, step) so a sequence's samples never depend on its batch.
//! It works on the host's top-256 candidates; the penalties act on those candidates only.

use deepinfer_plugin_sdk::sampler::{HistoryNeed, Row, Sampler};
use deepinfer_plugin_sdk::{Candidate, SamplingParams, TokenId};

mod index;
use index::IdIndex;

/// The sampler, with scratch buffers reused across rows.
#[derive(Debug, Default)]
pub struct Standard {
    work: Vec<Candidate>,
    index: IdIndex,
    counts: Vec<u32>,
    probs: Vec<f64>,
}

/// Orders candidates by logit, highest first; ties by lower id, so the order is total.
fn better(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.logit
        .partial_cmp(&a.logit)
        .unwrap_or(std::cmp::Ordering::Equal)
        .then(a.id.cmp(&b.id))
}

impl Standard {
    /// Applies penalties and logit bias to `self.work` in place; says whether any logit moved.
    fn process(&mut self, params: &SamplingParams, history: &[TokenId]) -> bool {
        let penalize = params.has_penalties() && !history.is_empty();
        if !penalize && params.logit_bias.is_empty() {
            return false;
        }
        self.index.build(self.work.iter().map(|c| c.id));
        let mut moved = false;
        if penalize {
            self.counts.clear();
            self.counts.resize(self.work.len(), 0);
            for &t in history {
                if let Some(i) = self.index.get(t) {
                    self.counts[i] += 1;
                }
            }
            for (c, &n) in self.work.iter_mut().zip(&self.counts) {
                if n == 0 {
                    continue;
                }
                let rp = params.repetition_penalty;
                if rp != 1.0 {
                    c.logit = if c.logit > 0.0 {
                        c.logit / rp
                    } else {
                        c.logit * rp
                    };
                }
                c.logit -= params.presence_penalty + params.frequency_penalty * n as f32;
                moved = true;
            }
        }
        for &(t, b) in &params.logit_bias {
            if let Some(i) = self.index.get(t) {
                self.work[i].logit += b;
                moved = true;
            }
        }
        for c in &mut self.work {
            if c.logit.is_nan() {
                c.logit = f32::NEG_INFINITY;
            }
        }
        moved
    }
}

impl Sampler for Standard {
    const DESCRIPTION: &'static str =
        "temperature, top-k, top-p, min-p, repetition/presence/frequency penalties, logit bias";
    const HISTORY: HistoryNeed = HistoryNeed::Penalized;

    fn sample(&mut self, row: &Row<'_>) -> Result<TokenId, String> {
        if row.candidates.is_empty() {
            return Err("no candidates".into());
        }
        let p = row.params;
        self.work.clear();
        self.work.extend_from_slice(row.candidates);
        let moved = self.process(p, row.history);
        if p.is_greedy() {
            let best = self.work.iter().min_by(|a, b| better(a, b));
            return best.map(|c| c.id).ok_or_else(|| "no candidates".into());
        }
        // The host sends candidates best first; only the penalties and biases can disorder
        // them, and then only a few, which the adaptive stable sort handles in near O(K).
        if moved || !self.work.is_sorted_by(|a, b| better(a, b).is_le()) {
            self.work.sort_by(better);
        }
        let k = match p.top_k {
            0 => self.work.len(),
            k => (k as usize).min(self.work.len()),
        };
        let cands = &self.work[..k];
        let max = cands[0].logit;
        if max == f32::NEG_INFINITY {
            return Err("every candidate has a logit of -inf".into());
        }
        let t = p.temperature as f64;
        self.probs.clear();
        self.probs
            .extend(cands.iter().map(|c| ((c.logit - max) as f64 / t).exp()));
        let total: f64 = self.probs.iter().sum();
        self.probs.iter_mut().for_each(|q| *q /= total);
        // min-p: drop tokens below min_p times the top probability.
        let mut keep = self.probs.len();
        if p.min_p > 0.0 {
            let floor = self.probs[0] * p.min_p as f64;
            keep = self
                .probs
                .iter()
                .take_while(|&&q| q >= floor)
                .count()
                .max(1);
        }
        // top-p: the smallest prefix whose mass reaches top_p.
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut n = 0;
            for q in &self.probs[..keep] {
                acc += q;
                n += 1;
                if acc >= p.top_p as f64 {
                    break;
                }
            }
            keep = n.max(1);
        }
        let probs = &self.probs[..keep];
        let mass: f64 = probs.iter().sum();
        let mut u = row.uniform() * mass;
        for (c, q) in cands.iter().zip(probs) {
            if u < *q {
                return Ok(c.id);
            }
            u -= q;
        }
        Ok(cands[keep - 1].id)
    }
}

deepinfer_plugin_sdk::export_sampler!(Standard);

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(logits: &[f32]) -> Vec<Candidate> {
        let mut c: Vec<Candidate> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| Candidate {
                id: i as TokenId,
                logit: l,
            })
            .collect();
        c.sort_by(better);
        c
    }

    fn draw(
        c: &[Candidate],
        p: &SamplingParams,
        seed: u64,
        step: u64,
        hist: &[TokenId],
    ) -> TokenId {
        let row = Row {
            candidates: c,
            params: p,
            seed,
            step,
            history: hist,
            logits: &[],
            vocab_size: 1000,
        };
        Standard::default().sample(&row).unwrap()
    }

    #[test]
    fn greedy_takes_the_argmax_with_lower_id_on_ties() {
        let c = cands(&[0.5, 2.0, 2.0, 1.0]);
        assert_eq!(draw(&c, &SamplingParams::default(), 0, 0, &[]), 1);
    }

    #[test]
    fn seeded_draws_repeat_and_depend_on_step() {
        let c = cands(&[0.0; 50]);
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let a: Vec<_> = (0..40).map(|s| draw(&c, &p, 9, s, &[])).collect();
        let b: Vec<_> = (0..40).map(|s| draw(&c, &p, 9, s, &[])).collect();
        assert_eq!(a, b);
        let distinct: std::collections::BTreeSet<_> = a.iter().collect();
        assert!(distinct.len() > 15, "{distinct:?}");
    }

    #[test]
    fn cuts_restrict_the_choice() {
        let c = cands(&[3.0, 2.9, 0.0, -1.0, -2.0]);
        let topk = SamplingParams {
            temperature: 2.0,
            top_k: 2,
            ..Default::default()
        };
        let topp = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            ..Default::default()
        };
        let minp = SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            ..Default::default()
        };
        for s in 0..200 {
            assert!(draw(&c, &topk, 1, s, &[]) <= 1);
            assert_eq!(draw(&c, &topp, 1, s, &[]), 0);
            assert!(draw(&c, &minp, 1, s, &[]) <= 1);
        }
    }

    #[test]
    fn penalties_and_bias_move_the_argmax() {
        let c = cands(&[2.0, 1.5, 1.0]);
        let rep = SamplingParams {
            repetition_penalty: 10.0,
            ..Default::default()
        };
        assert_eq!(draw(&c, &rep, 0, 0, &[0]), 1);
        let freq = SamplingParams {
            frequency_penalty: 0.4,
            ..Default::default()
        };
        assert_eq!(draw(&c, &freq, 0, 0, &[0, 0]), 1);
        assert_eq!(draw(&c, &freq, 0, 0, &[0]), 0);
        let bias = SamplingParams {
            logit_bias: vec![(2, 5.0)],
            ..Default::default()
        };
        assert_eq!(draw(&c, &bias, 0, 0, &[]), 2);
    }

    #[test]
    fn all_neg_infinity_is_an_error() {
        let c = cands(&[f32::NEG_INFINITY; 3]);
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let row = Row {
            candidates: &c,
            params: &p,
            seed: 0,
            step: 0,
            history: &[],
            logits: &[],
            vocab_size: 3,
        };
        assert!(Standard::default().sample(&row).is_err());
    }
}
