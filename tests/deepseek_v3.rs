//! DeepSeek-V3 on the CPU against HF transformers: tiny checkpoints written by
//! `deepinfer dev make-tiny` (tests/data/deepseek/*), reference logits from HF's own
//! `DeepseekV3ForCausalLM` and `MtpModel` in fp32 (scripts/deepseek_v3_reference.py). Checks a
//! prompt and 16 decode steps through the MLA cache, group-limited routing on and off, q_lora on
//! and off, FP8 block-quantized weights, the MTP layer, absorbed vs expanded MLA, and that bad
//! checkpoints fail with errors that name the problem.

use std::collections::HashMap;
use std::path::Path;

use deepinfer::backend::cpu::CpuBackend;
use deepinfer::model::arch::deepseek_v3::DeepseekV3;
use deepinfer::model::batch::Batch;
use deepinfer::model::mla::MlaPath;
use deepinfer::model::tiny_deepseek::TinyDeepseek;
use deepinfer::model::CausalLm;
use safetensors::SafeTensors;

#[path = "common/deepseek_ref.rs"]
mod deepseek_ref;

use deepseek_ref::{
    bf16_copy, copy_fixture, data, max_err, mtp_against_reference, prefill, reference, row_err,
};

const TOL: f64 = 1e-4;

fn model(name: &str) -> DeepseekV3<CpuBackend> {
    DeepseekV3::open(&data().join(name), CpuBackend::new(2)).expect("the tiny checkpoint loads")
}

/// Prompt in one prefill pass (expanded MLA), then each decode token alone (absorbed MLA) through
/// the cache; returns the max relative errors of the prompt rows and the decode rows.
fn check_prompt_and_decode(name: &str) -> (f64, f64) {
    let m = model(name);
    let r = reference(name);
    let mut kv = m.new_kv(4, 16).unwrap();
    let p = r.prompt_len;
    let got = m.forward(&prefill(&r.tokens[..p], 0), &mut kv).unwrap();
    let prompt_err = max_err(&got, &r.logits[..p * r.vocab], r.vocab);
    let mut decode_err = 0f64;
    for i in p..r.tokens.len() {
        let mut b = Batch::default();
        b.push(&r.tokens[i..i + 1], i, vec![0, 1, 2, 3], true);
        let got = m.forward(&b, &mut kv).unwrap();
        decode_err = decode_err.max(row_err(&got, &r.logits[i * r.vocab..(i + 1) * r.vocab]));
    }
    assert_eq!(r.tokens.len() - p, 16, "16 decode steps");
    eprintln!("{name}: prompt max rel err {prompt_err:.2e}, 16 decode steps {decode_err:.2e}");
    assert!(
        prompt_err < TOL,
        "{name}: prompt logits off by {prompt_err:e}"
    );
    assert!(
        decode_err < TOL,
        "{name}: decode logits off by {decode_err:e}"
    );
    (prompt_err, decode_err)
}

#[test]
fn q_lora_and_group_limited_routing_match_hf() {
    check_prompt_and_decode("qlora_group");
}

#[test]
fn no_q_lora_and_no_group_limit_match_hf() {
    check_prompt_and_decode("noqlora_nogroup");
}

#[test]
fn fp8_block_quantized_weights_match_hf() {
    check_prompt_and_decode("fp8");
}

#[test]
fn group_limit_changes_this_checkpoint() {
    // the group-limited fixture would route differently without the limit: the check above
    // would catch an implementation that ignored n_group/topk_group
    let dir = tempfile::tempdir().unwrap();
    copy_fixture("qlora_group", dir.path());
    edit_config(dir.path(), |c| c["topk_group"] = c["n_group"].clone());
    let m = DeepseekV3::open(dir.path(), CpuBackend::new(2)).unwrap();
    let r = reference("qlora_group");
    let mut kv = m.new_kv(4, 16).unwrap();
    let got = m.forward(&prefill(&r.tokens, 0), &mut kv).unwrap();
    let err = max_err(&got, &r.logits, r.vocab);
    eprintln!("without the group limit the logits move by {err:.2e}");
    assert!(err > 1e-3, "group limit made no difference ({err:e})");
}

