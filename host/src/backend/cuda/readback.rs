//! Device-to-host reads of activation buffers. Small reads go straight into the result; large
//! ones (a batch's logits) go through a pinned staging buffer, which the copy engine fills at
//! full speed, and are converted to f32 by several threads.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, CudaContext};

use super::device::cuda_err;
use super::{Act, Inner};
use crate::error::Result;

/// Reads of at least this many elements are staged.
const STAGE_MIN: usize = 1 << 20;

/// Page-locked host memory, freed on drop.
pub(crate) struct Pinned {
    ptr: *mut c_void,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain host memory, used only under the backend's mutex.
unsafe impl Send for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `malloc_host` and is freed only here, after every copy into
        // it was waited for.
        let _ = unsafe { result::free_host(self.ptr) };
    }
}

fn convert(act: Act, src: &[u8], dst: &mut [f32]) {
    match act {
        Act::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        Act::Bf16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f32::from_bits((u16::from_le_bytes([s[0], s[1]]) as u32) << 16);
            }
        }
    }
}

/// The first `n` activations at device address `ptr` as f32 (queued work must be flushed).
pub(crate) fn read(inner: &Inner, ptr: u64, n: usize) -> Result<Vec<f32>> {
    let act = inner.act();
    let bytes = n * act.size();
    let stream = inner.stream.cu_stream();
    let mut out = vec![0f32; n];
    if n < STAGE_MIN {
        let mut raw = vec![0u8; bytes];
        // SAFETY: `ptr` holds `bytes` bytes; the copy is ordered after the queued work and
        // complete once the stream is synchronized.
        unsafe { result::memcpy_dtoh_async(raw.as_mut_slice(), ptr, stream) }
            .map_err(|e| cuda_err("copy to host", e))?;
        inner.sync()?;
        convert(act, &raw, &mut out);
        return Ok(out);
    }
    let mut guard = inner.pinned.lock().unwrap_or_else(|p| p.into_inner());
    if guard.as_ref().is_none_or(|p| p.bytes < bytes) {
        *guard = None;
        inner
            .ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        // SAFETY: a fresh page-locked allocation owned by the returned `Pinned`.
        let p = unsafe { result::malloc_host(bytes, 0) }
            .map_err(|e| cuda_err("allocating pinned memory", e))?;
        *guard = Some(Pinned {
            ptr: p,
            bytes,
            ctx: inner.ctx.clone(),
        });
    }
    let pinned = guard.as_ref().map_or(std::ptr::null_mut(), |p| p.ptr);
    // SAFETY: the pinned buffer holds at least `bytes` bytes and is not used by anyone else
    // while the mutex is held.
    let staged: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(pinned as *mut u8, bytes) };
    // SAFETY: as above; the copy completes before `sync` returns.
    unsafe { result::memcpy_dtoh_async(&mut *staged, ptr, stream) }
        .map_err(|e| cuda_err("copy to host", e))?;
    inner.sync()?;
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .clamp(1, 16);
    let per = n.div_ceil(threads);
    let es = act.size();
    std::thread::scope(|s| {
        for (dst, src) in out.chunks_mut(per).zip(staged.chunks(per * es)) {
            s.spawn(move || convert(act, src, dst));
        }
    });
    Ok(out)
}
