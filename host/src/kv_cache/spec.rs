//! What the KV cache stores per layer: one [`KvCacheSpec`] per group of layers that share a
//! layout, and the [`KvCacheLayout`] of a whole model (groups + block size). Pure shapes and
//! byte counts; no memory is allocated here.
//!
//! Today every group shares one block table per sequence: block id `b` addresses page `b` of
//! every layer's arrays (for full attention, K and V of shape
//! `[num_blocks, block_size, kv_heads, head_dim]`). Sliding-window layers therefore keep their
//! whole history for now (correct, not memory-optimal). The extension points for later issues
//! are [`KvCacheSpec::resident_tokens`] (which positions a group must keep: a sliding window
//! plus a rollback margin can free older blocks) and [`KvCacheSpec::prefix_cacheable`] (window
//! caches stay out of the prefix cache and are rebuilt by bounded replay); a group whose
//! answers differ from full attention's will get its own block table and pool.

use std::ops::Range;

use crate::error::{Error, Result};

/// Shape of one attention layer's per-token K and V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Bytes per stored element (4 for f32, 2 for bf16/f16).
    pub dtype_bytes: usize,
}

/// The cache kind of one layer group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCacheSpec {
    /// Paged K and V for every position.
    FullAttention(AttentionShape),
    /// K and V, of which attention reads only the last `window` positions.
    SlidingWindow {
        shape: AttentionShape,
        window: usize,
    },
    /// Multi-head latent attention: one compressed latent plus a shared rotary key per token,
    /// no separate V.
    LatentMla {
        latent_dim: usize,
        rope_dim: usize,
        dtype_bytes: usize,
    },
}

impl KvCacheSpec {
    /// Bytes one token takes in one layer of this group.
    pub fn bytes_per_token(&self) -> usize {
        match *self {
            KvCacheSpec::FullAttention(s) | KvCacheSpec::SlidingWindow { shape: s, .. } => {
                2 * s.num_kv_heads * s.head_dim * s.dtype_bytes
            }
            KvCacheSpec::LatentMla {
                latent_dim,
                rope_dim,
                dtype_bytes,
            } => (latent_dim + rope_dim) * dtype_bytes,
        }
    }

    /// Positions, out of a sequence of `num_tokens`, whose KV this group must keep so that
    /// attention can still run and `rollback_margin` tokens can be rolled back. Full and
    /// latent caches keep everything.
    pub fn resident_tokens(&self, num_tokens: usize, rollback_margin: usize) -> Range<usize> {
        match *self {
            KvCacheSpec::SlidingWindow { window, .. } => {
                num_tokens.saturating_sub(window + rollback_margin)..num_tokens
            }
            _ => 0..num_tokens,
        }
    }

    /// Whether blocks of this group may be shared through prefix hashes.
    pub fn prefix_cacheable(&self) -> bool {
        !matches!(self, KvCacheSpec::SlidingWindow { .. })
    }
}

/// Layers that share one cache kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerGroup {
    /// Model layer indices in this group.
    pub layers: Vec<usize>,
    pub spec: KvCacheSpec,
}

/// The KV cache layout of a whole model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheLayout {
    /// Tokens per block (16 by default).
    pub block_size: usize,
    pub groups: Vec<LayerGroup>,
}

/// The default number of tokens per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

impl KvCacheLayout {
    /// Every layer full attention with the same shape (Llama-style models).
    pub fn full_attention(num_layers: usize, shape: AttentionShape, block_size: usize) -> Self {
        KvCacheLayout {
            block_size,
            groups: vec![LayerGroup {
                layers: (0..num_layers).collect(),
                spec: KvCacheSpec::FullAttention(shape),
            }],
        }
    }

    /// Bytes one block takes across every layer: for full attention,
    /// layers x kv_heads x head_dim x 2 (K and V) x element size x block_size.
    pub fn bytes_per_block(&self) -> usize {
        self.groups
            .iter()
            .map(|g| g.layers.len() * g.spec.bytes_per_token() * self.block_size)
            .sum()
    }

