//! Constraint plugin figures through Wasm: init time, grammar compile time, and mask time per
//! token (p50 / p99) while feeding a JSON document token by token, on synthetic 49,152- and
//! 131,072-token vocabularies and on the default model's real vocabulary; then engine runs of
//! the default model, constrained and free, at batch 1 and 16: throughput and the mask time
//! left exposed per step. Run: `cargo bench -p deepinfer --bench constraint_mask`
//! (`-- --no-engine` skips the engine runs).

use std::sync::Arc;
use std::time::Instant;

use deepinfer::backend::Device;
use deepinfer::plugins::{CacheDir, ConstraintVocab, PluginEngine, PluginSource, WasmConstraint};
use deepinfer::runtime::{Constraint, EngineOptions, Llm, Request};
use deepinfer::sampling::{NativeSampler, SamplingParams};

const SCHEMA: &str = r##"{"type":"object","properties":{
  "name":{"type":"string","maxLength":20},
  "age":{"type":"integer","minimum":0,"maximum":150},
  "tags":{"type":"array","items":{"enum":["a","b","c"]},"maxItems":4},
  "home":{"$ref":"#/$defs/addr"}},
  "required":["name","age","tags","home"],"additionalProperties":false,
  "$defs":{"addr":{"type":"object","properties":{"city":{"type":"string"},"zip":{"type":"string","pattern":"^[0-9]{5}$"}},
  "required":["city","zip"],"additionalProperties":false}}}"##;
const DOC: &str =
    r#"{"name":"Ada Lovelace","age":36,"tags":["a","c"],"home":{"city":"London","zip":"12345"}}"#;

