//! Whole-file reads with a ceiling. A path a user or a model folder names may be a device
//! (`/dev/zero`), a pipe or a file far larger than its kind ever is; reading it whole would
//! take all memory or never end. These reads stop one byte past the ceiling and say so.

use std::io::{BufRead, Read};

use anyhow::Context;
use std::path::Path;

/// Text a person writes: config files, JSON Schemas, grammars, a model's JSON configs.
pub const TEXT_MAX: u64 = 64 << 20;
/// Tokenizer files (the largest vocabularies' `tokenizer.json` are tens of MB), plugin
/// modules and a text to score whole.
pub const ASSET_MAX: u64 = 1 << 30;
/// The longest line of a JSONL file read line by line (requests, tasks, samples, records).
pub const LINE_MAX: usize = 256 << 20;

/// Lines of a reader, each at most `max` bytes without its newline (`\n` or `\r\n`): a longer
/// one is an error before it fills the memory, as a file with no newline, or `/dev/zero`,
/// would.
pub struct BoundedLines<R> {
    reader: R,
    max: usize,
}

impl BoundedLines<std::io::BufReader<std::fs::File>> {
    /// The lines of the file at `path`, each at most `LINE_MAX` bytes.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        Ok(BoundedLines::new(
            std::io::BufReader::new(std::fs::File::open(path)?),
            LINE_MAX,
        ))
    }
}

impl<R: std::io::BufRead> BoundedLines<R> {
    pub fn new(reader: R, max: usize) -> Self {
        BoundedLines { reader, max }
    }

    /// The next line, `None` at the end.
    pub fn next_line(&mut self) -> std::io::Result<Option<String>> {
        let mut buf = Vec::new();
        let got = (&mut self.reader)
            .take(self.max as u64 + 1)
            .read_until(b'\n', &mut buf)?;
        if got == 0 {
            return Ok(None);
        }
        if buf.last() == Some(&b'\n') {
            buf.pop();
            if buf.last() == Some(&b'\r') {
                buf.pop();
            }
        } else if buf.len() > self.max {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the line is longer than {}", human(self.max as u64)),
            ));
        }
        String::from_utf8(buf).map(Some).map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::InvalidData, "the line is not UTF-8")
        })
    }
}

impl<R: std::io::BufRead> Iterator for BoundedLines<R> {
    type Item = std::io::Result<String>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_line().transpose()
    }
}

/// The JSON values of `path`'s non-blank lines (each at most [`LINE_MAX`] bytes); errors name
/// the file and line, `what` the kind of line expected ("a task").
pub fn read_jsonl<T: serde::de::DeserializeOwned>(
    path: &Path,
    what: &str,
) -> anyhow::Result<Vec<T>> {
    BoundedLines::open(path)
        .with_context(|| format!("opening {}", path.display()))?
        .enumerate()
        .filter(|(_, l)| l.as_ref().map_or(true, |l| !l.trim().is_empty()))
        .map(|(i, l)| {
            let at = || format!("{}:{}", path.display(), i + 1);
            let l = l.with_context(|| format!("reading {}", at()))?;
            serde_json::from_str(&l).with_context(|| format!("{}: not {what}", at()))
        })
        .collect()
}

/// Reads `path` whole, refusing more than `max` bytes with an `InvalidData` error that gives
/// the ceiling. A regular file's size is checked before anything is read; other files (pipes,
/// devices) are read up to one byte past the ceiling.
pub fn read_bounded(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let file = std::fs::File::open(path)?;
    let meta = file.metadata()?;
    if meta.is_dir() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::IsADirectory,
            "is a folder, not a file",
        ));
    }
    if meta.is_file() && meta.len() > max {
        return Err(too_large(max));
    }
    let mut bytes = Vec::with_capacity(if meta.is_file() {
        meta.len() as usize
    } else {
        0
    });
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(too_large(max));
    }
    Ok(bytes)
}

/// `read_bounded` as UTF-8 text.
pub fn read_text_bounded(path: &Path, max: u64) -> std::io::Result<String> {
    String::from_utf8(read_bounded(path, max)?).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to()),
        )
    })
}

fn too_large(max: u64) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!(
            "longer than {} (this kind of file is never that large; is it the file you meant?)",
            human(max)
        ),
    )
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 30 && bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_up_to_the_ceiling_and_refuses_past_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.txt");
        std::fs::write(&p, "abcd").unwrap();
        assert_eq!(read_text_bounded(&p, 4).unwrap(), "abcd");
        let e = read_bounded(&p, 3).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("longer than 3 bytes"), "{e}");
        let e = read_bounded(dir.path(), 3).unwrap_err();
        assert!(e.to_string().contains("folder"), "{e}");
        std::fs::write(&p, [0xffu8, 0xfe]).unwrap();
        let e = read_text_bounded(&p, 10).unwrap_err();
        assert!(e.to_string().contains("UTF-8"), "{e}");
    }

    #[test]
    fn lines_are_bounded_and_keep_their_text() {
        let text = b"ab\r\n\ncdef\nghijkl\nxy";
        let mut l = BoundedLines::new(&text[..], 4);
        assert_eq!(l.next_line().unwrap().as_deref(), Some("ab"));
        assert_eq!(l.next_line().unwrap().as_deref(), Some(""));
        assert_eq!(l.next_line().unwrap().as_deref(), Some("cdef"));
        let e = l.next_line().unwrap_err();
        assert!(e.to_string().contains("longer than"), "{e}");
        // Endless input without a newline stops at the bound.
        let mut zero = BoundedLines::new(std::io::BufReader::new(std::io::repeat(0)), 1 << 20);
        assert!(zero.next_line().is_err());
        let mut last = BoundedLines::new(&b"xy"[..], 4);
        assert_eq!(last.next_line().unwrap().as_deref(), Some("xy"));
        assert_eq!(last.next_line().unwrap(), None);
    }

    #[cfg(unix)]
    #[test]
    fn an_endless_device_stops_at_the_ceiling() {
        let e = read_bounded(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("longer than 1 MiB"), "{e}");
    }
}
