//! Multi-head latent attention (DeepSeek-AI, 2024, "DeepSeek-V2", section 2.1): the paged
//! latent cache and the two ways of attending over it.
//!
//! The cache keeps, per token and layer, the normalized KV latent `c` (`kv_lora_rank` floats)
//! and the shared rotary key `k_pe` (`qk_rope_head_dim` floats) — never expanded K/V. Prefill
//! uses the expanded form (each cached latent is multiplied out by `kv_b_proj` into per-head
//! `k_nope` and `v`); decode uses the absorbed form (the query is projected into latent space
//! by `W_UK^T`, scores are taken against the latents, and `W_UV` is applied once to the
//! weighted latent sum). Host code over f32 slices; it must not know about checkpoints.

use crate::backend::cpu::ops::dot;
use crate::error::{Error, Result};
use crate::model::batch::{Batch, SeqSlice};

/// Which MLA form a forward pass uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlaPath {
    /// Absorbed for sequences running one token (decode), expanded otherwise (prefill).
    Auto,
    /// Absorbed for every sequence.
    Absorbed,
    /// Expanded for every sequence.
    Expanded,
}

/// Head shapes of one MLA layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaDims {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    /// `kv_lora_rank`.
    pub latent: usize,
}

impl MlaDims {
    pub fn q_width(&self) -> usize {
        self.heads * (self.nope + self.rope)
    }
    /// Rows of one head's block of `kv_b_proj` (`k_nope` rows, then `v` rows).
    fn kvb_rows(&self) -> usize {
        self.nope + self.v
    }

    /// Whether a step of `tokens` new tokens over `ctx_rows` context rows in all (cached and
    /// new) with `pairs` causal (query, key) pairs costs fewer multiply-adds in the expanded
    /// form than in the absorbed one. The expanded form projects every context row through
    /// `kv_b` (latent × heads × (nope + v)), where the absorbed form projects each new token's
    /// query and output through the same rows; a pair and head then takes (nope + rope) + v
    /// values instead of (latent + rope) + latent. So a fresh prompt (every context row new)
    /// always pays, a decode step over a long context never does.
    pub fn expanded_pays(&self, ctx_rows: usize, tokens: usize, pairs: u64) -> bool {
        let row = (self.latent * self.heads * self.kvb_rows()) as u128;
        let absorbed = (2 * self.latent + self.rope) as u128;
        let expanded = (self.nope + self.rope + self.v) as u128;
        let saved = absorbed.saturating_sub(expanded) * self.heads as u128;
        (ctx_rows.saturating_sub(tokens) as u128) * row < pairs as u128 * saved
    }
}

/// Everything an MLA attention operation needs besides its buffers and weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaParams {
    pub dims: MlaDims,
    /// Softmax scale (YaRN's mscale correction included).
    pub scale: f32,
    /// YaRN's cos/sin factor (1 without YaRN).
    pub rope_scale: f32,
    /// Rotary pairs are adjacent dims (DeepSeek) rather than halves.
    pub interleaved: bool,
    /// Epsilon of `kv_a_layernorm`.
    pub eps: f32,
    pub path: MlaPath,
}

/// The prepared weights an MLA attention operation reads (backend weight type `W`).
pub struct MlaWeights<'a, W> {
    /// `kv_a_layernorm` gain (a vector of `latent` floats).
    pub kv_a_norm: &'a W,
    /// `kv_b_proj`, `[heads * (nope + v), latent]`.
    pub kv_b: &'a W,
    /// Rotary inverse frequencies (a vector of `rope / 2` floats, YaRN-corrected).
    pub inv_freq: &'a W,
}

