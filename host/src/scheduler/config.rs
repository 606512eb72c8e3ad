//! Limits of the scheduler, fixed at start: the per-step token budget, the sequence cap, the
//! context length and whether a prompt may be split across steps.

use crate::error::{Error, Result};

/// How much work one step may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most tokens (prefill chunks + decodes + draft tokens) one step runs.
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Context window: prompt + generated tokens of one sequence.
    pub max_model_len: usize,
    /// Split long prompts across steps (chunked prefill). Without it, a prompt runs whole,
    /// and `max_num_batched_tokens` must cover `max_model_len`.
    pub chunked_prefill: bool,
}

impl SchedulerConfig {
    /// Defaults sized for the CPU backend, for a model with this context window.
    pub fn for_context(max_model_len: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_num_batched_tokens: 2048,
            max_num_seqs: 64,
            max_model_len,
            chunked_prefill: true,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.max_num_batched_tokens == 0 || self.max_num_seqs == 0 || self.max_model_len < 2 {
            return Err(Error::BadConfig(format!(
                "scheduler needs max_num_batched_tokens >= 1, max_num_seqs >= 1 and \
                 max_model_len >= 2, got {self:?}"
            )));
        }
        if !self.chunked_prefill && self.max_num_batched_tokens < self.max_model_len {
            return Err(Error::BadConfig(format!(
                "without chunked prefill, max_num_batched_tokens ({}) must be at least \
                 max_model_len ({}) so a recomputed sequence fits one step",
                self.max_num_batched_tokens, self.max_model_len
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        assert!(SchedulerConfig::for_context(8192).validate().is_ok());
        let mut c = SchedulerConfig::for_context(8192);
        c.chunked_prefill = false;
        assert!(c.validate().is_err());
        c.max_num_batched_tokens = 8192;
        assert!(c.validate().is_ok());
        c.max_num_seqs = 0;
        assert!(c.validate().is_err());
    }
}
