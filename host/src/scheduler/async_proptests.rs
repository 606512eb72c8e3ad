//! The property test of `proptests.rs` under async scheduling: each step is scheduled before
//! the previous step's results are applied, decodes whose input token is still in flight get
//! placeholder entries, and the driver fills them in the way the runtime does. Outputs must
//! still equal an unbatched run, and no block may leak.

use std::collections::HashMap;

use proptest::prelude::*;

use super::super::fake_model::FakeModel;
use super::super::*;
use super::{case, reference, Case};
use crate::ids::{RequestId, TokenId};
use crate::kv_cache::{KvCacheConfig, KvCacheManager};

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// Runs `c` one step ahead of its results; returns (placeholder entries, preemptions).
fn run_async(c: &Case) -> Result<(u64, u64), TestCaseError> {
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
    .map_err(fail)?;
    let cfg = SchedulerConfig {
        max_num_batched_tokens: c.budget,
        max_num_seqs: c.max_seqs,
        max_model_len: super::MAX_MODEL_LEN,
        chunked_prefill: c.chunked,
    };
    let mut sched = Scheduler::new(cfg, kv).map_err(fail)?;
    sched.set_async_decode(true);
    let mut model = FakeModel::new(num_blocks, c.block_size, super::VOCAB);
    let mut done: HashMap<SeqId, FinishedSeq> = HashMap::new();
    let mut in_flight: Option<(SchedulerOutput, Vec<Vec<TokenId>>)> = None;
    let mut placeholders = 0u64;
    let last_arrival = c.reqs.iter().map(|r| r.arrival).max().unwrap_or(0);
    let mut step = 0usize;
    while step <= last_arrival || sched.has_unfinished() || in_flight.is_some() {
        prop_assert!(step < 20_000, "requests did not finish in 20000 steps");
        for (i, r) in c.reqs.iter().enumerate() {
            if r.arrival == step {
                let stop = StopCondition {
                    max_tokens: r.max_tokens,
                    eos_token_ids: vec![super::EOS],
                    ignore_eos: r.ignore_eos,
                    stop_token_ids: vec![],
                };
                let id = RequestId(i as u64);
                let prompt = r.prompt.clone();
                sched
                    .add_request(NewRequest {
                        id,
                        prompt,
                        stop,
                        n: r.n,
                    })
                    .map_err(fail)?;
            }
            if r.abort_at == Some(step) && r.arrival <= step {
                let aborted = sched.abort_request(RequestId(i as u64));
                done.extend(aborted.into_iter().map(|f| (f.seq, f)));
            }
        }
        // Step N+1 is planned while step N is "in flight" (its results not applied yet).
        let out = sched.schedule();
        sched.check_invariants().map_err(fail)?;
        if let Some((prev, sampled)) = in_flight.take() {
            let outcome = sched.update_from_output(&prev, &sampled).map_err(fail)?;
            model.observe(&outcome);
            sched.check_invariants().map_err(fail)?;
            for f in outcome.finished {
                prop_assert!(done.insert(f.seq, f).is_none(), "a sequence finished twice");
            }
        }
        // Run it: fill placeholders with the token step N sampled; entries of sequences
        // that ended meanwhile are dropped (their results would be ignored anyway).
        let live: Vec<bool> = out
            .seqs
            .iter()
            .map(|e| sched.seq_tokens(e.seq).is_some())
            .collect();
        let mut run = out.clone();
        run.seqs.retain(|e| sched.seq_tokens(e.seq).is_some());
        for e in run.seqs.iter_mut().filter(|e| e.placeholder) {
            placeholders += 1;
            prop_assert_eq!(&e.token_ids, &vec![PLACEHOLDER_TOKEN]);
            let tokens = sched.seq_tokens(e.seq).unwrap_or_default();
            prop_assert_eq!(tokens.len(), e.num_computed_tokens + 1);
            e.token_ids[0] = *tokens.last().unwrap_or(&0);
        }
        let mut results = model.run(&run, sched.kv()).into_iter();
        let sampled: Vec<Vec<TokenId>> = live
            .iter()
            .map(|&l| {
                if l {
                    results.next().unwrap_or_default()
                } else {
                    Vec::new()
                }
            })
            .collect();
        if !out.is_empty() {
            in_flight = Some((out, sampled));
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
                return Err(fail(format!("{id} never finished")));
            };
            let (want, reason) = reference(r, sample);
            if f.reason == FinishReason::Aborted {
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
    prop_assert_eq!(sched.kv().num_sequences(), 0);
    Ok((placeholders, sched.stats().num_preemptions))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn async_scheduling_matches_unbatched_runs(c in case()) {
        run_async(&c)?;
    }
}

/// The random cases reach placeholders and preemption under async scheduling.
#[test]
fn async_cases_run_placeholders_and_preempt() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut placeholders, mut preemptions) = (0, 0);
    for _ in 0..64 {
        let c = case().new_tree(&mut runner).expect("strategy").current();
        let (p, q) = run_async(&c).expect("case passes");
        placeholders += p;
        preemptions += q;
    }
    assert!(
        placeholders > 0 && preemptions > 0,
        "{placeholders} {preemptions}"
    );
}