/// The host form of one MLA layer (what the CPU backend runs): normalizes the latents of
/// `kva` (`[n, latent + rope]`, the `kv_a_proj_with_mqa` output), rotates the rope key and the
/// queries' rope parts in place by each token's position, writes the cache and attends.
#[allow(clippy::too_many_arguments)]
pub fn host_layer(
    p: &MlaParams,
    kv: &mut MlaKv,
    layer: usize,
    batch: &Batch,
    kv_a_norm: &[f32],
    kv_b: &[f32],
    inv_freq: &[f32],
    q: &mut [f32],
    kva: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let d = &p.dims;
    let n = batch.n_tokens();
    let (r, dr) = (d.latent, d.rope);
    if kva.len() < n * (r + dr) || q.len() < n * d.q_width() || out.len() < n * d.heads * d.v {
        return Err(Error::BadRequest(format!(
            "MLA buffers too small for {n} tokens of {d:?}"
        )));
    }
    if kv_a_norm.len() != r || inv_freq.len() * 2 != dr {
        return Err(Error::BadConfig(format!(
            "MLA weights disagree with {d:?}: kv_a_layernorm {}, {} rotary frequencies",
            kv_a_norm.len(),
            inv_freq.len()
        )));
    }
    let mut latent = Vec::with_capacity(n * r);
    let mut k_pe = Vec::with_capacity(n * dr);
    for row in kva[..n * (r + dr)].chunks_exact(r + dr) {
        latent.extend_from_slice(&row[..r]);
        k_pe.extend_from_slice(&row[r..]);
    }
    rms_norm_rows(&mut latent, kv_a_norm, p.eps);
    let qk = d.nope + d.rope;
    for (t, &pos) in batch.positions().iter().enumerate() {
        rotate(
            &mut k_pe[t * dr..(t + 1) * dr],
            pos,
            inv_freq,
            p.rope_scale,
            p.interleaved,
        );
        for h in 0..d.heads {
            let base = (t * d.heads + h) * qk + d.nope;
            rotate(
                &mut q[base..base + dr],
                pos,
                inv_freq,
                p.rope_scale,
                p.interleaved,
            );
        }
    }
    kv.write(layer, batch, &latent, &k_pe)?;
    attention(
        p.path,
        d,
        kv,
        layer,
        batch,
        &q[..n * d.q_width()],
        kv_b,
        p.scale,
        &mut out[..n * d.heads * d.v],
    )
}

/// Paged latent cache: `[layers][num_blocks * block_size][latent + rope]` floats.
pub struct MlaKv {
    layers: usize,
    num_blocks: usize,
    block_size: usize,
    width: usize,
    data: Vec<f32>,
}

impl MlaKv {
    pub fn new(layers: usize, num_blocks: usize, block_size: usize, width: usize) -> Result<MlaKv> {
        let n = layers
            .checked_mul(num_blocks)
            .and_then(|x| x.checked_mul(block_size))
            .and_then(|x| x.checked_mul(width))
            .ok_or_else(|| Error::BadConfig("MLA cache size overflows".into()))?;
        if block_size == 0 {
            return Err(Error::BadConfig("KV block_size must be at least 1".into()));
        }
        Ok(MlaKv {
            layers,
            num_blocks,
            block_size,
            width,
            data: vec![0.0; n],
        })
    }

    /// Floats per token per layer.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }

    fn slot(&self, seq: &SeqSlice, pos: usize) -> Result<usize> {
        let b = *seq.block_table.get(pos / self.block_size).ok_or_else(|| {
            Error::BadRequest(format!(
                "block table of {} blocks does not cover position {pos}",
                seq.block_table.len()
            ))
        })? as usize;
        if b >= self.num_blocks {
            return Err(Error::BadRequest(format!(
                "block {b} is outside the MLA cache ({} blocks)",
                self.num_blocks
            )));
        }
        Ok(b * self.block_size + pos % self.block_size)
    }

    fn row(&self, layer: usize, slot: usize) -> &[f32] {
        let base = (layer * self.num_blocks * self.block_size + slot) * self.width;
        &self.data[base..base + self.width]
    }

