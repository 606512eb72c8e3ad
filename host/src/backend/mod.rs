//! Compute backends. The CPU backend is always built; the CUDA backend sits behind the `cuda`
//! feature so CPU builds never need a CUDA toolkit.

pub mod cpu;
