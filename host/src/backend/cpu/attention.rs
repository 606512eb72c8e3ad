//! Attention over the paged KV layout (block tables), with grouped-query heads and optional
//! sliding windows. Work is split into (sequence, KV head, query chunk) tasks on the pool.

use super::kv::PagedKv;
use super::ops::{axpy_body, dot_body, softmax_body};
use super::pool::ThreadPool;
use crate::model::batch::Batch;

pub use crate::backend::AttnParams;

/// Queries per task: enough work per task to amortize dispatch, small enough to balance.
const QUERY_CHUNK: usize = 16;

/// A raw pointer that tasks use to write disjoint parts of one output buffer.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint ranges (distinct tokens or distinct heads), so sharing the
// pointer across threads cannot race.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Taking `self` makes closures capture the whole wrapper, not the raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Writes each token's K and V (`[tokens, kv_heads * head_dim]`) into its slot.
pub fn write_kv(kv: &mut PagedKv, layer: usize, batch: &Batch, k: &[f32], v: &[f32]) {
    let slot = kv.slot_len();
    let mut offsets = Vec::with_capacity(batch.n_tokens());
    for s in &batch.seqs {
        for i in 0..s.len {
            offsets.push((s.start + i, kv.slot_offset(&s.block_table, s.pos + i)));
        }
    }
    let (kc, vc) = kv.layer_mut(layer);
    for (t, off) in offsets {
        kc[off..off + slot].copy_from_slice(&k[t * slot..t * slot + slot]);
        vc[off..off + slot].copy_from_slice(&v[t * slot..t * slot + slot]);
    }
}

/// `out[t, h, :] = softmax(q[t, h] . K[ctx] * scale) V[ctx]` for every token of the batch,
/// reading keys and values through each sequence's block table. The token's own K/V must
/// already be written (see [`write_kv`]).
pub fn paged_attention(
    pool: &ThreadPool,
    p: &AttnParams,
    batch: &Batch,
    q: &[f32],
    kv: &PagedKv,
    layer: usize,
    out: &mut [f32],
) {
    let group = p.n_heads / p.n_kv_heads;
    let hd = p.head_dim;
    let q_stride = p.n_heads * hd;
    assert_eq!(q.len(), batch.n_tokens() * q_stride, "attention: q shape");
    assert_eq!(out.len(), q.len(), "attention: out shape");
    let mut tasks = Vec::new();
    for (si, s) in batch.seqs.iter().enumerate() {
        for g in 0..p.n_kv_heads {
            for c in (0..s.len).step_by(QUERY_CHUNK) {
                tasks.push((si, g, c, (c + QUERY_CHUNK).min(s.len)));
            }
        }
    }
    let (kc, vc) = kv.layer(layer);
    let out_ptr = OutPtr(out.as_mut_ptr());
    pool.parallel_for(tasks.len(), &|ti| {
        let (si, g, c0, c1) = tasks[ti];
        let s = &batch.seqs[si];
        let ctx_end = s.pos + c1;
        // Slot offsets of every key this task reads, looked up once.
        let offs: Vec<usize> = (0..ctx_end)
            .map(|j| kv.slot_offset(&s.block_table, j) + g * hd)
            .collect();
        let mut scores = vec![0.0f32; group * ctx_end];
        let mut acc = vec![0.0f32; group * hd];
        for i in c0..c1 {
            let t = s.start + i;
            let pos = s.pos + i;
            let lo = match p.window {
                Some(w) => (pos + 1).saturating_sub(w),
                None => 0,
            };
            let qs = &q[t * q_stride + g * group * hd..t * q_stride + (g + 1) * group * hd];
            let keys = Keys {
                k: kc,
                v: vc,
                offs: &offs[lo..=pos],
            };
            attend(qs, &keys, hd, p.scale, &mut scores, &mut acc);
            let base = t * q_stride + g * group * hd;
            // SAFETY: each (token, kv-head group) range is written by exactly one task, and
            // `base + group * hd <= out.len()` because `t < n_tokens` and `g < n_kv_heads`.
            unsafe {
                std::ptr::copy_nonoverlapping(acc.as_ptr(), out_ptr.get().add(base), group * hd);
            }
        }
    });
}

/// The keys and values one query attends to: `k[offs[j]..][..hd]`, `v[offs[j]..][..hd]`.
struct Keys<'a> {
    k: &'a [f32],
    v: &'a [f32],
    offs: &'a [usize],
}

