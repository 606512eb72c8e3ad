//! Helpers shared by the plugin integration tests (`host/tests/plugins_*.rs`): a plugin host
//! with a private cache folder, the test-only plugins `host/build.rs` builds, synthetic logits.
#![allow(dead_code)]

use std::path::PathBuf;

use deepinfer::config::Config;
use deepinfer::plugins::{sha256_hex, CacheDir, PluginHost, WasmSampler};
use deepinfer::sampling::{BatchSampler, SampleRow, SamplingParams};

/// The default model's vocabulary size.
pub const VOCAB: usize = 49_152;

/// A component built by `host/build.rs` for the tests (`typical`, `hostile`, and the builtins).
pub fn test_plugin(name: &str) -> PathBuf {
    PathBuf::from(env!("DEEPINFER_TEST_PLUGIN_DIR")).join(format!("{name}.wasm"))
}

pub fn sha_of(path: &std::path::Path) -> String {
    sha256_hex(&std::fs::read(path).expect("test plugin exists"))
}

/// A host whose compiled-code cache lives in a fresh temporary folder.
pub fn host() -> (tempfile::TempDir, PluginHost) {
    let dir = tempfile::tempdir().expect("tempdir");
    let host = PluginHost::new(&CacheDir::At(dir.path().to_path_buf())).expect("plugin host");
    (dir, host)
}

/// Parses config text; relative paths are resolved against the temp folder it is written to.
pub fn config(text: &str) -> Config {
    Config::from_toml_str(text, None).expect("test config parses")
}

/// A config naming a plugin file with its pin and limits.
pub fn file_plugin_config(name: &str, path: &std::path::Path, extra: &str) -> Config {
    config(&format!(
        "[sampler]\nplugin = \"{name}\"\n[plugins.{name}]\npath = {path:?}\nsha256 = \"{}\"\n{extra}\n",
        sha_of(path)
    ))
}

pub fn load(host: &PluginHost, config: &Config) -> WasmSampler {
    host.load_sampler(config, &config.sampler.plugin)
        .expect("sampler loads")
}

/// Deterministic pseudo-random logits in [-8, 8) for (seed, step).
pub fn logits(seed: u64, step: u64, vocab: usize) -> Vec<f32> {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03);
    (0..vocab)
        .map(|_| {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0
        })
        .collect()
}

/// Samples one row alone.
pub fn sample_one(
    s: &dyn BatchSampler,
    logits: &[f32],
    p: &SamplingParams,
    seed: u64,
    step: u64,
    history: &[u32],
) -> Result<u32, String> {
    let row = SampleRow {
        logits,
        candidates: None,
        params: p,
        seed,
        step,
        history,
    };
    s.sample_batch(std::slice::from_ref(&row))
        .pop()
        .expect("one answer")
}

/// The index of the largest logit (lowest id on ties).
pub fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}
