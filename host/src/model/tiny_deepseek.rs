//! Tiny random DeepSeek-V3 checkpoints in HF format (`config.json`, `model.safetensors`,
//! `tokenizer.json`): deterministic from a seed, fp32 weights or DeepSeek's FP8 e4m3 weights
//! with block `weight_scale_inv`. Tests and `deepinfer dev make-tiny` use them; reference
//! logits come from HF transformers run on the same files.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use super::tiny::{vocab, Rng, SPECIALS};
use crate::error::{Error, Result};

/// Shape and options of a tiny DeepSeek-V3.
#[derive(Debug, Clone)]
pub struct TinyDeepseek {
    pub seed: u64,
    pub layers: usize,
    pub first_dense: usize,
    pub mtp_layers: usize,
    pub hidden: usize,
    pub heads: usize,
    /// `None`: `q_proj` without the low-rank path.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    pub intermediate: usize,
    pub moe_intermediate: usize,
    pub experts: usize,
    pub top_k: usize,
    pub shared: usize,
    pub n_group: usize,
    pub topk_group: usize,
    /// FP8 e4m3 weights with scales per block of this shape.
    pub fp8_block: Option<[usize; 2]>,
}

impl Default for TinyDeepseek {
    fn default() -> Self {
        TinyDeepseek {
            seed: 1,
            layers: 3,
            first_dense: 1,
            mtp_layers: 1,
            hidden: 64,
            heads: 4,
            q_lora_rank: Some(32),
            kv_lora_rank: 32,
            nope: 16,
            rope: 8,
            v: 16,
            intermediate: 128,
            moe_intermediate: 32,
            experts: 8,
            top_k: 3,
            shared: 1,
            n_group: 4,
            topk_group: 2,
            fp8_block: None,
        }
    }
}

/// The e4m3 code nearest to `x` (saturating at +-448).
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x < 0.0 { 0x80 } else { 0 };
    let a = x.abs().min(448.0);
    let mut best = (0u8, f32::INFINITY);
    for code in 0u8..0x7F {
        let d = (super::hf::e4m3_to_f32(code) - a).abs();
        if d < best.1 {
            best = (code, d);
        }
    }
    sign | best.0
}

struct Tensor {
    name: String,
    shape: Vec<usize>,
    dtype: Dtype,
    data: Vec<u8>,
}

