//! Unit tests of the scheduler: prefix hits, chunked prefill, step order, preemption order,
//! stop conditions, `n > 1` forks, draft rollback, aborts and contract checks.

use std::collections::HashMap;

use super::fake_model::{continuation, FakeModel};
use super::*;
use crate::error::Error;
use crate::ids::{RequestId, TokenId};
use crate::kv_cache::{KvCacheConfig, KvCacheManager};

const VOCAB: u32 = 1000;

fn sched(num_blocks: usize, block_size: usize, budget: usize, max_seqs: usize) -> Scheduler {
    let kv = KvCacheManager::new(KvCacheConfig {
        num_blocks,
        block_size,
        enable_prefix_caching: true,
    })
    .unwrap();
    let cfg = SchedulerConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: max_seqs,
        max_model_len: 512,
        chunked_prefill: true,
    };
    Scheduler::new(cfg, kv).unwrap()
}

fn req(id: u64, prompt: Vec<TokenId>, max_tokens: usize) -> NewRequest {
    NewRequest {
        id: RequestId(id),
        prompt,
        stop: StopCondition {
            max_tokens,
            eos_token_ids: vec![],
            ignore_eos: false,
            stop_token_ids: vec![],
        },
        n: 1,
    }
}

fn s0(id: u64) -> SeqId {
    SeqId::first(RequestId(id))
}

/// One step through the fake model; returns the plan and the outcome.
fn step(s: &mut Scheduler, m: &mut FakeModel) -> (SchedulerOutput, StepOutcome) {
    let out = s.schedule();
    let sampled = m.run(&out, s.kv());
    let outcome = s.update_from_output(&out, &sampled).unwrap();
    m.observe(&outcome);
    s.check_invariants().unwrap();
    (out, outcome)
}

fn run_all(s: &mut Scheduler, m: &mut FakeModel) -> HashMap<SeqId, FinishedSeq> {
    let mut done = HashMap::new();
    for _ in 0..10_000 {
        if !s.has_unfinished() {
            break;
        }
        let (_, outcome) = step(s, m);
        done.extend(outcome.finished.into_iter().map(|f| (f.seq, f)));
    }
    assert!(!s.has_unfinished(), "did not finish");
    done
}

#[test]
fn second_request_with_the_same_prompt_skips_its_cached_blocks() {
    let (mut s, mut m) = (sched(32, 16, 256, 8), FakeModel::new(32, 16, VOCAB));
    let prompt: Vec<TokenId> = (1..=40).collect();
    s.add_request(req(1, prompt.clone(), 3)).unwrap();
    let first = run_all(&mut s, &mut m);
    s.add_request(req(2, prompt.clone(), 3)).unwrap();
    let (out, _) = step(&mut s, &mut m);
    assert_eq!(out.seqs[0].num_cached_tokens, 32);
    assert_eq!(out.seqs[0].num_computed_tokens, 32);
    assert_eq!(out.seqs[0].token_ids, prompt[32..].to_vec());
    let second = run_all(&mut s, &mut m);
    assert_eq!(first[&s0(1)].output_tokens, second[&s0(2)].output_tokens);
    assert_eq!(second[&s0(2)].num_cached_tokens, 32);
    assert_eq!(s.kv_stats().prefix_hit_tokens, 32);
    assert_eq!(s.kv_stats().prefix_queried_tokens, 80);
}

#[test]
fn long_prompt_is_chunked_to_the_token_budget() {
    let (mut s, mut m) = (sched(32, 4, 8, 8), FakeModel::new(32, 4, VOCAB));
    s.add_request(req(1, (1..=20).collect(), 2)).unwrap();
    let sizes: Vec<(usize, bool)> = (0..4)
        .map(|_| {
            let (out, _) = step(&mut s, &mut m);
            (out.seqs[0].token_ids.len(), out.seqs[0].wants_sample)
        })
        .collect();
    assert_eq!(sizes, vec![(8, false), (8, false), (4, true), (1, true)]);
    assert!(!s.has_unfinished());
}

