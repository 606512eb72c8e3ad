#!/usr/bin/env bash
# On the device machine: unpacks what scripts/gpu-pack.sh left in dev-out/cuda/ (or
# $DEEPINFER_PACK_DIR), finds the CUDA libraries (NVRTC, cuBLAS) of the image, then runs what is asked:
#
#   scripts/gpu-run.sh tests              GPU kernel and model tests
#   scripts/gpu-run.sh bench ARGS...      deepinfer bench ARGS... (add --device cuda)
#   scripts/gpu-run.sh exec CMD...        any command with the libraries on the path
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pack="${DEEPINFER_PACK_DIR:-dev-out/cuda}"
case "$pack" in /*) ;; *) pack="$root/$pack" ;; esac
# Unpacked afresh on every call: a warm machine may still hold another pack's binaries.
bin=/tmp/deepinfer-bin/$(basename "$pack")
rm -rf "$bin"
mkdir -p "$bin"
# unxz FILE.xz DIR: FILE into DIR (python's lzma where the image has no xz).
unxz() {
    local out="$2/$(basename "$1" .xz)"
    xz -dc "$1" >"$out" 2>/dev/null || python3 -c "import lzma,sys;open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$1" "$out"
}
for f in "$pack"/*.xz; do
    unxz "$f" "$bin"
    chmod +x "$bin/$(basename "$f" .xz)"
done
# Kernels compiled ahead by gpu-pack.sh (cubin or PTX) go where the binaries look for them.
if compgen -G "$pack/ptx/*.xz" >/dev/null; then
    # The folder `model::fetch::cache_dir` names.
    cache="${DEEPINFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/deepinfer}"
    mkdir -p "$cache/ptx"
    for f in "$pack"/ptx/*.xz; do unxz "$f" "$cache/ptx"; done
fi
# The driver's folder first (a CUDA "stubs" folder holds a fake libcuda.so), then the toolkit's.
libdirs=$( (find / -xdev -name 'libcuda.so.1' -printf '%h\n' 2>/dev/null | grep -v stubs;
    ls -d /usr/local/cuda/lib64 2>/dev/null;
    find / -xdev \( -name 'libnvrtc.so*' -o -name 'libcublas.so*' \) -printf '%h\n' 2>/dev/null | grep -v stubs) | awk '!seen[$0]++' | tr '\n' ':')
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
export PATH="$bin:$PATH"
cd "$root"
what="${1:-tests}"
shift || true
case "$what" in
    tests)
        if ! compgen -G "$bin/gpu_*" >/dev/null; then
            echo "no GPU test binaries in $pack (packed with DEEPINFER_PACK_TESTS=0?)" >&2
            exit 2
        fi
        status=0
        for t in "$bin"/gpu_*; do "$t" --test-threads=1 --nocapture "$@" || status=1; done
        exit $status ;;
    bench) deepinfer bench "$@" ;;
    exec) "$@" ;;
    *) echo "unknown command $what" >&2; exit 2 ;;
esac
