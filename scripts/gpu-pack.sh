#!/usr/bin/env bash
# Builds the CUDA-enabled binary and GPU test binaries here (no CUDA toolkit needed) and packs
# them, stripped and xz-compressed, into dev-out/cuda/ (git-ignored) for the device machine.
#
#   scripts/gpu-pack.sh            then carry `dev-out/cuda` and run `scripts/gpu-run.sh ...` there
#
# DEEPINFER_PACK_TESTS=0 leaves the GPU test binaries out: the binary and the kernels alone,
# for benchmark calls (a few minutes sooner).
#
# DEEPINFER_PACK_DIR=DIR packs into DIR instead (absolute, or relative to the repository root);
# on the device machine `DEEPINFER_PACK_DIR=DIR scripts/gpu-run.sh ...` unpacks from there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo build --release --features cuda
# The test binaries' paths are printed by cargo as "Executable ... (target/release/deps/NAME-HASH)".
tests=""
if [ "${DEEPINFER_PACK_TESTS:-1}" != 0 ]; then
    tests=$(cargo test --release --features cuda -p deepinfer --test gpu_kernels --test gpu_model --test gpu_deepseek --no-run 2>&1 |
        sed -n 's/.*Executable .*(\(target[^)]*\)).*/\1/p')
fi
out="${DEEPINFER_PACK_DIR:-dev-out/cuda}"
mkdir -p "$out"
rm -f "$out"/*.xz
pack() { strip -o "$out/$2" "$1" && xz -T2 -6 -f "$out/$2"; }
pack target/release/deepinfer deepinfer
for t in $tests; do
    name=$(basename "$t" | sed 's/-[0-9a-f]*$//')
    pack "$t" "$name"
done
# The kernels' machine code for the H200 (sm_90a; DEEPINFER_PTX_ARCH picks another target, e.g.
# compute_90 for PTX), compiled here when an NVRTC library can be found (DEEPINFER_NVRTC_DIR, or
# LD_LIBRARY_PATH), so a fresh device machine skips NVRTC: gpu-run.sh puts it in the cache.
mkdir -p "$out/ptx"
rm -f "$out"/ptx/*.xz
nvrtc_dir="${DEEPINFER_NVRTC_DIR:-}"
if [ -z "$nvrtc_dir" ] && ! ldconfig -p 2>/dev/null | grep -q libnvrtc; then
    # NVRTC of the device's CUDA release (13.0: newer NVRTCs write code its driver cannot load),
    # installed once into dev-out/nvrtc (git-ignored).
    if [ ! -d dev-out/nvrtc ]; then
        python3 -m pip install --quiet --no-deps --target dev-out/nvrtc 'nvidia-cuda-nvrtc==13.0.*' >&2 ||
            rm -rf dev-out/nvrtc
    fi
    nvrtc_dir=$(find dev-out/nvrtc -name 'libnvrtc.so*' -printf '%h\n' 2>/dev/null | head -1)
    [ -z "$nvrtc_dir" ] || nvrtc_dir="$root/$nvrtc_dir"
fi
# Further images on request, each picked on the device by the same variables:
#   DEEPINFER_PACK_TRACE=1          the traced kernels (DEEPINFER_CUDA_TRACE)
#   DEEPINFER_PACK_DEFINES="A B=2,C" one image per space-separated DEEPINFER_CUDA_DEFINE list
# ("-" in the list stands for the plain image; with TRACE each list is compiled traced too).
variants=("-")
for d in ${DEEPINFER_PACK_DEFINES:-}; do [ "$d" = "-" ] || variants+=("$d"); done
traces=("")
[ -z "${DEEPINFER_PACK_TRACE:-}" ] || traces+=("x")
for tr in "${traces[@]}"; do
    for d in "${variants[@]}"; do
        [ "$d" = "-" ] && d=""
        tmp_cache=$(mktemp -d)
        if ptx=$(LD_LIBRARY_PATH="${nvrtc_dir:+$nvrtc_dir:}${LD_LIBRARY_PATH:-}" DEEPINFER_CACHE="$tmp_cache" \
            DEEPINFER_CUDA_TRACE="$tr" DEEPINFER_CUDA_DEFINE="$d" \
            target/release/deepinfer dev ptx --arch "${DEEPINFER_PTX_ARCH:-sm_90a}" 2>"$tmp_cache/err"); then
            xz -T2 -6 -c "$ptx" >"$out/ptx/$(basename "$ptx").xz"
            echo "gpu-pack: kernels${tr:+ traced}${d:+ with $d}: $(basename "$ptx")" >&2
        else
            echo "gpu-pack: no kernels compiled here ($(tail -1 "$tmp_cache/err")); the device compiles the kernels on its first run" >&2
        fi
        rm -rf "$tmp_cache"
    done
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
