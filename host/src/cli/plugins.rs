//! `deepinfer plugins list | inspect | check | pack`: what plugins a config names (kind, ABI
//! version, sha256, limits, whether a compiled form is cached), one plugin's manifest, a load
//! and smoke test of every plugin, and wrapping a freshly built core module as a component.
//! All plugin logic lives in `crate::plugins`; this file only parses flags and prints.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;

use crate::config::Config;
use crate::plugins::{
    self, CacheDir, Origin, PluginEngine, PluginHost, PluginKind, PluginSource, WasmSampler,
};
use crate::sampling::{BatchSampler, SampleRow, SamplingParams};

/// Inspect and check plugins.
#[derive(Debug, clap::Args)]
pub struct PluginsArgs {
    /// Config file (TOML) naming the plugins; without it, the embedded default config.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: PluginsCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum PluginsCommand {
    /// List the configured and builtin plugins: kind, ABI version, sha256, limits, cache state.
    List,
    /// Show one plugin in detail, with the manifest it declares (instantiates it).
    Inspect {
        /// A plugin name from the config, a builtin, or a path to a .wasm component.
        plugin: String,
    },
    /// Load every plugin the config names, check hash and ABI, and make one test call each.
    Check,
    /// Wrap a core module built for wasm32-unknown-unknown as a plugin component.
    Pack {
        /// The core module (target/wasm32-unknown-unknown/release/NAME.wasm).
        core: PathBuf,
        /// Where to write the component.
        #[arg(short, long, value_name = "FILE")]
        output: PathBuf,
    },
}

/// Runs a `deepinfer plugins` subcommand, printing to stdout.
pub fn run(args: PluginsArgs) -> anyhow::Result<()> {
    let config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    match args.command {
        PluginsCommand::List => list(&config),
        PluginsCommand::Inspect { plugin } => inspect(&config, &plugin),
        PluginsCommand::Check => check(&config),
        PluginsCommand::Pack { core, output } => pack(&core, &output),
    }
}

/// Plugin names to show: the sampler's, every `[plugins.NAME]`, every builtin; once each.
fn plugin_names(config: &Config) -> Vec<String> {
    let mut names = vec![config.sampler.plugin.clone()];
    names.extend(config.plugins.keys().cloned());
    names.extend(plugins::builtin_names().into_iter().map(String::from));
    let mut seen = std::collections::BTreeSet::new();
    names.retain(|n| seen.insert(n.clone()));
    names
}

fn list(config: &Config) -> anyhow::Result<()> {
    let engine = PluginEngine::without_ticker(&CacheDir::Default)?;
    println!(
        "{:<12} {:<16} {:<7} {:<16} {:>8} {:>8} {:>4} {:<6} SOURCE",
        "NAME", "KIND", "ABI", "SHA256", "MEMORY", "TIME", "POOL", "CACHED"
    );
    for name in plugin_names(config) {
        let d = match plugins::describe(config, &name, &engine) {
            Ok(d) => d,
            Err(e) => {
                println!("{name:<12} error: {e}");
                continue;
            }
        };
        let (kind, abi) = match &d.summary {
            Ok(s) => (s.kind.to_string(), s.abi.to_string()),
            Err(e) => {
                println!("{name:<12} refused: {e}");
                continue;
            }
        };
        let l = d.source.limits;
        println!(
            "{:<12} {:<16} {:<7} {:<16} {:>4} MiB {:>5} ms {:>4} {:<6} {}",
            name,
            kind,
            abi,
            &d.source.sha256[..16],
            l.memory_mib,
            l.time_limit_ms,
            l.pool_size,
            if d.cached { "yes" } else { "no" },
            d.source.origin
        );
    }
    Ok(())
}

/// The source of `plugin`: a config name or builtin, else a path to a component file (not
/// pinned: inspecting a file is how one learns its hash).
fn source_for(config: &Config, plugin: &str) -> anyhow::Result<PluginSource> {
    let path = PathBuf::from(plugin);
    if config.plugins.contains_key(plugin)
        || plugins::builtin_names().contains(&plugin)
        || !path.exists()
    {
        return Ok(PluginSource::from_config(config, plugin)?);
    }
    let bytes = crate::files::read_bounded(&path, crate::files::ASSET_MAX)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(PluginSource {
        name: path
            .file_stem()
            .map_or_else(|| plugin.to_string(), |s| s.to_string_lossy().into_owned()),
        origin: Origin::File(path),
        sha256: plugins::sha256_hex(&bytes),
        bytes: bytes.into(),
        limits: Default::default(),
        settings: Vec::new(),
    })
}

