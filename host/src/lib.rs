//! DeepInfer: an offline LLM inference engine whose policies (sampling, structured output,
//! draft scheduling, expert placement) are sandboxed WebAssembly plugins.
//!
//! Layers, with dependencies pointing one way: `cli` -> `runtime` (generation loop, library
//! API) -> `scheduler` -> `kv_cache`; `runtime` -> `model` (loaders, tokenizer, architectures)
//! -> `backend` (kernels) -> `tensor`. `plugins` hosts the Wasm policy plugins.

pub mod backend;
pub mod bench;
pub mod cli;
pub mod config;
pub mod error;
pub mod eval;
pub mod files;
pub mod ids;
pub mod json;
pub mod kv_cache;
pub mod model;
pub mod plugins;
pub mod runtime;
pub mod sampling;
pub mod scheduler;
pub mod tensor;

pub use error::{Error, Result};
