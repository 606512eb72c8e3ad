//! The kernels: the CUDA C sources in `kernels/` compiled once by NVRTC for the device's
//! architecture (machine code, or PTX where NVRTC knows no machine code for it; cached per
//! target and source hash in the cache folder), loaded as
//! one module, and resolved into typed kernel ids. It compiles and names kernels; launching
//! them is the queue's job.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, DevicePtr};
use cudarc::nvrtc::Ptx;
use sha2::{Digest, Sha256};

use super::device::cuda_err;
use super::Act;
use crate::error::{Error, Result};

/// Kernel sources in compilation order (`common.cuh` first: the others use its helpers).
pub const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../../../kernels/common.cuh")),
    (
        "elementwise.cu",
        include_str!("../../../../kernels/elementwise.cu"),
    ),
    ("gemv.cu", include_str!("../../../../kernels/gemv.cu")),
    ("gemt.cu", include_str!("../../../../kernels/gemt.cu")),
    (
        "attention_decode.cu",
        include_str!("../../../../kernels/attention_decode.cu"),
    ),
    (
        "attention_prefill.cu",
        include_str!("../../../../kernels/attention_prefill.cu"),
    ),
    ("sample.cu", include_str!("../../../../kernels/sample.cu")),
    ("mla.cu", include_str!("../../../../kernels/mla.cu")),
    ("moe.cu", include_str!("../../../../kernels/moe.cu")),
    ("stream.cu", include_str!("../../../../kernels/stream.cu")),
];

/// NVRTC options besides the architecture.
const OPTIONS: &[&str] = &["-std=c++17", "--extra-device-vectorization"];

/// `DEEPINFER_CUDA_DEFINE`: a comma-separated list of `NAME` or `NAME=VALUE` macros the
/// kernels are compiled with (kernel experiments: an image of its own, cached by its hash).
/// Names are C identifiers, values letters, digits, `_`, `.` and `-`.
pub fn kernel_defines() -> Result<Vec<(String, String)>> {
    match std::env::var("DEEPINFER_CUDA_DEFINE") {
        Ok(v) => parse_defines(&v),
        Err(_) => Ok(Vec::new()),
    }
}

/// [`kernel_defines`]'s list parsed.
pub fn parse_defines(v: &str) -> Result<Vec<(String, String)>> {
    let ident = |s: &str| {
        s.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    let mut out = Vec::new();
    for part in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, value) = part.split_once('=').unwrap_or((part, "1"));
        let (name, value) = (name.trim(), value.trim());
        let value_ok = !value.is_empty()
            && value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if !ident(name) || !value_ok {
            return Err(Error::BadConfig(format!(
                "DEEPINFER_CUDA_DEFINE={v}: `{part}` is not NAME or NAME=VALUE (a C identifier; \
                 a value of letters, digits, `_`, `.`, `-`)"
            )));
        }
        out.push((name.to_string(), value.to_string()));
    }
    Ok(out)
}

/// The whole translation unit.
pub fn source() -> String {
    let mut s = String::new();
    if super::trace::requested().is_some() {
        s.push_str("#define DEEPINFER_TRACE 1\n");
    }
    // (an invalid list is reported by `compile` and by the backend's options)
    for (name, value) in kernel_defines().unwrap_or_default() {
        s.push_str(&format!("#define {name} {value}\n"));
    }
    for (name, text) in SOURCES {
        s.push_str(&format!("// ---- {name} ----\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// The virtual architectures [`arch_for`] picks from (PTX, compiled to machine code by the
/// driver's JIT when loaded).
pub const ARCHS: [&str; 7] = [
    "compute_80",
    "compute_86",
    "compute_87",
    "compute_89",
    "compute_90",
    "compute_100",
    "compute_120",
];

/// The real architectures [`target_for`] picks from: NVRTC writes their machine code (a
/// cubin), which loads without the driver's JIT (tens of seconds for these kernels).
/// Compute capability 9.0 takes `sm_90a`, whose machine code may use Hopper's own instructions
/// (`wgmma`; the kernels that do are compiled only there) and runs on 9.0 devices alone.
pub const SMS: [&str; 7] = [
    "sm_80", "sm_86", "sm_87", "sm_89", "sm_90a", "sm_100", "sm_120",
];

/// The virtual architecture to compile for, from a compute capability.
pub fn arch_for(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 7) => "compute_87",
        (8, 9) => "compute_89",
        (9, _) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        // Anything newer runs compute_90 PTX through the driver's JIT.
        _ => "compute_90",
    }
}

/// What to compile for a compute capability: the device's own architecture where it is one of
/// [`SMS`], else the PTX of [`arch_for`].
pub fn target_for(major: i32, minor: i32) -> &'static str {
    let own = format!("sm_{major}{minor}");
    SMS.iter()
        .copied()
        .find(|&s| s == own || (s.strip_suffix('a') == Some(&own)))
        .unwrap_or_else(|| arch_for(major, minor))
}

/// Whether `target` names a real architecture (NVRTC writes a cubin) rather than a virtual
/// one (PTX).
pub fn is_cubin(target: &str) -> bool {
    target.starts_with("sm_")
}

/// Compiles `src` for `target` (`sm_XY`: a cubin; `compute_XY`: PTX text).
fn compile_source(src: &str, target: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    let nvrtc = |what: &str, e: result::NvrtcError| Error::Cuda(format!("NVRTC {what}: {e:?}"));
    let src = std::ffi::CString::new(src)
        .map_err(|_| Error::Cuda("the kernel source holds a NUL byte".into()))?;
    /// Destroys the program however this function returns.
    struct Program(sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: made by `create_program` below and destroyed only here.
            let _ = unsafe { result::destroy_program(self.0) };
        }
    }
    let prog = Program(
        result::create_program(&src, Some(c"deepinfer_kernels.cu"))
            .map_err(|e| nvrtc("could not create a program", e))?,
    );
    let mut opts = vec![format!("--gpu-architecture={target}")];
    opts.extend(OPTIONS.iter().map(|o| o.to_string()));
    // SAFETY (this block and the ones below): `prog.0` is a live program (dropped at return),
    // and `src` outlives it.
    if let Err(e) = unsafe { result::compile_program(prog.0, &opts) } {
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|l| {
                let bytes: Vec<u8> = l
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        return Err(Error::Cuda(format!(
            "NVRTC failed to compile kernels/*.cu for {target} ({e:?}):\n{log}"
        )));
    }
    if is_cubin(target) {
        let mut size = 0usize;
        unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
            .result()
            .map_err(|e| nvrtc("cubin size", e))?;
        let mut cubin = vec![0u8; size];
        unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }
            .result()
            .map_err(|e| nvrtc("cubin", e))?;
        Ok(cubin)
    } else {
        let ptx = unsafe { result::get_ptx(prog.0) }.map_err(|e| nvrtc("PTX", e))?;
        Ok(ptx
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect())
    }
}

