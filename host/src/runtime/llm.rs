//! `Llm`: the offline library API. Requests are prepared (templated, tokenized, checked), run
//! in batches — prompts packed into prefill steps, then all live sequences decoded together —
//! and sampled through a [`BatchSampler`]. A request that fails (bad prompt, sampler error)
//! yields an output with `finish_reason = error`; the others keep running.

use std::sync::Arc;
use std::time::Instant;

use super::request::{FinishReason, PromptInput, Request, RequestOutput, Timings};
use crate::error::{Error, Result};
use crate::ids::TokenId;
use crate::model::batch::Batch;
use crate::model::{KvCache, LoadedModel};
use crate::sampling::{BatchSampler, SampleRow, SamplingParams};

/// Engine settings resolved once at start.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most sequences decoded together.
    pub max_batch: usize,
    /// Most prompt tokens run in one prefill step.
    pub prefill_chunk: usize,
    /// Seed for requests that give none.
    pub seed: u64,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            block_size: 16,
            max_batch: 64,
            prefill_chunk: 512,
            seed: 0,
        }
    }
}

/// A live sequence.
struct Seq {
    idx: usize,
    prompt: Vec<TokenId>,
    out: Vec<TokenId>,
    params: SamplingParams,
    seed: u64,
    blocks: Vec<u32>,
    /// Tokens already in the KV cache.
    cached: usize,
    t_first: Option<Instant>,
    done: Option<FinishReason>,
    error: Option<String>,
    text: String,
}

impl Seq {
    fn history(&self) -> Vec<TokenId> {
        let mut h = self.prompt.clone();
        h.extend_from_slice(&self.out);
        h
    }
}

/// An offline inference engine over one loaded model.
pub struct Llm {
    model: LoadedModel,
    sampler: Arc<dyn BatchSampler>,
    opts: EngineOptions,
}

impl Llm {
    pub fn new(model: LoadedModel, sampler: Arc<dyn BatchSampler>, opts: EngineOptions) -> Llm {
        Llm { model, sampler, opts }
    }

