//! A persistent worker pool for data-parallel kernels.
