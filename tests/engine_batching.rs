//! The engine core on the default model: a request's greedy output must not depend on how
//! it was scheduled. The same prompts run alone, in a batch of 64 (async and sync
//! scheduling), after a prefix-cache hit, and under a KV budget small enough to force
//! preemption; `n > 1` samples, seeded sampling and stop strings keep their meaning.

mod common;

use std::sync::Arc;

use deepinfer::config::Config;
use deepinfer::kv_cache::KvBudget;
use deepinfer::plugins::{CacheDir, PluginHost};
use deepinfer::runtime::{EngineOptions, FinishReason, Llm, PromptInput, Request, RequestOutput};
use deepinfer::sampling::{BatchSampler, SamplingParams};

const MAX_TOKENS: usize = 6;

fn engine(opts: EngineOptions) -> Llm {
    common::engine_with(common::default_model(), opts)
}

/// An engine for reference runs: no prefix cache, so every run is cold.
fn alone_engine() -> Llm {
    engine(EngineOptions {
        enable_prefix_caching: false,
        ..Default::default()
    })
}

/// `n` distinct token prompts whose lengths cycle through `lens`.
fn prompts(llm: &Llm, n: usize, lens: &[usize]) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let text = format!(
                "Question {i}: a farmer has {} sheep and buys {} more. How many sheep are there now, and why?",
                i * 7 + 3,
                i % 5 + 2
            );
            let ids = llm.model().tokenizer.encode(&text).expect("tokenizes");
            ids[..lens[i % lens.len()].min(ids.len())].to_vec()
        })
        .collect()
}

fn requests(prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Request> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let params = SamplingParams {
                max_tokens,
                ..Default::default()
            };
            Request::new(i.to_string(), PromptInput::Tokens(p.clone()), params)
        })
        .collect()
}

fn run(llm: &Llm, reqs: &[Request]) -> Vec<RequestOutput> {
    let out = llm.generate(reqs, &mut |_| {});
    for o in &out {
        assert!(o.error.is_none(), "{}: {:?}", o.id, o.error);
        assert!(
            !o.token_ids.is_empty() || o.finish_reason == FinishReason::Stop,
            "{o:?}"
        );
    }
    out
}

/// Each request run on its own, cold.
fn alone(llm: &Llm, reqs: &[Request]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|r| run(llm, std::slice::from_ref(r))[0].token_ids.clone())
        .collect()
}

fn tokens(out: &[RequestOutput]) -> Vec<Vec<u32>> {
    out.iter().map(|o| o.token_ids.clone()).collect()
}

#[test]
fn a_batch_of_64_matches_runs_alone_and_sync_scheduling() {
    let solo = alone_engine();
    let ps = prompts(&solo, 64, &[6, 9, 12, 15]);
    let reqs = requests(&ps, MAX_TOKENS);
    let picked: Vec<Request> = reqs.iter().step_by(9).cloned().collect();
    let reference = alone(&solo, &picked);
    drop(solo);

    let batched = engine(EngineOptions::default());
    let out = run(&batched, &reqs);
    let summary = batched.last_summary().expect("a summary");
    eprintln!("batch of 64: {summary}");
    assert!(
        summary.mean_decode_batch > 32.0,
        "the batch did not run together: {summary}"
    );
    for (r, want) in picked.iter().zip(&reference) {
        let got = &out[r.id.parse::<usize>().unwrap()];
        assert_eq!(
            &got.token_ids, want,
            "request {} differs in a batch of 64",
            r.id
        );
    }
    drop(batched);

    let sync = engine(EngineOptions {
        async_scheduling: false,
        ..Default::default()
    });
    let n = 24;
    assert_eq!(
        tokens(&run(&sync, &reqs[..n])),
        tokens(&out[..n]),
        "async and sync scheduling disagree"
    );
}

#[test]
fn a_prefix_cache_hit_changes_nothing() {
    let solo = alone_engine();
    let tok = &solo.model().tokenizer;
    let shared = tok
        .encode("You are a careful assistant. Answer in one short sentence, and never repeat the question. ")
        .expect("tokenizes");
    let reqs: Vec<Request> = [
        "What is the capital of Italy?",
        "Name a red fruit.",
        "What do bees make?",
    ]
    .iter()
    .enumerate()
    .map(|(i, q)| {
        let mut ids = shared.clone();
        ids.extend(tok.encode(q).expect("tokenizes"));
        let params = SamplingParams {
            max_tokens: MAX_TOKENS,
            ..Default::default()
        };
        Request::new(i.to_string(), PromptInput::Tokens(ids), params)
    })
    .collect();
    let reference = alone(&solo, &reqs);
    drop(solo);

    let cached = engine(EngineOptions::default());
    let first = run(&cached, &reqs[..1]);
    assert_eq!(first[0].cached_prompt_tokens, 0);
    let rest = run(&cached, &reqs[1..]);
    let again = run(&cached, &reqs[..1]);
    let block = cached.options().block_size;
    for o in rest.iter().chain(&again) {
        assert!(
            o.cached_prompt_tokens >= shared.len() / block * block,
            "no prefix hit: {o:?}"
        );
    }
    assert!(cached.last_summary().expect("summary").prefix_hit_rate > 0.5);
    assert_eq!(first[0].token_ids, reference[0]);
    assert_eq!(
        again[0].token_ids, reference[0],
        "the same prompt again, from the cache"
    );
    assert_eq!(
        tokens(&rest),
        reference[1..].to_vec(),
        "prompts sharing the cached prefix"
    );
}

