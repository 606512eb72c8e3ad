//! The compiled-code cache: precompiled components (`.cwasm`) in the user's cache folder, keyed
//! by the component's sha256 and the engine's precompile-compatibility hash, so a second start
//! does not run Cranelift again. It must only ever load files it wrote itself.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// Where compiled plugins are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheDir {
    /// `$DEEPINFER_CACHE_DIR/plugins`, else `$XDG_CACHE_HOME/deepinfer/plugins`, else
    /// `~/.cache/deepinfer/plugins`.
    Default,
    At(PathBuf),
    /// Compile every time.
    Disabled,
}

impl CacheDir {
    /// The folder, if caching is on and one can be found.
    pub fn resolve(&self) -> Option<PathBuf> {
        match self {
            CacheDir::Disabled => None,
            CacheDir::At(p) => Some(p.clone()),
            CacheDir::Default => {
                let var = |k: &str| {
                    std::env::var_os(k)
                        .filter(|v| !v.is_empty())
                        .map(PathBuf::from)
                };
                if let Some(d) = var("DEEPINFER_CACHE_DIR") {
                    return Some(d.join("plugins"));
                }
                var("XDG_CACHE_HOME")
                    .or_else(|| var("HOME").map(|h| h.join(".cache")))
                    .map(|c| c.join("deepinfer").join("plugins"))
            }
        }
    }
}

/// A `Hasher` that feeds sha256, so the engine's compatibility hash gives a key that is stable
/// across runs and Rust versions.
struct ShaHasher(Sha256);

impl Hasher for ShaHasher {
    fn finish(&self) -> u64 {
        0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

/// 16 hex digits naming the engine's compiled-code compatibility.
pub fn engine_key(engine: &wasmtime::Engine) -> String {
    let mut h = ShaHasher(Sha256::new());
    engine.precompile_compatibility_hash().hash(&mut h);
    hex(&h.0.finalize()[..8])
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The cache file of a component with sha256 `sha` under `dir` for `engine_key`.
pub fn entry_path(dir: &Path, sha: &str, engine_key: &str) -> PathBuf {
    dir.join(format!("{sha}-{engine_key}.cwasm"))
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a reader never sees a
/// partial file.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable_and_paths_distinct() {
        let engine = wasmtime::Engine::default();
        assert_eq!(engine_key(&engine), engine_key(&engine));
        assert_eq!(engine_key(&engine).len(), 16);
        let d = Path::new("/c");
        assert_ne!(entry_path(d, "aa", "k"), entry_path(d, "ab", "k"));
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn atomic_write_replaces_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub").join("x.cwasm");
        write_atomically(&p, b"one").unwrap();
        write_atomically(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(p.parent().unwrap()).unwrap().count(), 1);
    }
}
