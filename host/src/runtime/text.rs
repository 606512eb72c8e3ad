//! Incremental detokenization and stop strings, per sample. Decoding the whole output after
//! every token costs O(n²); [`TextStream`] decodes only a short window (the tokens since the
//! last complete character run) and appends the difference. It works through a decode
//! function, so it knows nothing about tokenizers, and it runs off the engine's busy loop.

use crate::ids::TokenId;

/// The replacement character a decoder emits for an incomplete UTF-8 sequence.
const REPLACEMENT: char = '\u{FFFD}';

/// A growing token sequence and the text it decodes to.
#[derive(Debug, Clone, Default)]
pub struct TextStream {
    tokens: Vec<TokenId>,
    text: String,
    /// Start of the decode window: tokens before it are settled in `text`.
    prefix_offset: usize,
    /// Tokens up to here are reflected in `text`.
    read_offset: usize,
}

impl TextStream {
    pub fn tokens(&self) -> &[TokenId] {
        &self.tokens
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    /// Appends `new` tokens and returns the text they completed. Text is held back while the
    /// window ends in an incomplete character (the decoder's replacement character).
    pub fn push(&mut self, new: &[TokenId], decode: &dyn Fn(&[TokenId]) -> String) -> String {
        self.tokens.extend_from_slice(new);
        let prefix = decode(&self.tokens[self.prefix_offset..self.read_offset]);
        let full = decode(&self.tokens[self.prefix_offset..]);
        if full.len() <= prefix.len() || full.ends_with(REPLACEMENT) {
            return String::new();
        }
        let Some(delta) = full
            .get(prefix.len()..)
            .filter(|_| full.starts_with(&prefix))
        else {
            // A decoder whose window text does not extend its prefix (rare normalizers):
            // fall back to decoding everything once.
            let all = decode(&self.tokens);
            let delta = all.get(self.text.len()..).unwrap_or_default().to_string();
            self.text = all;
            self.prefix_offset = self.tokens.len();
            self.read_offset = self.tokens.len();
            return delta;
        };
        let delta = delta.to_string();
        self.text.push_str(&delta);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        delta
    }

    /// Cuts the text at byte `at` (a stop string's start) and the tokens after `keep`; the
    /// text is final from then on.
    pub fn truncate(&mut self, at: usize, keep: usize) {
        self.text.truncate(at);
        self.tokens.truncate(keep);
        self.read_offset = self.tokens.len();
        self.prefix_offset = self.tokens.len();
    }

    /// The settled text: whatever the window still holds back is decoded once, fully.
    pub fn finish(&mut self, decode: &dyn Fn(&[TokenId]) -> String) -> &str {
        if self.read_offset < self.tokens.len() {
            self.text = decode(&self.tokens);
            self.read_offset = self.tokens.len();
            self.prefix_offset = self.tokens.len();
        }
        &self.text
    }
}

/// Where the earliest of `stops` starts in `text`, looking only at matches that end after
/// byte `old_len` (text before it was searched already).
pub fn find_stop(text: &str, old_len: usize, stops: &[String]) -> Option<usize> {
    let longest = stops.iter().map(|s| s.len()).max()?;
    let mut from = old_len
        .saturating_sub(longest.saturating_sub(1))
        .min(text.len());
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i))
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy byte-level decoder: token t < 256 is byte t; 300 is a control token (dropped).
    fn decode(ids: &[TokenId]) -> String {
        let bytes: Vec<u8> = ids.iter().filter(|&&t| t < 256).map(|&t| t as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn ids(s: &str) -> Vec<TokenId> {
        s.bytes().map(TokenId::from).collect()
    }

    #[test]
    fn pieces_add_up_to_the_full_decode() {
        let text = "héllo wörld, ça va? 日本";
        let mut st = TextStream::default();
        let mut joined = String::new();
        for t in ids(text) {
            joined.push_str(&st.push(&[t], &decode));
        }
        assert_eq!(joined, text);
        assert_eq!(st.text(), text);
        assert_eq!(st.finish(&decode), text);
    }

    #[test]
    fn incomplete_characters_are_held_back() {
        let mut st = TextStream::default();
        let e = "é".as_bytes();
        assert_eq!(st.push(&[TokenId::from(e[0])], &decode), "");
        assert_eq!(st.push(&[TokenId::from(e[1])], &decode), "é");
        assert_eq!(st.push(&[300, TokenId::from(b'x')], &decode), "x");
        assert_eq!(st.tokens().len(), 4);
    }

    #[test]
    fn finish_flushes_a_dangling_byte() {
        let mut st = TextStream::default();
        st.push(&ids("ab"), &decode);
        st.push(&[0xC3], &decode);
        assert_eq!(st.text(), "ab");
        assert_eq!(st.finish(&decode), "ab\u{FFFD}");
    }

    #[test]
    fn stops_are_found_across_pushes_once() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        assert_eq!(find_stop("abcEN", 0, &stops), None);
        // "EN" was seen before; the match completes with the new "D".
        assert_eq!(find_stop("abcEND", 5, &stops), Some(3));
        assert_eq!(find_stop("a\n\nbEND", 2, &stops), Some(1));
        assert_eq!(find_stop("a\n\nbEND", 6, &stops), Some(4));
        assert_eq!(find_stop("xyz", 3, &[]), None);
        assert_eq!(find_stop("日本END", 6, &stops), Some(6));
    }

    #[test]
    fn truncate_keeps_the_stream_consistent() {
        let mut st = TextStream::default();
        for t in ids("hello STOP more") {
            st.push(&[t], &decode);
        }
        let at = find_stop(st.text(), 0, &["STOP".to_string()]).unwrap();
        st.truncate(at, 10);
        assert_eq!(st.text(), "hello ");
        assert_eq!(st.tokens().len(), 10);
        assert_eq!(st.finish(&decode), "hello ");
    }
}
