//! `deepinfer bench offline`: the engine core's benchmark. Three parts, each printing a table
//! line and writing one JSON record:
//! - `throughput`: prompts of mixed length with a fixed number of new tokens each, run
//!   batched through the engine, against a spread subset of the same prompts run one at a
//!   time (generated tokens per second, and the ratio); the set runs in a few groups, each
//!   batched run followed by its one-at-a-time share, so both see the same machine load;
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
    /// The throughput set runs as this many batched runs, each followed by its share of the
    /// one-at-a-time requests, so both modes are measured under the same machine load.
    #[arg(long, default_value_t = 4)]
    pub groups: usize,
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
        let (v, line) = throughput(&path, threads, vocab, args)?;
        record(v, line)?;
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

/// Seconds of CPU this process has used (user + system; `/proc/self/stat`, in USER_HZ =
/// 100 ticks per second). Tokens per CPU second are less sensitive than wall time to other
/// processes on a shared machine.
fn process_cpu_s() -> f64 {
    let read = || -> Option<f64> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let fields: Vec<&str> = stat
            .get(stat.rfind(')')? + 2..)?
            .split_whitespace()
            .collect();
        // Fields 14 and 15 (utime, stime); `fields` starts at field 3.
        let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        Some(ticks as f64 / 100.0)
    };
    read().unwrap_or(0.0)
}

/// Tokens, wall seconds and CPU seconds of one measured window.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
struct Window {
    tokens: u64,
    wall_s: f64,
    cpu_s: f64,
}

impl Window {
    fn measure(f: impl FnOnce() -> anyhow::Result<u64>) -> anyhow::Result<Window> {
        let (t, c) = (Instant::now(), process_cpu_s());
        let tokens = f()?;
        Ok(Window {
            tokens,
            wall_s: t.elapsed().as_secs_f64(),
            cpu_s: process_cpu_s() - c,
        })
    }

    fn rate(&self) -> f64 {
        self.tokens as f64 / self.wall_s.max(1e-12)
    }

    fn cpu_rate(&self) -> f64 {
        self.tokens as f64 / self.cpu_s.max(1e-12)
    }

    fn add(&mut self, o: &Window) {
        self.tokens += o.tokens;
        self.wall_s += o.wall_s;
        self.cpu_s += o.cpu_s;
    }
}

/// The throughput part: the prompt set in `groups` batched runs, each followed by its share
/// of one-at-a-time requests (alternating, so both see the same machine load).
fn throughput(
    path: &Path,
    threads: usize,
    vocab: usize,
    args: &OfflineArgs,
) -> anyhow::Result<(serde_json::Value, String)> {
    let n = args.prompts.max(1);
    let span = args.max_len.saturating_sub(args.min_len);
    // Lengths spread evenly, in a scrambled order so any stride sees the whole mix.
    let reqs: Vec<Request> = (0..n)
        .map(|i| {
            let len = args.min_len + (i * 37 % n) * span / n.saturating_sub(1).max(1);
            token_request(
                format!("t{i}"),
                synthetic_prompt(len.max(1), vocab, i as u64 + 1),
                args.new_tokens,
            )
        })
        .collect();
    let groups = args.groups.clamp(1, n);
    let per_group = n.div_ceil(groups);
    let solo_per_group = args.sequential.div_ceil(groups).max(1);
    let batched = engine(path, threads, args.native_sampler, EngineOptions::default())?;
    let solo_opts = EngineOptions {
        enable_prefix_caching: false,
        ..Default::default()
    };
    let solo = engine(path, threads, args.native_sampler, solo_opts)?;
    let (mut b_total, mut s_total) = (Window::default(), Window::default());
    let (mut ratios, mut cpu_ratios, mut windows) = (Vec::new(), Vec::new(), Vec::new());
    let (mut preemptions, mut exposed) = (0u64, Vec::new());
    for (g, group) in reqs.chunks(per_group).enumerate() {
        eprintln!(
            "deepinfer: throughput group {}/{groups}: {} prompts batched ...",
            g + 1,
            group.len()
        );
        let b = Window::measure(|| {
            let (_, s) = run_all(&batched, group)?;
            preemptions += s.preemptions;
            exposed.push(s.exposed_fraction);
            Ok(s.generated_tokens)
        })?;
        let stride = (group.len() / solo_per_group).max(1);
        let subset: Vec<&Request> = group.iter().step_by(stride).take(solo_per_group).collect();
        eprintln!(
            "deepinfer: throughput group {}/{groups}: {} of them one at a time ...",
            g + 1,
            subset.len()
        );
        let s = Window::measure(|| {
            let mut tokens = 0;
            for r in &subset {
                tokens += run_all(&solo, std::slice::from_ref(*r))?.1.generated_tokens;
            }
            Ok(tokens)
        })?;
        eprintln!(
            "deepinfer: group {}: batched {:.1} tok/s, one at a time {:.1} tok/s -> {:.2}x ({:.2}x per CPU second)",
            g + 1,
            b.rate(),
            s.rate(),
            b.rate() / s.rate(),
            b.cpu_rate() / s.cpu_rate()
        );
        ratios.push(b.rate() / s.rate());
        cpu_ratios.push(b.cpu_rate() / s.cpu_rate());
        windows.push(serde_json::json!({"batched": b, "sequential": s}));
        b_total.add(&b);
        s_total.add(&s);
    }
    let median = |v: &[f64]| Summary::of(v).map_or(0.0, |s| s.median);
    let v = serde_json::json!({"mode": "offline", "part": "throughput", "prompts": n, "min_len": args.min_len,
        "max_len": args.max_len, "new_tokens": args.new_tokens, "threads": threads, "groups": groups,
        "sequential_requests": s_total.tokens / args.new_tokens.max(1) as u64,
        "batched": b_total, "sequential": s_total, "batched_tok_s": b_total.rate(), "sequential_tok_s": s_total.rate(),
        "speedup": b_total.rate() / s_total.rate(), "speedup_per_cpu_s": b_total.cpu_rate() / s_total.cpu_rate(),
        "median_group_speedup": median(&ratios), "median_group_speedup_per_cpu_s": median(&cpu_ratios),
        "preemptions": preemptions, "exposed_fraction": exposed, "windows": windows});
    let line = format!(
        "throughput: batched {:.1} tok/s, one at a time {:.1} tok/s -> {:.2}x (median over {groups} alternating groups \
         {:.2}x; per CPU second {:.2}x)",
        b_total.rate(),
        s_total.rate(),
        b_total.rate() / s_total.rate(),
        median(&ratios),
        b_total.cpu_rate() / s_total.cpu_rate()
    );
    Ok((v, line))
}
