//! Command-line interface: flag parsing and the subcommands.

mod bench;
mod bench_offline;
mod dev;
mod eval;
mod generate;
mod jsonl_out;
mod plot;
mod plugins;
mod prompts_file;

use clap::{Parser, Subcommand};

/// DeepInfer: offline LLM inference with sandboxed WebAssembly policy plugins.
#[derive(Debug, Parser)]
#[command(name = "deepinfer", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per run: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate text from prompts (the default model is fetched on first use).
    Generate(generate::GenerateArgs),
    /// Measure prefill and decode speed, optionally against a peer command.
    Bench(bench::BenchArgs),
    /// Draw SVG plots of bench records.
    Plot(plot::PlotArgs),
    /// Evaluate: generate samples, score them, or compute perplexity.
    Eval(eval::EvalArgs),
    /// List, inspect and check the configured plugins.
    Plugins(plugins::PluginsArgs),
    /// Developer tools (tiny checkpoints).
    Dev(dev::DevArgs),
}

/// A count flag that must be at least `N` (`--threads`, bench sizes and repeats, `eval ppl
/// --window`): a smaller value is refused by name instead of being raised, read as "all" or
/// run as an empty measurement.
pub fn at_least<const N: usize>(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n < N => Err(format!("must be at least {N}")),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// An error and its causes on one line, `a: b: c`, leaving out a cause whose text the
/// message before it already ends with (errors that print their source themselves).
pub fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.is_empty() {
            out = text;
        } else if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

/// Parses the command line and runs the subcommand.
pub fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DEEPINFER_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Plot(args) => plot::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Plugins(args) => plugins::run(args),
        Command::Dev(args) => dev::run(args),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_error_chain_names_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let e = anyhow::Error::new(crate::Error::io("/x/model", io)).context("loading the model");
        assert_eq!(
            super::error_chain(&e),
            "loading the model: i/o error on /x/model: no such file"
        );
        let e = anyhow::anyhow!("inner").context("middle").context("outer");
        assert_eq!(super::error_chain(&e), "outer: middle: inner");
    }
}
