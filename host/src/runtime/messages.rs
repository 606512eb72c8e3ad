//! What the run's threads send each other. The engine thread (scheduler) hands plans to the
//! executor (forward passes), which hands logits to the sampler stage, which reports sampled
//! tokens back to both; the output stage (detokenizer, stop strings, outputs) reports to the
//! engine. Plain data only.

use std::sync::Arc;
use std::time::Instant;

use super::request::RequestOutput;
use crate::ids::TokenId;
use crate::kv_cache::SeqId;
use crate::model::Logits;
use crate::scheduler::{FinishReason as SchedFinish, SchedulerOutput};

/// Where one step's time went, measured on the executor and the sampler stage.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTiming {
    /// The forward pass.
    pub forward_s: f64,
    /// From the end of the previous forward pass to the start of this one: the time the
    /// compute thread sat idle (`None` for the first step of a run).
    pub gap_s: Option<f64>,
    /// Part of the gap spent waiting for this step's plan from the scheduler.
    pub wait_plan_s: f64,
    /// Part of the gap spent waiting for the previous step's sampled tokens.
    pub wait_sample_s: f64,
    /// Sampling this step's rows (on the sampler stage), mask waits included.
    pub sample_s: f64,
    /// Part of `sample_s` spent waiting for the constraint worker's masks: the exposed mask
    /// time (the rest of the mask work overlapped the forward pass).
    pub mask_wait_s: f64,
    /// Time the constraint worker spent on matchers (consume + mask) since the previous step.
    pub mask_s: f64,
    /// Rows of this step sampled under a constraint.
    pub constrained_rows: usize,
    pub num_tokens: usize,
    pub num_seqs: usize,
    /// Every entry is a one-token decode.
    pub decode_only: bool,
}

/// Executor -> sampler stage: one step's logits (or why the forward pass failed).
pub struct SampleJob {
    pub out: Arc<SchedulerOutput>,
    /// One row per entry with `wants_sample`, in entry order: full rows, or each row's top
    /// candidates selected where the model ran (see `executor::LogitsPolicy`).
    pub logits: Result<Logits, String>,
    pub timing: StepTiming,
}

/// Sampler stage -> executor: the tokens a step sampled, for the next step's placeholders.
pub type SampledTokens = Vec<(SeqId, TokenId)>;

/// Sampler stage -> engine: one step's results.
pub struct StepDone {
    /// Per entry of the step: the sampled tokens (empty when not sampled), or an error that
    /// fails the entry's request.
    pub results: Vec<Result<Vec<TokenId>, String>>,
    pub timing: StepTiming,
    /// When the tokens were sampled.
    pub at: Instant,
}

/// Anything the engine thread waits for.
pub enum EngineEvent {
    Step(StepDone),
    /// The output stage found a stop string in this sequence's text.
    Stop(SeqId),
    /// New text of one sample, for streaming.
    Tokens {
        index: usize,
        sample: u32,
        token_ids: Vec<TokenId>,
        text: String,
    },
    /// A request is complete.
    Output {
        index: usize,
        output: Box<RequestOutput>,
    },
}

/// Engine -> output stage.
pub enum OutputMsg {
    /// Tokens a sequence gained in a step.
    Tokens {
        seq: SeqId,
        tokens: Vec<TokenId>,
        at: Instant,
    },
    /// A sequence ended (for `Aborted`, `error` says why).
    Finished {
        seq: SeqId,
        reason: SchedFinish,
        error: Option<String>,
        num_cached_tokens: usize,
        num_preemptions: u32,
        at: Instant,
    },
}
