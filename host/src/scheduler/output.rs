//! The plain data the scheduler hands out: what runs this step ([`SchedulerOutput`]), what the
//! step produced once it ran ([`StepOutcome`]), and a mirror of the block tables that the
//! runtime keeps up to date from the diffs ([`BlockTables`]). No device types.

use std::collections::HashMap;
use std::ops::Range;

use super::request::FinishReason;
use crate::ids::{BlockId, TokenId};
use crate::kv_cache::SeqId;

/// How a sequence's block table changed since the runtime last saw it: keep the first
/// `num_kept` entries, then append `new_blocks`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTableDiff {
    pub num_kept: usize,
    pub new_blocks: Vec<BlockId>,
}

impl BlockTableDiff {
    pub fn apply(&self, table: &mut Vec<BlockId>) {
        table.truncate(self.num_kept);
        table.extend_from_slice(&self.new_blocks);
    }
}

/// Sent once per admission (first schedule, or after a preemption): what the runtime needs
/// to start tracking the sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSeqData {
    pub num_prompt_tokens: usize,
    /// Every known token (prompt, then any output produced before a preemption).
    pub token_ids: Vec<TokenId>,
}

/// One sequence's work in a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub seq: SeqId,
    /// Tokens to run, at positions `num_computed_tokens..`; the last `num_draft_tokens` are
    /// draft tokens to verify.
    pub token_ids: Vec<TokenId>,
    /// Tokens already in the KV cache: the position of `token_ids[0]`.
    pub num_computed_tokens: usize,
    pub num_draft_tokens: usize,
    /// Whether this step reaches the sequence's last known token, so its logits are sampled:
    /// `1 + num_draft_tokens` positions, the last ones of `token_ids`. False for a prefill
    /// chunk that does not finish the prompt.
    pub wants_sample: bool,
    pub block_table: BlockTableDiff,
    /// Prompt tokens this admission skipped because their KV was cached (0 otherwise).
    pub num_cached_tokens: usize,
    /// Present on the first step after (re)admission.
    pub new_seq: Option<NewSeqData>,
    /// The sequence's admission count, echoed back so results of a step that ran before the
    /// sequence was preempted are ignored.
    pub epoch: u32,
    /// Async scheduling: `token_ids` is one placeholder standing for the token that the step
    /// still in flight samples for this sequence; the runtime substitutes that token before
    /// the step runs. Only ever set on a one-token decode.
    pub placeholder: bool,
}

impl ScheduledSeq {
    pub fn num_scheduled_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// Positions this step writes KV for.
    pub fn positions(&self) -> Range<usize> {
        self.num_computed_tokens..self.num_computed_tokens + self.token_ids.len()
    }
}

/// One step's plan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    pub step: u64,
    /// Scheduled sequences: decodes first, then continued prefills, then new admissions.
    pub seqs: Vec<ScheduledSeq>,
    /// Sum of `token_ids.len()` over `seqs`.
    pub num_scheduled_tokens: usize,
    /// Sequences that lost their KV this step; the runtime drops their state.
    pub preempted: Vec<SeqId>,
    /// Sequences that finished or were aborted since the previous step.
    pub finished: Vec<SeqId>,
}

impl SchedulerOutput {
    /// Nothing to run.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}

/// New tokens of one sequence after a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqUpdate {
    pub seq: SeqId,
    pub new_tokens: Vec<TokenId>,
    pub finish: Option<FinishReason>,
}

/// A sequence that ended, with everything it produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedSeq {
    pub seq: SeqId,
    pub num_prompt_tokens: usize,
    pub output_tokens: Vec<TokenId>,
    pub reason: FinishReason,
    /// Prompt tokens its first admission found cached (prefix hit or fork).
    pub num_cached_tokens: usize,
    pub num_preemptions: u32,
}

/// What [`Scheduler::update_from_output`](super::Scheduler::update_from_output) learned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepOutcome {
    /// Sequences that gained tokens, in schedule order.
    pub updates: Vec<SeqUpdate>,
    pub finished: Vec<FinishedSeq>,
}

/// The runtime's copy of every running sequence's block table, kept current by applying each
/// [`SchedulerOutput`] before the step runs.
#[derive(Debug, Clone, Default)]
pub struct BlockTables {
    tables: HashMap<SeqId, Vec<BlockId>>,
}

impl BlockTables {
    pub fn apply(&mut self, out: &SchedulerOutput) {
        for s in out.preempted.iter().chain(&out.finished) {
            self.tables.remove(s);
        }
        for s in &out.seqs {
            s.block_table.apply(self.tables.entry(s.seq).or_default());
        }
    }

    pub fn get(&self, seq: SeqId) -> &[BlockId] {
        self.tables.get(&seq).map(|t| t.as_slice()).unwrap_or(&[])
    }

    /// The table as the raw ids kernels index with.
    pub fn raw(&self, seq: SeqId) -> Vec<u32> {
        self.get(seq).iter().map(|b| b.0).collect()
    }

    pub fn len(&self) -> usize {
        self.tables.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }
}
