//! `deepinfer bench prefill|decode`: sweeps over prompt lengths or batch sizes, warm-up kept
//! apart, JSONL records, and an optional peer command run alternately for a same-run ratio.

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};

use crate::backend::Device;
use crate::bench::{decode_steps, BenchRecord, PrefillBench, PrefillSpec, Summary};

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub mode: BenchMode,
    /// A `.gguf` file or HF folder (default: the default model).
    #[arg(long, global = true, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Compute threads.
    #[arg(long, global = true, default_value_t = 2, value_parser = super::at_least::<1>)]
    pub threads: usize,
    /// Where to run: cpu, cuda or cuda:N (cuda needs a build with `--features cuda`).
    #[arg(long, global = true, default_value = "cpu")]
    pub device: Device,
    /// Run a random-weight model of this shape (llama3-8b, llama3-1b, smollm2-135m, tiny)
    /// instead of a checkpoint.
    #[arg(long, global = true, value_name = "SHAPE")]
    pub random_weights: Option<String>,
    /// Measured repeats per point.
    #[arg(long, global = true, default_value_t = 5, value_parser = super::at_least::<1>)]
    pub repeats: usize,
    /// Unmeasured warm-up repeats per point.
    #[arg(long, global = true, default_value_t = 1)]
    pub warmup: usize,
    /// Append JSONL records to this file (default: print them to stdout).
    #[arg(long, global = true, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// A peer command run alternately with each repeat. It gets DEEPINFER_BENCH_MODE,
    /// _MODEL, _PROMPT_LEN, _NEW_TOKENS, _BATCH and _THREADS in its environment and must
    /// print one JSON line `{"raw_s": [seconds, ...]}` (prefill: one value; decode: one per step).
    #[arg(long, global = true, value_name = "COMMAND")]
    pub peer: Option<String>,
}

#[derive(Debug, clap::Subcommand)]
pub enum BenchMode {
    /// Time the prefill of one prompt per length (and per chunk size).
    Prefill {
        /// Prompt lengths, comma-separated (a cached prefix counts in the length).
        #[arg(long, value_delimiter = ',', default_value = "128,512", value_parser = super::at_least::<1>)]
        lengths: Vec<usize>,
        /// Chunked prefill: forward passes of at most this many tokens; comma-separated to
        /// sweep (default: the whole prompt in one pass).
        #[arg(long, value_delimiter = ',', value_name = "TOKENS", value_parser = super::at_least::<1>)]
        chunk_sizes: Vec<usize>,
        /// Compute a shared prefix of this many tokens once (rounded down to whole KV
        /// blocks), then time only each request's uncached suffix, as after a prefix-cache hit.
        #[arg(long, default_value_t = 0, value_name = "TOKENS")]
        cached_prefix: usize,
    },
    /// Time decode steps after a prefill.
    Decode {
        /// Batch sizes, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1", value_parser = super::at_least::<1>)]
        batch: Vec<usize>,
        #[arg(long, default_value_t = 128, value_parser = super::at_least::<1>)]
        prompt_len: usize,
        #[arg(long, default_value_t = 128, value_parser = super::at_least::<1>)]
        new_tokens: usize,
    },
    /// The engine offline: batched vs one-at-a-time throughput, prefix-hit time to first
    /// token, exposed CPU time per decode step (CPU; records as JSON lines).
    Offline(super::bench_offline::OfflineArgs),
    /// The device's read rate by each path the CUDA kernels stream weights with: 16-byte
    /// loads into registers, and rings of shared-memory pages of each size, 1 to 8 a warp,
    /// filled by bulk copies (whole, by halves, or by halves from two places), the lanes'
    /// `cp.async` copies or both; then an L2 round trip's time with nothing streaming and
    /// behind 8 KiB rings 1 to 3 pages deep; then a Moonlight step's weight rows as one
    /// resident launch of dependent GEMVs, what a persistent step could stream (CUDA; one
    /// line a path, JSON records with --output).
    Stream {
        /// Bytes read a launch, MiB (several times the L2's size).
        #[arg(long, default_value_t = 1024, value_parser = super::at_least::<1>)]
        mib: usize,
        /// Ring page sizes, KiB, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "4,8,16", value_parser = super::at_least::<1>)]
        pages_kib: Vec<usize>,
    },
}

struct Point {
    mode: &'static str,
    batch: usize,
    prompt_len: usize,
    new_tokens: usize,
    /// Prefill only: chunk size (`None`: one pass) and requested cached prefix.
    chunk: Option<usize>,
    cached_prefix: usize,
}