#[test]
fn decodes_go_first_then_prefills_then_admissions() {
    let (mut s, mut m) = (sched(64, 4, 6, 8), FakeModel::new(64, 4, VOCAB));
    s.add_request(req(1, vec![1, 2, 3], 10)).unwrap();
    step(&mut s, &mut m); // prompt of 1 done: it decodes from now on
    s.add_request(req(2, (1..=20).collect(), 10)).unwrap();
    let (out, _) = step(&mut s, &mut m);
    assert_eq!(
        out.seqs
            .iter()
            .map(|e| (e.seq, e.token_ids.len()))
            .collect::<Vec<_>>(),
        vec![(s0(1), 1), (s0(2), 5)]
    );
    s.add_request(req(3, vec![5, 6], 10)).unwrap();
    let (out, _) = step(&mut s, &mut m);
    // 1 decodes, 2 continues its prefill and takes the rest: 3 waits.
    assert_eq!(
        out.seqs
            .iter()
            .map(|e| (e.seq, e.token_ids.len()))
            .collect::<Vec<_>>(),
        vec![(s0(1), 1), (s0(2), 5)]
    );
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn the_newest_running_sequence_is_preempted_and_requeued_first() {
    // 6 blocks of 2 tokens; three requests of 3-token prompts generating 6 tokens each
    // need 4 blocks apiece at the end, so they cannot all stay.
    let (mut s, mut m) = (sched(6, 2, 64, 8), FakeModel::new(6, 2, VOCAB));
    for id in 1..=3 {
        s.add_request(req(id, vec![id as TokenId; 3], 6)).unwrap();
    }
    let mut first_preempted = None;
    let mut done = HashMap::new();
    while s.has_unfinished() {
        let (out, outcome) = step(&mut s, &mut m);
        if first_preempted.is_none() && !out.preempted.is_empty() {
            first_preempted = Some(out.preempted.clone());
            // The victim is the newest admission and now heads the queue.
            assert_eq!(out.preempted[0], s0(3));
            assert_eq!(s.waiting.front(), Some(&s0(3)));
        }
        done.extend(outcome.finished.into_iter().map(|f| (f.seq, f)));
    }
    assert!(first_preempted.is_some(), "expected a preemption");
    assert!(done[&s0(3)].num_preemptions > 0);
    assert_eq!(
        done[&s0(1)].num_preemptions,
        0,
        "the oldest is never preempted"
    );
    for id in 1..=3 {
        let want = continuation(&[id as TokenId; 3], 0, VOCAB, 6);
        assert_eq!(
            done[&s0(id)].output_tokens,
            want,
            "request {id} recomputed wrongly"
        );
    }
    assert_eq!(s.kv_stats().blocks_used, 0);
}

#[test]
fn stop_conditions_end_sequences_and_free_blocks() {
    let (mut s, mut m) = (sched(32, 4, 64, 8), FakeModel::new(32, 4, VOCAB));
    let prompt = vec![9, 8, 7];
    let cont = continuation(&prompt, 0, VOCAB, 6);
    assert!(
        !cont[..2].contains(&cont[2]) && cont[0] != cont[1],
        "pick another prompt"
    );
    let mut eos = req(1, prompt.clone(), 6);
    eos.stop.eos_token_ids = vec![cont[2]];
    let mut ignore = req(2, prompt.clone(), 6);
    ignore.stop.eos_token_ids = vec![cont[2]];
    ignore.stop.ignore_eos = true;
    let mut stop_id = req(3, prompt.clone(), 6);
    stop_id.stop.stop_token_ids = vec![cont[1]];
    for r in [eos, ignore, stop_id] {
        s.add_request(r).unwrap();
    }
    let done = run_all(&mut s, &mut m);
    assert_eq!(done[&s0(1)].reason, FinishReason::Eos);
    assert_eq!(done[&s0(1)].output_tokens, cont[..3].to_vec());
    assert_eq!(done[&s0(2)].reason, FinishReason::Length);
    assert_eq!(done[&s0(2)].output_tokens, cont);
    assert_eq!(done[&s0(3)].reason, FinishReason::StopToken(cont[1]));
    assert_eq!(s.kv_stats().blocks_used, 0);
}

#[test]
fn samples_of_one_request_share_the_prompt_blocks() {
    let (mut s, mut m) = (sched(64, 4, 64, 8), FakeModel::new(64, 4, VOCAB));
    let prompt: Vec<TokenId> = (1..=10).collect();
    s.add_request(NewRequest {
        n: 3,
        ..req(1, prompt.clone(), 4)
    })
    .unwrap();
    let (out, _) = step(&mut s, &mut m);
    assert_eq!(out.seqs.len(), 1, "the prompt runs once");
    let shared = s.kv().block_table(s0(1))[..2].to_vec();
    for b in &shared {
        assert_eq!(s.kv().pool().ref_count(*b), 3);
    }
    let (out, _) = step(&mut s, &mut m);
    for e in out.seqs.iter().filter(|e| e.seq.sample > 0) {
        assert_eq!(e.num_cached_tokens, 8);
        assert_eq!(
            e.token_ids,
            prompt[8..].to_vec(),
            "a sample recomputes only the tail"
        );
        assert_eq!(&s.kv().block_table(e.seq)[..2], &shared[..]);
    }
    let done = run_all(&mut s, &mut m);
    for sample in 0..3 {
        let id = SeqId {
            request: RequestId(1),
            sample,
        };
        let want = continuation(&prompt, sample, VOCAB, 4);
        assert_eq!(done[&id].output_tokens, want, "sample {sample}");
    }
    assert_eq!(s.kv_stats().blocks_used, 0);
}

#[test]
fn rejected_drafts_are_rolled_back() {
    let (mut s, mut m) = (sched(64, 2, 64, 8), FakeModel::new(64, 2, VOCAB));
    let prompt: Vec<TokenId> = vec![3, 1, 4];
    let want = continuation(&prompt, 0, VOCAB, 12);
    s.add_request(req(1, prompt.clone(), 12)).unwrap();
    step(&mut s, &mut m); // prompt, first token
                          // Two right drafts, then a wrong one, then one more.
    let mut drafts = want[1..5].to_vec();
    drafts[2] = drafts[2].wrapping_add(1) % VOCAB;
    s.set_draft_tokens(s0(1), drafts);
    let (out, outcome) = step(&mut s, &mut m);
    assert_eq!(out.seqs[0].num_draft_tokens, 4);
    assert_eq!(outcome.updates[0].new_tokens, want[1..4].to_vec());
    // prompt 3 + 4 tokens; KV is valid for all but the newest token.
    assert_eq!(s.seqs[&s0(1)].num_computed_tokens, 6);
    // Positions 0..8 held 4 blocks of 2; the block of positions 6..8 went back.
    assert_eq!(s.kv().block_table(s0(1)).len(), 3);
    let done = run_all(&mut s, &mut m);
    assert_eq!(done[&s0(1)].output_tokens, want);
}

#[test]
fn aborting_frees_every_sample() {
    let (mut s, mut m) = (sched(64, 4, 64, 8), FakeModel::new(64, 4, VOCAB));
    s.add_request(NewRequest {
        n: 2,
        ..req(1, (1..=9).collect(), 50)
    })
    .unwrap();
    step(&mut s, &mut m);
    step(&mut s, &mut m);
    let aborted = s.abort_request(RequestId(1));
    assert_eq!(aborted.len(), 2);
    assert!(aborted.iter().all(|f| f.reason == FinishReason::Aborted));
    assert!(!s.has_unfinished());
    assert_eq!(s.kv_stats().blocks_used, 0);
    assert_eq!(s.schedule().finished.len(), 2, "the runtime hears of both");
}

#[test]
fn requests_that_could_never_run_are_rejected() {
    let mut s = sched(4, 4, 64, 8);
    assert!(matches!(
        s.add_request(req(1, vec![], 4)),
        Err(Error::EmptyPrompt)
    ));
    assert!(matches!(
        s.add_request(req(1, vec![1; 500], 100)),
        Err(Error::PromptTooLong { .. })
    ));
    // 10 + 8 - 1 = 17 tokens need 5 blocks of 4.
    assert!(matches!(
        s.add_request(req(1, vec![1; 10], 8)),
        Err(Error::KvCacheTooSmall {
            needed_blocks: 5,
            ..
        })
    ));
    s.add_request(req(1, vec![1; 10], 7)).unwrap();
    assert!(matches!(
        s.add_request(req(1, vec![1; 3], 2)),
        Err(Error::BadRequest(_))
    ));
}

#[test]
fn malformed_results_are_refused() {
    let mut s = sched(64, 4, 64, 8);
    s.add_request(req(1, vec![1, 2, 3], 4)).unwrap();
    let out = s.schedule();
    assert!(s.update_from_output(&out, &[]).is_err());
    assert!(s.update_from_output(&out, &[vec![]]).is_err());
    assert!(
        s.update_from_output(&out, &[vec![5, 6]]).is_err(),
        "two tokens without drafts"
    );
    assert!(s.update_from_output(&out, &[vec![5]]).is_ok());
}

#[test]
fn a_sample_finished_while_parked_is_not_forked() {
    let (mut s, mut m) = (sched(64, 4, 64, 8), FakeModel::new(64, 4, VOCAB));
    s.add_request(NewRequest {
        n: 3,
        ..req(1, (1..=9).collect(), 5)
    })
    .unwrap();
    let parked = SeqId {
        request: RequestId(1),
        sample: 2,
    };
    let f = s.finish_seq(parked, FinishReason::Aborted).unwrap();
    assert!(f.output_tokens.is_empty());
    let done = run_all(&mut s, &mut m);
    assert_eq!(done.len(), 2);
    assert_eq!(
        s.kv().num_sequences(),
        0,
        "no table left for the finished sample"
    );
    assert_eq!(s.kv_stats().blocks_used, 0);
}

#[test]
fn a_request_that_ends_in_its_prompt_step_still_caches_the_prompt() {
    let (mut s, mut m) = (sched(32, 16, 256, 8), FakeModel::new(32, 16, VOCAB));
    let prompt: Vec<TokenId> = (1..=40).collect();
    s.add_request(req(1, prompt.clone(), 1)).unwrap();
    run_all(&mut s, &mut m);
    s.add_request(req(2, prompt, 1)).unwrap();
    let (out, _) = step(&mut s, &mut m);
    assert_eq!(out.seqs[0].num_cached_tokens, 32);
    run_all(&mut s, &mut m);
    assert_eq!(s.kv_stats().blocks_used, 0);
}
