//! The generation runtime: the library API ([`Llm`]) and the engine core that runs requests
//! through the scheduler, the model and a sampler. It owns the threads of a run (engine
//! loop, executor, sampler stage, output stage) and the data they pass; it must not contain
//! scheduling policy (`scheduler`), KV bookkeeping (`kv_cache`) or kernels (`backend`).

mod constraint_stage;
mod engine;
mod executor;
mod llm;
mod messages;
mod options;
mod output_stage;
mod progress;
mod request;
mod sample_stage;
mod stats;
pub mod text;

pub use llm::{Llm, DEFAULT_GRAMMAR_MEMORY_MIB, DEFAULT_GRAMMAR_TIME_LIMIT_MS};
pub use messages::StepTiming;
pub use options::{available_memory, EngineOptions, ResolvedSizes, DEFAULT_KV_BUDGET};
pub use request::{
    Constraint, FinishReason, PromptInput, Request, RequestOutput, SampleOutput, StreamEvent,
    Timings,
};
pub use stats::RunSummary;
