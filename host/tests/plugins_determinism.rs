//! Seeded sampling through the `standard` plugin is reproducible: identical across runs (fresh
//! engines), identical whether a row runs alone or in a batch of 8 with other requests, the
//! same from several threads at once, and the same as the plugin's algorithm compiled natively.

#[path = "plugins/common.rs"]
mod common;

use common::*;
use deepinfer::config::Config;
use deepinfer::plugins::{top_k_into, WasmSampler, DEFAULT_TOP_K};
use deepinfer::sampling::{BatchSampler, SampleRow, SamplingParams};
use std::sync::Arc;

fn standard() -> (tempfile::TempDir, WasmSampler) {
    let (dir, host) = host();
    let s = load(&host, &Config::default());
    (dir, s)
}

/// Eight requests with different parameters and seeds; row 0 is the one we follow.
fn requests() -> Vec<(SamplingParams, u64)> {
    let p = |t: f32, k: u32, tp: f32, mp: f32, rp: f32, fp: f32| SamplingParams {
        temperature: t,
        top_k: k,
        top_p: tp,
        min_p: mp,
        repetition_penalty: rp,
        frequency_penalty: fp,
        ..Default::default()
    };
    vec![
        (p(0.9, 40, 0.95, 0.0, 1.1, 0.0), 11),
        (p(0.0, 0, 1.0, 0.0, 1.0, 0.0), 12),
        (p(1.3, 0, 1.0, 0.05, 1.0, 0.2), 13),
        (p(0.7, 5, 1.0, 0.0, 1.0, 0.0), 14),
        (p(1.0, 0, 0.5, 0.0, 1.3, 0.0), 15),
        (
            SamplingParams {
                temperature: 1.0,
                logit_bias: vec![(7, 30.0)],
                ..Default::default()
            },
            16,
        ),
        (p(2.0, 100, 0.9, 0.1, 1.0, 0.5), 17),
        (p(0.5, 0, 1.0, 0.0, 1.0, 0.0), 18),
    ]
}

/// Runs `steps` steps of the first `n` requests in one batch per step, feeding each row's
/// tokens back as history; returns every row's tokens.
fn generate(s: &dyn BatchSampler, n: usize, steps: u64) -> Vec<Vec<u32>> {
    let reqs = requests();
    let mut hist: Vec<Vec<u32>> = vec![vec![1, 2, 3]; n];
    for step in 0..steps {
        let logits: Vec<Vec<f32>> = (0..n)
            .map(|i| logits(100 + i as u64, step, VOCAB))
            .collect();
        let rows: Vec<SampleRow<'_>> = (0..n)
            .map(|i| SampleRow {
                logits: &logits[i],
                candidates: None,
                params: &reqs[i].0,
                seed: reqs[i].1,
                step,
                history: &hist[i],
            })
            .collect();
        let out = s.sample_batch(&rows);
        for (h, t) in hist.iter_mut().zip(out) {
            h.push(t.expect("standard samples"));
        }
    }
    hist
}

#[test]
fn seeded_outputs_are_identical_across_runs() {
    let (_a, first) = standard();
    let (_b, second) = standard();
    let one = generate(&first, 8, 12);
    assert_eq!(one, generate(&second, 8, 12));
    assert_eq!(
        one,
        generate(&first, 8, 12),
        "and on the same sampler again"
    );
}

#[test]
fn a_row_alone_equals_the_row_in_a_batch_of_eight() {
    let (_a, s) = standard();
    let alone = generate(&s, 1, 16);
    let batched = generate(&s, 8, 16);
    assert_eq!(alone[0], batched[0]);
    // The batch really mixes different outputs.
    assert!(batched.iter().any(|h| h != &batched[0]));
}

#[test]
fn concurrent_calls_from_several_threads_agree() {
    let (_a, s) = standard();
    let s = Arc::new(s);
    let expected = generate(&*s, 8, 6);
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let s = s.clone();
            std::thread::spawn(move || generate(&*s, 8, 6))
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), expected);
    }
}

#[test]
fn the_plugin_equals_its_algorithm_compiled_natively() {
    use deepinfer_plugin_sdk::sampler::{Row, Sampler};
    use deepinfer_plugin_sdk::{Candidate, SamplingParams as SdkParams};
    let (_a, wasm) = standard();
    let mut native = standard_sampler::Standard::default();
    let mut top = Vec::new();
    for (i, (p, seed)) in requests().into_iter().enumerate() {
        for step in 0..6u64 {
            let l = logits(7 + i as u64, step, VOCAB);
            let hist = [
                5u32,
                9,
                9,
                top.first()
                    .map_or(0, |c: &deepinfer::sampling::Candidate| c.id),
            ];
            top_k_into(&l, DEFAULT_TOP_K as usize, &mut top);
            let mut cands: Vec<Candidate> = top
                .iter()
                .map(|c| Candidate {
                    id: c.id,
                    logit: c.logit,
                })
                .collect();
            for &(t, _) in &p.logit_bias {
                if !cands.iter().any(|c| c.id == t) {
                    cands.push(Candidate {
                        id: t,
                        logit: l[t as usize],
                    });
                }
            }
            let sp = SdkParams {
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
                seed,
                step,
                history: &hist,
                logits: &[],
                vocab_size: VOCAB as u32,
            };
            let want = native.sample(&row).expect("native samples");
            assert_eq!(
                sample_one(&wasm, &l, &p, seed, step, &hist),
                Ok(want),
                "request {i} step {step}"
            );
        }
    }
}
