//! The engine core loop of one run, on the caller's thread: admit requests into the
//! scheduler, then `schedule -> (executor) forward -> (sampler stage) sample ->
//! update_from_output`, with the executor, the sampler stage and the output stage on their
//! own threads. With async scheduling the loop plans step N+1 as soon as step N is handed to
//! the executor (decodes of N get placeholder tokens in N+1), so scheduling and input
//! preparation overlap the forward pass. The loop itself never touches logits or text.

use std::collections::VecDeque;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use super::constraint_stage::run_constraint_worker;
use super::executor::{run_executor, ExecutorIo, LogitsPolicy};
use super::messages::{EngineEvent, OutputMsg, StepDone};
use super::output_stage::{run_output_stage, OutputIo, OutputSpec};
use super::progress::Progress;
use super::request::{Request, RequestOutput, StreamEvent};
use super::sample_stage::{request_id, run_sampler, ConstraintLink, SamplerIo, SeqSettings};
use super::stats::{RunSummary, StepStats};
use crate::ids::{RequestId, TokenId};
use crate::kv_cache::SeqId;
use crate::model::{KvCache, LoadedModel};
use crate::plugins::Matcher;
use crate::sampling::BatchSampler;
use crate::scheduler::{
    FinishReason as SchedFinish, FinishedSeq, NewRequest, Scheduler, SchedulerOutput, StopCondition,
};

/// What persists across runs: the scheduler (with the KV-cache manager and its prefix
/// cache) and the model's KV storage, both sized once at start.
pub struct EngineCore {
    pub scheduler: Scheduler,
    pub kv: KvCache,
    /// Request id of the next run's first request.
    pub next_request: u64,
}

/// A request after templating and tokenizing.
pub struct Prepared {
    pub text: Option<String>,
    pub ids: Vec<TokenId>,
    pub seed: u64,
    /// One matcher per sample of a constrained request, made at admission; the run moves
    /// them to the constraint worker.
    pub matchers: std::sync::Mutex<Vec<Matcher>>,
}

/// Borrowed pieces a run needs.
pub struct RunContext<'a> {
    pub model: &'a LoadedModel,
    pub sampler: &'a dyn BatchSampler,
    pub async_scheduling: bool,
    /// See `EngineOptions::select_candidates`.
    pub select_candidates: bool,
    pub progress: bool,
}

/// Delivers outputs and token events to the caller, and counts them for the summary.
struct Sink<'a> {
    on_event: &'a mut dyn FnMut(StreamEvent<'_>),
    requests: &'a [Request],
    /// Request id of `requests[0]`.
    base: u64,
    progress: Progress,
    summary: RunSummary,
    done: Vec<bool>,
    num_done: usize,
}

impl Sink<'_> {
    fn output(&mut self, index: usize, o: &RequestOutput) {
        if std::mem::replace(&mut self.done[index], true) {
            return;
        }
        self.num_done += 1;
        let s = &mut self.summary;
        s.failed += usize::from(o.error.is_some());
        s.prompt_tokens += o.prompt_token_ids.len() as u64;
        s.cached_prompt_tokens += o.cached_prompt_tokens as u64;
        s.generated_tokens += o.num_generated_tokens() as u64;
        self.progress.request_done(o.num_generated_tokens());
        (self.on_event)(StreamEvent::Finished { index, output: o });
    }

    fn fail(&mut self, index: usize, prepared: Option<&Prepared>, error: String) {
        let req = &self.requests[index];
        let mut o =
            RequestOutput::failed(req.id.clone(), prepared.and_then(|p| p.text.clone()), error);
        if let Some(p) = prepared {
            o.prompt_token_ids = p.ids.clone();
        }
        self.output(index, &o);
    }
}

