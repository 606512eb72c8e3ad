#!/usr/bin/env bash
# Builds the CUDA-enabled binary and GPU test binaries here (no CUDA toolkit needed) and packs
# them, stripped and xz-compressed, into dev-out/cuda/ (git-ignored) for the device machine.
#
#   scripts/gpu-pack.sh            then carry `dev-out/cuda` and run `scripts/gpu-run.sh ...` there
#
# DEEPINFER_PACK_DIR=DIR packs into DIR instead (absolute, or relative to the repository root);
# on the device machine `DEEPINFER_PACK_DIR=DIR scripts/gpu-run.sh ...` unpacks from there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo build --release --features cuda
# The test binaries' paths are printed by cargo as "Executable ... (target/release/deps/NAME-HASH)".
tests=$(cargo test --release --features cuda -p deepinfer --test gpu_kernels --test gpu_model --test gpu_deepseek --no-run 2>&1 |
    sed -n 's/.*Executable .*(\(target[^)]*\)).*/\1/p')
out="${DEEPINFER_PACK_DIR:-dev-out/cuda}"
mkdir -p "$out"
rm -f "$out"/*.xz
pack() { strip -o "$out/$2" "$1" && xz -T2 -6 -f "$out/$2"; }
pack target/release/deepinfer deepinfer
for t in $tests; do
    name=$(basename "$t" | sed 's/-[0-9a-f]*$//')
    pack "$t" "$name"
done
ls -la "$out"
