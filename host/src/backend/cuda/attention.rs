//! Attention launcher: writes the step's K/V into their paged slots, then runs either the
//! split-KV decode kernel (every query token on its own, keys split across blocks so a small
//! batch still fills the GPU) or, when some sequence runs more than a few tokens and the head
//! size has a tensor-core kernel, the flash-attention prefill kernel.

use std::sync::Arc;

use super::module::DECODE_GROUPS;
use super::ops::check;
use super::queue::Op;
use super::step::CudaStep;
use super::weights::CudaKv;
use super::{CudaBuf, Inner};
use crate::backend::AttnParams;
use crate::error::{Error, Result};

/// Sequences running more tokens than this use the prefill kernel.
const DECODE_MAX_LEN: usize = 8;
/// Blocks the decode kernel aims to launch (two waves of 132 SMs).
const TARGET_BLOCKS: usize = 264;
/// Most query heads per decode block (`DEC_MAXG`).
const DEC_MAXG: usize = 8;

fn decode_index(head_dim: usize) -> Option<usize> {
    [16, 32, 64, 128, 256].iter().position(|&d| d == head_dim)
}

fn prefill_index(head_dim: usize) -> Option<usize> {
    [64, 128].iter().position(|&d| d == head_dim)
}

/// Key splits per (token, head group): enough blocks to fill the GPU, at least 32 keys each.
/// Depends on the context only through its power-of-two bucket, so decode steps keep their shape.
pub fn splits_for(blocks_per_split: usize, max_ctx: usize) -> usize {
    let by_gpu = TARGET_BLOCKS.div_ceil(blocks_per_split.max(1));
    let by_ctx = max_ctx.next_power_of_two().div_ceil(32);
    by_gpu.min(by_ctx).clamp(1, 64)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    inner: &Arc<Inner>,
    step: &CudaStep,
    kv: &mut CudaKv,
    layer: usize,
    p: &AttnParams,
    q: &CudaBuf,
    k: &CudaBuf,
    v: &CudaBuf,
    out: &mut CudaBuf,
) -> Result<()> {
    let n = step.n_tokens;
    if n == 0 {
        return Ok(());
    }
    let s = kv.shape;
    if p.n_kv_heads != s.kv_heads || p.head_dim != s.head_dim || step.block_size != s.block_size {
        return Err(Error::BadRequest(format!(
            "attention: {} KV heads of {} with blocks of {}, but the cache holds {} of {} with blocks of {}",
            p.n_kv_heads, p.head_dim, step.block_size, s.kv_heads, s.head_dim, s.block_size
        )));
    }
    if p.n_kv_heads == 0 || !p.n_heads.is_multiple_of(p.n_kv_heads) {
        return Err(Error::BadConfig(format!(
            "{} heads over {} KV heads",
            p.n_heads, p.n_kv_heads
        )));
    }
    if step.max_block as usize >= s.num_blocks {
        return Err(Error::BadRequest(format!(
            "block id {} is outside the cache ({} blocks)",
            step.max_block, s.num_blocks
        )));
    }
    let dec = decode_index(p.head_dim).ok_or_else(|| {
        Error::BadConfig(format!(
            "the CUDA attention kernels take head_dim 16, 32, 64, 128 or 256, not {}",
            p.head_dim
        ))
    })?;
    let (qw, kvw) = (p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim);
    check("attention q", q.len, n * qw)?;
    check("attention k", k.len, n * kvw)?;
    check("attention v", v.len, n * kvw)?;
    check("attention output", out.len, n * qw)?;
    let (kc, vc) = kv
        .layer(layer)
        .ok_or_else(|| Error::BadRequest(format!("layer {layer} is outside the KV cache")))?;
    let kern = inner.module.act(inner.act());
    if decode_fused(
        inner,
        kern,
        step,
        p,
        [q.ptr(), k.ptr(), v.ptr(), kc, vc],
        out.ptr(),
    ) {
        return Ok(());
    }
    let folded = inner.opts.fuse
        && inner.opts.fuse_rope_kv
        && fold_rope_kv(inner, kern, [q.ptr(), k.ptr(), v.ptr(), kc, vc], step, p);
    if !folded {
        inner.push(Op::Launch {
            kernel: kern.write_kv,
            grid: [n as u32, 1, 1],
            block: kvw.next_power_of_two().clamp(32, 256) as u32,
            smem: 0,
            args: vec![kc, vc, k.ptr(), v.ptr(), step.slots(), kvw as u64],
        });
    }
    let scale_log2 = (p.scale * std::f32::consts::LOG2_E).to_bits() as u64;
    let window = p.window.unwrap_or(0) as u64;
    if let (true, Some(pi)) = (step.max_len > DECODE_MAX_LEN, prefill_index(p.head_dim)) {
        let (kernel, smem, grid, block) = prefill_kernel(inner, kern, pi, step.n_tiles, p);
        inner.push(Op::Launch {
            kernel,
            grid,
            block,
            smem,
            args: vec![
                out.ptr(),
                q.ptr(),
                kc,
                vc,
                step.tiles(),
                step.n_tiles as u64,
                step.seq_start(),
                step.seq_len(),
                step.seq_pos(),
                step.tables(),
                step.width as u64,
                p.n_heads as u64,
                p.n_kv_heads as u64,
                step.block_size as u64,
                scale_log2,
                window,
            ],
        });
        return Ok(());
    }
    let group = p.n_heads / p.n_kv_heads;
    // Kernels are specialized by heads per block, so a GQA group of 4 keeps half the registers
    // of the 8-head kernel (batch-32 decode attention on the H200: 32.8 us a layer before).
    let maxg = group.next_power_of_two().min(DEC_MAXG);
    let gi = DECODE_GROUPS.iter().position(|&g| g == maxg).unwrap_or(3);
    let hgroups = group.div_ceil(maxg);
    let splits = decode_splits(step, p, hgroups);
    let (part_o, part_ml) = if splits > 1 {
        (
            Some(inner.scratch(n * p.n_heads * splits * p.head_dim, 4)?),
            Some(inner.scratch(n * p.n_heads * splits * 2, 4)?),
        )
    } else {
        (None, None)
    };
    let ptr = |b: &Option<CudaBuf>| b.as_ref().map_or(0, |b| b.ptr());
    let grid_y = p.n_kv_heads * hgroups;
    let counters = if splits > 1 && inner.opts.fuse2 {
        inner.counters(n * grid_y)
    } else {
        None
    };
    inner.push(Op::Launch {
        kernel: kern.attn_decode[dec][gi],
        grid: [n as u32, grid_y as u32, splits as u32],
        block: 128,
        smem: 0,
        args: vec![
            ptr(&part_o),
            ptr(&part_ml),
            out.ptr(),
            q.ptr(),
            kc,
            vc,
            step.tok_seq(),
            step.positions(),
            step.tables(),
            step.width as u64,
            p.n_heads as u64,
            p.n_kv_heads as u64,
            step.block_size as u64,
            scale_log2,
            window,
            splits as u64,
            counters.unwrap_or(0),
        ],
    });
    if splits > 1 && counters.is_none() {
        inner.push(Op::Launch {
            kernel: kern.attn_combine,
            grid: [(n * p.n_heads) as u32, 1, 1],
            block: p.head_dim.clamp(32, 256) as u32,
            smem: 0,
            args: vec![
                out.ptr(),
                ptr(&part_o),
                ptr(&part_ml),
                splits as u64,
                p.head_dim as u64,
            ],
        });
    }
    Ok(())
}

