//! A stand-in for the `instant` crate, used through `[patch.crates-io]`.
//!
//! llguidance times its own work (statistics only: no decision depends on a duration) and, with
//! its `wasm` feature, takes `Instant` from `instant` instead of `std::time`. On
//! `wasm32-unknown-unknown` `std::time::Instant::now()` panics, and a plugin has no clock to
//! import (no WASI), so here an instant is a tick of a process-wide monotonic counter: `now()`
//! is always later than every earlier `now()`, and each tick counts as one nanosecond. Elapsed
//! times inside the sandbox are therefore meaningless small numbers, never a panic. On every
//! other target this is `std::time::Instant`.

#[cfg(not(all(target_arch = "wasm32", not(target_os = "wasi"))))]
pub use std::time::Instant;

#[cfg(all(target_arch = "wasm32", not(target_os = "wasi")))]
mod counter;

#[cfg(all(target_arch = "wasm32", not(target_os = "wasi")))]
pub use counter::Instant;

pub use std::time::Duration;
