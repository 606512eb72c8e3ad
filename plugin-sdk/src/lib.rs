//! The DeepInfer plugin SDK: traits with defaults and export macros for writing policy plugins
//! as WebAssembly components. It owns the guest side of the ABI in `wit/`; the generated
//! bindings stay private (`bindings` is hidden), so plugins depend only on the types here.
//!
//! A sampler plugin is a `cdylib` crate built for `wasm32-unknown-unknown`:
//!
//! ```
//! use deepinfer_plugin_sdk::sampler::{Row, Sampler};
//! use deepinfer_plugin_sdk::TokenId;
//!
//! #[derive(Default)]
//! struct First;
//!
//! impl Sampler for First {
//!     const DESCRIPTION: &'static str = "always the highest logit";
//!     fn sample(&mut self, row: &Row<'_>) -> Result<TokenId, String> {
//!         row.candidates.first().map(|c| c.id).ok_or_else(|| "no candidates".to_string())
//!     }
//! }
//!
//! deepinfer_plugin_sdk::export_sampler!(First);
//! ```
//!
//! On other targets the export macro expands to nothing, so the same crate also builds as a
//! plain library for native tests and benchmarks. `doc/plugin-authoring.md` walks through
//! writing, building and configuring one.

extern crate self as deepinfer_plugin_sdk;

pub mod constraint;
pub mod log;
pub mod rng;
pub mod sampler;
pub mod settings;
mod types;

pub use settings::Settings;
pub use types::{Candidate, PluginInfo, SamplingParams, TokenId};

/// The ABI version this SDK builds plugins for (the WIT package `deepinfer:plugin@ABI_VERSION`).
pub const ABI_VERSION: &str = "0.1.0";

#[doc(hidden)]
pub mod bindings;

#[doc(hidden)]
pub use wit_bindgen as __wit_bindgen;