fn f32_tensor(name: String, shape: Vec<usize>, vals: Vec<f32>) -> Tensor {
    Tensor {
        name,
        shape,
        dtype: Dtype::F32,
        data: vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

impl TinyDeepseek {
    pub fn vocab_size(&self) -> usize {
        vocab().len()
    }

    /// `config.json` contents.
    pub fn config(&self) -> serde_json::Value {
        let mut c = json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size(),
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "moe_intermediate_size": self.moe_intermediate,
            "num_hidden_layers": self.layers,
            "num_nextn_predict_layers": self.mtp_layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.heads,
            "n_shared_experts": self.shared,
            "n_routed_experts": self.experts,
            "routed_scaling_factor": 2.5,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_rope_head_dim": self.rope,
            "v_head_dim": self.v,
            "qk_nope_head_dim": self.nope,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "num_experts_per_tok": self.top_k,
            "first_k_dense_replace": self.first_dense,
            "moe_layer_freq": 1,
            "norm_topk_prob": true,
            "hidden_act": "silu",
            "max_position_embeddings": 128,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8
            },
            "rope_interleave": true,
            "attention_bias": false,
            "tie_word_embeddings": false,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32"
        });
        if let Some([r, k]) = self.fp8_block {
            c["quantization_config"] = json!({
                "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [r, k]
            });
        }
        c
    }

    fn tensors(&self) -> Vec<Tensor> {
        let mut r = Rng(self.seed);
        let (d, h) = (self.hidden, self.heads);
        let qk = self.nope + self.rope;
        let mut out = Vec::new();
        let nv = self.vocab_size();
        out.push(f32_tensor(
            "model.embed_tokens.weight".into(),
            vec![nv, d],
            r.fill(nv * d, 1.0),
        ));
        let lin = |r: &mut Rng, name: String, rows: usize, cols: usize| {
            let v = r.fill(rows * cols, 1.0 / (cols as f32).sqrt());
            (name, vec![rows, cols], v)
        };
        let gain =
            |r: &mut Rng, n: usize| -> Vec<f32> { (0..n).map(|_| 1.0 + 0.2 * r.next()).collect() };
        let mut layer_tensors = Vec::new();
        for i in 0..self.layers + self.mtp_layers {
            let p = format!("model.layers.{i}");
            let mut t = Vec::new();
            t.push((
                format!("{p}.input_layernorm.weight"),
                vec![d],
                gain(&mut r, d),
            ));
            t.push((
                format!("{p}.post_attention_layernorm.weight"),
                vec![d],
                gain(&mut r, d),
            ));
            let a = format!("{p}.self_attn");
            match self.q_lora_rank {
                None => t.push(lin(&mut r, format!("{a}.q_proj.weight"), h * qk, d)),
                Some(q) => {
                    t.push(lin(&mut r, format!("{a}.q_a_proj.weight"), q, d));
                    t.push((
                        format!("{a}.q_a_layernorm.weight"),
                        vec![q],
                        gain(&mut r, q),
                    ));
                    t.push(lin(&mut r, format!("{a}.q_b_proj.weight"), h * qk, q));
                }
            }
            let kr = self.kv_lora_rank;
            t.push(lin(
                &mut r,
                format!("{a}.kv_a_proj_with_mqa.weight"),
                kr + self.rope,
                d,
            ));
            t.push((
                format!("{a}.kv_a_layernorm.weight"),
                vec![kr],
                gain(&mut r, kr),
            ));
            t.push(lin(
                &mut r,
                format!("{a}.kv_b_proj.weight"),
                h * (self.nope + self.v),
                kr,
            ));
            t.push(lin(&mut r, format!("{a}.o_proj.weight"), d, h * self.v));
            let mlp = |r: &mut Rng, t: &mut Vec<_>, p: String, f: usize| {
                t.push(lin(r, format!("{p}.gate_proj.weight"), f, d));
                t.push(lin(r, format!("{p}.up_proj.weight"), f, d));
                t.push(lin(r, format!("{p}.down_proj.weight"), d, f));
            };
            if i < self.first_dense {
                mlp(&mut r, &mut t, format!("{p}.mlp"), self.intermediate);
            } else {
                let g = r.fill(self.experts * d, 3.0 / (d as f32).sqrt());
                t.push((format!("{p}.mlp.gate.weight"), vec![self.experts, d], g));
                let b = r.fill(self.experts, 0.05);
                t.push((
                    format!("{p}.mlp.gate.e_score_correction_bias"),
                    vec![self.experts],
                    b,
                ));
                for e in 0..self.experts {
                    mlp(
                        &mut r,
                        &mut t,
                        format!("{p}.mlp.experts.{e}"),
                        self.moe_intermediate,
                    );
                }
                if self.shared > 0 {
                    let f = self.shared * self.moe_intermediate;
                    mlp(&mut r, &mut t, format!("{p}.mlp.shared_experts"), f);
                }
            }
            if i >= self.layers {
                t.push((format!("{p}.enorm.weight"), vec![d], gain(&mut r, d)));
                t.push((format!("{p}.hnorm.weight"), vec![d], gain(&mut r, d)));
                t.push(lin(&mut r, format!("{p}.eh_proj.weight"), d, 2 * d));
                t.push((
                    format!("{p}.shared_head.norm.weight"),
                    vec![d],
                    gain(&mut r, d),
                ));
            }
            layer_tensors.extend(t);
        }
        let norm = gain(&mut r, d);
        let head = r.fill(nv * d, 1.0 / (d as f32).sqrt());
        for (name, shape, vals) in layer_tensors {
            let quantize = self.fp8_block.is_some()
                && shape.len() == 2
                && name.ends_with("_proj.weight")
                && name.contains("model.layers.");
            if let (true, Some(block)) = (quantize, self.fp8_block) {
                let (q, s) = quantize_fp8(&vals, shape[0], shape[1], block);
                let grid = vec![shape[0].div_ceil(block[0]), shape[1].div_ceil(block[1])];
                let scale_name = name.replace(".weight", ".weight_scale_inv");
                out.push(Tensor {
                    name,
                    shape,
                    dtype: Dtype::F8_E4M3,
                    data: q,
                });
                out.push(f32_tensor(scale_name, grid, s));
            } else {
                out.push(f32_tensor(name, shape, vals));
            }
        }
        out.push(f32_tensor("model.norm.weight".into(), vec![d], norm));
        out.push(f32_tensor("lm_head.weight".into(), vec![nv, d], head));
        out
    }

    /// Checks the shape through the loader's own config validation.
    pub fn validate(&self) -> Result<()> {
        super::deepseek_config::DeepseekV3Config::from_json(&self.config()).map(|_| ())
    }

    /// Writes the checkpoint into `dir` (created if needed).
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let tensors = self.tensors();
        let views = tensors
            .iter()
            .map(|t| {
                TensorView::new(t.dtype, t.shape.clone(), &t.data)
                    .map(|v| (t.name.clone(), v))
                    .map_err(|e| Error::BadConfig(format!("tensor {}: {e}", t.name)))
            })
            .collect::<Result<Vec<_>>>()?;
        let path = dir.join("model.safetensors");
        safetensors::serialize_to_file(views, None::<HashMap<String, String>>, &path).map_err(
            |e| Error::Safetensors {
                path: path.clone(),
                reason: e.to_string(),
            },
        )?;
        let write = |name: &str, text: String| {
            let p = dir.join(name);
            std::fs::write(&p, text).map_err(|e| Error::io(&p, e))
        };
        let pretty = |v: &serde_json::Value| {
            serde_json::to_string_pretty(&crate::json::sorted_keys(v)).unwrap_or_default() + "\n"
        };
        write("config.json", pretty(&self.config()))?;
        write(
            "generation_config.json",
            pretty(&json!({"bos_token_id": 1, "eos_token_id": 2})),
        )?;
        write(
            "tokenizer_config.json",
            pretty(&json!({
                "add_bos_token": false,
                "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
            })),
        )?;
        write_tokenizer(&dir.join("tokenizer.json"))
    }
}

