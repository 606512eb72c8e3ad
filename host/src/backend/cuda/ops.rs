//! Typed launchers of the element-wise and row-wise kernels (`kernels/elementwise.cu`): each
//! checks its buffers' sizes, then queues one launch. A residual add followed by an RMSNorm
//! of the same buffer is fused into one kernel here.

use std::sync::Arc;

use super::queue::{elementwise_grid, Op};
use super::step::CudaStep;
use super::{Act, CudaBuf, CudaWeight, Inner};
use crate::error::{Error, Result};
use crate::ids::TokenId;
use crate::model::hparams::{RopeSpec, RopeStyle};

pub(crate) fn check(what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(Error::BadRequest(format!(
            "{what}: buffer holds {have} values, needs {need}"
        )));
    }
    Ok(())
}

fn f32_bits(v: f32) -> u64 {
    v.to_bits() as u64
}

/// Queues `kernel` without dynamic shared memory.
pub(crate) fn launch(
    inner: &Inner,
    kernel: super::module::KernelId,
    grid: [u32; 3],
    block: u32,
    args: Vec<u64>,
) {
    inner.push(Op::Launch {
        kernel,
        grid,
        block,
        smem: 0,
        args,
    });
}

pub(crate) fn from_host(inner: &Arc<Inner>, values: &[f32]) -> Result<CudaBuf> {
    let act = inner.act();
    let b = inner.scratch(values.len(), act.size())?;
    let data: Vec<u8> = match act {
        Act::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Act::Bf16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
    };
    inner.push(Op::Upload { ptr: b.ptr(), data });
    Ok(b)
}

/// Uploads small host data (token ids, row indices) into a pooled buffer.
pub(crate) fn upload_bytes(inner: &Arc<Inner>, data: Vec<u8>) -> Result<CudaBuf> {
    let b = inner.scratch(data.len(), 1)?;
    inner.push(Op::Upload { ptr: b.ptr(), data });
    Ok(b)
}

pub(crate) fn embed(
    inner: &Arc<Inner>,
    table: &CudaWeight,
    tokens: &[TokenId],
    out: &mut CudaBuf,
) -> Result<()> {
    if tokens.is_empty() {
        return Ok(());
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= table.rows) {
        return Err(Error::BadRequest(format!(
            "token id {t} is outside the vocabulary ({})",
            table.rows
        )));
    }
    check("embed output", out.len, tokens.len() * table.cols)?;
    let k = inner.module.act(inner.act()).embed;
    let data: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    // The step's device copy (padding tokens included when `out` has room for them).
    let (ids, rows) = match step_tokens(inner, &data) {
        Some((ptr, all)) if out.len >= all * table.cols => ((ptr, None), all),
        Some((ptr, _)) => ((ptr, None), tokens.len()),
        None => {
            let b = upload_bytes(inner, data)?;
            ((b.ptr(), Some(b)), tokens.len())
        }
    };
    let block = table.cols.next_power_of_two().clamp(32, 256) as u32;
    launch(
        inner,
        k,
        [rows as u32, 1, 1],
        block,
        vec![
            out.ptr(),
            table.ptr(),
            ids.0,
            table.wtype as u64,
            table.rows as u64,
            table.cols as u64,
            table.row_bytes as u64,
        ],
    );
    Ok(())
}

/// The device copy of the current step's token ids and how many it holds (padding included),
/// when `data` is exactly the batch's ids.
fn step_tokens(inner: &Inner, data: &[u8]) -> Option<(u64, usize)> {
    let g = inner.step_cache.lock().ok()?;
    g.as_ref().and_then(|c| c.tokens_for(data))
}

pub(crate) fn rms_norm(
    inner: &Arc<Inner>,
    x: &CudaBuf,
    w: &CudaWeight,
    eps: f32,
    out: &mut CudaBuf,
) -> Result<()> {
    if w.rows != 1 {
        return Err(Error::BadConfig("rms_norm gain is not a vector".into()));
    }
    let d = w.cols;
    let rows = x.len / d;
    if rows == 0 {
        return Ok(());
    }
    check("rms_norm output", out.len, rows * d)?;
    let k = inner.module.act(inner.act()).rms_norm;
    // Fuse a directly preceding `x += y` into this kernel.
    let mut y = 0u64;
    if inner.opts.fuse {
        let mut q = inner.queue();
        if let Some(Op::Add { x: ax, n, .. }) = q.last_mut() {
            if *ax == x.ptr() && *n == rows * d {
                if let Some(Op::Add { y: ay, .. }) = q.pop() {
                    y = ay;
                }
            }
        }
    }
    let block = if d >= 4096 {
        1024
    } else if d >= 1024 {
        512
    } else {
        256
    };
    launch(
        inner,
        k,
        [rows as u32, 1, 1],
        block,
        vec![out.ptr(), x.ptr(), y, w.ptr(), d as u64, f32_bits(eps)],
    );
    Ok(())
}

pub(crate) fn add_assign(inner: &Arc<Inner>, x: &mut CudaBuf, y: &CudaBuf) -> Result<()> {
    let n = x.len.min(y.len);
    if n > 0
        && !super::moe::fold_add(inner, x.ptr(), y.ptr(), n)
        && !super::mla::fold_add(inner, x.ptr(), y.ptr(), n)
        && !super::matmul::fold_add(inner, x.ptr(), y.ptr(), n)
    {
        let kernel = inner.module.act(inner.act()).add;
        inner.push(Op::Add {
            kernel,
            x: x.ptr(),
            y: y.ptr(),
            n,
        });
    }
    Ok(())
}