    /// Stores the step's latents (`[n, latent]`) and rotary keys (`[n, rope]`) in `layer`.
    pub fn write(
        &mut self,
        layer: usize,
        batch: &Batch,
        latent: &[f32],
        k_pe: &[f32],
    ) -> Result<()> {
        if layer >= self.layers {
            return Err(Error::BadRequest(format!(
                "MLA cache has {} layers, layer {layer} asked",
                self.layers
            )));
        }
        let r = self.width - k_pe.len() / batch.n_tokens().max(1);
        let dr = self.width - r;
        for s in &batch.seqs {
            for i in 0..s.len {
                let slot = self.slot(s, s.pos + i)?;
                let t = s.start + i;
                let base = (layer * self.num_blocks * self.block_size + slot) * self.width;
                let row = &mut self.data[base..base + self.width];
                row[..r].copy_from_slice(&latent[t * r..(t + 1) * r]);
                row[r..].copy_from_slice(&k_pe[t * dr..(t + 1) * dr]);
            }
        }
        Ok(())
    }
}

/// Rotates the rotary part of a row by `pos`: adjacent pairs (DeepSeek) or halves, each
/// rotated value scaled by `scale` (YaRN's cos/sin factor).
pub fn rotate(v: &mut [f32], pos: u32, inv_freq: &[f32], scale: f32, interleaved: bool) {
    let half = inv_freq.len();
    for (i, &f) in inv_freq.iter().enumerate() {
        let (s, c) = ((f * pos as f32) as f64).sin_cos();
        let (c, s) = (c as f32 * scale, s as f32 * scale);
        let (a, b) = if interleaved {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + half)
        };
        let (x, y) = (v[a], v[b]);
        v[a] = x * c - y * s;
        v[b] = y * c + x * s;
    }
}

/// Row-wise RMSNorm on the host.
pub fn rms_norm_rows(x: &mut [f32], gain: &[f32], eps: f32) {
    let d = gain.len();
    for row in x.chunks_exact_mut(d) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(gain) {
            *v = g * (*v * r);
        }
    }
}

fn softmax_in_place(s: &mut [f32]) {
    let m = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut sum = 0.0;
    for v in s.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    for v in s.iter_mut() {
        *v /= sum;
    }
}

/// Attends every query token of `batch` over its sequence's cached latents in `layer`.
///
/// `q`: `[n, heads, nope + rope]` with the rotary part already rotated; `w_kvb`: `kv_b_proj`
/// as `[heads * (nope + v), latent]`; `out`: `[n, heads * v]`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    path: MlaPath,
    d: &MlaDims,
    kv: &MlaKv,
    layer: usize,
    batch: &Batch,
    q: &[f32],
    w_kvb: &[f32],
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    if w_kvb.len() != d.heads * d.kvb_rows() * d.latent || kv.width != d.latent + d.rope {
        return Err(Error::BadConfig(format!(
            "MLA shapes disagree: kv_b_proj has {} floats for {:?}, cache width {}",
            w_kvb.len(),
            d,
            kv.width
        )));
    }
    for s in &batch.seqs {
        let absorbed = match path {
            MlaPath::Absorbed => true,
            MlaPath::Expanded => false,
            MlaPath::Auto => s.len == 1,
        };
        let ctx = s.pos + s.len;
        let slots = (0..ctx)
            .map(|p| kv.slot(s, p))
            .collect::<Result<Vec<usize>>>()?;
        let rows: Vec<&[f32]> = slots.iter().map(|&sl| kv.row(layer, sl)).collect();
        if absorbed {
            absorbed_seq(d, s, &rows, q, w_kvb, scale, out);
        } else {
            expanded_seq(d, s, &rows, q, w_kvb, scale, out);
        }
    }
    Ok(())
}

