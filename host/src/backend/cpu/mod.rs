//! The CPU backend: multi-threaded kernels with SIMD paths chosen at run time.

pub mod attention;
pub mod kv;
pub mod matmul;
pub mod matmul16;
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

/// How activations meet quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActPrecision {
    /// One 8-bit pass (the integer kernels' native form): fastest, about 0.4% relative error
    /// per product, enough to flip near-tied greedy choices.
    Int8,
    /// About 16 bits per activation, the default. Q4_0, Q4_1 and Q8_0 weights run one integer
    /// pass on 16-bit activations ([`matmul16`]); the other quantized types run two 8-bit
    /// passes (the activations, then their quantization residual) and sum them.
    Int16,
}

/// The CPU backend: a thread pool and the kernels of this module.
#[derive(Clone)]
pub struct CpuBackend {
    pool: Arc<ThreadPool>,
    precision: ActPrecision,
}

/// Most compute threads a CPU backend runs (a count past it is a typo, and spawning it would
/// exhaust the process's memory for thread stacks).
pub const MAX_THREADS: usize = 1024;

impl CpuBackend {
    /// A backend of `threads` compute threads (0 is taken as 1), refusing more than
    /// [`MAX_THREADS`].
    pub fn try_new(threads: usize) -> crate::error::Result<CpuBackend> {
        if threads > MAX_THREADS {
            return Err(crate::error::Error::BadDevice(format!(
                "{threads} CPU threads asked for (--threads or [model] threads); at most {MAX_THREADS}"
            )));
        }
        Ok(CpuBackend::new(threads))
    }

    pub fn new(threads: usize) -> CpuBackend {
        CpuBackend {
            pool: Arc::new(ThreadPool::new(threads.max(1))),
            precision: ActPrecision::Int16,
        }
    }