/// Compiles the kernels for `target` with NVRTC (no cache): a cubin for `sm_XY`, PTX text
/// for `compute_XY`.
pub fn compile(target: &str) -> Result<Vec<u8>> {
    kernel_defines()?;
    compile_source(&source(), target)
}

/// Whether `bytes` look like a complete image for `target` (a cache file cut short by a crash
/// is compiled again).
fn image_ok(target: &str, bytes: &[u8]) -> bool {
    if is_cubin(target) {
        bytes.starts_with(b"\x7fELF")
    } else {
        std::str::from_utf8(bytes).is_ok_and(|t| t.contains(".entry"))
    }
}

/// Where the compiled kernels for `target` are cached (`<cache>/ptx/`, for cubins too): the
/// name hashes the target, the NVRTC options and the source.
pub fn cache_path(target: &str) -> PathBuf {
    let mut h = Sha256::new();
    h.update(target.as_bytes());
    for o in OPTIONS {
        h.update(o.as_bytes());
    }
    h.update(source().as_bytes());
    let hex: String = h
        .finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect();
    let ext = if is_cubin(target) { "cubin" } else { "ptx" };
    crate::model::fetch::cache_dir()
        .join("ptx")
        .join(format!("{target}-{hex}.{ext}"))
}

/// The kernels compiled for `target`: from the cache folder, else compiled and cached (a
/// failed cache write only costs the next start a compile).
pub fn image_for(target: &str) -> Result<Vec<u8>> {
    let path = cache_path(target);
    if let Ok(bytes) = std::fs::read(&path) {
        if image_ok(target, &bytes) {
            return Ok(bytes);
        }
    }
    let image = compile(target)?;
    if let Some(dir) = path.parent() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::create_dir_all(dir).is_ok() && std::fs::write(&tmp, &image).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(image)
}

/// Loads the kernels of `target` into `ctx`.
fn load_image(ctx: &Arc<CudaContext>, target: &str) -> Result<Arc<cudarc::driver::CudaModule>> {
    let image = image_for(target)?;
    let code = if is_cubin(target) {
        Ptx::from_binary(image)
    } else {
        Ptx::from_src(String::from_utf8_lossy(&image).into_owned())
    };
    ctx.load_module(code)
        .map_err(|e| cuda_err(&format!("loading the kernel module ({target})"), e))
}

/// Dynamic shared memory of the double-buffered prefill kernel for head dim `d`: the 64-row
/// Q tile and two stages of 64-row K and V tiles, in bf16.
pub fn prefill2_smem(d: usize) -> usize {
    (64 + 2 * 2 * 64) * d * 2
}

/// Threads per block of the wide prefill kernel (`attn_prefill3`: 4 warps of 32 query rows).
pub const PREFILL3_THREADS: u32 = 128;

/// Dynamic shared memory of the wide prefill kernel for head dim `d`: the 128-row Q tile and
/// two stages of 64-row K and V tiles, in bf16 (96 KB at d = 128).
pub fn prefill3_smem(d: usize) -> usize {
    (128 + 2 * 2 * 64) * d * 2
}

/// Token bounds of the skinny tensor-core GEMMs (`gemt_t*` in `kernels/gemt.cu`).
pub const GEMT_TOKENS: [usize; 5] = [16, 24, 32, 48, 64];

/// Dynamic shared memory of the skinny GEMM for `tokens` (a bound of [`GEMT_TOKENS`]): two
/// activation chunks of 256 + 32 bf16 a token row (the partial sums, 132 f32 a token row,
/// reuse them).
pub fn gemt_smem(tokens: usize) -> usize {
    (2 * tokens * (256 + 32) * 2).max(tokens * 132 * 4)
}

/// A kernel, by index into [`Module::funcs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelId(pub u16);

/// The kernels instantiated for one activation type.
#[derive(Debug, Clone)]
pub struct ActKernels {
    pub embed: KernelId,
    pub rms_norm: KernelId,
    pub add: KernelId,
    pub silu_mul: KernelId,
    pub rope: KernelId,
    /// RoPE of two tensors in one launch.
    pub rope2: KernelId,
    pub gather_rows: KernelId,
    pub write_kv: KernelId,
    /// RoPE of queries and keys plus the K/V cache write in one launch.
    pub rope_kv: KernelId,
    /// By head dim 16, 32, 64, 128, 256 and query heads per block ([`DECODE_GROUPS`]).
    pub attn_decode: [[KernelId; 4]; 5],
    pub attn_combine: KernelId,
    /// Decode attention with RoPE, the K/V write and the split merge folded in
    /// (`attn_dec1_*`, cluster launches), by head dim 64, 128 and query heads per block
    /// ([`DECODE_GROUPS`]).
    pub attn_dec1: [[KernelId; 4]; 2],
    /// By head dim 64, 128.
    pub attn_prefill: [KernelId; 2],
    /// The double-buffered variant, by head dim 64, 128 (dynamic shared memory:
    /// [`prefill2_smem`]).
    pub attn_prefill2: [KernelId; 2],
    /// The wide variant (128 queries a block), by head dim 64, 128 (dynamic shared memory:
    /// [`prefill3_smem`]).
    pub attn_prefill3: [KernelId; 2],
    /// By weight type (see `WType`).
    pub gemv: [KernelId; 6],
    /// Block-cooperative GEMVs (`gemvb_*` in `kernels/gemv.cu`): by weight type (bf16, f16),
    /// token bound (1, 2, 4, 8) and shape ([`GEMVB_SHAPES`]).
    pub gemvb: [[[KernelId; 3]; 4]; 2],
    /// Block GEMVs with an RMSNorm folded in (`gemvbn_*`), by tokens and shape: bf16 weights
    /// and activations only.
    pub gemvb_norm: Option<[[KernelId; 3]; 4]>,
    /// Block GEMVs with a residual add folded in (`gemvba_*`), likewise.
    pub gemvb_acc: Option<[[KernelId; 3]; 4]>,
    /// Gate/up block GEMVs with SwiGLU folded in (`gemvbs_*`), and with the RMSNorm before
    /// them too (`gemvbns_*`), likewise; SwiGLU pairs rows, so shape (1, 8) is served by the
    /// (2, 4) kernel.
    pub gemvb_swiglu: Option<[[KernelId; 3]; 4]>,
    pub gemvb_norm_swiglu: Option<[[KernelId; 3]; 4]>,
    /// One-token GEMVs whose weights stream into shared memory before the programmatic wait
    /// (`gemvp*_bf16w_n1_r8` in `kernels/gemv.cu`), by fold: plain, RMSNorm, residual add; bf16
    /// weights and activations, rows of at most [`GEMVP_MAXK`] weights.
    pub gemvp: Option<[KernelId; 3]>,
    /// The same with [`GEMVP_WIDE_ROWS`] rows a block in [`GEMVP_WIDE_SMEM`] bytes of dynamic
    /// shared memory (`gemvp*_bf16w_n1_r32`); None where the device has less.
    pub gemvp_wide: Option<[KernelId; 3]>,
    /// The staged one-token gate/up GEMVs with SwiGLU folded in (`gemvps_bf16w_n1_r8`), and
    /// with the RMSNorm before them too (`gemvpns_bf16w_n1_r8`): 4 gate/up row pairs a block.
    pub gemvp_swiglu: Option<[KernelId; 2]>,
    pub argmax: KernelId,
    pub topk: KernelId,
}

