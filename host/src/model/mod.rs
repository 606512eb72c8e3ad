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
use crate::ids::TokenId;
use crate::sampling::Candidate;
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

/// The most candidates per row a caller may ask of [`CausalLm::forward_select`]; past this it
/// asks for full rows (device top-K kernels hold their candidates on chip).
pub const SELECT_MAX_K: usize = 1024;

/// How much of each logits row [`CausalLm::forward_select`] brings back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWant {
    /// Every vocabulary entry.
    Full,
    /// The `k` largest logits with their ids (`1 ..= SELECT_MAX_K`).
    TopK(usize),
    /// Only the id of the largest logit.
    Argmax,
}

/// The logits of the rows in `batch.logits_for`, as much of them as was asked.
#[derive(Debug, Clone, PartialEq)]
pub enum Logits {
    /// `[rows, vocab]`.
    Full(Vec<f32>),
    /// Per row the `k` largest, largest first, ties by the lower id.
    TopK(Vec<Vec<Candidate>>),
    /// Per row the id of the largest logit (ties: the lower id).
    Argmax(Vec<TokenId>),
}

impl Logits {
    /// Selects on the host from full rows of `vocab` logits (what a model without a device
    /// selection does; the same order as the device kernels).
    pub fn select(full: Vec<f32>, vocab: usize, want: LogitsWant) -> Result<Logits> {
        if vocab == 0 || !full.len().is_multiple_of(vocab) {
            return Err(Error::BadRequest(format!(
                "{} logits are not whole rows of {vocab}",
                full.len()
            )));
        }
        Ok(match want {
            LogitsWant::Full => Logits::Full(full),
            LogitsWant::TopK(k) => {
                check_k(k)?;
                Logits::TopK(
                    full.chunks_exact(vocab)
                        .map(|r| {
                            let mut top = Vec::new();
                            crate::sampling::top_k_into(r, k, &mut top);
                            top
                        })
                        .collect(),
                )
            }
            LogitsWant::Argmax => Logits::Argmax(crate::backend::select::argmax_rows(&full, vocab)),
        })
    }

    /// Brings back from `be` what `want` asks of `logits` (rows of `vocab`), selecting there.
    pub fn from_backend<B: crate::backend::Backend>(
        be: &B,
        logits: &B::Buf,
        vocab: usize,
        want: LogitsWant,
    ) -> Result<Logits> {
        Ok(match want {
            LogitsWant::Full => Logits::Full(be.to_host(logits)?),
            LogitsWant::Argmax => Logits::Argmax(be.argmax_rows(logits, vocab)?),
            LogitsWant::TopK(k) => {
                check_k(k)?;
                let rows = be.top_k_rows(logits, vocab, k)?;
                let to_candidates = |r: Vec<(TokenId, f32)>| {
                    r.into_iter()
                        .map(|(id, logit)| Candidate { id, logit })
                        .collect()
                };
                Logits::TopK(rows.into_iter().map(to_candidates).collect())
            }
        })
    }

    /// Number of rows.
    pub fn rows(&self, vocab: usize) -> usize {
        match self {
            Logits::Full(v) => v.len().checked_div(vocab).unwrap_or(0),
            Logits::TopK(r) => r.len(),
            Logits::Argmax(r) => r.len(),
        }
    }
}

/// `k` is a candidate count [`CausalLm::forward_select`] takes.
pub fn check_k(k: usize) -> Result<()> {
    if k == 0 || k > SELECT_MAX_K {
        return Err(Error::BadRequest(format!(
            "asked for {k} candidates per row (1 ..= {SELECT_MAX_K})"
        )));
    }
    Ok(())
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

    /// [`CausalLm::forward`], bringing back only what `want` asks of each row. A model on a
    /// device selects there, so that a decode step copies ids and a few values instead of
    /// whole vocabulary rows; the default selects on the host from full rows.
    fn forward_select(&self, batch: &Batch, kv: &mut KvCache, want: LogitsWant) -> Result<Logits> {
        Logits::select(self.forward(batch, kv)?, self.config().vocab, want)
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_selection_keeps_the_order_the_samplers_use() {
        let vocab = 7;
        let full = vec![
            0.5,
            2.0,
            -1.0,
            2.0,
            f32::NAN,
            1.5,
            0.0, //
            -3.0,
            -2.0,
            -1.0,
            -4.0,
            -1.0,
            -5.0,
            -6.0,
        ];
        let top = Logits::select(full.clone(), vocab, LogitsWant::TopK(3)).unwrap();
        let ids = |c: &Vec<Candidate>| c.iter().map(|c| c.id).collect::<Vec<_>>();
        match &top {
            Logits::TopK(rows) => {
                assert_eq!(rows.len(), 2);
                // Ties by the lower id; NaN counts as the lowest value.
                assert_eq!(ids(&rows[0]), vec![1, 3, 5]);
                assert_eq!(ids(&rows[1]), vec![2, 4, 1]);
                for (r, row) in rows.iter().enumerate() {
                    let want = crate::sampling::top_k_candidates(&full[r * vocab..][..vocab], 3);
                    assert_eq!(ids(row), ids(&want));
                }
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(top.rows(vocab), 2);
        // The backends' host fallback selects the same way.
        let host_rows = crate::backend::select::top_k_rows(&full, vocab, 3);
        let host_ids: Vec<Vec<u32>> = host_rows
            .iter()
            .map(|r| r.iter().map(|p| p.0).collect())
            .collect();
        assert_eq!(host_ids, vec![vec![1, 3, 5], vec![2, 4, 1]]);
        let arg = Logits::select(full.clone(), vocab, LogitsWant::Argmax).unwrap();
        assert_eq!(arg, Logits::Argmax(vec![1, 2]));
        let back = Logits::select(full.clone(), vocab, LogitsWant::Full).unwrap();
        assert!(
            matches!(&back, Logits::Full(v) if v.len() == full.len() && v[4].is_nan() && v[5] == 1.5)
        );
        assert!(Logits::select(full.clone(), vocab, LogitsWant::TopK(0)).is_err());
        assert!(Logits::select(full.clone(), vocab, LogitsWant::TopK(SELECT_MAX_K + 1)).is_err());
        assert!(Logits::select(full, 6, LogitsWant::Argmax).is_err());
    }
}
