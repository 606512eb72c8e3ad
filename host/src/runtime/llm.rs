//! `Llm`: the offline library API. Requests are prepared (templated, tokenized, checked) and
//! run by the engine core (continuous batching over a paged KV cache with prefix reuse,
//! chunked prefill, preemption and async scheduling), sampled through a [`BatchSampler`].
//! A request that fails (bad prompt, sampler error) yields an output with
//! `finish_reason = error`; the others keep running.
//!
//! ```no_run
//! # fn main() -> deepinfer::Result<()> {
//! use std::sync::Arc;
//! use deepinfer::runtime::{EngineOptions, Llm};
//! use deepinfer::sampling::{NativeSampler, SamplingParams};
//!
//! let model = deepinfer::model::load("model.gguf".as_ref(), deepinfer::backend::Device::cpu_all())?;
//! let llm = Llm::new(model, Arc::new(NativeSampler), EngineOptions::default())?;
//! let params = SamplingParams { max_tokens: 32, ..Default::default() };
//! for out in llm.generate_prompts(&["The capital of France is", "1, 2, 3,"], &params) {
//!     println!("{}: {}", out.id, out.text);
//! }
//! println!("{}", llm.last_summary().unwrap_or_default());
//! # Ok(()) }
//! ```

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::engine::{self, EngineCore, Prepared, RunContext};
use super::options::{EngineOptions, ResolvedSizes};
use super::request::{Constraint, PromptInput, Request, RequestOutput, StreamEvent};
use super::sample_stage::mix;
use super::stats::RunSummary;
use crate::error::{Error, Result};
use crate::ids::TokenId;
use crate::kv_cache::{KvCacheConfig, KvCacheManager, KvCacheStats};
use crate::model::LoadedModel;
use crate::plugins::{
    CacheDir, ConstraintVocab, Matcher, PluginEngine, PluginSource, WasmConstraint,
};
use crate::sampling::{BatchSampler, SamplingParams};
use crate::scheduler::Scheduler;

/// An offline inference engine over one loaded model.
pub struct Llm {
    model: LoadedModel,
    sampler: Arc<dyn BatchSampler>,
    opts: EngineOptions,
    sizes: ResolvedSizes,
    /// Scheduler, KV manager and KV storage; one run at a time holds it.
    core: Mutex<EngineCore>,
    last_summary: Mutex<Option<RunSummary>>,
    /// The constraint plugin (structured output): set with [`Llm::set_constraint_plugin`],
    /// else the builtin `grammar`, loaded when the first constrained request comes.
    constraints: OnceLock<std::result::Result<Arc<WasmConstraint>, String>>,
}

