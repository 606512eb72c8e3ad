//! CUDA kernels against the CPU backend (or an f64 reference) on fresh random inputs, odd
//! sizes included. Without the `cuda` feature or a device the tests print why and pass.

#[cfg(feature = "cuda")]
#[path = "gpu"]
mod gpu {
    mod attention;
    mod elementwise;
    mod matmul;
    mod sample;
    pub mod util;
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_kernels_skipped_without_the_cuda_feature() {
    eprintln!("skipped: built without `--features cuda`");
}