/// Absorbed form: `score_k = (W_UK^T q_nope) . c_k + q_pe . k_pe_k`, `out = W_UV sum p_k c_k`.
fn absorbed_seq(
    d: &MlaDims,
    s: &SeqSlice,
    rows: &[&[f32]],
    q: &[f32],
    w: &[f32],
    scale: f32,
    out: &mut [f32],
) {
    let (r, qw) = (d.latent, d.nope + d.rope);
    let mut q_lat = vec![0.0f32; r];
    let mut o_lat = vec![0.0f32; r];
    let mut scores = Vec::with_capacity(rows.len());
    for i in 0..s.len {
        let t = s.start + i;
        let visible = s.pos + i + 1;
        for h in 0..d.heads {
            let qh = &q[(t * d.heads + h) * qw..(t * d.heads + h + 1) * qw];
            let wh = &w[h * d.kvb_rows() * r..(h + 1) * d.kvb_rows() * r];
            q_lat.fill(0.0);
            for j in 0..d.nope {
                crate::backend::cpu::ops::axpy(&mut q_lat, qh[j], &wh[j * r..(j + 1) * r]);
            }
            scores.clear();
            scores.extend(
                rows[..visible]
                    .iter()
                    .map(|row| (dot(&q_lat, &row[..r]) + dot(&qh[d.nope..], &row[r..])) * scale),
            );
            softmax_in_place(&mut scores);
            o_lat.fill(0.0);
            for (row, &p) in rows[..visible].iter().zip(&scores) {
                crate::backend::cpu::ops::axpy(&mut o_lat, p, &row[..r]);
            }
            let oh = &mut out[(t * d.heads + h) * d.v..(t * d.heads + h + 1) * d.v];
            for (j, o) in oh.iter_mut().enumerate() {
                *o = dot(&wh[(d.nope + j) * r..(d.nope + j + 1) * r], &o_lat);
            }
        }
    }
}