#[test]
fn mtp_layer_matches_hf() {
    for name in ["qlora_group", "noqlora_nogroup", "fp8"] {
        let m = model(name);
        assert_eq!(m.num_mtp_layers(), 1);
        let r = reference(name);
        let d = r.hidden_dim;
        let mut kv = m.new_kv(4, 16).unwrap();
        let (hidden, err) = mtp_against_reference(&m, &r, &mut kv);
        let herr = max_err(&hidden, &r.hidden, d);
        eprintln!("{name}: hidden max rel err {herr:.2e}, MTP logits {err:.2e}");
        assert!(
            herr < TOL && err < TOL,
            "{name}: hidden {herr:e}, MTP {err:e}"
        );
        assert!(m
            .mtp_forward(1, &prefill(&r.tokens[..1], 0), &hidden[..d], &mut kv)
            .is_err());
    }
}

#[test]
fn absorbed_and_expanded_mla_agree_on_the_model() {
    let r = reference("qlora_group");
    let mut m = model("qlora_group");
    let run = |m: &DeepseekV3<CpuBackend>| {
        let mut kv = m.new_kv(4, 16).unwrap();
        m.forward(&prefill(&r.tokens, 0), &mut kv).unwrap()
    };
    m.set_mla_path(MlaPath::Absorbed);
    let absorbed = run(&m);
    m.set_mla_path(MlaPath::Expanded);
    let expanded = run(&m);
    let err = max_err(&absorbed, &expanded, r.vocab);
    eprintln!(
        "absorbed vs expanded over {} positions: {err:.2e}",
        r.tokens.len()
    );
    assert!(err < 1e-5, "absorbed vs expanded: {err:e}");
    assert!(max_err(&absorbed, &r.logits, r.vocab) < TOL);
}

#[test]
fn expert_load_counts_every_routed_token() {
    let m = model("qlora_group");
    let r = reference("qlora_group");
    let mut kv = m.new_kv(4, 16).unwrap();
    m.forward(&prefill(&r.tokens[..10], 0), &mut kv).unwrap();
    let load = m.expert_load();
    // layers 1 and 2 are MoE (layer 0 dense), plus the MTP layer (not run yet)
    assert_eq!(load.iter().map(|l| l.0).collect::<Vec<_>>(), vec![1, 2, 3]);
    for (layer, l) in &load[..2] {
        assert_eq!(l.last_step.iter().sum::<u64>(), 10 * 3, "layer {layer}");
        assert_eq!(l.steps, 1);
    }
    assert_eq!(load[2].1.steps, 0);
}

#[test]
fn make_tiny_regenerates_the_fixtures_byte_for_byte() {
    let specs = [
        ("qlora_group", TinyDeepseek::default()),
        (
            "noqlora_nogroup",
            TinyDeepseek {
                seed: 2,
                q_lora_rank: None,
                n_group: 1,
                topk_group: 1,
                ..TinyDeepseek::default()
            },
        ),
        (
            "fp8",
            TinyDeepseek {
                seed: 3,
                fp8_block: Some([32, 32]),
                ..TinyDeepseek::default()
            },
        ),
    ];
    for (name, spec) in specs {
        let dir = tempfile::tempdir().unwrap();
        spec.write(dir.path()).unwrap();
        for f in ["config.json", "model.safetensors", "tokenizer.json"] {
            let a = std::fs::read(dir.path().join(f)).unwrap();
            let b = std::fs::read(data().join(name).join(f)).unwrap();
            assert!(a == b, "{name}/{f} differs from what make-tiny writes");
        }
    }
}

#[test]
fn loads_through_the_generic_hf_path_with_its_tokenizer() {
    let loaded = deepinfer::model::load(
        &data().join("qlora_group"),
        deepinfer::backend::Device::Cpu { threads: 2 },
    )
    .unwrap();
    assert_eq!(loaded.model.config().arch, "deepseek_v3");
    assert_eq!(loaded.tokenizer.vocab_size(), loaded.model.config().vocab);
    let ids = loaded.tokenizer.encode("hello world").unwrap();
    assert_eq!(loaded.tokenizer.decode(&ids).unwrap(), "hello world");
    let r = reference("qlora_group");
    let mut kv = loaded.model.new_kv(4, 16).unwrap();
    let got = loaded
        .model
        .forward(&prefill(&r.tokens, 0), &mut kv)
        .unwrap();
    assert!(max_err(&got, &r.logits, r.vocab) < TOL);
}

