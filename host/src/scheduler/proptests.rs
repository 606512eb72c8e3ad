//! Property tests of the scheduler and KV cache together, driven by the fake model: random
//! arrivals, prompt lengths, shared prefixes, `max_tokens`, `n`, aborts and draft tokens,
//! under KV budgets small enough to force preemption and token budgets small enough to force
//! chunking. After every step the block pool and the scheduler check their invariants (ref
//! counts equal holders, free list = unheld blocks, no double free); at the end every request
//! has finished with exactly the tokens an unbatched run produces, and no block is held.

use std::collections::HashMap;

use proptest::prelude::*;

use super::fake_model::{chain, continuation, next_token, FakeModel};
use super::*;
use crate::ids::{RequestId, TokenId};
use crate::kv_cache::{KvCacheConfig, KvCacheManager};

#[path = "async_proptests.rs"]
mod async_mode;

const VOCAB: u32 = 48;
const EOS: TokenId = 0;
const MAX_MODEL_LEN: usize = 160;

#[derive(Debug, Clone)]
struct Req {
    arrival: usize,
    prompt: Vec<TokenId>,
    max_tokens: usize,
    n: u32,
    ignore_eos: bool,
    abort_at: Option<usize>,
}

#[derive(Debug, Clone)]
struct Case {
    block_size: usize,
    extra_blocks: usize,
    budget: usize,
    max_seqs: usize,
    chunked: bool,
    caching: bool,
    max_drafts: usize,
    seed: u64,
    reqs: Vec<Req>,
}

fn case() -> impl Strategy<Value = Case> {
    let prefixes = proptest::collection::vec(proptest::collection::vec(1u32..VOCAB, 0..40), 3);
    let req = (
        0usize..25,
        0usize..3,
        proptest::collection::vec(0u32..VOCAB, 1..24),
        1usize..24,
        1u32..=3,
        any::<bool>(),
        proptest::option::weighted(0.15, 0usize..60),
    );
    (
        prop_oneof![Just(1usize), Just(2), Just(4), Just(16)],
        0usize..24,
        1usize..48,
        1usize..7,
        prop::bool::weighted(0.8),
        any::<bool>(),
        prop_oneof![Just(0usize), 1usize..4],
        any::<u64>(),
        prefixes,
        proptest::collection::vec(req, 1..12),
    )
        .prop_map(
            |(bs, extra, budget, seqs, chunked, caching, drafts, seed, prefixes, reqs)| Case {
                block_size: bs,
                extra_blocks: extra,
                budget: if chunked { budget } else { MAX_MODEL_LEN },
                max_seqs: seqs,
                chunked,
                caching,
                max_drafts: drafts,
                seed,
                reqs: reqs
                    .into_iter()
                    .map(
                        |(arrival, p, suffix, max_tokens, n, ignore_eos, abort_at)| Req {
                            arrival,
                            prompt: prefixes[p].iter().chain(&suffix).copied().collect(),
                            max_tokens,
                            n,
                            ignore_eos,
                            abort_at,
                        },
                    )
                    .collect(),
            },
        )
}

