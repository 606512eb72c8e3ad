//! Mixture-of-experts layers on the device (`kernels/moe.cu`): routing, a per-expert plan
//! and expert-grouped products, all queued without a host round trip, so a decode step stays
//! one CUDA graph. Each selected expert's gate/up rows are streamed once for all of its tokens
//! (one launch for every selected expert), then its down rows (one launch), then one combine
//! launch weights and sums the outputs with the shared experts'. The load counters are
//! counted on the device and read on demand. It must not know about checkpoints.

use std::sync::Arc;

use super::device::{cuda_err, DevMem};
use super::module::{
    moe_gemm_smem, KernelId, Module, MOE_FFN1_THREADS, MOE_GEMM_K, MOE_GEMM_ROWS, MOE_GEMM_THREADS,
    MOE_GEMM_TOKENS, MOE_WG_ROWS, MOE_WG_SMEM, MOE_WG_TOKENS, ROWMMA_ROWS, ROWMMA_THREADS,
};
use super::ops::{check, launch};
use super::queue::{Op, GEMV_SEGMENTS};
use super::weights::WType;
use super::{Act, CudaBackend, CudaBuf, CudaWeight, Inner};
use crate::error::{Error, Result};
use crate::ids::TokenId;
use crate::model::moe::{ExpertLoad, MoeLayer, Router, ScoreFunc};

/// Most experts the routing and plan kernels take (`MOE_MAX_EXPERTS`).
const MAX_EXPERTS: usize = 1024;
/// Most expert groups and experts per token the routing kernel takes.
const MAX_GROUPS: usize = 64;
const MAX_TOP_K: usize = 64;
/// Output rows per block of the grouped GEMVs (one warp each).
const ROWS_PER_BLOCK: usize = 8;
/// Threads of the plan kernel (`MOE_PLAN_THREADS`).
const PLAN_THREADS: u32 = 1024;
/// Threads of a `moe_plan2` block (`MOE_PLAN2_THREADS`, a block an expert).
const PLAN2_THREADS: u32 = 512;
/// `moe_route8`: tokens and threads a block, most experts (`MOE_RT`, `MOE_RT_THREADS`,
/// `MOE_RT_MAXE`).
const ROUTE8_TOKENS: usize = 8;
const ROUTE8_THREADS: u32 = 256;
const ROUTE8_MAX_EXPERTS: usize = 256;
/// Decode kernels (`moe_*_dec`): most tokens, experts, routed slots (selected experts) and
/// shared-expert slots; experts per routing block, rows per block of the expert products.
const DEC_MAX_TOKENS: usize = 8;
const DEC_MAX_EXPERTS: usize = 256;
const DEC_MAX_SLOTS: usize = 64;
const DEC_MAX_SHARED: usize = 16;
const DEC_EXPERTS_PER_BLOCK: usize = 4;
/// Experts a block of the cluster routing (`MOED_EPBC`).
const DEC_EXPERTS_PER_CLUSTER_BLOCK: usize = 8;
const DEC_ROWS: usize = 4;
const DEC_THREADS: u32 = 256;

/// What a layer keeps on the device (in [`MoeLayer::device`]).
struct MoeDevice {
    /// `[gate; E]`, `[up; E]`, `[down; E]` weight addresses.
    ptrs: DevMem,
    bias: Option<DevMem>,
    /// Tokens per expert since the layer was built (u64) and in the last step (u32).
    totals: DevMem,
    last: DevMem,
    /// 0: f32 expert weights, 1: bf16.
    wi: usize,
    /// Arrival counter of the decode routing kernel, then `moe_ffn1`'s five (each left
    /// zeroed by every launch).
    counter: DevMem,
    /// `moe_ffn1`'s gate/up values of its slots (top k, then the shared experts' slots of
    /// `inter` rows), bf16.
    act: DevMem,
    /// `moe_ffn1`'s / `moe_fk1`'s router logits, f32.
    logits: DevMem,
    /// The shared experts as slots of the decode kernels: `None` when they cannot be (other
    /// type or width), else (slots, gate, up, down addresses; 0 slots without shared experts).
    dec_shared: Option<(usize, [u64; 3])>,
    /// The transposed down matrices `moe_fk1` reads, where [`CudaOptions::moe_splitk`] asks.
    split: Option<MoeSplit>,
}

/// `moe_fk1`'s weights: every down matrix transposed, `[inter, d]`, so an expert row's gate,
/// up and down values are three contiguous rows.
struct MoeSplit {
    /// `[gate; E]`, `[up; E]`, `[down transposed; E]` addresses.
    ptrs: DevMem,
    /// The shared experts' down matrix transposed, `[shared inter, d]` (0 without).
    shared_downt: u64,
    /// The experts' transposed copies, then the shared experts'.
    _mem: DevMem,
}

