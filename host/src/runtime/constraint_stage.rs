//! The constraint worker: the matchers of a run's constrained sequences, on their own thread.
//! After the sampler stage picks step N's tokens it sends them here (`advance`) and goes on;
//! the worker consumes them and computes each sequence's mask for step N+1 while the executor
//! runs step N+1's forward pass (the mask depends only on tokens already chosen). When step
//! N+1's logits arrive the sampler stage asks for the masks (`masks`); only the time it waits
//! then is exposed. It owns matcher bookkeeping (what each matcher consumed, reconciling after
//! preemption); it must not sample or touch logits beyond applying a mask.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use crate::ids::TokenId;
use crate::kv_cache::SeqId;
use crate::plugins::Matcher;

/// What a sequence's constraint says about its next token.
#[derive(Debug, Clone, PartialEq)]
pub enum NextMask {
    /// Allowed tokens: bit `t % 32` of word `t / 32`.
    Allowed(Vec<u32>),
    /// The matcher consumed an end-of-sequence token: the sequence has ended, and a row the
    /// engine still runs for it is ignored, so it is not constrained.
    Ended,
    /// The matcher failed; the sequence's request fails with this message.
    Failed(String),
}

/// Sampler stage -> worker.
pub enum ConstraintMsg {
    /// Tokens just chosen, one per sequence: consume them and compute the next masks.
    Advance(Vec<(SeqId, TokenId)>),
    /// A sequence was (re)admitted with these generated tokens (none at first admission; after
    /// a preemption, those the scheduler kept): make the matcher agree with them.
    Sync(SeqId, Vec<TokenId>),
    /// Answer the next masks of these sequences, in this order.
    Want(Vec<SeqId>),
    /// The sequence is gone; free its matcher.
    Drop(SeqId),
}

/// Worker -> sampler stage: the answer to one `Want`, and the seconds spent computing masks
/// since the previous answer (hidden or not).
pub struct MaskAnswer {
    pub masks: Vec<NextMask>,
    pub compute_s: f64,
}

struct Seq {
    matcher: Matcher,
    consumed: Vec<TokenId>,
    next: Option<NextMask>,
    ended: bool,
    failed: Option<String>,
}

impl Seq {
    fn fail(&mut self, what: &str, e: impl std::fmt::Display) {
        self.failed
            .get_or_insert_with(|| format!("constraint {what} failed: {e}"));
        self.next = None;
    }

    fn consume(&mut self, t: TokenId, eos: &[TokenId]) {
        if self.ended || self.failed.is_some() {
            return;
        }
        if eos.contains(&t) {
            // The sampler checked the mask, which allows EOS only where the output is
            // complete; the sequence ends here, so the matcher need not see it (llguidance
            // refuses EOS once its parser has stopped).
            self.ended = true;
            self.next = None;
            return;
        }
        match self.matcher.consume(&[t]) {
            Ok(()) => {
                self.consumed.push(t);
                self.next = None;
            }
            Err(e) => self.fail("consume", e),
        }
    }

    /// Rolls back to the common prefix with `generated`, then consumes the rest of it.
    fn sync(&mut self, generated: &[TokenId], eos: &[TokenId]) {
        let common = self
            .consumed
            .iter()
            .zip(generated)
            .take_while(|(a, b)| a == b)
            .count();
        if common == self.consumed.len() && common == generated.len() {
            return;
        }
        let extra = self.consumed.len() - common;
        if extra > 0 {
            if let Err(e) = self.matcher.rollback(extra) {
                self.fail("rollback", e);
                return;
            }
            self.consumed.truncate(common);
        }
        self.ended = false;
        self.next = None;
        for &t in &generated[common..] {
            self.consume(t, eos);
        }
    }

