//! Perplexity of a text under the model: teacher-forced windows, every position's next-token
//! log-probability.

use crate::error::{Error, Result};
use crate::ids::TokenId;
use crate::model::batch::Batch;
use crate::model::CausalLm;

/// Perplexity result.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Perplexity {
    pub tokens_scored: usize,
    pub mean_nll: f64,
    pub ppl: f64,
}

/// Scores `tokens` in windows of at most `window` tokens (each window starts a fresh cache).
pub fn perplexity(model: &dyn CausalLm, tokens: &[TokenId], window: usize) -> Result<Perplexity> {
    let window = window.clamp(2, model.config().context_len);
    if tokens.len() < 2 {
        return Err(Error::BadRequest(
            "perplexity needs a text of at least two tokens".into(),
        ));
    }
    let vocab = model.config().vocab;
    let block = 16;
    let mut nll = 0.0f64;
    let mut n = 0usize;
    for chunk in tokens.chunks(window) {
        if chunk.len() < 2 {
            continue;
        }
        let blocks = chunk.len().div_ceil(block);
        let mut kv = model.new_kv(blocks, block)?;
        let mut b = Batch::default();
        b.push(chunk, 0, (0..blocks as u32).collect(), false);
        b.logits_for = (0..chunk.len() - 1).collect();
        let logits = model.forward(&b, &mut kv)?;
        for (i, row) in logits.chunks_exact(vocab).enumerate() {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&l| (l as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            nll += lse - row[chunk[i + 1] as usize] as f64;
            n += 1;
        }
    }
    let mean_nll = nll / n as f64;
    Ok(Perplexity {
        tokens_scored: n,
        mean_nll,
        ppl: mean_nll.exp(),
    })
}