fn bytes_of<T: Copy>(v: &[T], f: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

fn build_state(inner: &Arc<Inner>, layer: &MoeLayer<CudaWeight>, d: usize) -> Result<MoeDevice> {
    let cfg = &layer.cfg;
    let e = cfg.n_experts;
    let first = layer
        .experts
        .first()
        .ok_or_else(|| Error::BadConfig("MoE layer without experts".into()))?;
    let wt = first.gate.wtype;
    let wi = match wt {
        WType::F32 => 0,
        WType::Bf16 => 1,
        other => {
            return Err(Error::BadConfig(format!(
                "MoE experts on CUDA must be f32 or bf16, not {other:?}"
            )))
        }
    };
    let inter = first.inter;
    if !d.is_multiple_of(8) || !inter.is_multiple_of(8) {
        return Err(Error::BadConfig(format!(
            "MoE on CUDA needs hidden ({d}) and expert width ({inter}) to be multiples of 8"
        )));
    }
    for (j, m) in layer.experts.iter().enumerate() {
        let ok = [&m.gate, &m.up, &m.down].iter().all(|w| w.wtype == wt)
            && m.inter == inter
            && (
                m.gate.rows,
                m.gate.cols,
                m.up.rows,
                m.up.cols,
                m.down.rows,
                m.down.cols,
            ) == (inter, d, inter, d, d, inter);
        if !ok {
            return Err(Error::BadConfig(format!(
                "MoE expert {j} differs in type or shape from expert 0 ({wt:?}, {inter}x{d})"
            )));
        }
    }
    let mut ptrs: Vec<u64> = layer.experts.iter().map(|m| m.gate.ptr()).collect();
    ptrs.extend(layer.experts.iter().map(|m| m.up.ptr()));
    ptrs.extend(layer.experts.iter().map(|m| m.down.ptr()));
    let upload = |data: Vec<u8>| -> Result<DevMem> {
        let m = DevMem::alloc(&inner.ctx, data.len())?;
        m.upload(&inner.stream, &data)?;
        Ok(m)
    };
    let bias = match &layer.router {
        Router::Learned { bias: Some(b), .. } => {
            Some(upload(bytes_of(b, |v: f32| v.to_le_bytes().to_vec()))?)
        }
        _ => None,
    };
    // The shared experts split into slots of `inter` rows (gate, up) and columns (down).
    let dec_shared = match &layer.shared {
        None => Some((0, [0; 3])),
        Some(s) => {
            let ok = [&s.gate, &s.up, &s.down].iter().all(|w| w.wtype == wt)
                && s.inter.is_multiple_of(inter)
                && s.inter / inter <= DEC_MAX_SHARED
                && (
                    s.gate.rows,
                    s.gate.cols,
                    s.up.rows,
                    s.up.cols,
                    s.down.rows,
                    s.down.cols,
                ) == (s.inter, d, s.inter, d, d, s.inter);
            ok.then(|| (s.inter / inter, [s.gate.ptr(), s.up.ptr(), s.down.ptr()]))
        }
    };
    let split = if inner.opts.moe_ffn1
        && inner.opts.moe_splitk
        && wi == 1
        && inner.module.deepseek[1].moe_fk1.is_some()
    {
        build_split(inner, layer, d, inter, &ptrs[..2 * e], dec_shared)?
    } else {
        None
    };
    // [0]: the decode routing's arrivals; [1..7]: `moe_ffn1`'s (logits, gate/up, blocks done,
    // residual rows, the o product's rows, the blocks' arrival tickets)
    let counter = DevMem::alloc(&inner.ctx, 28)?;
    counter.zero(&inner.stream)?;
    let totals = DevMem::alloc(&inner.ctx, e * 8)?;
    totals.zero(&inner.stream)?;
    let last = DevMem::alloc(&inner.ctx, e * 4)?;
    last.zero(&inner.stream)?;
    let logits = DevMem::alloc(&inner.ctx, e * 4)?;
    let slots = cfg.top_k + dec_shared.map_or(0, |(n, _)| n);
    let act = DevMem::alloc(&inner.ctx, slots * inter * 2)?;
    Ok(MoeDevice {
        ptrs: upload(bytes_of(&ptrs, |p: u64| p.to_le_bytes().to_vec()))?,
        bias,
        totals,
        last,
        wi,
        counter,
        logits,
        act,
        dec_shared,
        split,
    })
}

/// Transposed copies of the down matrices of a bf16 layer for `moe_fk1` (queued, so they run
/// before any launch that reads them): `None` where a down matrix's rows are not packed, the
/// shared experts are not slots of the decode kernels, or the device has no room for the copy
/// (a warning says so). Costs the layer's down bytes again in device memory.
fn build_split(
    inner: &Arc<Inner>,
    layer: &MoeLayer<CudaWeight>,
    d: usize,
    inter: usize,
    gate_up: &[u64],
    dec_shared: Option<(usize, [u64; 3])>,
) -> Result<Option<MoeSplit>> {
    let Some((n_shared, _)) = dec_shared else {
        return Ok(None);
    };
    let shared_down = layer.shared.as_ref().map(|s| &s.down);
    let downs: Vec<&CudaWeight> = layer.experts.iter().map(|m| &m.down).collect();
    let packed = |w: &CudaWeight| w.row_bytes == w.cols * 2 && w.rows <= i32::MAX as usize;
    if !downs.iter().copied().chain(shared_down).all(packed) {
        return Ok(None);
    }
    let block = inter * d * 2;
    let bytes = (downs.len() + n_shared) * block;
    let mem = match DevMem::alloc(&inner.ctx, bytes) {
        Ok(m) => m,
        Err(e) => {
            // the layer keeps moe_ffn1, which needs no copy
            tracing::warn!(
                "DEEPINFER_CUDA_MOE_SPLITK: no room for a MoE layer's transposed down matrices \
                 ({bytes} bytes: {e}); the layer runs moe_ffn1"
            );
            return Ok(None);
        }
    };
    let mut ptrs = gate_up.to_vec();
    let transpose = |w: &CudaWeight, at: u64| {
        inner.push(Op::Launch {
            kernel: inner.module.transpose_bf16,
            grid: [w.cols.div_ceil(32) as u32, w.rows.div_ceil(32) as u32, 1],
            block: 256,
            smem: 0,
            args: vec![at, w.ptr(), w.rows as u64, w.cols as u64],
        });
    };
    for (j, w) in downs.iter().enumerate() {
        let at = mem.ptr + (j * block) as u64;
        transpose(w, at);
        ptrs.push(at);
    }
    let shared_downt = match shared_down {
        Some(w) => {
            let at = mem.ptr + (downs.len() * block) as u64;
            transpose(w, at);
            at
        }
        None => 0,
    };
    let table = DevMem::alloc(&inner.ctx, ptrs.len() * 8)?;
    table.upload(
        &inner.stream,
        &bytes_of(&ptrs, |p: u64| p.to_le_bytes().to_vec()),
    )?;
    Ok(Some(MoeSplit {
        ptrs: table,
        shared_downt,
        _mem: mem,
    }))
}

fn state<'a>(
    inner: &Arc<Inner>,
    layer: &'a MoeLayer<CudaWeight>,
    d: usize,
) -> Result<&'a MoeDevice> {
    if layer.device.get().is_none() {
        let s = build_state(inner, layer, d)?;
        let _ = layer.device.set(Box::new(s));
    }
    layer
        .device
        .get()
        .and_then(|b| b.downcast_ref::<MoeDevice>())
        .ok_or_else(|| Error::Cuda("MoE layer holds another backend's state".into()))
}

