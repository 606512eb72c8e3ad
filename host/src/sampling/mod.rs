//! Sampling parameters of a request and the native sampler. The Wasm sampler plugins receive
//! the same parameters; the native path stays as the benchmark's comparison.

mod candidates;
mod native;
mod params;

pub use candidates::top_k_into;
pub use native::{apply_penalties, sample_native, top_k_candidates, uniform, Candidate};
pub use params::SamplingParams;

use crate::ids::TokenId;

/// One sequence's row for a sampling call.
pub struct SampleRow<'a> {
    /// Full-vocabulary logits for this position (empty when `candidates` stands in for them).
    pub logits: &'a [f32],
    /// The row's largest logits, largest first (ties by the lower id), selected where the model
    /// ran, in place of `logits` — only for a sampler whose
    /// [`BatchSampler::candidates_wanted`] asked for at most this many.
    pub candidates: Option<TopCandidates<'a>>,
    pub params: &'a SamplingParams,
    /// The sequence's seed (already resolved from the request or the engine).
    pub seed: u64,
    /// Index of the token being sampled within the sequence's output (0 for the first).
    pub step: u64,
    /// Prompt and output tokens so far.
    pub history: &'a [TokenId],
}

/// A row's largest logits standing in for its full row.
#[derive(Debug, Clone, Copy)]
pub struct TopCandidates<'a> {
    pub top: &'a [Candidate],
    /// The length of the full row.
    pub vocab: usize,
}

impl SampleRow<'_> {
    /// The vocabulary size the row's logits cover.
    pub fn vocab(&self) -> usize {
        self.candidates.map_or(self.logits.len(), |c| c.vocab)
    }
}

/// Samples one token per row, for the whole batch in one call. A row's error fails only
/// that row's request.
pub trait BatchSampler: Send + Sync {
    fn sample_batch(&self, rows: &[SampleRow<'_>]) -> Vec<Result<TokenId, String>>;

    /// How many of a row's largest logits this sampler needs to sample with `params`, when
    /// those are all it needs (then the engine may hand it [`SampleRow::candidates`] selected
    /// on the device instead of full rows); `None`: full rows. The default asks for full rows.
    fn candidates_wanted(&self, params: &SamplingParams) -> Option<usize> {
        let _ = params;
        None
    }
}

/// The native sampler as a [`BatchSampler`].
#[derive(Debug, Default, Clone, Copy)]
pub struct NativeSampler;

impl BatchSampler for NativeSampler {
    fn sample_batch(&self, rows: &[SampleRow<'_>]) -> Vec<Result<TokenId, String>> {
        rows.iter()
            .map(|r| {
                if r.logits.is_empty() {
                    return Err("the native sampler needs full logits rows".into());
                }
                Ok(sample_native(r.logits, r.params, r.seed, r.step, r.history))
            })
            .collect()
    }
}
