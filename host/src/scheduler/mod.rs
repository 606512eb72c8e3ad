//! The scheduler: decides how many tokens each sequence runs per step. Plain data, no device
//! types; it never touches tensors or the model, only token ids, counts and block ids.
//!
//! One mechanism covers prefill, chunked prefill, decode and draft verification: each step,
//! every scheduled sequence runs `token_ids.len()` tokens starting at position
//! `num_computed_tokens` (vLLM v1's idea). Each step hands out a token budget
//! (`max_num_batched_tokens`) under a sequence cap (`max_num_seqs`): decodes first, then
//! continued prefills, then waiting requests in FCFS order while budget and KV blocks last.
//! When blocks run out, the newest running sequence is preempted: its blocks are freed, it
//! goes back to the front of the queue and later recomputes prompt and output (often from
//! the prefix cache). Requests with `n > 1` run their prompt once; the further samples fork
//! from its blocks.
//!
//! The runtime drives it in three calls per step:
//!
//! ```
//! use deepinfer::ids::RequestId;
//! use deepinfer::kv_cache::{KvCacheConfig, KvCacheManager};
//! use deepinfer::scheduler::{BlockTables, NewRequest, Scheduler, SchedulerConfig, StopCondition};
//!
//! let kv = KvCacheManager::new(KvCacheConfig {
//!     num_blocks: 64,
//!     block_size: 16,
//!     enable_prefix_caching: true,
//! })?;
//! let mut sched = Scheduler::new(SchedulerConfig::for_context(2048), kv)?;
//! let stop = StopCondition { max_tokens: 4, eos_token_ids: vec![2], ignore_eos: false, stop_token_ids: vec![] };
//! sched.add_request(NewRequest { id: RequestId(7), prompt: vec![1, 5, 9], stop, n: 1 })?;
//!
//! let mut tables = BlockTables::default(); // the runtime's copy of the block tables
//! while sched.has_unfinished() {
//!     let out = sched.schedule();
//!     tables.apply(&out);
//!     // For each `s` in `out.seqs`, the model runs `s.token_ids` at positions
//!     // `s.positions()`, writing K/V of position `p` into block
//!     // `tables.get(s.seq)[p / block_size]`, slot `p % block_size`, and samples the last
//!     // `1 + s.num_draft_tokens` positions where `s.wants_sample`.
//!     let sampled: Vec<Vec<u32>> = out
//!         .seqs
//!         .iter()
//!         .map(|s| if s.wants_sample { vec![42] } else { vec![] })
//!         .collect();
//!     let outcome = sched.update_from_output(&out, &sampled)?;
//!     for done in outcome.finished {
//!         assert_eq!(done.output_tokens, vec![42; 4]);
//!     }
//! }
//! assert_eq!(sched.kv_stats().blocks_used, 0);
//! # Ok::<(), deepinfer::Error>(())
//! ```
//!
//! Speculative decoding: call [`Scheduler::set_draft_tokens`] before `schedule()`; a decoding
//! sequence then runs `1 + k` tokens, and `update_from_output` takes the accepted tokens
//! (accepted drafts plus one) and rolls the KV of rejected ones back. Stop strings are found
//! by the detokenizer, off this loop, which calls [`Scheduler::finish_seq`].

mod config;
mod output;
mod request;
mod schedule;
mod state;
mod update;

pub use self::config::SchedulerConfig;
pub use self::output::{
    BlockTableDiff, BlockTables, FinishedSeq, NewSeqData, ScheduledSeq, SchedulerOutput, SeqUpdate,
    StepOutcome,
};
pub use self::request::{FinishReason, NewRequest, StopCondition};
pub use self::schedule::PLACEHOLDER_TOKEN;
pub use self::state::{Scheduler, SchedulerStats};
pub use crate::kv_cache::SeqId;

#[cfg(test)]
mod fake_model;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;
