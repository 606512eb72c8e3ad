//! Weights and KV caches in device memory. Matrices of the types the kernels read directly
//! (F32, F16, BF16, Q4_0, Q4_1, Q8_0) are uploaded byte for byte; other GGUF types are
//! dequantized on the host and uploaded as bf16. Vectors (norm gains) become f32. KV caches are
//! bf16, one K and one V array per layer in the paged layout `[blocks, block_size, kv_heads,
//! head_dim]`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use half::bf16;

use super::device::DevMem;
use super::Inner;
use crate::backend::cpu::quant::dequantize_row;
use crate::backend::KvShape;
use crate::error::{Error, Result};
use crate::tensor::{DType, Weight};

/// Weight element types the kernels read (numbered as `WT_*` in `kernels/common.cuh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WType {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
    Q4_0 = 3,
    Q4_1 = 4,
    Q8_0 = 5,
}

impl WType {
    fn of(d: DType) -> Option<WType> {
        Some(match d {
            DType::F32 => WType::F32,
            DType::F16 => WType::F16,
            DType::BF16 => WType::Bf16,
            DType::Q4_0 => WType::Q4_0,
            DType::Q4_1 => WType::Q4_1,
            DType::Q8_0 => WType::Q8_0,
            _ => return None,
        })
    }

    pub fn is_block(self) -> bool {
        matches!(self, WType::Q4_0 | WType::Q4_1 | WType::Q8_0)
    }
}

/// A weight on the device.
pub struct CudaWeight {
    pub rows: usize,
    pub cols: usize,
    pub wtype: WType,
    pub row_bytes: usize,
    mem: Option<DevMem>,
    inner: Arc<Inner>,
}

impl CudaWeight {
    pub(crate) fn ptr(&self) -> u64 {
        self.mem.as_ref().map_or(0, |m| m.ptr)
    }
}

impl Drop for CudaWeight {
    fn drop(&mut self) {
        if let Some(m) = self.mem.take() {
            self.inner.retire(m);
        }
    }
}

fn upload(inner: &Arc<Inner>, bytes: &[u8]) -> Result<DevMem> {
    let mem = DevMem::alloc(&inner.ctx, bytes.len())?;
    mem.upload(&inner.stream, bytes)?;
    Ok(mem)
}

pub(crate) fn prepare(inner: &Arc<Inner>, w: &Weight) -> Result<CudaWeight> {
    let need = w.rows * w.row_bytes();
    if w.bytes().len() < need {
        return Err(Error::BadRequest(format!(
            "{} weight {}x{} has {} bytes, needs {need}",
            w.dtype,
            w.rows,
            w.cols,
            w.bytes().len()
        )));
    }
    let make = |wtype: WType, row_bytes: usize, mem: DevMem| CudaWeight {
        rows: w.rows,
        cols: w.cols,
        wtype,
        row_bytes,
        mem: Some(mem),
        inner: inner.clone(),
    };
    if w.rows == 1 {
        let mut v = vec![0f32; w.cols];
        dequantize_row(w.dtype, &w.bytes()[..need], &mut v);
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        return Ok(make(WType::F32, 4 * w.cols, upload(inner, &bytes)?));
    }
    if !matches!(w.dtype, DType::BF16 | DType::F16) {
        inner.all_half.store(false, Ordering::Relaxed);
    }
    match WType::of(w.dtype) {
        Some(wt) => Ok(make(wt, w.row_bytes(), upload(inner, &w.bytes()[..need])?)),
        None => {
            let rb = w.row_bytes();
            let mut row = vec![0f32; w.cols];
            let mut bytes = Vec::with_capacity(w.rows * w.cols * 2);
            for r in 0..w.rows {
                dequantize_row(w.dtype, &w.bytes()[r * rb..(r + 1) * rb], &mut row);
                bytes.extend(
                    row.iter()
                        .flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes()),
                );
            }
            Ok(make(WType::Bf16, 2 * w.cols, upload(inner, &bytes)?))
        }
    }
}

/// Paged KV storage on the device (bf16). Each layer's arrays hold one block more than the
/// shape says, in front of block 0: block -1, where the padding rows of a padded decode step
/// (`step::bucket`) write their K/V and attend, so they never touch a real block.
pub struct CudaKv {
    pub shape: KvShape,
    layers: Vec<(DevMem, DevMem)>,
    /// Bytes of one block (the offset of block 0 in each array).
    block_bytes: u64,
    inner: Arc<Inner>,
}

impl CudaKv {
    /// Device pointers of block 0 of layer `l`'s K and V arrays.
    pub(crate) fn layer(&self, l: usize) -> Option<(u64, u64)> {
        self.layers
            .get(l)
            .map(|(k, v)| (k.ptr + self.block_bytes, v.ptr + self.block_bytes))
    }
}

impl Drop for CudaKv {
    fn drop(&mut self) {
        for (k, v) in self.layers.drain(..) {
            self.inner.retire(k);
            drop(v);
        }
    }
}

pub(crate) fn new_kv(inner: &Arc<Inner>, s: KvShape) -> Result<CudaKv> {
    let block_bytes = s.block_size * s.kv_heads * s.head_dim * 2;
    let bytes = (s.num_blocks + 1) * block_bytes;
    let mut layers = Vec::with_capacity(s.layers);
    for _ in 0..s.layers {
        let k = DevMem::alloc(&inner.ctx, bytes)?;
        let v = DevMem::alloc(&inner.ctx, bytes)?;
        k.zero(&inner.stream)?;
        v.zero(&inner.stream)?;
        layers.push((k, v));
    }
    Ok(CudaKv {
        shape: s,
        layers,
        block_bytes: block_bytes as u64,
        inner: inner.clone(),
    })
}