    pub fn model(&self) -> &LoadedModel {
        &self.model
    }

    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    /// Templated prompt text (if any) and its token ids, with the request's limits checked.
    pub fn prepare(&self, req: &Request) -> Result<(Option<String>, Vec<TokenId>)> {
        req.params.validate().map_err(Error::BadRequest)?;
        let tok = &self.model.tokenizer;
        let (text, ids) = match &req.prompt {
            PromptInput::Text(t) => (Some(t.clone()), tok.encode(t)?),
            PromptInput::Chat(msgs) => {
                let tpl = self
                    .model
                    .chat_template
                    .as_ref()
                    .ok_or_else(|| Error::ChatTemplate("the model has no chat template".into()))?;
                let t = tpl.render(msgs, true)?;
                let ids = tok.encode(&t)?;
                (Some(t), ids)
            }
            PromptInput::Tokens(ids) => (None, ids.clone()),
        };
        if ids.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let cfg = self.model.model.config();
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= cfg.vocab) {
            return Err(Error::BadRequest(format!("prompt token id {bad} is outside the vocabulary ({})", cfg.vocab)));
        }
        let needed = ids.len() + req.params.max_tokens;
        if needed > cfg.context_len {
            return Err(Error::PromptTooLong {
                prompt_tokens: ids.len(),
                max_tokens: req.params.max_tokens,
                needed,
                context: cfg.context_len,
            });
        }
        Ok((text, ids))
    }

    /// Runs every request to completion; `on_done` sees each output as it finishes. The
    /// returned outputs are in request order.
    pub fn generate(&self, requests: &[Request], on_done: &mut dyn FnMut(&RequestOutput)) -> Vec<RequestOutput> {
        let t0 = Instant::now();
        let mut outputs: Vec<Option<RequestOutput>> = vec![None; requests.len()];
        let mut pending = Vec::new();
        for (idx, req) in requests.iter().enumerate() {
            match self.prepare(req) {
                Ok((text, ids)) => pending.push((idx, text, ids)),
                Err(e) => {
                    let out = RequestOutput::failed(req.id.clone(), prompt_text(&req.prompt), e.to_string());
                    on_done(&out);
                    outputs[idx] = Some(out);
                }
            }
        }
        let mut texts: Vec<Option<String>> = vec![None; requests.len()];
        for wave in pending.chunks(self.opts.max_batch.max(1)) {
            let mut seqs = Vec::with_capacity(wave.len());
            let mut next_block = 0u32;
            for (idx, text, ids) in wave {
                let params = requests[*idx].params.clone();
                let n_blocks = (ids.len() + params.max_tokens).div_ceil(self.opts.block_size);
                let blocks: Vec<u32> = (next_block..next_block + n_blocks as u32).collect();
                next_block += n_blocks as u32;
                texts[*idx] = text.clone();
                seqs.push(Seq {
                    idx: *idx,
                    seed: params.seed.unwrap_or_else(|| mix(self.opts.seed, *idx as u64)),
                    prompt: ids.clone(),
                    out: Vec::new(),
                    params,
                    blocks,
                    cached: 0,
                    t_first: None,
                    done: None,
                    error: None,
                    text: String::new(),
                });
            }
            match self.model.model.new_kv(next_block as usize, self.opts.block_size) {
                Ok(mut kv) => self.run_wave(&mut seqs, &mut kv),
                Err(e) => {
                    for s in &mut seqs {
                        s.done = Some(FinishReason::Error);
                        s.error = Some(format!("allocating the KV cache failed: {e}"));
                    }
                }
            }
            for s in seqs {
                let req = &requests[s.idx];
                let elapsed = t0.elapsed().as_secs_f64();
                let (ttft, decode_rate) = match s.t_first {
                    Some(tf) => {
                        let since_first = tf.elapsed().as_secs_f64();
                        let rate = if s.out.len() > 1 && since_first > 0.0 { (s.out.len() - 1) as f64 / since_first } else { 0.0 };
                        ((tf - t0).as_secs_f64(), rate)
                    }
                    None => (elapsed, 0.0),
                };
                let out = RequestOutput {
                    id: req.id.clone(),
                    prompt: texts[s.idx].take(),
                    prompt_token_ids: s.prompt,
                    text: s.text,
                    token_ids: s.out,
                    finish_reason: s.done.unwrap_or(FinishReason::Length),
                    error: s.error,
                    timings: Timings { time_to_first_token_s: ttft, decode_tok_per_s: decode_rate, total_s: elapsed },
                };
                on_done(&out);
                outputs[s.idx] = Some(out);
            }
        }
        outputs.into_iter().map(|o| o.expect("every request yields an output")).collect()
    }

    /// Prefills then decodes one wave of sequences until all are done.
    fn run_wave(&self, seqs: &mut [Seq], kv: &mut KvCache) {
        // Prefill: pack prompt chunks of several sequences into each step.
        loop {
            let mut batch = Batch::default();
            let mut members = Vec::new();
            let mut rows = Vec::new();
            for (i, s) in seqs.iter().enumerate() {
                let room = self.opts.prefill_chunk.saturating_sub(batch.n_tokens());
                if room == 0 {
                    break;
                }
                if s.done.is_some() || s.cached >= s.prompt.len() {
                    continue;
                }
                let n = room.min(s.prompt.len() - s.cached);
                let last = s.cached + n == s.prompt.len();
                batch.push(&s.prompt[s.cached..s.cached + n], s.cached, s.blocks.clone(), last);
                members.push((i, n));
                if last {
                    rows.push(i);
                }
            }
            if members.is_empty() {
                break;
            }
            let all: Vec<usize> = members.iter().map(|&(i, _)| i).collect();
            if let Some(logits) = self.step(&batch, kv, seqs, &all) {
                for &(i, n) in &members {
                    seqs[i].cached += n;
                }
                self.sample_rows(seqs, &rows, &logits);
            }
        }
        // Decode: every live sequence runs its last sampled token.
        loop {
            let rows: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].done.is_none()).collect();
            if rows.is_empty() {
                break;
            }
            let mut batch = Batch::default();
            for &i in &rows {
                let s = &seqs[i];
                let last = *s.out.last().expect("a live sequence after prefill has a token");
                batch.push(&[last], s.prompt.len() + s.out.len() - 1, s.blocks.clone(), true);
            }
            if let Some(logits) = self.step(&batch, kv, seqs, &rows) {
                self.sample_rows(seqs, &rows, &logits);
            }
        }
    }

    /// One forward pass; on failure every sequence in `rows` fails.
    fn step(&self, batch: &Batch, kv: &mut KvCache, seqs: &mut [Seq], rows: &[usize]) -> Option<Vec<f32>> {
        match self.model.model.forward(batch, kv) {
            Ok(l) => Some(l),
            Err(e) => {
                for &i in rows {
                    seqs[i].done = Some(FinishReason::Error);
                    seqs[i].error = Some(format!("forward pass failed: {e}"));
                }
                None
            }
        }
    }

    fn sample_rows(&self, seqs: &mut [Seq], rows: &[usize], logits: &[f32]) {
        let vocab = self.model.model.config().vocab;
        let histories: Vec<Vec<TokenId>> = rows.iter().map(|&i| seqs[i].history()).collect();
        let sample_rows: Vec<SampleRow> = rows
            .iter()
            .enumerate()
            .map(|(j, &i)| SampleRow {
                logits: &logits[j * vocab..(j + 1) * vocab],
                params: &seqs[i].params,
                seed: seqs[i].seed,
                step: seqs[i].out.len() as u64,
                history: &histories[j],
            })
            .collect();
        let picks = self.sampler.sample_batch(&sample_rows);
        drop(sample_rows);
        for (&i, pick) in rows.iter().zip(picks) {
            let s = &mut seqs[i];
            match pick {
                Ok(t) if (t as usize) < vocab => self.append(s, t),
                Ok(t) => {
                    s.done = Some(FinishReason::Error);
                    s.error = Some(format!("sampler returned token id {t}, outside the vocabulary ({vocab})"));
                }
                Err(e) => {
                    s.done = Some(FinishReason::Error);
                    s.error = Some(format!("sampler failed: {e}"));
                }
            }
        }
    }

    fn append(&self, s: &mut Seq, t: TokenId) {
        if s.t_first.is_none() {
            s.t_first = Some(Instant::now());
        }
        let tok = &self.model.tokenizer;
        if tok.is_eos(t) && !s.params.ignore_eos {
            s.done = Some(FinishReason::Stop);
            return;
        }
        s.out.push(t);
        s.text = tok.decode(&s.out).unwrap_or_default();
        if let Some(cut) = s.params.stop.iter().filter_map(|st| s.text.find(st.as_str())).min() {
            s.text.truncate(cut);
            s.done = Some(FinishReason::Stop);
        } else if s.out.len() >= s.params.max_tokens {
            s.done = Some(FinishReason::Length);
        }
    }
}

fn prompt_text(p: &PromptInput) -> Option<String> {
    match p {
        PromptInput::Text(t) => Some(t.clone()),
        _ => None,
    }
}

/// Derives a per-request seed from the engine seed (SplitMix64 finalizer).
fn mix(seed: u64, idx: u64) -> u64 {
    let mut z = seed.wrapping_add(idx.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
