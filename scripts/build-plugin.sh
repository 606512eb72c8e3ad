#!/usr/bin/env bash
# Builds a DeepInfer plugin crate for wasm32-unknown-unknown, wraps the core module as a
# component (`deepinfer plugins pack`) and prints the sha256 to pin in a config.
#
#   scripts/build-plugin.sh CRATE_DIR [OUT_DIR]     (OUT_DIR defaults to ./plugins-out)
#
# Uses `deepinfer` from $DEEPINFER or PATH, else builds and runs this repository's host.
set -euo pipefail

crate="${1:?usage: scripts/build-plugin.sh CRATE_DIR [OUT_DIR]}"
out="${2:-plugins-out}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
manifest="$crate/Cargo.toml"
[ -f "$manifest" ] || { echo "no Cargo.toml in $crate" >&2; exit 1; }

if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown; then
    echo "adding the wasm32-unknown-unknown target" >&2
    rustup target add wasm32-unknown-unknown
fi

# The package name: the first `name = "..."` of the manifest (the [package] table).
package="$(sed -n 's/^name *= *"\([^"]*\)".*/\1/p' "$manifest" | head -n 1)"
lib="${package//-/_}"

# Small, fast plugins: LTO, one codegen unit, no debug info (function names are kept).
CARGO_PROFILE_RELEASE_LTO=true \
CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 \
CARGO_PROFILE_RELEASE_DEBUG=false \
CARGO_PROFILE_RELEASE_STRIP=debuginfo \
CARGO_PROFILE_RELEASE_PANIC=abort \
    cargo build --release --target wasm32-unknown-unknown --manifest-path "$manifest"

target_dir="$(cargo metadata --format-version 1 --no-deps --manifest-path "$manifest" \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
core="$target_dir/wasm32-unknown-unknown/release/$lib.wasm"
[ -f "$core" ] || { echo "expected the core module at $core" >&2; exit 1; }

mkdir -p "$out"
if [ -n "${DEEPINFER:-}" ]; then
    "$DEEPINFER" plugins pack "$core" -o "$out/$lib.wasm"
elif command -v deepinfer >/dev/null 2>&1; then
    deepinfer plugins pack "$core" -o "$out/$lib.wasm"
else
    cargo run --release -q --manifest-path "$root/Cargo.toml" -p deepinfer -- plugins pack "$core" -o "$out/$lib.wasm"
fi
