//! TOML configuration: the raw file (every table denies unknown keys, and the error names the
//! key and the file) resolved once into values the engine uses. It owns the file format and
//! its defaults (`configs/default.toml`, embedded); it must not load models or plugins.
//!
//! Precedence: built-in defaults < config file < command-line flags. A CLI sets a flag by
//! writing the matching public field after [`Config::load`] (e.g.
//! `config.sampler.temperature = Some(t)`, `config.sampler.plugin = name`), then calls
//! [`SamplerConfig::params`] and `plugins::build_sampler(&config)`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::ids::TokenId;
use crate::sampling::SamplingParams;

/// The embedded default config (`configs/default.toml`).
pub const DEFAULT_TOML: &str = include_str!("../../configs/default.toml");

/// A whole config file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub model: ModelConfig,
    #[serde(default)]
    pub sampler: SamplerConfig,
    /// `[plugins.NAME]` tables, by name.
    #[serde(default)]
    pub plugins: BTreeMap<String, PluginConfig>,
    /// The file this config came from; `None` for the embedded default.
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// `[model]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// A model file or folder; relative paths are relative to the config file.
    pub path: Option<PathBuf>,
    /// CPU threads for the forward pass.
    pub threads: Option<usize>,
}

/// `[sampler]`: which sampler plugin runs, and the default sampling parameters of requests.
/// Unset fields keep [`SamplingParams::default`].
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplerConfig {
    /// Name of the sampler plugin: a `[plugins.NAME]` table or a builtin (`standard`, `greedy`).
    #[serde(default = "default_sampler_plugin")]
    pub plugin: String,
    pub temperature: Option<f32>,
    pub top_k: Option<u32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string key, TOML's rule) to an additive bias.
    #[serde(default)]
    pub logit_bias: BTreeMap<String, f32>,
    pub seed: Option<u64>,
    pub max_tokens: Option<usize>,
    pub stop: Option<Vec<String>>,
    pub ignore_eos: Option<bool>,
}

fn default_sampler_plugin() -> String {
    "standard".into()
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            plugin: default_sampler_plugin(),
            temperature: None,
            top_k: None,
            top_p: None,
            min_p: None,
            repetition_penalty: None,
            presence_penalty: None,
            frequency_penalty: None,
            logit_bias: BTreeMap::new(),
            seed: None,
            max_tokens: None,
            stop: None,
            ignore_eos: None,
        }
    }
}

/// `[plugins.NAME]`: where a plugin comes from, its pin and its limits.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginConfig {
    /// A `.wasm` component; relative paths are relative to the config file. Needs `sha256`.
    pub path: Option<PathBuf>,
    /// Use the plugin of this name built into the host.
    #[serde(default)]
    pub builtin: bool,
    /// Lowercase hex sha256 of the component; required with `path`, checked for builtins too.
    pub sha256: Option<String>,
    /// Most linear memory per instance, in MiB (default 64).
    pub memory_mib: Option<u32>,
    /// Most wall time per call, in milliseconds (default 100).
    pub time_limit_ms: Option<u32>,
    /// Most instances alive at once, so calls can run on that many threads (default 4).
    pub pool_size: Option<u32>,
    /// Plugin-specific settings, passed to the plugin's `configure` as text.
    #[serde(default)]
    pub settings: BTreeMap<String, toml::Value>,
}

impl Default for Config {
    /// The embedded `configs/default.toml` (a unit test checks that it parses).
    fn default() -> Self {
        Config::from_toml_str(DEFAULT_TOML, None).expect("the embedded default config is valid")
    }
}

impl Config {
    /// Reads and checks a config file. Errors name the file, and the key for unknown keys.
    pub fn load(path: impl AsRef<Path>) -> Result<Config> {
        let path = path.as_ref();
        let text = crate::files::read_text_bounded(path, crate::files::TEXT_MAX)
            .map_err(|e| Error::io(path, e))?;
        Config::from_toml_str(&text, Some(path))
    }

    /// Parses config text; `origin` (the file it came from) is used in errors and to resolve
    /// relative paths.
    pub fn from_toml_str(text: &str, origin: Option<&Path>) -> Result<Config> {
        let shown = origin.map_or_else(
            || PathBuf::from("<embedded default config>"),
            Path::to_path_buf,
        );
        let mut config: Config = toml::from_str(text).map_err(|e| Error::Config {
            path: shown.clone(),
            message: e.to_string().trim_end().to_string(),
        })?;
        if let Some(file) = origin {
            let dir = file.parent().unwrap_or(Path::new(""));
            let resolve = |p: &mut PathBuf| {
                if p.is_relative() {
                    *p = dir.join(&*p);
                }
            };
            if let Some(p) = config.model.path.as_mut() {
                resolve(p);
            }
            for plugin in config.plugins.values_mut() {
                if let Some(p) = plugin.path.as_mut() {
                    resolve(p);
                }
            }
            config.source = Some(file.to_path_buf());
        }
        config.check().map_err(|message| Error::Config {
            path: shown,
            message,
        })?;
        Ok(config)
    }

