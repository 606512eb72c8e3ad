//! TOML configuration: raw file -> resolved config, unknown keys rejected.
