//! Sampling cost per decode step over the default model's 49,152-token vocabulary, at batch 1,
//! 32 and 256: the `standard` Wasm plugin against the same algorithm compiled natively (the
//! plugin crate as a library, fed the same host-chosen candidates), the host's own native
//! sampler for reference, and the candidate selection alone. Also the cold start of a plugin
//! whose compiled form is cached, and of one that must be compiled.
//!
//! Run: `cargo bench -p deepinfer --bench sampler` (add `-- --quick` for a short run).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use deepinfer::config::Config;
use deepinfer::plugins::{top_k_into, CacheDir, PluginHost, DEFAULT_TOP_K};
use deepinfer::sampling::{BatchSampler, Candidate, NativeSampler, SampleRow, SamplingParams};
use deepinfer_plugin_sdk::sampler::{Row, Sampler};

const VOCAB: usize = 49_152;
const BATCHES: [usize; 3] = [1, 32, 256];

fn logits(seed: u64) -> Vec<f32> {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..VOCAB)
        .map(|_| {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0
        })
        .collect()
}

/// Typical chat sampling: temperature, nucleus, a light repetition penalty.
fn params() -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        repetition_penalty: 1.1,
        ..Default::default()
    }
}

/// The same algorithm natively: host candidate selection, then the plugin crate's code.
struct NativeStandard;

impl BatchSampler for NativeStandard {
    fn sample_batch(&self, rows: &[SampleRow<'_>]) -> Vec<Result<u32, String>> {
        let mut sampler = standard_sampler::Standard::default();
        let mut top: Vec<Candidate> = Vec::new();
        rows.iter()
            .map(|r| {
                top_k_into(r.logits, DEFAULT_TOP_K as usize, &mut top);
                let cands: Vec<deepinfer_plugin_sdk::Candidate> = top
                    .iter()
                    .map(|c| deepinfer_plugin_sdk::Candidate {
                        id: c.id,
                        logit: c.logit,
                    })
                    .collect();
                let p = r.params;
                let sp = deepinfer_plugin_sdk::SamplingParams {
                    temperature: p.temperature,
                    top_k: p.top_k,
                    top_p: p.top_p,
                    min_p: p.min_p,
                    repetition_penalty: p.repetition_penalty,
                    presence_penalty: p.presence_penalty,
                    frequency_penalty: p.frequency_penalty,
                    logit_bias: p.logit_bias.clone(),
                };
                let row = Row {
                    candidates: &cands,
                    params: &sp,
                    seed: r.seed,
                    step: r.step,
                    history: r.history,
                    logits: &[],
                    vocab_size: VOCAB as u32,
                };
                sampler.sample(&row)
            })
            .collect()
    }
}

fn per_step(c: &mut Criterion) {
    let cache = tempfile::tempdir().expect("tempdir");
    let host = PluginHost::new(&CacheDir::At(cache.path().to_path_buf())).expect("host");
    let wasm = host
        .load_sampler(&Config::default(), "standard")
        .expect("standard plugin");
    let all_logits: Vec<Vec<f32>> = (0..*BATCHES.iter().max().unwrap_or(&1))
        .map(|i| logits(i as u64))
        .collect();
    let history: Vec<u32> = (0..200).map(|i| (i * 97) % VOCAB as u32).collect();
    let p = params();
    let mut group = c.benchmark_group("sample_step");
    group
        .sample_size(10)
        .measurement_time(std::time::Duration::from_secs(3));
    for &n in &BATCHES {
        let rows: Vec<SampleRow<'_>> = (0..n)
            .map(|i| SampleRow {
                logits: &all_logits[i],
                candidates: None,
                params: &p,
                seed: i as u64,
                step: 3,
                history: &history,
            })
            .collect();
        let samplers: [(&str, &dyn BatchSampler); 3] = [
            ("wasm_standard", &wasm),
            ("native_standard", &NativeStandard),
            ("native_reference", &NativeSampler),
        ];
        for (name, s) in samplers {
            if name == "native_reference" && n > 32 {
                continue; // sorts the whole vocabulary per row: seconds per step at 256
            }
            group.bench_with_input(BenchmarkId::new(name, n), &rows, |b, rows| {
                b.iter(|| black_box(s.sample_batch(black_box(rows))))
            });
        }
        group.bench_with_input(BenchmarkId::new("candidates_only", n), &rows, |b, rows| {
            let mut top = Vec::new();
            b.iter(|| {
                for r in rows {
                    top_k_into(black_box(r.logits), DEFAULT_TOP_K as usize, &mut top);
                }
                black_box(&top);
            })
        });
    }
    group.finish();
}

fn cold_start(c: &mut Criterion) {
    let cache = tempfile::tempdir().expect("tempdir");
    let dir = CacheDir::At(cache.path().to_path_buf());
    let config = Config::default();
    // Fill the cache once.
    PluginHost::new(&dir)
        .and_then(|h| h.load_sampler(&config, "standard"))
        .expect("warm the cache");
    let mut group = c.benchmark_group("cold_start");
    group.sample_size(20);
    group.bench_function("cached_engine_and_load", |b| {
        b.iter(|| {
            let host = PluginHost::new(&dir).expect("host");
            black_box(host.load_sampler(&config, "standard").expect("load"))
        })
    });
    group.sample_size(10);
    group.bench_function("uncached_compile_and_load", |b| {
        b.iter(|| {
            let host = PluginHost::new(&CacheDir::Disabled).expect("host");
            black_box(host.load_sampler(&config, "standard").expect("load"))
        })
    });
    group.finish();
}

criterion_group!(benches, per_step, cold_start);
criterion_main!(benches);
