//! Hostile plugins: each misbehaviour fails only its own row, with an error that says what
//! happened, while the other rows of the same batch finish; the sampler keeps serving after.
//! Bad files (wrong pin, unknown ABI major, WASI imports) are refused before they run.

#[path = "plugins/common.rs"]
mod common;

use common::*;
use deepinfer::plugins::{PluginSource, WasmSampler};
use deepinfer::sampling::{BatchSampler, SampleRow, SamplingParams};
use deepinfer::Error;

// Seeds that trigger the hostile plugin (host/tests/plugins/hostile).
const LOOP: u64 = 1001;
const GROW: u64 = 1002;
const PANIC: u64 = 1003;
const OUT_OF_VOCAB: u64 = 1004;
const NOT_A_CANDIDATE: u64 = 1005;
const WRONG_COUNT: u64 = 1006;
const DEEP_RECURSION: u64 = 1007;
const ROW_ERROR: u64 = 1008;

fn hostile(host: &deepinfer::plugins::PluginHost) -> WasmSampler {
    let cfg = file_plugin_config(
        "hostile",
        &test_plugin("hostile"),
        "memory_mib = 16\ntime_limit_ms = 40\npool_size = 2",
    );
    load(host, &cfg)
}

/// Runs one batch with the given seeds; good rows must get their argmax.
fn run(s: &WasmSampler, seeds: &[u64]) -> Vec<Result<u32, String>> {
    let p = SamplingParams::default();
    let logits: Vec<Vec<f32>> = (0..seeds.len())
        .map(|i| logits(i as u64, 0, 1000))
        .collect();
    let rows: Vec<SampleRow<'_>> = seeds
        .iter()
        .zip(&logits)
        .map(|(&seed, l)| SampleRow {
            logits: l,
            candidates: None,
            params: &p,
            seed,
            step: 0,
            history: &[],
        })
        .collect();
    let out = s.sample_batch(&rows);
    assert_eq!(out.len(), seeds.len());
    for ((seed, l), r) in seeds.iter().zip(&logits).zip(&out) {
        if *seed < 1000 {
            assert_eq!(
                r.as_ref().ok(),
                Some(&argmax(l)),
                "good row (seed {seed}) must finish: {r:?}"
            );
        }
    }
    out
}

fn expect_only_bad_row_fails(seed: u64, words: &[&str]) {
    let (_cache, host) = host();
    let s = hostile(&host);
    let out = run(&s, &[1, seed, 2, 3]);
    let err = out[1].as_ref().expect_err("the hostile row fails");
    for w in words {
        assert!(
            err.contains(w),
            "error for seed {seed} should mention {w:?}: {err}"
        );
    }
    assert!(err.contains("hostile"), "names the plugin: {err}");
    // The sampler keeps serving: a clean batch after the failure.
    let again = run(&s, &[4, 5, 6]);
    assert!(again.iter().all(|r| r.is_ok()));
}

#[test]
fn infinite_loop_hits_the_time_limit() {
    expect_only_bad_row_fails(LOOP, &["time limit", "40 ms"]);
}

#[test]
fn unbounded_memory_growth_hits_the_memory_limit() {
    expect_only_bad_row_fails(GROW, &["memory limit", "16 MiB"]);
}

#[test]
fn a_panic_is_reported_with_its_message() {
    expect_only_bad_row_fails(PANIC, &["panicked", "on purpose"]);
}

#[test]
fn a_token_outside_the_vocabulary_is_refused() {
    expect_only_bad_row_fails(OUT_OF_VOCAB, &["outside the vocabulary", "1007"]);
}

#[test]
fn a_token_outside_the_candidates_is_refused() {
    expect_only_bad_row_fails(NOT_A_CANDIDATE, &["not among", "4 candidates"]);
}

#[test]
fn a_malformed_result_fails_only_its_row() {
    expect_only_bad_row_fails(WRONG_COUNT, &["malformed", "0 answers for 1 rows"]);
}

#[test]
fn deep_recursion_hits_the_stack_cap() {
    expect_only_bad_row_fails(DEEP_RECURSION, &["stack"]);
}

