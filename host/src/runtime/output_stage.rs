//! The output stage: detokenizes each sample incrementally, finds stop strings (and asks the
//! engine to end that sequence), streams text deltas, and assembles a [`RequestOutput`] once
//! every sample of a request has ended. It runs on its own thread, off the busy loop.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use super::messages::{EngineEvent, OutputMsg};
use super::request::{FinishReason, RequestOutput, SampleOutput, Timings};
use super::text::{find_stop, TextStream};
use crate::ids::TokenId;
use crate::kv_cache::SeqId;
use crate::model::tokenizer::Tokenizer;
use crate::scheduler::FinishReason as SchedFinish;

/// What the stage needs to know about one request of the run.
pub struct OutputSpec<'a> {
    pub id: &'a str,
    pub prompt_text: Option<&'a str>,
    pub prompt_ids: &'a [TokenId],
    pub n: u32,
    pub stop: &'a [String],
}

#[derive(Default)]
struct SampleState {
    stream: TextStream,
    /// A stop string was found; the text is final.
    stopped: bool,
    first_at: Option<Instant>,
    last_at: Option<Instant>,
    done: Option<SampleOutput>,
}

struct RequestState {
    samples: Vec<SampleState>,
    num_done: u32,
    num_cached_tokens: usize,
    num_preemptions: u32,
}

/// The stage's inputs and outputs.
pub struct OutputIo {
    pub inbox: Receiver<OutputMsg>,
    pub to_engine: Sender<EngineEvent>,
}

/// Runs until the inbox closes. `specs[i]` describes request `i`, whose id is `base + i`.
pub fn run_output_stage(
    tokenizer: &Tokenizer,
    specs: &[OutputSpec<'_>],
    base: u64,
    start: Instant,
    io: OutputIo,
) {
    let decode = |ids: &[TokenId]| tokenizer.decode(ids).unwrap_or_default();
    let mut states: HashMap<usize, RequestState> = HashMap::new();
    for msg in io.inbox.iter() {
        let seq = match &msg {
            OutputMsg::Tokens { seq, .. } | OutputMsg::Finished { seq, .. } => *seq,
        };
        let Some(index) = seq
            .request
            .0
            .checked_sub(base)
            .map(|i| i as usize)
            .filter(|&i| i < specs.len())
        else {
            continue;
        };
        let spec = &specs[index];
        let st = states.entry(index).or_insert_with(|| RequestState {
            samples: (0..spec.n).map(|_| SampleState::default()).collect(),
            num_done: 0,
            num_cached_tokens: 0,
            num_preemptions: 0,
        });
        let Some(sample) = st.samples.get_mut(seq.sample as usize) else {
            continue;
        };
        match msg {
            OutputMsg::Tokens { tokens, at, .. } => {
                if sample.stopped || sample.done.is_some() {
                    continue;
                }
                sample.first_at.get_or_insert(at);
                sample.last_at = Some(at);
                let old_len = sample.stream.text().len();
                let mut delta = sample.stream.push(&tokens, &decode);
                if let Some(cut) = find_stop(sample.stream.text(), old_len, spec.stop) {
                    let keep = sample.stream.tokens().len();
                    sample.stream.truncate(cut, keep);
                    sample.stopped = true;
                    delta.truncate(cut.saturating_sub(old_len).min(delta.len()));
                    if io.to_engine.send(EngineEvent::Stop(seq)).is_err() {
                        return;
                    }
                }
                let event = EngineEvent::Tokens {
                    index,
                    sample: seq.sample,
                    token_ids: tokens,
                    text: delta,
                };
                if io.to_engine.send(event).is_err() {
                    return;
                }
            }
            OutputMsg::Finished {
                reason,
                error,
                num_cached_tokens,
                num_preemptions,
                at,
                ..
            } => {
                if sample.done.is_some() {
                    continue;
                }
                sample.last_at.get_or_insert(at);
                if seq.sample == 0 {
                    st.num_cached_tokens = num_cached_tokens;
                }
                st.num_preemptions += num_preemptions;
                sample.done = Some(finish_sample(
                    sample, seq, reason, error, tokenizer, &decode,
                ));
                st.num_done += 1;
                if st.num_done == spec.n {
                    if let Some(st) = states.remove(&index) {
                        let output = assemble(spec, st, start);
                        let event = EngineEvent::Output {
                            index,
                            output: Box::new(output),
                        };
                        if io.to_engine.send(event).is_err() {
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// A sample's final text, tokens and reason.
fn finish_sample(
    s: &mut SampleState,
    seq: SeqId,
    reason: SchedFinish,
    error: Option<String>,
    tokenizer: &Tokenizer,
    decode: &dyn Fn(&[TokenId]) -> String,
) -> SampleOutput {
    let mut token_ids = s.stream.tokens().to_vec();
    let (finish_reason, text) = if s.stopped {
        (FinishReason::Stop, s.stream.text().to_string())
    } else {
        let r = match reason {
            SchedFinish::Length => FinishReason::Length,
            SchedFinish::Eos | SchedFinish::StopToken(_) | SchedFinish::StopString => {
                FinishReason::Stop
            }
            SchedFinish::Aborted => FinishReason::Error,
        };
        // The end-of-sequence token itself is not part of the output.
        if reason == SchedFinish::Eos && token_ids.last().is_some_and(|&t| tokenizer.is_eos(t)) {
            token_ids.pop();
        }
        (r, s.stream.finish(decode).to_string())
    };
    let error = match finish_reason {
        FinishReason::Error => Some(error.unwrap_or_else(|| "the request was aborted".into())),
        _ => None,
    };
    SampleOutput {
        sample: seq.sample,
        text,
        token_ids,
        finish_reason,
        error,
    }
}

fn assemble(spec: &OutputSpec<'_>, st: RequestState, start: Instant) -> RequestOutput {
    let since =
        |t: Option<Instant>| t.map_or(0.0, |t| t.saturating_duration_since(start).as_secs_f64());
    let first = &st.samples[0];
    let n_tokens = first.done.as_ref().map_or(0, |d| d.token_ids.len());
    let decode_s = match (first.first_at, first.last_at) {
        (Some(a), Some(b)) => b.saturating_duration_since(a).as_secs_f64(),
        _ => 0.0,
    };
    let timings = Timings {
        time_to_first_token_s: since(st.samples.iter().filter_map(|s| s.first_at).min()),
        decode_tok_per_s: if n_tokens > 1 && decode_s > 0.0 {
            (n_tokens - 1) as f64 / decode_s
        } else {
            0.0
        },
        total_s: since(st.samples.iter().filter_map(|s| s.last_at).max()),
    };
    let mut samples: Vec<SampleOutput> = st.samples.into_iter().filter_map(|s| s.done).collect();
    samples.sort_by_key(|s| s.sample);
    let main = if samples.is_empty() {
        SampleOutput {
            sample: 0,
            text: String::new(),
            token_ids: Vec::new(),
            finish_reason: FinishReason::Error,
            error: Some("no sample finished".into()),
        }
    } else {
        samples.remove(0)
    };
    RequestOutput {
        id: spec.id.to_string(),
        prompt: spec.prompt_text.map(str::to_string),
        prompt_token_ids: spec.prompt_ids.to_vec(),
        text: main.text,
        token_ids: main.token_ids,
        finish_reason: main.finish_reason,
        error: main.error,
        timings,
        cached_prompt_tokens: st.num_cached_tokens,
        preemptions: st.num_preemptions,
        samples,
    }
}
