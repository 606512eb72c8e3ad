//! The sampler stage: turns each step's logits into tokens, off the compute thread. It keeps
//! every live sequence's token history (for penalties and the per-token random stream),
//! calls the [`BatchSampler`] once per step (split across two threads for large batches),
//! and reports the tokens to the executor (placeholders) and the engine (scheduler update).
//! Rows of constrained sequences are masked first with the constraint worker's masks (see
//! `constraint_stage.rs`), and their chosen tokens are sent back to it at once, so the next
//! masks are computed while the next forward pass runs.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use super::constraint_stage::{allows, apply_mask, ConstraintMsg, MaskAnswer, NextMask};
use super::messages::{EngineEvent, SampleJob, SampledTokens, StepDone, StepTiming};
use crate::ids::{RequestId, TokenId};
use crate::kv_cache::SeqId;
use crate::model::Logits;
use crate::sampling::{BatchSampler, SampleRow, SamplingParams, TopCandidates};

/// Rows from which sampling is split across two threads.
const PARALLEL_ROWS: usize = 16;

/// Sampling settings of the run's requests, by request id.
pub struct SeqSettings<'a> {
    /// Request id of index 0; request `i` of the run has id `base + i`.
    pub base: u64,
    /// Per request index: parameters and seed of sample 0.
    pub requests: Vec<(&'a SamplingParams, u64)>,
    /// Per request index: whether its samples are constrained (they have matchers on the
    /// constraint worker).
    pub constrained: Vec<bool>,
}

impl SeqSettings<'_> {
    fn is_constrained(&self, seq: SeqId) -> bool {
        seq.request
            .0
            .checked_sub(self.base)
            .and_then(|i| self.constrained.get(usize::try_from(i).ok()?))
            .copied()
            .unwrap_or(false)
    }

    fn get(&self, seq: SeqId) -> Option<(&SamplingParams, u64)> {
        let idx = seq.request.0.checked_sub(self.base)?;
        let &(params, seed) = self.requests.get(usize::try_from(idx).ok()?)?;
        Some((params, sample_seed(seed, seq.sample)))
    }
}

/// Sample `j` of a request draws from its own stream.
pub fn sample_seed(seed: u64, sample: u32) -> u64 {
    if sample == 0 {
        seed
    } else {
        mix(seed, u64::from(sample))
    }
}