    /// Checks what serde cannot: values in range, plugin tables well formed.
    fn check(&self) -> std::result::Result<(), String> {
        self.sampler.params()?;
        if self.model.threads == Some(0) {
            return Err("[model] threads must be at least 1".into());
        }
        for (name, p) in &self.plugins {
            match (&p.path, p.builtin) {
                (Some(_), true) => {
                    return Err(format!(
                        "[plugins.{name}]: set either `path` or `builtin = true`, not both"
                    ))
                }
                (None, false) => {
                    return Err(format!(
                        "[plugins.{name}]: set `path = \"file.wasm\"` or `builtin = true`"
                    ))
                }
                _ => {}
            }
            if let Some(h) = &p.sha256 {
                if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(format!(
                        "[plugins.{name}] sha256: expected 64 hex digits, got {h:?}"
                    ));
                }
            }
            for (field, v) in [
                ("memory_mib", p.memory_mib),
                ("time_limit_ms", p.time_limit_ms),
                ("pool_size", p.pool_size),
            ] {
                if v == Some(0) {
                    return Err(format!("[plugins.{name}] {field} must be at least 1"));
                }
            }
            p.settings_text()
                .map_err(|e| format!("[plugins.{name}] settings: {e}"))?;
        }
        Ok(())
    }
}

impl SamplerConfig {
    /// The default sampling parameters of requests, checked; errors name the field.
    pub fn params(&self) -> std::result::Result<SamplingParams, String> {
        let mut p = SamplingParams::default();
        macro_rules! take {
            ($($f:ident),*) => { $( if let Some(v) = self.$f.clone() { p.$f = v; } )* };
        }
        take!(
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            max_tokens,
            stop,
            ignore_eos
        );
        p.seed = self.seed;
        for (k, &b) in &self.logit_bias {
            let id: TokenId = k
                .parse()
                .map_err(|_| format!("[sampler] logit_bias: key {k:?} is not a token id"))?;
            if !b.is_finite() {
                return Err(format!(
                    "[sampler] logit_bias: bias of token {id} must be finite"
                ));
            }
            p.logit_bias.push((id, b));
        }
        p.validate().map_err(|e| format!("[sampler] {e}"))?;
        Ok(p)
    }
}

impl PluginConfig {
    /// The `settings` table as the key/value text a plugin receives; only scalars are allowed.
    pub fn settings_text(&self) -> std::result::Result<Vec<(String, String)>, String> {
        self.settings
            .iter()
            .map(|(k, v)| {
                let text = match v {
                    toml::Value::String(s) => s.clone(),
                    toml::Value::Integer(i) => i.to_string(),
                    toml::Value::Float(f) => f.to_string(),
                    toml::Value::Boolean(b) => b.to_string(),
                    _ => return Err(format!("`{k}` must be a string, number or boolean")),
                };
                Ok((k.clone(), text))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_default_parses_and_names_standard() {
        let c = Config::default();
        assert_eq!(c.sampler.plugin, "standard");
        assert!(c.sampler.params().is_ok());
    }

    #[test]
    fn unknown_keys_name_the_key_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.toml");
        for text in [
            "[sampler]\ntemprature = 0.5\n",
            "[plugins.x]\nbuiltin = true\nmemory = 3\n",
            "colour = 1\n",
        ] {
            std::fs::write(&path, text).unwrap();
            let msg = Config::load(&path).unwrap_err().to_string();
            let key = ["temprature", "memory", "colour"]
                .into_iter()
                .find(|k| text.contains(k))
                .unwrap();
            assert!(msg.contains(key), "{msg}");
            assert!(msg.contains("bad.toml"), "{msg}");
        }
    }

    #[test]
    fn sampler_fields_override_defaults_and_are_checked() {
        let c = Config::from_toml_str(
            "[sampler]\nplugin = \"greedy\"\ntemperature = 0.7\ntop_p = 0.9\nseed = 5\nlogit_bias = { \"12\" = -3.5 }\n",
            None,
        )
        .unwrap();
        let p = c.sampler.params().unwrap();
        assert_eq!((p.temperature, p.top_p, p.seed), (0.7, 0.9, Some(5)));
        assert_eq!(p.logit_bias, vec![(12, -3.5)]);
        assert_eq!(c.sampler.plugin, "greedy");
        let bad = Config::from_toml_str("[sampler]\ntop_p = 1.5\n", None)
            .unwrap_err()
            .to_string();
        assert!(bad.contains("top_p"), "{bad}");
        let bad = Config::from_toml_str("[sampler]\nlogit_bias = { abc = 1.0 }\n", None)
            .unwrap_err()
            .to_string();
        assert!(bad.contains("abc"), "{bad}");
        let bad = Config::from_toml_str("[model]\nthreads = 0\n", None)
            .unwrap_err()
            .to_string();
        assert!(bad.contains("[model] threads must be at least 1"), "{bad}");
    }

    #[test]
    fn plugin_tables_resolve_paths_and_check_pins() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        let pin = "ab".repeat(32);
        std::fs::write(&path, format!("[plugins.t]\npath = \"t.wasm\"\nsha256 = \"{pin}\"\nsettings = {{ mass = 0.5, name = \"x\" }}\n")).unwrap();
        let c = Config::load(&path).unwrap();
        let t = &c.plugins["t"];
        assert_eq!(t.path.as_deref(), Some(dir.path().join("t.wasm").as_path()));
        assert_eq!(
            t.settings_text().unwrap(),
            vec![("mass".into(), "0.5".into()), ("name".into(), "x".into())]
        );
        for bad in [
            "[plugins.t]\npath = \"t.wasm\"\nbuiltin = true\n",
            "[plugins.t]\nsha256 = \"00\"\nbuiltin = true\n",
            "[plugins.t]\nbuiltin = true\nsettings = { a = [1] }\n",
            "[plugins.t]\nbuiltin = true\nmemory_mib = 0\n",
            "[plugins.t]\n",
        ] {
            assert!(Config::from_toml_str(bad, None).is_err(), "{bad}");
        }
    }
}