/// `out = moe(x)` on the device; hash-routed layers fall back to the host routing.
pub(crate) fn forward(
    be: &CudaBackend,
    layer: &MoeLayer<CudaWeight>,
    x: &CudaBuf,
    tokens: &[TokenId],
    n: usize,
    d: usize,
    out: &mut CudaBuf,
) -> Result<()> {
    let inner = &be.inner;
    let gate = match &layer.router {
        Router::Learned { gate, .. } => gate,
        Router::Hashed { .. } => return layer.forward(be, x, tokens, n, d, out),
    };
    if n == 0 {
        return Ok(());
    }
    let cfg = &layer.cfg;
    let (e, k) = (cfg.n_experts, cfg.top_k);
    if e > MAX_EXPERTS || cfg.n_group > MAX_GROUPS || k > MAX_TOP_K {
        return Err(Error::BadConfig(format!(
            "MoE on CUDA takes at most {MAX_EXPERTS} experts in {MAX_GROUPS} groups and top {MAX_TOP_K} ({e} in {}, top {k})",
            cfg.n_group
        )));
    }
    if gate.rows != e || gate.cols != d {
        return Err(Error::BadConfig(format!(
            "router gate is {}x{}, expected {e}x{d}",
            gate.rows, gate.cols
        )));
    }
    check("MoE input", x.len(), n * d)?;
    check("MoE output", out.len(), n * d)?;
    let st = state(inner, layer, d)?;
    let inter = layer.experts[0].inter;
    if let Some(shared) = decode_fits(be, layer, st, n, d) {
        return forward_decode(be, layer, st, gate, x, n, d, inter, shared, out);
    }
    // the combine writes every row of `out`
    if out.device_len() == n * d {
        inner.drop_zeroing(out.ptr(), out.device_len() * inner.act().size());
    }
    let act = inner.act();
    let kern = &inner.module.deepseek[match act {
        Act::F32 => 0,
        Act::Bf16 => 1,
    }];
    let nk = n * k;
    let ids = inner.scratch(nk, 4)?;
    let weights = inner.scratch(nk, 4)?;
    let score = match cfg.score {
        ScoreFunc::Sigmoid => 0u64,
        ScoreFunc::Softmax => 1,
        ScoreFunc::SqrtSoftplus => 2,
    };
    // 8 tokens a block for many tokens (whole 8-value chunks of 16-byte f32 / f16 / bf16 rows)
    let route8 = inner.opts.moe_many
        && n >= inner.opts.route8_min
        && e <= ROUTE8_MAX_EXPERTS
        && d.is_multiple_of(8)
        && gate.row_bytes.is_multiple_of(16)
        && matches!(gate.wtype, WType::F32 | WType::F16 | WType::Bf16);
    let mut args = vec![
        ids.ptr(),
        weights.ptr(),
        x.ptr(),
        gate.ptr(),
        gate.wtype as u64,
        gate.row_bytes as u64,
        st.bias.as_ref().map_or(0, |b| b.ptr),
    ];
    if route8 {
        args.push(n as u64);
    }
    args.extend([
        d as u64,
        e as u64,
        k as u64,
        score,
        cfg.n_group as u64,
        cfg.topk_group as u64,
        cfg.norm_topk_prob as u64,
        cfg.scaling.to_bits() as u64,
    ]);
    let (route, blocks, threads) = if route8 {
        (kern.moe_route8, n.div_ceil(ROUTE8_TOKENS), ROUTE8_THREADS)
    } else {
        (kern.moe_route, n, 1024)
    };
    launch(inner, route, [blocks as u32, 1, 1], threads, args);
    let offsets = inner.scratch(e + 1, 4)?;
    let rows = inner.scratch(nk, 4)?;
    let active = inner.scratch(e, 4)?;
    let n_active = inner.scratch(1, 4)?;
    let (plan, plan_blocks, plan_threads) = if inner.opts.moe_many {
        (inner.module.moe_plan2, e as u32, PLAN2_THREADS)
    } else {
        (inner.module.moe_plan, 1, PLAN_THREADS)
    };
    launch(
        inner,
        plan,
        [plan_blocks, 1, 1],
        plan_threads,
        vec![
            offsets.ptr(),
            rows.ptr(),
            active.ptr(),
            n_active.ptr(),
            st.totals.ptr,
            st.last.ptr,
            ids.ptr(),
            nk as u64,
            e as u64,
        ],
    );
    let slots = e.min(nk) as u32;
    // one token: every selected expert has exactly one assignment (the lean kernels)
    let ti = usize::from(n > 1);
    let h = inner.scratch(nk * inter, act.size())?;
    let (gates, ups, downs) = (
        st.ptrs.ptr,
        st.ptrs.ptr + 8 * e as u64,
        st.ptrs.ptr + 16 * e as u64,
    );
    // tensor cores where a step has more assignments than the decode kernels take
    let mma = inner.opts.moe_mma && act == Act::Bf16 && st.wi == 1 && n > DEC_MAX_TOKENS;
    // tiled GEMMs where the experts average `moe_gemm_min` assignments or more (both row
    // lengths in whole stages)
    let gemm = mma
        && inner.opts.moe_gemm
        && nk >= inner.opts.moe_gemm_min * e
        && d.is_multiple_of(MOE_GEMM_K)
        && inter.is_multiple_of(MOE_GEMM_K)
        && moe_gemm_smem(2) <= inner.module.max_smem;
    // on Hopper's warpgroup MMA where the module has it (an sm_90a image)
    let wg = inner
        .module
        .moe_wg
        .filter(|_| gemm && inner.opts.moe_wg && MOE_WG_SMEM <= inner.module.max_smem);
    // kernels, weight rows a block of each (gate/up: of each matrix), threads, blocks, smem
    let (gateup, down, rows_per_block, threads, blocks, smem) = if let Some([gu, dn]) = wg {
        let tiles = (nk.div_ceil(MOE_WG_TOKENS) + slots as usize) as u32;
        let sm = MOE_WG_SMEM as u32;
        (
            gu,
            dn,
            [MOE_WG_ROWS / 2, MOE_WG_ROWS],
            MOE_GEMM_THREADS,
            tiles,
            [sm, sm],
        )
    } else if gemm {
        // an upper bound of the active experts' tiles; the rest of the blocks leave at once
        let tiles = (nk.div_ceil(MOE_GEMM_TOKENS) + slots as usize) as u32;
        let [gu, dn] = inner.module.moe_gemm;
        let sm = [moe_gemm_smem(2) as u32, moe_gemm_smem(1) as u32];
        (gu, dn, [MOE_GEMM_ROWS; 2], MOE_GEMM_THREADS, tiles, sm)
    } else if mma {
        let [gu, dn] = inner.module.moe_mma;
        (gu, dn, [ROWMMA_ROWS; 2], ROWMMA_THREADS, slots, [0, 0])
    } else {
        (
            kern.moe_gateup[st.wi][ti],
            kern.moe_down[st.wi][ti],
            [ROWS_PER_BLOCK; 2],
            (ROWS_PER_BLOCK * 32) as u32,
            slots,
            [0, 0],
        )
    };
    // a launch of `out_rows` rows a group of assignments
    let push = |kernel, out_rows: usize, rows_per_block: usize, smem, args| {
        inner.push(Op::Launch {
            kernel,
            grid: [blocks, out_rows.div_ceil(rows_per_block) as u32, 1],
            block: threads,
            smem,
            args,
        })
    };
    push(
        gateup,
        inter,
        rows_per_block[0],
        smem[0],
        vec![
            h.ptr(),
            x.ptr(),
            gates,
            ups,
            active.ptr(),
            n_active.ptr(),
            offsets.ptr(),
            rows.ptr(),
            k as u64,
            d as u64,
            inter as u64,
        ],
    );
    let y = inner.scratch(nk * d, 4)?;
    push(
        down,
        d,
        rows_per_block[1],
        smem[1],
        vec![
            y.ptr(),
            h.ptr(),
            downs,
            active.ptr(),
            n_active.ptr(),
            offsets.ptr(),
            rows.ptr(),
            k as u64,
            inter as u64,
            d as u64,
        ],
    );
    let shared = match &layer.shared {
        Some(s) => {
            let mut o = crate::backend::Backend::zeros(be, n * d)?;
            s.forward(be, x, n, &mut o)?;
            Some(o)
        }
        None => None,
    };
    launch(
        inner,
        kern.moe_combine,
        [n as u32, d.div_ceil(256) as u32, 1],
        256,
        vec![
            out.ptr(),
            y.ptr(),
            weights.ptr(),
            shared.as_ref().map_or(0, |s| s.ptr()),
            k as u64,
            d as u64,
        ],
    );
    layer.count_device_step();
    Ok(())
}

