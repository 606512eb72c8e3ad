//! The plugins built into the host: built from source by `host/build.rs` for wasm32, wrapped
//! as components and embedded here. Never committed as binaries.

include!(concat!(env!("OUT_DIR"), "/builtin_plugins.rs"));

/// The component of the builtin plugin `name`.
pub fn get(name: &str) -> Option<&'static [u8]> {
    BUILTIN_COMPONENTS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, b)| *b)
}

/// Names of the builtin plugins.
pub fn names() -> impl Iterator<Item = &'static str> {
    BUILTIN_COMPONENTS.iter().map(|(n, _)| *n)
}

#[cfg(test)]
mod tests {
    #[test]
    fn greedy_and_standard_are_built_in() {
        for name in ["greedy", "standard"] {
            let bytes = super::get(name).unwrap_or_else(|| panic!("{name} missing"));
            assert!(bytes.starts_with(b"\0asm"));
        }
        assert!(super::get("nope").is_none());
    }
}