#[test]
fn a_row_error_fails_only_that_row() {
    expect_only_bad_row_fails(ROW_ERROR, &["refuses this row"]);
}

#[test]
fn every_hostile_row_in_one_batch_fails_alone() {
    let (_cache, host) = host();
    let s = hostile(&host);
    let seeds = [
        1,
        LOOP,
        2,
        GROW,
        PANIC,
        3,
        OUT_OF_VOCAB,
        NOT_A_CANDIDATE,
        WRONG_COUNT,
        DEEP_RECURSION,
        ROW_ERROR,
        4,
    ];
    let out = run(&s, &seeds);
    for (seed, r) in seeds.iter().zip(&out) {
        assert_eq!(r.is_ok(), *seed < 1000, "seed {seed}: {r:?}");
    }
}

#[test]
fn a_wrong_sha256_names_the_file_and_both_hashes() {
    let path = test_plugin("hostile");
    let wrong = "ab".repeat(32);
    let cfg = config(&format!(
        "[sampler]\nplugin = \"h\"\n[plugins.h]\npath = {path:?}\nsha256 = \"{wrong}\"\n"
    ));
    let (_cache, host) = host();
    let err = host.load_sampler(&cfg, "h").err().expect("refused");
    assert!(matches!(err, Error::PluginHashMismatch { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&wrong) && msg.contains(&sha_of(&path)) && msg.contains("hostile.wasm"),
        "{msg}"
    );
}

/// A component exporting `export` whose instantiation would trap at once (a core start
/// function that executes `unreachable`), so a refusal proves it was never instantiated.
fn component_exporting(export: &str, import: Option<&str>) -> Vec<u8> {
    let import = import
        .map(|name| format!(r#"(import "{name}" (instance (export "get-arguments" (func (result (list string))))))"#))
        .unwrap_or_default();
    let text = format!(
        r#"(component
            {import}
            (core module $m (func $boom unreachable) (start $boom) (func (export "f")))
            (core instance $i (instantiate $m))
            (func $f (canon lift (core func $i "f")))
            (instance $api (export "manifest" (func $f)))
            (export "{export}" (instance $api)))"#
    );
    wat::parse_str(text).expect("test component assembles")
}

fn load_bytes(name: &str, bytes: Vec<u8>) -> Result<WasmSampler, Error> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{name}.wasm"));
    std::fs::write(&path, &bytes).unwrap();
    let cfg = file_plugin_config(name, &path, "");
    let source = PluginSource::from_config(&cfg, name)?;
    let (_cache, host) = host();
    WasmSampler::load(host.engine().clone(), &source)
}

#[test]
fn an_unknown_abi_major_is_refused_before_instantiation() {
    for version in ["9.0.0", "0.2.0"] {
        let bytes = component_exporting(&format!("deepinfer:plugin/sampler-api@{version}"), None);
        let err = load_bytes("future", bytes).err().expect("refused");
        assert!(matches!(err, Error::PluginAbi { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains(version) && msg.contains("0.1.x") && msg.contains("future"),
            "{msg}"
        );
    }
}

#[test]
fn a_plugin_importing_wasi_is_refused() {
    let bytes = component_exporting(
        "deepinfer:plugin/sampler-api@0.1.0",
        Some("wasi:cli/environment@0.2.0"),
    );
    let err = load_bytes("wasi_user", bytes).err().expect("refused");
    assert!(matches!(err, Error::PluginImport { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("wasi:cli/environment@0.2.0") && msg.contains("wasm32-unknown-unknown"),
        "{msg}"
    );
}

#[test]
fn a_valid_name_passes_the_static_check_but_not_the_world_check() {
    // Control for the two tests above: with a supported name and no foreign import, the same
    // component gets past the static check and is refused by the world's type check instead.
    let bytes = component_exporting("deepinfer:plugin/sampler-api@0.1.0", None);
    let err = load_bytes("trapper", bytes).err().expect("refused");
    assert!(matches!(err, Error::Plugin { .. }), "{err}");
    assert!(
        err.to_string().contains("does not match the sampler world"),
        "{err}"
    );
}
