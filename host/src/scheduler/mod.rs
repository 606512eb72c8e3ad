//! The scheduler: decides how many tokens each request runs per step. Plain data, no device types.
