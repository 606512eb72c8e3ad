//! A test-only sampler that misbehaves on purpose when a row's seed asks it to, so the host's
//! isolation can be tested row by row. Any other seed gets the first candidate.

use deepinfer_plugin_sdk::sampler::{Row, Sampler};
use deepinfer_plugin_sdk::TokenId;
use std::hint::black_box;

pub const LOOP: u64 = 1001;
pub const GROW: u64 = 1002;
pub const PANIC: u64 = 1003;
pub const OUT_OF_VOCAB: u64 = 1004;
pub const NOT_A_CANDIDATE: u64 = 1005;
pub const WRONG_COUNT: u64 = 1006;
pub const DEEP_RECURSION: u64 = 1007;
pub const ROW_ERROR: u64 = 1008;

#[derive(Debug, Default)]
pub struct Hostile;

#[allow(unconditional_recursion)]
fn recurse(n: u64) -> u64 {
    black_box(recurse(black_box(n + 1)) + 1)
}

impl Sampler for Hostile {
    const DESCRIPTION: &'static str = "misbehaves on seeds 1001..=1008 (tests only)";
    const TOP_K: u32 = 4;

    fn sample(&mut self, row: &Row<'_>) -> Result<TokenId, String> {
        match row.seed {
            LOOP => {
                let mut i = 0u64;
                loop {
                    i = black_box(i.wrapping_add(1));
                }
            }
            GROW => {
                let mut hoard = Vec::new();
                loop {
                    hoard.push(vec![1u8; 1 << 20]);
                    black_box(&hoard);
                }
            }
            PANIC => panic!("hostile plugin panics on purpose"),
            OUT_OF_VOCAB => Ok(row.vocab_size + 7),
            NOT_A_CANDIDATE => (0..row.vocab_size)
                .find(|t| row.candidates.iter().all(|c| c.id != *t))
                .ok_or_else(|| "every token is a candidate".to_string()),
            DEEP_RECURSION => Ok(recurse(0) as TokenId),
            ROW_ERROR => Err("hostile plugin refuses this row".into()),
            _ => row
                .candidates
                .first()
                .map(|c| c.id)
                .ok_or_else(|| "no candidates".into()),
        }
    }

    fn sample_batch(&mut self, rows: &[Row<'_>]) -> Vec<Result<TokenId, String>> {
        let mut out: Vec<_> = rows.iter().map(|r| self.sample(r)).collect();
        if rows.iter().any(|r| r.seed == WRONG_COUNT) {
            out.pop();
        }
        out
    }
}

deepinfer_plugin_sdk::export_sampler!(Hostile);
