//! The `grammar` constraint plugin: structured output through llguidance compiled into the
//! plugin. It compiles JSON Schema, regular expressions, Lark-style EBNF and fixed choices into
//! llguidance parsers over the host's vocabulary, and answers masks from them. It owns spec
//! translation and option defaults; it must not know anything about the model or the host.

use std::sync::Arc;

use deepinfer_plugin_sdk::constraint::{Constraint, Matcher, Vocabulary};
use deepinfer_plugin_sdk::{Settings, TokenId};
use llguidance::api::TopLevelGrammar;
use llguidance::{ParserFactory, TokenParser};
use toktrie::{ApproximateTokEnv, InferenceCapabilities, TokEnv, TokRxInfo, TokTrie};

mod spec;

pub use spec::{choice_regex, json_schema_grammar};

/// Setting: ignore JSON Schema keywords llguidance does not implement instead of refusing.
const LENIENT: &str = "lenient";
/// Setting: JSON output may carry free whitespace between tokens (default: compact).
const FLEXIBLE_WHITESPACE: &str = "flexible-whitespace";

/// The plugin's per-instance state: the parser factory over the vocabulary.
#[derive(Default)]
pub struct GrammarPlugin {
    options: spec::Options,
    factory: Option<Arc<ParserFactory>>,
    /// Every end-of-sequence token, set in a mask wherever llguidance allows its one EOS.
    eos: Vec<TokenId>,
    words: usize,
}

/// A compiled spec: a parser at its start, cloned for every matcher.
pub struct Grammar {
    parser: TokenParser,
}

/// One sequence's matcher.
pub struct GrammarMatcher {
    inner: llguidance::Matcher,
    eos: Vec<TokenId>,
    words: usize,
}

impl GrammarPlugin {
    /// The plugin ready for `compile` (native use: tests and benchmarks).
    pub fn with_vocabulary(vocab: Vocabulary) -> Result<Self, String> {
        let mut p = GrammarPlugin::default();
        p.init(vocab)?;
        Ok(p)
    }
}

impl Constraint for GrammarPlugin {
    type Grammar = Grammar;
    type Matcher = GrammarMatcher;
    const DESCRIPTION: &'static str = "JSON Schema, regex, Lark EBNF and choices (llguidance)";
    const KINDS: &'static [&'static str] = &["json-schema", "regex", "lark", "choice"];

    fn configure(&mut self, settings: &Settings) -> Result<(), String> {
        settings.reject_unknown(&[LENIENT, FLEXIBLE_WHITESPACE])?;
        self.options.lenient = settings.parse_or(LENIENT, false)?;
        self.options.flexible_whitespace = settings.parse_or(FLEXIBLE_WHITESPACE, false)?;
        Ok(())
    }

    fn init(&mut self, vocab: Vocabulary) -> Result<(), String> {
        let eos = *vocab
            .eos_tokens
            .first()
            .ok_or("vocabulary: no end-of-sequence token")?;
        let size = vocab.vocab_size;
        // Special tokens get llguidance's marker byte so no grammar text can produce them;
        // padding past the tokenizer's tokens stays empty (never allowed).
        let mut words: Vec<Vec<u8>> = (0..size).map(|t| vocab.token(t).to_vec()).collect();
        for &t in vocab.special_tokens.iter().chain(&vocab.eos_tokens) {
            if let Some(w) = words.get_mut(t as usize) {
                let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                marked.extend_from_slice(if w.is_empty() { b"<special>" } else { w });
                *w = marked;
            }
        }
        let info = TokRxInfo::new(size, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities {
                // The vocabulary comes without its merge rules, so llguidance cannot
                // tokenize canonically; `forced` tokenizes the forced bytes greedily instead.
                ff_tokens: false,
                backtrack: false,
                conditional_ff_tokens: false,
                fork: false,
            },
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| format!("building the token trie: {e}"))?;
        factory.quiet();
        self.factory = Some(Arc::new(factory));
        self.eos = vocab.eos_tokens.clone();
        self.words = vocab.mask_words();
        Ok(())
    }

    fn compile(&mut self, kind: &str, spec: &str) -> Result<Grammar, String> {
        let factory = self
            .factory
            .as_ref()
            .ok_or("the host compiled a grammar before `init`")?;
        let grammar: TopLevelGrammar = match kind {
            "json-schema" => json_schema_grammar(spec, &self.options)?,
            "regex" => TopLevelGrammar::from_regex(spec),
            "lark" => TopLevelGrammar::from_lark(spec.to_string()),
            "choice" => TopLevelGrammar::from_regex(&choice_regex(spec)?),
            other => return Err(format!("unknown constraint kind `{other}`")),
        };
        let parser = factory
            .create_parser(grammar)
            .map_err(|e| format!("{kind}: {e}"))?;
        Ok(Grammar { parser })
    }

    fn matcher(&mut self, grammar: &Grammar) -> GrammarMatcher {
        GrammarMatcher {
            inner: llguidance::Matcher::new(Ok(grammar.parser.deep_clone())),
            eos: self.eos.clone(),
            words: self.words,
        }
    }
}