/// The commit the binary was built from; outside a checkout at build time, the current
/// directory's HEAD if it is one.
fn commit() -> String {
    match option_env!("DEEPINFER_GIT_COMMIT").unwrap_or_default() {
        "" => Command::new("git")
            .args(["rev-parse", "--short=12", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default(),
        c => c.to_string(),
    }
}

fn run_peer(cmd: &str, p: &Point, model: &str, threads: usize) -> anyhow::Result<Vec<f64>> {
    let out = Command::new("sh")
        .args(["-c", cmd])
        .env("DEEPINFER_BENCH_MODE", p.mode)
        .env("DEEPINFER_BENCH_MODEL", model)
        .env("DEEPINFER_BENCH_PROMPT_LEN", p.prompt_len.to_string())
        .env("DEEPINFER_BENCH_CACHED_PREFIX", p.cached_prefix.to_string())
        .env(
            "DEEPINFER_BENCH_CHUNK",
            p.chunk.map_or(String::new(), |c| c.to_string()),
        )
        .env("DEEPINFER_BENCH_NEW_TOKENS", p.new_tokens.to_string())
        .env("DEEPINFER_BENCH_BATCH", p.batch.to_string())
        .env("DEEPINFER_BENCH_THREADS", threads.to_string())
        .output()
        .with_context(|| format!("running peer `{cmd}`"))?;
    if !out.status.success() {
        bail!(
            "peer `{cmd}` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .with_context(|| format!("peer `{cmd}` printed no JSON line"))?;
    let v: serde_json::Value = serde_json::from_str(line).context("peer output is not JSON")?;
    let raw = v["raw_s"]
        .as_array()
        .context("peer output has no `raw_s` list")?;
    raw.iter()
        .map(|x| x.as_f64().context("`raw_s` holds a non-number"))
        .collect()
}

/// Where records go: appended to `--output`, or printed.
fn open_sink(output: &Option<PathBuf>) -> anyhow::Result<Box<dyn Write>> {
    Ok(match output {
        Some(p) => Box::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("opening {}", p.display()))?,
        ),
        None => Box::new(std::io::stdout()),
    })
}

/// Runs `deepinfer bench`.
pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    if let BenchMode::Offline(o) = &a.mode {
        let mut sink = open_sink(&a.output)?;
        return super::bench_offline::run(a.model.as_deref(), a.threads, a.repeats, o, &mut sink);
    }
    if let BenchMode::Stream { mib, pages_kib } = &a.mode {
        return stream(&a, *mib, pages_kib);
    }
    let device = match a.device {
        Device::Cpu { .. } => Device::Cpu {
            threads: a.threads.max(1),
        },
        d => d,
    };
    let loaded = crate::model::random::load_cli_model(
        a.model.as_deref(),
        a.random_weights.as_deref(),
        device,
        &mut |m| eprintln!("deepinfer: {m}"),
    )
    .context("loading the model")?;
    let path = loaded.path.clone();
    let model = loaded.model.as_ref();
    let points: Vec<Point> = match &a.mode {
        BenchMode::Prefill {
            lengths,
            chunk_sizes,
            cached_prefix,
        } => {
            if chunk_sizes.contains(&0) {
                bail!("--chunk-sizes: a chunk must hold at least one token");
            }
            let chunks: Vec<Option<usize>> = if chunk_sizes.is_empty() {
                vec![None]
            } else {
                chunk_sizes.iter().map(|&c| Some(c)).collect()
            };
            let mut v = Vec::new();
            for &l in lengths {
                if *cached_prefix >= l {
                    bail!("--cached-prefix {cached_prefix} must be shorter than prompt length {l}");
                }
                for &chunk in &chunks {
                    v.push(Point {
                        mode: "prefill",
                        batch: 1,
                        prompt_len: l,
                        new_tokens: 0,
                        chunk,
                        cached_prefix: *cached_prefix,
                    });
                }
            }
            v
        }
        BenchMode::Decode {
            batch,
            prompt_len,
            new_tokens,
        } => batch
            .iter()
            .map(|&b| Point {
                mode: "decode",
                batch: b,
                prompt_len: *prompt_len,
                new_tokens: *new_tokens,
                chunk: None,
                cached_prefix: 0,
            })
            .collect(),
        BenchMode::Offline(_) | BenchMode::Stream { .. } => Vec::new(),
    };
    let model_name = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let commit = commit();
    let mut sink = open_sink(&a.output)?;
    let mut table = Vec::new();
    for p in &points {
        let ctx = p.prompt_len + p.new_tokens + 1;
        if ctx > model.config().context_len {
            bail!(
                "prompt {} + {} new tokens exceeds the model's context {}",
                p.prompt_len,
                p.new_tokens,
                model.config().context_len
            );
        }
        // Prefill points compute their cached prefix (if any) once, here, untimed.
        let mut prefill = match p.mode {
            "prefill" => Some(PrefillBench::new(
                model,
                PrefillSpec {
                    len: p.prompt_len,
                    cached_prefix: p.cached_prefix,
                    chunk: p.chunk,
                },
            )?),
            _ => None,
        };
        let cached_prefix_len = prefill.as_ref().map_or(0, |b| b.cached_prefix());
        if cached_prefix_len != p.cached_prefix {
            eprintln!(
                "deepinfer: cached prefix {} rounded down to {cached_prefix_len} (whole KV blocks)",
                p.cached_prefix
            );
        }
        let mut ours_once = |seed: u64| -> anyhow::Result<Vec<f64>> {
            Ok(match prefill.as_mut() {
                Some(b) => vec![b.run(seed)?],
                None => decode_steps(model, p.batch, p.prompt_len, p.new_tokens)?,
            })
        };
        for w in 0..a.warmup {
            ours_once(1000 + w as u64)?;
            if let Some(cmd) = &a.peer {
                run_peer(cmd, p, &path.to_string_lossy(), a.threads)?;
            }
        }
        let (mut ours, mut peer) = (Vec::new(), Vec::new());
        for r in 0..a.repeats {
            eprintln!(
                "deepinfer: {} batch {} len {}{}: repeat {}/{}",
                p.mode,
                p.batch,
                p.prompt_len,
                p.chunk.map_or(String::new(), |c| format!(" chunk {c}")),
                r + 1,
                a.repeats
            );
            ours.extend(ours_once(r as u64)?);
            if let Some(cmd) = &a.peer {
                peer.extend(run_peer(cmd, p, &path.to_string_lossy(), a.threads)?);
            }
        }
        let mut records = vec![("deepinfer", ours)];
        if a.peer.is_some() {
            records.push(("peer", peer));
        }
        let mut medians = Vec::new();
        for (engine, raw) in records {
            let mut rec = BenchRecord {
                mode: p.mode.into(),
                engine: engine.into(),
                model: model_name.clone(),
                device: model.device_name(),
                threads: a.threads,
                batch: p.batch,
                prompt_len: p.prompt_len,
                new_tokens: p.new_tokens,
                warmup: a.warmup,
                cached_prefix_len,
                chunk_size: p.chunk,
                drafts: Default::default(),
                commit: commit.clone(),
                timestamp: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
                raw_s: raw,
                median_s: 0.0,
                prefill_tok_s: None,
                decode_steps_s: None,
                tok_s_per_user: None,
                tok_s_per_user_full_acceptance: None,
                tok_s_per_device: None,
            };
            rec.derive();
            writeln!(sink, "{}", serde_json::to_string(&rec)?)?;
            let rate = rec.prefill_tok_s.or(rec.tok_s_per_device).unwrap_or(0.0);
            let spread = Summary::of(&rec.raw_s)
                .map(|s| (s.min, s.max))
                .unwrap_or_default();
            medians.push(rec.median_s);
            table.push(format!(
                "{:<8} {:<10} {:>5} {:>6} {:>6} {:>6} {:>12.3} {:>10.1}  [{:.3}..{:.3}] ms",
                p.mode,
                engine,
                p.batch,
                p.prompt_len,
                cached_prefix_len,
                p.chunk.map_or("-".to_string(), |c| c.to_string()),
                rec.median_s * 1e3,
                rate,
                spread.0 * 1e3,
                spread.1 * 1e3
            ));
        }
        if medians.len() == 2 && medians[0] > 0.0 {
            table.push(format!(
                "{:<8} ratio deepinfer/peer speed = {:.2}x",
                p.mode,
                medians[1] / medians[0]
            ));
        }
    }
    sink.flush()?;
    eprintln!(
        "{:<8} {:<10} {:>5} {:>6} {:>6} {:>6} {:>12} {:>10}",
        "mode", "engine", "batch", "len", "cached", "chunk", "median ms", "tok/s"
    );
    for l in table {
        eprintln!("{l}");
    }
    Ok(())
}

/// `deepinfer bench stream`: each read path's median rate over `--repeats` launches (after
/// one unmeasured launch), a line each in the probe's order.
#[cfg(feature = "cuda")]
fn stream(a: &BenchArgs, mib: usize, pages_kib: &[usize]) -> anyhow::Result<()> {
    use crate::backend::cuda::{CudaBackend, CudaOptions};
    let Device::Cuda { ordinal } = a.device else {
        bail!("bench stream measures a CUDA device: pass --device cuda");
    };
    if a.repeats == 0 {
        bail!("--repeats: at least one measured launch");
    }
    let be = CudaBackend::new(ordinal, CudaOptions::from_env()?)?;
    let bytes = mib.checked_mul(1 << 20).context("--mib: too large")?;
    let units: Vec<usize> = pages_kib.iter().map(|k| k.saturating_mul(1024)).collect();
    let points = be.stream_probe(bytes, &units, a.repeats)?;
    let device = crate::backend::Backend::device_name(&be);
    let commit = commit();
    let mut sink = a
        .output
        .as_ref()
        .map(|_| open_sink(&a.output))
        .transpose()?;
    println!(
        "{device}: {mib} MiB a launch, median of {} launches",
        a.repeats
    );
    println!("path  page_kib  pages/warp  fill  in_flight_kib/SM   TB/s  L2 round trip ns");
    // (chain rows: pages a block, the shape in place of the fill, µs a layer last)
    for p in &points {
        // TB/s of the median launch (the latency probe's: of its streaming warps)
        let launch = Summary::of(&p.seconds);
        let rate = launch
            .as_ref()
            .map_or(0.0, |t| p.bytes as f64 / t.median / 1e12);
        let trip = Summary::of(&p.round_trip_ns).map(|t| t.median);
        // (register loads fill no pages; a chain row names its shape)
        let fill = match p.path {
            "ring" | "lat" => crate::backend::cuda::STREAM_FILLS
                .get(p.mode)
                .copied()
                .unwrap_or("?"),
            "chain" => p.variant.as_str(),
            _ => "-",
        };
        let layer_us = launch
            .filter(|_| p.layers > 0)
            .map(|t| t.median * 1e6 / p.layers as f64);
        println!(
            "{:<5} {:>8} {:>11} {:>5} {:>17} {:>7.3} {:>17}",
            p.path,
            p.unit / 1024,
            p.pages,
            fill,
            p.in_flight / 1024,
            rate,
            match (trip, layer_us) {
                (Some(t), _) => format!("{t:.0}"),
                (None, Some(us)) => {
                    // shares of the launch spent waiting: inputs, pages, a free page
                    let w = |k: usize| {
                        let v: Vec<f64> = p.waits.iter().map(|w| w[k]).collect();
                        Summary::of(&v).map_or(f64::NAN, |s| s.median * 100.0)
                    };
                    format!(
                        "{us:.1} us/layer  wait in/page/free {:.0}/{:.0}/{:.0}%",
                        w(0),
                        w(1),
                        w(2)
                    )
                }
                _ => "-".to_string(),
            }
        );
        if let Some(s) = sink.as_mut() {
            let rec = serde_json::json!({
                "mode": "stream",
                "device": device,
                "commit": commit,
                "path": p.path,
                "page_bytes": p.unit,
                "pages_per_warp": p.pages,
                "fill": fill,
                "in_flight_bytes": p.in_flight,
                "bytes": p.bytes,
                "raw_s": p.seconds,
                "median_tb_s": rate,
                "round_trip_ns": p.round_trip_ns,
                "median_round_trip_ns": trip,
                "variant": p.variant,
                "layers": p.layers,
                "median_layer_us": layer_us,
                "wait_shares": p.waits,
            });
            writeln!(s, "{rec}")?;
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn stream(_: &BenchArgs, _: usize, _: &[usize]) -> anyhow::Result<()> {
    bail!("bench stream measures a CUDA device: this build has none (build with `--features cuda`)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    #[test]
    fn bench_stream_parses_its_options_and_asks_for_a_cuda_device() {
        let cli = Cli::try_parse_from(["bench", "stream", "--mib", "256", "--pages-kib", "4,16"])
            .expect("parses");
        match &cli.bench.mode {
            BenchMode::Stream { mib, pages_kib } => {
                assert_eq!(*mib, 256);
                assert_eq!(pages_kib, &[4, 16]);
            }
            other => panic!("parsed as {other:?}"),
        }
        // the CPU is not a device the probe measures, with or without the CUDA backend built
        let err = run(cli.bench).expect_err("the CPU has no stream probe");
        assert!(
            err.to_string()
                .contains("bench stream measures a CUDA device"),
            "{err}"
        );
    }
}
