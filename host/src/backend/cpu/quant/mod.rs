//! GGML block formats: dequantization and dot products computed directly on quantized blocks.
