//! Models: file loaders (GGUF, HF safetensors folders), tokenizer, chat templates and one
//! file per architecture behind the [`CausalLm`] trait.

pub mod arch;
pub mod batch;
pub mod chat;
pub mod deepseek_config;
pub mod fetch;
pub mod gguf;
pub mod gguf_config;
pub mod gguf_writer;
pub mod hf;
pub mod hparams;
pub mod mla;
pub mod moe;
pub mod random;
pub mod tiny;
pub mod tiny_deepseek;
pub mod tokenizer;

use std::path::{Path, PathBuf};

use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::Weight;
use batch::Batch;
use chat::ChatTemplate;
use hparams::ModelConfig;
use tokenizer::Tokenizer;

/// A model's paged KV storage, owned by the caller and opaque to it: the model made it with
/// [`CausalLm::new_kv`] and downcasts it back in `forward`.
pub struct KvCache {
    inner: Box<dyn std::any::Any + Send>,
    block_size: usize,
}

impl KvCache {
    pub fn new<T: Send + 'static>(inner: T, block_size: usize) -> KvCache {
        KvCache {
            inner: Box::new(inner),
            block_size,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The backend's storage; an error if this cache was made by another backend.
    pub fn get_mut<T: 'static>(&mut self) -> Result<&mut T> {
        self.inner
            .downcast_mut::<T>()
            .ok_or_else(|| Error::BadRequest("KV cache was made by a different backend".into()))
    }
}

/// A decoder-only language model.
pub trait CausalLm: Send + Sync {
    fn config(&self) -> &ModelConfig;

    /// The device it runs on, in words.
    fn device_name(&self) -> String;

    /// Paged KV storage for `num_blocks` blocks of `block_size` tokens.
    fn new_kv(&self, num_blocks: usize, block_size: usize) -> Result<KvCache>;

    /// Runs every token of `batch`, writing their K/V into `kv`, and returns the logits of the
    /// tokens listed in `batch.logits_for` (`[logits_for.len(), vocab]`).
    fn forward(&self, batch: &Batch, kv: &mut KvCache) -> Result<Vec<f32>>;

    /// What [`CausalLm::new_kv`] stores per layer group, for sizing the cache from a memory
    /// budget. Default: f32 K and V of the config's KV heads in every layer.
    fn kv_layout(&self, block_size: usize) -> crate::kv_cache::KvCacheLayout {
        let c = self.config();
        let shape = crate::kv_cache::AttentionShape {
            num_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            dtype_bytes: std::mem::size_of::<f32>(),
        };
        crate::kv_cache::KvCacheLayout::full_attention(c.n_layers, shape, block_size)
    }
}

/// Which naming convention a checkpoint's tensors follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    Gguf,
    Hf,
}

/// Where an architecture's loader gets its tensors.
pub trait WeightSource {
    fn naming(&self) -> Naming;
    fn has(&self, name: &str) -> bool;
    /// The tensor `name`, checked against the logical row-major `shape`.
    fn weight(&self, name: &str, shape: &[usize]) -> Result<Weight>;
}

impl WeightSource for gguf::GgufFile {
    fn naming(&self) -> Naming {
        Naming::Gguf
    }
    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
    fn weight(&self, name: &str, shape: &[usize]) -> Result<Weight> {
        gguf::GgufFile::weight(self, name, shape)
    }
}

/// A model ready to run: weights, tokenizer and chat template.
pub struct LoadedModel {
    pub path: PathBuf,
    pub model: Box<dyn CausalLm>,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("path", &self.path)
            .field("config", self.model.config())
            .finish()
    }
}

/// Loads a `.gguf` file or an HF folder (`config.json` + safetensors + `tokenizer.json`)
/// onto `device`.
pub fn load(path: &Path, device: Device) -> Result<LoadedModel> {
    if path.is_dir() {
        return hf::load(path, device);
    }
    let g = gguf::GgufFile::open(path)?;
    let cfg = gguf_config::model_config(&g)?;
    let tokenizer = Tokenizer::from_gguf(&g)?;
    if tokenizer.vocab_size() != cfg.vocab {
        return Err(Error::BadMetadata {
            key: "tokenizer.ggml.tokens".into(),
            reason: format!(
                "{} tokens, but the embedding has {} rows",
                tokenizer.vocab_size(),
                cfg.vocab
            ),
        });
    }
    let chat_template = ChatTemplate::for_tokenizer(
        g.get("tokenizer.chat_template").and_then(|v| v.as_str()),
        &tokenizer,
    )?;
    let model = arch::build(cfg, &g, device)?;
    Ok(LoadedModel {
        path: path.to_path_buf(),
        model,
        tokenizer,
        chat_template,
    })
}
