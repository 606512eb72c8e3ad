//! Unit tests of the KV-cache manager: prefix hits, allocation failure, fork, rollback, LRU.

use super::*;
use crate::ids::{RequestId, TokenId};
use crate::kv_cache::extend_block_hashes;

fn seq(r: u64) -> SeqId {
    SeqId::first(RequestId(r))
}

fn manager(num_blocks: usize) -> KvCacheManager {
    KvCacheManager::new(KvCacheConfig {
        num_blocks,
        block_size: 4,
        enable_prefix_caching: true,
    })
    .unwrap()
}

fn hashes(tokens: &[TokenId]) -> Vec<BlockHash> {
    let mut h = Vec::new();
    extend_block_hashes(&mut h, tokens, 4);
    h
}

/// Runs a whole prompt through the manager as the scheduler would: look up, allocate, compute,
/// publish. Returns the hit.
fn admit(m: &mut KvCacheManager, s: SeqId, prompt: &[TokenId]) -> PrefixHit {
    let h = hashes(prompt);
    let hit = m.find_prefix_hit(&h, prompt.len());
    m.allocate_slots(s, 0, prompt.len() - hit.num_tokens, &hit)
        .unwrap();
    m.cache_full_blocks(s, &h, prompt.len());
    hit
}

#[test]
fn second_request_with_the_same_prompt_reuses_every_full_block() {
    let mut m = manager(16);
    let prompt: Vec<TokenId> = (0..10).collect(); // 2 full blocks + 2 tokens
    assert_eq!(admit(&mut m, seq(1), &prompt).num_tokens, 0);
    let hit = admit(&mut m, seq(2), &prompt);
    assert_eq!(hit.num_tokens, 8);
    assert_eq!(&m.block_table(seq(2))[..2], &m.block_table(seq(1))[..2]);
    assert_ne!(
        m.block_table(seq(2))[2],
        m.block_table(seq(1))[2],
        "partial block is private"
    );
    for &b in &m.block_table(seq(1))[..2] {
        assert_eq!(m.pool().ref_count(b), 2);
    }
    m.check_invariants().unwrap();
}

#[test]
fn a_block_aligned_prompt_leaves_its_last_block_to_compute() {
    let mut m = manager(16);
    let prompt: Vec<TokenId> = (0..8).collect();
    admit(&mut m, seq(1), &prompt);
    m.free(seq(1));
    let hit = admit(&mut m, seq(2), &prompt);
    assert_eq!(hit.num_tokens, 4, "the last token must run to give logits");
}

#[test]
fn hits_survive_the_first_holder_and_count_in_stats() {
    let mut m = manager(16);
    let prompt: Vec<TokenId> = (100..113).collect();
    admit(&mut m, seq(1), &prompt);
    m.free(seq(1));
    assert_eq!(m.stats().blocks_used, 0);
    assert_eq!(m.stats().blocks_cached, 3);
    let hit = admit(&mut m, seq(2), &prompt);
    m.record_prefix_lookup(prompt.len(), hit.num_tokens);
    assert_eq!(hit.num_tokens, 12);
    assert_eq!(m.stats().prefix_hit_tokens, 12);
    assert!((m.stats().prefix_hit_rate() - 12.0 / 13.0).abs() < 1e-12);
    m.check_invariants().unwrap();
}

#[test]
fn allocation_failure_changes_nothing() {
    let mut m = manager(4);
    let prompt: Vec<TokenId> = (0..9).collect();
    admit(&mut m, seq(1), &prompt); // 3 blocks
    let before = m.stats();
    assert_eq!(m.allocate_slots(seq(2), 0, 5, &PrefixHit::default()), None);
    assert_eq!(m.stats(), before);
    assert!(m.block_table(seq(2)).is_empty());
    // Growing seq 1 past its third block needs the last free block, then fails.
    let none = PrefixHit::default();
    assert_eq!(m.allocate_slots(seq(1), 9, 3, &none), Some(0));
    assert_eq!(m.allocate_slots(seq(1), 9, 4, &none), Some(1));
    assert_eq!(m.allocate_slots(seq(1), 13, 4, &none), None);
    assert_eq!(m.block_table(seq(1)).len(), 4);
    m.check_invariants().unwrap();
}

