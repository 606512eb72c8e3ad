//! Host bindings generated from the frozen WIT of each supported ABI version, one module per
//! version (`v0_1` is `plugin-sdk/wit/v0.1.0/`). Adding a version adds a module; none is edited.

pub mod v0_1 {
    /// The `sampler` world of `deepinfer:plugin@0.1.0`.
    pub mod sampler {
        wasmtime::component::bindgen!({
            world: "sampler",
            path: "../plugin-sdk/wit/v0.1.0",
        });
    }
}

/// The `constraint` world of `deepinfer:plugin@0.1.0` (structured output).
pub mod v0_1_constraint {
    wasmtime::component::bindgen!({
        world: "constraint",
        path: "../plugin-sdk/wit/v0.1.0",
        // The shared imports are the sampler world's, so one host implementation serves both.
        with: {
            "deepinfer:plugin/host": super::v0_1::sampler::deepinfer::plugin::host,
            "deepinfer:plugin/types": super::v0_1::sampler::deepinfer::plugin::types,
        },
    });
}
