//! DeepInfer: an offline LLM inference engine whose policies (sampling, structured output,
//! draft scheduling, expert placement) are sandboxed WebAssembly plugins.
//!
//! Layers, with dependencies pointing one way: `runtime` (generation loop, library API) ->
//! `model` (loaders, tokenizer, architectures) -> `backend` (kernels) -> `tensor`.

pub mod backend;
pub mod error;
pub mod ids;
pub mod sampling;
pub mod tensor;

pub use error::{Error, Result};
