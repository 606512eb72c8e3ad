//! Tokenizers through the `tokenizers` crate: loaded from `tokenizer.json`, or rebuilt from a
//! GGUF file's vocabulary and merges with the pre-tokenizer that `tokenizer.ggml.pre` names.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::gguf::GgufFile;
use crate::error::{Error, Result};
use crate::ids::TokenId;

/// GGUF token type of control tokens (matched as special tokens).
const TOKEN_TYPE_CONTROL: i64 = 3;

/// Llama-3's split pattern (`tokenizer.ggml.pre = llama-bpe`); Qwen2 uses the same with single
/// digits.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A text tokenizer with the model's special ids.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos: Option<TokenId>,
    pub eos: Vec<TokenId>,
    pub add_bos: bool,
    vocab_size: usize,
    /// Token strings are GPT-2 byte-level (each byte written as one printable char).
    byte_level: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Loads `tokenizer.json` (HF format). Special ids are given by the caller (from the
    /// model's config files).
    pub fn from_file(
        path: &Path,
        bos: Option<TokenId>,
        eos: Vec<TokenId>,
        add_bos: bool,
    ) -> Result<Tokenizer> {
        let bytes = crate::files::read_bounded(path, crate::files::ASSET_MAX)
            .map_err(|e| Error::io(path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let vocab_size = inner.get_vocab_size(true);
        let byte_level = matches!(
            inner.get_decoder(),
            Some(tokenizers::decoders::DecoderWrapper::ByteLevel(_))
        );
        Ok(Tokenizer {
            inner,
            bos,
            eos,
            add_bos,
            vocab_size,
            byte_level,
        })
    }

    /// Rebuilds the tokenizer stored in a GGUF file's metadata.
    pub fn from_gguf(g: &GgufFile) -> Result<Tokenizer> {
        let model = g.str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(Error::Tokenizer(format!(
                "tokenizer.ggml.model = `{model}` is not supported yet (byte-level BPE `gpt2` is); \
                 pass the model as an HF folder with tokenizer.json instead"
            )));
        }
        let tokens = g.str_array("tokenizer.ggml.tokens")?;
        let merges = g.str_array("tokenizer.ggml.merges")?;
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| Error::Tokenizer(format!("merge `{m}` has no space")))
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(tok_err)?;
        let pre = g
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let pre_tok = pre_tokenizer_for(pre)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tok));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let types = g
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.as_array());
        if let Some(types) = types {
            let special: Vec<AddedToken> = types
                .iter()
                .enumerate()
                .filter(|(_, t)| t.as_i64() == Some(TOKEN_TYPE_CONTROL))
                .filter_map(|(i, _)| tokens.get(i))
                .map(|t| AddedToken::from(t.to_string(), true))
                .collect();
            inner.add_special_tokens(&special);
        }
        let id = |k: &str| g.u64_opt(k).map(|v| v.map(|v| v as TokenId));
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let add_bos = g
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        Ok(Tokenizer {
            inner,
            bos,
            eos: eos.into_iter().collect(),
            add_bos,
            vocab_size: tokens.len(),
            byte_level: true,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Encodes text; control tokens written in the text are matched as special tokens. Adds BOS
    /// when the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<TokenId>> {
        let enc = self.inner.encode_fast(text, false).map_err(tok_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            if let Some(b) = self.bos {
                if enc.get_ids().first() != Some(&b) {
                    ids.push(b);
                }
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes ids to text, dropping special tokens.
    pub fn decode(&self, ids: &[TokenId]) -> Result<String> {
        self.inner.decode(ids, true).map_err(tok_err)
    }

    /// The token's text form (its vocabulary entry), for diagnostics.
    pub fn token_str(&self, id: TokenId) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The raw bytes each token stands for, for constraint plugins that match bytes. A
    /// byte-level BPE token (GPT-2 style) is mapped back char by char through the byte-to-unicode
    /// table, so a token that holds half of a UTF-8 character gives exactly its bytes (decoding
    /// it as text would give U+FFFD). A SentencePiece-style token maps `<0xHH>` to its byte and
    /// `▁` to a space. Unknown ids give no bytes.
    pub fn token_bytes(&self, id: TokenId) -> Vec<u8> {
        let Some(s) = self.inner.id_to_token(id) else {
            return Vec::new();
        };
        if self.byte_level {
            if let Some(b) = byte_level_bytes(&s) {
                return b;
            }
        }
        if let Some(b) = byte_fallback(&s) {
            return vec![b];
        }
        s.replace('\u{2581}', " ").into_bytes()
    }

    /// Writes the tokenizer as an HF `tokenizer.json`.
    pub fn save_json(&self, path: &Path) -> Result<()> {
        self.inner
            .save(path, false)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))
    }

    /// Ids of the special (control) tokens, ascending.
    pub fn special_ids(&self) -> Vec<TokenId> {
        let mut ids: Vec<TokenId> = (self.inner.get_added_tokens_decoder().iter())
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }

    pub fn is_eos(&self, id: TokenId) -> bool {
        self.eos.contains(&id)
    }
}

/// GPT-2's byte-to-unicode table inverted: the byte each printable char of a byte-level token
/// stands for. Bytes that are printable Latin-1 stand for themselves; the others (controls,
/// space, 0x7F-0xA0, 0xAD) were shifted to U+0100 upwards in byte order.
fn byte_level_bytes(token: &str) -> Option<Vec<u8>> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    token
        .chars()
        .map(|c| {
            let c = c as u32;
            if c < 256 && printable(c as u8) {
                return Some(c as u8);
            }
            let k = c.checked_sub(256)?;
            (0..=255u8).filter(|&b| !printable(b)).nth(k as usize)
        })
        .collect()
}