/// The MLA and MoE kernels (`kernels/mla.cu`, `kernels/moe.cu`) of one activation type; pairs
/// are by weight type (f32, bf16).
#[derive(Debug, Clone)]
pub struct DeepseekKernels {
    pub mla_q_absorb: [KernelId; 2],
    /// `mla_q_absorb` with the rotation's sines and cosines computed before the programmatic
    /// wait and the cache rows in a block of their own (`CudaOptions::ds2`, `Ds2`).
    pub mla_q_absorb2: [KernelId; 2],
    pub mla_decode: KernelId,
    /// `mla_decode` scoring a tile's keys together (`CudaOptions::ds2`, `Ds2`).
    pub mla_decode2: KernelId,
    pub mla_v_up: [KernelId; 2],
    /// `mla_v_up` loading the split outputs with their (max, sum) pairs (`CudaOptions::ds2`, `Ds2`).
    pub mla_v_up2: [KernelId; 2],
    /// The three MLA kernels in one cluster launch for decode steps of one token a sequence
    /// (`CudaOptions::fuse_mla`), by weight type.
    pub mla_dec1: [KernelId; 2],
    /// `mla_dec1` with the layer's attention half around it (`CudaOptions::fuse_layer`; bf16
    /// activations and weights only).
    pub mla_layer1: Option<KernelId>,
    /// The dynamic shared memory `mla_layer1` may ask for, bytes, and how many of its clusters
    /// of 2, 4 and 8 blocks the device holds at once with that much (0 where unknown).
    pub mla_layer1_smem: u32,
    pub mla_layer1_clusters: [u32; 3],
    pub moe_route: KernelId,
    /// The routing of 8 tokens a block (steps of many tokens; same results).
    pub moe_route8: KernelId,
    /// By weight type and assignments per pass (1, 8).
    pub moe_gateup: [[KernelId; 2]; 2],
    pub moe_down: [[KernelId; 2]; 2],
    pub moe_combine: KernelId,
    /// Decode steps (`moe_*_dec`): routing with the norm and the plan folded in, and the
    /// expert products with the shared experts as further slots, by weight type (f32, bf16)
    /// and tokens (1, 8).
    pub moe_route_dec: KernelId,
    pub moe_gu_dec: [[KernelId; 2]; 2],
    pub moe_down_dec: [[KernelId; 2]; 2],
    /// `moe_route_dec` as one thread-block cluster (`Ds2::cluster`), for 1 and for up to 8
    /// tokens.
    pub moe_route_decc: [KernelId; 2],
    /// `moe_route1c`: the routing of one token in fewer steps (`Ds2::route1`; up to 64
    /// experts, rows of at most 2048, no group limit, top k at most 32).
    pub moe_route1c: KernelId,
    /// Dynamic shared memory that fills an SM beside the cluster routing's own (`Ds2::own_sm`:
    /// no other kernel's block shares the routing's SMs), bytes, for `moe_route_decc` (1, 8
    /// tokens) and `moe_route1c`; 0 where it could not be set.
    pub route_own_smem: [u32; 3],
    /// `moe_ffn1`: a one-token MoE layer in one persistent launch (bf16; sm_90+ devices that
    /// hold a block on every SM with [`DeepseekKernels::moe_ffn1_smem`] bytes of dynamic
    /// shared memory).
    pub moe_ffn1: Option<KernelId>,
    /// The dynamic shared memory `moe_ffn1` may ask for, bytes.
    pub moe_ffn1_smem: u32,
    /// `moe_fk1`: `moe_ffn1`'s layer with the down product split by expert row (its down
    /// matrices transposed), on the same terms.
    pub moe_fk1: Option<KernelId>,
    /// The dynamic shared memory `moe_fk1` may ask for, bytes.
    pub moe_fk1_smem: u32,
}

/// Query heads per block of the decode attention instantiations (`MAXG`).
pub const DECODE_GROUPS: [usize; 4] = [1, 2, 4, 8];