/// What sample `sample` of `r` produces when run alone.
fn reference(r: &Req, sample: u32) -> (Vec<TokenId>, FinishReason) {
    let mut h = *chain(&r.prompt).last().expect("prompts are not empty");
    let mut out = Vec::new();
    loop {
        let t = next_token(h, sample, VOCAB);
        out.push(t);
        h = super::fake_model::mix(h, t);
        if t == EOS && !r.ignore_eos {
            return (out, FinishReason::Eos);
        }
        if out.len() == r.max_tokens {
            return (out, FinishReason::Length);
        }
    }
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// How often each mechanism ran, to show the random cases reach them.
#[derive(Debug, Default)]
struct Coverage {
    preemptions: u64,
    prefix_hit_tokens: u64,
    forked_samples: u64,
    partial_prefill_chunks: u64,
    drafts_run: u64,
    drafts_rejected: u64,
    aborted: u64,
}

fn run_case(c: &Case) -> Result<Coverage, TestCaseError> {
    let mut cov = Coverage::default();
    let needed = c
        .reqs
        .iter()
        .map(|r| (r.prompt.len() + r.max_tokens - 1).div_ceil(c.block_size));
    let num_blocks = needed.max().unwrap_or(1) + c.extra_blocks;
    let kv = KvCacheManager::new(KvCacheConfig {
        num_blocks,
        block_size: c.block_size,
        enable_prefix_caching: c.caching,
    })
    .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let cfg = SchedulerConfig {
        max_num_batched_tokens: c.budget,
        max_num_seqs: c.max_seqs,
        max_model_len: MAX_MODEL_LEN,
        chunked_prefill: c.chunked,
    };
    let mut sched = Scheduler::new(cfg, kv).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut model = FakeModel::new(num_blocks, c.block_size, VOCAB);
    let mut done: HashMap<SeqId, FinishedSeq> = HashMap::new();
    let mut rng = c.seed | 1;
    let last_arrival = c.reqs.iter().map(|r| r.arrival).max().unwrap_or(0);

    let mut step = 0usize;
    while step <= last_arrival || sched.has_unfinished() {
        prop_assert!(step < 20_000, "requests did not finish in 20000 steps");
        for (i, r) in c.reqs.iter().enumerate() {
            if r.arrival == step {
                let stop = StopCondition {
                    max_tokens: r.max_tokens,
                    eos_token_ids: vec![EOS],
                    ignore_eos: r.ignore_eos,
                    stop_token_ids: vec![],
                };
                let new = NewRequest {
                    id: RequestId(i as u64),
                    prompt: r.prompt.clone(),
                    stop,
                    n: r.n,
                };
                sched
                    .add_request(new)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            if r.abort_at == Some(step) && r.arrival <= step {
                done.extend(
                    sched
                        .abort_request(RequestId(i as u64))
                        .into_iter()
                        .map(|f| (f.seq, f)),
                );
            }
        }
        if c.max_drafts > 0 {
            for (id, hist) in &model.histories {
                let k = (xorshift(&mut rng) % (c.max_drafts as u64 + 1)) as usize;
                let mut d = continuation(hist, id.sample, VOCAB, k);
                if k > 0 && xorshift(&mut rng).is_multiple_of(2) {
                    let at = (xorshift(&mut rng) % k as u64) as usize;
                    d[at] = (d[at] + 1) % VOCAB;
                }
                sched.set_draft_tokens(*id, d);
            }
        }
        let out = sched.schedule();
        prop_assert!(out.num_scheduled_tokens <= c.budget);
        prop_assert!(out.seqs.len() <= c.max_seqs);
        if let Err(e) = sched.check_invariants() {
            return Err(TestCaseError::fail(format!("after schedule: {e}")));
        }
        let sampled = model.run(&out, sched.kv());
        for (e, toks) in out.seqs.iter().zip(&sampled) {
            cov.partial_prefill_chunks += u64::from(!e.wants_sample);
            cov.drafts_run += e.num_draft_tokens as u64;
            if e.wants_sample {
                cov.drafts_rejected += (e.num_draft_tokens + 1 - toks.len()) as u64;
            }
        }
        let outcome = sched
            .update_from_output(&out, &sampled)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        model.observe(&outcome);
        if let Err(e) = sched.check_invariants() {
            return Err(TestCaseError::fail(format!("after update: {e}")));
        }
        for f in outcome.finished {
            prop_assert!(done.insert(f.seq, f).is_none(), "a sequence finished twice");
        }
        step += 1;
    }

    for (i, r) in c.reqs.iter().enumerate() {
        for sample in 0..r.n {
            let id = SeqId {
                request: RequestId(i as u64),
                sample,
            };
            let Some(f) = done.get(&id) else {
                return Err(TestCaseError::fail(format!("{id} never finished")));
            };
            let (want, reason) = reference(r, sample);
            cov.forked_samples += u64::from(sample > 0 && f.num_cached_tokens > 0);
            if f.reason == FinishReason::Aborted {
                cov.aborted += 1;
                prop_assert!(
                    want.starts_with(&f.output_tokens),
                    "{id}: aborted output diverged"
                );
            } else {
                prop_assert_eq!(&f.output_tokens, &want, "{} output", id);
                prop_assert_eq!(f.reason, reason);
            }
        }
    }
    let stats = sched.kv_stats();
    prop_assert_eq!(stats.blocks_used, 0, "blocks leaked");
    prop_assert_eq!(stats.blocks_free, num_blocks);
    prop_assert_eq!(sched.kv().num_sequences(), 0);
    prop_assert!(sched.kv().check_invariants().is_ok());
    cov.preemptions = sched.stats().num_preemptions;
    cov.prefix_hit_tokens = stats.prefix_hit_tokens;
    Ok(cov)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn every_request_finishes_correctly_and_no_block_leaks(c in case()) {
        run_case(&c)?;
    }
}

/// The random cases do reach every mechanism: preemption, prefix hits, forks, chunking,
/// accepted and rejected drafts, aborts.
#[test]
fn random_cases_cover_every_mechanism() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut total = Coverage::default();
    for _ in 0..128 {
        let c = case().new_tree(&mut runner).expect("strategy").current();
        let cov = run_case(&c).expect("case passes");
        total.preemptions += cov.preemptions;
        total.prefix_hit_tokens += cov.prefix_hit_tokens;
        total.forked_samples += cov.forked_samples;
        total.partial_prefill_chunks += cov.partial_prefill_chunks;
        total.drafts_run += cov.drafts_run;
        total.drafts_rejected += cov.drafts_rejected;
        total.aborted += cov.aborted;
    }
    eprintln!("coverage over 128 random cases: {total:?}");
    assert!(total.preemptions > 0 && total.prefix_hit_tokens > 0 && total.forked_samples > 0);
    assert!(total.partial_prefill_chunks > 0 && total.aborted > 0);
    assert!(total.drafts_rejected > 0 && total.drafts_run > total.drafts_rejected);
}

/// A fixed stress case: many requests sharing a prefix, a KV cache of barely one sequence,
/// a budget of 3 tokens, drafts on. Forces preemption and chunking on every path.
#[test]
fn tiny_budgets_still_finish_everything() {
    let shared: Vec<TokenId> = (1..30).collect();
    let reqs = (0..10)
        .map(|i| Req {
            arrival: i % 4,
            prompt: shared
                .iter()
                .copied()
                .chain([i as TokenId + 1; 3])
                .collect(),
            max_tokens: 12 + i,
            n: 1 + (i % 3) as u32,
            ignore_eos: true,
            abort_at: None,
        })
        .collect();
    let c = Case {
        block_size: 4,
        extra_blocks: 2,
        budget: 3,
        max_seqs: 4,
        chunked: true,
        caching: true,
        max_drafts: 2,
        seed: 7,
        reqs,
    };
    let cov = run_case(&c).unwrap();
    assert!(cov.preemptions > 0, "{cov:?}");
}
