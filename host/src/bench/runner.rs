//! Timed forward passes: a prefill of a whole prompt, and decode steps of a batch.

use std::time::Instant;

use crate::error::Result;
use crate::ids::TokenId;
use crate::model::batch::Batch;
use crate::model::{CausalLm, KvCache};

const BLOCK: usize = 16;

/// Deterministic pseudo-random prompt tokens (the content does not change the work).
pub fn synthetic_prompt(len: usize, vocab: usize, seed: u64) -> Vec<TokenId> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as TokenId
        })
        .collect()
}

fn kv_for(model: &dyn CausalLm, seqs: usize, tokens: usize) -> Result<(KvCache, usize)> {
    let per_seq = tokens.div_ceil(BLOCK);
    Ok((model.new_kv(seqs * per_seq, BLOCK)?, per_seq))
}

/// Seconds to prefill one prompt of `len` tokens (one forward pass, logits of the last token).
pub fn prefill_once(model: &dyn CausalLm, len: usize, seed: u64) -> Result<f64> {
    let prompt = synthetic_prompt(len, model.config().vocab, seed);
    let (mut kv, per_seq) = kv_for(model, 1, len)?;
    let mut b = Batch::default();
    b.push(&prompt, 0, (0..per_seq as u32).collect(), true);
    let t = Instant::now();
    model.forward(&b, &mut kv)?;
    Ok(t.elapsed().as_secs_f64())
}

/// Prefills `batch` prompts of `prompt_len` (untimed), then times `steps` decode steps of the
/// whole batch, each feeding back the greedy token. Returns seconds per step.
pub fn decode_steps(
    model: &dyn CausalLm,
    batch: usize,
    prompt_len: usize,
    steps: usize,
) -> Result<Vec<f64>> {
    let vocab = model.config().vocab;
    let (mut kv, per_seq) = kv_for(model, batch, prompt_len + steps + 1)?;
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
        .collect();
    let mut last = Vec::with_capacity(batch);
    for (i, table) in tables.iter().enumerate() {
        let mut b = Batch::default();
        b.push(
            &synthetic_prompt(prompt_len, vocab, i as u64 + 1),
            0,
            table.clone(),
            true,
        );
        let logits = model.forward(&b, &mut kv)?;
        last.push(argmax(&logits));
    }
    let mut times = Vec::with_capacity(steps);
    for s in 0..steps {
        let mut b = Batch::default();
        for (i, table) in tables.iter().enumerate() {
            b.push(&[last[i]], prompt_len + s, table.clone(), true);
        }
        let t = Instant::now();
        let logits = model.forward(&b, &mut kv)?;
        times.push(t.elapsed().as_secs_f64());
        for (i, l) in logits.chunks_exact(vocab).enumerate() {
            last[i] = argmax(l);
        }
    }
    Ok(times)
}

fn argmax(l: &[f32]) -> TokenId {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as TokenId
}
