//! The [`Scheduler`] itself: its queues, admission of requests, aborts, preemption and the
//! accessors. The step logic lives in `schedule.rs` and `update.rs`.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::config::SchedulerConfig;
use super::output::FinishedSeq;
use super::request::{FinishReason, NewRequest, SeqStatus, Sequence};
use crate::error::{Error, Result};
use crate::ids::{RequestId, TokenId};
use crate::kv_cache::{KvCacheManager, KvCacheStats, SeqId};

/// Counters of the scheduler, for the run summary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub num_steps: u64,
    pub num_scheduled_tokens: u64,
    pub num_preemptions: u64,
    pub num_finished: u64,
}

/// FCFS continuous-batching scheduler over a [`KvCacheManager`].
#[derive(Debug)]
pub struct Scheduler {
    pub(super) config: SchedulerConfig,
    pub(super) kv: KvCacheManager,
    pub(super) seqs: HashMap<SeqId, Sequence>,
    /// Admission order; the last is the newest, preempted first.
    pub(super) running: Vec<SeqId>,
    pub(super) waiting: VecDeque<SeqId>,
    /// Live requests: samples requested (`n`) and samples not finished yet.
    pub(super) requests: HashMap<RequestId, (u32, u32)>,
    /// Finished or aborted since the last `schedule()`.
    pub(super) finished_since_step: Vec<SeqId>,
    pub(super) stats: SchedulerStats,
    /// Async scheduling: decodes may be scheduled one step ahead of their input token.
    pub(super) async_decode: bool,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, kv: KvCacheManager) -> Result<Scheduler> {
        config.validate()?;
        Ok(Scheduler {
            config,
            kv,
            seqs: HashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            requests: HashMap::new(),
            finished_since_step: Vec::new(),
            stats: SchedulerStats::default(),
            async_decode: false,
        })
    }

    /// Async scheduling (off by default). When on, `schedule()` may be called again before
    /// the previous step's results are applied, and a sequence whose sampled token is still
    /// in flight gets its next decode at once: a one-token entry with
    /// [`placeholder`](super::ScheduledSeq::placeholder) set, whose token the runtime fills
    /// in from the step in flight. The runtime must run steps in the order they were
    /// scheduled and apply their results in that order.
    pub fn set_async_decode(&mut self, on: bool) {
        self.async_decode = on;
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The KV-cache manager, read-only (block tables, reference counts, invariants).
    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    pub fn kv_stats(&self) -> KvCacheStats {
        self.kv.stats()
    }

    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether any sequence has not finished (waiting, running or parked).
    pub fn has_unfinished(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Prompt then generated tokens of a live sequence.
    pub fn seq_tokens(&self, seq: SeqId) -> Option<&[TokenId]> {
        self.seqs.get(&seq).map(|s| s.tokens.as_slice())
    }

    /// Queues a request (FCFS). Rejects what could never run: an empty prompt, a prompt plus
    /// `max_tokens` beyond the context window, or a sequence whose full length needs more KV
    /// blocks than exist (a sequence alone must always fit, or preemption could not help).
    pub fn add_request(&mut self, req: NewRequest) -> Result<()> {
        let (prompt_len, max_tokens) = (req.prompt.len(), req.stop.max_tokens);
        if prompt_len == 0 {
            return Err(Error::EmptyPrompt);
        }
        if max_tokens == 0 || req.n == 0 {
            return Err(Error::BadRequest(
                "max_tokens and n must be at least 1".into(),
            ));
        }
        if prompt_len + max_tokens > self.config.max_model_len {
            return Err(Error::PromptTooLong {
                prompt_tokens: prompt_len,
                max_tokens,
                needed: prompt_len + max_tokens,
                context: self.config.max_model_len,
            });
        }
        // The last generated token's KV is never needed.
        let needed_blocks = self.kv.blocks_for(prompt_len + max_tokens - 1);
        if needed_blocks > self.kv.num_blocks() {
            return Err(Error::KvCacheTooSmall {
                needed_blocks,
                num_blocks: self.kv.num_blocks(),
            });
        }
        if self.requests.contains_key(&req.id) {
            return Err(Error::BadRequest(format!(
                "duplicate request id {}",
                req.id
            )));
        }
        self.requests.insert(req.id, (req.n, req.n));
        let stop = Arc::new(req.stop);
        let first = SeqId::first(req.id);
        let mut seq = Sequence::new(first, req.prompt.clone(), stop.clone(), SeqStatus::Waiting);
        for sample in 1..req.n {
            let id = SeqId {
                request: req.id,
                sample,
            };
            let sib = Sequence::new(id, req.prompt.clone(), stop.clone(), SeqStatus::Parked);
            self.seqs.insert(id, sib);
            seq.parked_siblings.push(id);
        }
        self.seqs.insert(first, seq);
        self.waiting.push_back(first);
        Ok(())
    }

    /// Offers draft tokens for a running sequence's next step (speculative decoding). They
    /// run only when the sequence is decoding; unverified drafts are dropped after one step.
    pub fn set_draft_tokens(&mut self, seq: SeqId, drafts: Vec<TokenId>) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.draft_tokens = drafts;
        }
    }

    /// Ends every sample of a request (cancelled or failed). Returns what they produced.
    pub fn abort_request(&mut self, id: RequestId) -> Vec<FinishedSeq> {
        let n = self.requests.get(&id).map_or(0, |r| r.0);
        (0..n)
            .filter_map(|sample| {
                self.finish_seq(
                    SeqId {
                        request: id,
                        sample,
                    },
                    FinishReason::Aborted,
                )
            })
            .collect()
    }

    /// Ends one sequence now (a stop string was found, or it failed), freeing its blocks.
    pub fn finish_seq(&mut self, id: SeqId, reason: FinishReason) -> Option<FinishedSeq> {
        let seq = self.seqs.remove(&id)?;
        self.running.retain(|s| *s != id);
        self.waiting.retain(|s| *s != id);
        self.kv.free(id);
        // Samples still waiting for this one's prompt compute it themselves.
        for sib in seq.parked_siblings.iter().rev() {
            if let Some(s) = self.seqs.get_mut(sib) {
                s.status = SeqStatus::Waiting;
                self.waiting.push_front(*sib);
            }
        }
        if let Some(r) = self.requests.get_mut(&id.request) {
            r.1 -= 1;
            if r.1 == 0 {
                self.requests.remove(&id.request);
            }
        }
        self.finished_since_step.push(id);
        self.stats.num_finished += 1;
        Some(FinishedSeq {
            seq: id,
            num_prompt_tokens: seq.num_prompt_tokens,
            output_tokens: seq.tokens[seq.num_prompt_tokens..].to_vec(),
            reason,
            num_cached_tokens: seq.first_cached_tokens.unwrap_or(0),
            num_preemptions: seq.num_preemptions,
        })
    }

    /// Preemption by recomputation: frees the sequence's blocks and puts it at the front of
    /// the waiting queue; on readmission it recomputes prompt and generated tokens (cheaply,
    /// when its blocks are still cached).
    pub(super) fn preempt(&mut self, id: SeqId) {
        self.kv.free(id);
        self.running.retain(|s| *s != id);
        if let Some(s) = self.seqs.get_mut(&id) {
            s.status = SeqStatus::Waiting;
            s.num_computed_tokens = 0;
            s.num_preemptions += 1;
            s.epoch += 1;
            s.synced_blocks = 0;
            s.known_to_runtime = false;
            s.draft_tokens.clear();
            s.pending_samples = 0;
        }
        self.waiting.push_front(id);
        self.stats.num_preemptions += 1;
    }

    /// Checks the scheduler's own bookkeeping against the KV manager, for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
        if self.running.len() > self.config.max_num_seqs {
            return Err(format!("{} running > max_num_seqs", self.running.len()));
        }
        for (id, s) in &self.seqs {
            if s.id != *id {
                return Err(format!("{id} is filed under the wrong key"));
            }
            let in_running = self.running.contains(id);
            let in_waiting = self.waiting.contains(id);
            let table = self.kv.block_table(*id).len();
            let ok = match s.status {
                SeqStatus::Running => in_running && !in_waiting,
                SeqStatus::Waiting => in_waiting && !in_running && table == 0,
                SeqStatus::Parked => !in_running && !in_waiting && table == 0,
            };
            if !ok {
                return Err(format!(
                    "{id} is {:?} but queued wrongly or holds blocks",
                    s.status
                ));
            }
            if s.status == SeqStatus::Running && table < self.kv.blocks_for(s.num_computed_tokens) {
                return Err(format!("{id} has computed tokens without blocks"));
            }
        }
        if self.running.len() + self.waiting.len() > self.seqs.len() {
            return Err("a sequence is queued twice".into());
        }
        Ok(())
    }
}
