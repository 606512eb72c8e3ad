//! cuBLAS for the linear layers of more than a few tokens: one handle on the backend's stream
//! with a fixed workspace (so calls can be captured into CUDA graphs), and the row-major
//! `y = x W^T` product expressed in cuBLAS's column-major terms.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as bsys};
use cudarc::driver::{CudaContext, CudaStream};

use super::device::{cuda_err, DevMem};
use crate::error::Result;

/// Element type of a GEMM operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmType {
    F32,
    Bf16,
}

impl GemmType {
    fn cuda(self) -> bsys::cudaDataType {
        match self {
            GemmType::F32 => bsys::cudaDataType::CUDA_R_32F,
            GemmType::Bf16 => bsys::cudaDataType::CUDA_R_16BF,
        }
    }
}

/// `y[n, m] = x[n, k] . w[m, k]^T` with every matrix row-major and contiguous.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub w: u64,
    pub x: u64,
    pub y: u64,
    /// Type of `w` and `x`.
    pub ab: GemmType,
    pub c: GemmType,
}

/// A cuBLAS handle bound to the backend's stream.
pub struct Blas {
    handle: bsys::cublasHandle_t,
    _workspace: DevMem,
}

// SAFETY: the handle is only used under the backend's queue lock (one thread at a time), which
// is what cuBLAS asks of a handle.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

const WORKSPACE: usize = 32 << 20;

impl Blas {
    pub fn new(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> Result<Blas> {
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        let handle =
            blas::create_handle().map_err(|e| cuda_err("creating the cuBLAS handle", e))?;
        let workspace = DevMem::alloc(ctx, WORKSPACE)?;
        // SAFETY: `handle` is live; the stream and the workspace outlive it (both are owned by
        // the backend, and the workspace by this value).
        unsafe {
            blas::set_stream(handle, stream.cu_stream() as _)
                .map_err(|e| cuda_err("cublasSetStream", e))?;
            bsys::cublasSetWorkspace_v2(handle, workspace.ptr as *mut c_void, WORKSPACE)
                .result()
                .map_err(|e| cuda_err("cublasSetWorkspace", e))?;
        }
        Ok(Blas {
            handle,
            _workspace: workspace,
        })
    }

    /// Enqueues `g` on the stream.
    pub fn run(&self, g: &Gemm) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Column-major view: C (m x n, ld m) = op(A) (m x k) . B (k x n), where A is w seen as a
        // k x m column-major matrix (transposed) and B is x seen as k x n.
        // SAFETY: the pointers are live device allocations of the stated shapes (the backend's
        // typed launcher checked them), and alpha/beta outlive the call.
        unsafe {
            blas::gemm_ex(
                self.handle,
                bsys::cublasOperation_t::CUBLAS_OP_T,
                bsys::cublasOperation_t::CUBLAS_OP_N,
                g.m as i32,
                g.n as i32,
                g.k as i32,
                &alpha as *const f32 as *const c_void,
                g.w as *const c_void,
                g.ab.cuda(),
                g.k as i32,
                g.x as *const c_void,
                g.ab.cuda(),
                g.k as i32,
                &beta as *const f32 as *const c_void,
                g.y as *mut c_void,
                g.c.cuda(),
                g.m as i32,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }
        .map_err(|e| cuda_err(&format!("cublasGemmEx m={} n={} k={}", g.m, g.n, g.k), e))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed only here.
        let _ = unsafe { blas::destroy_handle(self.handle) };
    }
}