/// The shared-expert slots of the decode kernels when they take this step (up to 8 tokens,
/// at most 256 experts and 64 selected per step, a gate they read 8 values at a time, shared
/// experts that split into slots).
fn decode_fits(
    be: &CudaBackend,
    layer: &MoeLayer<CudaWeight>,
    st: &MoeDevice,
    n: usize,
    d: usize,
) -> Option<(usize, [u64; 3])> {
    let cfg = &layer.cfg;
    let gate = match &layer.router {
        Router::Learned { gate, .. } => gate,
        Router::Hashed { .. } => return None,
    };
    let fits = be.inner.opts.fuse_moe
        && n <= DEC_MAX_TOKENS
        && cfg.n_experts <= DEC_MAX_EXPERTS
        && cfg.n_experts.min(n * cfg.top_k) <= DEC_MAX_SLOTS
        && matches!(gate.wtype, WType::F32 | WType::Bf16 | WType::F16)
        && gate.row_bytes.is_multiple_of(16)
        && d.is_multiple_of(8);
    if fits {
        st.dec_shared
    } else {
        None
    }
}

/// `moe_ffn1`'s launch shape: kernel, dynamic shared memory, ring pages and their bytes.
struct Ffn1 {
    kernel: KernelId,
    smem: u32,
    pages: usize,
    page: usize,
}

/// Most ring pages, widest hidden row and expert row, most picked experts and slots of
/// `moe_ffn1` (`MOEF_MAXP`, `MOEF_MAXJ`, `MOEF_MAXIJ`, `MOEF_MAXS`).
const FFN1_MAX_PAGES: usize = 32;
const FFN1_MAX_WIDTH: usize = 2048;
const FFN1_MAX_TOP_K: usize = 32;
const FFN1_MAX_SLOTS: usize = 48;
/// Consumer warps of a `moe_ffn1` block (`MOEF_WARPS`), each with its own ring pages.
const FFN1_WARPS: usize = 8;
/// Fewest ring pages worth the launch.
const FFN1_MIN_PAGES: usize = 8;

/// Whether a one-token step (no group limit) of this layer takes `moe_ffn1`, and its shape:
/// bf16 weights and activations, the option on, a device holding a block on every SM, at
/// most 64 experts (and no more than SMs: a block computes an expert's logit) and
/// [`FFN1_MAX_TOP_K`] picked, rows of at most [`FFN1_MAX_WIDTH`], and room for the slots'
/// activations beside [`FFN1_MIN_PAGES`] pages of two weight rows each.
fn ffn1_fits(
    inner: &Inner,
    st: &MoeDevice,
    d: usize,
    inter: usize,
    e: usize,
    k: usize,
    n_shared: usize,
) -> Option<Ffn1> {
    let kern = &inner.module.deepseek[1];
    let kernel = kern.moe_ffn1?;
    let slots = k + n_shared;
    let fits = inner.opts.moe_ffn1
        && inner.act() == Act::Bf16
        && st.wi == 1
        && e <= 64
        && e <= inner.module.sms
        && k <= FFN1_MAX_TOP_K
        && slots <= FFN1_MAX_SLOTS
        && d <= FFN1_MAX_WIDTH
        && inter <= FFN1_MAX_WIDTH
        && d.is_multiple_of(8)
        && inter.is_multiple_of(8);
    if !fits {
        return None;
    }
    let page = 4 * d.max(inter);
    let room = (kern.moe_ffn1_smem as usize).checked_sub(slots * inter * 2)?;
    // a whole number of pages a consumer warp
    let most = match inner.opts.ffn1_pages {
        0 => FFN1_MAX_PAGES,
        n => n.min(FFN1_MAX_PAGES),
    };
    let pages = (room / page).min(most) / FFN1_WARPS * FFN1_WARPS;
    (pages >= FFN1_MIN_PAGES).then_some(Ffn1 {
        kernel,
        smem: (pages * page + slots * inter * 2) as u32,
        pages,
        page,
    })
}

