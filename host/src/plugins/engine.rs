//! The wasmtime engine every plugin runs on: its configuration (epoch interruption, stack cap,
//! no fuel, no WASI), the ticker thread that advances the epoch, and compiling components
//! through the `.cwasm` cache.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use wasmtime::component::Component;
use wasmtime::{Config, Engine};

use super::cache::{self, CacheDir};
use super::limits::{MAX_WASM_STACK, TICK};
use crate::error::{Error, Result};

/// The shared engine and its compiled-code cache. Cheap to share behind an `Arc`; the ticker
/// thread stops when the last owner drops it.
pub struct PluginEngine {
    engine: Engine,
    cache_dir: Option<PathBuf>,
    engine_key: String,
    ticker: Option<Ticker>,
}

struct Ticker {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The engine configuration. Everything that affects compiled code is here, so the
/// compatibility hash (the cache key) changes whenever it does.
fn engine_config() -> Config {
    let mut c = Config::new();
    c.wasm_component_model(true)
        .epoch_interruption(true)
        .max_wasm_stack(MAX_WASM_STACK)
        .cranelift_opt_level(wasmtime::OptLevel::Speed);
    c
}

impl PluginEngine {
    /// Builds the engine and starts its ticker thread.
    pub fn new(cache: &CacheDir) -> Result<Arc<PluginEngine>> {
        let mut me = PluginEngine::without_ticker(cache)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (engine, flag) = (me.engine.clone(), stop.clone());
        let handle = std::thread::Builder::new()
            .name("plugin-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(TICK);
                    engine.increment_epoch();
                }
            })
            .map_err(|e| engine_error(format!("cannot start the epoch ticker thread: {e}")))?;
        me.ticker = Some(Ticker {
            stop,
            handle: Some(handle),
        });
        Ok(Arc::new(me))
    }

    /// An engine that can compile and inspect but whose calls would never time out: for
    /// `plugins list` and for loading without running.
    pub fn without_ticker(cache: &CacheDir) -> Result<PluginEngine> {
        let engine = Engine::new(&engine_config()).map_err(|e| engine_error(e.to_string()))?;
        let engine_key = cache::engine_key(&engine);
        Ok(PluginEngine {
            engine,
            cache_dir: cache.resolve(),
            engine_key,
            ticker: None,
        })
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Whether calls on this engine are interrupted at their deadline.
    pub fn has_ticker(&self) -> bool {
        self.ticker.is_some()
    }

    /// The cache file a component with this sha256 would use, if caching is on.
    pub fn cache_path(&self, sha256: &str) -> Option<PathBuf> {
        self.cache_dir
            .as_ref()
            .map(|d| cache::entry_path(d, sha256, &self.engine_key))
    }

    /// Whether a compiled form of the component is cached.
    pub fn is_cached(&self, sha256: &str) -> bool {
        self.cache_path(sha256).is_some_and(|p| p.is_file())
    }

    /// Compiles a component, or loads its compiled form from the cache (and fills the cache
    /// on a miss). A cache that cannot be read or written only costs a compile.
    pub fn compile(&self, plugin: &str, bytes: &[u8], sha256: &str) -> Result<Component> {
        let path = self.cache_path(sha256);
        if let Some(p) = path.as_ref().filter(|p| p.is_file()) {
            // SAFETY: `deserialize_file` runs machine code from the file. We only load files
            // this cache wrote (named by the component's sha256 and the engine's compatibility
            // hash, written atomically) in the user's own cache folder; wasmtime also checks
            // the header and the engine compatibility before using it.
            match unsafe { Component::deserialize_file(&self.engine, p) } {
                Ok(c) => return Ok(c),
                Err(e) => {
                    tracing::warn!(plugin, path = %p.display(), "ignoring unusable cached plugin: {e}")
                }
            }
        }
        let component = Component::new(&self.engine, bytes).map_err(|e| Error::Plugin {
            plugin: plugin.to_string(),
            reason: format!("does not compile: {e}"),
        })?;
        if let Some(p) = path {
            match component.serialize() {
                Ok(compiled) => {
                    if let Err(e) = cache::write_atomically(&p, &compiled) {
                        tracing::warn!(plugin, path = %p.display(), "cannot cache the compiled plugin: {e}");
                    }
                }
                Err(e) => tracing::warn!(plugin, "cannot serialize the compiled plugin: {e}"),
            }
        }
        Ok(component)
    }
}

fn engine_error(reason: String) -> Error {
    Error::Plugin {
        plugin: "<engine>".into(),
        reason,
    }
}
