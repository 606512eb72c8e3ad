//! HF-format model folders: `config.json`, `*.safetensors` (single or sharded with
//! `model.safetensors.index.json`), `tokenizer.json`, `tokenizer_config.json`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::arch;
use super::chat::ChatTemplate;
use super::hparams::{
    check_layer_count, AttentionKind, LayerSpec, ModelConfig, RopeSpec, RopeStyle,
};
use super::tokenizer::Tokenizer;
use super::{LoadedModel, Naming, WeightSource};
use crate::error::{Error, Result};
use crate::tensor::{Bytes, DType, Weight};

struct Entry {
    map: Arc<Mmap>,
    /// `None`: FP8 e4m3 (dequantized on load with its `weight_scale_inv`).
    dtype: Option<DType>,
    shape: Vec<usize>,
    offset: usize,
    len: usize,
}

/// The tensors of an HF folder, memory-mapped.
pub struct SafetensorsFolder {
    tensors: HashMap<String, Entry>,
    /// Block shape of FP8 weights' scales (`quantization_config.weight_block_size`).
    fp8_block: [usize; 2],
}

fn st_err(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Safetensors {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

impl SafetensorsFolder {
    /// Maps every safetensors file of the folder (the index's shards, or `model.safetensors`,
    /// or every `*.safetensors`).
    pub fn open(dir: &Path) -> Result<SafetensorsFolder> {
        let files = shard_files(dir)?;
        let mut tensors = HashMap::new();
        for path in files {
            let file = std::fs::File::open(&path).map_err(|e| Error::io(&path, e))?;
            // SAFETY: read-only map of a model file; see `GgufFile::open`.
            let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?);
            let (header, meta) = SafeTensors::read_metadata(&map).map_err(|e| st_err(&path, e))?;
            let data_start = 8 + header;
            for (name, info) in meta.tensors() {
                let dtype = match info.dtype {
                    Dtype::F32 => Some(DType::F32),
                    Dtype::F16 => Some(DType::F16),
                    Dtype::BF16 => Some(DType::BF16),
                    Dtype::F8_E4M3 => None,
                    other => {
                        return Err(st_err(
                            &path,
                            format!("tensor `{name}` has unsupported dtype {other:?}"),
                        ))
                    }
                };
                let (a, b) = info.data_offsets;
                tensors.insert(
                    name.clone(),
                    Entry {
                        map: map.clone(),
                        dtype,
                        shape: info.shape.clone(),
                        offset: data_start + a,
                        len: b - a,
                    },
                );
            }
        }
        Ok(SafetensorsFolder {
            tensors,
            fp8_block: [128, 128],
        })
    }

    /// Sets the block shape FP8 weights' scales cover (DeepSeek: 128 x 128).
    pub fn set_fp8_block(&mut self, block: [usize; 2]) {
        self.fp8_block = block;
    }

    /// An FP8 e4m3 weight times its per-block `weight_scale_inv`, as an owned F32 weight.
    fn dequant_fp8(&self, name: &str, e: &Entry, rows: usize, cols: usize) -> Result<Weight> {
        let scale_name = match name.strip_suffix(".weight") {
            Some(p) => format!("{p}.weight_scale_inv"),
            None => format!("{name}_scale_inv"),
        };
        let [br, bc] = self.fp8_block;
        let grid = [rows.div_ceil(br), cols.div_ceil(bc)];
        let scales = self.weight(&scale_name, &grid).map_err(|err| match err {
            Error::MissingTensor(_) => Error::MissingTensor(format!(
                "{scale_name} (the block scales of FP8 tensor `{name}`)"
            )),
            other => other,
        })?;
        let sdt = scales.dtype;
        let mut s = vec![0.0f32; grid[0] * grid[1]];
        crate::backend::cpu::quant::dequantize_row(sdt, scales.bytes(), &mut s);
        let raw = &e.map[e.offset..e.offset + e.len];
        let mut out = Vec::with_capacity(rows * cols * 4);
        for r in 0..rows {
            for c in 0..cols {
                let v = e4m3_to_f32(raw[r * cols + c]);
                if v.is_nan() {
                    return Err(Error::BadMetadata {
                        key: name.to_string(),
                        reason: format!("FP8 value at [{r}, {c}] is NaN"),
                    });
                }
                let v = v * s[(r / br) * grid[1] + c / bc];
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Ok(Weight {
            dtype: DType::F32,
            rows,
            cols,
            data: Bytes::Owned(Arc::new(out)),
        })
    }
}

/// Decodes one FP8 e4m3 (`e4m3fn`: bias 7, no infinities, `S.1111.111` is NaN) value.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0xF, (b & 7) as f32);
    if e == 0xF && b & 7 == 7 {
        return f32::NAN;
    }
    let v = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e as i32 - 7)
    };
    sign * v
}

fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v: Value = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| st_err(&index, "no `weight_map` object"))?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|f| f.as_str())
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(st_err(dir, "no *.safetensors files in the folder"));
    }
    Ok(files)
}

impl WeightSource for SafetensorsFolder {
    fn naming(&self) -> Naming {
        Naming::Hf
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn weight(&self, name: &str, shape: &[usize]) -> Result<Weight> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        if e.shape != shape {
            return Err(Error::ShapeMismatch {
                tensor: name.into(),
                expected: shape.to_vec(),
                actual: e.shape.clone(),
            });
        }
        let cols = *shape.last().unwrap_or(&1);
        let rows = if shape.len() > 1 {
            shape[..shape.len() - 1].iter().product()
        } else {
            1
        };
        let Some(dtype) = e.dtype else {
            if e.len != rows * cols {
                return Err(Error::ShapeMismatch {
                    tensor: name.into(),
                    expected: shape.to_vec(),
                    actual: e.shape.clone(),
                });
            }
            return self.dequant_fp8(name, e, rows, cols);
        };
        if dtype.bytes_for(rows * cols) != Some(e.len) {
            return Err(Error::ShapeMismatch {
                tensor: name.into(),
                expected: shape.to_vec(),
                actual: e.shape.clone(),
            });
        }
        Ok(Weight {
            dtype,
            rows,
            cols,
            data: Bytes::Mapped {
                map: e.map.clone(),
                offset: e.offset,
                len: e.len,
            },
        })
    }
}

pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = crate::files::read_text_bounded(path, crate::files::TEXT_MAX)
        .map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::BadConfig(format!("{}: {e}", path.display())))
}

fn field<'a>(cfg: &'a Value, key: &str) -> Option<&'a Value> {
    cfg.get(key).filter(|v| !v.is_null())
}

fn req_usize(cfg: &Value, key: &str) -> Result<usize> {
    field(cfg, key)
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .ok_or_else(|| {
            Error::BadConfig(format!(
                "config.json: `{key}` is missing or not a non-negative integer"
            ))
        })
}

/// Ids that may be written as a number or a list.
fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}

