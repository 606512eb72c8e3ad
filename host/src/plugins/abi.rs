//! The plugin ABI's versions and kinds, and the static check of a component against them: read
//! its top-level imports and exports (without compiling it) to learn its kind and ABI version,
//! and refuse unknown ABI majors and foreign imports (WASI, ...) before anything runs.

use std::fmt;

use wasmparser::{Encoding, Parser, Payload};

use crate::error::{Error, Result};

/// The WIT package every plugin interface belongs to.
pub const PACKAGE: &str = "deepinfer:plugin";

/// ABI versions this host loads. Each is frozen under `plugin-sdk/wit/vX.Y.Z/`.
pub const SUPPORTED: &[AbiVersion] = &[AbiVersion {
    major: 0,
    minor: 1,
    patch: 0,
}];

/// Interfaces a plugin may import (besides nothing at all).
const IMPORTABLE: &[&str] = &["types", "host"];

/// A version of the `deepinfer:plugin` package.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct AbiVersion {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
}

impl AbiVersion {
    /// Parses `MAJOR.MINOR.PATCH` (pre-release or build suffixes are refused).
    pub fn parse(text: &str) -> Option<AbiVersion> {
        let mut it = text.split('.').map(|p| p.parse::<u64>().ok());
        let v = AbiVersion {
            major: it.next()??,
            minor: it.next()??,
            patch: it.next()??,
        };
        it.next().is_none().then_some(v)
    }

    /// The compatibility series (Cargo's rule): `MAJOR` from 1.0 on, `0.MINOR` before. Versions
    /// of one series share one frozen ABI; a new series is a new major.
    pub fn series(self) -> (u64, u64) {
        if self.major == 0 {
            (0, self.minor)
        } else {
            (self.major, 0)
        }
    }

    /// Whether this host loads plugins of this version's series.
    pub fn is_supported(self) -> bool {
        SUPPORTED.iter().any(|s| s.series() == self.series())
    }
}

impl fmt::Display for AbiVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The supported series, for messages: "0.1.x".
pub fn supported_list() -> String {
    let v: Vec<String> = SUPPORTED
        .iter()
        .map(|s| match s.series() {
            (0, minor) => format!("0.{minor}.x"),
            (major, _) => format!("{major}.x"),
        })
        .collect();
    v.join(", ")
}

/// What a plugin does: one world of the ABI each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PluginKind {
    Sampler,
    Constraint,
    DraftScheduler,
    Eplb,
}

impl PluginKind {
    pub const ALL: [PluginKind; 4] = [
        PluginKind::Sampler,
        PluginKind::Constraint,
        PluginKind::DraftScheduler,
        PluginKind::Eplb,
    ];

    /// The interface the kind's world exports.
    pub fn interface(self) -> &'static str {
        match self {
            PluginKind::Sampler => "sampler-api",
            PluginKind::Constraint => "constraint-api",
            PluginKind::DraftScheduler => "draft-scheduler-api",
            PluginKind::Eplb => "eplb-api",
        }
    }

    /// The world's name.
    pub fn name(self) -> &'static str {
        match self {
            PluginKind::Sampler => "sampler",
            PluginKind::Constraint => "constraint",
            PluginKind::DraftScheduler => "draft-scheduler",
            PluginKind::Eplb => "eplb",
        }
    }
}

impl fmt::Display for PluginKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the static check learned about a component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub kind: PluginKind,
    pub abi: AbiVersion,
    pub imports: Vec<String>,
    pub exports: Vec<String>,
}

/// Splits `deepinfer:plugin/NAME@VERSION` into (NAME, VERSION text).
fn split_name(full: &str) -> Option<(&str, &str)> {
    let rest = full.strip_prefix(PACKAGE)?.strip_prefix('/')?;
    rest.split_once('@')
}

