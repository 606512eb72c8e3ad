//! Plugin host: wasmtime components under limits, loaded from config and pinned by hash.
//! It owns the sandbox (engine, limits, instance pools, compiled-code cache), the static ABI
//! check, and the host side of each plugin kind; it must not contain any plugin's policy.
//!
//! Entry points:
//! - [`build_sampler`]: the sampler a config names, as `Arc<dyn BatchSampler>`.
//! - [`PluginHost`]: an engine with its cache folder, to load several plugins or to choose the
//!   cache folder (tests do).
//! - [`describe`]: what `deepinfer plugins list` shows about one configured plugin.

mod abi;
mod bindings;
mod builtin;
mod cache;
mod constraint;
mod engine;
mod limits;
mod pack;
mod pool;
mod sampler;
mod source;

use std::sync::Arc;

pub use crate::sampling::top_k_into;
pub use abi::{inspect as inspect_component, AbiVersion, PluginKind, Summary, SUPPORTED};
pub use cache::{sha256_hex, CacheDir};
pub use constraint::{ConstraintManifest, ConstraintVocab, Matcher, WasmConstraint};
pub use engine::PluginEngine;
pub use limits::{PluginLimits, MAX_WASM_STACK};
pub use pack::pack_component;
pub use sampler::{SamplerManifest, WasmSampler, DEFAULT_TOP_K};
pub use source::{Origin, PluginSource};

use crate::config::Config;
use crate::error::Result;
use crate::sampling::BatchSampler;

/// Names of the plugins built into this host.
pub fn builtin_names() -> Vec<&'static str> {
    builtin::names().collect()
}

/// A plugin engine and its compiled-code cache.
#[derive(Clone)]
pub struct PluginHost {
    engine: Arc<PluginEngine>,
}

impl PluginHost {
    /// Starts an engine (and its epoch ticker) caching compiled plugins in `cache`.
    pub fn new(cache: &CacheDir) -> Result<PluginHost> {
        Ok(PluginHost {
            engine: PluginEngine::new(cache)?,
        })
    }

    pub fn engine(&self) -> &Arc<PluginEngine> {
        &self.engine
    }

    /// Loads the sampler plugin `name` as `config` describes it.
    pub fn load_sampler(&self, config: &Config, name: &str) -> Result<WasmSampler> {
        let source = PluginSource::from_config(config, name)?;
        WasmSampler::load(self.engine.clone(), &source)
    }
}

/// The sampler `config.sampler.plugin` names, loaded on an engine with the default cache
/// folder. Errors name the plugin (and the file, for a file or hash problem).
pub fn build_sampler(config: &Config) -> Result<Arc<dyn BatchSampler>> {
    let host = PluginHost::new(&CacheDir::Default)?;
    Ok(Arc::new(host.load_sampler(config, &config.sampler.plugin)?))
}

/// What can be said about a configured plugin without running it.
#[derive(Debug, Clone)]
pub struct PluginDescription {
    pub source: PluginSource,
    /// The static ABI check's result (an error if the component is refused).
    pub summary: std::result::Result<Summary, String>,
    /// Whether a compiled form is in the cache for this engine.
    pub cached: bool,
}

/// Describes plugin `name` of `config` (reads and hashes the file, checks the ABI statically,
/// looks in the cache); compiles nothing.
pub fn describe(config: &Config, name: &str, engine: &PluginEngine) -> Result<PluginDescription> {
    let source = PluginSource::from_config(config, name)?;
    let summary = abi::inspect(name, &source.bytes).map_err(|e| e.to_string());
    let cached = engine.is_cached(&source.sha256);
    Ok(PluginDescription {
        source,
        summary,
        cached,
    })
}
