//! After a step ran: append the sampled tokens, roll back rejected draft tokens, publish the
//! newly computed full blocks to the prefix cache, fork further samples once a prompt is
//! computed, and detect finished sequences (freeing their blocks).

use super::output::{ScheduledSeq, SchedulerOutput, SeqUpdate, StepOutcome};
use super::request::SeqStatus;
use super::state::Scheduler;
use crate::error::{Error, Result};
use crate::ids::TokenId;
use crate::kv_cache::{extend_block_hashes, SeqId};

impl Scheduler {
    /// Applies the results of the step `output` described. `sampled[i]` belongs to
    /// `output.seqs[i]`: empty when that entry does not want a sample, otherwise the accepted
    /// tokens: the first sampled token, or with `d` drafts, the accepted drafts then one
    /// more (1 to `d + 1` tokens). Entries whose sequence has since finished or been preempted
    /// are skipped. Fails, changing nothing for that entry and later ones, when the results
    /// do not fit the plan.
    pub fn update_from_output(
        &mut self,
        output: &SchedulerOutput,
        sampled: &[Vec<TokenId>],
    ) -> Result<StepOutcome> {
        if sampled.len() != output.seqs.len() {
            return Err(Error::Scheduler(format!(
                "step {} scheduled {} sequences but {} results came back",
                output.step,
                output.seqs.len(),
                sampled.len()
            )));
        }
        let mut outcome = StepOutcome::default();
        for (entry, tokens) in output.seqs.iter().zip(sampled) {
            let live = self
                .seqs
                .get(&entry.seq)
                .is_some_and(|s| s.status == SeqStatus::Running && s.epoch == entry.epoch);
            if live {
                self.apply_entry(entry, tokens, &mut outcome)?;
            }
        }
        Ok(outcome)
    }

    fn apply_entry(
        &mut self,
        entry: &ScheduledSeq,
        tokens: &[TokenId],
        outcome: &mut StepOutcome,
    ) -> Result<()> {
        let id = entry.seq;
        let written = entry.num_computed_tokens + entry.token_ids.len();
        if !entry.wants_sample {
            if !tokens.is_empty() {
                return Err(Error::Scheduler(format!(
                    "{id} was not due a sample but got {tokens:?}"
                )));
            }
            self.publish(id, written);
            return Ok(());
        }
        let d = entry.num_draft_tokens;
        let drafts = &entry.token_ids[entry.token_ids.len() - d..];
        let accepted_ok = !tokens.is_empty()
            && tokens.len() <= d + 1
            && tokens[..tokens.len() - 1]
                .iter()
                .zip(drafts)
                .all(|(t, dr)| t == dr);
        if !accepted_ok {
            return Err(Error::Scheduler(format!(
                "{id}: {tokens:?} is not an accepted prefix of drafts {drafts:?} plus one token"
            )));
        }
        if let Some(s) = self.seqs.get_mut(&id) {
            s.pending_samples = s.pending_samples.saturating_sub(1);
        }
        let rejected = d + 1 - tokens.len();
        if rejected > 0 {
            let valid = self.kv.rollback(id, written - rejected);
            if let Some(s) = self.seqs.get_mut(&id) {
                s.num_computed_tokens = valid;
                s.synced_blocks = s.synced_blocks.min(self.kv.block_table(id).len());
            }
        }
        self.fork_parked_siblings(id);

        let Some(s) = self.seqs.get_mut(&id) else {
            return Ok(());
        };
        let mut new_tokens = Vec::with_capacity(tokens.len());
        let mut finish = None;
        for &t in tokens {
            s.tokens.push(t);
            new_tokens.push(t);
            finish = s.stop.check(t, s.num_output_tokens());
            if finish.is_some() {
                break;
            }
        }
        let computed = s.num_computed_tokens;
        outcome.updates.push(SeqUpdate {
            seq: id,
            new_tokens,
            finish,
        });
        // Publish before a finish frees the blocks, so that a request that ends in the step
        // that computed its prompt (max_tokens = 1) still leaves its prefix cached.
        self.publish(id, computed);
        if let Some(reason) = finish {
            outcome.finished.extend(self.finish_seq(id, reason));
        }
        Ok(())
    }

    /// Publishes the full blocks among the first `computed` tokens of `id` to the prefix cache.
    fn publish(&mut self, id: SeqId, computed: usize) {
        if !self.kv.config().enable_prefix_caching {
            return;
        }
        let block_size = self.kv.block_size();
        if let Some(s) = self.seqs.get_mut(&id) {
            extend_block_hashes(&mut s.block_hashes, &s.tokens, block_size);
            self.kv
                .cache_full_blocks(id, &s.block_hashes, computed.min(s.tokens.len()));
        }
    }

    /// Sample 0 of an `n > 1` request just computed its prompt: the other samples share its
    /// full prompt blocks and join the running set (each recomputes only the prompt's partial
    /// tail, so that no block is written by two sequences). Samples beyond `max_num_seqs`
    /// wait at the front of the queue and find the prompt through the prefix cache instead.
    fn fork_parked_siblings(&mut self, parent: SeqId) {
        let Some(p) = self.seqs.get_mut(&parent) else {
            return;
        };
        if p.parked_siblings.is_empty() {
            return;
        }
        let mut siblings = std::mem::take(&mut p.parked_siblings);
        let prompt_len = p.num_prompt_tokens;
        self.publish(parent, prompt_len);
        let mut overflow = Vec::new();
        // A sample may have been finished on its own while parked.
        siblings.retain(|s| self.seqs.contains_key(s));
        for sib in siblings {
            if self.running.len() >= self.config.max_num_seqs {
                overflow.push(sib);
                continue;
            }
            let shared = self.kv.fork(parent, sib, prompt_len - 1);
            if let Some(s) = self.seqs.get_mut(&sib) {
                s.status = SeqStatus::Running;
                s.num_computed_tokens = shared;
                s.num_cached_tokens = shared;
                s.first_cached_tokens = Some(shared);
                self.running.push(sib);
            }
        }
        for sib in overflow.into_iter().rev() {
            if let Some(s) = self.seqs.get_mut(&sib) {
                s.status = SeqStatus::Waiting;
                self.waiting.push_front(sib);
            }
        }
    }
}