/// Token bounds of the block-cooperative GEMV instantiations.
pub const GEMVB_TOKENS: [usize; 4] = [1, 2, 4, 8];
/// (rows per block, 16-byte loads per thread and row) of the block-cooperative GEMVs.
pub const GEMVB_SHAPES: [(usize, usize); 3] = [(4, 2), (2, 4), (1, 8)];
/// Rows per block and the longest rows of the one-token shared-memory GEMVs (`GEMVP_ROWS`,
/// `GEMVP_MAXK` in `kernels/gemv.cu`).
pub const GEMVP_ROWS: usize = 8;
/// Rows per block of the wide one-token staged GEMVs and their dynamic shared memory: the
/// rows (at most [`GEMVP_MAXK`] bf16 weights each) and the input in f32.
pub const GEMVP_WIDE_ROWS: usize = 32;
pub const GEMVP_WIDE_SMEM: usize = GEMVP_WIDE_ROWS * GEMVP_MAXK * 2 + GEMVP_MAXK * 4;
pub const GEMVP_MAXK: usize = 2048;
/// Rows a block and threads of the row-streaming tensor-core products (`ROWMMA_ROWS`,
/// `ROWMMA_THREADS` in `kernels/gemt.cu`): the grouped expert products and MLA's V
/// up-projection of larger steps.
pub const ROWMMA_ROWS: usize = 64;
pub const ROWMMA_THREADS: u32 = 128;
/// The tensor-core MLA decode (`mla_decode_mma` in `kernels/mla.cu`): threads a block, keys a
/// tile (`MLA_DT`), and its dynamic shared memory (`MLA_DSMEM`: two key tiles and the query of
/// 16 heads, rows of the widest latent + rope (576) padded by 8 values, bf16).
pub const MLA_DECODE_THREADS: u32 = 256;
pub const MLA_DECODE_KEYS: usize = 32;
pub const MLA_DECODE_MMA_SMEM: usize = (2 * MLA_DECODE_KEYS + 16) * (576 + 8) * 2;
/// ... and of its prompt variant (`mla_decode_mma4`, `MLA_D4SMEM`): two key tiles and the
/// queries of 4 tokens' 16 heads.
pub const MLA_DECODE4_SMEM: usize = (2 * MLA_DECODE_KEYS + 64) * (576 + 8) * 2;
/// Dynamic shared memory of the expanded-form MLA attention (`mla_x_attn`): 128 queries of
/// nope + rope = 192 values and two stages of 64 K rows (192 values) and V rows (128).
pub const MLA_X_SMEM: usize = (128 * 192 + 2 * 64 * (192 + 128)) * 2;
/// The tiled grouped expert GEMMs (`moe_gu_gemm` / `moe_dn_gemm` in `kernels/moe.cu`): weight
/// rows and assignments a tile, k a stage (`MOEG_TM`, `MOEG_TN`, `MOEG_TK`), threads a block.
pub const MOE_GEMM_ROWS: usize = 128;
pub const MOE_GEMM_TOKENS: usize = 64;
pub const MOE_GEMM_K: usize = 64;
pub const MOE_GEMM_THREADS: u32 = 256;
/// Dynamic shared memory of a tiled grouped GEMM of `nm` matrices: two stages of `nm` weight
/// tiles and one input tile, rows padded by 8 values (`MoegStage`).
pub const fn moe_gemm_smem(nm: usize) -> usize {
    2 * (nm * MOE_GEMM_ROWS + MOE_GEMM_TOKENS) * (MOE_GEMM_K + 8) * 2
}
/// The warpgroup-MMA expert GEMMs (`moe_gu_wg` / `moe_dn_wg`, `MOEW_*` in `kernels/moe.cu`):
/// assignments a tile, weight rows a tile (gate/up: half of each matrix), and dynamic shared
/// memory: 4 stages of 128 input rows and 256 weight rows of 128 bytes, and 1 KB to align them.
pub const MOE_WG_TOKENS: usize = 128;
pub const MOE_WG_ROWS: usize = 256;
pub const MOE_WG_SMEM: usize = 4 * (MOE_WG_TOKENS + MOE_WG_ROWS) * 128 + 1024;

/// The loaded module and its kernel ids.
pub struct Module {
    funcs: Vec<CudaFunction>,
    /// Kernel names by id.
    names: Vec<String>,
    /// The trace table (`di_trace`: address, bytes) of a module compiled for tracing
    /// (`trace::requested`).
    pub trace_table: Option<(u64, usize)>,
    /// Its per-block stamps (`di_trace_blocks`), in kernels compiled with `DI_TRACE_BLOCKS`.
    pub trace_blocks: Option<(u64, usize)>,
    /// Launch with programmatic stream serialization (Hopper and later; see `pdl_wait` in
    /// `kernels/common.cuh`).
    pub pdl: bool,
    /// Thread-block clusters (sm_90+).
    pub clusters: bool,
    /// The scheduling policy cluster launches ask for (`CudaOptions::cluster_policy`).
    pub cluster_policy: Option<sys::CUclusterSchedulingPolicy>,
    /// The device's streaming multiprocessors.
    pub sms: usize,
    pub f32: ActKernels,
    pub bf16: ActKernels,
    pub rope_table: KernelId,
    pub weight_to_bf16: KernelId,
    pub weight_to_f32: KernelId,
    /// `transpose_bf16`: a bf16 matrix transposed (`moe_fk1`'s down matrices).
    pub transpose_bf16: KernelId,
    /// By activation type (f32, bf16).
    pub deepseek: [DeepseekKernels; 2],
    pub moe_plan: KernelId,
    /// The same plan over a block an expert (`moe_plan2`).
    pub moe_plan2: KernelId,
    /// The grouped expert products on tensor cores (bf16 weights and activations): gate/up
    /// with SwiGLU, and down.
    pub moe_mma: [KernelId; 2],
    /// The same products as tiled GEMMs for steps whose experts have many tokens each
    /// (prefill): gate/up with SwiGLU, and down.
    pub moe_gemm: [KernelId; 2],
    /// The tiled GEMMs on warpgroup MMA (`moe_gu_wg`, `moe_dn_wg`): in `sm_90a` images only.
    pub moe_wg: Option<[KernelId; 2]>,
    /// MLA on tensor cores (bf16): the split merge into bf16 latents, the V up-projection,
    /// the query absorption with the rope queries and cache rows, the split-KV decode, and its
    /// variant of 4 tokens a block.
    pub mla_mma: [KernelId; 5],
    /// MLA in the expanded form for prompts (bf16, DeepSeek-V3's head shape): the query
    /// rotation with the cache rows, the context gather, and the attention.
    pub mla_x: [KernelId; 3],
    /// The device's opt-in limit of dynamic shared memory per block, bytes.
    pub max_smem: usize,
    /// Skinny tensor-core GEMMs (bf16), by token bound ([`GEMT_TOKENS`]): plain (up to three
    /// segments) and gate/up with SwiGLU.
    pub gemt: [KernelId; 5],
    pub gemt_swiglu: [KernelId; 5],
    /// The read-rate probes of `deepinfer bench stream` (`kernels/stream.cu`): 16-byte loads
    /// into registers, and bulk copies into rings of shared-memory pages (sm_90+, with the
    /// dynamic shared memory it may ask for), and the chain of dependent GEMVs a persistent
    /// launch would stream (sm_90+, likewise).
    pub stream_ldg: KernelId,
    pub stream_ring: Option<(KernelId, u32)>,
    pub stream_chain: Option<(KernelId, u32)>,
}

