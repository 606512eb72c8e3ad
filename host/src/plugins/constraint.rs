//! The host side of the `constraint` world (structured output): a [`WasmConstraint`] plugin
//! loaded with the tokenizer's vocabulary, and per-sequence [`Matcher`] handles over it (mask,
//! consume, rollback, validate, forced tokens, accepting/finished). It checks every mask's
//! shape, caches compiled grammars by (kind, spec), and survives traps: a trap fails the call
//! that caused it, the instance is rebuilt, and each other matcher is rebuilt on its next call
//! by recompiling its grammar and replaying its accepted tokens. It holds no policy.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use wasmtime::component::{HasSelf, Linker, ResourceAny};
use wasmtime::Store;

use super::abi::PluginKind;
use super::bindings::v0_1_constraint::exports::deepinfer::plugin::constraint_api as api;
use super::bindings::v0_1_constraint::{Constraint as ConstraintWorld, ConstraintPre};
use super::engine::PluginEngine;
use super::limits::{PluginLimits, PluginState};
use super::source::PluginSource;
use crate::error::{Error, Result};
use crate::ids::TokenId;

/// The vocabulary a constraint plugin is initialized with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConstraintVocab {
    pub token_bytes: Vec<u8>,
    pub token_ends: Vec<u32>,
    pub eos_tokens: Vec<TokenId>,
    pub special_tokens: Vec<TokenId>,
    /// Width of the logits (at least the number of tokens).
    pub vocab_size: u32,
}

impl ConstraintVocab {
    /// From one byte string per token.
    pub fn from_tokens<B: AsRef<[u8]>>(
        tokens: &[B],
        eos: &[TokenId],
        special: &[TokenId],
        vocab_size: usize,
    ) -> Self {
        let mut v = ConstraintVocab {
            eos_tokens: eos.to_vec(),
            special_tokens: special.to_vec(),
            vocab_size: vocab_size.max(tokens.len()) as u32,
            ..Default::default()
        };
        for t in tokens {
            v.token_bytes.extend_from_slice(t.as_ref());
            v.token_ends.push(v.token_bytes.len() as u32);
        }
        v
    }

    /// Words per mask.
    pub fn mask_words(&self) -> usize {
        (self.vocab_size as usize).div_ceil(32)
    }

    fn to_wit(&self) -> api::Vocabulary {
        api::Vocabulary {
            token_bytes: self.token_bytes.clone(),
            token_ends: self.token_ends.clone(),
            eos_tokens: self.eos_tokens.clone(),
            special_tokens: self.special_tokens.clone(),
            vocab_size: self.vocab_size,
        }
    }
}

/// What a constraint plugin declared about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConstraintManifest {
    pub name: String,
    pub version: String,
    pub description: String,
    pub kinds: Vec<String>,
}

struct Instance {
    store: Store<PluginState>,
    world: ConstraintWorld,
}

/// One matcher's record: enough to rebuild it on a fresh instance.
struct Slot {
    key: (String, String),
    accepted: Vec<TokenId>,
    /// The guest resource and the instance generation it lives in.
    handle: Option<(u64, ResourceAny)>,
}

/// Compiled grammars kept per instance; past this the oldest is dropped (a matcher made from
/// it keeps working; a rebuild recompiles it).
const MAX_GRAMMARS: usize = 32;

struct Inner {
    inst: Instance,
    generation: u64,
    grammars: HashMap<(String, String), ResourceAny>,
    /// Keys of `grammars`, oldest first.
    grammar_order: VecDeque<(String, String)>,
    slots: HashMap<u64, Slot>,
    next_id: u64,
}

/// A constraint plugin with one instance, shared by the matchers made from it.
pub struct WasmConstraint {
    name: Arc<str>,
    limits: PluginLimits,
    settings: Vec<(String, String)>,
    engine: Arc<PluginEngine>,
    pre: ConstraintPre<PluginState>,
    manifest: ConstraintManifest,
    vocab: api::Vocabulary,
    words: usize,
    inner: Mutex<Inner>,
}

/// A sequence's position in a constraint. Dropping it frees the guest matcher.
pub struct Matcher {
    plugin: Arc<WasmConstraint>,
    id: u64,
}

