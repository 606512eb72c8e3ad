//! The compute stage: runs each planned step's forward pass, in plan order, on the thread
//! that drives the backend. It mirrors the block tables from the plans' diffs, fills async
//! placeholders with the tokens the previous step sampled, and hands the logits to the
//! sampler stage. It never samples, detokenizes or schedules; it measures how long the
//! compute sat idle between forward passes (the exposed CPU time).

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use super::messages::{SampleJob, SampledTokens, StepTiming};
use crate::ids::TokenId;
use crate::kv_cache::SeqId;
use crate::model::batch::Batch;
use crate::model::{CausalLm, KvCache, Logits, LogitsWant, SELECT_MAX_K};
use crate::scheduler::{BlockTables, SchedulerOutput};

/// The executor's channels.
pub struct ExecutorIo {
    pub plans: Receiver<Arc<SchedulerOutput>>,
    pub sampled: Receiver<SampledTokens>,
    pub jobs: Sender<SampleJob>,
    pub logits: LogitsPolicy,
}

/// How much of its logits rows each request's sampler needs, decided once per run: a step
/// whose sampling rows all need only their top candidates asks the model for those (on a GPU
/// they are selected there and only they cross to the host), any other step for full rows.
#[derive(Debug, Clone, Default)]
pub struct LogitsPolicy {
    /// Request id of index 0.
    pub base: u64,
    /// Per request index: `Some(k)` when `k` top candidates suffice, `None` for full rows.
    pub per_request: Vec<Option<usize>>,
}

impl LogitsPolicy {
    /// What step `out` asks of the model.
    pub fn want(&self, out: &SchedulerOutput) -> LogitsWant {
        let mut k = 0;
        for e in out.seqs.iter().filter(|e| e.wants_sample) {
            let need = (e.seq.request.0.checked_sub(self.base))
                .and_then(|i| self.per_request.get(usize::try_from(i).ok()?).copied())
                .flatten();
            match need {
                Some(n) if (1..=SELECT_MAX_K).contains(&n) => k = k.max(n),
                _ => return LogitsWant::Full,
            }
        }
        if k == 0 {
            LogitsWant::Full
        } else {
            LogitsWant::TopK(k)
        }
    }
}

/// Runs plans until the plan channel closes (or the sampler stage is gone).
pub fn run_executor(model: &dyn CausalLm, kv: &mut KvCache, io: ExecutorIo) {
    let mut tables = BlockTables::default();
    let mut last: HashMap<SeqId, TokenId> = HashMap::new();
    let (mut sent, mut received) = (0u64, 0u64);
    let mut prev_end: Option<Instant> = None;
    loop {
        let t_wait = Instant::now();
        let Ok(out) = io.plans.recv() else {
            return;
        };
        let wait_plan_s = t_wait.elapsed().as_secs_f64();
        tables.apply(&out);
        for s in out.finished.iter().chain(&out.preempted) {
            last.remove(s);
        }
        // Placeholders stand for the previous step's samples: wait for them only then.
        let t_sample = Instant::now();
        let needs_tokens = out.seqs.iter().any(|e| e.placeholder);
        while received < sent {
            let next = if needs_tokens {
                io.sampled.recv().ok()
            } else {
                io.sampled.try_recv().ok()
            };
            let Some(tokens) = next else {
                break;
            };
            last.extend(tokens);
            received += 1;
        }
        let wait_sample_s = t_sample.elapsed().as_secs_f64();
        let batch = build_batch(&out, &tables, &last);
        let t_fwd = Instant::now();
        let gap_s = prev_end.map(|p| (t_fwd - p).as_secs_f64());
        let logits = if batch.tokens.is_empty() {
            Ok(Logits::Full(Vec::new()))
        } else {
            (model.forward_select(&batch, kv, io.logits.want(&out))).map_err(|e| e.to_string())
        };
        let end = Instant::now();
        let ran = !batch.tokens.is_empty();
        if ran {
            prev_end = Some(end);
        }
        let timing = StepTiming {
            forward_s: (end - t_fwd).as_secs_f64(),
            gap_s: gap_s.filter(|_| ran),
            wait_plan_s,
            wait_sample_s,
            sample_s: 0.0,
            mask_wait_s: 0.0,
            mask_s: 0.0,
            constrained_rows: 0,
            num_tokens: batch.tokens.len(),
            num_seqs: out.seqs.len(),
            decode_only: ran
                && out
                    .seqs
                    .iter()
                    .all(|e| e.token_ids.len() == 1 && e.new_seq.is_none()),
        };
        tracing::debug!(
            step = out.step,
            seqs = timing.num_seqs,
            tokens = timing.num_tokens,
            gap_ms = timing.gap_s.unwrap_or(0.0) * 1e3,
            wait_plan_ms = wait_plan_s * 1e3,
            wait_sample_ms = wait_sample_s * 1e3,
            forward_ms = timing.forward_s * 1e3,
            "executor step"
        );
        if io
            .jobs
            .send(SampleJob {
                out,
                logits,
                timing,
            })
            .is_err()
        {
            return;
        }
        sent += 1;
    }
}

/// The forward pass's input: every entry's tokens at its positions, through its mirrored
/// block table, with logits for the entries that sample.
fn build_batch(
    out: &SchedulerOutput,
    tables: &BlockTables,
    last: &HashMap<SeqId, TokenId>,
) -> Batch {
    let mut batch = Batch::default();
    for e in &out.seqs {
        let filled;
        let tokens: &[TokenId] = if e.placeholder {
            // A missing sample means its row failed; the engine fails that request and
            // ignores this entry, so any in-vocabulary id will do.
            filled = [last.get(&e.seq).copied().unwrap_or(0)];
            &filled
        } else {
            &e.token_ids
        };
        batch.push(
            tokens,
            e.num_computed_tokens,
            tables.raw(e.seq),
            e.wants_sample,
        );
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{BlockId, RequestId};
    use crate::scheduler::{BlockTableDiff, ScheduledSeq, PLACEHOLDER_TOKEN};

    fn entry(seq: SeqId, tokens: Vec<TokenId>, pos: usize, placeholder: bool) -> ScheduledSeq {
        ScheduledSeq {
            seq,
            token_ids: tokens,
            num_computed_tokens: pos,
            num_draft_tokens: 0,
            wants_sample: true,
            block_table: BlockTableDiff {
                num_kept: 0,
                new_blocks: vec![BlockId(3), BlockId(5)],
            },
            num_cached_tokens: 0,
            new_seq: None,
            epoch: 0,
            placeholder,
        }
    }

    #[test]
    fn placeholders_take_the_previous_sample() {
        let a = SeqId::first(RequestId(1));
        let b = SeqId::first(RequestId(2));
        let out = SchedulerOutput {
            seqs: vec![
                entry(a, vec![PLACEHOLDER_TOKEN], 17, true),
                entry(b, vec![4, 5, 6], 0, false),
            ],
            ..Default::default()
        };
        let mut tables = BlockTables::default();
        tables.apply(&out);
        let last = HashMap::from([(a, 42)]);
        let batch = build_batch(&out, &tables, &last);
        assert_eq!(batch.tokens, vec![42, 4, 5, 6]);
        assert_eq!(batch.logits_for, vec![0, 3]);
        assert_eq!(batch.seqs[0].pos, 17);
        assert_eq!(batch.seqs[1].block_table, vec![3, 5]);
    }
}
