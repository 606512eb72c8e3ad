//! Sampler benchmark (placeholder until the plugin host lands in this commit series).
fn main() {}
