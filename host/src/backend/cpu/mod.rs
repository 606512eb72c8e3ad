//! The CPU backend: multi-threaded kernels with SIMD paths chosen at run time.

pub mod attention;
pub mod kv;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod quant;
