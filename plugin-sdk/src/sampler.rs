//! The sampler plugin kind: a trait with defaults, the row type it sees, and the glue the
//! `export_sampler!` macro wires to the generated bindings.

use crate::{Candidate, PluginInfo, SamplingParams, Settings, TokenId};

/// Which rows get their token history from the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HistoryNeed {
    /// No row does.
    None,
    /// Only rows that set a repetition, presence or frequency penalty.
    Penalized,
    /// Every row.
    Always,
}

/// One sequence's row of a step.
#[derive(Debug, Clone, Copy)]
pub struct Row<'a> {
    /// The `TOP_K` highest raw logits, highest first (ties: lower id first), then any token
    /// named in `params.logit_bias` that is not already among them.
    pub candidates: &'a [Candidate],
    pub params: &'a SamplingParams,
    /// Seed of the sequence's random stream.
    pub seed: u64,
    /// Index of the token being sampled within the sequence's output.
    pub step: u64,
    /// Prompt and output tokens so far (empty unless `HISTORY` asks for it).
    pub history: &'a [TokenId],
    /// Full-vocabulary logits (empty unless `FULL_LOGITS` is set).
    pub logits: &'a [f32],
    /// Size of the model's vocabulary.
    pub vocab_size: u32,
}

impl Row<'_> {
    /// The row's uniform draw in [0, 1) for this step (Philox keyed by seed, step).
    pub fn uniform(&self) -> f64 {
        crate::rng::uniform(self.seed, self.step, 0)
    }
}

/// A sampler plugin. Implement `sample` (and `configure` if it takes settings), then call
/// [`export_sampler!`](crate::export_sampler) with the type.
///
/// A sampler must be a pure function of its rows: draw randomness with [`Row::uniform`] or
/// [`crate::rng`], never from state carried between calls, so that a row's result does not
/// depend on the rest of the batch and the host may retry rows one at a time.
pub trait Sampler: Default + 'static {
    /// One line for `deepinfer plugins inspect`.
    const DESCRIPTION: &'static str = "";
    /// Candidates per row; 0 means the host's default (256).
    const TOP_K: u32 = 0;
    /// Also receive every row's full-vocabulary logits (costly).
    const FULL_LOGITS: bool = false;
    /// Which rows receive their token history.
    const HISTORY: HistoryNeed = HistoryNeed::None;

    /// Applies the plugin's settings once per instance. The default accepts none.
    fn configure(&mut self, settings: &Settings) -> Result<(), String> {
        settings.reject_unknown(&[])
    }

    /// Picks one row's token: one of `row.candidates`, or with `FULL_LOGITS` any id below
    /// `row.vocab_size`.
    fn sample(&mut self, row: &Row<'_>) -> Result<TokenId, String>;

    /// Picks every row's token. The default calls `sample` per row.
    fn sample_batch(&mut self, rows: &[Row<'_>]) -> Vec<Result<TokenId, String>> {
        rows.iter().map(|r| self.sample(r)).collect()
    }
}

/// Exports a [`Sampler`] type as the plugin's `sampler` world. On targets other than wasm32 it
/// expands to nothing, so the crate also builds natively for tests and benchmarks.
#[macro_export]
macro_rules! export_sampler {
    ($ty:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            use $crate::bindings::sampler::exports::deepinfer::plugin::sampler_api as api;

            ::std::thread_local! {
                static STATE: ::std::cell::RefCell<::std::option::Option<$ty>> =
                    const { ::std::cell::RefCell::new(::std::option::Option::None) };
            }

            struct Glue;

            impl api::Guest for Glue {
                fn manifest() -> api::SamplerManifest {
                    $crate::sampler::__glue::manifest::<$ty>(
                        ::core::env!("CARGO_PKG_NAME"),
                        ::core::env!("CARGO_PKG_VERSION"),
                    )
                }
                fn configure(
                    settings: ::std::vec::Vec<(::std::string::String, ::std::string::String)>,
                ) -> ::std::result::Result<(), ::std::string::String> {
                    STATE.with(|s| $crate::sampler::__glue::configure::<$ty>(s, settings))
                }
                fn sample(
                    batch: api::Batch,
                ) -> ::std::vec::Vec<::std::result::Result<u32, ::std::string::String>> {
                    STATE.with(|s| $crate::sampler::__glue::sample::<$ty>(s, batch))
                }
            }

    $crate::bindings::sampler::export_world!(Glue with_types_in $crate::bindings::sampler);
        };
    };
}