impl WasmConstraint {
    /// Checks, compiles, instantiates, configures and initializes a constraint plugin.
    pub fn load(
        engine: Arc<PluginEngine>,
        source: &PluginSource,
        vocab: &ConstraintVocab,
    ) -> Result<Arc<WasmConstraint>> {
        let fail = |reason: String| Error::Plugin {
            plugin: source.name.clone(),
            reason,
        };
        let summary = super::abi::inspect(&source.name, &source.bytes)?;
        if summary.kind != PluginKind::Constraint {
            return Err(fail(format!(
                "is a {} plugin, not a constraint",
                summary.kind
            )));
        }
        let component = engine.compile(&source.name, &source.bytes, &source.sha256)?;
        let mut linker = Linker::<PluginState>::new(engine.engine());
        ConstraintWorld::add_to_linker::<PluginState, HasSelf<PluginState>>(&mut linker, |s| s)
            .map_err(|e| fail(format!("linking host imports: {e}")))?;
        let pre = linker
            .instantiate_pre(&component)
            .and_then(ConstraintPre::new)
            .map_err(|e| fail(format!("does not match the constraint world: {e}")))?;
        let name: Arc<str> = source.name.as_str().into();
        let vocab = vocab.to_wit();
        let words = (vocab.vocab_size as usize).div_ceil(32);
        let mut inst = instantiate(
            &pre,
            &engine,
            &name,
            &source.limits,
            &source.settings,
            &vocab,
        )
        .map_err(fail)?;
        let m = call(&mut inst, &source.limits, |w, s| {
            w.deepinfer_plugin_constraint_api().call_manifest(s)
        })
        .map_err(|e| fail(format!("manifest: {e}")))?;
        Ok(Arc::new(WasmConstraint {
            name,
            limits: source.limits,
            settings: source.settings.clone(),
            engine,
            pre,
            manifest: ConstraintManifest {
                name: m.info.name,
                version: m.info.version,
                description: m.info.description,
                kinds: m.kinds,
            },
            vocab,
            words,
            inner: Mutex::new(Inner {
                inst,
                generation: 0,
                grammars: HashMap::new(),
                grammar_order: VecDeque::new(),
                slots: HashMap::new(),
                next_id: 0,
            }),
        }))
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn manifest(&self) -> &ConstraintManifest {
        &self.manifest
    }
    /// Words per mask.
    pub fn mask_words(&self) -> usize {
        self.words
    }

    /// A matcher at the start of `spec` compiled as `kind`. A spec the plugin refuses is a bad
    /// request, with the plugin's message (which names the place).
    pub fn matcher(self: &Arc<Self>, kind: &str, spec: &str) -> Result<Matcher> {
        if !self.manifest.kinds.iter().any(|k| k == kind) {
            return Err(Error::BadRequest(format!(
                "constraint kind `{kind}` is not supported by plugin `{}` (it compiles: {})",
                self.name,
                self.manifest.kinds.join(", ")
            )));
        }
        let mut inner = self.lock();
        let id = inner.next_id;
        inner.next_id += 1;
        inner.slots.insert(
            id,
            Slot {
                key: (kind.to_string(), spec.to_string()),
                accepted: Vec::new(),
                handle: None,
            },
        );
        if let Err(e) = self.ensure(&mut inner, id) {
            inner.slots.remove(&id);
            return Err(e);
        }
        drop(inner);
        Ok(Matcher {
            plugin: self.clone(),
            id,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn plugin_err(&self, reason: String) -> Error {
        Error::Plugin {
            plugin: self.name.to_string(),
            reason,
        }
    }

    /// Makes sure matcher `id` lives in the current instance, rebuilding it if not.
    fn ensure(&self, inner: &mut Inner, id: u64) -> Result<ResourceAny> {
        let slot = inner
            .slots
            .get(&id)
            .ok_or_else(|| self.plugin_err("matcher was dropped".into()))?;
        if let Some((g, h)) = slot.handle {
            if g == inner.generation {
                return Ok(h);
            }
        }
        let key = slot.key.clone();
        let replay = slot.accepted.clone();
        let grammar = match inner.grammars.get(&key) {
            Some(g) => *g,
            None => {
                let (kind, spec) = (&key.0, &key.1);
                let limits = one_off(&self.limits);
                let g = self
                    .call_within(inner, &limits, |w, s| {
                        w.deepinfer_plugin_constraint_api()
                            .grammar()
                            .call_compile(s, kind, spec)
                    })?
                    .map_err(|e| Error::BadRequest(format!("{kind} constraint: {e}")))?;
                if inner.grammars.len() >= MAX_GRAMMARS {
                    if let Some(old) = inner.grammar_order.pop_front() {
                        if let Some(h) = inner.grammars.remove(&old) {
                            let _ = h.resource_drop(&mut inner.inst.store);
                        }
                    }
                }
                inner.grammars.insert(key.clone(), g);
                inner.grammar_order.push_back(key.clone());
                g
            }
        };
        let h = self.call(inner, |w, s| {
            w.deepinfer_plugin_constraint_api()
                .matcher()
                .call_constructor(s, grammar)
        })?;
        if !replay.is_empty() {
            let ids: Vec<u32> = replay.clone();
            self.call(inner, |w, s| {
                w.deepinfer_plugin_constraint_api()
                    .matcher()
                    .call_consume(s, h, &ids)
            })?
            .map_err(|e| self.plugin_err(format!("replaying a matcher: {e}")))?;
        }
        let generation = inner.generation;
        if let Some(slot) = inner.slots.get_mut(&id) {
            slot.handle = Some((generation, h));
        }
        Ok(h)
    }

    /// Runs one call; a trap rebuilds the instance (every matcher is rebuilt on next use).
    fn call<T>(
        &self,
        inner: &mut Inner,
        f: impl FnOnce(&ConstraintWorld, &mut Store<PluginState>) -> wasmtime::Result<T>,
    ) -> Result<T> {
        self.call_within(inner, &self.limits, f)
    }

    fn call_within<T>(
        &self,
        inner: &mut Inner,
        limits: &PluginLimits,
        f: impl FnOnce(&ConstraintWorld, &mut Store<PluginState>) -> wasmtime::Result<T>,
    ) -> Result<T> {
        match call(&mut inner.inst, limits, f) {
            Ok(v) => Ok(v),
            Err(reason) => {
                let fresh = instantiate(
                    &self.pre,
                    &self.engine,
                    &self.name,
                    &self.limits,
                    &self.settings,
                    &self.vocab,
                )
                .map_err(|e| self.plugin_err(format!("{reason}; rebuilding it failed: {e}")))?;
                inner.inst = fresh;
                inner.generation += 1;
                inner.grammars.clear();
                inner.grammar_order.clear();
                Err(self.plugin_err(reason))
            }
        }
    }

    /// Runs `f` on matcher `id`'s guest resource.
    fn with<T>(
        &self,
        id: u64,
        f: impl FnOnce(
            &api::GuestMatcher<'_>,
            &mut Store<PluginState>,
            ResourceAny,
        ) -> wasmtime::Result<T>,
    ) -> Result<T> {
        let mut inner = self.lock();
        let h = self.ensure(&mut inner, id)?;
        self.call(&mut inner, |w, s| {
            f(&w.deepinfer_plugin_constraint_api().matcher(), s, h)
        })
    }

    fn record(&self, id: u64, f: impl FnOnce(&mut Vec<TokenId>)) {
        if let Some(slot) = self.lock().slots.get_mut(&id) {
            f(&mut slot.accepted);
        }
    }
}

impl Matcher {
    /// Appends the allowed-next-token mask (`mask_words` words) to `out`. Bits past the
    /// vocabulary are cleared.
    pub fn mask(&self, out: &mut Vec<u32>) -> Result<()> {
        let p = &self.plugin;
        let words = p
            .with(self.id, |m, s, h| m.call_mask(s, h))?
            .map_err(|e| p.plugin_err(format!("mask: {e}")))?;
        if words.len() != p.words {
            return Err(p.plugin_err(format!(
                "mask has {} words, expected {}",
                words.len(),
                p.words
            )));
        }
        let start = out.len();
        out.extend_from_slice(&words);
        let tail = p.vocab.vocab_size % 32;
        if tail != 0 {
            if let Some(last) = out[start..].last_mut() {
                *last &= (1u32 << tail) - 1;
            }
        }
        Ok(())
    }

    /// Advances over `tokens`; on a refused token it fails, having consumed those before it.
    pub fn consume(&self, tokens: &[TokenId]) -> Result<()> {
        let p = &self.plugin;
        let ids: &[u32] = tokens;
        let ok = self.validate(tokens)? as usize;
        let r = p.with(self.id, |m, s, h| m.call_consume(s, h, &ids[..ok]))?;
        r.map_err(|e| p.plugin_err(format!("consume: {e}")))?;
        p.record(self.id, |a| a.extend_from_slice(&tokens[..ok]));
        match tokens.get(ok) {
            None => Ok(()),
            Some(t) => Err(Error::BadRequest(format!(
                "token {} is not allowed by the constraint here",
                t
            ))),
        }
    }

    /// Undoes the last `n` consumed tokens.
    pub fn rollback(&self, n: usize) -> Result<()> {
        let p = &self.plugin;
        p.with(self.id, |m, s, h| m.call_rollback(s, h, n as u32))?
            .map_err(|e| p.plugin_err(format!("rollback: {e}")))?;
        p.record(self.id, |a| a.truncate(a.len().saturating_sub(n)));
        Ok(())
    }

    /// How many leading tokens of `tokens` the constraint allows.
    pub fn validate(&self, tokens: &[TokenId]) -> Result<u32> {
        let ids: &[u32] = tokens;
        let n = self
            .plugin
            .with(self.id, |m, s, h| m.call_validate(s, h, ids))?;
        Ok(n.min(tokens.len() as u32))
    }

    /// Tokens the constraint forces from here.
    pub fn forced(&self) -> Result<Vec<TokenId>> {
        let v = self.plugin.with(self.id, |m, s, h| m.call_forced(s, h))?;
        Ok(v)
    }

    /// Whether the output so far is complete.
    pub fn is_accepting(&self) -> Result<bool> {
        self.plugin
            .with(self.id, |m, s, h| m.call_is_accepting(s, h))
    }

    /// Whether nothing may follow.
    pub fn is_finished(&self) -> Result<bool> {
        self.plugin
            .with(self.id, |m, s, h| m.call_is_finished(s, h))
    }
}

impl Drop for Matcher {
    fn drop(&mut self) {
        let mut inner = self.plugin.lock();
        let generation = inner.generation;
        if let Some(Slot {
            handle: Some((g, h)),
            ..
        }) = inner.slots.remove(&self.id)
        {
            if g == generation {
                let _ = h.resource_drop(&mut inner.inst.store);
            }
        }
    }
}

fn instantiate(
    pre: &ConstraintPre<PluginState>,
    engine: &PluginEngine,
    name: &Arc<str>,
    limits: &PluginLimits,
    settings: &Vec<(String, String)>,
    vocab: &api::Vocabulary,
) -> std::result::Result<Instance, String> {
    let mut store = Store::new(engine.engine(), PluginState::new(name.clone(), limits));
    store.limiter(|s| s);
    store.epoch_deadline_trap();
    store.set_epoch_deadline(limits.deadline_ticks());
    let world = pre.instantiate(&mut store).map_err(|e| {
        format!(
            "instantiation failed: {}",
            store.data().describe_failure(&e, limits.time_limit_ms)
        )
    })?;
    let mut inst = Instance { store, world };
    call(&mut inst, limits, |w, s| {
        w.deepinfer_plugin_constraint_api()
            .call_configure(s, settings)
    })?
    .map_err(|e| format!("configure failed: {e}"))?;
    call(&mut inst, &one_off(limits), |w, s| {
        w.deepinfer_plugin_constraint_api().call_init(s, vocab)
    })?
    .map_err(|e| format!("init failed: {e}"))?;
    Ok(inst)
}

/// Limits for one-off calls (init: the token index; compile: a new grammar), whose cost is
/// well above a per-step call's.
fn one_off(limits: &PluginLimits) -> PluginLimits {
    PluginLimits {
        time_limit_ms: limits.time_limit_ms.max(10_000),
        ..*limits
    }
}

/// Runs one call under the time limit; a failure is described in words.
fn call<T>(
    inst: &mut Instance,
    limits: &PluginLimits,
    f: impl FnOnce(&ConstraintWorld, &mut Store<PluginState>) -> wasmtime::Result<T>,
) -> std::result::Result<T, String> {
    inst.store.data_mut().begin_call();
    inst.store.set_epoch_deadline(limits.deadline_ticks());
    f(&inst.world, &mut inst.store)
        .map_err(|e| inst.store.data().describe_failure(&e, limits.time_limit_ms))
}

#[cfg(test)]
#[path = "constraint_tests.rs"]
mod tests;