impl Matcher for GrammarMatcher {
    fn mask(&mut self, out: &mut Vec<u32>) -> Result<(), String> {
        let vob = self
            .inner
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        let words = vob.as_slice();
        let start = out.len();
        out.extend(words.iter().take(self.words));
        out.resize(start + self.words, 0);
        let mask = &mut out[start..];
        let any_eos = self.eos.iter().any(|&t| vob.is_allowed(t));
        for &t in &self.eos {
            if let Some(w) = mask.get_mut(t as usize / 32) {
                if any_eos {
                    *w |= 1 << (t % 32);
                } else {
                    *w &= !(1 << (t % 32));
                }
            }
        }
        Ok(())
    }

    fn consume(&mut self, tokens: &[TokenId]) -> Result<(), String> {
        // Validate first: llguidance's matcher is unusable after a refused token.
        let ok = self.validate(tokens) as usize;
        let ok_tokens: Vec<TokenId> = tokens[..ok].iter().map(|&t| self.canon(t)).collect();
        self.inner
            .consume_tokens(&ok_tokens)
            .map_err(|e| e.to_string())?;
        match tokens.get(ok) {
            None => Ok(()),
            Some(t) => Err(format!(
                "token {t} is not allowed here (after {ok} of {})",
                tokens.len()
            )),
        }
    }

    fn rollback(&mut self, n: u32) -> Result<(), String> {
        self.inner.rollback(n as usize).map_err(|e| e.to_string())
    }

    fn validate(&mut self, tokens: &[TokenId]) -> u32 {
        let canon: Vec<TokenId> = tokens.iter().map(|&t| self.canon(t)).collect();
        self.inner.validate_tokens(&canon).unwrap_or(0) as u32
    }

    fn forced(&mut self) -> Vec<TokenId> {
        if self.inner.is_error() {
            return Vec::new();
        }
        let bytes = self.inner.compute_ff_bytes();
        let Ok(env) = self.inner.tok_env() else {
            return Vec::new();
        };
        let mut tokens = env.tok_trie().greedy_tokenize(&bytes);
        // Greedy pieces may cross a lexeme boundary the grammar does not allow: keep the
        // allowed prefix, and drop the last token, which a longer one might replace.
        let ok = self.validate(&tokens) as usize;
        tokens.truncate(ok.saturating_sub(1));
        tokens
    }

    fn is_accepting(&mut self) -> bool {
        self.inner.is_accepting().unwrap_or(false)
    }

    fn is_finished(&mut self) -> bool {
        self.inner.is_stopped()
    }
}

impl GrammarMatcher {
    /// Any end-of-sequence token as the one llguidance knows.
    fn canon(&self, t: TokenId) -> TokenId {
        if self.eos.len() > 1 && self.eos[1..].contains(&t) {
            self.eos[0]
        } else {
            t
        }
    }
}

deepinfer_plugin_sdk::export_constraint!(GrammarPlugin);

/// The sandbox has no entropy source; hash seeds need none (getrandom's custom backend).
#[cfg(target_arch = "wasm32")]
#[no_mangle]
unsafe extern "Rust" fn __getrandom_v03_custom(
    dest: *mut u8,
    len: usize,
) -> Result<(), getrandom::Error> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in 0..len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // SAFETY: getrandom passes a writable buffer of `len` bytes.
        unsafe { dest.add(i).write(x as u8) };
    }
    Ok(())
}

#[cfg(test)]
mod tests;