/// Conversions between the generated bindings and the SDK's types. Used by the macro only.
#[doc(hidden)]
pub mod __glue {
    use super::*;
    use crate::bindings::sampler::deepinfer::plugin::types as wit_types;
    use crate::bindings::sampler::exports::deepinfer::plugin::sampler_api as api;
    use std::cell::RefCell;

    pub fn manifest<S: Sampler>(name: &str, version: &str) -> api::SamplerManifest {
        let info = PluginInfo {
            name: name.to_string(),
            version: version.to_string(),
            description: S::DESCRIPTION.to_string(),
        };
        api::SamplerManifest {
            info: wit_types::PluginInfo {
                name: info.name,
                version: info.version,
                description: info.description,
            },
            top_k: S::TOP_K,
            full_logits: S::FULL_LOGITS,
            history: match S::HISTORY {
                HistoryNeed::None => api::HistoryNeed::None,
                HistoryNeed::Penalized => api::HistoryNeed::Penalized,
                HistoryNeed::Always => api::HistoryNeed::Always,
            },
        }
    }

    pub fn configure<S: Sampler>(
        state: &RefCell<Option<S>>,
        settings: Vec<(String, String)>,
    ) -> Result<(), String> {
        crate::log::install_panic_hook();
        let mut sampler = S::default();
        sampler.configure(&Settings::new(settings))?;
        *state.borrow_mut() = Some(sampler);
        Ok(())
    }

    fn params(p: api::SamplingParams) -> SamplingParams {
        SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            logit_bias: p.logit_bias,
        }
    }

    pub fn sample<S: Sampler>(
        state: &RefCell<Option<S>>,
        batch: api::Batch,
    ) -> Vec<Result<TokenId, String>> {
        let n = batch.rows.len();
        let fail = |msg: String| (0..n).map(|_| Err(msg.clone())).collect();
        let total_cands: u64 = batch.rows.iter().map(|r| r.candidates as u64).sum();
        let total_hist: u64 = batch.rows.iter().map(|r| r.history as u64).sum();
        let vocab = batch.vocab_size as usize;
        if total_cands != batch.candidate_ids.len() as u64
            || batch.candidate_ids.len() != batch.candidate_logits.len()
            || total_hist != batch.history.len() as u64
            || !(batch.logits.is_empty() || batch.logits.len() == vocab * n)
        {
            return fail("inconsistent batch from the host".to_string());
        }
        let candidates: Vec<Candidate> = batch
            .candidate_ids
            .iter()
            .zip(&batch.candidate_logits)
            .map(|(&id, &logit)| Candidate { id, logit })
            .collect();
        let row_params: Vec<SamplingParams> = batch
            .rows
            .iter()
            .map(|r| params(r.params.clone()))
            .collect();
        let mut rows = Vec::with_capacity(n);
        let (mut c, mut h) = (0usize, 0usize);
        for (i, r) in batch.rows.iter().enumerate() {
            let (nc, nh) = (r.candidates as usize, r.history as usize);
            rows.push(Row {
                candidates: &candidates[c..c + nc],
                params: &row_params[i],
                seed: r.seed,
                step: r.step,
                history: &batch.history[h..h + nh],
                logits: if batch.logits.is_empty() {
                    &[]
                } else {
                    &batch.logits[i * vocab..(i + 1) * vocab]
                },
                vocab_size: batch.vocab_size,
            });
            c += nc;
            h += nh;
        }
        let mut guard = state.borrow_mut();
        let sampler = guard.get_or_insert_with(S::default);
        sampler.sample_batch(&rows)
    }
}
