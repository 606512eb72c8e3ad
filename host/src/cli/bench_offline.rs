//! `deepinfer bench offline`: the engine core's benchmark. Three parts, each printing a table
//! line and writing one JSON record:
//! - `throughput`: prompts of mixed length with a fixed number of new tokens each, run as
//!   one batch through the engine, against a spread subset of the same prompts run one at a
//!   time (generated tokens per second, and the ratio);
//! - `ttft`: time to first token of a request whose long prefix is in the prefix cache,
//!   against the same request cold (a fresh prefix per repeat; medians);
//! - `exposed`: compute-idle CPU time per decode step at a full batch, async scheduling
//!   against sync (means and medians over the decode steps).

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;

use crate::backend::Device;
use crate::bench::runner::synthetic_prompt;
use crate::bench::Summary;
use crate::config::Config;
use crate::model::fetch::resolve_model;
use crate::runtime::{EngineOptions, Llm, PromptInput, Request, RunSummary};
use crate::sampling::{BatchSampler, NativeSampler, SamplingParams};

/// Flags of `bench offline`.
#[derive(Debug, Clone, clap::Args)]
pub struct OfflineArgs {
    /// Parts to run, comma-separated: throughput, ttft, exposed.
    #[arg(long, value_delimiter = ',', default_value = "throughput,ttft,exposed")]
    pub parts: Vec<String>,
    /// Prompts of the throughput run.
    #[arg(long, default_value_t = 256)]
    pub prompts: usize,
    /// Shortest and longest prompt (lengths spread evenly between them).
    #[arg(long, default_value_t = 16)]
    pub min_len: usize,
    #[arg(long, default_value_t = 256)]
    pub max_len: usize,
    /// New tokens per request (end-of-sequence ignored).
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    /// Prompts of the throughput set also run one at a time (an evenly spread subset).
    #[arg(long, default_value_t = 16)]
    pub sequential: usize,
    /// Shared prefix length of the TTFT part.
    #[arg(long, default_value_t = 1024)]
    pub prefix_len: usize,
    /// Sequences of the exposed-time part (all decoding together).
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Sample with the native sampler instead of the default config's Wasm plugin.
    #[arg(long)]
    pub native_sampler: bool,
}

/// The sampler the engines use: the default config's plugin, or the native one.
fn sampler(native: bool) -> anyhow::Result<Arc<dyn BatchSampler>> {
    if native {
        return Ok(Arc::new(NativeSampler));
    }
    crate::plugins::build_sampler(&Config::default()).context("loading the default sampler plugin")
}

fn engine(model: &Path, threads: usize, native: bool, opts: EngineOptions) -> anyhow::Result<Llm> {
    let loaded = crate::model::load(model, Device::Cpu { threads })
        .with_context(|| format!("loading {}", model.display()))?;
    Ok(Llm::new(loaded, sampler(native)?, opts)?)
}

fn token_request(id: String, ids: Vec<u32>, max_tokens: usize) -> Request {
    let params = SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    Request::new(id, PromptInput::Tokens(ids), params)
}

fn run_all(llm: &Llm, reqs: &[Request]) -> anyhow::Result<(f64, RunSummary)> {
    let t = Instant::now();
    let out = llm.generate(reqs, &mut |_| {});
    if let Some(e) = out.iter().find_map(|o| o.error.clone()) {
        anyhow::bail!("a benchmark request failed: {e}");
    }
    Ok((
        t.elapsed().as_secs_f64(),
        llm.last_summary().unwrap_or_default(),
    ))
}

