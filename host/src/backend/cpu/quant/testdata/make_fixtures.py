#!/usr/bin/env python3
"""Builds dequant_fixtures.bin: random but valid blocks of every supported GGML type and the
values gguf-py (the ggml project's own Python package) dequantizes them to.

    pip install gguf numpy
    python3 make_fixtures.py            # writes dequant_fixtures.bin beside this script

Blocks are random bytes whose f16 scale fields are overwritten with finite values of sane
magnitude (random bytes would give NaN/Inf scales). The file is little-endian:

    b"DQFX", u32 version (1), u32 entry count, then per entry:
    u32 ggml type id, u32 element count, u32 byte count, the block bytes, element-count f32s.
"""
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

SEED = 20260529

# type: (elements per block, bytes per block, byte offsets of f16 scale fields, blocks)
LAYOUT = {
    T.F16: (1, 2, [0], 64),
    T.BF16: (1, 2, [], 64),
    T.Q4_0: (32, 18, [0], 8),
    T.Q4_1: (32, 20, [0, 2], 8),
    T.Q5_0: (32, 22, [0], 8),
    T.Q5_1: (32, 24, [0, 2], 8),
    T.Q8_0: (32, 34, [0], 8),
    T.Q2_K: (256, 84, [80, 82], 3),
    T.Q3_K: (256, 110, [108], 3),
    T.Q4_K: (256, 144, [0, 2], 3),
    T.Q5_K: (256, 176, [0, 2], 3),
    T.Q6_K: (256, 210, [208], 3),
}


def sane_f16(rng: np.random.Generator) -> bytes:
    mag = 10.0 ** rng.uniform(-3.0, 0.3)
    sign = -1.0 if rng.random() < 0.5 else 1.0
    return np.float16(sign * mag).tobytes()


def blocks_for(qtype: T, rng: np.random.Generator) -> bytes:
    elems, nbytes, scale_offsets, nblocks = LAYOUT[qtype]
    if qtype == T.BF16:
        vals = rng.normal(0.0, 2.0, nblocks).astype(np.float32)
        return (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    out = bytearray()
    for _ in range(nblocks):
        block = bytearray(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())
        for off in scale_offsets:
            block[off:off + 2] = sane_f16(rng)
        out += block
    return bytes(out)


def main() -> None:
    rng = np.random.default_rng(SEED)
    entries = []
    for qtype in LAYOUT:
        raw = blocks_for(qtype, rng)
        data = np.frombuffer(raw, dtype=np.uint8)
        values = np.asarray(dequantize(data, qtype), dtype=np.float32).reshape(-1)
        elems, nbytes, _, nblocks = LAYOUT[qtype]
        assert values.size == elems * nblocks and len(raw) == nbytes * nblocks
        assert np.all(np.isfinite(values)), qtype.name
        entries.append((int(qtype), values.size, raw, values))
    blob = bytearray(b"DQFX" + struct.pack("<II", 1, len(entries)))
    for type_id, n, raw, values in entries:
        blob += struct.pack("<III", type_id, n, len(raw)) + raw + values.astype("<f4").tobytes()
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("dequant_fixtures.bin")
    out.write_bytes(bytes(blob))
    print(f"wrote {out.name}: {len(entries)} types, {len(blob)} bytes")


if __name__ == "__main__":
    main()
