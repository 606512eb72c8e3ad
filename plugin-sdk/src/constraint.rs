//! The constraint plugin kind (structured output): a trait for the plugin, a trait for its
//! per-sequence matchers, the vocabulary type they are built over, and the glue the
//! `export_constraint!` macro wires to the generated bindings.
//!
//! A constraint plugin compiles a spec (a JSON Schema, a regex, a grammar) into a `Grammar`
//! once, then the host creates one `Matcher` per sequence over it. Masks are bitsets over the
//! model's vocabulary: bit `t % 32` of word `t / 32` set means token `t` may come next.

use crate::{PluginInfo, Settings, TokenId};

/// The tokenizer's vocabulary as the host sends it once per instance.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Vocabulary {
    /// Bytes of every tokenizer token, concatenated (see [`Vocabulary::token`]).
    pub token_bytes: Vec<u8>,
    /// End offset of each token in `token_bytes`.
    pub token_ends: Vec<u32>,
    /// Tokens that end a sequence.
    pub eos_tokens: Vec<TokenId>,
    /// Control tokens, never allowed inside constrained output.
    pub special_tokens: Vec<TokenId>,
    /// Width of the model's logits (at least the tokenizer's token count).
    pub vocab_size: u32,
}

impl Vocabulary {
    /// Builds a vocabulary from one byte string per token.
    pub fn from_tokens<B: AsRef<[u8]>>(tokens: &[B], eos: &[TokenId], vocab_size: u32) -> Self {
        let mut v = Vocabulary {
            eos_tokens: eos.to_vec(),
            vocab_size: vocab_size.max(tokens.len() as u32),
            ..Default::default()
        };
        for t in tokens {
            v.token_bytes.extend_from_slice(t.as_ref());
            v.token_ends.push(v.token_bytes.len() as u32);
        }
        v
    }

    /// Number of tokenizer tokens (may be below `vocab_size`).
    pub fn len(&self) -> usize {
        self.token_ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.token_ends.is_empty()
    }

    /// The bytes of token `id` (empty past the tokenizer's tokens or for a malformed table).
    pub fn token(&self, id: TokenId) -> &[u8] {
        let i = id as usize;
        let Some(&end) = self.token_ends.get(i) else {
            return &[];
        };
        let start = if i == 0 { 0 } else { self.token_ends[i - 1] };
        self.token_bytes
            .get(start as usize..end as usize)
            .unwrap_or(&[])
    }

    /// Words in a mask: `(vocab_size + 31) / 32`.
    pub fn mask_words(&self) -> usize {
        (self.vocab_size as usize).div_ceil(32)
    }

    /// Checks the table is well formed (ends non-decreasing and within the bytes).
    pub fn check(&self) -> Result<(), String> {
        let mut prev = 0u32;
        for (i, &e) in self.token_ends.iter().enumerate() {
            if e < prev || e as usize > self.token_bytes.len() {
                return Err(format!(
                    "vocabulary: token {i} ends at {e}, out of order or range"
                ));
            }
            prev = e;
        }
        if (self.vocab_size as usize) < self.token_ends.len() {
            return Err("vocabulary: vocab-size is below the token count".into());
        }
        Ok(())
    }
}

/// One sequence's position in a compiled constraint.
pub trait Matcher: 'static {
    /// Appends the allowed-next-token mask (`mask_words` words) to `out`. End-of-sequence
    /// tokens are set only where the output is complete.
    fn mask(&mut self, out: &mut Vec<u32>) -> Result<(), String>;
    /// Advances over `tokens`; on a token that is not allowed it fails and stays before it.
    fn consume(&mut self, tokens: &[TokenId]) -> Result<(), String>;
    /// Undoes the last `n` consumed tokens.
    fn rollback(&mut self, n: u32) -> Result<(), String>;
    /// How many leading tokens of `tokens` are allowed; the state does not change.
    fn validate(&mut self, tokens: &[TokenId]) -> u32;
    /// Tokens forced from here; the default forces none.
    fn forced(&mut self) -> Vec<TokenId> {
        Vec::new()
    }
    /// Whether the output so far is complete.
    fn is_accepting(&mut self) -> bool;
    /// Whether nothing may follow.
    fn is_finished(&mut self) -> bool;
}