/// Runs `requests` (already prepared, or failed with a message) to completion.
pub fn run(
    core: &mut EngineCore,
    ctx: RunContext<'_>,
    requests: &[Request],
    prepared: &[Result<Prepared, String>],
    on_event: &mut dyn FnMut(StreamEvent<'_>),
) -> RunSummary {
    let start = Instant::now();
    let base = core.next_request;
    core.next_request += requests.len() as u64;
    let (kv0, st0) = (core.scheduler.kv_stats(), core.scheduler.stats());
    let mut sink = Sink {
        on_event,
        requests,
        base,
        progress: Progress::new(requests.len(), ctx.progress),
        summary: RunSummary {
            requests: requests.len(),
            ..Default::default()
        },
        done: vec![false; requests.len()],
        num_done: 0,
    };
    let tokenizer = &ctx.model.tokenizer;
    let mut live = 0usize;
    for (i, (req, p)) in requests.iter().zip(prepared).enumerate() {
        let p = match p {
            Ok(p) => p,
            Err(msg) => {
                sink.fail(i, None, msg.clone());
                continue;
            }
        };
        let stop = StopCondition {
            max_tokens: req.params.max_tokens,
            eos_token_ids: tokenizer.eos.clone(),
            ignore_eos: req.params.ignore_eos,
            stop_token_ids: req.stop_token_ids.clone(),
        };
        let new = NewRequest {
            id: request_id(base, i),
            prompt: p.ids.clone(),
            stop,
            n: req.n,
        };
        match core.scheduler.add_request(new) {
            Ok(()) => live += 1,
            Err(e) => sink.fail(i, Some(p), e.to_string()),
        }
    }
    let no_ids: &[TokenId] = &[];
    let specs: Vec<OutputSpec<'_>> = requests
        .iter()
        .zip(prepared)
        .map(|(r, p)| OutputSpec {
            id: &r.id,
            prompt_text: p.as_ref().ok().and_then(|p| p.text.as_deref()),
            prompt_ids: p.as_ref().map_or(no_ids, |p| &p.ids),
            n: r.n,
            stop: &r.params.stop,
        })
        .collect();
    let settings = SeqSettings {
        base,
        requests: requests
            .iter()
            .zip(prepared)
            .map(|(r, p)| (&r.params, p.as_ref().map_or(0, |p| p.seed)))
            .collect(),
        constrained: Vec::new(),
    };
    let vocab = ctx.model.model.config().vocab;
    let model = ctx.model.model.as_ref();
    let mut matchers: Vec<(SeqId, Matcher)> = Vec::new();
    let mut constrained = vec![false; requests.len()];
    for (i, p) in prepared.iter().enumerate() {
        let Ok(p) = p else { continue };
        let mine = std::mem::take(&mut *p.matchers.lock().unwrap_or_else(|e| e.into_inner()));
        constrained[i] = !mine.is_empty();
        for (j, m) in mine.into_iter().enumerate() {
            let seq = SeqId {
                request: request_id(base, i),
                sample: j as u32,
            };
            matchers.push((seq, m));
        }
    }
    let policy = LogitsPolicy {
        base,
        per_request: (requests.iter().zip(&constrained))
            .map(|(r, &c)| {
                let ok = ctx.select_candidates && !c;
                ok.then(|| ctx.sampler.candidates_wanted(&r.params))
                    .flatten()
            })
            .collect(),
    };
    let settings = SeqSettings {
        constrained,
        ..settings
    };
    let eos = tokenizer.eos.clone();
    let depth = if ctx.async_scheduling { 2 } else { 1 };
    let EngineCore { scheduler, kv, .. } = core;
    if live > 0 {
        std::thread::scope(|s| {
            let (plan_tx, plan_rx) = mpsc::channel();
            let (tok_tx, tok_rx) = mpsc::channel();
            let (job_tx, job_rx) = mpsc::channel();
            let (ev_tx, ev_rx) = mpsc::channel();
            let (out_tx, out_rx) = mpsc::channel();
            let ev_tx2 = ev_tx.clone();
            let (cons_tx, cons_rx) = mpsc::channel();
            let (mask_tx, mask_rx) = mpsc::channel();
            let constraints = (!matchers.is_empty()).then_some(ConstraintLink {
                to_worker: cons_tx,
                answers: mask_rx,
            });
            let worker_ok = matchers.is_empty()
                || std::thread::Builder::new()
                    .name("deepinfer-constraint".into())
                    .spawn_scoped(s, move || {
                        run_constraint_worker(matchers, eos, cons_rx, mask_tx)
                    })
                    .is_ok();
            let kv: &mut KvCache = kv;
            let exec_io = ExecutorIo {
                plans: plan_rx,
                sampled: tok_rx,
                jobs: job_tx,
                logits: policy,
            };
            let samp_io = SamplerIo {
                jobs: job_rx,
                to_executor: tok_tx,
                to_engine: ev_tx2,
                constraints,
            };
            let out_io = OutputIo {
                inbox: out_rx,
                to_engine: ev_tx,
            };
            let (settings, specs) = (&settings, &specs);
            let spawned = [
                std::thread::Builder::new()
                    .name("deepinfer-executor".into())
                    .spawn_scoped(s, move || run_executor(model, kv, exec_io))
                    .is_ok(),
                std::thread::Builder::new()
                    .name("deepinfer-sampler".into())
                    .spawn_scoped(s, move || {
                        run_sampler(ctx.sampler, settings, vocab, samp_io)
                    })
                    .is_ok(),
                std::thread::Builder::new()
                    .name("deepinfer-output".into())
                    .spawn_scoped(s, move || {
                        run_output_stage(tokenizer, specs, base, start, out_io)
                    })
                    .is_ok(),
            ];
            if worker_ok && spawned.iter().all(|&ok| ok) {
                drive(
                    scheduler,
                    Channels {
                        plans: plan_tx,
                        events: ev_rx,
                        outputs: out_tx,
                    },
                    depth,
                    &mut sink,
                );
            }
        });
    }
    // Whatever did not finish (a worker died) fails now, and leaves the scheduler clean.
    for (i, p) in prepared.iter().enumerate() {
        let _ = scheduler.abort_request(request_id(base, i));
        if !sink.done[i] {
            let why = "the engine stopped before this request finished";
            sink.fail(i, p.as_ref().ok(), why.into());
        }
    }
    sink.progress.finish();
    let mut summary = std::mem::take(&mut sink.summary);
    let (kv1, st1) = (scheduler.kv_stats(), scheduler.stats());
    let queried = kv1.prefix_queried_tokens - kv0.prefix_queried_tokens;
    let hit = kv1.prefix_hit_tokens - kv0.prefix_hit_tokens;
    summary.prefix_hit_rate = if queried > 0 {
        hit as f64 / queried as f64
    } else {
        0.0
    };
    summary.preemptions = st1.num_preemptions - st0.num_preemptions;
    summary.wall_s = start.elapsed().as_secs_f64();
    summary
}

/// The engine thread's ends of the channels.
struct Channels {
    plans: Sender<Arc<SchedulerOutput>>,
    events: Receiver<EngineEvent>,
    outputs: Sender<OutputMsg>,
}

/// The loop: keep up to `depth` steps in flight, apply results in order, relay stop strings
/// and outputs. Returns when every admitted request has an output or a worker is gone.
fn drive(sched: &mut Scheduler, ch: Channels, depth: usize, sink: &mut Sink<'_>) {
    let mut inflight: VecDeque<Arc<SchedulerOutput>> = VecDeque::new();
    let mut stats = StepStats::default();
    while sink.num_done < sink.done.len() {
        while inflight.len() < depth && sched.has_unfinished() {
            let out = sched.schedule();
            let idle = out.is_empty();
            if idle && inflight.is_empty() && out.finished.is_empty() && out.preempted.is_empty() {
                // Nothing runs and nothing will: never expected (a lone request always
                // fits), but do not spin.
                let why = "the scheduler could not make progress";
                abort_all(sched, sink.base, sink.requests.len(), &ch.outputs, why);
                break;
            }
            if idle && out.finished.is_empty() && out.preempted.is_empty() {
                break; // wait for results
            }
            let out = Arc::new(out);
            if ch.plans.send(out.clone()).is_err() {
                return;
            }
            inflight.push_back(out);
            if idle {
                break;
            }
        }
        let Ok(event) = ch.events.recv() else {
            return;
        };
        match event {
            EngineEvent::Step(done) => {
                let Some(out) = inflight.pop_front() else {
                    continue;
                };
                stats.record(&done.timing);
                apply_step(sched, &out, done, &ch.outputs);
            }
            EngineEvent::Stop(seq) => {
                if let Some(f) = sched.finish_seq(seq, SchedFinish::StopString) {
                    send_finished(&ch.outputs, f, None);
                }
            }
            EngineEvent::Tokens {
                index,
                sample,
                token_ids,
                text,
            } => {
                let id = &sink.requests[index].id;
                (sink.on_event)(StreamEvent::Tokens {
                    index,
                    id,
                    sample,
                    token_ids: &token_ids,
                    text: &text,
                });
            }
            EngineEvent::Output { index, output } => sink.output(index, &output),
        }
    }
    stats.fill(&mut sink.summary);
}

/// Applies one step's results: failed rows fail their requests, the rest updates the
/// scheduler, and new tokens and finished sequences go to the output stage.
fn apply_step(
    sched: &mut Scheduler,
    out: &SchedulerOutput,
    done: StepDone,
    outputs: &Sender<OutputMsg>,
) {
    for (e, r) in out.seqs.iter().zip(&done.results) {
        if let Err(msg) = r {
            for f in sched.abort_request(e.seq.request) {
                send_finished(outputs, f, Some(msg.clone()));
            }
        }
    }
    let sampled: Vec<Vec<TokenId>> = done
        .results
        .into_iter()
        .map(Result::unwrap_or_default)
        .collect();
    match sched.update_from_output(out, &sampled) {
        Ok(outcome) => {
            for u in outcome
                .updates
                .into_iter()
                .filter(|u| !u.new_tokens.is_empty())
            {
                let _ = outputs.send(OutputMsg::Tokens {
                    seq: u.seq,
                    tokens: u.new_tokens,
                    at: done.at,
                });
            }
            for f in outcome.finished {
                send_finished(outputs, f, None);
            }
        }
        Err(e) => {
            let msg = e.to_string();
            let ids: Vec<RequestId> = out.seqs.iter().map(|e| e.seq.request).collect();
            for id in ids {
                for f in sched.abort_request(id) {
                    send_finished(outputs, f, Some(msg.clone()));
                }
            }
        }
    }
}

fn send_finished(outputs: &Sender<OutputMsg>, f: FinishedSeq, error: Option<String>) {
    let _ = outputs.send(OutputMsg::Finished {
        seq: f.seq,
        reason: f.reason,
        error,
        num_cached_tokens: f.num_cached_tokens,
        num_preemptions: f.num_preemptions,
        at: Instant::now(),
    });
}

/// Fails every request of the run still in the scheduler.
fn abort_all(sched: &mut Scheduler, base: u64, n: usize, outputs: &Sender<OutputMsg>, why: &str) {
    for i in 0..n {
        for f in sched.abort_request(request_id(base, i)) {
            send_finished(outputs, f, Some(why.to_string()));
        }
    }
}