/// Blocks of a `moe_ffn1` / `moe_fk1` launch of a layer of `e` experts: one an SM, or
/// `CudaOptions::ffn1_blocks` where that lies in [e, SMs] (each of the first `e` blocks to
/// arrive computes a logit; every block must be resident at once).
fn ffn1_blocks(inner: &Inner, e: usize) -> usize {
    let sms = inner.module.sms;
    match inner.opts.ffn1_blocks {
        n if n >= e && n <= sms => n,
        _ => sms,
    }
}

/// Most ring pages of `moe_fk1` (`MOEK_MAXP`).
const FK1_MAX_PAGES: usize = 16;
/// Most blocks (SMs) of `moe_fk1` (`MOEK_MAXG`).
const FK1_MAX_BLOCKS: usize = 256;
/// Parameters of `moe_fk1` (out, res, ..., d (19), ..., page), laid out as `moe_ffn1`'s
/// first ones, then [`FK1_L2`]'s.
const FK1_ARGS: usize = 33;
/// Where `moe_fk1`'s two (address, bytes) ranges of the next launch's weights start, which
/// its blocks ask into L2 once their units are done (`link_next_weights`; zero: none).
const FK1_L2: usize = 29;

/// `moe_fk1`'s launch shape where a one-token step that `moe_ffn1` takes may take it instead:
/// the layer's transposed down matrices made, and room for [`FFN1_MIN_PAGES`] pages of three
/// rows (the gate, up and transposed down rows of one expert row) that also hold the 8 warps'
/// `d` partial sums.
fn fk1_fits(inner: &Inner, st: &MoeDevice, d: usize) -> Option<Ffn1> {
    st.split.as_ref()?;
    if inner.module.sms > FK1_MAX_BLOCKS {
        return None;
    }
    let kern = &inner.module.deepseek[1];
    let kernel = kern.moe_fk1?;
    let page = 3 * d * 2;
    let pages = (kern.moe_fk1_smem as usize / page).min(FK1_MAX_PAGES) / FFN1_WARPS * FFN1_WARPS;
    (pages >= FFN1_MIN_PAGES && pages * page >= FFN1_WARPS * d * 4).then_some(Ffn1 {
        kernel,
        smem: (pages * page) as u32,
        pages,
        page,
    })
}