/// Linear memory of the builtin `grammar` plugin when loaded by default: its token index over
/// a 49K-152K vocabulary plus parser state.
pub const DEFAULT_GRAMMAR_MEMORY_MIB: u32 = 256;
/// Per-call time limit of the builtin `grammar` plugin when loaded by default: a mask inside a
/// free-text JSON string walks most of the vocabulary and, on a loaded machine, can take tens
/// of milliseconds; a call past the limit fails its request.
pub const DEFAULT_GRAMMAR_TIME_LIMIT_MS: u32 = 2000;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Llm {
    /// Sizes the KV cache from `opts.kv_budget` once and allocates it (the CPU backend's
    /// pages cost memory only once written).
    pub fn new(
        model: LoadedModel,
        sampler: Arc<dyn BatchSampler>,
        opts: EngineOptions,
    ) -> Result<Llm> {
        let layout = model.model.kv_layout(opts.block_size);
        let sizes = opts.resolve_layout(model.model.config(), &layout)?;
        let manager = KvCacheManager::new(KvCacheConfig {
            num_blocks: sizes.num_blocks,
            block_size: opts.block_size,
            enable_prefix_caching: opts.enable_prefix_caching,
        })?;
        let mut scheduler = Scheduler::new(sizes.scheduler, manager)?;
        scheduler.set_async_decode(opts.async_scheduling);
        let kv = model.model.new_kv(sizes.num_blocks, opts.block_size)?;
        tracing::info!(
            "KV cache: {} blocks of {} tokens ({} MiB at most)",
            sizes.num_blocks,
            opts.block_size,
            (sizes.num_blocks * sizes.bytes_per_block) >> 20
        );
        Ok(Llm {
            model,
            sampler,
            opts,
            sizes,
            core: Mutex::new(EngineCore {
                scheduler,
                kv,
                next_request: 0,
            }),
            last_summary: Mutex::new(None),
            constraints: OnceLock::new(),
        })
    }

    /// The vocabulary a constraint plugin is initialized with: each token's bytes, EOS, the
    /// special tokens, and the logits width.
    pub fn constraint_vocab(&self) -> ConstraintVocab {
        let tok = &self.model.tokenizer;
        let tokens: Vec<Vec<u8>> = (0..tok.vocab_size() as TokenId)
            .map(|t| tok.token_bytes(t))
            .collect();
        let special: Vec<TokenId> = (tok.special_ids().into_iter())
            .filter(|t| !tok.eos.contains(t))
            .collect();
        let width = self.model.model.config().vocab;
        ConstraintVocab::from_tokens(&tokens, &tok.eos, &special, width)
    }

    /// Uses `plugin` (loaded with [`Llm::constraint_vocab`]) for constrained requests. Fails if
    /// a constraint plugin is already in use.
    pub fn set_constraint_plugin(&self, plugin: Arc<WasmConstraint>) -> Result<()> {
        self.constraints
            .set(Ok(plugin))
            .map_err(|_| Error::BadRequest("this engine already has its constraint plugin".into()))
    }

    /// The constraint plugin, loading the builtin `grammar` if none was set.
    pub fn constraint_plugin(&self) -> Result<Arc<WasmConstraint>> {
        let loaded = self.constraints.get_or_init(|| {
            let load = || -> Result<Arc<WasmConstraint>> {
                let mut source = PluginSource::resolve("grammar", None)?;
                source.limits.memory_mib = source.limits.memory_mib.max(DEFAULT_GRAMMAR_MEMORY_MIB);
                source.limits.time_limit_ms =
                    (source.limits.time_limit_ms).max(DEFAULT_GRAMMAR_TIME_LIMIT_MS);
                let engine = PluginEngine::new(&CacheDir::Default)?;
                WasmConstraint::load(engine, &source, &self.constraint_vocab())
            };
            load().map_err(|e| e.to_string())
        });
        loaded.clone().map_err(|reason| Error::Plugin {
            plugin: "grammar".into(),
            reason,
        })
    }

    /// Compiles a constraint (or finds it compiled), refusing a bad spec with a message that
    /// names the place; nothing runs.
    pub fn check_constraint(&self, c: &Constraint) -> Result<()> {
        self.constraint_plugin()?
            .matcher(&c.kind, &c.spec)
            .map(drop)
    }

    /// One matcher per sample of a constrained request (none for a free one).
    fn matchers(&self, req: &Request) -> Result<Vec<Matcher>> {
        let Some(c) = &req.constraint else {
            return Ok(Vec::new());
        };
        if req.params.ignore_eos {
            return Err(Error::BadRequest(
                "ignore_eos cannot be combined with a constraint (the constraint decides where \
                 the output may end)"
                    .into(),
            ));
        }
        let plugin = self.constraint_plugin()?;
        (0..req.n)
            .map(|_| plugin.matcher(&c.kind, &c.spec))
            .collect()
    }

    pub fn model(&self) -> &LoadedModel {
        &self.model
    }

    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    /// KV blocks the budget gave.
    pub fn num_kv_blocks(&self) -> usize {
        self.sizes.num_blocks
    }

    /// The KV cache's counters (blocks in use and cached, prefix hits over the engine's life).
    pub fn kv_stats(&self) -> KvCacheStats {
        lock(&self.core).scheduler.kv_stats()
    }

    /// The summary of the latest finished run.
    pub fn last_summary(&self) -> Option<RunSummary> {
        lock(&self.last_summary).clone()
    }

    /// Templated prompt text (if any) and its token ids, with the request's limits checked.
    pub fn prepare(&self, req: &Request) -> Result<(Option<String>, Vec<TokenId>)> {
        req.params.validate().map_err(Error::BadRequest)?;
        if req.n == 0 {
            return Err(Error::BadRequest("n must be at least 1".into()));
        }
        let tok = &self.model.tokenizer;
        let (text, ids) = match &req.prompt {
            PromptInput::Text(t) => (Some(t.clone()), tok.encode(t)?),
            PromptInput::Chat(msgs) => {
                let tpl =
                    self.model.chat_template.as_ref().ok_or_else(|| {
                        Error::ChatTemplate("the model has no chat template".into())
                    })?;
                let t = tpl.render(msgs, true)?;
                let ids = tok.encode(&t)?;
                (Some(t), ids)
            }
            PromptInput::Tokens(ids) => (None, ids.clone()),
        };
        if ids.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let cfg = self.model.model.config();
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= cfg.vocab) {
            return Err(Error::BadRequest(format!(
                "prompt token id {bad} is outside the vocabulary ({})",
                cfg.vocab
            )));
        }
        let needed = ids.len() + req.params.max_tokens;
        if needed > cfg.context_len {
            return Err(Error::PromptTooLong {
                prompt_tokens: ids.len(),
                max_tokens: req.params.max_tokens,
                needed,
                context: cfg.context_len,
            });
        }
        Ok((text, ids))
    }

    /// Runs every request to completion; `on_done` sees each output as it finishes (in
    /// completion order). The returned outputs are in request order.
    pub fn generate(
        &self,
        requests: &[Request],
        on_done: &mut dyn FnMut(&RequestOutput),
    ) -> Vec<RequestOutput> {
        let mut outputs: Vec<Option<RequestOutput>> = vec![None; requests.len()];
        self.generate_stream(requests, &mut |ev| {
            if let StreamEvent::Finished { index, output } = ev {
                on_done(output);
                outputs[index] = Some(output.clone());
            }
        });
        outputs
            .into_iter()
            .zip(requests)
            .map(|(o, r)| {
                o.unwrap_or_else(|| RequestOutput::failed(r.id.clone(), None, "no output".into()))
            })
            .collect()
    }

    /// Text prompts with shared parameters (vLLM's `generate(prompts, params)`); ids are
    /// the prompts' indices.
    pub fn generate_prompts<S: AsRef<str>>(
        &self,
        prompts: &[S],
        params: &SamplingParams,
    ) -> Vec<RequestOutput> {
        let requests: Vec<Request> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| Request::text(i.to_string(), p.as_ref(), params.clone()))
            .collect();
        self.generate(&requests, &mut |_| {})
    }

    /// The streaming form: `on_event` sees every sample's new tokens (with their text) as
    /// they are produced, and each request's output as soon as it is complete. Returns the
    /// run's summary (also kept for [`Llm::last_summary`]). Runs one at a time per engine.
    pub fn generate_stream(
        &self,
        requests: &[Request],
        on_event: &mut dyn FnMut(StreamEvent<'_>),
    ) -> RunSummary {
        let prepared: Vec<std::result::Result<Prepared, String>> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let (text, ids) = self.prepare(r).map_err(|e| e.to_string())?;
                let matchers = self.matchers(r).map_err(|e| e.to_string())?;
                Ok(Prepared {
                    text,
                    ids,
                    seed: r
                        .params
                        .seed
                        .unwrap_or_else(|| mix(self.opts.seed, i as u64)),
                    matchers: Mutex::new(matchers),
                })
            })
            .collect();
        let mut core = lock(&self.core);
        let ctx = RunContext {
            model: &self.model,
            sampler: self.sampler.as_ref(),
            async_scheduling: self.opts.async_scheduling,
            select_candidates: self.opts.select_candidates,
            progress: self.opts.progress,
        };
        let summary = engine::run(&mut core, ctx, requests, &prepared, on_event);
        drop(core);
        *lock(&self.last_summary) = Some(summary.clone());
        summary
    }
}