/// A constraint plugin. Implement it, then call
/// [`export_constraint!`](crate::export_constraint) with the type.
pub trait Constraint: Default + 'static {
    /// A compiled spec, shared by the matchers made from it.
    type Grammar: 'static;
    type Matcher: Matcher;
    /// One line for `deepinfer plugins inspect`.
    const DESCRIPTION: &'static str = "";
    /// The spec kinds `compile` accepts ("json-schema", "regex", "lark", "choice", ...).
    const KINDS: &'static [&'static str];

    /// Applies the plugin's settings once per instance. The default accepts none.
    fn configure(&mut self, settings: &Settings) -> Result<(), String> {
        settings.reject_unknown(&[])
    }
    /// Receives the vocabulary once, before any `compile`.
    fn init(&mut self, vocab: Vocabulary) -> Result<(), String>;
    /// Compiles `spec` as `kind`; an error names the place in the spec that is wrong.
    fn compile(&mut self, kind: &str, spec: &str) -> Result<Self::Grammar, String>;
    /// A matcher at the start of `grammar`. A matcher that cannot be made reports its error
    /// from `mask`.
    fn matcher(&mut self, grammar: &Self::Grammar) -> Self::Matcher;
}

/// Exports a [`Constraint`] type as the plugin's `constraint` world. On targets other than
/// wasm32 it expands to nothing.
#[macro_export]
macro_rules! export_constraint {
    ($ty:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            use $crate::bindings::constraint::exports::deepinfer::plugin::constraint_api as api;
            use $crate::constraint::{Constraint as _, Matcher as _};
            use ::std::cell::RefCell;
            use ::std::string::String;
            use ::std::vec::Vec;

            ::std::thread_local! {
                static STATE: RefCell<::std::option::Option<$ty>> =
                    const { RefCell::new(::std::option::Option::None) };
            }

            struct Glue;
            struct G(<$ty as $crate::constraint::Constraint>::Grammar);
            struct M(RefCell<<$ty as $crate::constraint::Constraint>::Matcher>);

            impl api::GuestGrammar for G {
                fn compile(kind: String, spec: String) -> ::std::result::Result<api::Grammar, String> {
                    STATE
                        .with(|s| $crate::constraint::__glue::compile::<$ty>(s, &kind, &spec))
                        .map(|g| api::Grammar::new(G(g)))
                }
            }

            impl api::GuestMatcher for M {
                fn new(grammar: api::GrammarBorrow<'_>) -> Self {
                    let g: &G = grammar.get();
                    M(RefCell::new(STATE.with(|s| {
                        $crate::constraint::__glue::matcher::<$ty>(s, &g.0)
                    })))
                }
                fn mask(&self) -> ::std::result::Result<Vec<u32>, String> {
                    let mut out = Vec::new();
                    self.0.borrow_mut().mask(&mut out)?;
                    Ok(out)
                }
                fn consume(&self, tokens: Vec<u32>) -> ::std::result::Result<(), String> {
                    self.0.borrow_mut().consume(&tokens)
                }
                fn rollback(&self, n: u32) -> ::std::result::Result<(), String> {
                    self.0.borrow_mut().rollback(n)
                }
                fn validate(&self, tokens: Vec<u32>) -> u32 {
                    self.0.borrow_mut().validate(&tokens)
                }
                fn forced(&self) -> Vec<u32> {
                    self.0.borrow_mut().forced()
                }
                fn is_accepting(&self) -> bool {
                    self.0.borrow_mut().is_accepting()
                }
                fn is_finished(&self) -> bool {
                    self.0.borrow_mut().is_finished()
                }
            }

            impl api::Guest for Glue {
                type Grammar = G;
                type Matcher = M;
                fn manifest() -> api::ConstraintManifest {
                    let (info, kinds) = $crate::constraint::__glue::manifest::<$ty>(
                        ::core::env!("CARGO_PKG_NAME"),
                        ::core::env!("CARGO_PKG_VERSION"),
                    );
                    api::ConstraintManifest {
                        info: $crate::bindings::constraint::deepinfer::plugin::types::PluginInfo {
                            name: info.name,
                            version: info.version,
                            description: info.description,
                        },
                        kinds,
                    }
                }
                fn configure(
                    settings: Vec<(String, String)>,
                ) -> ::std::result::Result<(), String> {
                    STATE.with(|s| $crate::constraint::__glue::configure::<$ty>(s, settings))
                }
                fn init(v: api::Vocabulary) -> ::std::result::Result<(), String> {
                    let vocab = $crate::constraint::Vocabulary {
                        token_bytes: v.token_bytes,
                        token_ends: v.token_ends,
                        eos_tokens: v.eos_tokens,
                        special_tokens: v.special_tokens,
                        vocab_size: v.vocab_size,
                    };
                    STATE.with(|s| $crate::constraint::__glue::init::<$ty>(s, vocab))
                }
                fn masks(
                    matchers: Vec<api::MatcherBorrow<'_>>,
                ) -> ::std::result::Result<Vec<u32>, String> {
                    let mut out = Vec::new();
                    for m in &matchers {
                        m.get::<M>().0.borrow_mut().mask(&mut out)?;
                    }
                    Ok(out)
                }
            }

            $crate::bindings::constraint::export_world!(Glue with_types_in $crate::bindings::constraint);
        };
    };
}