impl Module {
    /// The dynamic shared memory a GEMV launch of `kernel` asks for (the wide staged ones').
    pub fn gemv_smem(&self, kernel: KernelId) -> u32 {
        let wide = [&self.f32, &self.bf16]
            .iter()
            .any(|a| a.gemvp_wide.is_some_and(|w| w.contains(&kernel)));
        if wide {
            GEMVP_WIDE_SMEM as u32
        } else {
            0
        }
    }

    pub fn load(ctx: &Arc<CudaContext>) -> Result<Module> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cuda_err("reading the compute capability", e))?;
        let target = target_for(major, minor);
        // A cubin the driver refuses (one written by a newer NVRTC than the driver knows, say)
        // falls back to PTX, which the driver's JIT compiles.
        let (module, target_of_image) = match load_image(ctx, target) {
            Ok(m) => (m, target),
            Err(e) if is_cubin(target) => {
                tracing::warn!("{e}; using PTX instead");
                let arch = arch_for(major, minor);
                (load_image(ctx, arch)?, arch)
            }
            Err(e) => return Err(e),
        };
        let max_smem =
            ctx.attribute(
                sys::CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| cuda_err("reading the shared memory limit", e))? as usize;
        let sms = ctx
            .attribute(sys::CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| cuda_err("reading the multiprocessor count", e))?
            .max(1) as usize;
        let (trace_table, trace_blocks) = match super::trace::requested() {
            Some(_) => {
                let stream = ctx.default_stream();
                let table = module
                    .get_global("di_trace", &stream)
                    .map_err(|e| cuda_err("finding the trace table", e))?;
                let bytes = table.len();
                let (ptr, _sync) = table.device_ptr(&stream);
                // only where DI_TRACE_BLOCKS is among the kernels' defines
                let blocks = kernel_defines()?
                    .iter()
                    .any(|(n, _)| n == "DI_TRACE_BLOCKS")
                    .then(|| {
                        module
                            .get_global("di_trace_blocks", &stream)
                            .map(|t| (t.device_ptr(&stream).0, t.len()))
                            .map_err(|e| cuda_err("finding the per-block trace table", e))
                    })
                    .transpose()?;
                (Some((ptr, bytes)), blocks)
            }
            None => (None, None),
        };
        let mut funcs = Vec::new();
        let mut names = Vec::new();
        let mut index = HashMap::new();
        let mut get = |name: String| -> Result<KernelId> {
            if let Some(&id) = index.get(&name) {
                return Ok(id);
            }
            let f = module
                .load_function(&name)
                .map_err(|e| cuda_err(&format!("kernel `{name}`"), e))?;
            let id = KernelId(funcs.len() as u16);
            funcs.push(f);
            names.push(name.clone());
            index.insert(name, id);
            Ok(id)
        };
        let mut act = |s: &str| -> Result<ActKernels> {
            let mut n = |base: &str| get(format!("{base}_{s}"));
            // The folded GEMVs exist for bf16 activations only.
            let folded = |n: &mut dyn FnMut(&str) -> Result<KernelId>,
                          base: &str|
             -> Result<Option<[[KernelId; 3]; 4]>> {
                if s != "bf16" {
                    return Ok(None);
                }
                let mut g = [[KernelId(0); 3]; 4];
                for (ni, tn) in GEMVB_TOKENS.iter().enumerate() {
                    for (si, &(r, u)) in GEMVB_SHAPES.iter().enumerate() {
                        // The SwiGLU kernels (`gemvbs`, `gemvbns`) pair rows: no (1, 8).
                        let (r, u) = if base.ends_with('s') && r == 1 {
                            GEMVB_SHAPES[1]
                        } else {
                            (r, u)
                        };
                        g[ni][si] = n(&format!("{base}_bf16w_n{tn}_r{r}u{u}"))?;
                    }
                }
                Ok(Some(g))
            };
            Ok(ActKernels {
                embed: n("embed")?,
                rms_norm: n("rms_norm")?,
                add: n("add")?,
                silu_mul: n("silu_mul")?,
                rope: n("rope")?,
                rope2: n("rope2")?,
                gather_rows: n("gather_rows")?,
                write_kv: n("write_kv")?,
                rope_kv: n("rope_kv")?,
                attn_decode: {
                    let mut a = [[KernelId(0); 4]; 5];
                    for (di, d) in [16, 32, 64, 128, 256].iter().enumerate() {
                        for (gi, g) in DECODE_GROUPS.iter().enumerate() {
                            a[di][gi] = n(&format!("attn_decode_d{d}_g{g}"))?;
                        }
                    }
                    a
                },
                attn_combine: n("attn_combine")?,
                attn_dec1: {
                    let mut a = [[KernelId(0); 4]; 2];
                    for (di, d) in [64, 128].iter().enumerate() {
                        for (gi, g) in DECODE_GROUPS.iter().enumerate() {
                            a[di][gi] = n(&format!("attn_dec1_d{d}_g{g}"))?;
                        }
                    }
                    a
                },
                attn_prefill: [n("attn_prefill_d64")?, n("attn_prefill_d128")?],
                attn_prefill2: [n("attn_prefill2_d64")?, n("attn_prefill2_d128")?],
                attn_prefill3: [n("attn_prefill3_d64")?, n("attn_prefill3_d128")?],
                gemv: [
                    n("gemv_f32w")?,
                    n("gemv_f16w")?,
                    n("gemv_bf16w")?,
                    n("gemv_q4_0w")?,
                    n("gemv_q4_1w")?,
                    n("gemv_q8_0w")?,
                ],
                gemvb: {
                    let mut g = [[[KernelId(0); 3]; 4]; 2];
                    for (wi, w) in ["bf16w", "f16w"].iter().enumerate() {
                        for (ni, tn) in GEMVB_TOKENS.iter().enumerate() {
                            for (si, (r, u)) in GEMVB_SHAPES.iter().enumerate() {
                                g[wi][ni][si] = n(&format!("gemvb_{w}_n{tn}_r{r}u{u}"))?;
                            }
                        }
                    }
                    g
                },
                gemvb_norm: folded(&mut n, "gemvbn")?,
                gemvb_acc: folded(&mut n, "gemvba")?,
                gemvb_swiglu: folded(&mut n, "gemvbs")?,
                gemvb_norm_swiglu: folded(&mut n, "gemvbns")?,
                gemvp: if s == "bf16" {
                    Some([
                        n("gemvp_bf16w_n1_r8")?,
                        n("gemvpn_bf16w_n1_r8")?,
                        n("gemvpa_bf16w_n1_r8")?,
                    ])
                } else {
                    None
                },
                gemvp_swiglu: if s == "bf16" {
                    Some([n("gemvps_bf16w_n1_r8")?, n("gemvpns_bf16w_n1_r8")?])
                } else {
                    None
                },
                gemvp_wide: if s == "bf16" && max_smem >= GEMVP_WIDE_SMEM {
                    Some([
                        n("gemvp_bf16w_n1_r32")?,
                        n("gemvpn_bf16w_n1_r32")?,
                        n("gemvpa_bf16w_n1_r32")?,
                    ])
                } else {
                    None
                },
                argmax: n("argmax")?,
                topk: n("topk")?,
            })
        };
        let f32 = act("f32")?;
        let bf16 = act("bf16")?;
        let rope_table = get("rope_table".into())?;
        let weight_to_bf16 = get("weight_to_bf16".into())?;
        let weight_to_f32 = get("weight_to_f32".into())?;
        let transpose_bf16 = get("transpose_bf16".into())?;
        let mut ds = |s: &str| -> Result<DeepseekKernels> {
            let mut n = |b: &str| get(format!("{b}_{s}"));
            Ok(DeepseekKernels {
                mla_q_absorb: [n("mla_q_absorb_wf32")?, n("mla_q_absorb_wbf16")?],
                mla_q_absorb2: [n("mla_q_absorb2_wf32")?, n("mla_q_absorb2_wbf16")?],
                mla_decode: n("mla_decode")?,
                mla_decode2: n("mla_decode2")?,
                mla_v_up: [n("mla_v_up_wf32")?, n("mla_v_up_wbf16")?],
                mla_v_up2: [n("mla_v_up2_wf32")?, n("mla_v_up2_wbf16")?],
                mla_dec1: [n("mla_dec1_wf32")?, n("mla_dec1_wbf16")?],
                mla_layer1: if s == "bf16" {
                    Some(n("mla_layer1")?)
                } else {
                    None
                },
                mla_layer1_smem: 0,
                mla_layer1_clusters: [0; 3],
                moe_route: n("moe_route")?,
                moe_route8: n("moe_route8")?,
                moe_gateup: [
                    [n("moe_gateup_wf32_t1")?, n("moe_gateup_wf32_t8")?],
                    [n("moe_gateup_wbf16_t1")?, n("moe_gateup_wbf16_t8")?],
                ],
                moe_down: [
                    [n("moe_down_wf32_t1")?, n("moe_down_wf32_t8")?],
                    [n("moe_down_wbf16_t1")?, n("moe_down_wbf16_t8")?],
                ],
                moe_combine: n("moe_combine")?,
                moe_route_dec: n("moe_route_dec")?,
                moe_route_decc: [n("moe_route_decc_n1")?, n("moe_route_decc_n8")?],
                moe_route1c: n("moe_route1c")?,
                route_own_smem: [0; 3],
                moe_ffn1: if s == "bf16" && major >= 9 {
                    Some(n("moe_ffn1")?)
                } else {
                    None
                },
                moe_ffn1_smem: 0,
                moe_fk1: if s == "bf16" && major >= 9 {
                    Some(n("moe_fk1")?)
                } else {
                    None
                },
                moe_fk1_smem: 0,
                moe_gu_dec: [
                    [n("moe_gu_dec_wf32_n1")?, n("moe_gu_dec_wf32_n8")?],
                    [n("moe_gu_dec_wbf16_n1")?, n("moe_gu_dec_wbf16_n8")?],
                ],
                moe_down_dec: [
                    [n("moe_down_dec_wf32_n1")?, n("moe_down_dec_wf32_n8")?],
                    [n("moe_down_dec_wbf16_n1")?, n("moe_down_dec_wbf16_n8")?],
                ],
            })
        };
        let mut deepseek = [ds("f32")?, ds("bf16")?];
        let moe_plan = get("moe_plan".into())?;
        let moe_plan2 = get("moe_plan2".into())?;
        let moe_mma = [get("moe_gu_mma".into())?, get("moe_dn_mma".into())?];
        let moe_gemm = [get("moe_gu_gemm".into())?, get("moe_dn_gemm".into())?];
        let moe_wg = if target_of_image.starts_with("sm_90a") {
            Some([get("moe_gu_wg".into())?, get("moe_dn_wg".into())?])
        } else {
            None
        };
        let mla_mma = [
            get("mla_merge".into())?,
            get("mla_v_mma".into())?,
            get("mla_q_absorb_mma".into())?,
            get("mla_decode_mma".into())?,
            get("mla_decode_mma4".into())?,
        ];
        let mla_x = [
            get("mla_x_rope".into())?,
            get("mla_x_gather".into())?,
            get("mla_x_attn".into())?,
        ];
        let stream_ldg = get("stream_ldg".into())?;
        let (stream_ring, stream_chain) = if major >= 9 {
            (
                Some(get("stream_ring".into())?),
                Some(get("stream_chain".into())?),
            )
        } else {
            (None, None)
        };
        let mut gemt = [KernelId(0); 5];
        let mut gemt_swiglu = [KernelId(0); 5];
        for (i, t) in GEMT_TOKENS.iter().enumerate() {
            gemt[i] = get(format!("gemt_t{t}"))?;
            gemt_swiglu[i] = get(format!("gemts_t{t}"))?;
        }
        let gemt_bytes = gemt
            .iter()
            .chain(&gemt_swiglu)
            .zip(GEMT_TOKENS.iter().cycle())
            .map(|(k, t)| (*k, gemt_smem(*t)));
        let big_smem: Vec<(KernelId, usize)> = [&f32, &bf16]
            .iter()
            .flat_map(|a| {
                let p2 = a
                    .attn_prefill2
                    .iter()
                    .zip([64, 128])
                    .map(|(k, d)| (*k, prefill2_smem(d)));
                let p3 = a
                    .attn_prefill3
                    .iter()
                    .zip([64, 128])
                    .map(|(k, d)| (*k, prefill3_smem(d)));
                p2.chain(p3)
            })
            .chain(gemt_bytes)
            .chain([
                (mla_mma[3], MLA_DECODE_MMA_SMEM),
                (mla_mma[4], MLA_DECODE4_SMEM),
                (mla_x[2], MLA_X_SMEM),
                (moe_gemm[0], moe_gemm_smem(2)),
                (moe_gemm[1], moe_gemm_smem(1)),
            ])
            .chain(moe_wg.into_iter().flatten().map(|k| (k, MOE_WG_SMEM)))
            .chain(
                [&f32, &bf16]
                    .iter()
                    .flat_map(|a| a.gemvp_wide.into_iter().flatten())
                    .map(|k| (k, GEMVP_WIDE_SMEM)),
            )
            .collect();
        // Kernels that need more than the device has are never launched (see
        // `attention::prefill_kernel`; the skinny GEMMs, at most 74 KB, fit every sm_80+ device).
        for (k, bytes) in big_smem.into_iter().filter(|&(_, b)| b <= max_smem) {
            let f = funcs[k.0 as usize].cu_function();
            // SAFETY: `f` is a kernel of the loaded module; the value is within the device's
            // opt-in limit (227 KB on Hopper, 163 KB on A100).
            unsafe {
                cudarc::driver::result::function::set_function_attribute(
                    f,
                    sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            }
            .map_err(|e| cuda_err("raising a kernel's shared memory limit", e))?;
        }
        let raise = |k: KernelId| {
            raise_dyn_smem(funcs[k.0 as usize].cu_function(), max_smem, usize::MAX).map(|s| (k, s))
        };
        let stream_ring = stream_ring.and_then(raise);
        let stream_chain = stream_chain.and_then(raise);
        for ds in deepseek.iter_mut() {
            let kernels = [ds.moe_route_decc[0], ds.moe_route_decc[1], ds.moe_route1c];
            for (k, own) in kernels.iter().zip(ds.route_own_smem.iter_mut()) {
                let f = funcs[k.0 as usize].cu_function();
                *own = raise_dyn_smem(f, max_smem, usize::MAX).unwrap_or(0);
            }
            // the persistent one-token MoE launches: the most shared memory that still leaves
            // a block an SM, or none
            for (kernel, smem) in [
                (&mut ds.moe_ffn1, &mut ds.moe_ffn1_smem),
                (&mut ds.moe_fk1, &mut ds.moe_fk1_smem),
            ] {
                if let Some(k) = *kernel {
                    let f = funcs[k.0 as usize].cu_function();
                    *smem = raise_dyn_smem(f, max_smem, usize::MAX)
                        .filter(|&smem| blocks_per_sm(f, MOE_FFN1_THREADS, smem) >= 1)
                        .unwrap_or(0);
                    if *smem == 0 {
                        *kernel = None;
                    }
                }
            }
            if let Some(k) = ds.mla_layer1 {
                (ds.mla_layer1_smem, ds.mla_layer1_clusters) =
                    layer_occupancy(funcs[k.0 as usize].cu_function(), max_smem);
                tracing::debug!(
                    "mla_layer1: {} bytes of dynamic shared memory, clusters of 2 / 4 / 8 held at once {:?}",
                    ds.mla_layer1_smem,
                    ds.mla_layer1_clusters
                );
            }
        }
        Ok(Module {
            stream_ldg,
            stream_ring,
            stream_chain,
            funcs,
            names,
            trace_table,
            trace_blocks,
            pdl: major >= 9,
            clusters: major >= 9,
            cluster_policy: None,
            sms,
            max_smem,
            f32,
            bf16,
            rope_table,
            weight_to_bf16,
            transpose_bf16,
            weight_to_f32,
            deepseek,
            moe_plan,
            moe_plan2,
            moe_mma,
            moe_gemm,
            moe_wg,
            mla_mma,
            mla_x,
            gemt,
            gemt_swiglu,
        })
    }

    pub fn act(&self, a: Act) -> &ActKernels {
        match a {
            Act::F32 => &self.f32,
            Act::Bf16 => &self.bf16,
        }
    }

    pub fn function(&self, k: KernelId) -> sys::CUfunction {
        self.funcs[k.0 as usize].cu_function()
    }

    pub fn name(&self, k: KernelId) -> &str {
        &self.names[k.0 as usize]
    }
}

