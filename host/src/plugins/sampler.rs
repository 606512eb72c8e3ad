//! The host side of the `sampler` world: a [`BatchSampler`] that sends each step's batch to a
//! Wasm sampler plugin in one call and checks every answer. It chooses the candidates the
//! plugin sees, isolates failures (a batch that traps or answers malformed is retried row by
//! row on fresh instances, so only the guilty rows fail), and never trusts a token id.

use std::sync::Arc;

use wasmtime::component::{HasSelf, Linker};
use wasmtime::Store;

use super::abi::{AbiVersion, PluginKind};
use super::bindings::v0_1::sampler::exports::deepinfer::plugin::sampler_api as api;
use super::bindings::v0_1::sampler::{Sampler as SamplerWorld, SamplerPre};
use super::engine::PluginEngine;
use super::limits::{PluginLimits, PluginState};
use super::source::{Origin, PluginSource};
use crate::error::{Error, Result};
use crate::ids::TokenId;
use crate::sampling::{top_k_into, BatchSampler, Candidate, SampleRow, SamplingParams};

/// Candidates per row when the manifest says 0.
pub const DEFAULT_TOP_K: u32 = 256;
/// The most candidates a manifest may ask for (more means "send full logits").
const MAX_TOP_K: u32 = 1 << 16;

/// What a sampler plugin declared about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SamplerManifest {
    pub name: String,
    pub version: String,
    pub description: String,
    /// Candidates per row (already resolved: never 0).
    pub top_k: u32,
    pub full_logits: bool,
    /// "none", "penalized" or "always".
    pub history: &'static str,
}

/// One live instance with its store and reusable buffers.
struct Instance {
    store: Store<PluginState>,
    world: SamplerWorld,
    batch: api::Batch,
    top: Vec<Candidate>,
}

/// A sampler plugin, ready to be called from any thread.
pub struct WasmSampler {
    name: Arc<str>,
    origin: Origin,
    sha256: String,
    abi: AbiVersion,
    limits: PluginLimits,
    settings: Vec<(String, String)>,
    engine: Arc<PluginEngine>,
    pre: SamplerPre<PluginState>,
    manifest: SamplerManifest,
    history: api::HistoryNeed,
    pool: super::pool::Pool<Instance>,
}