/// Printable bytes, then pseudo-random ASCII words of 2-8 bytes up to `size` tokens.
fn vocab(size: usize) -> (Vec<Vec<u8>>, u32) {
    let mut tokens: Vec<Vec<u8>> = vec![b"<eos>".to_vec()];
    tokens.extend((0..=255u8).map(|b| vec![b]));
    let alphabet = b"abcdefghijklmnopqrstuvwxyz0123456789\":,{}[] _ABCDEFGHIJ";
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut seen = std::collections::HashSet::new();
    while tokens.len() < size {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = 2 + (x % 7) as usize;
        let w: Vec<u8> = (0..len)
            .map(|i| alphabet[((x >> (8 + 5 * i)) % alphabet.len() as u64) as usize])
            .collect();
        if seen.insert(w.clone()) {
            tokens.push(w);
        }
    }
    (tokens, 0)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Loads the grammar plugin over `cv`; returns it with its load+init time in ms.
fn plugin(cv: &ConstraintVocab) -> (Arc<WasmConstraint>, f64) {
    let engine = PluginEngine::new(&CacheDir::Disabled).expect("engine");
    let mut source = PluginSource::resolve("grammar", None).expect("grammar plugin");
    source.limits.memory_mib = 512;
    let t = Instant::now();
    let plugin = WasmConstraint::load(engine, &source, cv).expect("load");
    (plugin, t.elapsed().as_secs_f64() * 1e3)
}

/// Feeds DOC `rounds` times (fresh matchers) by the longest allowed token, timing each mask
/// in microseconds; returns (compile ms of the first matcher, mask times).
fn feed(plugin: &Arc<WasmConstraint>, tokens: &[Vec<u8>], rounds: usize) -> (f64, Vec<f64>) {
    let t = Instant::now();
    drop(plugin.matcher("json-schema", SCHEMA).expect("compile"));
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut times = Vec::new();
    let mut mask = Vec::new();
    for _ in 0..rounds {
        let m = plugin.matcher("json-schema", SCHEMA).expect("compile");
        let mut rest = DOC.as_bytes();
        while !rest.is_empty() {
            mask.clear();
            let t = Instant::now();
            m.mask(&mut mask).expect("mask");
            times.push(t.elapsed().as_secs_f64() * 1e6);
            let best = (0..tokens.len())
                .filter(|&i| mask[i / 32] >> (i % 32) & 1 == 1 && !tokens[i].is_empty())
                .filter(|&i| rest.starts_with(&tokens[i]))
                .max_by_key(|&i| tokens[i].len())
                .expect("some allowed token continues the document");
            m.consume(&[best as u32]).expect("consume");
            rest = &rest[tokens[best].len()..];
        }
        assert!(m.is_accepting().unwrap());
    }
    (compile_ms, times)
}

fn report(label: &str, load_ms: f64, compile_ms: f64, mut times: Vec<f64>) {
    let n = times.len();
    println!(
        "{label}: load+init {load_ms:.0} ms, first compile {compile_ms:.2} ms, mask over {n} steps: \
         p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        pct(&mut times, 0.5),
        pct(&mut times, 0.99),
        pct(&mut times, 1.0)
    );
}

fn run_synthetic(size: usize) {
    let (tokens, eos) = vocab(size);
    let cv = ConstraintVocab::from_tokens(&tokens, &[eos], &[], size);
    let (plugin, load_ms) = plugin(&cv);
    let (compile_ms, times) = feed(&plugin, &tokens, 5);
    report(
        &format!("synthetic vocab {size}"),
        load_ms,
        compile_ms,
        times,
    );
}

/// Schemas of typical size, each compiled once (first request with a new schema).
const COMPILE_SET: &[&str] = &[
    r#"{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"]}"#,
    r#"{"type":"array","items":{"type":"object","properties":{"x":{"type":"number"},"y":{"type":"number"}},"required":["x","y"]},"maxItems":10}"#,
    r#"{"type":"object","properties":{"status":{"enum":["ok","error","pending"]},"code":{"type":"integer","minimum":100,"maximum":599},"tags":{"type":"array","items":{"type":"string","pattern":"^[a-z]{1,8}$"}}},"required":["status","code"],"additionalProperties":false}"#,
    r#"{"anyOf":[{"type":"object","properties":{"circle":{"type":"number","minimum":0}},"required":["circle"]},{"type":"object","properties":{"square":{"type":"number","minimum":0}},"required":["square"]}]}"#,
];

fn run_real(llm: &Llm) {
    let cv = llm.constraint_vocab();
    let tokens: Vec<Vec<u8>> = (0..cv.token_ends.len())
        .map(|t| {
            let start = if t == 0 {
                0
            } else {
                cv.token_ends[t - 1] as usize
            };
            let special =
                cv.special_tokens.contains(&(t as u32)) || cv.eos_tokens.contains(&(t as u32));
            if special {
                Vec::new()
            } else {
                cv.token_bytes[start..cv.token_ends[t] as usize].to_vec()
            }
        })
        .collect();
    let (plugin, load_ms) = plugin(&cv);
    let (compile_ms, times) = feed(&plugin, &tokens, 5);
    report("default model vocab 49152", load_ms, compile_ms, times);
    let mut compiles = Vec::new();
    for s in COMPILE_SET {
        let t = Instant::now();
        drop(plugin.matcher("json-schema", s).expect("compile"));
        compiles.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let t = Instant::now();
    drop(
        plugin
            .matcher("regex", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}")
            .expect("regex"),
    );
    let regex_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    drop(
        plugin
            .matcher(
                "lark",
                "start: expr\nexpr: NUM ((\"+\"|\"*\") NUM)*\nNUM: /[0-9]+/\n",
            )
            .expect("lark"),
    );
    let lark_ms = t.elapsed().as_secs_f64() * 1e3;
    println!(
        "compile on the default vocab: json-schema {} ms; regex {regex_ms:.2} ms; lark {lark_ms:.2} ms",
        compiles.iter().map(|c| format!("{c:.2}")).collect::<Vec<_>>().join(" / ")
    );
}

/// Constrained vs free generation of the same prompts at batch `batch` (greedy, 48 tokens).
fn engine_runs(llm: &Llm, batch: usize) {
    let schema = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":40},"age":{"type":"integer","minimum":0,"maximum":150},"city":{"type":"string","maxLength":40}},"required":["name","age","city"],"additionalProperties":false}"#;
    let reqs = |constrained: bool, tag: &str| -> Vec<Request> {
        (0..batch)
            .map(|i| {
                let params = SamplingParams {
                    max_tokens: 48,
                    ignore_eos: !constrained,
                    ..Default::default()
                };
                let mut r = Request::text(
                    format!("{tag}{i}"),
                    format!("Person number {i} as JSON: "),
                    params,
                );
                if constrained {
                    r.constraint = Some(Constraint::json_schema(schema));
                }
                r
            })
            .collect()
    };
    // Warm the grammar cache and the threads.
    llm.generate(&reqs(true, "warm")[..1], &mut |_| {});
    for constrained in [false, true] {
        let outs = llm.generate(
            &reqs(constrained, if constrained { "c" } else { "f" }),
            &mut |_| {},
        );
        let s = llm.last_summary().expect("summary");
        let tokens: usize = outs.iter().map(|o| o.token_ids.len()).sum();
        println!(
            "engine batch {batch} {}: {tokens} tokens in {:.2} s = {:.1} tok/s; decode step {:.2} ms; \
             mask {:.3} ms/step computed, {:.3} ms/step exposed ({} constrained steps)",
            if constrained { "constrained" } else { "free       " },
            s.wall_s,
            s.generated_tok_per_s(),
            s.ms_per_decode_step,
            s.mask_compute_ms_per_step,
            s.mask_exposed_ms_per_step,
            s.constrained_steps
        );
    }
}

fn main() {
    run_synthetic(49_152);
    run_synthetic(131_072);
    let path = deepinfer::model::fetch::resolve_model(None, &mut |m| eprintln!("{m}"))
        .expect("the default model is available");
    let model = deepinfer::model::load(&path, Device::Cpu { threads: 2 }).expect("model loads");
    let llm = Llm::new(
        model,
        Arc::new(NativeSampler),
        EngineOptions {
            progress: false,
            ..EngineOptions::default()
        },
    )
    .expect("engine");
    run_real(&llm);
    if !std::env::args().any(|a| a == "--no-engine") {
        engine_runs(&llm, 1);
        engine_runs(&llm, 16);
    }
}