/// A decode step's MoE layer in three launches (`moe_*_dec` in `kernels/moe.cu`): routing
/// (with an RMSNorm queued just before whose output is `x` folded in) and the plan; the
/// experts' gate/up products with SiLU, shared experts included; the down products weighted
/// and summed into `out`. A residual add of `out` queued next folds into the last launch
/// ([`fold_add`]).
#[allow(clippy::too_many_arguments)]
fn forward_decode(
    be: &CudaBackend,
    layer: &MoeLayer<CudaWeight>,
    st: &MoeDevice,
    gate: &CudaWeight,
    x: &CudaBuf,
    n: usize,
    d: usize,
    inter: usize,
    (n_shared, shared): (usize, [u64; 3]),
    out: &mut CudaBuf,
) -> Result<()> {
    let inner = &be.inner;
    let cfg = &layer.cfg;
    let (e, k) = (cfg.n_experts, cfg.top_k);
    let act = inner.act();
    let kern = &inner.module.deepseek[match act {
        Act::F32 => 0,
        Act::Bf16 => 1,
    }];
    if out.device_len() == n * d {
        inner.drop_zeroing(out.ptr(), out.device_len() * act.size());
    }
    // An RMSNorm just queued that writes `x` (and adds nothing): the routing kernel does it.
    let mut norm = None;
    if inner.opts.fuse {
        let rms = inner.module.act(act).rms_norm;
        norm = inner.queue().take_norm(rms, x.ptr(), d, n);
    }
    let score = match cfg.score {
        ScoreFunc::Sigmoid => 0u64,
        ScoreFunc::Softmax => 1,
        ScoreFunc::SqrtSoftplus => 2,
    };
    let (src, gain, eps) = norm.unwrap_or((x.ptr(), 0, 0));
    let grouped = cfg.n_group > 1 && cfg.topk_group < cfg.n_group;
    if n == 1 && !grouped {
        let ffn1 = ffn1_fits(inner, st, d, inter, e, k, n_shared);
        // moe_ffn1's and moe_fk1's first parameters: they differ in the buffer between the
        // launch's phases (index 6), the expert address table and the shared down matrix
        let first = |buf: u64, ptrs: u64, shared_down: u64, f: &Ffn1| {
            vec![
                out.ptr(),
                0,
                x.ptr(),
                src,
                gain,
                eps,
                buf,
                st.logits.ptr,
                st.counter.ptr + 4,
                st.totals.ptr,
                st.last.ptr,
                gate.ptr(),
                gate.wtype as u64,
                gate.row_bytes as u64,
                st.bias.as_ref().map_or(0, |b| b.ptr),
                ptrs,
                shared[0],
                shared[1],
                shared_down,
                d as u64,
                e as u64,
                k as u64,
                n_shared as u64,
                inter as u64,
                score,
                cfg.norm_topk_prob as u64,
                cfg.scaling.to_bits() as u64,
                f.pages as u64,
                f.page as u64,
            ]
        };
        let blocks = ffn1_blocks(inner, e);
        let launch = |f: &Ffn1, args: Vec<u64>| Op::Launch {
            kernel: f.kernel,
            grid: [blocks as u32, 1, 1],
            block: MOE_FFN1_THREADS,
            smem: f.smem,
            args,
        };
        if let (Some(_), Some(f), Some(sp)) = (&ffn1, fk1_fits(inner, st, d), &st.split) {
            // the blocks' partial sums of the output
            let part = inner.scratch(blocks * d, 4)?;
            let mut args = first(part.ptr(), sp.ptrs.ptr, sp.shared_downt, &f);
            // the next launch's weights: none until `link_next_weights` finds them
            debug_assert_eq!(args.len(), FK1_L2);
            args.resize(FK1_ARGS, 0);
            let mut q = inner.queue();
            q.push(launch(&f, args));
            q.stats.fk1_launches += 1;
            drop(q);
            layer.count_device_step();
            return Ok(());
        }
        if let Some(f) = ffn1 {
            if st.act.bytes < (k + n_shared) * inter * 2 {
                return Err(Error::Cuda(format!(
                    "moe_ffn1: the layer's buffer for {} slots of {inter} values holds {} bytes",
                    k + n_shared,
                    st.act.bytes
                )));
            }
            let mut args = first(st.act.ptr, st.ptrs.ptr, shared[2], &f);
            // the products after and before the layer: none until a pass folds one in
            // (fold_next_norm_gemv, fold_prev_acc_gemv)
            debug_assert_eq!(args.len(), FFN1_NEXT);
            args.resize(FFN1_ARGS, 0);
            args[FFN1_L2] = inner.opts.ffn1_l2 as u64;
            let mut q = inner.queue();
            q.push(launch(&f, args));
            q.stats.ffn1_launches += 1;
            q.stats.ffn1_blocks = blocks as u64;
            drop(q);
            layer.count_device_step();
            return Ok(());
        }
    }
    let logits = inner.scratch(n * e, 4)?;
    // the slot table the three launches pass on
    let slots = e.min(n * k);
    let slot_ptr = inner.scratch(slots * 3, 8)?;
    let slot_cnt = inner.scratch(slots, 4)?;
    let slot_tok = inner.scratch(slots * DEC_MAX_TOKENS, 4)?;
    let slot_wt = inner.scratch(slots * DEC_MAX_TOKENS, 4)?;
    // Up to 64 experts: one cluster of blocks of 8 experts (the portable cluster size).
    let cluster = e.div_ceil(DEC_EXPERTS_PER_CLUSTER_BLOCK);
    let clustered = inner.opts.ds2.cluster && inner.module.clusters && cluster <= 8;
    // the kernels' token bound: 1, or up to DEC_MAX_TOKENS
    let ti = usize::from(n > 1);
    let args = vec![
        logits.ptr(),
        st.counter.ptr,
        slot_ptr.ptr(),
        slot_cnt.ptr(),
        slot_tok.ptr(),
        slot_wt.ptr(),
        st.totals.ptr,
        st.last.ptr,
        x.ptr(),
        src,
        gain,
        eps,
        gate.ptr(),
        gate.wtype as u64,
        gate.row_bytes as u64,
        st.bias.as_ref().map_or(0, |b| b.ptr),
        st.ptrs.ptr,
        d as u64,
        e as u64,
        k as u64,
        n as u64,
        score,
        cfg.n_group as u64,
        cfg.topk_group as u64,
        cfg.norm_topk_prob as u64,
        cfg.scaling.to_bits() as u64,
        slots as u64,
        inner.opts.ds2.route as u64,
    ];
    // the one-token routing in fewer steps, where its bounds allow
    let lean = inner.opts.ds2.route1
        && n == 1
        && e <= 64
        && k <= 32
        && d.is_multiple_of(8)
        && d <= 2048
        && !grouped;
    let ki = if lean { 2 } else { ti };
    if clustered {
        inner.push(Op::Cluster {
            kernel: if lean {
                kern.moe_route1c
            } else {
                kern.moe_route_decc[ti]
            },
            grid: [cluster as u32, 1, 1],
            block: DEC_THREADS,
            cluster: cluster as u32,
            smem: if inner.opts.ds2.own_sm {
                kern.route_own_smem[ki]
            } else {
                0
            },
            args,
        });
    } else {
        launch(
            inner,
            kern.moe_route_dec,
            [e.div_ceil(DEC_EXPERTS_PER_BLOCK) as u32, 1, 1],
            DEC_THREADS,
            args,
        );
    }
    let per_slot = if n > 1 { DEC_MAX_TOKENS } else { 1 };
    let h = inner.scratch((slots + n_shared) * per_slot * inter, act.size())?;
    // row chunks a slot; with `gu_wave` (one token) the blocks of one wave (`gu_wave` an SM) take
    // them in turn
    let mut chunks_y = inter.div_ceil(DEC_ROWS);
    let wave = inner.opts.ds2.gu_wave as usize;
    if wave > 0 && n == 1 {
        chunks_y = chunks_y.min((wave * inner.module.sms / (slots + n_shared)).max(1));
    }
    launch(
        inner,
        kern.moe_gu_dec[st.wi][ti],
        [(slots + n_shared) as u32, chunks_y as u32, 1],
        DEC_THREADS,
        vec![
            h.ptr(),
            x.ptr(),
            src,
            gain,
            eps,
            slot_ptr.ptr(),
            slot_cnt.ptr(),
            slot_tok.ptr(),
            shared[0],
            shared[1],
            slots as u64,
            n_shared as u64,
            n as u64,
            d as u64,
            inter as u64,
            inner.opts.ds2.shared as u64,
        ],
    );
    // threads: the 16-byte chunks of an expert row, at least 64, at most 256
    let chunks = inter / if st.wi == 0 { 4 } else { 8 };
    // (and at least one per routed slot: each loads its slot's table entry)
    let threads = chunks
        .max(slots)
        .next_multiple_of(32)
        .clamp(64, DEC_THREADS as usize) as u32;
    launch(
        inner,
        kern.moe_down_dec[st.wi][ti],
        [d.div_ceil(DEC_ROWS) as u32, 1, 1],
        threads,
        vec![
            out.ptr(),
            0,
            h.ptr(),
            slot_ptr.ptr(),
            slot_cnt.ptr(),
            slot_tok.ptr(),
            slot_wt.ptr(),
            shared[2],
            slots as u64,
            n_shared as u64,
            n as u64,
            d as u64,
            inter as u64,
            inner.opts.ds2.down_prefetch as u64,
            // the next kernel's weights to ask into L2 (see `link_next_weights`)
            0,
            0,
            0,
            0,
        ],
    );
    layer.count_device_step();
    Ok(())
}

