//! The flattened batch a forward pass runs: every scheduled token of every sequence in one
//! list, each sequence with its slice, its block table and how many of its tokens are cached.
//! Prefill, chunked prefill and decode are all "this sequence runs N tokens this step".

use crate::ids::TokenId;

/// One sequence's part of a [`Batch`].
#[derive(Debug, Clone, PartialEq)]
pub struct SeqSlice {
    /// Index of this sequence's first token in [`Batch::tokens`].
    pub start: usize,
    /// Tokens this sequence runs this step.
    pub len: usize,
    /// Position of its first token this step (= tokens already in its KV cache).
    pub pos: usize,
    /// Physical KV block of each logical block, covering at least `pos + len` tokens.
    pub block_table: Vec<u32>,
}

impl SeqSlice {
    /// Tokens in the cache once this step has run.
    pub fn context_len(&self) -> usize {
        self.pos + self.len
    }
}

/// A forward pass's input.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    pub tokens: Vec<TokenId>,
    pub seqs: Vec<SeqSlice>,
    /// Indices into `tokens` whose logits are wanted (usually each sequence's last token).
    pub logits_for: Vec<usize>,
}

impl Batch {
    /// Appends a sequence's tokens; `want_logits` asks for the logits of its last token.
    pub fn push(
        &mut self,
        tokens: &[TokenId],
        pos: usize,
        block_table: Vec<u32>,
        want_logits: bool,
    ) {
        let start = self.tokens.len();
        self.tokens.extend_from_slice(tokens);
        if want_logits && !tokens.is_empty() {
            self.logits_for.push(start + tokens.len() - 1);
        }
        self.seqs.push(SeqSlice {
            start,
            len: tokens.len(),
            pos,
            block_table,
        });
    }

    /// Position of every token, in `tokens` order.
    pub fn positions(&self) -> Vec<u32> {
        let mut p = vec![0u32; self.tokens.len()];
        for s in &self.seqs {
            for i in 0..s.len {
                p[s.start + i] = (s.pos + i) as u32;
            }
        }
        p
    }

    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }
}