/// A SentencePiece byte-fallback token `<0xHH>`.
fn byte_fallback(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2)
        .then(|| u8::from_str_radix(hex, 16).ok())
        .flatten()
}

fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper> {
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        Ok(Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tok_err)?
        .into())
    };
    let byte_level_re = |use_regex| ByteLevel::new(false, true, use_regex).into();
    Ok(match pre {
        // GPT-2's pattern inside ByteLevel; SmolLM2 first splits every digit on its own.
        "default" | "gpt2" | "gpt-2" => byte_level_re(true),
        "smollm" | "starcoder" | "refact" => Sequence::new(vec![
            Digits::new(true).into(),
            byte_level_re(true),
        ])
        .into(),
        "llama-bpe" | "llama3" => Sequence::new(vec![split(LLAMA3_SPLIT)?, byte_level_re(false)]).into(),
        "qwen2" => Sequence::new(vec![split(QWEN2_SPLIT)?, byte_level_re(false)]).into(),
        other => {
            return Err(Error::Tokenizer(format!(
                "pre-tokenizer `{other}` (tokenizer.ggml.pre) is not supported; supported: default, gpt2, smollm, starcoder, llama-bpe, qwen2"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_tokens_give_their_true_bytes() {
        assert_eq!(byte_level_bytes("Ġhello").unwrap(), b" hello");
        assert_eq!(byte_level_bytes("ĊĉĠ").unwrap(), b"\n\t ");
        // "é" is C3 A9; byte-level BPE writes it as "Ã©", and a token may hold only "Ã".
        assert_eq!(byte_level_bytes("Ã©").unwrap(), "é".as_bytes());
        assert_eq!(byte_level_bytes("Ã").unwrap(), [0xC3]);
        assert_eq!(byte_level_bytes("ÿ").unwrap(), [0xFF]);
        assert_eq!(byte_level_bytes("ġ").unwrap(), [0x7F]);
        assert_eq!(byte_level_bytes("Ń").unwrap(), [0xAD]);
        assert_eq!(byte_level_bytes("日"), None);
        // Every byte has exactly one char, and the table is a bijection.
        let mut seen = std::collections::HashSet::new();
        for c in (33u32..127).chain(161..173).chain(174..256).chain(256..324) {
            let b = byte_level_bytes(&char::from_u32(c).unwrap().to_string()).unwrap();
            assert_eq!(b.len(), 1);
            assert!(seen.insert(b[0]), "char U+{c:04X}");
        }
        assert_eq!(seen.len(), 256);
    }

    #[test]
    fn sentencepiece_byte_tokens() {
        assert_eq!(byte_fallback("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_fallback("<0xE3>"), Some(0xE3));
        assert_eq!(byte_fallback("<0xZZ>"), None);
        assert_eq!(byte_fallback("<0x0>"), None);
    }
}
