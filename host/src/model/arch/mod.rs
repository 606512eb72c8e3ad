//! One file per architecture, and the registry that maps an architecture name to its loader.

pub mod deepseek_v3;
pub mod llama;

use crate::backend::cpu::CpuBackend;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::model::hparams::ModelConfig;
use crate::model::{CausalLm, WeightSource};

/// Architectures this build can run, by their GGUF / HF names.
pub const SUPPORTED: &[&str] = &["llama", "mistral", "deepseek_v3", "kimi_k2"];

/// Builds the model for `cfg.arch` from `src` on `device`.
pub fn build(
    cfg: ModelConfig,
    src: &dyn WeightSource,
    device: Device,
) -> Result<Box<dyn CausalLm>> {
    match device {
        Device::Cpu { threads } => build_on(cfg, src, CpuBackend::try_new(threads)?),
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

/// Builds a DeepSeek-V3 model from `src` on `device`.
pub fn build_deepseek_v3(
    cfg: crate::model::deepseek_config::DeepseekV3Config,
    src: &dyn WeightSource,
    device: Device,
) -> Result<Box<dyn CausalLm>> {
    use deepseek_v3::DeepseekV3;
    match device {
        Device::Cpu { threads } => Ok(Box::new(DeepseekV3::load(
            cfg,
            src,
            CpuBackend::try_new(threads)?,
        )?)),
        #[cfg(feature = "cuda")]
        Device::Cuda { ordinal } => {
            use crate::backend::cuda::{CudaBackend, CudaOptions};
            let be = CudaBackend::new(ordinal, CudaOptions::from_env()?)?;
            Ok(Box::new(DeepseekV3::load(cfg, src, be)?))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => Err(Error::BadConfig(
            "this build has no CUDA backend (build with `--features cuda`)".into(),
        )),
    }
}

pub fn unknown(arch: &str) -> Error {
    Error::UnknownArchitecture(arch.to_string(), SUPPORTED.join(", "))
}
