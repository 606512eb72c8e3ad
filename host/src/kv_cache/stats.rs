//! Counters of the KV cache: block usage and prefix-cache effectiveness. Plain numbers for the
//! CLI summary and the benchmark; nothing here changes the cache.

/// A snapshot of the KV cache's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvCacheStats {
    pub num_blocks: usize,
    /// Blocks held by at least one sequence.
    pub blocks_used: usize,
    /// Blocks no sequence holds (some of them still cached).
    pub blocks_free: usize,
    /// Blocks that carry a content hash (held or free).
    pub blocks_cached: usize,
    /// Prompt tokens looked up in the prefix cache on admission.
    pub prefix_queried_tokens: u64,
    /// Of those, tokens whose KV was found cached and not recomputed.
    pub prefix_hit_tokens: u64,
    /// Cached blocks reused for other content.
    pub evictions: u64,
}

impl KvCacheStats {
    /// Prefix hit tokens / queried tokens, 0 when nothing was queried.
    pub fn prefix_hit_rate(&self) -> f64 {
        if self.prefix_queried_tokens == 0 {
            0.0
        } else {
            self.prefix_hit_tokens as f64 / self.prefix_queried_tokens as f64
        }
    }

    /// Fraction of blocks held by sequences.
    pub fn usage(&self) -> f64 {
        if self.num_blocks == 0 {
            0.0
        } else {
            self.blocks_used as f64 / self.num_blocks as f64
        }
    }
}