impl WasmSampler {
    /// Checks, compiles (or loads from the cache), instantiates and configures a sampler plugin,
    /// and reads its manifest. Every error names the plugin.
    pub fn load(engine: Arc<PluginEngine>, source: &PluginSource) -> Result<WasmSampler> {
        let name: Arc<str> = source.name.as_str().into();
        let fail = |reason: String| Error::Plugin {
            plugin: source.name.clone(),
            reason,
        };
        let summary = super::abi::inspect(&source.name, &source.bytes)?;
        if summary.kind != PluginKind::Sampler {
            return Err(fail(format!("is a {} plugin, not a sampler", summary.kind)));
        }
        let component = engine.compile(&source.name, &source.bytes, &source.sha256)?;
        let mut linker = Linker::<PluginState>::new(engine.engine());
        SamplerWorld::add_to_linker::<PluginState, HasSelf<PluginState>>(&mut linker, |s| s)
            .map_err(|e| fail(format!("linking host imports: {e}")))?;
        let pre = linker
            .instantiate_pre(&component)
            .and_then(SamplerPre::new)
            .map_err(|e| fail(format!("does not match the sampler world: {e}")))?;
        let mut sampler = WasmSampler {
            name: name.clone(),
            origin: source.origin.clone(),
            sha256: source.sha256.clone(),
            abi: summary.abi,
            limits: source.limits,
            settings: source.settings.clone(),
            engine,
            pre,
            manifest: SamplerManifest {
                name: String::new(),
                version: String::new(),
                description: String::new(),
                top_k: DEFAULT_TOP_K,
                full_logits: false,
                history: "none",
            },
            history: api::HistoryNeed::None,
            pool: super::pool::Pool::new(source.limits.pool_size as usize),
        };
        let mut first = sampler.instantiate().map_err(fail)?;
        let m = sampler
            .call(&mut first, |w, s| {
                w.deepinfer_plugin_sampler_api().call_manifest(s)
            })
            .map_err(|e| fail(format!("manifest: {e}")))?;
        if m.top_k > MAX_TOP_K {
            return Err(fail(format!("manifest asks for {} candidates (at most {MAX_TOP_K}; ask for full logits instead)", m.top_k)));
        }
        sampler.history = m.history;
        sampler.manifest = SamplerManifest {
            name: m.info.name,
            version: m.info.version,
            description: m.info.description,
            top_k: if m.top_k == 0 { DEFAULT_TOP_K } else { m.top_k },
            full_logits: m.full_logits,
            history: match m.history {
                api::HistoryNeed::None => "none",
                api::HistoryNeed::Penalized => "penalized",
                api::HistoryNeed::Always => "always",
            },
        };
        sampler.pool.adopt(first);
        Ok(sampler)
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn manifest(&self) -> &SamplerManifest {
        &self.manifest
    }
    pub fn abi(&self) -> AbiVersion {
        self.abi
    }
    pub fn sha256(&self) -> &str {
        &self.sha256
    }
    pub fn origin(&self) -> &Origin {
        &self.origin
    }
    pub fn limits(&self) -> PluginLimits {
        self.limits
    }

    /// A fresh, configured instance.
    fn instantiate(&self) -> std::result::Result<Instance, String> {
        let mut store = Store::new(
            self.engine.engine(),
            PluginState::new(self.name.clone(), &self.limits),
        );
        store.limiter(|s| s);
        store.epoch_deadline_trap();
        store.set_epoch_deadline(self.limits.deadline_ticks());
        let world = self.pre.instantiate(&mut store).map_err(|e| {
            format!(
                "instantiation failed: {}",
                store.data().describe_failure(&e, self.limits.time_limit_ms)
            )
        })?;
        let mut inst = Instance {
            store,
            world,
            batch: empty_batch(),
            top: Vec::new(),
        };
        let settings = self.settings.clone();
        self.call(&mut inst, |w, s| {
            w.deepinfer_plugin_sampler_api()
                .call_configure(s, &settings)
        })?
        .map_err(|e| format!("configure failed: {e}"))?;
        Ok(inst)
    }

    /// Runs one call under the time limit; a failure is described in words.
    fn call<T>(
        &self,
        inst: &mut Instance,
        f: impl FnOnce(&SamplerWorld, &mut Store<PluginState>) -> wasmtime::Result<T>,
    ) -> std::result::Result<T, String> {
        inst.store.data_mut().begin_call();
        inst.store.set_epoch_deadline(self.limits.deadline_ticks());
        f(&inst.world, &mut inst.store).map_err(|e| {
            inst.store
                .data()
                .describe_failure(&e, self.limits.time_limit_ms)
        })
    }

    /// Fills the instance's batch buffers from `rows`.
    fn fill(&self, inst: &mut Instance, rows: &[SampleRow<'_>], vocab: usize) {
        let b = &mut inst.batch;
        b.rows.clear();
        b.candidate_ids.clear();
        b.candidate_logits.clear();
        b.history.clear();
        b.logits.clear();
        b.vocab_size = vocab as u32;
        for r in rows {
            let start = b.candidate_ids.len();
            let top = match r.candidates {
                Some(c) => &c.top[..c.top.len().min(self.manifest.top_k as usize)],
                None => {
                    top_k_into(r.logits, self.manifest.top_k as usize, &mut inst.top);
                    &inst.top[..]
                }
            };
            for c in top {
                b.candidate_ids.push(c.id);
                b.candidate_logits.push(c.logit);
            }
            for &(t, _) in &r.params.logit_bias {
                // Biased tokens come from full rows (`candidates_wanted` asks for those then).
                let fresh = (t as usize) < vocab && !b.candidate_ids[start..].contains(&t);
                if let (true, Some(&l)) = (fresh, r.logits.get(t as usize)) {
                    b.candidate_ids.push(t);
                    b.candidate_logits.push(l);
                }
            }
            let wants_history = match self.history {
                api::HistoryNeed::None => false,
                api::HistoryNeed::Penalized => has_penalties(r.params),
                api::HistoryNeed::Always => true,
            };
            let history: &[TokenId] = if wants_history { r.history } else { &[] };
            b.history.extend_from_slice(history);
            if self.manifest.full_logits {
                b.logits.extend_from_slice(r.logits);
            }
            b.rows.push(api::Row {
                params: wit_params(r.params),
                seed: r.seed,
                step: r.step,
                candidates: (b.candidate_ids.len() - start) as u32,
                history: history.len() as u32,
            });
        }
    }

    /// One call for all of `rows`. `Err` means the whole call failed (trap, limit, malformed
    /// answer); `Ok` holds each row's own result, checked.
    fn try_batch(
        &self,
        rows: &[SampleRow<'_>],
    ) -> std::result::Result<Vec<Result<TokenId, String>>, String> {
        let vocab = rows[0].vocab();
        if rows.iter().any(|r| r.vocab() != vocab) {
            return Err("rows of one batch have different vocabulary sizes".into());
        }
        let mut inst = self
            .pool
            .lease(|| self.instantiate())
            .map_err(|e| self.msg(&e))?;
        self.fill(&mut inst, rows, vocab);
        let answer = {
            let Instance {
                store,
                world,
                batch,
                ..
            } = &mut *inst;
            store.data_mut().begin_call();
            store.set_epoch_deadline(self.limits.deadline_ticks());
            world
                .deepinfer_plugin_sampler_api()
                .call_sample(&mut *store, batch)
                .map_err(|e| store.data().describe_failure(&e, self.limits.time_limit_ms))
        };
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                // A trapped instance may be in any state: drop it; the pool builds a new one.
                inst.discard();
                return Err(self.msg(&e));
            }
        };
        if answer.len() != rows.len() {
            inst.give_back();
            return Err(self.msg(&format!(
                "returned a malformed result: {} answers for {} rows",
                answer.len(),
                rows.len()
            )));
        }
        let mut out = Vec::with_capacity(rows.len());
        let mut start = 0usize;
        for (row, a) in inst.batch.rows.iter().zip(answer) {
            let cands = &inst.batch.candidate_ids[start..start + row.candidates as usize];
            start += row.candidates as usize;
            out.push(match a {
                Err(e) => Err(self.msg(&format!("failed this row: {e}"))),
                Ok(t) if t as usize >= vocab => Err(self.msg(&format!(
                    "returned token {t}, outside the vocabulary of {vocab} tokens"
                ))),
                Ok(t) if !self.manifest.full_logits && !cands.contains(&t) => {
                    Err(self.msg(&format!(
                        "returned token {t}, which is not among the row's {} candidates",
                        cands.len()
                    )))
                }
                Ok(t) => Ok(t),
            });
        }
        inst.give_back();
        Ok(out)
    }

    fn msg(&self, what: &str) -> String {
        format!("sampler plugin `{}` {what}", self.name)
    }
}

impl BatchSampler for WasmSampler {
    /// The manifest's candidate count, unless the plugin reads full logits or the row has a
    /// logit bias (biased tokens outside the top-K are added from the full row).
    fn candidates_wanted(&self, params: &SamplingParams) -> Option<usize> {
        (!self.manifest.full_logits && params.logit_bias.is_empty())
            .then_some(self.manifest.top_k as usize)
    }

