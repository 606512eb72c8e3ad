//! `deepinfer plugins ...` (host/src/cli/plugins.rs), compiled here against the library so it
//! is checked before the CLI wires it: list, inspect, check and pack run end to end.

// The CLI file uses `crate::` paths; give this test crate the same names.
mod config {
    pub use deepinfer::config::*;
}
mod files {
    pub use deepinfer::files::*;
}
mod plugins {
    pub use deepinfer::plugins::*;
}
mod sampling {
    pub use deepinfer::sampling::*;
}
#[path = "../src/cli/plugins.rs"]
mod cli_plugins;

#[path = "plugins/common.rs"]
mod common;

use clap::Parser;
use cli_plugins::{run, PluginsArgs};

#[derive(Parser)]
struct Cmd {
    #[command(flatten)]
    args: PluginsArgs,
}

fn parse(args: &[&str]) -> PluginsArgs {
    Cmd::try_parse_from(std::iter::once("plugins").chain(args.iter().copied()))
        .expect("flags parse")
        .args
}

#[test]
fn list_inspect_and_check_run_on_the_default_config() {
    let dir = tempfile::tempdir().unwrap();
    // SAFETY of the test: only this binary's tests read it, all with the same value.
    std::env::set_var("DEEPINFER_CACHE_DIR", dir.path());
    run(parse(&["list"])).expect("list");
    run(parse(&["inspect", "standard"])).expect("inspect");
    run(parse(&["check"])).expect("check");
    let file = common::test_plugin("typical");
    run(parse(&["inspect", file.to_str().unwrap()])).expect("inspect a file");
}

#[test]
fn check_fails_on_a_bad_pin() {
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var("DEEPINFER_CACHE_DIR", dir.path());
    let cfg = dir.path().join("c.toml");
    let path = common::test_plugin("typical");
    std::fs::write(
        &cfg,
        format!(
            "[plugins.t]\npath = {path:?}\nsha256 = \"{}\"\n",
            "0".repeat(64)
        ),
    )
    .unwrap();
    let err = run(parse(&["--config", cfg.to_str().unwrap(), "check"])).unwrap_err();
    assert!(err.to_string().contains("failed the check"), "{err}");
}

#[test]
fn pack_refuses_a_module_without_plugin_exports() {
    let dir = tempfile::tempdir().unwrap();
    let core = dir.path().join("empty.wasm");
    std::fs::write(
        &core,
        wat::parse_str("(module (memory (export \"memory\") 1))").unwrap(),
    )
    .unwrap();
    let out = dir.path().join("out.wasm");
    let args = parse(&["pack", core.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(run(args).is_err());
    assert!(!out.exists());
}

#[test]
fn pack_wraps_a_core_module_into_the_same_component_the_build_makes() {
    let dir = tempfile::tempdir().unwrap();
    let core =
        std::path::PathBuf::from(env!("DEEPINFER_TEST_PLUGIN_DIR")).join("typical.core.wasm");
    let out = dir.path().join("typical.wasm");
    run(parse(&[
        "pack",
        core.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]))
    .expect("pack");
    assert_eq!(
        common::sha_of(&out),
        common::sha_of(&common::test_plugin("typical"))
    );
}
