//! The KV-cache manager: one block table per sequence over a shared [`BlockPool`], prefix-cache
//! lookup and publication, slot allocation, forking and rollback. It speaks in token counts and
//! block ids and never sees tokens' values, devices or tensors.
//!
//! Rules that keep shared blocks safe: a sequence only writes KV at positions at or beyond its
//! computed count, and those always lie in blocks it holds alone. Prefix hits and forks share
//! full blocks only; a block is published under its hash only after its KV was computed
//! ([`KvCacheManager::cache_full_blocks`], called once a step has run); and a rollback that
//! would write into a shared or published block first gives that block up.

use std::collections::HashMap;

use super::block_hash::BlockHash;
use super::block_pool::BlockPool;
use super::stats::KvCacheStats;
use super::SeqId;
use crate::error::{Error, Result};
use crate::ids::BlockId;

/// Sizes and switches of the manager, fixed at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    pub enable_prefix_caching: bool,
}

/// Cached full blocks that start a sequence, found by [`KvCacheManager::find_prefix_hit`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixHit {
    pub blocks: Vec<BlockId>,
    /// Tokens those blocks hold (`blocks.len() * block_size`).
    pub num_tokens: usize,
}

#[derive(Debug, Clone, Default)]
struct SeqBlocks {
    blocks: Vec<BlockId>,
    /// Leading blocks already published or found published (no need to look at them again).
    num_published: usize,
}

/// Block tables of all live sequences over one block pool.
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    config: KvCacheConfig,
    pool: BlockPool,
    tables: HashMap<SeqId, SeqBlocks>,
    queried_tokens: u64,
    hit_tokens: u64,
}