/// Key splits of the decode kernels for `hgroups` blocks of query heads per KV head. They
/// follow the batch's bucket, not its size, so a padded step and the same batch unpadded
/// reduce each row's keys in the same order (bit-identical rows).
fn decode_splits(step: &CudaStep, p: &AttnParams, hgroups: usize) -> usize {
    let n = step.n_tokens;
    let blocks = super::step::bucket(n).unwrap_or(n) * p.n_kv_heads * hgroups;
    let ctx = match p.window {
        Some(w) => step.max_ctx.min(w),
        None => step.max_ctx,
    };
    splits_for(blocks, ctx)
}

/// Most key splits of the fused decode kernel: one cluster holds them (the portable size).
const DEC1_MAX_SPLITS: usize = 8;

/// Queues the fused decode kernel (`attn_dec1_*`: RoPE of `q` and `k` when their rotations
/// were queued just before, the K/V cache write, attention and the split merge in one
/// cluster launch) when it takes this step: every sequence runs one token, head dim 64 or
/// 128, at most [`DEC_MAXG`] query heads per KV head, at most [`DEC1_MAX_SPLITS`] key splits
/// and a device with clusters. `bufs`: q, k, v and the layer's K and V caches. True when it
/// queued it. Only steps of at most [`TARGET_BLOCKS`] blocks take it.
fn decode_fused(
    inner: &Inner,
    kern: &super::module::ActKernels,
    step: &CudaStep,
    p: &AttnParams,
    bufs: [u64; 5],
    out: u64,
) -> bool {
    let [q, k, v, kc, vc] = bufs;
    let group = p.n_heads / p.n_kv_heads;
    let di = match p.head_dim {
        64 => 0,
        128 => 1,
        _ => return false,
    };
    if !(inner.opts.fuse && inner.opts.fuse_attn && inner.module.clusters)
        || step.max_len != 1
        || group > DEC_MAXG
        || step.n_tokens > 65_535
    {
        return false;
    }
    let splits = decode_splits(step, p, 1);
    // Larger batches keep the separate launches: on the H200 a Llama-3-8B batch-32 step
    // (512 blocks of the fused kernel, which holds more registers) took 6.50 ms fused against
    // 6.11 ms, while batch 1 (64 blocks) gained 0.18 ms. One wave of two blocks an SM passes.
    if splits > DEC1_MAX_SPLITS || splits * p.n_kv_heads * step.n_tokens > TARGET_BLOCKS {
        return false;
    }
    let gi = DECODE_GROUPS
        .iter()
        .position(|&g| g == group.next_power_of_two())
        .unwrap_or(3);
    let mut queue = inner.queue();
    // Without rotations to fold (none queued, or not of whole heads), q and k are read as
    // they are: style -1.
    let (cs, sn, style) = match take_ropes(&mut queue, kern, q, k, step.n_tokens, p) {
        Some([cs, sn, _, style]) => (cs, sn, style),
        None => (0, 0, (-1i32) as u32 as u64),
    };
    let scale_log2 = (p.scale * std::f32::consts::LOG2_E).to_bits() as u64;
    queue.push(Op::Cluster {
        kernel: kern.attn_dec1[di][gi],
        grid: [splits as u32, p.n_kv_heads as u32, step.n_tokens as u32],
        block: 128,
        cluster: splits as u32,
        smem: 0,
        args: vec![
            out,
            q,
            k,
            v,
            kc,
            vc,
            step.slots(),
            cs,
            sn,
            step.tok_seq(),
            step.positions(),
            step.tables(),
            step.width as u64,
            p.n_heads as u64,
            p.n_kv_heads as u64,
            step.block_size as u64,
            scale_log2,
            p.window.unwrap_or(0) as u64,
            style,
        ],
    });
    true
}

