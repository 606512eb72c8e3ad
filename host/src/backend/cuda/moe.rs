//! Mixture-of-experts layers on the device (`kernels/moe.cu`): routing, a per-expert plan
//! and expert-grouped products, all queued without a host round trip, so a decode step stays
//! one CUDA graph. Each selected expert's gate/up rows are streamed once for all of its tokens
//! (one launch for every selected expert), then its down rows (one launch), then one combine
//! launch weights and sums the outputs with the shared experts'. The load counters are
//! counted on the device and read on demand. It must not know about checkpoints.

use std::sync::Arc;

use super::device::{cuda_err, DevMem};
use super::ops::{check, launch};
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
    let totals = DevMem::alloc(&inner.ctx, e * 8)?;
    totals.zero(&inner.stream)?;
    let last = DevMem::alloc(&inner.ctx, e * 4)?;
    last.zero(&inner.stream)?;
    Ok(MoeDevice {
        ptrs: upload(bytes_of(&ptrs, |p: u64| p.to_le_bytes().to_vec()))?,
        bias,
        totals,
        last,
        wi,
    })
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
    launch(
        inner,
        kern.moe_route,
        [n as u32, 1, 1],
        1024,
        vec![
            ids.ptr(),
            weights.ptr(),
            x.ptr(),
            gate.ptr(),
            gate.wtype as u64,
            gate.row_bytes as u64,
            st.bias.as_ref().map_or(0, |b| b.ptr),
            d as u64,
            e as u64,
            k as u64,
            score,
            cfg.n_group as u64,
            cfg.topk_group as u64,
            cfg.norm_topk_prob as u64,
            cfg.scaling.to_bits() as u64,
        ],
    );
    let offsets = inner.scratch(e + 1, 4)?;
    let rows = inner.scratch(nk, 4)?;
    let active = inner.scratch(e, 4)?;
    let n_active = inner.scratch(1, 4)?;
    launch(
        inner,
        inner.module.moe_plan,
        [1, 1, 1],
        (e.next_multiple_of(32)).clamp(32, 1024) as u32,
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
    launch(
        inner,
        kern.moe_gateup[st.wi][ti],
        [slots, inter.div_ceil(ROWS_PER_BLOCK) as u32, 1],
        (ROWS_PER_BLOCK * 32) as u32,
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
    launch(
        inner,
        kern.moe_down[st.wi][ti],
        [slots, d.div_ceil(ROWS_PER_BLOCK) as u32, 1],
        (ROWS_PER_BLOCK * 32) as u32,
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
        [n as u32, 1, 1],
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
