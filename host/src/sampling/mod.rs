//! Sampling parameters of a request and the native sampler. The Wasm sampler plugins receive
//! the same parameters; the native path stays as the benchmark's comparison.

mod native;
mod params;

pub use native::{apply_penalties, sample_native, top_k_candidates, uniform, Candidate};
pub use params::SamplingParams;

use crate::ids::TokenId;

/// One sequence's row for a sampling call.
pub struct SampleRow<'a> {
    /// Full-vocabulary logits for this position.
    pub logits: &'a [f32],
    pub params: &'a SamplingParams,
    /// The sequence's seed (already resolved from the request or the engine).
    pub seed: u64,
    /// Index of the token being sampled within the sequence's output (0 for the first).
    pub step: u64,
    /// Prompt and output tokens so far.
    pub history: &'a [TokenId],
}

/// Samples one token per row, for the whole batch in one call. A row's error fails only
/// that row's request.
pub trait BatchSampler: Send + Sync {
    fn sample_batch(&self, rows: &[SampleRow<'_>]) -> Vec<Result<TokenId, String>>;
}

/// The native sampler as a [`BatchSampler`].
#[derive(Debug, Default, Clone, Copy)]
pub struct NativeSampler;

impl BatchSampler for NativeSampler {
    fn sample_batch(&self, rows: &[SampleRow<'_>]) -> Vec<Result<TokenId, String>> {
        rows.iter()
            .map(|r| Ok(sample_native(r.logits, r.params, r.seed, r.step, r.history)))
            .collect()
    }
}
