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
# Benchmark records name the commit the binary was built from (HEAD at build time); a tree with
# uncommitted changes is more than that commit, so the pack says what it was built from.
{
    echo "built $(date -u +%FT%TZ) from $(git describe --always --dirty 2>/dev/null || echo 'no git checkout')"
    git status --short --untracked-files=no 2>/dev/null
} >"$out/BUILD"
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    echo "gpu-pack: uncommitted changes are in this build; bench records will name $(git rev-parse --short=12 HEAD) (see $out/BUILD)" >&2
fi
ls -la "$out"
