//! A forward pass's batch layout on the device: token ids, positions, each token's sequence
//! and KV slot, block tables (padded to a power-of-two width so decode steps keep one shape),
//! the logits rows, per-sequence spans and the prefill kernel's 64-query work items, all in
//! one pooled buffer filled by a single upload. Rotary tables are built per spec on first use.
//!
//! Decode steps are padded to a bucket of batch sizes ([`bucket`]) so that one CUDA graph
//! serves every batch size of a bucket. A padding row is a sequence of its own: token 0 at
//! position 0, its K/V slot and its block table in block -1 (the scratch block every
//! [`super::CudaKv`] keeps before block 0), its logits row its own. While such a step lives,
//! per-token buffers made by `zeros` carry the padding rows too (see `CudaBuf`), and the
//! operations run over them; only the real rows reach the host.

use std::sync::Arc;

use super::ops;
use super::queue::Op;
use super::{CudaBuf, Inner};
use crate::error::{Error, Result};
use crate::model::batch::Batch;
use crate::model::hparams::RopeSpec;

/// Query rows per prefill work item (`FA_BM` in `kernels/attention_prefill.cu`).
pub const PREFILL_TILE: usize = 64;

/// Batch sizes decode steps are padded to (beyond the last one they are not padded).
const BUCKETS: [usize; 15] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512];

/// The bucket a decode step of `n` sequences is padded to, `None` above the largest.
pub fn bucket(n: usize) -> Option<usize> {
    BUCKETS.iter().copied().find(|&b| b >= n)
}

/// A padded step's real and padded token counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pad {
    pub real: usize,
    pub padded: usize,
}

/// What `embed`, `gather_rows` and `zeros` look up to reuse the step's device copies.
pub(crate) struct StepCache {
    /// Token ids as uploaded (padding included).
    pub tokens: Vec<u8>,
    pub tokens_ptr: u64,
    /// The batch's logits rows (without padding); the device copy holds `pad.padded` rows
    /// when the step is padded.
    pub rows: Vec<usize>,
    pub rows_ptr: u64,
    pub pad: Option<Pad>,
    arena: u64,
}

impl StepCache {
    /// The device copy of the step's token ids and how many it holds, when `data` (little-
    /// endian u32 ids) is exactly the batch's tokens.
    pub fn tokens_for(&self, data: &[u8]) -> Option<(u64, usize)> {
        let real = self.pad.map_or(self.tokens.len() / 4, |p| p.real);
        (self.tokens.get(..real * 4)? == data).then_some((self.tokens_ptr, self.tokens.len() / 4))
    }

    /// The device copy of the logits rows and how many it holds, when `rows` are the batch's.
    pub fn rows_for(&self, rows: &[usize]) -> Option<(u64, usize)> {
        (self.rows.as_slice() == rows)
            .then_some((self.rows_ptr, self.pad.map_or(rows.len(), |p| p.padded)))
    }
}

/// The padded size of a decode batch, when it is padded at all: every sequence runs one
/// token and wants its logits, in order.
fn padding(batch: &Batch, enabled: bool) -> Option<Pad> {
    let n = batch.n_tokens();
    if !enabled || n == 0 || batch.seqs.len() != n || batch.logits_for.len() != n {
        return None;
    }
    let plain = batch
        .seqs
        .iter()
        .enumerate()
        .all(|(i, s)| s.len == 1 && s.start == i && batch.logits_for[i] == i);
    let padded = bucket(n)?;
    (plain && padded > n).then_some(Pad { real: n, padded })
}

/// Device offsets (bytes) of the arrays in the arena.
#[derive(Debug, Clone, Copy, Default)]
struct Offsets {
    tokens: usize,
    positions: usize,
    tok_seq: usize,
    slots: usize,
    tables: usize,
    rows: usize,
    seq_start: usize,
    seq_len: usize,
    seq_pos: usize,
    ctx_start: usize,
    tiles: usize,
}

/// A prepared step (see the module doc).
pub struct CudaStep {
    pub n_tokens: usize,
    pub n_seqs: usize,
    /// Padded block-table width.
    pub width: usize,
    /// Longest query run of a sequence this step.
    pub max_len: usize,
    /// Longest context (cached + new) of a sequence.
    pub max_ctx: usize,
    /// Largest block id any table uses.
    pub max_block: u32,
    pub block_size: usize,
    pub n_tiles: usize,
    /// Tokens of the batch itself (`n_tokens` counts the padding rows too).
    pub real_tokens: usize,
    /// Context rows (cached + new) of all sequences together, and (query, key) pairs of the
    /// causal attention over them: what MLA's two forms cost (`mla::expanded_pays`).
    pub ctx_rows: usize,
    pub pairs: u64,
    arena: CudaBuf,
    off: Offsets,
    ropes: Vec<(RopeSpec, CudaBuf, CudaBuf)>,
}

