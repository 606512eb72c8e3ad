//! What a request brings (prompt, stop conditions, number of samples) and the scheduler's
//! private record of each sequence. Token ids only; text and stop strings live elsewhere.

use std::sync::Arc;

use crate::ids::{RequestId, TokenId};
use crate::kv_cache::{BlockHash, SeqId};
use crate::sampling::SamplingParams;

/// When a sequence stops generating, by token id. Stop *strings* need text and are checked
/// by the detokenizer, which then calls [`Scheduler::finish_seq`](super::Scheduler::finish_seq).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopCondition {
    /// Most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// End-of-sequence ids of the model.
    pub eos_token_ids: Vec<TokenId>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
    /// More ids that end a sequence.
    pub stop_token_ids: Vec<TokenId>,
}

impl StopCondition {
    /// From sampling parameters and the model's EOS ids.
    pub fn from_params(params: &SamplingParams, eos_token_ids: &[TokenId]) -> StopCondition {
        StopCondition {
            max_tokens: params.max_tokens,
            eos_token_ids: eos_token_ids.to_vec(),
            ignore_eos: params.ignore_eos,
            stop_token_ids: Vec::new(),
        }
    }

    /// Why a sequence stops after emitting `token` as its `num_output_tokens`-th output
    /// token, if it does. A stop token counts: it stays in the output.
    pub fn check(&self, token: TokenId, num_output_tokens: usize) -> Option<FinishReason> {
        if !self.ignore_eos && self.eos_token_ids.contains(&token) {
            Some(FinishReason::Eos)
        } else if self.stop_token_ids.contains(&token) {
            Some(FinishReason::StopToken(token))
        } else if num_output_tokens >= self.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FinishReason {
    /// Reached `max_tokens`.
    Length,
    /// Emitted an end-of-sequence token.
    Eos,
    /// Emitted one of the request's stop token ids.
    StopToken(TokenId),
    /// The detokenizer found a stop string.
    StopString,
    /// Cancelled, or failed outside the scheduler (e.g. a plugin trapped).
    Aborted,
}

/// A request as the scheduler receives it: token ids, stop conditions, samples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRequest {
    pub id: RequestId,
    pub prompt: Vec<TokenId>,
    pub stop: StopCondition,
    /// Independent samples of the same prompt (`n`); they share the prompt's KV blocks.
    pub n: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SeqStatus {
    Waiting,
    Running,
    /// A further sample waiting for sample 0 to compute the shared prompt.
    Parked,
}

/// The scheduler's record of one sequence.
#[derive(Debug, Clone)]
pub(super) struct Sequence {
    pub id: SeqId,
    /// Prompt then generated tokens.
    pub tokens: Vec<TokenId>,
    pub num_prompt_tokens: usize,
    /// Tokens whose KV is written (or being written by a step in flight).
    pub num_computed_tokens: usize,
    /// Chained hashes of the full blocks of `tokens`.
    pub block_hashes: Vec<BlockHash>,
    pub stop: Arc<StopCondition>,
    pub status: SeqStatus,
    /// Draft tokens proposed for the next step (speculative decoding).
    pub draft_tokens: Vec<TokenId>,
    /// Tokens skipped at the latest admission (prefix hit or fork), reported once.
    pub num_cached_tokens: usize,
    /// Prompt tokens skipped at the first admission, for the final report.
    pub first_cached_tokens: Option<usize>,
    pub num_preemptions: u32,
    /// Leading entries of the block table the runtime already has.
    pub synced_blocks: usize,
    /// Whether the runtime has seen this sequence since its latest admission.
    pub known_to_runtime: bool,
    /// Admission count: results of steps from an earlier admission are ignored.
    pub epoch: u32,
    /// For sample 0 of an `n > 1` request: the samples waiting to fork from it.
    pub parked_siblings: Vec<SeqId>,
    /// Scheduled steps of this admission that sample this sequence and whose results have
    /// not come back yet (async scheduling runs one step ahead of the results).
    pub pending_samples: usize,
}

impl Sequence {
    pub fn new(
        id: SeqId,
        prompt: Vec<TokenId>,
        stop: Arc<StopCondition>,
        status: SeqStatus,
    ) -> Sequence {
        Sequence {
            id,
            num_prompt_tokens: prompt.len(),
            tokens: prompt,
            num_computed_tokens: 0,
            block_hashes: Vec::new(),
            stop,
            status,
            draft_tokens: Vec::new(),
            num_cached_tokens: 0,
            first_cached_tokens: None,
            num_preemptions: 0,
            synced_blocks: 0,
            known_to_runtime: false,
            epoch: 0,
            parked_siblings: Vec::new(),
            pending_samples: 0,
        }
    }

    pub fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }

    /// Known tokens whose KV is not computed yet (0 while a decode is in flight).
    pub fn num_uncomputed(&self) -> usize {
        self.tokens.len().saturating_sub(self.num_computed_tokens)
    }

    /// Whether async scheduling may run this sequence's next decode before the token it
    /// feeds is known: a sample is in flight, every known token is computed, and the token
    /// in flight will not be the last one `max_tokens` allows.
    pub fn can_decode_ahead(&self) -> bool {
        self.pending_samples > 0
            && self.num_computed_tokens == self.tokens.len()
            && self.num_output_tokens() + self.pending_samples < self.stop.max_tokens
    }

    /// Drafts worth running: one step yields at most `drafts + 1` tokens, so never more
    /// than the tokens the sequence may still generate, minus one.
    pub fn usable_drafts(&self) -> usize {
        let left = self
            .stop
            .max_tokens
            .saturating_sub(self.num_output_tokens());
        self.draft_tokens.len().min(left.saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_checks_eos_stop_ids_and_length() {
        let mut s = StopCondition {
            max_tokens: 3,
            eos_token_ids: vec![2],
            ignore_eos: false,
            stop_token_ids: vec![7],
        };
        assert_eq!(s.check(2, 1), Some(FinishReason::Eos));
        assert_eq!(s.check(7, 1), Some(FinishReason::StopToken(7)));
        assert_eq!(s.check(5, 2), None);
        assert_eq!(s.check(5, 3), Some(FinishReason::Length));
        s.ignore_eos = true;
        assert_eq!(s.check(2, 1), None);
    }
}