fn inspect(config: &Config, plugin: &str) -> anyhow::Result<()> {
    let source = source_for(config, plugin)?;
    println!("name:      {}", source.name);
    println!("source:    {}", source.origin);
    println!("sha256:    {}", source.sha256);
    println!("size:      {} bytes", source.bytes.len());
    let summary = plugins::inspect_component(&source.name, &source.bytes)?;
    println!("kind:      {}", summary.kind);
    println!("abi:       deepinfer:plugin@{}", summary.abi);
    println!(
        "imports:   {}",
        if summary.imports.is_empty() {
            "(none)".into()
        } else {
            summary.imports.join(", ")
        }
    );
    println!("exports:   {}", summary.exports.join(", "));
    let l = source.limits;
    println!(
        "limits:    {} MiB memory, {} ms per call, {} instances",
        l.memory_mib, l.time_limit_ms, l.pool_size
    );
    for (k, v) in &source.settings {
        println!("setting:   {k} = {v}");
    }
    let host = PluginHost::new(&CacheDir::Default)?;
    println!(
        "cached:    {}",
        if host.engine().is_cached(&source.sha256) {
            "yes"
        } else {
            "no (compiling now)"
        }
    );
    if summary.kind == PluginKind::Sampler {
        let s = WasmSampler::load(host.engine().clone(), &source)?;
        let m = s.manifest();
        println!("plugin:    {} {}", m.name, m.version);
        println!("about:     {}", m.description);
        println!(
            "wants:     top {} candidates{}, history: {}",
            m.top_k,
            if m.full_logits { " + full logits" } else { "" },
            m.history
        );
    }
    Ok(())
}

fn check(config: &Config) -> anyhow::Result<()> {
    let host = PluginHost::new(&CacheDir::Default)?;
    let mut failed = 0;
    for name in plugin_names(config) {
        match check_one(config, &host, &name) {
            Ok(note) => println!("ok      {name}: {note}"),
            Err(e) => {
                failed += 1;
                println!("FAILED  {name}: {e:#}");
            }
        }
    }
    anyhow::ensure!(failed == 0, "{failed} plugin(s) failed the check");
    Ok(())
}

/// Loads one plugin and, for a sampler, samples two synthetic rows.
fn check_one(config: &Config, host: &PluginHost, name: &str) -> anyhow::Result<String> {
    let source = PluginSource::from_config(config, name)?;
    let summary = plugins::inspect_component(name, &source.bytes)?;
    if summary.kind != PluginKind::Sampler {
        return Ok(format!(
            "{} plugin, ABI {} (static check only)",
            summary.kind, summary.abi
        ));
    }
    let sampler = Arc::new(WasmSampler::load(host.engine().clone(), &source)?);
    let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 / 10.0).collect();
    let params = [
        SamplingParams::default(),
        SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            ..Default::default()
        },
    ];
    let rows: Vec<SampleRow<'_>> = params
        .iter()
        .map(|p| SampleRow {
            logits: &logits,
            candidates: None,
            params: p,
            seed: 1,
            step: 0,
            history: &[],
        })
        .collect();
    for (i, r) in sampler.sample_batch(&rows).into_iter().enumerate() {
        r.map_err(|e| anyhow::anyhow!("test row {i}: {e}"))?;
    }
    Ok(format!(
        "sampler, ABI {}, sha256 {}",
        summary.abi, source.sha256
    ))
}

fn pack(core: &std::path::Path, output: &std::path::Path) -> anyhow::Result<()> {
    let bytes = crate::files::read_bounded(core, crate::files::ASSET_MAX)
        .with_context(|| format!("reading {}", core.display()))?;
    let name = core
        .file_stem()
        .map_or_else(|| "plugin".into(), |s| s.to_string_lossy().into_owned());
    let component = plugins::pack_component(&name, &bytes)?;
    std::fs::write(output, &component).with_context(|| format!("writing {}", output.display()))?;
    let summary = plugins::inspect_component(&name, &component)?;
    println!(
        "wrote {} ({} plugin, ABI {}, {} bytes)",
        output.display(),
        summary.kind,
        summary.abi,
        component.len()
    );
    println!("sha256 {}", plugins::sha256_hex(&component));
    Ok(())
}
