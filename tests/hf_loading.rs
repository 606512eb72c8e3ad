//! HF folders (config.json + safetensors + tokenizer.json) load through the same Llama code as
//! GGUF: a tiny GGUF checkpoint converted to HF layout (rotate-half Q/K rows, HF tensor names,
//! single and sharded safetensors) gives the same logits.

mod common;

use std::collections::HashMap;
use std::path::Path;

use deepinfer::model::batch::Batch;
use deepinfer::model::gguf_writer::{self, TensorOut};
use deepinfer::model::tiny::TinyLlama;
use deepinfer::model::LoadedModel;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

fn hf_name(gguf: &str) -> String {
    let top = |n: &str| match n {
        "token_embd.weight" => "model.embed_tokens.weight".to_string(),
        "output_norm.weight" => "model.norm.weight".to_string(),
        _ => unreachable!("{n}"),
    };
    let Some(rest) = gguf.strip_prefix("blk.") else {
        return top(gguf);
    };
    let (layer, name) = rest.split_once('.').unwrap();
    let hf = match name {
        "attn_norm.weight" => "input_layernorm",
        "attn_q.weight" => "self_attn.q_proj",
        "attn_k.weight" => "self_attn.k_proj",
        "attn_v.weight" => "self_attn.v_proj",
        "attn_output.weight" => "self_attn.o_proj",
        "ffn_norm.weight" => "post_attention_layernorm",
        "ffn_gate.weight" => "mlp.gate_proj",
        "ffn_up.weight" => "mlp.up_proj",
        "ffn_down.weight" => "mlp.down_proj",
        _ => unreachable!("{name}"),
    };
    format!("model.layers.{layer}.{hf}.weight")
}

/// GGUF's Q/K rows pair dimensions (2i, 2i+1) of each head; HF pairs (i, i + half).
fn unpermute(t: &TensorOut, heads: usize) -> Vec<u8> {
    let cols = t.dims[0] as usize;
    let rows = t.dims[1] as usize;
    let hd = rows / heads;
    let half = hd / 2;
    let mut out = vec![0u8; t.data.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = (h * hd + 2 * i + j) * cols * 4;
                let dst = (h * hd + j * half + i) * cols * 4;
                out[dst..dst + cols * 4].copy_from_slice(&t.data[src..src + cols * 4]);
            }
        }
    }
    out
}

fn write_hf(
    dir: &Path,
    spec: &TinyLlama,
    tensors: &[TensorOut],
    shards: usize,
    gguf: &LoadedModel,
) {
    let mut named: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|t| {
            let data = if t.name.ends_with("attn_q.weight") {
                unpermute(t, spec.heads)
            } else if t.name.ends_with("attn_k.weight") {
                unpermute(t, spec.kv_heads)
            } else {
                t.data.clone()
            };
            (
                hf_name(&t.name),
                t.dims.iter().rev().map(|&d| d as usize).collect(),
                data,
            )
        })
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let per = named.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in named.chunks(per).enumerate() {
        let file = if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{shards:05}.safetensors", i + 1)
        };
        let views: Vec<(String, TensorView)> = chunk
            .iter()
            .map(|(n, shape, data)| {
                (
                    n.clone(),
                    TensorView::new(Dtype::F32, shape.clone(), data).unwrap(),
                )
            })
            .collect();
        for (n, _) in &views {
            weight_map.insert(n.clone(), serde_json::Value::String(file.clone()));
        }
        safetensors::serialize_to_file(views, None::<HashMap<String, String>>, &dir.join(&file))
            .unwrap();
    }
    if shards > 1 {
        let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": spec.hidden, "intermediate_size": spec.ffn,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
        "num_hidden_layers": spec.layers, "vocab_size": deepinfer::model::tiny::vocab().len(),
        "max_position_embeddings": spec.context, "rms_norm_eps": 1e-5,
        "rope_parameters": { "rope_type": "default", "rope_theta": 10000.0 },
        "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    gguf.tokenizer
        .save_json(&dir.join("tokenizer.json"))
        .unwrap();
}

fn logits(m: &LoadedModel, tokens: &[u32]) -> Vec<f32> {
    let mut kv = m.model.new_kv(4, 16).unwrap();
    let mut b = Batch::default();
    b.push(tokens, 0, vec![0, 1, 2, 3], false);
    b.logits_for = (0..tokens.len()).collect();
    m.model.forward(&b, &mut kv).unwrap()
}

#[test]
fn hf_folders_single_and_sharded_match_the_gguf_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinyLlama::default();
    let (meta, tensors) = spec.build();
    let gguf_path = dir.path().join("tiny.gguf");
    gguf_writer::write(&gguf_path, &meta, &tensors).unwrap();
    let gguf = common::load_cpu(&gguf_path).unwrap();
    let text = "hello world, or else";
    let ids = gguf.tokenizer.encode(text).unwrap();
    let want = logits(&gguf, &ids);
    for shards in [1, 3] {
        let hf_dir = dir.path().join(format!("hf{shards}"));
        std::fs::create_dir_all(&hf_dir).unwrap();
        write_hf(&hf_dir, &spec, &tensors, shards, &gguf);
        let hf = common::load_cpu(&hf_dir).unwrap_or_else(|e| panic!("{shards} shards: {e}"));
        assert_eq!(hf.tokenizer.encode(text).unwrap(), ids);
        let got = logits(&hf, &ids);
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            diff < 1e-3,
            "{shards} shard(s): max logit difference {diff}"
        );
    }
}

#[test]
fn hf_config_errors_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type": "llama", "hidden_size": 64}"#,
    )
    .unwrap();
    let e = common::load_cpu(dir.path()).unwrap_err().to_string();
    assert!(e.contains("num_attention_heads"), "{e}");
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type": "gpt-neo"}"#,
    )
    .unwrap();
    let e = common::load_cpu(dir.path()).unwrap_err().to_string();
    assert!(e.contains("gpt-neo"), "{e}");
    // A layer count no file could back is refused before any per-layer table is sized by it.
    for n in ["1000000000", "18446744073709551615"] {
        std::fs::write(
            dir.path().join("config.json"),
            format!(
                r#"{{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                    "num_hidden_layers": {n}, "intermediate_size": 128, "vocab_size": 32}}"#
            ),
        )
        .unwrap();
        let e = common::load_cpu(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("num_hidden_layers") && e.contains("1024"),
            "{n}: {e}"
        );
    }
}
