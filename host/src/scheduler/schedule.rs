//! One scheduling step: hand out the token budget, decodes first, then continued prefills,
//! then new admissions in FCFS order while budget, sequence slots and KV blocks last;
//! preempt the newest running sequence when blocks run out.

use super::output::{BlockTableDiff, NewSeqData, ScheduledSeq, SchedulerOutput};
use super::request::SeqStatus;
use super::state::Scheduler;
use crate::ids::TokenId;
use crate::kv_cache::{extend_block_hashes, PrefixHit, SeqId};

/// The token id an async decode entry carries until the runtime substitutes the token the
/// step in flight samples (see [`ScheduledSeq::placeholder`]). Out of every vocabulary, so a
/// runtime that forgot to substitute fails loudly.
pub const PLACEHOLDER_TOKEN: TokenId = TokenId::MAX;

/// A sequence's share of the step, before the output is assembled.
struct Planned {
    id: SeqId,
    start: usize,
    num_new: usize,
    num_drafts: usize,
    /// An async decode whose input token is still being sampled.
    placeholder: bool,
}

impl Scheduler {
    /// Plans the next step. Advances each scheduled sequence's computed count at once, so a
    /// prefill can be scheduled again before the previous step's results come back.
    pub fn schedule(&mut self) -> SchedulerOutput {
        self.stats.num_steps += 1;
        let mut budget = self.config.max_num_batched_tokens;
        let mut plan: Vec<Planned> = Vec::new();
        let mut preempted: Vec<SeqId> = Vec::new();

        let ahead = |s: &super::request::Sequence| self.async_decode && s.can_decode_ahead();
        let (decodes, prefills): (Vec<SeqId>, Vec<SeqId>) = self.running.iter().partition(|id| {
            self.seqs
                .get(id)
                .is_some_and(|s| s.num_uncomputed() == 1 || ahead(s))
        });
        for id in decodes.into_iter().chain(prefills) {
            if budget == 0 {
                break;
            }
            let Some(s) = self
                .seqs
                .get(&id)
                .filter(|s| s.status == SeqStatus::Running)
            else {
                continue; // preempted earlier in this step
            };
            let placeholder = self.async_decode && s.can_decode_ahead();
            let remaining = if placeholder { 1 } else { s.num_uncomputed() };
            if remaining == 0 {
                continue; // its decode is still in flight
            }
            let drafts = if remaining == 1 && !placeholder {
                s.usable_drafts()
            } else {
                0
            };
            let num_new = (remaining + drafts).min(budget);
            let start = s.num_computed_tokens;
            if self.allocate_or_preempt(id, start, num_new, &mut plan, &mut budget, &mut preempted)
            {
                plan.push(Planned {
                    id,
                    start,
                    num_new,
                    num_drafts: num_new.saturating_sub(remaining),
                    placeholder,
                });
                budget -= num_new;
                if let Some(s) = self.seqs.get_mut(&id) {
                    s.num_computed_tokens += num_new;
                }
            }
        }

        // Like vLLM: a step that had to preempt admits nobody new.
        if preempted.is_empty() {
            self.admit_waiting(&mut plan, &mut budget);
        }

        let seqs: Vec<ScheduledSeq> = plan.into_iter().filter_map(|p| self.assemble(p)).collect();
        let num_scheduled_tokens = seqs.iter().map(|s| s.token_ids.len()).sum();
        self.stats.num_scheduled_tokens += num_scheduled_tokens as u64;
        SchedulerOutput {
            step: self.stats.num_steps,
            seqs,
            num_scheduled_tokens,
            preempted,
            finished: std::mem::take(&mut self.finished_since_step),
        }
    }

    /// Allocates slots for a running sequence, preempting the newest running sequences until
    /// it fits. False when the sequence had to preempt itself.
    fn allocate_or_preempt(
        &mut self,
        id: SeqId,
        start: usize,
        num_new: usize,
        plan: &mut Vec<Planned>,
        budget: &mut usize,
        preempted: &mut Vec<SeqId>,
    ) -> bool {
        loop {
            if self
                .kv
                .allocate_slots(id, start, num_new, &PrefixHit::default())
                .is_some()
            {
                return true;
            }
            let Some(&victim) = self.running.last() else {
                return false;
            };
            if let Some(pos) = plan.iter().position(|p| p.id == victim) {
                *budget += plan.remove(pos).num_new;
            }
            self.preempt(victim);
            preempted.push(victim);
            if victim == id {
                return false;
            }
        }
    }

    /// Admits waiting sequences in order while budget, sequence slots and blocks last; the
    /// first that does not fit stops admission (FCFS: nobody overtakes it).
    fn admit_waiting(&mut self, plan: &mut Vec<Planned>, budget: &mut usize) {
        let block_size = self.kv.block_size();
        let caching = self.kv.config().enable_prefix_caching;
        while *budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let Some(s) = self.seqs.get_mut(&id) else {
                self.waiting.pop_front();
                continue;
            };
            if caching {
                extend_block_hashes(&mut s.block_hashes, &s.tokens, block_size);
            }
            let num_tokens = s.tokens.len();
            let hit = self.kv.find_prefix_hit(&s.block_hashes, num_tokens);
            let remaining = num_tokens - hit.num_tokens;
            if !self.config.chunked_prefill && remaining > *budget {
                break;
            }
            let num_new = remaining.min(*budget);
            if self.kv.allocate_slots(id, 0, num_new, &hit).is_none() {
                break;
            }
            if s.first_cached_tokens.is_none() {
                s.first_cached_tokens = Some(hit.num_tokens);
                self.kv.record_prefix_lookup(num_tokens, hit.num_tokens);
            }
            s.status = SeqStatus::Running;
            s.num_computed_tokens = hit.num_tokens + num_new;
            s.num_cached_tokens = hit.num_tokens;
            self.waiting.pop_front();
            self.running.push(id);
            plan.push(Planned {
                id,
                start: hit.num_tokens,
                num_new,
                num_drafts: 0,
                placeholder: false,
            });
            *budget -= num_new;
        }
    }

    /// Turns a planned share into plain data: the tokens, the block-table diff, and the
    /// sequence's history when the runtime has not seen it since its admission.
    fn assemble(&mut self, p: Planned) -> Option<ScheduledSeq> {
        let table = self.kv.block_table(p.id);
        let s = self.seqs.get_mut(&p.id)?;
        let real = p.num_new - p.num_drafts;
        let (token_ids, wants_sample) = if p.placeholder {
            (vec![PLACEHOLDER_TOKEN], true)
        } else {
            let mut t = s.tokens[p.start..p.start + real].to_vec();
            t.extend_from_slice(&s.draft_tokens[..p.num_drafts]);
            (t, p.start + real == s.tokens.len())
        };
        s.draft_tokens.clear();
        s.pending_samples += usize::from(wants_sample);
        let block_table = BlockTableDiff {
            num_kept: s.synced_blocks,
            new_blocks: table[s.synced_blocks.min(table.len())..].to_vec(),
        };
        s.synced_blocks = table.len();
        let new_seq = (!s.known_to_runtime).then(|| NewSeqData {
            num_prompt_tokens: s.num_prompt_tokens,
            token_ids: s.tokens.clone(),
        });
        s.known_to_runtime = true;
        Some(ScheduledSeq {
            seq: p.id,
            wants_sample,
            token_ids,
            num_computed_tokens: p.start,
            num_draft_tokens: p.num_drafts,
            block_table,
            num_cached_tokens: std::mem::take(&mut s.num_cached_tokens),
            new_seq,
            epoch: s.epoch,
            placeholder: p.placeholder,
        })
    }
}
