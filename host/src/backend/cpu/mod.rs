//! The CPU backend: multi-threaded kernels with SIMD paths chosen at run time.

pub mod attention;
pub mod kv;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod quant;

use std::sync::Arc;

use super::{AttnParams, Backend, KvShape};
use crate::error::{Error, Result};
use crate::ids::TokenId;
use crate::model::batch::Batch;
use crate::model::hparams::RopeSpec;
use crate::tensor::Weight;
use kv::PagedKv;
use ops::RopeTable;
use pool::ThreadPool;

/// The CPU backend: a thread pool and the kernels of this module.
#[derive(Clone)]
pub struct CpuBackend {
    pool: Arc<ThreadPool>,
}

impl CpuBackend {
    pub fn new(threads: usize) -> CpuBackend {
        CpuBackend { pool: Arc::new(ThreadPool::new(threads.max(1))) }
    }

    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }
}

/// A weight on the CPU: the (possibly quantized) matrix as loaded, plus an f32 copy of
/// vectors (norm gains), which are tiny and read whole.
pub struct CpuWeight {
    pub w: Weight,
    vector: Option<Vec<f32>>,
}

/// A step's layout on the CPU: the batch and its rope tables, built on first use.
pub struct CpuStep {
    batch: Batch,
    positions: Vec<u32>,
    ropes: Vec<RopeTable>,
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Weight = CpuWeight;
    type Kv = PagedKv;
    type Step = CpuStep;

    fn device_name(&self) -> String {
        format!("cpu ({} threads)", self.pool.n_threads())
    }

    fn prepare_weight(&self, w: &Weight) -> Result<CpuWeight> {
        let vector = if w.rows == 1 {
            let mut v = vec![0.0; w.cols];
            quant::dequantize_row(w.dtype, w.bytes(), &mut v);
            Some(v)
        } else {
            None
        };
        Ok(CpuWeight { w: w.clone(), vector })
    }

    fn zeros(&self, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    fn new_kv(&self, s: KvShape) -> Result<PagedKv> {
        Ok(PagedKv::new(s.layers, s.num_blocks, s.block_size, s.kv_heads, s.head_dim))
    }

    fn prepare_step(&self, batch: &Batch, _block_size: usize) -> Result<CpuStep> {
        Ok(CpuStep { batch: batch.clone(), positions: batch.positions(), ropes: Vec::new() })
    }

    fn embed(&self, table: &CpuWeight, tokens: &[TokenId], out: &mut Vec<f32>) -> Result<()> {
        let w = &table.w;
        let (d, row) = (w.cols, w.row_bytes());
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= w.rows {
                return Err(Error::BadRequest(format!("token id {t} is outside the vocabulary ({})", w.rows)));
            }
            let bytes = &w.bytes()[t as usize * row..(t as usize + 1) * row];
            quant::dequantize_row(w.dtype, bytes, &mut out[i * d..(i + 1) * d]);
        }
        Ok(())
    }

    fn matmul(&self, w: &CpuWeight, x: &Vec<f32>, n_tokens: usize, y: &mut Vec<f32>) -> Result<()> {
        matmul::matmul(&self.pool, &w.w, x, n_tokens, y);
        Ok(())
    }

    fn rms_norm(&self, x: &Vec<f32>, w: &CpuWeight, eps: f32, out: &mut Vec<f32>) -> Result<()> {
        let g = w.vector.as_deref().ok_or_else(|| Error::BadConfig("rms_norm gain is not a vector".into()))?;
        let n = x.len() / g.len() * g.len();
        ops::rms_norm(&x[..n], g, eps, &mut out[..n]);
        Ok(())
    }

    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<()> {
        ops::add_assign(x, y);
        Ok(())
    }

    fn silu_mul(&self, gate: &mut Vec<f32>, up: &Vec<f32>) -> Result<()> {
        ops::silu_mul(gate, up);
        Ok(())
    }

    fn rope(&self, step: &mut CpuStep, spec: RopeSpec, x: &mut Vec<f32>, n_heads: usize, head_dim: usize) -> Result<()> {
        let i = match step.ropes.iter().position(|t| t.spec == spec) {
            Some(i) => i,
            None => {
                step.ropes.push(RopeTable::new(spec, &step.positions));
                step.ropes.len() - 1
            }
        };
        let n = step.positions.len() * n_heads * head_dim;
        step.ropes[i].apply(&mut x[..n], n_heads, head_dim);
        Ok(())
    }

    fn attention(
        &self,
        step: &CpuStep,
        kv: &mut PagedKv,
        layer: usize,
        p: &AttnParams,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let n = step.batch.n_tokens();
        let (qn, kvn) = (n * p.n_heads * p.head_dim, n * p.n_kv_heads * p.head_dim);
        attention::write_kv(kv, layer, &step.batch, &k[..kvn], &v[..kvn]);
        attention::paged_attention(&self.pool, p, &step.batch, &q[..qn], kv, layer, &mut out[..qn]);
        Ok(())
    }

    fn gather_rows(&self, x: &Vec<f32>, width: usize, rows: &[usize], out: &mut Vec<f32>) -> Result<()> {
        for (j, &r) in rows.iter().enumerate() {
            out[j * width..(j + 1) * width].copy_from_slice(&x[r * width..(r + 1) * width]);
        }
        Ok(())
    }

    fn to_host(&self, x: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(x.clone())
    }
}
