//! Paged KV storage on the CPU: per layer, K and V arrays of shape
//! `[num_blocks, block_size, kv_heads, head_dim]` in f32. Block ids come from the KV-cache
//! manager; this type only owns the memory and knows where a (block, slot) lives.
//!
//! The arrays are zero-allocated, so the operating system commits their pages only when a
//! block is first written: a large configured capacity costs no resident memory until used.

/// KV storage for every layer of one model.
#[derive(Debug)]
pub struct PagedKv {
    pub block_size: usize,
    pub num_blocks: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl PagedKv {
    pub fn new(
        n_layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> PagedKv {
        let n = num_blocks * block_size * kv_heads * head_dim;
        PagedKv {
            block_size,
            num_blocks,
            kv_heads,
            head_dim,
            layers: (0..n_layers)
                .map(|_| (vec![0.0; n], vec![0.0; n]))
                .collect(),
        }
    }

    /// Bytes one block takes across all layers (K and V).
    pub fn bytes_per_block(
        n_layers: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> usize {
        n_layers * 2 * block_size * kv_heads * head_dim * std::mem::size_of::<f32>()
    }

    /// Floats per token slot (all KV heads).
    pub fn slot_len(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Offset of a token's slot: `block_table[pos / block_size]`, slot `pos % block_size`.
    #[inline]
    pub fn slot_offset(&self, block_table: &[u32], pos: usize) -> usize {
        let b = block_table[pos / self.block_size] as usize;
        (b * self.block_size + pos % self.block_size) * self.slot_len()
    }

    pub fn layer(&self, l: usize) -> (&[f32], &[f32]) {
        let (k, v) = &self.layers[l];
        (k, v)
    }

    pub fn layer_mut(&mut self, l: usize) -> (&mut [f32], &mut [f32]) {
        let (k, v) = &mut self.layers[l];
        (k, v)
    }
}
