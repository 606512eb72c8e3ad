//! Matrix products of (possibly quantized) weights with f32 activations, split across the thread pool.
