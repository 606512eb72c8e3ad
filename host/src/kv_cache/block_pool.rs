//! The block pool: a fixed set of KV blocks with reference counts, a free list evicted in LRU
//! order, and the map from content hash to cached block. It knows nothing of requests; the
//! manager decides who holds which block.
//!
//! A block is *free* when no sequence holds it (reference count 0). A free block may still be
//! *cached*: it keeps its hash, and a later prefix hit revives it, until the pool hands it out
//! for other content (eviction). Freed cached blocks join the back of the free list, so the
//! least recently released one is evicted first; freed blocks without a hash join the front,
//! since nothing is lost by reusing them.

use std::collections::HashMap;

use super::block_hash::BlockHash;
use super::free_queue::FreeQueue;
use crate::ids::BlockId;

/// Reference-counted KV blocks and the prefix-cache index over them.
#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_counts: Vec<u32>,
    hashes: Vec<Option<BlockHash>>,
    free: FreeQueue,
    cached: HashMap<BlockHash, BlockId>,
    evictions: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` free, uncached blocks.
    pub fn new(num_blocks: u32) -> BlockPool {
        BlockPool {
            ref_counts: vec![0; num_blocks as usize],
            hashes: vec![None; num_blocks as usize],
            free: FreeQueue::full(num_blocks),
            cached: HashMap::new(),
            evictions: 0,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks no sequence holds, cached or not: what an allocation can take.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks that carry a hash (held or free).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Cached blocks that were handed out for other content so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts[block.0 as usize]
    }

    pub fn hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.hashes[block.0 as usize]
    }

    /// The cached block holding this content, if any.
    pub fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Free blocks from next-to-evict to last, for tests and diagnostics.
    pub fn free_order(&self) -> Vec<BlockId> {
        self.free.iter().map(BlockId).collect()
    }

    /// Takes `n` free blocks (evicting cached content if need be), each with reference count 1;
    /// `None`, changing nothing, when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        // `n <= len` was checked, so the queue cannot run dry here.
        while let Some(i) = (out.len() < n).then(|| self.free.pop_front()).flatten() {
            self.uncache(BlockId(i));
            self.ref_counts[i as usize] = 1;
            out.push(BlockId(i));
        }
        Some(out)
    }

    /// Adds a holder to each block; a free block leaves the free list (a prefix hit revives it).
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            let i = b.0 as usize;
            if self.ref_counts[i] == 0 {
                self.free.remove(b.0);
            }
            self.ref_counts[i] += 1;
        }
    }

    /// Drops one holder of each block, in the order given; blocks reaching zero become free.
    /// Callers pass a sequence's blocks tail first, so its tail is evicted before its head.
    ///
    /// # Panics
    /// On a block that is already free: a double free is a bug in the caller.
    pub fn release(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for b in blocks {
            let i = b.0 as usize;
            assert!(self.ref_counts[i] > 0, "double free of KV block {}", b.0);
            self.ref_counts[i] -= 1;
            if self.ref_counts[i] == 0 {
                if self.hashes[i].is_some() {
                    self.free.push_back(b.0);
                } else {
                    self.free.push_front(b.0);
                }
            }
        }
    }

    /// Publishes a held, full block under `hash` so later prompts can reuse it. Returns false
    /// (and changes nothing) when the block already has a hash or another block holds this
    /// content.
    pub fn register(&mut self, block: BlockId, hash: BlockHash) -> bool {
        let i = block.0 as usize;
        if self.hashes[i].is_some() || self.cached.contains_key(&hash) {
            return false;
        }
        self.hashes[i] = Some(hash);
        self.cached.insert(hash, block);
        true
    }

    /// Withdraws a block's hash (its content is about to change). Counts no eviction.
    pub fn unregister(&mut self, block: BlockId) {
        if let Some(h) = self.hashes[block.0 as usize].take() {
            if self.cached.get(&h) == Some(&block) {
                self.cached.remove(&h);
            }
        }
    }

    fn uncache(&mut self, block: BlockId) {
        if self.hashes[block.0 as usize].is_some() {
            self.unregister(block);
            self.evictions += 1;
        }
    }

    /// Checks the free list, that exactly the unheld blocks are free, and that the hash index
    /// and the per-block hashes agree.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.free.check()?;
        for (i, &rc) in self.ref_counts.iter().enumerate() {
            let free = self.free.contains(i as u32);
            if (rc == 0) != free {
                return Err(format!("block {i}: ref_count {rc} but free = {free}"));
            }
        }
        for (h, b) in &self.cached {
            if self.hashes[b.0 as usize] != Some(*h) {
                return Err(format!(
                    "hash index names block {} that has another hash",
                    b.0
                ));
            }
        }
        let hashed = self.hashes.iter().filter(|h| h.is_some()).count();
        if hashed != self.cached.len() {
            return Err(format!(
                "{hashed} blocks carry a hash but {} are indexed",
                self.cached.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn h(x: u128) -> BlockHash {
        BlockHash(x)
    }

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut p = BlockPool::new(4);
        let a = p.allocate(3).unwrap();
        assert_eq!(a.len(), 3);
        assert!(p.allocate(2).is_none());
        assert_eq!(p.num_free(), 1);
        p.release(a);
        assert_eq!(p.num_free(), 4);
        p.check_invariants().unwrap();
    }

    #[test]
    fn freed_cached_blocks_are_evicted_least_recently_freed_first() {
        let mut p = BlockPool::new(4);
        let b = p.allocate(4).unwrap();
        for (k, &blk) in b.iter().enumerate() {
            assert!(p.register(blk, h(k as u128)));
        }
        // Release in the order 2, 0, 3, 1: eviction must follow that order.
        for k in [2, 0, 3, 1] {
            p.release([b[k]]);
        }
        assert_eq!(p.free_order(), vec![b[2], b[0], b[3], b[1]]);
        let first = p.allocate(1).unwrap();
        assert_eq!(first, vec![b[2]]);
        assert_eq!(p.lookup(h(2)), None, "evicted block lost its hash");
        assert_eq!(p.lookup(h(0)), Some(b[0]), "others keep theirs");
        assert_eq!(p.evictions(), 1);
        // A hit revives block 0: it leaves the free list, so block 3 goes next.
        p.touch(&[b[0]]);
        assert_eq!(p.allocate(1).unwrap(), vec![b[3]]);
        p.check_invariants().unwrap();
    }

    #[test]
    fn unhashed_blocks_are_reused_before_cached_ones() {
        let mut p = BlockPool::new(3);
        let b = p.allocate(3).unwrap();
        assert!(p.register(b[0], h(1)));
        p.release([b[0], b[1], b[2]]);
        // b[0] is cached: it sits behind the two plain blocks.
        assert_eq!(p.free_order().last(), Some(&b[0]));
        p.allocate(2).unwrap();
        assert_eq!(p.lookup(h(1)), Some(b[0]));
    }

    #[test]
    fn register_refuses_duplicate_content() {
        let mut p = BlockPool::new(2);
        let b = p.allocate(2).unwrap();
        assert!(p.register(b[0], h(9)));
        assert!(!p.register(b[1], h(9)));
        assert!(!p.register(b[0], h(10)));
        assert_eq!(p.hash_of(b[1]), None);
        p.check_invariants().unwrap();
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut p = BlockPool::new(2);
        let b = p.allocate(1).unwrap();
        p.release(b.clone());
        p.release(b);
    }

    proptest! {
        /// Random allocate / touch / release / register sequences keep the pool consistent,
        /// and the reference counts equal the holders a shadow model tracks.
        #[test]
        fn random_operations_keep_invariants(ops in proptest::collection::vec((0u8..4, 0usize..6), 1..300)) {
            let mut p = BlockPool::new(8);
            let mut held: Vec<BlockId> = Vec::new(); // one entry per reference
            for (op, k) in ops {
                match op {
                    0 => {
                        let before = p.num_free();
                        match p.allocate(k) {
                            Some(v) => { prop_assert_eq!(v.len(), k); held.extend(v); }
                            None => prop_assert!(k > before),
                        }
                    }
                    1 if !held.is_empty() => { let b = held[k % held.len()]; p.touch(&[b]); held.push(b); }
                    2 if !held.is_empty() => { let b = held.swap_remove(k % held.len()); p.release([b]); }
                    3 if !held.is_empty() => { let b = held[k % held.len()]; p.register(b, h(k as u128)); }
                    _ => {}
                }
                prop_assert!(p.check_invariants().is_ok(), "{:?}", p.check_invariants());
                for i in 0..8u32 {
                    let n = held.iter().filter(|b| b.0 == i).count() as u32;
                    prop_assert_eq!(p.ref_count(BlockId(i)), n);
                }
            }
            p.release(held.drain(..));
            prop_assert_eq!(p.num_free(), 8);
        }
    }
}