pub(crate) fn silu_mul(inner: &Arc<Inner>, gate: &mut CudaBuf, up: &CudaBuf) -> Result<()> {
    let n = gate.len.min(up.len);
    if n > 0 && !super::matmul::fold_silu(inner, gate.ptr(), up.ptr(), n) {
        let k = inner.module.act(inner.act()).silu_mul;
        launch(
            inner,
            k,
            [elementwise_grid(n), 1, 1],
            256,
            vec![gate.ptr(), up.ptr(), n as u64],
        );
    }
    Ok(())
}

pub(crate) fn rope(
    inner: &Arc<Inner>,
    step: &mut CudaStep,
    spec: RopeSpec,
    x: &mut CudaBuf,
    n_heads: usize,
    head_dim: usize,
) -> Result<()> {
    let n = step.n_tokens;
    if n == 0 || spec.dims < 2 {
        return Ok(());
    }
    if spec.dims > head_dim {
        return Err(Error::BadConfig(format!(
            "rope dims {} exceed head_dim {head_dim}",
            spec.dims
        )));
    }
    check("rope input", x.len, n * n_heads * head_dim)?;
    let half = spec.dims / 2;
    let (cs, sn) = step.rope_table(inner, spec)?;
    let style = match spec.style {
        RopeStyle::Interleaved => 0u64,
        RopeStyle::Half => 1,
    };
    let kernels = inner.module.act(inner.act());
    let k = kernels.rope;
    if inner.opts.fuse2 {
        // The queries' rotation just queued with the same table and shape: rotate both at once.
        let mut q = inner.queue();
        if let Some(Op::Launch { kernel, args, .. }) = q.last_mut() {
            if *kernel == k
                && args.len() == 8
                && args[0] != x.ptr()
                && args[1..4] == [cs, sn, n as u64]
                && args[5..8] == [head_dim as u64, half as u64, style]
            {
                let (x1, h1) = (args[0], args[4]);
                q.pop();
                q.push(Op::Launch {
                    kernel: kernels.rope2,
                    grid: [elementwise_grid(n * (h1 as usize + n_heads) * half), 1, 1],
                    block: 256,
                    smem: 0,
                    args: vec![
                        x1,
                        x.ptr(),
                        cs,
                        sn,
                        n as u64,
                        h1,
                        n_heads as u64,
                        head_dim as u64,
                        half as u64,
                        style,
                    ],
                });
                return Ok(());
            }
        }
    }
    let total = n * n_heads * half;
    launch(
        inner,
        k,
        [elementwise_grid(total), 1, 1],
        256,
        vec![
            x.ptr(),
            cs,
            sn,
            n as u64,
            n_heads as u64,
            head_dim as u64,
            half as u64,
            style,
        ],
    );
    Ok(())
}

/// Queues the angle table of `spec` for a step's positions (`cos`, `sin`: [tokens, half]).
pub(crate) fn rope_table(
    inner: &Arc<Inner>,
    positions: u64,
    n: usize,
    spec: RopeSpec,
    cs: &CudaBuf,
    sn: &CudaBuf,
) {
    let half = spec.dims / 2;
    launch(
        inner,
        inner.module.rope_table,
        [elementwise_grid(n * half), 1, 1],
        256,
        vec![
            cs.ptr(),
            sn.ptr(),
            positions,
            n as u64,
            half as u64,
            spec.dims as u64,
            f32_bits(spec.theta),
            f32_bits(spec.scale),
        ],
    );
}

pub(crate) fn gather_rows(
    inner: &Arc<Inner>,
    x: &CudaBuf,
    width: usize,
    rows: &[usize],
    out: &mut CudaBuf,
) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    check("gather_rows output", out.len, rows.len() * width)?;
    if let Some(&r) = rows.iter().find(|&&r| (r + 1) * width > x.len) {
        return Err(Error::BadRequest(format!(
            "gather_rows: row {r} is outside the input"
        )));
    }
    let known = inner
        .step_cache
        .lock()
        .ok()
        .and_then(|g| g.as_ref().and_then(|c| c.rows_for(rows)));
    // A padded step's rows continue with the padding rows, gathered too when both buffers
    // have room for them.
    let (ptr, n_rows, _hold) = match known {
        Some((p, all)) if out.len >= all * width && x.len >= all * width => (p, all, None),
        Some((p, _)) => (p, rows.len(), None),
        None => {
            let data: Vec<u8> = rows
                .iter()
                .flat_map(|&r| (r as i32).to_le_bytes())
                .collect();
            let b = upload_bytes(inner, data)?;
            (b.ptr(), rows.len(), Some(b))
        }
    };
    let k = inner.module.act(inner.act()).gather_rows;
    launch(
        inner,
        k,
        [n_rows as u32, 1, 1],
        256,
        vec![out.ptr(), x.ptr(), ptr, width as u64],
    );
    Ok(())
}

pub(crate) fn to_host(inner: &Arc<Inner>, x: &CudaBuf) -> Result<Vec<f32>> {
    inner.flush()?;
    super::readback::read(inner, x.ptr(), x.host_len)
}