impl KvCacheManager {
    pub fn new(config: KvCacheConfig) -> Result<KvCacheManager> {
        if config.block_size == 0 || config.num_blocks == 0 {
            return Err(Error::BadConfig(
                "KV cache needs block_size >= 1 and num_blocks >= 1".into(),
            ));
        }
        let n = u32::try_from(config.num_blocks)
            .ok()
            .filter(|&n| n < u32::MAX)
            .ok_or_else(|| {
                Error::BadConfig(format!("{} KV blocks is too many", config.num_blocks))
            })?;
        Ok(KvCacheManager {
            config,
            pool: BlockPool::new(n),
            tables: HashMap::new(),
            queried_tokens: 0,
            hit_tokens: 0,
        })
    }

    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.config.num_blocks
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.config.block_size)
    }

    /// The pool, read-only (reference counts, free order, hashes).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// A sequence's block table: block `i` holds positions `i * block_size ..`.
    pub fn block_table(&self, seq: SeqId) -> &[BlockId] {
        self.tables
            .get(&seq)
            .map(|t| t.blocks.as_slice())
            .unwrap_or(&[])
    }

    /// The longest run of cached blocks that starts `block_hashes`, for a sequence of
    /// `num_tokens` tokens. At least one token is always left to compute, since the model must
    /// produce logits for the last one. Takes no reference; pass the hit to
    /// [`allocate_slots`](Self::allocate_slots) at once.
    pub fn find_prefix_hit(&self, block_hashes: &[BlockHash], num_tokens: usize) -> PrefixHit {
        if !self.config.enable_prefix_caching {
            return PrefixHit::default();
        }
        let max_blocks = num_tokens.saturating_sub(1) / self.config.block_size;
        let blocks: Vec<BlockId> = block_hashes
            .iter()
            .take(max_blocks)
            .map_while(|h| self.pool.lookup(*h))
            .collect();
        PrefixHit {
            num_tokens: blocks.len() * self.config.block_size,
            blocks,
        }
    }

    /// Makes room for `num_new_tokens` more tokens after `num_computed_tokens` (plus the
    /// tokens of `hit`, which must come with a sequence that holds nothing yet). Returns the
    /// number of blocks taken from the free list, or `None`, changing nothing, when too few
    /// are free: the caller should preempt someone.
    pub fn allocate_slots(
        &mut self,
        seq: SeqId,
        num_computed_tokens: usize,
        num_new_tokens: usize,
        hit: &PrefixHit,
    ) -> Option<usize> {
        let have = self.tables.get(&seq).map_or(0, |t| t.blocks.len());
        debug_assert!(hit.blocks.is_empty() || (have == 0 && num_computed_tokens == 0));
        let total = num_computed_tokens + hit.num_tokens + num_new_tokens;
        let need = self
            .blocks_for(total)
            .saturating_sub(have + hit.blocks.len());
        let revived = hit
            .blocks
            .iter()
            .filter(|&&b| self.pool.ref_count(b) == 0)
            .count();
        if need > self.pool.num_free() - revived {
            return None;
        }
        self.pool.touch(&hit.blocks);
        let new = self.pool.allocate(need)?;
        let table = self.tables.entry(seq).or_default();
        table.blocks.extend_from_slice(&hit.blocks);
        table.num_published = table.num_published.max(hit.blocks.len());
        table.blocks.extend(new);
        Some(need)
    }

    /// Publishes the sequence's full blocks among its first `num_computed_tokens` tokens under
    /// `block_hashes` (the sequence's chained hashes), so later prompts can reuse them. Call it
    /// only for tokens whose KV the model has written.
    pub fn cache_full_blocks(
        &mut self,
        seq: SeqId,
        block_hashes: &[BlockHash],
        num_computed_tokens: usize,
    ) {
        if !self.config.enable_prefix_caching {
            return;
        }
        let Some(table) = self.tables.get_mut(&seq) else {
            return;
        };
        let full = (num_computed_tokens / self.config.block_size)
            .min(block_hashes.len())
            .min(table.blocks.len());
        let start = table.num_published.min(full);
        for (&block, &hash) in table.blocks[start..full]
            .iter()
            .zip(&block_hashes[start..full])
        {
            // A block whose content another block already publishes stays private.
            self.pool.register(block, hash);
        }
        table.num_published = table.num_published.max(full);
    }

    /// Gives `child` the parent's full blocks among its first `num_tokens` tokens (each gains
    /// a holder) and returns how many tokens they hold: the child's computed count. The
    /// child must hold nothing yet; a partial last block is never shared.
    pub fn fork(&mut self, parent: SeqId, child: SeqId, num_tokens: usize) -> usize {
        let n = num_tokens / self.config.block_size;
        let shared: Vec<BlockId> = self.block_table(parent).iter().take(n).copied().collect();
        debug_assert!(self.block_table(child).is_empty());
        self.pool.touch(&shared);
        let num_published = shared.len();
        let tokens = shared.len() * self.config.block_size;
        self.tables.insert(
            child,
            SeqBlocks {
                blocks: shared,
                num_published,
            },
        );
        tokens
    }

    /// Keeps the KV of the first `num_tokens` tokens and releases whole blocks past them
    /// (rejected draft tokens). Returns how many tokens stay valid: fewer than asked when the
    /// last kept block is shared, since writing into it would corrupt another sequence; the
    /// caller recomputes the difference.
    pub fn rollback(&mut self, seq: SeqId, num_tokens: usize) -> usize {
        let bs = self.config.block_size;
        let Some(table) = self.tables.get_mut(&seq) else {
            return 0;
        };
        let keep = num_tokens.div_ceil(bs).min(table.blocks.len());
        let mut valid = num_tokens.min(keep * bs);
        let dropped: Vec<BlockId> = table.blocks.drain(keep..).rev().collect();
        self.pool.release(dropped);
        if !valid.is_multiple_of(bs) {
            if let Some(&last) = table.blocks.last() {
                if self.pool.ref_count(last) > 1 {
                    table.blocks.pop();
                    self.pool.release([last]);
                    valid = table.blocks.len() * bs;
                } else {
                    self.pool.unregister(last);
                }
            }
        }
        table.num_published = table.num_published.min(valid / bs);
        valid
    }

    /// Releases every block of the sequence (tail first, so its tail is evicted first); cached
    /// blocks keep their hashes for later hits.
    pub fn free(&mut self, seq: SeqId) {
        if let Some(t) = self.tables.remove(&seq) {
            self.pool.release(t.blocks.into_iter().rev());
        }
    }

    /// Counts a prefix lookup of `queried` tokens of which `hit` were cached.
    pub fn record_prefix_lookup(&mut self, queried: usize, hit: usize) {
        self.queried_tokens += queried as u64;
        self.hit_tokens += hit as u64;
    }

    pub fn stats(&self) -> KvCacheStats {
        KvCacheStats {
            num_blocks: self.pool.num_blocks(),
            blocks_used: self.pool.num_blocks() - self.pool.num_free(),
            blocks_free: self.pool.num_free(),
            blocks_cached: self.pool.num_cached(),
            prefix_queried_tokens: self.queried_tokens,
            prefix_hit_tokens: self.hit_tokens,
            evictions: self.pool.evictions(),
        }
    }

    /// Checks the pool, and that each block's reference count equals the number of block
    /// tables that hold it, none twice.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let mut holders = vec![0u32; self.pool.num_blocks()];
        for (seq, t) in &self.tables {
            let mut sorted = t.blocks.clone();
            sorted.sort();
            if sorted.windows(2).any(|w| w[0] == w[1]) {
                return Err(format!("{seq} holds a block twice"));
            }
            for b in &t.blocks {
                holders[b.0 as usize] += 1;
            }
        }
        for (i, &n) in holders.iter().enumerate() {
            let rc = self.pool.ref_count(BlockId(i as u32));
            if rc != n {
                return Err(format!("block {i}: ref_count {rc} but {n} holders"));
            }
        }
        Ok(())
    }

    /// Live sequences that hold a block table.
    pub fn num_sequences(&self) -> usize {
        self.tables.len()
    }
}

#[cfg(test)]
#[path = "manager_tests.rs"]
mod tests;