#[test]
fn engine_batches_match_the_direct_greedy_loop() {
    use deepinfer::runtime::{EngineOptions, Llm, PromptInput, Request};
    use deepinfer::sampling::{NativeSampler, SamplingParams};
    let r = reference("qlora_group");
    let prompts: Vec<Vec<u32>> = vec![
        r.tokens[..5].to_vec(),
        r.tokens[3..20].to_vec(),
        r.tokens[..1].to_vec(),
    ];
    let steps = 10;
    let m = model("qlora_group");
    let argmax = |l: &[f32]| (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32;
    let direct: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut kv = m.new_kv(4, 16).unwrap();
            let mut b = prefill(p, 0);
            b.logits_for = vec![p.len() - 1];
            let mut next = argmax(&m.forward(&b, &mut kv).unwrap());
            let mut out = vec![next];
            for i in 1..steps {
                let mut b = Batch::default();
                b.push(&[next], p.len() + i - 1, vec![0, 1, 2, 3], true);
                next = argmax(&m.forward(&b, &mut kv).unwrap());
                out.push(next);
            }
            out
        })
        .collect();
    let loaded = deepinfer::model::load(
        &data().join("qlora_group"),
        deepinfer::backend::Device::Cpu { threads: 2 },
    )
    .unwrap();
    // the engine sizes the cache by the latent layout: 3 main + 1 MTP layer, 32 + 8 floats
    assert_eq!(
        loaded.model.kv_layout(16).bytes_per_block(),
        4 * 40 * 4 * 16
    );
    let llm = Llm::new(
        loaded,
        std::sync::Arc::new(NativeSampler),
        EngineOptions::default(),
    )
    .unwrap();
    let reqs: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            Request::new(
                i.to_string(),
                PromptInput::Tokens(p.clone()),
                SamplingParams {
                    max_tokens: steps,
                    ignore_eos: true,
                    ..Default::default()
                },
            )
        })
        .collect();
    let out = llm.generate(&reqs, &mut |_| {});
    for (o, want) in out.iter().zip(&direct) {
        assert!(o.error.is_none(), "{:?}", o.error);
        assert_eq!(&o.token_ids, want, "request {}", o.id);
    }
}

#[test]
fn bf16_weights_load_and_stay_close() {
    // the same checkpoint with every tensor rounded to bf16: loads through the BF16 path, and
    // lands within bf16 rounding of the fp32 reference (but not on it)
    let dir = tempfile::tempdir().unwrap();
    bf16_copy("qlora_group", dir.path());
    let m = DeepseekV3::open(dir.path(), CpuBackend::new(2)).unwrap();
    let r = reference("qlora_group");
    let mut kv = m.new_kv(4, 16).unwrap();
    let got = m.forward(&prefill(&r.tokens, 0), &mut kv).unwrap();
    let err = max_err(&got, &r.logits, r.vocab);
    eprintln!("bf16 weights vs fp32 reference: {err:.2e}");
    assert!(err > 1e-5 && err < 5e-2, "bf16: {err:e}");
}

// ---- bad input -------------------------------------------------------------------------------

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut c);
    std::fs::write(&p, c.to_string()).unwrap();
}

fn open_err(name: &str, edit: impl FnOnce(&Path)) -> String {
    let dir = tempfile::tempdir().unwrap();
    copy_fixture(name, dir.path());
    edit(dir.path());
    let Err(e) = DeepseekV3::open(dir.path(), CpuBackend::new(1)) else {
        panic!("the broken checkpoint must not load");
    };
    let cpu = deepinfer::backend::Device::Cpu { threads: 1 };
    let Err(generic) = deepinfer::model::load(dir.path(), cpu) else {
        panic!("nor through the generic loader");
    };
    assert_eq!(e.to_string(), generic.to_string());
    e.to_string()
}

/// Rewrites model.safetensors without the tensor `drop`.
fn rewrite_tensors(dir: &Path, drop: &str) {
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != drop)
        .collect();
    assert!(kept.len() + 1 == st.len(), "{drop} was in the checkpoint");
    safetensors::serialize_to_file(kept, None::<HashMap<String, String>>, &p).unwrap();
}

#[test]
fn config_contradicting_the_tensors_names_the_tensor() {
    let e = open_err("qlora_group", |d| {
        edit_config(d, |c| c["kv_lora_rank"] = 24.into())
    });
    assert!(e.contains("kv_b_proj") && e.contains("shape"), "{e}");
    let e = open_err("qlora_group", |d| {
        edit_config(d, |c| c["q_lora_rank"] = 0.into())
    });
    assert!(e.contains("q_proj"), "{e}");
    let e = open_err("qlora_group", |d| {
        edit_config(d, |c| c["n_routed_experts"] = 16.into())
    });
    assert!(
        e.contains("mlp.gate.weight") || e.contains("experts.8"),
        "{e}"
    );
}

#[test]
fn missing_expert_tensor_is_named() {
    let name = "model.layers.2.mlp.experts.5.up_proj.weight";
    let e = open_err("qlora_group", |d| rewrite_tensors(d, name));
    assert!(e.contains(name), "{e}");
    let scale = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv";
    let e = open_err("fp8", |d| rewrite_tensors(d, scale));
    assert!(e.contains(scale) && e.contains("FP8"), "{e}");
}