/// SplitMix64 of `seed` and `idx`: per-request and per-sample seeds.
pub fn mix(seed: u64, idx: u64) -> u64 {
    let mut z = seed.wrapping_add(idx.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct History {
    tokens: Vec<TokenId>,
    num_prompt: usize,
}

/// The stage's channels.
pub struct SamplerIo {
    pub jobs: Receiver<SampleJob>,
    pub to_executor: Sender<SampledTokens>,
    pub to_engine: Sender<EngineEvent>,
    /// The constraint worker, when some request is constrained.
    pub constraints: Option<ConstraintLink>,
}

/// The sampler stage's ends of the constraint worker's channels.
pub struct ConstraintLink {
    pub to_worker: Sender<ConstraintMsg>,
    pub answers: Receiver<MaskAnswer>,
}

/// Samples steps until the job channel closes.
pub fn run_sampler(
    sampler: &dyn BatchSampler,
    settings: &SeqSettings<'_>,
    vocab: usize,
    io: SamplerIo,
) {
    let mut histories: HashMap<SeqId, History> = HashMap::new();
    for job in io.jobs.iter() {
        let out = &job.out;
        for s in out.finished.iter().chain(&out.preempted) {
            histories.remove(s);
        }
        if let Some(link) = &io.constraints {
            for &s in out.finished.iter().filter(|&&s| settings.is_constrained(s)) {
                let _ = link.to_worker.send(ConstraintMsg::Drop(s));
            }
        }
        for e in &out.seqs {
            if let Some(n) = &e.new_seq {
                if let (Some(link), true) = (&io.constraints, settings.is_constrained(e.seq)) {
                    let generated = n.token_ids.get(n.num_prompt_tokens..).unwrap_or(&[]);
                    let _ = link
                        .to_worker
                        .send(ConstraintMsg::Sync(e.seq, generated.to_vec()));
                }
                histories.insert(
                    e.seq,
                    History {
                        tokens: n.token_ids.clone(),
                        num_prompt: n.num_prompt_tokens,
                    },
                );
            }
        }
        let t0 = Instant::now();
        let mut timing = job.timing;
        let results = match &job.logits {
            Err(msg) => out
                .seqs
                .iter()
                .map(|_| Err(format!("forward pass failed: {msg}")))
                .collect(),
            Ok(logits) => {
                let step = Step {
                    sampler,
                    settings,
                    vocab,
                    constraints: io.constraints.as_ref(),
                };
                step.run(&job, logits, &mut histories, &mut timing)
            }
        };
        timing.sample_s = t0.elapsed().as_secs_f64();
        let tokens: SampledTokens = out
            .seqs
            .iter()
            .zip(&results)
            .filter_map(|(e, r)| Some((e.seq, *r.as_ref().ok()?.first()?)))
            .collect();
        // The executor may be gone at the end of a run; the engine still wants the step.
        let _ = io.to_executor.send(tokens);
        let done = StepDone {
            results,
            timing,
            at: Instant::now(),
        };
        if io.to_engine.send(EngineEvent::Step(done)).is_err() {
            return;
        }
    }
}

/// What one step's sampling needs besides the job.
struct Step<'s, 'a> {
    sampler: &'s dyn BatchSampler,
    settings: &'s SeqSettings<'a>,
    vocab: usize,
    constraints: Option<&'s ConstraintLink>,
}

impl Step<'_, '_> {
    /// The next masks of the step's constrained rows (waiting for the worker: the exposed
    /// mask time), by entry index.
    fn masks(&self, job: &SampleJob, timing: &mut StepTiming) -> HashMap<usize, NextMask> {
        let Some(link) = self.constraints else {
            return HashMap::new();
        };
        let entries: Vec<usize> = (job.out.seqs.iter().enumerate())
            .filter(|(_, e)| e.wants_sample && self.settings.is_constrained(e.seq))
            .map(|(i, _)| i)
            .collect();
        if entries.is_empty() {
            return HashMap::new();
        }
        let ids = entries.iter().map(|&i| job.out.seqs[i].seq).collect();
        let t0 = Instant::now();
        let answer = match link.to_worker.send(ConstraintMsg::Want(ids)) {
            Ok(()) => link.answers.recv().ok(),
            Err(_) => None,
        };
        timing.mask_wait_s = t0.elapsed().as_secs_f64();
        timing.constrained_rows = entries.len();
        let masks = match answer {
            Some(a) => {
                timing.mask_s = a.compute_s;
                a.masks
            }
            None => vec![NextMask::Failed("the constraint worker stopped".into()); entries.len()],
        };
        entries.into_iter().zip(masks).collect()
    }

    /// One row per sampling entry; returns per-entry results and extends the histories.
    fn run(
        &self,
        job: &SampleJob,
        logits: &Logits,
        histories: &mut HashMap<SeqId, History>,
        timing: &mut StepTiming,
    ) -> Vec<Result<Vec<TokenId>, String>> {
        let (vocab, out) = (self.vocab, &job.out);
        let masks = self.masks(job, timing);
        let mut results: Vec<Result<Vec<TokenId>, String>> = vec![Ok(Vec::new()); out.seqs.len()];
        // Masked copies of the constrained rows' logits, by entry index.
        let mut masked: HashMap<usize, Vec<f32>> = HashMap::new();
        let sampled = out.seqs.iter().enumerate().filter(|(_, e)| e.wants_sample);
        // The step's logits rows are the sampled entries', in order.
        for (r, (i, e)) in sampled.enumerate() {
            let row = full_row(logits, vocab, r);
            match (masks.get(&i), row) {
                (Some(NextMask::Allowed(_)), None) => {
                    results[i] = Err(format!(
                        "sequence {}: its constraint needs full logits, the step has none",
                        e.seq
                    ));
                }
                (Some(NextMask::Allowed(m)), Some(row)) => {
                    let mut l = row.to_vec();
                    apply_mask(&mut l, m);
                    masked.insert(i, l);
                }
                (Some(NextMask::Failed(msg)), _) => {
                    results[i] = Err(format!("sequence {}: {msg}", e.seq));
                }
                _ => {}
            }
        }
        let mut rows = Vec::new();
        let mut row_entries = Vec::new();
        for (i, e) in out.seqs.iter().enumerate().filter(|(_, e)| e.wants_sample) {
            let r = rows.len();
            let (row_logits, candidates) = match (full_row(logits, vocab, r), logits) {
                (Some(l), _) => (l, None),
                (None, Logits::TopK(c)) if r < c.len() => {
                    let top = TopCandidates { top: &c[r], vocab };
                    (&[][..], Some(top))
                }
                _ => {
                    results[i] = Err("the forward pass returned too few logits".into());
                    rows.push(None);
                    continue;
                }
            };
            let (Some((params, seed)), Some(h)) = (self.settings.get(e.seq), histories.get(&e.seq))
            else {
                results[i] = Err(format!("sequence {} is unknown to the sampler", e.seq));
                rows.push(None);
                continue;
            };
            if results[i].is_err() {
                rows.push(None);
                continue;
            }
            rows.push(Some(SampleRow {
                logits: masked.get(&i).map_or(row_logits, Vec::as_slice),
                candidates,
                params,
                seed,
                step: h.tokens.len().saturating_sub(h.num_prompt) as u64,
                history: &h.tokens,
            }));
            row_entries.push(i);
        }
        let real: Vec<SampleRow<'_>> = rows.into_iter().flatten().collect();
        let picks = sample_rows(self.sampler, &real);
        drop(real);
        let mut advance = Vec::new();
        for (&i, pick) in row_entries.iter().zip(picks) {
            let e = &out.seqs[i];
            let mask = match masks.get(&i) {
                Some(NextMask::Allowed(m)) => Some(m),
                _ => None,
            };
            results[i] = match pick {
                Ok(t) if mask.is_some_and(|m| !allows(m, t)) => Err(format!(
                    "the sampler chose token {t}, which the constraint does not allow"
                )),
                Ok(t) if (t as usize) < vocab => {
                    if let Some(h) = histories.get_mut(&e.seq) {
                        h.tokens.push(t);
                    }
                    if mask.is_some() {
                        advance.push((e.seq, t));
                    }
                    Ok(vec![t])
                }
                Ok(t) => Err(format!(
                    "sampler returned token id {t}, outside the vocabulary ({vocab})"
                )),
                Err(msg) => Err(format!("sampler failed: {msg}")),
            };
        }
        if let (Some(link), false) = (self.constraints, advance.is_empty()) {
            let _ = link.to_worker.send(ConstraintMsg::Advance(advance));
        }
        results
    }
}

/// Row `r` of full-vocabulary logits, if the step brought full rows back.
fn full_row(logits: &Logits, vocab: usize, r: usize) -> Option<&[f32]> {
    match logits {
        Logits::Full(v) => v.get(r * vocab..(r + 1) * vocab),
        Logits::TopK(_) | Logits::Argmax(_) => None,
    }
}

/// Samples the rows, on two threads when there are many (each row's result depends only on
/// the row, so the split changes nothing).
fn sample_rows(sampler: &dyn BatchSampler, rows: &[SampleRow<'_>]) -> Vec<Result<TokenId, String>> {
    if rows.len() < PARALLEL_ROWS {
        return sampler.sample_batch(rows);
    }
    let (a, b) = rows.split_at(rows.len() / 2);
    std::thread::scope(|s| {
        let other = s.spawn(|| sampler.sample_batch(b));
        let mut first = sampler.sample_batch(a);
        match other.join() {
            Ok(second) => first.extend(second),
            Err(_) => first.extend(b.iter().map(|_| Err("sampler thread panicked".to_string()))),
        }
        first
    })
}

/// The request id of index `idx` in a run whose first id is `base`.
pub fn request_id(base: u64, idx: usize) -> RequestId {
    RequestId(base + idx as u64)
}