    /// The same backend with another activation precision (benchmarks compare them).
    pub fn with_precision(mut self, precision: ActPrecision) -> CpuBackend {
        self.precision = precision;
        self
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
    /// The whole matrix in f32, made on first use by [`CpuWeight::dense`].
    dense: std::sync::OnceLock<Arc<Vec<f32>>>,
}

impl CpuWeight {
    /// The matrix dequantized to f32 (`rows * cols`, row-major), computed once.
    pub fn dense(&self) -> Arc<Vec<f32>> {
        self.dense
            .get_or_init(|| {
                let w = &self.w;
                let mut v = vec![0.0f32; w.rows * w.cols];
                let rb = w.row_bytes();
                for (r, out) in v.chunks_exact_mut(w.cols.max(1)).enumerate() {
                    quant::dequantize_row(w.dtype, &w.bytes()[r * rb..(r + 1) * rb], out);
                }
                Arc::new(v)
            })
            .clone()
    }
}

thread_local! {
    /// Reused [activations; residuals] and their outputs for the two-pass product.
    static SPLIT: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Elements per activation-quantization block of the kernels for `dtype` (0: float kernels,
/// no activation quantization).
fn activation_block(dtype: crate::tensor::DType) -> usize {
    use crate::tensor::DType::*;
    match dtype {
        F32 | F16 | BF16 => 0,
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 => 32,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K => 256,
    }
}

/// `r = x - d q`, where `d q` is what the kernels' symmetric 8-bit quantization of the block
/// (`d = max|x| / 127`, round half to even) represents.
fn residual_block(x: &[f32], r: &mut [f32]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        r.fill(0.0);
        return;
    }
    let (d, id) = (amax / 127.0, 127.0 / amax);
    // Adding and removing 1.5 * 2^23 rounds to nearest even for |v| <= 127 (as the kernels'
    // quantizer does) without a libm call.
    const MAGIC: f32 = 12_582_912.0;
    for (o, &v) in r.iter_mut().zip(x) {
        *o = v - d * ((v * id + MAGIC) - MAGIC);
    }
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
    type MlaKv = crate::model::mla::MlaKv;

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
        Ok(CpuWeight {
            w: w.clone(),
            vector,
            dense: std::sync::OnceLock::new(),
        })
    }

    fn zeros(&self, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    fn new_kv(&self, s: KvShape) -> Result<PagedKv> {
        Ok(PagedKv::new(
            s.layers,
            s.num_blocks,
            s.block_size,
            s.kv_heads,
            s.head_dim,
        ))
    }

    fn prepare_step(&self, batch: &Batch, _block_size: usize) -> Result<CpuStep> {
        Ok(CpuStep {
            batch: batch.clone(),
            positions: batch.positions(),
            ropes: Vec::new(),
        })
    }

    fn embed(&self, table: &CpuWeight, tokens: &[TokenId], out: &mut Vec<f32>) -> Result<()> {
        let w = &table.w;
        let (d, row) = (w.cols, w.row_bytes());
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= w.rows {
                return Err(Error::BadRequest(format!(
                    "token id {t} is outside the vocabulary ({})",
                    w.rows
                )));
            }
            let bytes = &w.bytes()[t as usize * row..(t as usize + 1) * row];
            quant::dequantize_row(w.dtype, bytes, &mut out[i * d..(i + 1) * d]);
        }
        Ok(())
    }

    fn matmul(&self, w: &CpuWeight, x: &Vec<f32>, n_tokens: usize, y: &mut Vec<f32>) -> Result<()> {
        let block = activation_block(w.w.dtype);
        if self.precision == ActPrecision::Int8 || block == 0 {
            matmul::matmul(&self.pool, &w.w, x, n_tokens, y);
            return Ok(());
        }
        if matmul16::supports(w.w.dtype) {
            matmul16::matmul16(&self.pool, &w.w, x, n_tokens, y);
            return Ok(());
        }
        // Run the activations and their 8-bit quantization residual as 2n tokens, then add
        // the halves: y = W x_q + W (x - x_q).
        let (cols, rows) = (w.w.cols, w.w.rows);
        SPLIT.with(|buf| {
            let (xx, yy) = &mut *buf.borrow_mut();
            xx.clear();
            xx.extend_from_slice(&x[..n_tokens * cols]);
            xx.resize(2 * n_tokens * cols, 0.0);
            let (hi, lo) = xx.split_at_mut(n_tokens * cols);
            for (xb, rb) in hi.chunks_exact(block).zip(lo.chunks_exact_mut(block)) {
                residual_block(xb, rb);
            }
            yy.resize(2 * n_tokens * rows, 0.0);
            matmul::matmul(&self.pool, &w.w, xx, 2 * n_tokens, yy);
            let (a, b) = yy.split_at(n_tokens * rows);
            for ((o, &p), &q) in y[..n_tokens * rows].iter_mut().zip(a).zip(b) {
                *o = p + q;
            }
        });
        Ok(())
    }

    fn rms_norm(&self, x: &Vec<f32>, w: &CpuWeight, eps: f32, out: &mut Vec<f32>) -> Result<()> {
        let g = w
            .vector
            .as_deref()
            .ok_or_else(|| Error::BadConfig("rms_norm gain is not a vector".into()))?;
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

    fn rope(
        &self,
        step: &mut CpuStep,
        spec: RopeSpec,
        x: &mut Vec<f32>,
        n_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
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
        attention::paged_attention(
            &self.pool,
            p,
            &step.batch,
            &q[..qn],
            kv,
            layer,
            &mut out[..qn],
        );
        Ok(())
    }

    fn new_mla_kv(
        &self,
        layers: usize,
        num_blocks: usize,
        block_size: usize,
        width: usize,
    ) -> Result<Self::MlaKv> {
        crate::model::mla::MlaKv::new(layers, num_blocks, block_size, width)
    }

    fn mla_attention(
        &self,
        step: &mut CpuStep,
        kv: &mut Self::MlaKv,
        layer: usize,
        p: &crate::model::mla::MlaParams,
        w: &crate::model::mla::MlaWeights<'_, CpuWeight>,
        q: &mut Vec<f32>,
        kva: &Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let vector = |w: &CpuWeight, what: &str| {
            w.vector
                .clone()
                .ok_or_else(|| Error::BadConfig(format!("MLA {what} is not a vector")))
        };
        let kv_b = w.kv_b.dense();
        crate::model::mla::host_layer(
            p,
            kv,
            layer,
            &step.batch,
            &vector(w.kv_a_norm, "kv_a_layernorm")?,
            &kv_b,
            &vector(w.inv_freq, "rotary frequency table")?,
            q,
            kva,
            out,
        )
    }

    fn gather_rows(
        &self,
        x: &Vec<f32>,
        width: usize,
        rows: &[usize],
        out: &mut Vec<f32>,
    ) -> Result<()> {
        for (j, &r) in rows.iter().enumerate() {
            out[j * width..(j + 1) * width].copy_from_slice(&x[r * width..(r + 1) * width]);
        }
        Ok(())
    }

    fn to_host(&self, x: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(x.clone())
    }

    fn upload(&self, x: &[f32]) -> Result<Vec<f32>> {
        Ok(x.to_vec())
    }

    fn scatter_add_rows(
        &self,
        out: &mut Vec<f32>,
        src: &Vec<f32>,
        width: usize,
        rows: &[usize],
        scales: &[f32],
    ) -> Result<()> {
        if rows.iter().any(|&r| (r + 1) * width > out.len()) || rows.len() * width > src.len() {
            return Err(Error::BadRequest(
                "scatter_add_rows: row index outside the buffer".into(),
            ));
        }
        for (j, (&r, &s)) in rows.iter().zip(scales).enumerate() {
            ops::axpy(
                &mut out[r * width..(r + 1) * width],
                s,
                &src[j * width..(j + 1) * width],
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Bytes, DType};

    /// A Q8_0 weight (rows x cols) with per-block scale 1/64 and pseudo-random values.
    fn q8_weight(rows: usize, cols: usize) -> (Weight, Vec<f32>) {
        let mut bytes = Vec::new();
        let mut vals = Vec::new();
        let mut s = 12345u32;
        for _ in 0..rows * cols / 32 {
            bytes.extend_from_slice(&half::f16::from_f32(1.0 / 64.0).to_le_bytes());
            for _ in 0..32 {
                s = s.wrapping_mul(1_103_515_245).wrapping_add(12345);
                let q = ((s >> 16) % 255) as i32 - 127;
                bytes.push(q as i8 as u8);
                vals.push(q as f32 / 64.0);
            }
        }
        (
            Weight {
                dtype: DType::Q8_0,
                rows,
                cols,
                data: Bytes::Owned(Arc::new(bytes)),
            },
            vals,
        )
    }

    #[test]
    fn two_pass_activations_are_far_more_precise_than_one() {
        let (rows, cols, n) = (8, 256, 3);
        let (w, vals) = q8_weight(rows, cols);
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 3.0)
            .collect();
        let exact: Vec<f64> = (0..n * rows)
            .map(|o| {
                let (t, r) = (o / rows, o % rows);
                (0..cols)
                    .map(|c| vals[r * cols + c] as f64 * x[t * cols + c] as f64)
                    .sum()
            })
            .collect();
        let err = |p: ActPrecision| {
            let be = CpuBackend::new(2).with_precision(p);
            let cw = be.prepare_weight(&w).unwrap();
            let mut y = vec![0.0; n * rows];
            be.matmul(&cw, &x, n, &mut y).unwrap();
            y.iter()
                .zip(&exact)
                .map(|(a, b)| (*a as f64 - b).abs())
                .fold(0.0, f64::max)
        };
        let (e1, e2) = (err(ActPrecision::Int8), err(ActPrecision::Int16));
        assert!(e1 > 1e-3, "one pass should show 8-bit error, got {e1}");
        assert!(e2 < e1 / 50.0, "two passes: {e2} vs one pass {e1}");
    }

    #[test]
    fn residual_of_representable_values_is_zero() {
        // integer multiples of d = 0.5 with max |q| = 127: exactly what the kernels see
        let x: Vec<f32> = (0..32)
            .map(|i| {
                if i == 0 {
                    63.5
                } else {
                    (i as f32 * 4.0 - 64.0) * 0.5
                }
            })
            .collect();
        let mut r = vec![1.0; 32];
        residual_block(&x, &mut r);
        assert!(r.iter().all(|v| v.abs() < 1e-6), "{r:?}");
        residual_block(&[0.0; 32], &mut r);
        assert!(r.iter().all(|&v| v == 0.0));
    }
}
