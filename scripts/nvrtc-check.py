#!/usr/bin/env python3
"""Compiles kernels/*.cu as the CUDA backend does (NVRTC, concatenated in module order), with
no device: prints NVRTC's log and, with -Xptxas=-v, each kernel's registers and spills.

    python3 -m pip install --no-deps --target dev-out/nvrtc 'nvidia-cuda-nvrtc==13.0.*'
    LD_LIBRARY_PATH=dev-out/nvrtc/nvidia/cu13/lib scripts/nvrtc-check.py -Xptxas=-v

Extra arguments are passed to NVRTC; the target defaults to sm_90a (--arch=ARCH picks another).
"""
import ctypes
import os
import sys

# The order `backend::cuda::module` concatenates the sources in.
ORDER = ["common.cuh", "elementwise.cu", "gemv.cu", "gemt.cu", "attention_decode.cu",
         "attention_prefill.cu", "sample.cu", "mla.cu", "moe.cu", "stream.cu"]


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels")
    args = [a for a in sys.argv[1:] if not a.startswith("--arch=")]
    arch = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--arch=")), "sm_90a")
    try:
        lib = ctypes.CDLL("libnvrtc.so.13")
    except OSError:
        sys.exit("nvrtc-check: no libnvrtc.so.13 on LD_LIBRARY_PATH (see the usage above)")
    src = "".join(f"// ---- {n} ----\n" + open(os.path.join(root, n)).read() + "\n" for n in ORDER)
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kernels.cu", 0, None, None) != 0:
        sys.exit("nvrtc-check: nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--extra-device-vectorization"]
    opts += [a.encode() for a in args]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    print(log.value.decode(errors="replace"))
    print("compiled" if rc == 0 else f"failed (NVRTC result {rc})")
    sys.exit(0 if rc == 0 else 1)


if __name__ == "__main__":
    main()