#[test]
fn reviving_free_cached_blocks_counts_against_the_free_list() {
    let mut m = manager(4);
    let prompt: Vec<TokenId> = (0..9).collect();
    admit(&mut m, seq(1), &prompt);
    m.free(seq(1)); // 4 free, 2 of them cached
    let h = hashes(&prompt);
    let hit = m.find_prefix_hit(&h, prompt.len());
    assert_eq!(hit.blocks.len(), 2);
    // 2 revived + 3 new > 4 blocks: refused, and the hit blocks stay free and cached.
    assert_eq!(m.allocate_slots(seq(2), 0, 9, &hit), None);
    assert_eq!(m.stats().blocks_free, 4);
    assert_eq!(m.allocate_slots(seq(2), 0, 8, &hit), Some(2));
    m.check_invariants().unwrap();
}

#[test]
fn eviction_takes_the_least_recently_freed_cached_block() {
    let mut m = manager(4);
    let a: Vec<TokenId> = vec![1, 1, 1, 1, 0];
    let b: Vec<TokenId> = vec![2, 2, 2, 2, 0];
    admit(&mut m, seq(1), &a);
    admit(&mut m, seq(2), &b);
    m.free(seq(1)); // a's cached block freed first
    m.free(seq(2));
    // A fresh 2-block request takes the two plain blocks, then a third evicts a's block.
    m.allocate_slots(seq(3), 0, 8, &PrefixHit::default())
        .unwrap();
    assert_eq!(m.stats().evictions, 0);
    m.allocate_slots(seq(3), 8, 4, &PrefixHit::default())
        .unwrap();
    assert_eq!(m.stats().evictions, 1);
    assert_eq!(
        m.find_prefix_hit(&hashes(&a), 5).num_tokens,
        0,
        "a was evicted"
    );
    assert_eq!(
        m.find_prefix_hit(&hashes(&b), 5).num_tokens,
        4,
        "b survives"
    );
    m.check_invariants().unwrap();
}

#[test]
fn fork_shares_full_blocks_only() {
    let mut m = manager(8);
    let prompt: Vec<TokenId> = (0..10).collect();
    admit(&mut m, seq(1), &prompt);
    let child = SeqId {
        request: RequestId(1),
        sample: 1,
    };
    assert_eq!(m.fork(seq(1), child, prompt.len() - 1), 8);
    assert_eq!(m.block_table(child), &m.block_table(seq(1))[..2]);
    assert_eq!(m.pool().ref_count(m.block_table(child)[0]), 2);
    // The child computes its tail in a block of its own.
    m.allocate_slots(child, 8, 2, &PrefixHit::default())
        .unwrap();
    assert_ne!(m.block_table(child)[2], m.block_table(seq(1))[2]);
    m.check_invariants().unwrap();
    m.free(seq(1));
    m.free(child);
    assert_eq!(m.stats().blocks_used, 0);
    m.check_invariants().unwrap();
}

#[test]
fn rollback_releases_whole_blocks_past_the_kept_tokens() {
    let mut m = manager(8);
    m.allocate_slots(seq(1), 0, 13, &PrefixHit::default())
        .unwrap(); // 4 blocks
    assert_eq!(m.rollback(seq(1), 6), 6);
    assert_eq!(m.block_table(seq(1)).len(), 2);
    assert_eq!(
        m.rollback(seq(1), 8),
        8,
        "rolling forward keeps what is there"
    );
    assert_eq!(m.stats().blocks_used, 2);
    m.check_invariants().unwrap();
}

#[test]
fn rollback_into_a_shared_block_gives_it_up() {
    let mut m = manager(8);
    let prompt: Vec<TokenId> = (0..9).collect();
    admit(&mut m, seq(1), &prompt);
    admit(&mut m, seq(2), &prompt); // shares blocks 0 and 1
                                    // Keeping 6 tokens would mean writing position 6 into shared block 1.
    assert_eq!(m.rollback(seq(2), 6), 4);
    assert_eq!(m.block_table(seq(2)).len(), 1);
    // Seq 1 holds block 1 alone and published it: rollback withdraws its hash instead.
    assert_eq!(m.rollback(seq(1), 6), 6);
    assert_eq!(m.find_prefix_hit(&hashes(&prompt), 9).num_tokens, 4);
    m.check_invariants().unwrap();
}

#[test]
fn disabled_prefix_caching_never_hits() {
    let mut m = KvCacheManager::new(KvCacheConfig {
        num_blocks: 8,
        block_size: 4,
        enable_prefix_caching: false,
    })
    .unwrap();
    let prompt: Vec<TokenId> = (0..9).collect();
    admit(&mut m, seq(1), &prompt);
    assert_eq!(admit(&mut m, seq(2), &prompt).num_tokens, 0);
    assert_eq!(m.stats().blocks_cached, 0);
}
