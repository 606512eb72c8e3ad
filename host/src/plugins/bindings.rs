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