/// Expanded form: every cached latent multiplied out into per-head `k_nope` and `v`, then
/// ordinary attention with keys `[k_nope, k_pe]`.
fn expanded_seq(
    d: &MlaDims,
    s: &SeqSlice,
    rows: &[&[f32]],
    q: &[f32],
    w: &[f32],
    scale: f32,
    out: &mut [f32],
) {
    let (r, qw, kr) = (d.latent, d.nope + d.rope, d.kvb_rows());
    let ctx = rows.len();
    // kv[k][h] = W_h c_k: nope key rows then value rows
    let mut kv = vec![0.0f32; ctx * d.heads * kr];
    for (k, row) in rows.iter().enumerate() {
        for (o, wr) in kv[k * d.heads * kr..(k + 1) * d.heads * kr]
            .iter_mut()
            .zip(w.chunks_exact(r))
        {
            *o = dot(wr, &row[..r]);
        }
    }
    let mut scores = Vec::with_capacity(ctx);
    for i in 0..s.len {
        let t = s.start + i;
        let visible = s.pos + i + 1;
        for h in 0..d.heads {
            let qh = &q[(t * d.heads + h) * qw..(t * d.heads + h + 1) * qw];
            scores.clear();
            scores.extend((0..visible).map(|k| {
                let kh = &kv[(k * d.heads + h) * kr..(k * d.heads + h) * kr + d.nope];
                (dot(&qh[..d.nope], kh) + dot(&qh[d.nope..], &rows[k][r..])) * scale
            }));
            softmax_in_place(&mut scores);
            let oh = &mut out[(t * d.heads + h) * d.v..(t * d.heads + h + 1) * d.v];
            oh.fill(0.0);
            for (k, &p) in scores.iter().enumerate() {
                let vh = &kv[(k * d.heads + h) * kr + d.nope..(k * d.heads + h + 1) * kr];
                crate::backend::cpu::ops::axpy(oh, p, vh);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn absorbed_and_expanded_agree_over_a_paged_cache() {
        let d = MlaDims {
            heads: 3,
            nope: 8,
            rope: 4,
            v: 6,
            latent: 10,
        };
        let mut seed = 9;
        let w: Vec<f32> = (0..d.heads * (d.nope + d.v) * d.latent)
            .map(|_| lcg(&mut seed))
            .collect();
        let mut kv = MlaKv::new(2, 8, 4, d.latent + d.rope).unwrap();
        // two sequences: 7 tokens at 0.., and 3 tokens after 5 cached ones
        let mut batch = Batch::default();
        batch.push(&[1; 7], 0, vec![3, 5], true);
        batch.push(&[2; 3], 5, vec![0, 6], true);
        let n = batch.n_tokens();
        let lat: Vec<f32> = (0..n * d.latent).map(|_| lcg(&mut seed)).collect();
        let kpe: Vec<f32> = (0..n * d.rope).map(|_| lcg(&mut seed)).collect();
        // positions 0..5 of the second sequence were cached earlier
        let mut prev = Batch::default();
        prev.push(&[2; 5], 0, vec![0, 6], false);
        let plat: Vec<f32> = (0..5 * d.latent).map(|_| lcg(&mut seed)).collect();
        let pkpe: Vec<f32> = (0..5 * d.rope).map(|_| lcg(&mut seed)).collect();
        kv.write(1, &prev, &plat, &pkpe).unwrap();
        kv.write(1, &batch, &lat, &kpe).unwrap();
        let q: Vec<f32> = (0..n * d.q_width()).map(|_| lcg(&mut seed)).collect();
        let mut a = vec![0.0; n * d.heads * d.v];
        let mut e = vec![0.0; n * d.heads * d.v];
        attention(MlaPath::Absorbed, &d, &kv, 1, &batch, &q, &w, 0.3, &mut a).unwrap();
        attention(MlaPath::Expanded, &d, &kv, 1, &batch, &q, &w, 0.3, &mut e).unwrap();
        let err = a
            .iter()
            .zip(&e)
            .map(|(x, y)| (x - y).abs() / y.abs().max(1e-2))
            .fold(0.0f32, f32::max);
        assert!(err < 1e-5, "absorbed vs expanded: {err}");
        assert!(e.iter().any(|v| v.abs() > 1e-3));
        // a block table that is too short is an error, not a panic
        let mut short = Batch::default();
        short.push(&[1; 5], 0, vec![3], true);
        assert!(attention(MlaPath::Auto, &d, &kv, 1, &short, &q, &w, 0.3, &mut e).is_err());
    }

    #[test]
    fn interleaved_rotation_pairs_adjacent_dims() {
        let mut v = vec![1.0, 0.0, 0.0, 1.0];
        rotate(&mut v, 1, &[std::f32::consts::FRAC_PI_2, 0.0], 1.0, true);
        assert!((v[0]).abs() < 1e-6 && (v[1] - 1.0).abs() < 1e-6, "{v:?}");
        assert!((v[2]).abs() < 1e-6 && (v[3] - 1.0).abs() < 1e-6, "{v:?}");
    }

    #[test]
    fn the_expanded_form_pays_for_prompts_not_for_decode_steps() {
        // DeepSeek-V3's heads: 16 of nope 128, rope 64, v 128 over a latent of 512
        let d = MlaDims {
            heads: 16,
            nope: 128,
            rope: 64,
            v: 128,
            latent: 512,
        };
        let pairs = |runs: &[(u64, u64)]| {
            runs.iter()
                .map(|&(pos, len)| len * pos + len * (len + 1) / 2)
                .sum::<u64>()
        };
        // a fresh prompt: nothing to expand beyond its own tokens
        assert!(d.expanded_pays(2048, 2048, pairs(&[(0, 2048)])));
        assert!(d.expanded_pays(2, 2, pairs(&[(0, 2)])));
        // 64 decode tokens over contexts of 128: every cached row would be expanded for one query
        assert!(!d.expanded_pays(64 * 129, 64, pairs(&[(128, 1); 64])));
        // a 512-token chunk after 1,536 cached tokens: the pairs outweigh the history's expansion
        assert!(d.expanded_pays(2048, 512, pairs(&[(1536, 512)])));
        // 8 new tokens after 4,096: they do not
        assert!(!d.expanded_pays(4104, 8, pairs(&[(4096, 8)])));
    }
}