/// The dynamic shared memory `mla_layer1` may have (its f32 input: hidden widths up to 8,192).
const MLA_LAYER1_SMEM: usize = 32 * 1024;

/// Raises `f`'s dynamic shared memory limit to what the device has beside its static shared
/// memory, at most `cap` bytes: the limit set, or `None` where a call fails.
fn raise_dyn_smem(f: sys::CUfunction, max_smem: usize, cap: usize) -> Option<u32> {
    use cudarc::driver::result::function as func;
    use sys::CUfunction_attribute_enum as A;
    // SAFETY: `f` is a kernel of the loaded module; the value set is within the device's
    // opt-in limit less the kernel's static shared memory.
    unsafe {
        func::get_function_attribute(f, A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES).and_then(|st| {
            let fill = max_smem.saturating_sub(st.max(0) as usize).min(cap) as i32;
            func::set_function_attribute(
                f,
                A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                fill,
            )
            .map(|()| fill as u32)
        })
    }
    .ok()
}

/// Threads of a `moe_ffn1` block (`MOEF_THREADS`: 8 warps, each copying and reading its own
/// ring of pages).
pub const MOE_FFN1_THREADS: u32 = 256;

/// How many blocks of `f` with `threads` threads and `smem` bytes of dynamic shared memory an
/// SM holds at once (0 where the call fails).
fn blocks_per_sm(f: sys::CUfunction, threads: u32, smem: u32) -> u32 {
    let mut n: std::ffi::c_int = 0;
    // SAFETY: `f` is a kernel of the loaded module; the call only writes `n`.
    let ok = unsafe {
        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, f, threads as i32, smem as usize)
    }
    .result();
    if ok.is_ok() {
        n.max(0) as u32
    } else {
        0
    }
}

