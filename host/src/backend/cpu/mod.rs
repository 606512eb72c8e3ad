//! The CPU backend: multi-threaded kernels with SIMD paths chosen at run time.
