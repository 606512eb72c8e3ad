//! Benchmarks of the model forward pass: prefill and decode sweeps, warm-up kept out of the
//! measured window, one JSONL record per point, and an optional peer command run alternately
//! in the same process tree so ratios compare like with like.

pub mod accounting;
pub mod plot;
pub mod record;
pub mod runner;

pub use record::{BenchRecord, Summary};
pub use runner::{decode_steps, prefill_once, PrefillBench, PrefillSpec};
