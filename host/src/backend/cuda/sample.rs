//! Candidate selection on the device (`kernels/sample.cu`): argmax and top-K of logits rows,
//! so that only ids and a few values cross to the host.

use std::sync::Arc;

use cudarc::driver::result;

use super::device::cuda_err;
use super::queue::Op;
use super::{CudaBuf, Inner};
use crate::error::{Error, Result};

/// Largest K the top-K kernel takes (`TOPK_MAX`).
pub const TOPK_MAX: usize = 1024;

/// Rows the kernel runs over (a padded step's padding rows included, so the launch is the
/// same for every batch of a bucket and joins its graph) and rows returned.
fn rows_of(x: &CudaBuf, width: usize) -> Result<(usize, usize)> {
    if width == 0 {
        return Err(Error::BadRequest("row width 0".into()));
    }
    Ok((x.len / width, x.host_len / width))
}

/// Queues a copy of `n` values of `T` at `ptr` into `v` (the caller synchronizes once).
fn download_into<T>(inner: &Inner, ptr: u64, v: &mut [T]) -> Result<()> {
    // SAFETY: `ptr` holds `v.len()` values of `T` written by the queued kernel; the copy is
    // ordered after it on the stream, and the caller keeps `v` alive and untouched until the
    // stream is synchronized.
    unsafe { result::memcpy_dtoh_async(v, ptr, inner.stream.cu_stream()) }
        .map_err(|e| cuda_err("copy to host", e))
}

pub(crate) fn download<T: Default + Clone>(inner: &Inner, ptr: u64, n: usize) -> Result<Vec<T>> {
    let mut v = vec![T::default(); n];
    download_into(inner, ptr, &mut v)?;
    inner.sync()?;
    Ok(v)
}

pub(crate) fn argmax_rows(inner: &Arc<Inner>, x: &CudaBuf, width: usize) -> Result<Vec<u32>> {
    let (dev_rows, rows) = rows_of(x, width)?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    let out = inner.scratch(dev_rows, 4)?;
    inner.push(Op::Launch {
        kernel: inner.module.act(inner.act()).argmax,
        grid: [dev_rows as u32, 1, 1],
        block: 1024,
        smem: 0,
        args: vec![out.ptr(), x.ptr(), width as u64],
    });
    inner.flush()?;
    download(inner, out.ptr(), rows)
}

pub(crate) fn top_k_rows(
    inner: &Arc<Inner>,
    x: &CudaBuf,
    width: usize,
    k: usize,
) -> Result<Vec<Vec<(u32, f32)>>> {
    let (dev_rows, rows) = rows_of(x, width)?;
    let k = k.min(width);
    if k > TOPK_MAX {
        return Err(Error::BadRequest(format!(
            "top-K of {k} exceeds the device limit {TOPK_MAX}"
        )));
    }
    if rows == 0 || k == 0 {
        return Ok(vec![Vec::new(); rows]);
    }
    let ids = inner.scratch(dev_rows * k, 4)?;
    let vals = inner.scratch(dev_rows * k, 4)?;
    inner.push(Op::Launch {
        kernel: inner.module.act(inner.act()).topk,
        grid: [dev_rows as u32, 1, 1],
        block: 1024,
        smem: 0,
        args: vec![ids.ptr(), vals.ptr(), x.ptr(), width as u64, k as u64],
    });
    inner.flush()?;
    // Both copies queued, one wait.
    let mut i = vec![0u32; rows * k];
    let mut v = vec![0f32; rows * k];
    download_into(inner, ids.ptr(), &mut i)?;
    download_into(inner, vals.ptr(), &mut v)?;
    inner.sync()?;
    Ok(i.chunks(k)
        .zip(v.chunks(k))
        .map(|(i, v)| i.iter().copied().zip(v.iter().copied()).collect())
        .collect())
}
