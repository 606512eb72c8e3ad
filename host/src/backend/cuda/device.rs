//! Device memory: raw allocations that free themselves, and the pool that recycles activation
//! buffers. The pool always hands out the lowest free address of a size class, so a forward
//! pass that asks for the same sizes in the same order gets the same addresses every time:
//! that is what lets a captured CUDA graph be replayed. It owns memory, never kernels.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaStream};

use crate::error::{Error, Result};

pub(crate) fn cuda_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("{what}: {e:?}"))
}

/// One device allocation, freed on drop.
pub(crate) struct DevMem {
    pub ptr: u64,
    pub bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DevMem {
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DevMem> {
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        // SAFETY: a plain device allocation of `bytes.max(1)` bytes; the pointer is owned by
        // the returned value and freed exactly once in `drop`.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(|e| cuda_err(&format!("allocating {bytes} bytes of device memory"), e))?;
        Ok(DevMem {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }

    /// Copies host bytes to the start of this allocation on `stream` and waits for the copy.
    /// (The legacy default stream does not order against the backend's non-blocking stream,
    /// so every write goes through that stream.)
    pub fn upload(&self, stream: &CudaStream, data: &[u8]) -> Result<()> {
        if data.len() > self.bytes {
            return Err(Error::Cuda(format!(
                "upload of {} bytes into {} bytes",
                data.len(),
                self.bytes
            )));
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        // SAFETY: `data.len()` bytes fit in this allocation (checked above); the host data
        // outlives the copy, which is complete when `synchronize` returns.
        unsafe { result::memcpy_htod_async(self.ptr, data, stream.cu_stream()) }
            .map_err(|e| cuda_err("copying to the device", e))?;
        stream
            .synchronize()
            .map_err(|e| cuda_err("synchronizing the stream", e))
    }

    /// Fills the allocation with zero bytes on `stream` and waits.
    pub fn zero(&self, stream: &CudaStream) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        // SAFETY: the range is this allocation.
        unsafe { result::memset_d8_async(self.ptr, 0, self.bytes, stream.cu_stream()) }
            .map_err(|e| cuda_err("clearing device memory", e))?;
        stream
            .synchronize()
            .map_err(|e| cuda_err("synchronizing the stream", e))
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `malloc_sync` and is freed only here. Callers make sure no
        // queued work still uses it (the backend flushes and synchronizes before freeing).
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Size class of an allocation: rounded up to an eighth of the largest power of two not above
/// it (at most 12.5% waste), at least 256 bytes.
pub(crate) fn size_class(bytes: usize) -> usize {
    let b = bytes.max(256);
    let p = 1usize << (usize::BITS - 1 - b.leading_zeros());
    let step = (p / 8).max(256);
    b.div_ceil(step) * step
}

/// Free allocations by size class.
#[derive(Default)]
pub(crate) struct Pool {
    free: HashMap<usize, Vec<DevMem>>,
}

impl Pool {
    /// An allocation of at least `bytes`: the lowest-addressed free one of its class, else new.
    pub fn take(&mut self, ctx: &Arc<CudaContext>, bytes: usize) -> Result<DevMem> {
        let class = size_class(bytes);
        if let Some(list) = self.free.get_mut(&class) {
            if let Some(i) = (0..list.len()).min_by_key(|&i| list[i].ptr) {
                return Ok(list.swap_remove(i));
            }
        }
        DevMem::alloc(ctx, class)
    }

    pub fn give(&mut self, mem: DevMem) {
        self.free
            .entry(size_class(mem.bytes))
            .or_default()
            .push(mem);
    }

    /// Frees every held allocation (the caller has synchronized the stream).
    pub fn release_all(&mut self) {
        self.free.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_round_up_within_an_eighth() {
        assert_eq!(size_class(1), 256);
        assert_eq!(size_class(256), 256);
        assert_eq!(size_class(257), 512);
        for b in [1000usize, 4096, 4097, 123_456, 10_000_000, 470_000_000] {
            let c = size_class(b);
            assert!(c >= b && (c - b) * 8 <= c, "{b} -> {c}");
            assert_eq!(size_class(c), c, "a class is its own class");
        }
    }
}