/// Per-block `amax / 448` scales and the e4m3 codes of `w / scale`.
fn quantize_fp8(w: &[f32], rows: usize, cols: usize, [br, bc]: [usize; 2]) -> (Vec<u8>, Vec<f32>) {
    let grid_c = cols.div_ceil(bc);
    let mut scales = vec![0.0f32; rows.div_ceil(br) * grid_c];
    for r in 0..rows {
        for c in 0..cols {
            let s = &mut scales[(r / br) * grid_c + c / bc];
            *s = s.max(w[r * cols + c].abs() / 448.0);
        }
    }
    for s in &mut scales {
        if *s == 0.0 {
            *s = 1.0;
        }
    }
    let q = (0..rows * cols)
        .map(|i| f32_to_e4m3(w[i] / scales[(i / cols / br) * grid_c + (i % cols) / bc]))
        .collect();
    (q, scales)
}

/// A byte-level BPE `tokenizer.json` over the tiny vocabulary (the same tokens as the tiny
/// Llama GGUF: ChatML specials, 256 byte tokens, a few merges).
fn write_tokenizer(path: &Path) -> Result<()> {
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::AddedToken;
    let terr = |e: tokenizers::Error| Error::Tokenizer(e.to_string());
    let v = vocab();
    let ids: HashMap<String, u32> = v
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges: Vec<(String, String)> = v[SPECIALS.len() + 256..]
        .iter()
        .filter_map(|m| split_merge(m, &ids))
        .collect();
    let vocab: tokenizers::models::bpe::Vocab = ids.into_iter().collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(terr)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let specials: Vec<AddedToken> = SPECIALS
        .iter()
        .map(|s| AddedToken::from(s.to_string(), true))
        .collect();
    tok.add_special_tokens(&specials);
    tok.save(path, false).map_err(terr)
}

/// The pair of existing tokens a merged token came from (longest known prefix first).
fn split_merge(m: &str, ids: &HashMap<String, u32>) -> Option<(String, String)> {
    let chars: Vec<char> = m.chars().collect();
    (1..chars.len()).rev().find_map(|k| {
        let (a, b): (String, String) = (chars[..k].iter().collect(), chars[k..].iter().collect());
        (ids.contains_key(&a) && ids.contains_key(&b)).then_some((a, b))
    })
}