fn put<T: Copy>(
    buf: &mut Vec<u8>,
    items: impl IntoIterator<Item = T>,
    to_bytes: impl Fn(T) -> Vec<u8>,
) -> usize {
    while !buf.len().is_multiple_of(16) {
        buf.push(0);
    }
    let at = buf.len();
    for x in items {
        buf.extend(to_bytes(x));
    }
    at
}

pub(crate) fn prepare(inner: &Arc<Inner>, batch: &Batch, block_size: usize) -> Result<CudaStep> {
    if block_size == 0 {
        return Err(Error::BadRequest("block size 0".into()));
    }
    let n = batch.n_tokens();
    if block_size > i32::MAX as usize {
        return Err(Error::BadRequest(format!("block size {block_size}")));
    }
    let mut tok_seq = vec![0i32; n];
    let mut slots = vec![0i64; n];
    let (mut max_len, mut max_ctx, mut max_table, mut max_block) = (0usize, 0usize, 1usize, 0u32);
    for (si, s) in batch.seqs.iter().enumerate() {
        if s.start + s.len > n {
            return Err(Error::BadRequest(format!(
                "sequence {si} runs past the batch's tokens"
            )));
        }
        let need = (s.pos + s.len).div_ceil(block_size);
        if s.block_table.len() < need {
            return Err(Error::BadRequest(format!(
                "sequence {si}: block table has {} blocks, {} tokens need {need}",
                s.block_table.len(),
                s.pos + s.len
            )));
        }
        for i in 0..s.len {
            let p = s.pos + i;
            let b = s.block_table[p / block_size];
            tok_seq[s.start + i] = si as i32;
            slots[s.start + i] = (b as usize * block_size + p % block_size) as i64;
        }
        max_len = max_len.max(s.len);
        max_ctx = max_ctx.max(s.pos + s.len);
        max_table = max_table.max(s.block_table.len());
        max_block = max_block.max(s.block_table.iter().copied().max().unwrap_or(0));
    }
    if let Some(&r) = batch.logits_for.iter().find(|&&r| r >= n) {
        return Err(Error::BadRequest(format!(
            "logits row {r} is outside the batch ({n} tokens)"
        )));
    }
    let width = max_table.next_power_of_two();
    let pad = padding(batch, inner.opts.graphs && inner.opts.buckets);
    let total = pad.map_or(n, |p| p.padded);
    let extra = total - n;
    let bs = block_size as i64;
    // Padding rows: one sequence each, token 0 at position 0, slot and table in block -1.
    let tokens = batch.tokens.iter().copied().chain((0..extra).map(|_| 0u32));
    let positions = batch.positions().into_iter().chain((0..extra).map(|_| 0));
    let tok_seq = tok_seq.into_iter().chain((n..total).map(|i| i as i32));
    let slots = slots.into_iter().chain((0..extra).map(|_| -bs));
    let rows = batch.logits_for.iter().copied().chain(n..total);
    let spans = |f: fn(&crate::model::batch::SeqSlice) -> usize, pad_value: fn(usize) -> usize| {
        batch
            .seqs
            .iter()
            .map(move |s| f(s) as i32)
            .chain((n..total).map(move |i| pad_value(i) as i32))
            .collect::<Vec<i32>>()
    };
    let seq_start = spans(|s| s.start, |i| i);
    let seq_len = spans(|s| s.len, |_| 1);
    let seq_pos = spans(|s| s.pos, |_| 0);
    // where each sequence's context starts when all of them are laid end to end (MLA's
    // expanded form gathers them so); a padding row's context is its one token
    let mut ctx_rows = 0usize;
    let mut pairs = 0u64;
    let mut ctx_start = Vec::with_capacity(batch.seqs.len() + extra);
    for s in &batch.seqs {
        ctx_start.push(ctx_rows as i32);
        ctx_rows += s.pos + s.len;
        let (pos, len) = (s.pos as u64, s.len as u64);
        pairs += len * pos + len * (len + 1) / 2;
    }
    for _ in n..total {
        ctx_start.push(ctx_rows as i32);
        ctx_rows += 1;
        pairs += 1;
    }
    let mut tiles = Vec::new();
    for (si, s) in batch.seqs.iter().enumerate() {
        for q0 in (0..s.len).step_by(PREFILL_TILE) {
            tiles.push(si as i32);
            tiles.push(q0 as i32);
        }
    }
    for si in n..total {
        tiles.extend([si as i32, 0]);
    }
    let i32b = |v: i32| v.to_le_bytes().to_vec();
    let mut buf = Vec::new();
    let off = Offsets {
        tokens: put(&mut buf, tokens, |t: u32| t.to_le_bytes().to_vec()),
        positions: put(&mut buf, positions.map(|p| p as i32), i32b),
        tok_seq: put(&mut buf, tok_seq, i32b),
        slots: put(&mut buf, slots, |v: i64| v.to_le_bytes().to_vec()),
        tables: put(
            &mut buf,
            batch
                .seqs
                .iter()
                .flat_map(|s| {
                    (0..width).map(move |j| s.block_table.get(j).copied().unwrap_or(0) as i32)
                })
                .chain((0..extra * width).map(|_| -1)),
            i32b,
        ),
        rows: put(&mut buf, rows.map(|r| r as i32), i32b),
        seq_start: put(&mut buf, seq_start, i32b),
        seq_len: put(&mut buf, seq_len, i32b),
        seq_pos: put(&mut buf, seq_pos, i32b),
        ctx_start: put(&mut buf, ctx_start, i32b),
        tiles: put(&mut buf, tiles.iter().copied(), i32b),
    };
    let arena = inner.scratch(buf.len().max(16), 1)?;
    let base = arena.ptr();
    let tokens_bytes = buf[off.tokens..off.tokens + 4 * total].to_vec();
    inner.push(Op::Upload {
        ptr: base,
        data: buf,
    });
    if let Ok(mut c) = inner.step_cache.lock() {
        *c = Some(StepCache {
            tokens: tokens_bytes,
            tokens_ptr: base + off.tokens as u64,
            rows: batch.logits_for.clone(),
            rows_ptr: base + off.rows as u64,
            pad,
            arena: base,
        });
    }
    Ok(CudaStep {
        n_tokens: total,
        n_seqs: batch.seqs.len() + extra,
        width,
        max_len,
        max_ctx,
        max_block,
        block_size,
        n_tiles: tiles.len() / 2,
        real_tokens: n,
        ctx_rows,
        pairs,
        arena,
        off,
        ropes: Vec::new(),
    })
}