/// Folds `res += y` (`len` values) into the decode down-projection just queued when it alone
/// writes `y` (all of it); true when it did.
pub(crate) fn fold_add(inner: &Arc<Inner>, res: u64, y: u64, len: usize) -> bool {
    if !(inner.opts.fuse && inner.opts.fuse_add) {
        return false;
    }
    let mut q = inner.queue();
    let Some(Op::Launch { kernel, args, .. }) = q.last_mut() else {
        return false;
    };
    // The kernels take out, res, then a buffer `res` must not be: moe_down_dec's arguments
    // are out, res, h, ..., n (10), d (11), inter, early, then the prefetch ranges; moe_ffn1's
    // and moe_fk1's out, res, the normalized row, ..., d (19) (each reads its input before any
    // block writes `res`, grid-wide counters in between, so `res` may be that input).
    let values = if is_down_dec(&inner.module, *kernel, args) {
        args[10] * args[11]
    } else if (inner.module.deepseek[1].moe_ffn1 == Some(*kernel) && args.len() == FFN1_ARGS)
        || (inner.module.deepseek[1].moe_fk1 == Some(*kernel) && args.len() == FK1_ARGS)
    {
        args[19]
    } else {
        return false;
    };
    if args[0] == y && args[1] == 0 && values as usize == len && res != y && res != args[2] {
        args[1] = res;
        return true;
    }
    false
}

/// Parameters of `moe_ffn1`: out, res, ..., page (28), then the folded products' from
/// [`FFN1_NEXT`] and [`FFN1_PREV`], then [`FFN1_L2`], then [`FFN1_NEXT_L2`]'s.
const FFN1_ARGS: usize = 52;
/// Where `moe_ffn1`'s two (address, bytes) ranges of the next launch's weights start, which
/// its warps ask into L2 (`link_next_weights`; zero: none).
const FFN1_NEXT_L2: usize = 48;
/// Where `moe_ffn1`'s last parameter is: how it asks L2 for its shared down rows
/// (`CudaOptions::ffn1_l2`).
const FFN1_L2: usize = 47;
/// Where `moe_ffn1`'s parameters of the product after the layer start: three (weight, output,
/// rows) segments as the GEMVs take them, the norm's gain and eps, the norm's output.
const FFN1_NEXT: usize = 29;
/// Most rows of that product a block of `moe_ffn1` takes (two a ring page).
const FFN1_NEXT_ROWS: usize = 64;
/// Where `moe_ffn1`'s parameters of the product before the layer start: weight, input,
/// output, the residual stream it adds into, rows, columns.
const FFN1_PREV: usize = 41;
/// Widest input of that product (`moe_ffn1` stages it in its 2,048 floats of `hs`).
const FFN1_PREV_MAX_K: usize = 2048;

/// `CudaOptions::ffn1_next`: a `moe_ffn1` launch adding into the residual stream, directly
/// followed by a one-token staged GEMV (`gemvp*` NORM, bf16 rows as wide as the layer's) whose
/// folded RMSNorm reads that stream, takes the GEMV in (the GEMV's op is removed): the next
/// layer's q/kv_a product then streams its weights while the layer's down rows finish. Run on
/// a pass before it executes; the same pass gives the same ops, so captured graphs still
/// match. Returns how many it folded.
pub(crate) fn fold_next_norm_gemv(ops: &mut Vec<Op>, m: &Module) -> u64 {
    let Some(ffn1) = m.deepseek[1].moe_ffn1 else {
        return 0;
    };
    let norm_kernels = [m.bf16.gemvp.map(|k| k[1]), m.bf16.gemvp_wide.map(|k| k[1])];
    let mut folded = 0;
    let mut i = 1;
    while i < ops.len() {
        let (a, b) = ops.split_at_mut(i);
        let (
            Some(Op::Launch {
                kernel, grid, args, ..
            }),
            Some(Op::Gemv(g)),
        ) = (a.last_mut(), b.first())
        else {
            i += 1;
            continue;
        };
        let fits = *kernel == ffn1
            && args.len() == FFN1_ARGS
            && args[FFN1_NEXT..FFN1_PREV].iter().all(|&v| v == 0)
            && norm_kernels.contains(&Some(g.kernel))
            && g.wtype == WType::Bf16
            && g.res == 0
            && !g.swiglu
            && g.p.n == 1
            && g.p.k as u64 == args[19]
            && g.p.row_bytes == 2 * g.p.k
            && (1..=GEMV_SEGMENTS).contains(&g.p.segs.len())
            && g.p.segs.iter().map(|s| s.2).sum::<usize>() <= FFN1_NEXT_ROWS * grid[0] as usize;
        let Some((_, gain, eps)) = g.norm.filter(|nm| fits && args[1] != 0 && nm.0 == args[1])
        else {
            i += 1;
            continue;
        };
        // The product runs after every block has passed its last read and write of the
        // layer's buffers (the second grid-wide count) but the residual stream's, which it
        // reads: its outputs may be any buffer of the layer's (the pool hands freed ones on)
        // but that one.
        if g.p.segs.iter().any(|s| s.1 == args[1]) || g.p.x == args[1] {
            i += 1;
            continue;
        }
        for (j, &(w, y, rows)) in g.p.segs.iter().enumerate() {
            args[FFN1_NEXT + j] = w;
            args[FFN1_NEXT + 3 + j] = y;
            args[FFN1_NEXT + 6 + j] = rows as u64;
        }
        args[FFN1_NEXT + 9] = gain;
        args[FFN1_NEXT + 10] = eps as u64;
        args[FFN1_NEXT + 11] = g.p.x;
        ops.remove(i);
        folded += 1;
        i += 1;
    }
    folded
}