    fn sample_batch(&self, rows: &[SampleRow<'_>]) -> Vec<Result<TokenId, String>> {
        if rows.is_empty() {
            return Vec::new();
        }
        match self.try_batch(rows) {
            Ok(out) => out,
            Err(e) if rows.len() == 1 => vec![Err(e)],
            Err(e) => {
                // Find the guilty rows: every row alone, each on a healthy instance.
                tracing::warn!(
                    plugin = &*self.name,
                    "batch call failed, retrying row by row: {e}"
                );
                rows.iter()
                    .map(|r| match self.try_batch(std::slice::from_ref(r)) {
                        Ok(mut one) => one
                            .pop()
                            .unwrap_or_else(|| Err(self.msg("returned no answer"))),
                        Err(e) => Err(e),
                    })
                    .collect()
            }
        }
    }
}

fn has_penalties(p: &SamplingParams) -> bool {
    p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
}

fn wit_params(p: &SamplingParams) -> api::SamplingParams {
    api::SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        logit_bias: p.logit_bias.clone(),
    }
}

fn empty_batch() -> api::Batch {
    api::Batch {
        rows: Vec::new(),
        candidate_ids: Vec::new(),
        candidate_logits: Vec::new(),
        history: Vec::new(),
        logits: Vec::new(),
        vocab_size: 0,
    }
}
