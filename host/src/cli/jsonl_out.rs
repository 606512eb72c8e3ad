//! The resumable JSONL output file of `deepinfer generate --output FILE`: every result is
//! written as one line and flushed as soon as it completes, so an interrupted run keeps every
//! finished line; reopening the file collects the ids already there (a torn last line from
//! a kill is cut off) so the next run appends only the rest.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use super::prompts_file::id_string;

/// An output file opened for appending.
pub struct JsonlOut {
    path: PathBuf,
    file: File,
    /// Ids of the results the file held when opened.
    pub done: HashSet<String>,
}

impl JsonlOut {
    /// Opens `path`: truncated when `overwrite`, otherwise continued (created if missing). A
    /// path that is not a regular file (`/dev/stdout`, a pipe, a device) is only written to:
    /// there is nothing to resume from it, and reading it could block or never end.
    pub fn open(path: &Path, overwrite: bool) -> anyhow::Result<JsonlOut> {
        // (regular, exists): a missing path is created below as a regular file
        let (regular, exists) = match std::fs::metadata(path) {
            Ok(m) if m.is_dir() => bail!("{} is a folder, not a file", path.display()),
            Ok(m) => (m.is_file(), true),
            Err(_) => (true, false),
        };
        let done = if overwrite || !regular || !exists {
            HashSet::new()
        } else {
            repair(path)?
        };
        let file = OpenOptions::new()
            .create(true)
            .append(!overwrite || !regular)
            .write(true)
            .truncate(overwrite && regular)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(JsonlOut {
            path: path.to_path_buf(),
            file,
            done,
        })
    }

    /// Appends one record as a line and flushes it.
    pub fn write(&mut self, record: &impl serde::Serialize) -> anyhow::Result<()> {
        let mut line = serde_json::to_string(record)?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|_| self.file.flush())
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// Reads the ids of a previous run's complete lines. A last line cut short by a kill is
/// removed (it is redone); a bad line anywhere else is an error, not silently skipped.
fn repair(path: &Path) -> anyhow::Result<HashSet<String>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut done = HashSet::new();
    let mut good_end = 0usize;
    let mut start = 0usize;
    let mut line_no = 0usize;
    while start < bytes.len() {
        line_no += 1;
        let end = bytes[start..]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(bytes.len(), |i| start + i);
        let line = &bytes[start..end];
        let last = end + 1 >= bytes.len();
        let id = serde_json::from_slice::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v.get("id").map(id_string));
        match id {
            Some(id) => {
                done.insert(id);
                good_end = end;
            }
            None if line.iter().all(u8::is_ascii_whitespace) => {}
            None if last => break,
            None => bail!(
                "{}:{line_no} is not a result line; fix it or pass --overwrite to start over",
                path.display()
            ),
        }
        start = end + 1;
    }
    // Keep whole lines only, each ending in a newline.
    let mut keep = bytes[..good_end.min(bytes.len())].to_vec();
    if !keep.is_empty() {
        keep.push(b'\n');
    }
    if keep != bytes {
        std::fs::write(path, &keep).with_context(|| format!("repairing {}", path.display()))?;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resuming_keeps_whole_lines_and_drops_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.jsonl");
        std::fs::write(
            &p,
            "{\"id\":\"a\",\"text\":\"x\"}\n{\"id\":\"b\"}\n{\"id\":\"c\",\"te",
        )
        .unwrap();
        let mut out = JsonlOut::open(&p, false).unwrap();
        assert_eq!(out.done, HashSet::from(["a".to_string(), "b".to_string()]));
        out.write(&serde_json::json!({"id": "c"})).unwrap();
        drop(out);
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(
            text,
            "{\"id\":\"a\",\"text\":\"x\"}\n{\"id\":\"b\"}\n{\"id\":\"c\"}\n"
        );
        // A complete last line without its newline is kept.
        std::fs::write(&p, "{\"id\":\"a\"}").unwrap();
        let out = JsonlOut::open(&p, false).unwrap();
        assert!(out.done.contains("a"));
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{\"id\":\"a\"}\n");
        // A bad line in the middle is an error; --overwrite starts over.
        std::fs::write(&p, "{\"id\":\"a\"}\nnot json\n{\"id\":\"b\"}\n").unwrap();
        assert!(JsonlOut::open(&p, false).is_err());
        let out = JsonlOut::open(&p, true).unwrap();
        assert!(out.done.is_empty());
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "");
    }

    #[test]
    fn devices_are_written_not_resumed_and_a_failed_write_is_an_error() {
        // /dev/null reads as empty and /dev/full as endless zeros: neither is read back.
        let mut out = JsonlOut::open(Path::new("/dev/null"), false).unwrap();
        assert!(out.done.is_empty());
        out.write(&serde_json::json!({"id": "a"})).unwrap();
        let mut full = JsonlOut::open(Path::new("/dev/full"), false).unwrap();
        let e = full.write(&serde_json::json!({"id": "a"})).unwrap_err();
        assert!(format!("{e:#}").contains("/dev/full"), "{e:#}");
        let dir = tempfile::tempdir().unwrap();
        let e = JsonlOut::open(dir.path(), false)
            .err()
            .expect("a folder is refused");
        assert!(e.to_string().contains("folder"), "{e}");
    }
}
