//! Timed forward passes: a prefill of a whole prompt, and decode steps of a batch.

use std::time::Instant;

use crate::error::{Error, Result};
use crate::ids::TokenId;
use crate::model::batch::Batch;
use crate::model::{CausalLm, KvCache, Logits, LogitsWant};

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

/// What one timed prefill computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillSpec {
    /// Prompt length in tokens, cached prefix included.
    pub len: usize,
    /// Leading tokens computed once, before any timed repeat, and shared by every repeat
    /// (a prefix-cache hit). Rounded down to whole KV blocks, as the engine caches them.
    pub cached_prefix: usize,
    /// Forward passes of at most this many tokens (chunked prefill); `None`: one pass.
    pub chunk: Option<usize>,
}

impl PrefillSpec {
    /// The whole prompt in one pass, nothing cached.
    pub fn whole(len: usize) -> PrefillSpec {
        PrefillSpec {
            len,
            cached_prefix: 0,
            chunk: None,
        }
    }

    /// The cached prefix actually used: whole blocks only, and at least one token left to
    /// compute.
    pub fn effective_prefix(&self) -> usize {
        let p = self.cached_prefix.min(self.len.saturating_sub(1));
        p - p % BLOCK
    }
}

/// A prefill benchmark point: owns the KV cache, with the cached prefix (if any) already
/// computed; each [`PrefillBench::run`] times the uncached suffix, written into blocks of its
/// own as a request forked from the prefix would be.
pub struct PrefillBench<'m> {
    model: &'m dyn CausalLm,
    spec: PrefillSpec,
    prefix: usize,
    kv: KvCache,
    table: Vec<u32>,
}

impl<'m> PrefillBench<'m> {
    /// Allocates the cache and computes the prefix (untimed).
    pub fn new(model: &'m dyn CausalLm, spec: PrefillSpec) -> Result<PrefillBench<'m>> {
        if spec.len == 0 {
            return Err(Error::BadRequest(
                "prefill length must be at least 1".into(),
            ));
        }
        if spec.chunk == Some(0) {
            return Err(Error::BadRequest("chunk size must be at least 1".into()));
        }
        let prefix = spec.effective_prefix();
        let (kv, per_seq) = kv_for(model, 1, spec.len)?;
        let table: Vec<u32> = (0..per_seq as u32).collect();
        let mut bench = PrefillBench {
            model,
            spec,
            prefix,
            kv,
            table,
        };
        if prefix > 0 {
            let tokens = synthetic_prompt(prefix, model.config().vocab, 0xC0FFEE);
            bench.forward_chunks(&tokens, 0)?;
        }
        Ok(bench)
    }

    /// Tokens served from the cache in every repeat.
    pub fn cached_prefix(&self) -> usize {
        self.prefix
    }

    /// Seconds to compute the uncached suffix (its content drawn from `seed`), in chunks.
    pub fn run(&mut self, seed: u64) -> Result<f64> {
        let suffix = synthetic_prompt(self.spec.len - self.prefix, self.model.config().vocab, seed);
        let t = Instant::now();
        self.forward_chunks(&suffix, self.prefix)?;
        Ok(t.elapsed().as_secs_f64())
    }

    fn forward_chunks(&mut self, tokens: &[TokenId], start: usize) -> Result<()> {
        let chunk = self.spec.chunk.unwrap_or(tokens.len()).max(1);
        let mut pos = start;
        for part in tokens.chunks(chunk) {
            let last = pos + part.len() == start + tokens.len();
            let mut b = Batch::default();
            b.push(part, pos, self.table.clone(), last);
            self.model
                .forward_select(&b, &mut self.kv, LogitsWant::Argmax)?;
            pos += part.len();
        }
        Ok(())
    }
}

/// Seconds to prefill one prompt of `len` tokens (one forward pass, logits of the last token).
pub fn prefill_once(model: &dyn CausalLm, len: usize, seed: u64) -> Result<f64> {
    PrefillBench::new(model, PrefillSpec::whole(len))?.run(seed)
}

/// Prefills `batch` prompts of `prompt_len` (untimed), then times `steps` decode steps of the
/// whole batch, each feeding back the greedy token. Returns seconds per step.
pub fn decode_steps(
    model: &dyn CausalLm,
    batch: usize,
    prompt_len: usize,
    steps: usize,
) -> Result<Vec<f64>> {
    if batch == 0 || prompt_len == 0 || steps == 0 {
        return Err(Error::BadRequest(format!(
            "a decode benchmark needs at least one sequence, prompt token and step \
             (batch {batch}, prompt length {prompt_len}, steps {steps})"
        )));
    }
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
        last.push(greedy(model, &b, &mut kv)?[0]);
    }
    let mut times = Vec::with_capacity(steps);
    for s in 0..steps {
        let mut b = Batch::default();
        for (i, table) in tables.iter().enumerate() {
            b.push(&[last[i]], prompt_len + s, table.clone(), true);
        }
        let t = Instant::now();
        last = greedy(model, &b, &mut kv)?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(times)
}

/// The greedy token of each row of `b` (selected where the model runs: on a GPU only the ids
/// come back, as in a framework whose decode loop takes the argmax on the device).
fn greedy(model: &dyn CausalLm, b: &Batch, kv: &mut KvCache) -> Result<Vec<TokenId>> {
    match model.forward_select(b, kv, LogitsWant::Argmax)? {
        Logits::Argmax(ids) if ids.len() == b.logits_for.len() => Ok(ids),
        _ => Err(Error::BadRequest(
            "the model answered an argmax request with something else".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Device;

    #[test]
    fn cached_prefix_is_whole_blocks_and_leaves_a_token_to_compute() {
        let spec = |len, cached_prefix| PrefillSpec {
            len,
            cached_prefix,
            chunk: None,
        };
        assert_eq!(spec(100, 40).effective_prefix(), 32);
        assert_eq!(spec(100, 15).effective_prefix(), 0);
        assert_eq!(spec(32, 32).effective_prefix(), 16);
        assert_eq!(spec(33, 32).effective_prefix(), 32);
    }

    #[test]
    fn chunked_and_cached_prefill_runs_and_bad_specs_are_refused() {
        let m = crate::model::random::load("tiny", 7, Device::Cpu { threads: 1 }).unwrap();
        let model = m.model.as_ref();
        let mut b = PrefillBench::new(
            model,
            PrefillSpec {
                len: 70,
                cached_prefix: 40,
                chunk: Some(9),
            },
        )
        .unwrap();
        assert_eq!(b.cached_prefix(), 32);
        for seed in 0..3 {
            assert!(b.run(seed).unwrap() >= 0.0);
        }
        let bad = |len, chunk| {
            PrefillBench::new(
                model,
                PrefillSpec {
                    len,
                    cached_prefix: 0,
                    chunk,
                },
            )
            .is_err()
        };
        assert!(bad(0, None));
        assert!(bad(8, Some(0)));
    }

    #[test]
    fn decode_steps_time_every_step_and_refuse_empty_shapes() {
        let m = crate::model::random::load("tiny", 7, Device::Cpu { threads: 1 }).unwrap();
        let model = m.model.as_ref();
        assert_eq!(decode_steps(model, 2, 5, 3).unwrap().len(), 3);
        for (batch, len, steps) in [(0, 5, 3), (2, 0, 3), (2, 5, 0)] {
            let e = decode_steps(model, batch, len, steps)
                .unwrap_err()
                .to_string();
            assert!(e.contains("at least one"), "{e}");
        }
    }
}
