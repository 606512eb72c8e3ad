//! Element-wise and row-wise kernels: RMSNorm, RoPE, SwiGLU, softmax.