// The wide kernels (`FW_BM` = 128) take two of the step's 64-query work items a block.
const _: () = assert!(super::step::PREFILL_TILE * 2 == 128);

/// The prefill kernel to launch for head-dim index `pi`, its dynamic shared memory, grid and
/// block. The wide kernel takes the query head as x and the 64-query work item as y (longest
/// rows first, the heads of one KV head side by side); the others the item as x, the head as y.
/// The wide one falls back to the double-buffered kernel where it cannot run: more work items
/// than a grid's y holds, the device's shared memory short, or a scale that is not positive
/// (it takes the row maximum before scaling); the double-buffered one to the plain kernel where
/// the device's shared memory is short of its 80 KB (at head dim 128).
fn prefill_kernel(
    inner: &Inner,
    kern: &super::module::ActKernels,
    pi: usize,
    n_tiles: usize,
    p: &AttnParams,
) -> (super::module::KernelId, u32, [u32; 3], u32) {
    use super::module::{prefill2_smem, prefill3_smem, PREFILL3_THREADS};
    use super::PrefillKernel;
    let d = p.head_dim;
    let narrow = [n_tiles as u32, p.n_heads as u32, 1];
    match inner.opts.prefill {
        PrefillKernel::Plain => return (kern.attn_prefill[pi], 0, narrow, 128),
        PrefillKernel::Pipelined => {}
        PrefillKernel::Wide => {
            let smem = prefill3_smem(d);
            if n_tiles <= 65_535 && smem <= inner.module.max_smem && p.scale > 0.0 {
                let grid = [p.n_heads as u32, n_tiles as u32, 1];
                return (kern.attn_prefill3[pi], smem as u32, grid, PREFILL3_THREADS);
            }
        }
    }
    let smem = prefill2_smem(d);
    if smem > inner.module.max_smem {
        return (kern.attn_prefill[pi], 0, narrow, 128);
    }
    (kern.attn_prefill2[pi], smem as u32, narrow, 128)
}