/// `CudaOptions::ffn1_prev`: a one-token staged GEMV adding into the residual stream (`gemvp*`
/// residual add, bf16 rows: the attention's o product) directly followed by a `moe_ffn1`
/// launch whose folded RMSNorm reads that stream is taken into the launch (the GEMV's op is
/// removed): the launch's warps copy the product's rows first, before their programmatic wait,
/// compute them with `gemvp`'s sums in its order and meet at a grid-wide count before the
/// routing reads the stream. Run on a pass before it executes (before
/// [`fold_next_norm_gemv`]); returns how many it folded.
pub(crate) fn fold_prev_acc_gemv(ops: &mut Vec<Op>, m: &Module) -> u64 {
    let Some(ffn1) = m.deepseek[1].moe_ffn1 else {
        return 0;
    };
    let acc_kernels = [m.bf16.gemvp.map(|k| k[2]), m.bf16.gemvp_wide.map(|k| k[2])];
    let mut folded = 0;
    let mut i = 1;
    while i < ops.len() {
        let (a, b) = ops.split_at_mut(i);
        let (Some(Op::Gemv(g)), Some(Op::Launch { kernel, args, .. })) = (a.last(), b.first_mut())
        else {
            i += 1;
            continue;
        };
        let fits = *kernel == ffn1
            && args.len() == FFN1_ARGS
            && args[FFN1_PREV..FFN1_L2].iter().all(|&v| v == 0)
            && acc_kernels.contains(&Some(g.kernel))
            && g.wtype == WType::Bf16
            && g.norm.is_none()
            && !g.swiglu
            && g.p.n == 1
            && g.p.segs.len() == 1
            && g.p.k.is_multiple_of(8)
            && (8..=FFN1_PREV_MAX_K).contains(&g.p.k)
            && g.p.row_bytes == 2 * g.p.k
            // two rows a ring page
            && 2 * g.p.row_bytes as u64 <= args[28];
        if !fits {
            i += 1;
            continue;
        }
        // The stream the product adds into is the one the layer's RMSNorm reads (`src`, with
        // a gain), all `d` rows of it; the product writes only its output and that stream
        // before the grid meets, and its input must be neither.
        let (w, y, rows) = g.p.segs[0];
        if g.res == 0
            || g.res != args[3]
            || args[4] == 0
            || rows as u64 != args[19]
            || y == g.res
            || g.p.x == g.res
            || g.p.x == y
        {
            i += 1;
            continue;
        }
        let (x, res, k) = (g.p.x, g.res, g.p.k);
        args[FFN1_PREV] = w;
        args[FFN1_PREV + 1] = x;
        args[FFN1_PREV + 2] = y;
        args[FFN1_PREV + 3] = res;
        args[FFN1_PREV + 4] = rows as u64;
        args[FFN1_PREV + 5] = k as u64;
        ops.remove(i - 1);
        folded += 1;
    }
    folded
}

/// Parameters of `moe_down_dec`: out, res, h, the slot table (4), shared down, n_routed,
/// n_shared, n, d, inter, early, then (pf0, pf0_bytes, pf1, pf1_bytes) from 14.
const DOWN_ARGS: usize = 18;

/// Whether `kernel` with `args` is a `moe_down_dec` launch (its [`DOWN_ARGS`] arguments).
fn is_down_dec(m: &Module, kernel: KernelId, args: &[u64]) -> bool {
    args.len() == DOWN_ARGS
        && m.deepseek
            .iter()
            .flat_map(|k| k.moe_down_dec.iter().flatten())
            .any(|&k| k == kernel)
}

/// Gives a launch directly followed by a one-token GEMV of staged rows (`gemvp*`: the next
/// layer's q/kv_a) that GEMV's first two weight segments, which the launch asks into L2 at its
/// end, since the GEMV's blocks cannot be resident (and start their copies) until the launch's
/// leave: with `down_dec` (`Ds2::next_l2`) a decode down projection followed by an 8-row staged
/// GEMV, as its blocks finish; with `fk1` (`CudaOptions::fk1_l2`) a `moe_fk1` launch followed by
/// any staged GEMV, once its blocks' units are done; with `ffn1` (`CudaOptions::ffn1_next_l2`) a
/// `moe_ffn1` launch with no product folded in after it, followed by any staged GEMV, as its
/// warps finish their down rows. Run on a pass before it executes; the same pass gives the
/// same arguments, so captured graphs still match. Returns how many launches it linked.
pub(crate) fn link_next_weights(
    ops: &mut [Op],
    m: &Module,
    down_dec: bool,
    fk1: bool,
    ffn1: bool,
) -> u64 {
    let mut linked = 0;
    let among = |set: Option<[KernelId; 3]>, k: KernelId| set.is_some_and(|s| s.contains(&k));
    for i in 1..ops.len() {
        let (a, b) = ops.split_at_mut(i);
        let (Some(Op::Launch { kernel, args, .. }), Some(Op::Gemv(g))) = (a.last_mut(), b.first())
        else {
            continue;
        };
        // any staged GEMV, 8-row or wide blocks
        let staged = among(m.bf16.gemvp, g.kernel) || among(m.bf16.gemvp_wide, g.kernel);
        // where the launch's two (address, bytes) ranges start
        let at = if down_dec && is_down_dec(m, *kernel, args) && among(m.bf16.gemvp, g.kernel) {
            14
        } else if fk1 && staged && m.deepseek[1].moe_fk1 == Some(*kernel) && args.len() == FK1_ARGS
        {
            FK1_L2
        } else if ffn1
            && staged
            && m.deepseek[1].moe_ffn1 == Some(*kernel)
            && args.len() == FFN1_ARGS
            && args[FFN1_NEXT..FFN1_PREV].iter().all(|&v| v == 0)
        {
            FFN1_NEXT_L2
        } else {
            continue;
        };
        for (j, seg) in g.p.segs.iter().take(2).enumerate() {
            args[at + 2 * j] = seg.0;
            args[at + 1 + 2 * j] = (seg.2 * g.p.row_bytes) as u64;
        }
        linked += 1;
    }
    linked
}

/// The layer's load counters: the device's when it ran there, else the host's.
pub(crate) fn load(inner: &Arc<Inner>, layer: &MoeLayer<CudaWeight>) -> Result<ExpertLoad> {
    let host = layer.load();
    let Some(st) = layer
        .device
        .get()
        .and_then(|b| b.downcast_ref::<MoeDevice>())
    else {
        return Ok(host);
    };
    inner.flush()?;
    let e = layer.cfg.n_experts;
    let mut totals = vec![0u8; e * 8];
    let mut last = vec![0u8; e * 4];
    let stream = inner.stream.cu_stream();
    // SAFETY: both allocations hold these many bytes; the copies are ordered after the queued
    // work and complete once the stream is synchronized.
    unsafe {
        cudarc::driver::result::memcpy_dtoh_async(totals.as_mut_slice(), st.totals.ptr, stream)
            .map_err(|e| cuda_err("copy to host", e))?;
        cudarc::driver::result::memcpy_dtoh_async(last.as_mut_slice(), st.last.ptr, stream)
            .map_err(|e| cuda_err("copy to host", e))?;
    }
    inner.sync()?;
    let dev_total: Vec<u64> = totals
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect();
    let dev_last: Vec<u64> = last
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as u64)
        .collect();
    Ok(ExpertLoad {
        total: host
            .total
            .iter()
            .zip(&dev_total)
            .map(|(a, b)| a + b)
            .collect(),
        last_step: dev_last,
        steps: host.steps,
    })
}
