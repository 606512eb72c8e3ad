//! Packing: wraps a core module built for `wasm32-unknown-unknown` (carrying the
//! `component-type` section that the SDK's bindings embed) as a component, then checks it
//! against the ABI. `deepinfer plugins pack` and `scripts/build-plugin.sh` use it.

use crate::error::{Error, Result};

/// The component for `core`, checked like any plugin the host loads.
pub fn pack_component(name: &str, core: &[u8]) -> Result<Vec<u8>> {
    let fail = |reason: String| Error::Plugin {
        plugin: name.to_string(),
        reason,
    };
    let component = wit_component::ComponentEncoder::default()
        .module(core)
        .and_then(|e| e.validate(true).encode())
        .map_err(|e| fail(format!("cannot wrap as a component: {e:#}")))?;
    super::abi::inspect(name, &component)?;
    Ok(component)
}