/// Replaces the RoPE launches of `q` and then `k` just queued (same table and head size, the
/// whole head rotated) by one launch that also writes K/V into the cache; true when it did. `bufs`: q, k, v, and the
/// layer's K and V caches.
fn fold_rope_kv(
    inner: &Inner,
    kern: &super::module::ActKernels,
    bufs: [u64; 5],
    step: &CudaStep,
    p: &AttnParams,
) -> bool {
    let [q, k, v, kc, vc] = bufs;
    let mut queue = inner.queue();
    let Some([cs, sn, half, style]) = take_ropes(&mut queue, kern, q, k, step.n_tokens, p) else {
        return false;
    };
    let hd = p.head_dim as u64;
    let n = step.n_tokens as u64;
    let total = step.n_tokens * (p.n_heads + p.n_kv_heads) * half as usize
        + step.n_tokens * p.n_kv_heads * p.head_dim;
    queue.push(Op::Launch {
        kernel: kern.rope_kv,
        grid: [super::queue::elementwise_grid(total), 1, 1],
        block: 256,
        smem: 0,
        args: vec![
            q,
            k,
            v,
            kc,
            vc,
            step.slots(),
            cs,
            sn,
            n,
            p.n_heads as u64,
            p.n_kv_heads as u64,
            hd,
            half,
            style,
        ],
    });
    true
}

/// Takes back the RoPE launches of `q` and then `k` just queued when they share a table and
/// rotate whole heads of `p`'s shape: their cos and sin tables, half and style.
fn take_ropes(
    queue: &mut super::queue::Queue,
    kern: &super::module::ActKernels,
    q: u64,
    k: u64,
    n_tokens: usize,
    p: &AttnParams,
) -> Option<[u64; 4]> {
    let (n, hd) = (n_tokens as u64, p.head_dim as u64);
    // rope's arguments: x, cos, sin, tokens, heads, head_dim, half, style.
    let rope_of = |op: Option<&Op>, x: u64, heads: usize| match op {
        Some(Op::Launch { kernel, args, .. })
            if *kernel == kern.rope
                && args.len() == 8
                && args[0] == x
                && args[3] == n
                && args[4] == heads as u64
                && args[5] == hd
                && args[6] * 2 == hd =>
        {
            Some([args[1], args[2], args[6], args[7]])
        }
        _ => None,
    };
    let last = queue.pop()?;
    let Some(table) = rope_of(Some(&last), k, p.n_kv_heads) else {
        queue.push(last);
        return None;
    };
    let before = queue.last_mut().map(|o| &*o);
    if rope_of(before, q, p.n_heads) != Some(table) {
        queue.push(last);
        return None;
    }
    queue.pop();
    Some(table)
}

#[cfg(test)]
mod tests {
    use super::splits_for;

    #[test]
    fn splits_fill_the_gpu_but_keep_32_keys_each() {
        assert_eq!(splits_for(8, 256), 8); // one token, 8 KV heads: 33 by GPU, 8 by context
        assert_eq!(splits_for(8, 4096), 33);
        assert_eq!(splits_for(1024, 4096), 1); // a big batch fills the GPU alone
        assert_eq!(splits_for(3, 1), 1);
        assert_eq!(
            splits_for(8, 200),
            splits_for(8, 256),
            "one bucket per power of two"
        );
    }
}