    /// How many whole blocks fit in `bytes`.
    pub fn num_blocks_for_bytes(&self, bytes: u64) -> usize {
        match self.bytes_per_block() as u64 {
            0 => 0,
            per => usize::try_from(bytes / per).unwrap_or(usize::MAX),
        }
    }

    /// Rejects empty layouts, zero sizes and layers listed twice.
    pub fn validate(&self) -> Result<()> {
        if self.block_size == 0 {
            return Err(Error::BadConfig("KV block_size must be at least 1".into()));
        }
        if self.groups.is_empty() || self.groups.iter().all(|g| g.layers.is_empty()) {
            return Err(Error::BadConfig("KV cache layout has no layers".into()));
        }
        let mut seen = std::collections::HashSet::new();
        for g in &self.groups {
            if g.spec.bytes_per_token() == 0 {
                return Err(Error::BadConfig(format!(
                    "KV spec {:?} stores nothing",
                    g.spec
                )));
            }
            if let KvCacheSpec::SlidingWindow { window: 0, .. } = g.spec {
                return Err(Error::BadConfig("sliding window of 0 tokens".into()));
            }
            for &l in &g.layers {
                if !seen.insert(l) {
                    return Err(Error::BadConfig(format!(
                        "layer {l} is in two KV layer groups"
                    )));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm() -> KvCacheLayout {
        let shape = AttentionShape {
            num_kv_heads: 3,
            head_dim: 64,
            dtype_bytes: 4,
        };
        KvCacheLayout::full_attention(30, shape, 16)
    }

    #[test]
    fn bytes_per_block_of_the_default_model() {
        // 30 layers x 3 heads x 64 x 2 (K,V) x 4 bytes x 16 tokens
        assert_eq!(smollm().bytes_per_block(), 30 * 3 * 64 * 2 * 4 * 16);
        assert_eq!(smollm().num_blocks_for_bytes(1 << 30), (1 << 30) / 737_280);
    }

    #[test]
    fn mixed_groups_add_up() {
        let shape = AttentionShape {
            num_kv_heads: 1,
            head_dim: 256,
            dtype_bytes: 2,
        };
        let layout = KvCacheLayout {
            block_size: 16,
            groups: vec![
                LayerGroup {
                    layers: vec![0, 1, 2, 3, 4],
                    spec: KvCacheSpec::SlidingWindow { shape, window: 512 },
                },
                LayerGroup {
                    layers: vec![5],
                    spec: KvCacheSpec::FullAttention(shape),
                },
                LayerGroup {
                    layers: vec![6],
                    spec: KvCacheSpec::LatentMla {
                        latent_dim: 512,
                        rope_dim: 64,
                        dtype_bytes: 2,
                    },
                },
            ],
        };
        layout.validate().unwrap();
        assert_eq!(layout.bytes_per_block(), 6 * 1024 * 16 + 576 * 2 * 16);
    }

    #[test]
    fn sliding_window_keeps_only_window_plus_margin() {
        let s = KvCacheSpec::SlidingWindow {
            shape: AttentionShape {
                num_kv_heads: 1,
                head_dim: 8,
                dtype_bytes: 4,
            },
            window: 128,
        };
        assert_eq!(s.resident_tokens(1000, 12), 860..1000);
        assert_eq!(s.resident_tokens(100, 12), 0..100);
        assert!(!s.prefix_cacheable());
        let full = KvCacheSpec::LatentMla {
            latent_dim: 4,
            rope_dim: 2,
            dtype_bytes: 2,
        };
        assert_eq!(full.resident_tokens(1000, 12), 0..1000);
    }

    #[test]
    fn validate_rejects_duplicate_layers() {
        let mut l = smollm();
        l.groups.push(l.groups[0].clone());
        assert!(l.validate().is_err());
        l.groups.clear();
        assert!(l.validate().is_err());
    }
}