/// State handling shared by the export macro's glue. Used by the macro only.
#[doc(hidden)]
pub mod __glue {
    use super::*;
    use std::cell::RefCell;

    pub fn manifest<C: Constraint>(name: &str, version: &str) -> (PluginInfo, Vec<String>) {
        let info = PluginInfo {
            name: name.to_string(),
            version: version.to_string(),
            description: C::DESCRIPTION.to_string(),
        };
        (info, C::KINDS.iter().map(|k| k.to_string()).collect())
    }

    pub fn configure<C: Constraint>(
        state: &RefCell<Option<C>>,
        settings: Vec<(String, String)>,
    ) -> Result<(), String> {
        crate::log::install_panic_hook();
        let mut c = C::default();
        c.configure(&Settings::new(settings))?;
        *state.borrow_mut() = Some(c);
        Ok(())
    }

    pub fn init<C: Constraint>(
        state: &RefCell<Option<C>>,
        vocab: Vocabulary,
    ) -> Result<(), String> {
        vocab.check()?;
        state
            .borrow_mut()
            .get_or_insert_with(C::default)
            .init(vocab)
    }

    pub fn compile<C: Constraint>(
        state: &RefCell<Option<C>>,
        kind: &str,
        spec: &str,
    ) -> Result<C::Grammar, String> {
        if !C::KINDS.contains(&kind) {
            return Err(format!(
                "unknown constraint kind `{kind}` (this plugin compiles: {})",
                C::KINDS.join(", ")
            ));
        }
        state
            .borrow_mut()
            .get_or_insert_with(C::default)
            .compile(kind, spec)
    }

    pub fn matcher<C: Constraint>(state: &RefCell<Option<C>>, grammar: &C::Grammar) -> C::Matcher {
        state
            .borrow_mut()
            .get_or_insert_with(C::default)
            .matcher(grammar)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocabulary_slices_tokens_and_checks_its_table() {
        let v = Vocabulary::from_tokens(&["a", "bc", ""], &[2], 40);
        assert_eq!(v.len(), 3);
        assert_eq!(v.token(1), b"bc");
        assert_eq!(v.token(2), b"");
        assert_eq!(v.token(9), b"");
        assert_eq!(v.mask_words(), 2);
        assert!(v.check().is_ok());
        let mut bad = v.clone();
        bad.token_ends = vec![3, 1];
        assert!(bad.check().is_err());
    }
}