    fn compute(&mut self) -> NextMask {
        if let Some(e) = &self.failed {
            return NextMask::Failed(e.clone());
        }
        if self.ended {
            return NextMask::Ended;
        }
        if let Some(m) = &self.next {
            return m.clone();
        }
        let mut words = Vec::new();
        let m = match self.matcher.mask(&mut words) {
            Ok(()) if words.iter().all(|&w| w == 0) => {
                NextMask::Failed("the constraint allows no token here".into())
            }
            Ok(()) => NextMask::Allowed(words),
            Err(e) => NextMask::Failed(format!("constraint mask failed: {e}")),
        };
        self.next = Some(m.clone());
        m
    }
}

/// Runs the worker until the sampler stage hangs up. The first mask of every sequence is
/// computed at once, while the prompts are being prefilled.
pub fn run_constraint_worker(
    matchers: Vec<(SeqId, Matcher)>,
    eos: Vec<TokenId>,
    inbox: Receiver<ConstraintMsg>,
    answers: Sender<MaskAnswer>,
) {
    let mut compute_s = 0.0;
    let mut seqs: HashMap<SeqId, Seq> = HashMap::new();
    for (id, matcher) in matchers {
        let mut s = Seq {
            matcher,
            consumed: Vec::new(),
            next: None,
            ended: false,
            failed: None,
        };
        let t0 = Instant::now();
        s.compute();
        compute_s += t0.elapsed().as_secs_f64();
        seqs.insert(id, s);
    }
    for msg in inbox.iter() {
        let t0 = Instant::now();
        match msg {
            ConstraintMsg::Advance(tokens) => {
                for &(id, t) in &tokens {
                    if let Some(s) = seqs.get_mut(&id) {
                        s.consume(t, &eos);
                    }
                }
                for (id, _) in &tokens {
                    if let Some(s) = seqs.get_mut(id) {
                        s.compute();
                    }
                }
            }
            ConstraintMsg::Sync(id, generated) => {
                if let Some(s) = seqs.get_mut(&id) {
                    s.sync(&generated, &eos);
                    s.compute();
                }
            }
            ConstraintMsg::Want(ids) => {
                let masks = ids
                    .iter()
                    .map(|id| match seqs.get_mut(id) {
                        Some(s) => s.compute(),
                        None => NextMask::Failed(format!("sequence {id} has no matcher")),
                    })
                    .collect();
                compute_s += t0.elapsed().as_secs_f64();
                let answer = MaskAnswer {
                    masks,
                    compute_s: std::mem::take(&mut compute_s),
                };
                if answers.send(answer).is_err() {
                    return;
                }
                continue;
            }
            ConstraintMsg::Drop(id) => {
                seqs.remove(&id);
            }
        }
        compute_s += t0.elapsed().as_secs_f64();
    }
}

/// Sets every logit the mask does not allow to minus infinity.
pub fn apply_mask(logits: &mut [f32], mask: &[u32]) {
    for (chunk, &w) in logits.chunks_mut(32).zip(mask) {
        if w == u32::MAX {
            continue;
        }
        for (i, l) in chunk.iter_mut().enumerate() {
            if w >> i & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    let covered = mask.len() * 32;
    if logits.len() > covered {
        logits[covered..].fill(f32::NEG_INFINITY);
    }
}

/// Whether the mask allows token `t`.
pub fn allows(mask: &[u32], t: TokenId) -> bool {
    mask.get(t as usize / 32)
        .is_some_and(|w| w >> (t % 32) & 1 == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_set_disallowed_logits_to_minus_infinity() {
        let mut l = vec![1.0f32; 70];
        let mask = [0b101u32, u32::MAX];
        apply_mask(&mut l, &mask);
        assert_eq!(l[0], 1.0);
        assert_eq!(l[1], f32::NEG_INFINITY);
        assert_eq!(l[2], 1.0);
        assert!(l[3..32].iter().all(|&x| x == f32::NEG_INFINITY));
        assert!(l[32..64].iter().all(|&x| x == 1.0));
        assert!(l[64..].iter().all(|&x| x == f32::NEG_INFINITY));
        assert!(allows(&mask, 2) && !allows(&mask, 1) && allows(&mask, 40) && !allows(&mask, 99));
    }
}
