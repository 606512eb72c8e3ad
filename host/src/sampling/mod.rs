//! Sampling parameters of a request and the native sampler. The Wasm sampler plugins receive
//! the same parameters; the native path stays as the benchmark's comparison.

mod native;
mod params;

pub use native::{sample_native, top_k_candidates, Candidate};
pub use params::SamplingParams;
