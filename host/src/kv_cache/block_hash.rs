//! Chained content hashes of full KV blocks, the keys of the prefix cache. Owns only the hash
//! function; which blocks carry which hash is the block pool's business.
//!
//! Block `i` of a sequence hashes its parent's hash together with its own `block_size` token
//! ids, so equal hashes mean equal token prefixes, not merely equal blocks. The hash is the
//! first 128 bits of SHA-256: a collision would silently hand one prompt another prompt's keys
//! and values, so a 64-bit hash over millions of blocks is not enough.

use sha2::{Digest, Sha256};

use crate::ids::TokenId;

/// The chained hash of one full block: it names the block's tokens and every token before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// Hashes one full block given the hash of the block before it (`None` for the first block).
pub fn hash_block(parent: Option<BlockHash>, tokens: &[TokenId]) -> BlockHash {
    let mut bytes = Vec::with_capacity(17 + 4 * tokens.len());
    match parent {
        Some(p) => {
            bytes.push(1);
            bytes.extend_from_slice(&p.0.to_le_bytes());
        }
        None => bytes.push(0),
    }
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    let digest = Sha256::digest(&bytes);
    let mut first = [0u8; 16];
    first.copy_from_slice(&digest[..16]);
    BlockHash(u128::from_le_bytes(first))
}

/// Extends `hashes` with the hashes of every full block of `tokens` not hashed yet. A partial
/// last block gets no hash; call again when more tokens arrive.
pub fn extend_block_hashes(hashes: &mut Vec<BlockHash>, tokens: &[TokenId], block_size: usize) {
    if block_size == 0 {
        return;
    }
    let full = tokens.len() / block_size;
    for i in hashes.len()..full {
        let parent = hashes.last().copied();
        hashes.push(hash_block(
            parent,
            &tokens[i * block_size..(i + 1) * block_size],
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_give_equal_hashes() {
        let a: Vec<TokenId> = (0..40).collect();
        let mut b = a.clone();
        b[35] = 999; // differs only in the third (partial) block
        let (mut ha, mut hb) = (Vec::new(), Vec::new());
        extend_block_hashes(&mut ha, &a, 16);
        extend_block_hashes(&mut hb, &b, 16);
        assert_eq!(ha.len(), 2);
        assert_eq!(ha, hb);
    }

    #[test]
    fn hash_depends_on_the_parent() {
        let block: Vec<TokenId> = vec![7; 16];
        let h0 = hash_block(None, &block);
        let h1 = hash_block(Some(h0), &block);
        assert_ne!(h0, h1);
        // Same second block after a different first block: different hash.
        let other = hash_block(None, &[8; 16]);
        assert_ne!(hash_block(Some(other), &block), h1);
    }

    #[test]
    fn extending_incrementally_matches_hashing_at_once() {
        let tokens: Vec<TokenId> = (0..100).map(|i| i * 31 % 17).collect();
        let mut once = Vec::new();
        extend_block_hashes(&mut once, &tokens, 8);
        let mut step = Vec::new();
        for n in 0..=tokens.len() {
            extend_block_hashes(&mut step, &tokens[..n], 8);
        }
        assert_eq!(once, step);
        assert_eq!(once.len(), 12);
    }
}