/// One query's heads of a KV group (`qs`: `acc.len() / hd` heads) against `keys`: softmax
/// attention into `acc`; `scores` is scratch of at least heads x keys. The same operations for
/// a query whatever the batch, chunk or thread.
fn attend(qs: &[f32], keys: &Keys<'_>, hd: usize, scale: f32, scores: &mut [f32], acc: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::ops::has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { attend_avx2(qs, keys, hd, scale, scores, acc) };
    }
    attend_body(qs, keys, hd, scale, scores, acc)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(
    qs: &[f32],
    keys: &Keys<'_>,
    hd: usize,
    scale: f32,
    scores: &mut [f32],
    acc: &mut [f32],
) {
    attend_body(qs, keys, hd, scale, scores, acc)
}

#[inline(always)]
fn attend_body(
    qs: &[f32],
    keys: &Keys<'_>,
    hd: usize,
    scale: f32,
    scores: &mut [f32],
    acc: &mut [f32],
) {
    let (n, group) = (keys.offs.len(), acc.len() / hd);
    for (j, &off) in keys.offs.iter().enumerate() {
        let key = &keys.k[off..off + hd];
        for h in 0..group {
            scores[h * n + j] = dot_body(&qs[h * hd..h * hd + hd], key) * scale;
        }
    }
    for h in 0..group {
        softmax_body(&mut scores[h * n..h * n + n]);
    }
    acc.iter_mut().for_each(|a| *a = 0.0);
    for (j, &off) in keys.offs.iter().enumerate() {
        let val = &keys.v[off..off + hd];
        for h in 0..group {
            axpy_body(&mut acc[h * hd..h * hd + hd], scores[h * n + j], val);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference: contiguous K/V per sequence, naive loops in f64.
    fn naive(
        q: &[f32],
        ks: &[Vec<f32>],
        vs: &[Vec<f32>],
        p: &AttnParams,
        pos0: usize,
        n: usize,
    ) -> Vec<f32> {
        let hd = p.head_dim;
        let group = p.n_heads / p.n_kv_heads;
        let mut out = vec![0.0; n * p.n_heads * hd];
        for i in 0..n {
            let pos = pos0 + i;
            let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            for h in 0..p.n_heads {
                let g = h / group;
                let qh = &q[(i * p.n_heads + h) * hd..][..hd];
                let sc: Vec<f64> = (lo..=pos)
                    .map(|j| {
                        (0..hd)
                            .map(|d| qh[d] as f64 * ks[j][g * hd + d] as f64)
                            .sum::<f64>()
                            * p.scale as f64
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let v: f64 = (lo..=pos)
                        .zip(&e)
                        .map(|(j, w)| w / z * vs[j][g * hd + d] as f64)
                        .sum();
                    out[(i * p.n_heads + h) * hd + d] = v as f32;
                }
            }
        }
        out
    }

    fn rnd(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    }

    #[test]
    fn paged_matches_naive_with_scattered_blocks_gqa_and_windows() {
        let pool = ThreadPool::new(2);
        for window in [None, Some(5)] {
            let p = AttnParams {
                n_heads: 6,
                n_kv_heads: 2,
                head_dim: 8,
                scale: 0.35,
                window,
            };
            let bs = 4;
            let mut kv = PagedKv::new(1, 16, bs, 2, 8);
            let mut seed = 7u64;
            let total = 23; // prompt of 20 then a chunk of 3
            let table: Vec<u32> = vec![9, 2, 14, 0, 5, 11];
            let ks: Vec<Vec<f32>> = (0..total)
                .map(|_| (0..16).map(|_| rnd(&mut seed)).collect())
                .collect();
            let vs: Vec<Vec<f32>> = (0..total)
                .map(|_| (0..16).map(|_| rnd(&mut seed)).collect())
                .collect();
            let q: Vec<f32> = (0..total * 48).map(|_| rnd(&mut seed)).collect();
            for (pos0, n) in [(0usize, 20usize), (20, 3)] {
                let mut b = Batch::default();
                b.push(&vec![0; n], pos0, table.clone(), true);
                let k: Vec<f32> = ks[pos0..pos0 + n].concat();
                let v: Vec<f32> = vs[pos0..pos0 + n].concat();
                write_kv(&mut kv, 0, &b, &k, &v);
                let qq = &q[pos0 * 48..(pos0 + n) * 48];
                let mut out = vec![0.0; qq.len()];
                paged_attention(&pool, &p, &b, qq, &kv, 0, &mut out);
                let want = naive(qq, &ks, &vs, &p, pos0, n);
                for (a, b) in out.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-5, "window {window:?}: {a} vs {b}");
                }
            }
        }
    }
}
