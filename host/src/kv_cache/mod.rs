//! The KV-cache manager: block pool, reference counts, prefix hashing, eviction, per-layer-group
//! layout specs and capacity from a memory budget. Plain CPU data: it hands out block ids and
//! never touches device memory, tensors or the model (the backend owns the KV arrays that the
//! block ids index).
//!
//! - [`BlockPool`]: fixed blocks, reference counts, a free list evicted least recently freed
//!   first, and the hash -> block index of the prefix cache.
//! - [`KvCacheManager`]: one block table per sequence; prefix lookup
//!   ([`find_prefix_hit`](KvCacheManager::find_prefix_hit)), slot allocation
//!   ([`allocate_slots`](KvCacheManager::allocate_slots), `None` = preempt), publication of
//!   computed blocks, fork for `n > 1` samples, rollback of rejected draft tokens.
//! - [`block_hash`]: chained hashes of full blocks, `hash(parent, tokens)`.
//! - [`KvCacheLayout`] / [`KvCacheSpec`]: what each layer group stores (full attention,
//!   sliding window, latent MLA) and the bytes per block; [`num_blocks_for_budget`] turns a
//!   configured budget into a block count once at start.

pub mod block_hash;
mod block_pool;
mod capacity;
mod free_queue;
mod manager;
mod spec;
mod stats;

pub use block_hash::{extend_block_hashes, hash_block, BlockHash};
pub use block_pool::BlockPool;
pub use capacity::{num_blocks_for_budget, KvBudget};
pub use manager::{KvCacheConfig, KvCacheManager, PrefixHit};
pub use spec::{AttentionShape, KvCacheLayout, KvCacheSpec, LayerGroup, DEFAULT_BLOCK_SIZE};
pub use stats::KvCacheStats;

use crate::ids::RequestId;

/// One sequence that owns a block table: sample `sample` of request `request` (requests with
/// `n > 1` samples have one sequence per sample).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId {
    pub request: RequestId,
    pub sample: u32,
}

impl SeqId {
    /// The first (often only) sample of a request.
    pub fn first(request: RequestId) -> SeqId {
        SeqId { request, sample: 0 }
    }
}

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.request, self.sample)
    }
}