/// Reads a Llama-family `config.json` into a [`ModelConfig`]. Rope settings may be written
/// new-style (`rope_parameters`) or old-style (`rope_theta` + `rope_scaling`).
pub fn model_config(cfg: &Value) -> Result<ModelConfig> {
    let model_type = field(cfg, "model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    if !arch::SUPPORTED.contains(&model_type) {
        return Err(arch::unknown(model_type));
    }
    let hidden = req_usize(cfg, "hidden_size")?;
    let n_heads = req_usize(cfg, "num_attention_heads")?;
    if n_heads == 0 {
        return Err(Error::BadConfig(
            "config.json: num_attention_heads is 0".into(),
        ));
    }
    let n_kv_heads = field(cfg, "num_key_value_heads")
        .and_then(|v| v.as_u64())
        .map_or(n_heads, |v| v as usize);
    let head_dim = field(cfg, "head_dim")
        .and_then(|v| v.as_u64())
        .map_or(hidden / n_heads, |v| v as usize);
    let n_layers = check_layer_count(
        req_usize(cfg, "num_hidden_layers")?,
        "config.json: `num_hidden_layers`",
    )?;
    let rope_params = field(cfg, "rope_parameters");
    let theta = rope_params
        .and_then(|p| p.get("rope_theta"))
        .or_else(|| field(cfg, "rope_theta"))
        .and_then(|v| v.as_f64())
        .unwrap_or(10000.0) as f32;
    let scaling = rope_params.or_else(|| field(cfg, "rope_scaling"));
    let scale = match scaling
        .and_then(|s| s.get("rope_type").or_else(|| s.get("type")))
        .and_then(|v| v.as_str())
    {
        None | Some("default") => 1.0,
        Some("linear") => scaling
            .and_then(|s| s.get("factor"))
            .and_then(|v| v.as_f64())
            .unwrap_or(1.0) as f32,
        Some(other) => {
            return Err(Error::BadConfig(format!(
                "config.json: rope scaling `{other}` is not supported"
            )))
        }
    };
    let attention = match field(cfg, "sliding_window").and_then(|v| v.as_u64()) {
        Some(w) if w > 0 => AttentionKind::Sliding { window: w as usize },
        _ => AttentionKind::Full,
    };
    let spec = LayerSpec {
        attention,
        rope: RopeSpec {
            theta,
            dims: head_dim,
            style: RopeStyle::Half,
            scale,
        },
    };
    let c = ModelConfig {
        arch: model_type.to_string(),
        n_layers,
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        ffn: req_usize(cfg, "intermediate_size")?,
        vocab: req_usize(cfg, "vocab_size")?,
        context_len: field(cfg, "max_position_embeddings")
            .and_then(|v| v.as_u64())
            .unwrap_or(4096) as usize,
        rms_eps: field(cfg, "rms_norm_eps")
            .and_then(|v| v.as_f64())
            .unwrap_or(1e-5) as f32,
        tie_embeddings: field(cfg, "tie_word_embeddings")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
        layers: vec![spec; n_layers],
    };
    c.validate()?;
    Ok(c)
}

/// Loads an HF folder.
pub fn load(dir: &Path, device: crate::backend::Device) -> Result<LoadedModel> {
    let cfg_json = read_json(&dir.join("config.json"))?;
    let model_type = field(&cfg_json, "model_type").and_then(|v| v.as_str());
    let deepseek = match model_type {
        Some(t) if super::deepseek_config::MODEL_TYPES.contains(&t) => Some(
            super::deepseek_config::DeepseekV3Config::from_json(&cfg_json)?,
        ),
        _ => None,
    };
    let cfg = match &deepseek {
        Some(d) => d.model_config(),
        None => model_config(&cfg_json)?,
    };
    let tok_cfg = read_json(&dir.join("tokenizer_config.json")).ok();
    let gen_cfg = read_json(&dir.join("generation_config.json")).ok();
    let mut eos = ids(gen_cfg.as_ref().and_then(|g| g.get("eos_token_id")));
    if eos.is_empty() {
        eos = ids(field(&cfg_json, "eos_token_id"));
    }
    let bos = ids(field(&cfg_json, "bos_token_id")).first().copied();
    let add_bos = tok_cfg
        .as_ref()
        .and_then(|t| t.get("add_bos_token"))
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"), bos, eos, add_bos)?;
    let chat_template = ChatTemplate::for_tokenizer(
        tok_cfg
            .as_ref()
            .and_then(|t| t.get("chat_template"))
            .and_then(|v| v.as_str()),
        &tokenizer,
    )?;
    let mut st = SafetensorsFolder::open(dir)?;
    let model = match deepseek {
        Some(d) => {
            if let Some(b) = d.fp8_block {
                st.set_fp8_block(b);
            }
            arch::build_deepseek_v3(d, &st, device)?
        }
        None => arch::build(cfg, &st, device)?,
    };
    Ok(LoadedModel {
        path: dir.to_path_buf(),
        model,
        tokenizer,
        chat_template,
    })
}
