//! One file per architecture, and the registry that maps an architecture name to its loader.

pub mod llama;

use crate::error::{Error, Result};
use crate::model::hparams::ModelConfig;
use crate::model::{CausalLm, WeightSource};

/// Architectures this build can run, by their GGUF / HF names.
pub const SUPPORTED: &[&str] = &["llama", "mistral"];

/// Builds the model for `cfg.arch` from `src`.
pub fn build(cfg: ModelConfig, src: &dyn WeightSource) -> Result<Box<dyn CausalLm>> {
    match cfg.arch.as_str() {
        "llama" | "mistral" => Ok(Box::new(llama::Llama::load(cfg, src)?)),
        other => Err(unknown(other)),
    }
}

pub fn unknown(arch: &str) -> Error {
    Error::UnknownArchitecture(arch.to_string(), SUPPORTED.join(", "))
}
