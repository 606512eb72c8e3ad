//! One file per architecture, and the registry that maps an architecture name to its loader.

pub mod llama;

use crate::backend::cpu::CpuBackend;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::model::hparams::ModelConfig;
use crate::model::{CausalLm, WeightSource};

/// Architectures this build can run, by their GGUF / HF names.
pub const SUPPORTED: &[&str] = &["llama", "mistral"];

/// Builds the model for `cfg.arch` from `src` on `device`.
pub fn build(
    cfg: ModelConfig,
    src: &dyn WeightSource,
    device: Device,
) -> Result<Box<dyn CausalLm>> {
    match device {
        Device::Cpu { threads } => build_on(cfg, src, CpuBackend::new(threads)),
        #[cfg(feature = "cuda")]
        Device::Cuda { ordinal } => {
            use crate::backend::cuda::{CudaBackend, CudaOptions};
            build_on(
                cfg,
                src,
                CudaBackend::new(ordinal, CudaOptions::from_env()?)?,
            )
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => Err(Error::BadConfig(
            "this build has no CUDA backend (build with `--features cuda`)".into(),
        )),
    }
}

fn build_on<B: crate::backend::Backend>(
    cfg: ModelConfig,
    src: &dyn WeightSource,
    backend: B,
) -> Result<Box<dyn CausalLm>> {
    match cfg.arch.as_str() {
        "llama" | "mistral" => Ok(Box::new(llama::Llama::load(cfg, src, backend)?)),
        other => Err(unknown(other)),
    }
}

pub fn unknown(arch: &str) -> Error {
    Error::UnknownArchitecture(arch.to_string(), SUPPORTED.join(", "))
}
