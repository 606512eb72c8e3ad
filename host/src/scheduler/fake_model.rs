//! A stand-in model for scheduler tests. It keeps a fake paged KV store whose slot for
//! position `p` holds a hash of the sequence's tokens `0..=p`, written through the block
//! tables the scheduler hands out; "attention" reads every earlier slot back and checks it,
//! and the next token is a function of what it read. So a wrong block table, a prefix hit on
//! the wrong content, a write into a shared block or stale KV after a rollback either trips an
//! assertion or changes the output, which tests compare against a run with no batching.

use std::collections::HashMap;

use super::output::{BlockTables, SchedulerOutput, StepOutcome};
use crate::ids::TokenId;
use crate::kv_cache::{KvCacheManager, SeqId};

const SEED: u64 = 0x5eed_1234_abcd_0042;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The hash of a prefix extended by one token.
pub(super) fn mix(prev: u64, token: TokenId) -> u64 {
    splitmix(prev ^ (u64::from(token) << 17) ^ 0x1f)
}

/// `chain[p]` names tokens `0..=p`.
pub(super) fn chain(tokens: &[TokenId]) -> Vec<u64> {
    let mut h = SEED;
    tokens
        .iter()
        .map(|&t| {
            h = mix(h, t);
            h
        })
        .collect()
}

/// The "model": the token after a prefix, for one sample of a request.
pub(super) fn next_token(prefix_hash: u64, sample: u32, vocab: u32) -> TokenId {
    (splitmix(prefix_hash ^ u64::from(sample).wrapping_mul(0x1234_5678_9abc)) % u64::from(vocab))
        as TokenId
}

/// The true continuation of `history` for `k` tokens: what a perfect drafter proposes.
pub(super) fn continuation(history: &[TokenId], sample: u32, vocab: u32, k: usize) -> Vec<TokenId> {
    let mut h = chain(history).last().copied().unwrap_or(SEED);
    let mut out = Vec::with_capacity(k);
    for _ in 0..k {
        let t = next_token(h, sample, vocab);
        out.push(t);
        h = mix(h, t);
    }
    out
}

/// The runtime side of the tests: applies scheduler outputs to a fake KV store.
pub(super) struct FakeModel {
    block_size: usize,
    vocab: u32,
    slots: Vec<Option<u64>>,
    tables: BlockTables,
    /// The runtime's copy of each sequence's tokens.
    pub histories: HashMap<SeqId, Vec<TokenId>>,
    pub tokens_run: usize,
}

impl FakeModel {
    pub fn new(num_blocks: usize, block_size: usize, vocab: u32) -> FakeModel {
        FakeModel {
            block_size,
            vocab,
            slots: vec![None; num_blocks * block_size],
            tables: BlockTables::default(),
            histories: HashMap::new(),
            tokens_run: 0,
        }
    }

    /// Runs one step; returns each entry's accepted tokens (empty when not sampled).
    pub fn run(&mut self, out: &SchedulerOutput, kv: &KvCacheManager) -> Vec<Vec<TokenId>> {
        self.tables.apply(out);
        for s in out.preempted.iter().chain(&out.finished) {
            self.histories.remove(s);
        }
        let bs = self.block_size;
        let mut results = Vec::with_capacity(out.seqs.len());
        for e in &out.seqs {
            if let Some(n) = &e.new_seq {
                self.histories.insert(e.seq, n.token_ids.clone());
            }
            let hist = self
                .histories
                .get(&e.seq)
                .expect("runtime never saw this sequence");
            let d = e.num_draft_tokens;
            let real = e.token_ids.len() - d;
            let start = e.num_computed_tokens;
            assert_eq!(
                &e.token_ids[..real],
                &hist[start..start + real],
                "{}: wrong tokens",
                e.seq
            );
            let mut tokens = hist[..start + real].to_vec();
            tokens.extend_from_slice(&e.token_ids[real..]);
            let expected = chain(&tokens);
            let table = self.tables.get(e.seq);
            assert_eq!(
                table,
                kv.block_table(e.seq),
                "{}: mirrored block table diverged",
                e.seq
            );
            assert!(
                table.len() * bs >= tokens.len(),
                "{}: too few blocks",
                e.seq
            );
            for p in e.positions() {
                let b = table[p / bs];
                assert_eq!(
                    kv.pool().ref_count(b),
                    1,
                    "{}: writes into shared block {}",
                    e.seq,
                    b.0
                );
                self.slots[b.0 as usize * bs + p % bs] = Some(expected[p]);
            }
            self.tokens_run += e.token_ids.len();
            // Attention: read the whole context back.
            let read = |p: usize| self.slots[table[p / bs].0 as usize * bs + p % bs];
            for (p, want) in expected.iter().enumerate() {
                assert_eq!(
                    read(p),
                    Some(*want),
                    "{}: position {p} reads wrong KV",
                    e.seq
                );
            }
            let mut accepted = Vec::new();
            if e.wants_sample {
                for i in 0..=d {
                    let pos = start + real - 1 + i;
                    let t = next_token(read(pos).unwrap_or(0), e.seq.sample, self.vocab);
                    accepted.push(t);
                    if i == d || e.token_ids[real + i] != t {
                        break;
                    }
                }
            }
            results.push(accepted);
        }
        results
    }

    /// Mirrors the tokens the scheduler accepted.
    pub fn observe(&mut self, outcome: &StepOutcome) {
        for u in &outcome.updates {
            if let Some(h) = self.histories.get_mut(&u.seq) {
                h.extend_from_slice(&u.new_tokens);
            }
        }
    }
}
