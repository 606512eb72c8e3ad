//! Shared helpers for the end-to-end tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use deepinfer::backend::Device;
use deepinfer::model::{fetch, load, LoadedModel};
use deepinfer::runtime::{EngineOptions, Llm, PromptInput, Request};
use deepinfer::sampling::{NativeSampler, SamplingParams};

/// The default model, fetched through the same path `deepinfer generate` uses.
pub fn default_model_path() -> PathBuf {
    fetch::resolve_model(None, &mut |m| eprintln!("test setup: {m}"))
        .expect("the default model is available")
}

pub fn default_model() -> LoadedModel {
    load(&default_model_path(), Device::Cpu { threads: 2 }).expect("the default model loads")
}

/// Runs the binary with `args`, asserting that it fails with an error rather than a panic;
/// returns what it printed to stderr.
pub fn refused<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(args)
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "succeeded: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

pub fn load_cpu(path: &std::path::Path) -> deepinfer::Result<LoadedModel> {
    load(path, Device::Cpu { threads: 2 })
}

pub fn engine(model: LoadedModel) -> Llm {
    engine_with(model, EngineOptions::default())
}

pub fn engine_with(model: LoadedModel, opts: EngineOptions) -> Llm {
    Llm::new(model, Arc::new(NativeSampler), opts).expect("the engine starts")
}

pub fn greedy(id: &str, prompt: PromptInput, max_tokens: usize) -> Request {
    Request::new(
        id,
        prompt,
        SamplingParams {
            max_tokens,
            ..Default::default()
        },
    )
}

/// The reference vectors in `tests/data/smollm2_greedy.json`.
pub struct RefCase {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub top5_next: Vec<u32>,
    pub greedy_ids: Vec<u32>,
}

pub fn reference_cases() -> Vec<RefCase> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/data/smollm2_greedy.json"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("reference file"))
            .expect("json");
    let ids = |x: &serde_json::Value| -> Vec<u32> {
        x.as_array()
            .expect("array")
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect()
    };
    v.as_array()
        .expect("list")
        .iter()
        .map(|c| RefCase {
            prompt: c["prompt"].as_str().expect("prompt").to_string(),
            prompt_ids: ids(&c["prompt_ids"]),
            top5_next: ids(&c["top5_next"]),
            greedy_ids: ids(&c["greedy_ids"]),
        })
        .collect()
}