#[test]
fn routing_settings_out_of_range_are_rejected() {
    for (key, value, expect) in [
        ("topk_group", serde_json::json!(5), "topk_group"),
        ("n_group", serde_json::json!(3), "n_group"),
        (
            "num_experts_per_tok",
            serde_json::json!(9),
            "num_experts_per_tok",
        ),
        ("scoring_func", serde_json::json!("relu"), "scoring_func"),
        ("topk_method", serde_json::json!("random"), "topk_method"),
        (
            "routed_scaling_factor",
            serde_json::json!(-1.0),
            "routed_scaling_factor",
        ),
        (
            "first_k_dense_replace",
            serde_json::json!(7),
            "first_k_dense_replace",
        ),
        ("kv_lora_rank", serde_json::json!("big"), "kv_lora_rank"),
    ] {
        let e = open_err("qlora_group", |d| {
            edit_config(d, |c| c[key] = value.clone())
        });
        assert!(e.contains(expect), "{key} = {value}: {e}");
    }
    let e = open_err("qlora_group", |d| {
        edit_config(d, |c| c["rope_scaling"]["type"] = "dynamic".into())
    });
    assert!(e.contains("rope"), "{e}");
    let e = open_err("fp8", |d| {
        edit_config(d, |c| {
            c["quantization_config"]["weight_block_size"] = serde_json::json!([0, 32])
        })
    });
    assert!(e.contains("weight_block_size"), "{e}");
}

#[test]
fn layer_counts_no_checkpoint_backs_are_refused() {
    for n in [
        serde_json::json!(1_000_000_000u64),
        serde_json::json!(u64::MAX),
    ] {
        let e = open_err("qlora_group", |d| {
            edit_config(d, |c| c["num_hidden_layers"] = n.clone())
        });
        assert!(
            e.contains("num_hidden_layers") && e.contains("1024"),
            "{n}: {e}"
        );
    }
    let e = open_err("qlora_group", |d| {
        edit_config(d, |c| c["num_hidden_layers"] = 5.into())
    });
    assert!(e.contains("model.layers."), "{e}");
}

/// Every number of a tiny checkpoint's config.json (rope_scaling's included) set to each
/// extreme: the load either succeeds or gives an error; it never panics or aborts.
#[test]
fn every_config_number_at_its_extremes_is_an_error_or_loads() {
    let dir = tempfile::tempdir().unwrap();
    copy_fixture("qlora_group", dir.path());
    let path = dir.path().join("config.json");
    let original = std::fs::read_to_string(&path).unwrap();
    let cfg: serde_json::Value = serde_json::from_str(&original).unwrap();
    let mut places: Vec<Vec<String>> = Vec::new();
    for (k, v) in cfg.as_object().unwrap() {
        if v.is_number() {
            places.push(vec![k.clone()]);
        }
        if let Some(o) = v.as_object() {
            places.extend(
                o.iter()
                    .filter(|(_, x)| x.is_number())
                    .map(|(j, _)| vec![k.clone(), j.clone()]),
            );
        }
    }
    let extremes = [
        serde_json::json!(0),
        serde_json::json!(-1),
        serde_json::json!(1u64 << 31),
        serde_json::json!(u64::MAX),
        serde_json::json!(1e300),
        serde_json::json!(0.5),
    ];
    for place in &places {
        for x in &extremes {
            let mut c = cfg.clone();
            let slot = place.iter().fold(&mut c, |v, k| &mut v[k.as_str()]);
            *slot = x.clone();
            std::fs::write(&path, c.to_string()).unwrap();
            let cpu = deepinfer::backend::Device::Cpu { threads: 1 };
            if let Err(e) = deepinfer::model::load(dir.path(), cpu) {
                assert!(!e.to_string().is_empty(), "{place:?} = {x}");
            }
        }
    }
    assert!(places.len() >= 20, "only {} numbers found", places.len());
    std::fs::write(&path, original).unwrap();
}

#[test]
fn corrupt_safetensors_is_an_error_not_a_panic() {
    let e = open_err("qlora_group", |d| {
        let p = d.join("model.safetensors");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    });
    assert!(e.contains("safetensors"), "{e}");
    let e = open_err("qlora_group", |d| {
        std::fs::write(
            d.join("model.safetensors"),
            b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}",
        )
        .unwrap()
    });
    assert!(e.contains("safetensors"), "{e}");
}
