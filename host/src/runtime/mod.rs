//! The generation runtime: runs requests through a model and a sampler.