impl CudaStep {
    fn at(&self, off: usize) -> u64 {
        self.arena.ptr() + off as u64
    }

    pub fn positions(&self) -> u64 {
        self.at(self.off.positions)
    }
    pub fn tok_seq(&self) -> u64 {
        self.at(self.off.tok_seq)
    }
    pub fn slots(&self) -> u64 {
        self.at(self.off.slots)
    }
    pub fn tables(&self) -> u64 {
        self.at(self.off.tables)
    }
    pub fn seq_start(&self) -> u64 {
        self.at(self.off.seq_start)
    }
    pub fn seq_len(&self) -> u64 {
        self.at(self.off.seq_len)
    }
    pub fn seq_pos(&self) -> u64 {
        self.at(self.off.seq_pos)
    }
    pub fn ctx_start(&self) -> u64 {
        self.at(self.off.ctx_start)
    }
    pub fn tiles(&self) -> u64 {
        self.at(self.off.tiles)
    }

    /// Device pointers of the cos/sin table of `spec`, queued on first use.
    pub(crate) fn rope_table(&mut self, inner: &Arc<Inner>, spec: RopeSpec) -> Result<(u64, u64)> {
        if let Some((_, c, s)) = self.ropes.iter().find(|(sp, _, _)| *sp == spec) {
            return Ok((c.ptr(), s.ptr()));
        }
        let len = self.n_tokens * (spec.dims / 2);
        let cs = inner.scratch(len, 4)?;
        let sn = inner.scratch(len, 4)?;
        ops::rope_table(inner, self.positions(), self.n_tokens, spec, &cs, &sn);
        let ptrs = (cs.ptr(), sn.ptr());
        self.ropes.push((spec, cs, sn));
        Ok(ptrs)
    }
}

impl Drop for CudaStep {
    fn drop(&mut self) {
        let inner = &self.arena.inner;
        if let Ok(mut c) = inner.step_cache.lock() {
            if c.as_ref().is_some_and(|c| c.arena == self.arena.ptr()) {
                *c = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{bucket, padding, Pad};
    use crate::model::batch::Batch;

    #[test]
    fn buckets_round_up_and_stop_at_the_largest() {
        assert_eq!(bucket(1), Some(1));
        assert_eq!(bucket(3), Some(4));
        assert_eq!(bucket(17), Some(24));
        assert_eq!(bucket(24), Some(24));
        assert_eq!(bucket(129), Some(192));
        assert_eq!(bucket(512), Some(512));
        assert_eq!(bucket(513), None);
        for n in 1..=512 {
            let b = bucket(n).unwrap();
            assert!(b >= n && b < 2 * n.max(1) + 1, "{n} -> {b}");
        }
    }

    #[test]
    fn only_plain_decode_batches_are_padded() {
        let decode = |n: usize| {
            let mut b = Batch::default();
            for i in 0..n {
                b.push(&[7], 10 + i, vec![i as u32], true);
            }
            b
        };
        assert_eq!(padding(&decode(3), true), Some(Pad { real: 3, padded: 4 }));
        assert_eq!(padding(&decode(3), false), None, "switched off");
        assert_eq!(padding(&decode(4), true), None, "already a bucket");
        let mut prefill = decode(2);
        prefill.push(&[1, 2], 0, vec![9], true);
        assert_eq!(padding(&prefill, true), None, "a sequence runs two tokens");
        let mut no_logits = Batch::default();
        for i in 0..3 {
            no_logits.push(&[7], 10, vec![i], i != 1);
        }
        assert_eq!(padding(&no_logits, true), None, "a row without logits");
    }
}