#[test]
fn preemption_under_a_tiny_kv_budget_changes_nothing() {
    let solo = alone_engine();
    // Prompts just short of a block boundary, so decoding needs a second block each.
    let ps = prompts(&solo, 16, &[14, 15]);
    let reqs = requests(&ps, 8);
    let reference = alone(&solo, &reqs);
    let bytes_per_block = solo
        .options()
        .kv_layout(solo.model().model.config())
        .bytes_per_block();
    drop(solo);

    let opts = EngineOptions {
        kv_budget: KvBudget::Bytes(10 * bytes_per_block as u64),
        ..Default::default()
    };
    let tight = engine(opts);
    assert_eq!(tight.num_kv_blocks(), 10);
    let out = run(&tight, &reqs);
    let summary = tight.last_summary().expect("summary");
    assert!(summary.preemptions > 0, "nothing was preempted: {summary}");
    assert!(out.iter().any(|o| o.preemptions > 0));
    assert_eq!(tokens(&out), reference);
    assert_eq!(tight.kv_stats().blocks_used, 0, "blocks leaked");
}

#[test]
fn samples_seeds_and_stop_strings_keep_their_meaning() {
    let llm = engine(EngineOptions::default());
    let prompt = PromptInput::Text("The three primary colours are".into());
    let greedy = SamplingParams {
        max_tokens: 10,
        ignore_eos: true,
        ..Default::default()
    };
    let one = run(&llm, &[Request::new("g", prompt.clone(), greedy.clone())]);
    let mut three = Request::new("g3", prompt.clone(), greedy.clone());
    three.n = 3;
    let out = run(&llm, &[three])[0].clone();
    assert_eq!(out.samples.len(), 2);
    assert_eq!(out.token_ids, one[0].token_ids);
    for s in &out.samples {
        assert_eq!(
            s.token_ids, one[0].token_ids,
            "greedy sample {} differs",
            s.sample
        );
    }

    // Seeded sampling: a request's tokens do not depend on its neighbours or on n.
    let hot = SamplingParams {
        temperature: 1.0,
        seed: Some(11),
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    };
    let single = run(&llm, &[Request::new("s", prompt.clone(), hot.clone())]);
    let mut pair = Request::new("s2", prompt.clone(), hot.clone());
    pair.n = 2;
    let others: Vec<Request> = (0..5)
        .map(|i| Request::text(format!("o{i}"), format!("Item {i}:"), hot.clone()))
        .collect();
    let mixed = run(&llm, &[others, vec![pair]].concat());
    assert_eq!(
        mixed[5].token_ids, single[0].token_ids,
        "seeded sample 0 changed in a batch"
    );

    // A stop string taken from the greedy text cuts the output right before it.
    let text = &one[0].text;
    let cut = text
        .char_indices()
        .nth(text.chars().count() / 2)
        .map_or(0, |(i, _)| i);
    let stop: String = text[cut..].chars().take(3).collect();
    let stopped = run(
        &llm,
        &[Request::new(
            "st",
            prompt,
            SamplingParams {
                stop: vec![stop.clone()],
                ..greedy
            },
        )],
    );
    let want = &text[..text.find(&stop).expect("the stop occurs")];
    assert_eq!(stopped[0].text, want);
    assert_eq!(stopped[0].finish_reason, FinishReason::Stop);
    assert!(stopped[0].token_ids.len() < one[0].token_ids.len());
}

#[test]
fn top_candidates_selected_by_the_model_sample_like_full_rows() {
    // With `select_candidates` the model hands the sampler each row's top-K (on a GPU it selects
    // them there); a run that brings back full rows must sample exactly the same tokens, for
    // greedy, seeded, penalized requests and one with a logit bias (which needs full rows, so
    // its steps switch back to them).
    let prompt = |i: usize| PromptInput::Text(format!("Story {i}: once upon a time"));
    let mut reqs = Vec::new();
    for i in 0..6 {
        let params = SamplingParams {
            temperature: if i % 2 == 0 { 0.0 } else { 0.9 },
            top_p: 0.95,
            repetition_penalty: if i == 3 { 1.3 } else { 1.0 },
            seed: Some(100 + i as u64),
            max_tokens: 8,
            ignore_eos: true,
            ..Default::default()
        };
        reqs.push(Request::new(format!("r{i}"), prompt(i), params));
    }
    let mut biased = SamplingParams {
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    };
    biased.logit_bias = vec![(42, 5.0)];
    reqs.push(Request::new("bias", prompt(9), biased));
    // The builtin `standard` plugin (what `generate` samples with) asks for its top 256.
    let cache = tempfile::tempdir().expect("tempdir");
    let host = PluginHost::new(&CacheDir::At(cache.path().to_path_buf())).expect("plugin host");
    let sampler: Arc<dyn BatchSampler> = Arc::new(
        host.load_sampler(&Config::default(), "standard")
            .expect("the builtin sampler loads"),
    );
    assert!(sampler.candidates_wanted(&reqs[0].params).is_some());
    let with = |select_candidates| {
        let opts = EngineOptions {
            select_candidates,
            ..Default::default()
        };
        Llm::new(common::default_model(), sampler.clone(), opts).expect("the engine starts")
    };
    let (selected, full) = (with(true), with(false));
    let a = tokens(&run(&selected, &reqs));
    let b = tokens(&run(&full, &reqs));
    assert_eq!(a, b);
    // Without the biased request every step takes the selected path.
    let c = tokens(&run(&selected, &reqs[..6]));
    assert_eq!(c, b[..6]);
}
