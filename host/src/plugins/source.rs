//! Where a plugin's bytes come from (a builtin or a file named in config) and the sha256 pin
//! that must match before anything else happens.

use std::path::PathBuf;
use std::sync::Arc;

use super::builtin;
use super::cache::sha256_hex;
use super::limits::PluginLimits;
use crate::config::{Config, PluginConfig};
use crate::error::{Error, Result};

/// Where a plugin came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Builtin,
    File(PathBuf),
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Builtin => f.write_str("builtin"),
            Origin::File(p) => write!(f, "{}", p.display()),
        }
    }
}

/// A plugin's bytes, checked against its pin, with what config says about it.
#[derive(Debug, Clone)]
pub struct PluginSource {
    pub name: String,
    pub origin: Origin,
    pub bytes: Arc<[u8]>,
    /// Lowercase hex sha256 of `bytes`.
    pub sha256: String,
    pub limits: PluginLimits,
    pub settings: Vec<(String, String)>,
}

impl PluginSource {
    /// Resolves plugin `name` from `config`: its `[plugins.NAME]` table if there is one, else
    /// the builtin of that name with default limits.
    pub fn from_config(config: &Config, name: &str) -> Result<PluginSource> {
        PluginSource::resolve(name, config.plugins.get(name))
    }

    pub fn resolve(name: &str, table: Option<&PluginConfig>) -> Result<PluginSource> {
        let fail = |reason: String| Error::Plugin {
            plugin: name.to_string(),
            reason,
        };
        let (origin, bytes): (Origin, Arc<[u8]>) = match table.and_then(|t| t.path.clone()) {
            Some(path) => {
                let bytes = crate::files::read_bounded(&path, crate::files::ASSET_MAX)
                    .map_err(|e| Error::io(&path, e))?;
                (Origin::File(path), bytes.into())
            }
            None => {
                let bytes = builtin::get(name).ok_or_else(|| {
                    let known: Vec<_> = builtin::names().collect();
                    fail(format!(
                        "no such builtin plugin (builtins: {}); for a plugin file add a \
                         [plugins.{name}] table with `path` and `sha256`",
                        known.join(", ")
                    ))
                })?;
                (Origin::Builtin, bytes.into())
            }
        };
        let sha256 = sha256_hex(&bytes);
        let pin = table
            .and_then(|t| t.sha256.as_deref())
            .map(str::to_ascii_lowercase);
        match (&origin, pin) {
            (_, Some(expected)) if expected != sha256 => {
                return Err(Error::PluginHashMismatch {
                    plugin: name.to_string(),
                    path: match &origin {
                        Origin::File(p) => p.clone(),
                        Origin::Builtin => PathBuf::from("<builtin>"),
                    },
                    expected,
                    actual: sha256,
                })
            }
            (Origin::File(p), None) => {
                return Err(fail(format!(
                    "{} is not pinned: add `sha256 = \"{sha256}\"` to [plugins.{name}] once you \
                     trust this file",
                    p.display()
                )))
            }
            _ => {}
        }
        let settings = match table {
            Some(t) => t
                .settings_text()
                .map_err(|e| fail(format!("settings: {e}")))?,
            None => Vec::new(),
        };
        Ok(PluginSource {
            name: name.to_string(),
            origin,
            bytes,
            sha256,
            limits: PluginLimits::from_config(table),
            settings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_resolve_without_a_table() {
        let s = PluginSource::resolve("greedy", None).unwrap();
        assert_eq!(s.origin, Origin::Builtin);
        assert_eq!(s.sha256.len(), 64);
        assert!(PluginSource::resolve("nope", None).is_err());
    }

    #[test]
    fn files_must_be_pinned_and_match() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.wasm");
        std::fs::write(&path, b"not really wasm").unwrap();
        let actual = sha256_hex(b"not really wasm");
        let mut t = PluginConfig {
            path: Some(path.clone()),
            ..Default::default()
        };
        let e = PluginSource::resolve("p", Some(&t))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&actual) && e.contains("not pinned"), "{e}");
        t.sha256 = Some("0".repeat(64));
        let e = PluginSource::resolve("p", Some(&t))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&actual) && e.contains(&"0".repeat(64)) && e.contains("p.wasm"),
            "{e}"
        );
        t.sha256 = Some(actual.to_uppercase());
        assert!(PluginSource::resolve("p", Some(&t)).is_ok());
    }
}