/// Raises `f`'s (`mla_layer1`'s) dynamic shared memory limit to [`MLA_LAYER1_SMEM`] and asks
/// how many clusters of 2, 4 and 8 blocks of 256 threads with that much the device holds at
/// once: (limit, clusters), zeros where a call fails or the device has too little (the fused
/// layer launch is then not used).
fn layer_occupancy(f: sys::CUfunction, max_smem: usize) -> (u32, [u32; 3]) {
    let Some(fill) = raise_dyn_smem(f, max_smem, MLA_LAYER1_SMEM) else {
        return (0, [0; 3]);
    };
    let mut clusters = [0u32; 3];
    for (c, out) in [2u32, 4, 8].into_iter().zip(clusters.iter_mut()) {
        // SAFETY: all-zero is a valid launch attribute; the one set is the cluster shape.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attr.value.clusterDim =
            sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: c, y: 1, z: 1 };
        let cfg = sys::CUlaunchConfig {
            gridDimX: c,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: 256,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: fill,
            hStream: std::ptr::null_mut(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut n: std::ffi::c_int = 0;
        // SAFETY: `cfg` and `attr` outlive the call, which only reads them and writes `n`.
        let ok = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f, &cfg) }.result();
        *out = if ok.is_ok() { n.max(0) as u32 } else { 0 };
    }
    (fill, clusters)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiles every kernel with NVRTC when the library is present (no GPU needed), so a
    /// syntax or type error in `kernels/*.cu` shows up without a device.
    #[test]
    fn kernels_compile_with_nvrtc() {
        // SAFETY: only tries to dlopen libnvrtc.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!(
                "skipped: no NVRTC library (set LD_LIBRARY_PATH to a folder with libnvrtc.so)"
            );
            return;
        }
        let ptx = String::from_utf8(compile("compute_90").expect("kernels compile")).unwrap();
        for name in [
            "gemv_bf16w_bf16",
            "gemvb_bf16w_n4_r4u2_bf16",
            "gemvbn_bf16w_n8_r1u8_bf16",
            "gemvba_bf16w_n1_r2u4_bf16",
            "gemvpn_bf16w_n1_r8_bf16",
            "gemvpa_bf16w_n1_r32_bf16",
            "gemvpns_bf16w_n1_r8_bf16",
            "attn_prefill_d128_f32",
            "attn_prefill3_d128_bf16",
            "attn_decode_d64_g4_bf16",
            "topk_f32",
            "rms_norm_f32",
            "mla_decode_bf16",
            "mla_decode2_bf16",
            "mla_dec1_wbf16_bf16",
            "mla_dec1_wf32_f32",
            "mla_layer1_bf16",
            "moe_gateup_wbf16_t8_bf16",
            "moe_plan",
            "moe_plan2",
            "moe_route8_bf16",
            "moe_ffn1_bf16",
            "moe_fk1_bf16",
            "transpose_bf16",
            "moe_gu_mma",
            "moe_dn_mma",
            "moe_gu_gemm",
            "moe_dn_gemm",
            "mla_merge",
            "mla_v_mma",
            "mla_q_absorb_mma",
            "mla_decode_mma",
            "mla_decode_mma4",
            "mla_x_rope",
            "mla_x_gather",
            "mla_x_attn",
            "gemt_t24",
            "gemts_t64",
            "moe_route_dec_bf16",
            "moe_route_decc_n1_bf16",
            "moe_route1c_bf16",
            "moe_down_dec_wbf16_n8_bf16",
        ] {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "{name} missing from the PTX"
            );
        }
        // the warpgroup-MMA kernels exist for the arch-specific Hopper target only
        let ptx_a = String::from_utf8(compile("compute_90a").expect("kernels compile")).unwrap();
        for name in ["moe_gu_wg", "moe_dn_wg"] {
            assert!(ptx_a.contains(&format!(".entry {name}(")), "{name}");
            assert!(!ptx.contains(&format!(".entry {name}(")), "{name}");
        }
        assert!(ptx_a.contains("wgmma.mma_async"));
    }

    #[test]
    fn real_architectures_compile_to_a_cubin() {
        // SAFETY: only tries to dlopen libnvrtc.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: no NVRTC library");
            return;
        }
        let src = "extern \"C\" __global__ void k(float* x) { x[threadIdx.x] = 1.0f; }";
        let cubin = compile_source(src, "sm_90").expect("compiles");
        assert!(image_ok("sm_90", &cubin), "not an ELF image");
        let ptx = compile_source(src, "compute_90").expect("compiles");
        assert!(image_ok("compute_90", &ptx) && !image_ok("sm_90", &ptx));
        let e = compile_source("this is not CUDA", "sm_90")
            .unwrap_err()
            .to_string();
        assert!(e.contains("sm_90") && e.contains("error"), "{e}");
    }

    #[test]
    fn kernel_defines_parse() {
        let d = parse_defines(" DI_X_EVICT, R=4 ,,V=1.5e-3").unwrap();
        let want = [("DI_X_EVICT", "1"), ("R", "4"), ("V", "1.5e-3")];
        assert_eq!(d.len(), want.len());
        for ((n, v), (wn, wv)) in d.iter().zip(want) {
            assert_eq!((n.as_str(), v.as_str()), (wn, wv));
        }
        assert!(parse_defines("").unwrap().is_empty());
        for bad in ["1X", "A=", "A=b c", "A;B", "X=\"q\""] {
            let e = parse_defines(bad).unwrap_err().to_string();
            assert!(e.contains("DEEPINFER_CUDA_DEFINE"), "{bad}: {e}");
        }
    }

    #[test]
    fn arch_names() {
        assert_eq!(target_for(9, 0), "sm_90a");
        assert_eq!(target_for(12, 0), "sm_120");
        assert_eq!(target_for(12, 1), "compute_90");
        assert!(is_cubin("sm_90") && !is_cubin("compute_90"));
        assert!(cache_path("sm_90").to_string_lossy().ends_with(".cubin"));
        assert_eq!(arch_for(9, 0), "compute_90");
        assert_eq!(arch_for(8, 0), "compute_80");
        // Every capability maps into ARCHS, which `deepinfer dev ptx` accepts.
        for major in 7..=13 {
            for minor in 0..=9 {
                assert!(ARCHS.contains(&arch_for(major, minor)));
            }
        }
    }
}