/// Runs `bench offline`; `repeats` applies to the TTFT part. Records go to `sink`.
pub fn run(
    model: Option<&Path>,
    threads: usize,
    repeats: usize,
    args: &OfflineArgs,
    sink: &mut dyn Write,
) -> anyhow::Result<()> {
    let path = resolve_model(model, &mut |m| eprintln!("deepinfer: {m}"))?;
    let threads = threads.max(1);
    let mut table = Vec::new();
    let mut record = |v: serde_json::Value, line: String| -> anyhow::Result<()> {
        writeln!(sink, "{v}")?;
        eprintln!("{line}");
        table.push(line);
        Ok(())
    };
    let vocab = engine(
        &path,
        threads,
        args.native_sampler,
        EngineOptions::default(),
    )?
    .model()
    .model
    .config()
    .vocab;
    let want = |p: &str| args.parts.iter().any(|x| x == p);

    if want("throughput") {
        let n = args.prompts.max(1);
        let span = args.max_len.saturating_sub(args.min_len);
        // Lengths spread evenly, in a scrambled order so any stride sees the whole mix.
        let reqs: Vec<Request> = (0..n)
            .map(|i| {
                let len = args.min_len + (i * 37 % n) * span / n.max(2).saturating_sub(1).max(1);
                token_request(
                    format!("t{i}"),
                    synthetic_prompt(len.max(1), vocab, i as u64 + 1),
                    args.new_tokens,
                )
            })
            .collect();
        eprintln!("deepinfer: throughput: {n} prompts batched ...");
        let batched = engine(
            &path,
            threads,
            args.native_sampler,
            EngineOptions::default(),
        )?;
        let (b_s, b_sum) = run_all(&batched, &reqs)?;
        drop(batched);
        let stride = (n / args.sequential.max(1)).max(1);
        let subset: Vec<Request> = reqs
            .iter()
            .step_by(stride)
            .take(args.sequential.max(1))
            .cloned()
            .collect();
        eprintln!(
            "deepinfer: throughput: {} of them one at a time ...",
            subset.len()
        );
        let solo = engine(
            &path,
            threads,
            args.native_sampler,
            EngineOptions {
                enable_prefix_caching: false,
                ..Default::default()
            },
        )?;
        let (mut s_s, mut s_tokens) = (0.0, 0u64);
        for r in &subset {
            let (t, s) = run_all(&solo, std::slice::from_ref(r))?;
            s_s += t;
            s_tokens += s.generated_tokens;
        }
        let (b_rate, s_rate) = (b_sum.generated_tokens as f64 / b_s, s_tokens as f64 / s_s);
        record(
            serde_json::json!({"mode": "offline", "part": "throughput", "prompts": n, "min_len": args.min_len,
                "max_len": args.max_len, "new_tokens": args.new_tokens, "threads": threads,
                "batched_s": b_s, "batched_tok_s": b_rate, "sequential_requests": subset.len(),
                "sequential_s": s_s, "sequential_tok_s": s_rate, "speedup": b_rate / s_rate, "summary": b_sum}),
            format!(
                "throughput: batched {b_rate:.1} tok/s ({} tokens in {b_s:.1} s), one at a time {s_rate:.1} tok/s \
                 ({} requests) -> {:.2}x",
                b_sum.generated_tokens,
                subset.len(),
                b_rate / s_rate
            ),
        )?;
    }

    if want("ttft") {
        let llm = engine(
            &path,
            threads,
            args.native_sampler,
            EngineOptions::default(),
        )?;
        let (mut cold, mut hit) = (Vec::new(), Vec::new());
        for r in 0..repeats.max(1) {
            let prefix = synthetic_prompt(args.prefix_len, vocab, 10_000 + r as u64);
            let with = |suffix_seed: u64| {
                let mut ids = prefix.clone();
                ids.extend(synthetic_prompt(16, vocab, suffix_seed));
                token_request(format!("p{r}-{suffix_seed}"), ids, 1)
            };
            let c = llm.generate(&[with(1)], &mut |_| {});
            let h = llm.generate(&[with(2)], &mut |_| {});
            anyhow::ensure!(
                h[0].cached_prompt_tokens > 0,
                "the second request found no prefix in the cache"
            );
            cold.push(c[0].timings.time_to_first_token_s);
            hit.push(h[0].timings.time_to_first_token_s);
            eprintln!(
                "deepinfer: ttft repeat {}: cold {:.3} s, hit {:.3} s",
                r + 1,
                cold[r],
                hit[r]
            );
        }
        let (c, h) = (
            Summary::of(&cold).map_or(0.0, |s| s.median),
            Summary::of(&hit).map_or(0.0, |s| s.median),
        );
        record(
            serde_json::json!({"mode": "offline", "part": "ttft", "prefix_len": args.prefix_len, "suffix_len": 16,
                "threads": threads, "cold_s": cold, "hit_s": hit, "cold_median_s": c, "hit_median_s": h,
                "ratio": c / h.max(1e-12)}),
            format!(
                "ttft: {}-token prefix: cold {:.1} ms, cached {:.1} ms (medians of {}) -> {:.1}x lower",
                args.prefix_len,
                c * 1e3,
                h * 1e3,
                cold.len(),
                c / h.max(1e-12)
            ),
        )?;
    }

    if want("exposed") {
        let reqs: Vec<Request> = (0..args.batch.max(1))
            .map(|i| {
                token_request(
                    format!("e{i}"),
                    synthetic_prompt(32, vocab, 500 + i as u64),
                    args.new_tokens,
                )
            })
            .collect();
        for async_scheduling in [true, false] {
            let opts = EngineOptions {
                async_scheduling,
                max_num_seqs: args.batch.max(1),
                ..Default::default()
            };
            let (_, s) = run_all(&engine(&path, threads, args.native_sampler, opts)?, &reqs)?;
            let mode = if async_scheduling { "async" } else { "sync" };
            record(
                serde_json::json!({"mode": "offline", "part": "exposed", "scheduling": mode, "batch": args.batch,
                    "threads": threads, "new_tokens": args.new_tokens, "summary": s}),
                format!(
                    "exposed ({mode}): {:.2} ms mean / {:.2} ms median per decode step of {:.1} ms ({:.2}%), \
                     of which waiting for samples {:.2} ms; {} decode steps at mean batch {:.1}",
                    s.exposed_ms_per_decode_step,
                    s.median_exposed_ms_per_decode_step,
                    s.ms_per_decode_step,
                    s.exposed_fraction * 100.0,
                    s.exposed_sample_wait_ms_per_decode_step,
                    s.decode_steps,
                    s.mean_decode_batch
                ),
            )?;
        }
    }
    sink.flush()?;
    eprintln!("--- bench offline ({}, {threads} threads)", path.display());
    for l in table {
        eprintln!("{l}");
    }
    Ok(())
}
