//! Generated guest bindings, one module per world. Private to the SDK's macros: plugin code
//! uses the SDK's own types, so a new ABI version can change these without breaking plugins.

/// The `sampler` world.
pub mod sampler {
    wit_bindgen::generate!({
        world: "sampler",
        path: "wit/v0.1.0",
        pub_export_macro: true,
        export_macro_name: "export_world",
        default_bindings_module: "deepinfer_plugin_sdk::bindings::sampler",
        runtime_path: "deepinfer_plugin_sdk::__wit_bindgen::rt",
    });
}

/// The `constraint` world.
pub mod constraint {
    wit_bindgen::generate!({
        world: "constraint",
        path: "wit/v0.1.0",
        pub_export_macro: true,
        export_macro_name: "export_world",
        default_bindings_module: "deepinfer_plugin_sdk::bindings::constraint",
        runtime_path: "deepinfer_plugin_sdk::__wit_bindgen::rt",
    });
}
