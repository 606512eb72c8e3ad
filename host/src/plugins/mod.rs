//! Plugin host: wasmtime components under limits, loaded from config and pinned by hash.