/// Reads a component's top-level imports and exports and checks them against the ABI. Errors
/// name `plugin`. Nothing is compiled or run.
pub fn inspect(plugin: &str, bytes: &[u8]) -> Result<Summary> {
    let fail = |reason: String| Error::Plugin {
        plugin: plugin.to_string(),
        reason,
    };
    let (imports, exports) = top_level_names(bytes).map_err(fail)?;

    // The export says the kind and the ABI version; check it first, so that a plugin of an
    // unknown ABI is reported as such rather than by its (equally unknown) imports.
    let mut found: Option<(PluginKind, &str)> = None;
    for name in &exports {
        let Some((iface, version)) = split_name(name) else {
            continue;
        };
        let kind = PluginKind::ALL.into_iter().find(|k| k.interface() == iface);
        if let Some(kind) = kind {
            if found.is_some() {
                return Err(fail("exports more than one plugin interface".into()));
            }
            found = Some((kind, version));
        }
    }
    let Some((kind, version_text)) = found else {
        return Err(fail(format!(
            "exports no {PACKAGE} plugin interface (it exports: {})",
            if exports.is_empty() {
                "nothing".to_string()
            } else {
                exports.join(", ")
            }
        )));
    };
    let abi = AbiVersion::parse(version_text)
        .ok_or_else(|| fail(format!("bad ABI version `{version_text}`")))?;
    if !abi.is_supported() {
        return Err(Error::PluginAbi {
            plugin: plugin.to_string(),
            found: abi.to_string(),
            supported: supported_list(),
        });
    }
    for name in &imports {
        let allowed = split_name(name).is_some_and(|(iface, v)| {
            IMPORTABLE.contains(&iface)
                && AbiVersion::parse(v).is_some_and(|v| v.series() == abi.series())
        });
        if !allowed {
            return Err(Error::PluginImport {
                plugin: plugin.to_string(),
                import: name.clone(),
            });
        }
    }
    Ok(Summary {
        kind,
        abi,
        imports,
        exports,
    })
}

/// The names of a component's top-level imports and exports.
fn top_level_names(bytes: &[u8]) -> std::result::Result<(Vec<String>, Vec<String>), String> {
    let mut imports = Vec::new();
    let mut exports = Vec::new();
    let mut depth = 0usize;
    for payload in Parser::new(0).parse_all(bytes) {
        let payload = payload.map_err(|e| format!("not a valid WebAssembly component: {e}"))?;
        match payload {
            Payload::Version { encoding, .. } if depth == 0 && encoding != Encoding::Component => {
                return Err(
                    "is a core WebAssembly module, not a component; wrap it with \
                            `deepinfer plugins pack` (or scripts/build-plugin.sh)"
                        .into(),
                );
            }
            Payload::ModuleSection { .. } | Payload::ComponentSection { .. } => depth += 1,
            Payload::End(_) => depth = depth.saturating_sub(1),
            Payload::ComponentImportSection(reader) if depth == 0 => {
                for import in reader {
                    let import = import.map_err(|e| format!("bad import section: {e}"))?;
                    imports.push(import.name.name.to_string());
                }
            }
            Payload::ComponentExportSection(reader) if depth == 0 => {
                for export in reader {
                    let export = export.map_err(|e| format!("bad export section: {e}"))?;
                    exports.push(export.name.name.to_string());
                }
            }
            _ => {}
        }
    }
    Ok((imports, exports))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_group_into_series() {
        let v = AbiVersion::parse("0.1.7").unwrap();
        assert_eq!(v.series(), (0, 1));
        assert!(v.is_supported());
        assert!(!AbiVersion::parse("0.2.0").unwrap().is_supported());
        assert!(!AbiVersion::parse("9.0.0").unwrap().is_supported());
        assert_eq!(AbiVersion::parse("2.3.4").unwrap().series(), (2, 0));
        assert!(AbiVersion::parse("1.0").is_none());
        assert!(AbiVersion::parse("1.0.0-rc1").is_none());
    }

    #[test]
    fn a_core_module_is_refused_with_a_hint() {
        let core = wat::parse_str("(module)").unwrap();
        let e = inspect("x", &core).unwrap_err().to_string();
        assert!(
            e.contains("core WebAssembly module") && e.contains("pack"),
            "{e}"
        );
    }

    fn exporting(name: &str) -> Vec<u8> {
        wat::parse_str(format!(
            r#"(component
                (core module $m (func (export "f")))
                (core instance $i (instantiate $m))
                (func $f (canon lift (core func $i "f")))
                (instance $api (export "manifest" (func $f)))
                (export "{name}" (instance $api)))"#
        ))
        .unwrap()
    }

    #[test]
    fn the_export_names_the_kind_and_version() {
        for kind in PluginKind::ALL {
            let s = inspect(
                "x",
                &exporting(&format!("{PACKAGE}/{}@0.1.3", kind.interface())),
            )
            .unwrap();
            assert_eq!((s.kind, s.abi.to_string()), (kind, "0.1.3".to_string()));
            assert!(s.imports.is_empty());
        }
        let e = inspect("x", &exporting("deepinfer:plugin/sampler-api@0.1")).unwrap_err();
        assert!(e.to_string().contains("bad ABI version"), "{e}");
    }

    #[test]
    fn a_component_without_plugin_exports_is_refused() {
        let c = wat::parse_str("(component)").unwrap();
        let e = inspect("x", &c).unwrap_err().to_string();
        assert!(e.contains("exports no deepinfer:plugin"), "{e}");
    }
}
