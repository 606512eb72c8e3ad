//! The generation runtime: runs requests through a model and a sampler.

mod llm;
mod request;

pub use llm::{EngineOptions, Llm};
pub use request::{FinishReason, PromptInput, Request, RequestOutput, Timings};
