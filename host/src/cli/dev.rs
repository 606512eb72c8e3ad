//! `deepinfer dev`: developer tools. `make-tiny` writes a tiny random checkpoint in HF format
//! (deterministic from a seed) for tests and reference runs; `ptx` (CUDA builds) compiles the
//! kernels with NVRTC into the cache a GPU run reads, so it can be made ahead of time.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};

use crate::model::tiny_deepseek::TinyDeepseek;

#[derive(Debug, Args)]
pub struct DevArgs {
    #[command(subcommand)]
    command: DevCommand,
}

#[derive(Debug, Subcommand)]
enum DevCommand {
    /// Write a tiny random checkpoint (config.json, model.safetensors, tokenizer.json).
    MakeTiny(MakeTinyArgs),
    /// Compile the CUDA kernels with NVRTC (no GPU needed) into the kernel cache
    /// (`$DEEPINFER_CACHE/ptx`, else `~/.cache/deepinfer/ptx`) and print the file's path.
    #[cfg(feature = "cuda")]
    Ptx(PtxArgs),
}

#[cfg(feature = "cuda")]
#[derive(Debug, Args)]
struct PtxArgs {
    /// Target, as the GPU run picks it from the device: a real architecture (`sm_90a` for
    /// Hopper: machine code, loaded without the driver's JIT) or a virtual one
    /// (`compute_90`: PTX).
    #[arg(long, default_value = "sm_90a")]
    arch: String,
}

#[derive(Debug, Args)]
struct MakeTinyArgs {
    /// Architecture (only `deepseek_v3` for now).
    #[arg(long, default_value = "deepseek_v3")]
    arch: String,
    /// Rank of the low-rank query path; 0 for a plain `q_proj`.
    #[arg(long, default_value_t = 32)]
    q_lora_rank: usize,
    /// Expert groups (1: no group-limited routing).
    #[arg(long, default_value_t = 4)]
    n_group: usize,
    /// Groups each token may route into.
    #[arg(long, default_value_t = 2)]
    topk_group: usize,
    /// Store the layers' projections as FP8 e4m3 with block scales.
    #[arg(long)]
    fp8: bool,
    /// FP8 scale block, `ROWSxCOLS`.
    #[arg(long, default_value = "32x32")]
    fp8_block: String,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output folder.
    #[arg(long)]
    out: PathBuf,
}

pub fn run(args: DevArgs) -> anyhow::Result<()> {
    match args.command {
        DevCommand::MakeTiny(a) => make_tiny(a),
        #[cfg(feature = "cuda")]
        DevCommand::Ptx(a) => ptx(a),
    }
}

#[cfg(feature = "cuda")]
fn ptx(a: PtxArgs) -> anyhow::Result<()> {
    use crate::backend::cuda::module;
    let Some(target) = module::SMS
        .iter()
        .chain(module::ARCHS.iter())
        .copied()
        .find(|&x| x == a.arch)
    else {
        bail!(
            "--arch {}: expected one of {}, {}",
            a.arch,
            module::SMS.join(", "),
            module::ARCHS.join(", ")
        );
    };
    // SAFETY: only tries to dlopen libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        bail!("no NVRTC library found: put a folder holding libnvrtc.so on LD_LIBRARY_PATH");
    }
    module::image_for(target).context("compiling the CUDA kernels")?;
    println!("{}", module::cache_path(target).display());
    Ok(())
}

fn make_tiny(a: MakeTinyArgs) -> anyhow::Result<()> {
    if a.arch != "deepseek_v3" {
        bail!("--arch {}: only deepseek_v3 is supported", a.arch);
    }
    // A tiny checkpoint's width is 64; a rank past this is a typo that would fill the memory.
    const MAX_TINY_RANK: usize = 1024;
    if a.q_lora_rank > MAX_TINY_RANK {
        bail!(
            "--q-lora-rank {}: at most {MAX_TINY_RANK} for a tiny checkpoint",
            a.q_lora_rank
        );
    }
    let block = match a
        .fp8_block
        .split_once('x')
        .map(|(r, c)| (r.parse(), c.parse()))
    {
        Some((Ok(r), Ok(c))) if r > 0 && c > 0 => [r, c],
        _ => bail!(
            "--fp8-block {}: expected ROWSxCOLS, e.g. 128x128",
            a.fp8_block
        ),
    };
    let spec = TinyDeepseek {
        seed: a.seed,
        q_lora_rank: (a.q_lora_rank > 0).then_some(a.q_lora_rank),
        n_group: a.n_group,
        topk_group: a.topk_group,
        fp8_block: a.fp8.then_some(block),
        ..TinyDeepseek::default()
    };
    spec.validate()?;
    spec.write(&a.out)
        .with_context(|| format!("writing {}", a.out.display()))?;
    println!("wrote {}", a.out.display());
    Ok(())
}
