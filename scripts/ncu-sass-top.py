#!/usr/bin/env python3
"""Where a kernel's warps stall, by SASS instruction, from an ncu source-page dump.

    ncu ... --section SourceCounters --section WarpStateStats -o rep <program>
    ncu --import rep.ncu-rep --page source --csv --print-source sass > src.csv
    scripts/ncu-sass-top.py src.csv [KERNEL-SUBSTRING] [--top N]

Per kernel: the sampled stall reasons' shares, then the N instructions with the most samples
(index in the listing, share, instruction, its two largest reasons).
"""
import argparse
import collections
import csv


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump")
    ap.add_argument("kernel", nargs="?")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    blocks, cur = [], None
    with open(a.dump) as f:
        for line in f.read().splitlines():
            if line.startswith('"Kernel Name"'):
                cur = [line.split(",")[1].strip('"'), []]
                blocks.append(cur)
            elif cur is not None:
                cur[1].append(line)
    for name, body in blocks:
        if a.kernel and a.kernel not in name:
            continue
        rows = list(csv.reader(body))
        hdr, data = rows[0], rows[1:]
        ix = {h: i for i, h in enumerate(hdr)}
        col = ix["Warp Stall Sampling (All Samples)"]
        reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
        num = lambda r, i: float(r[i] or 0)
        total = sum(num(r, col) for r in data) or 1.0
        by = collections.Counter()
        for r in data:
            for h in reasons:
                by[h] += num(r, ix[h])
        shares = ", ".join(f"{k[6:]} {v / total * 100:.0f}%" for k, v in by.most_common(7))
        print(f"== {name}: {len(data)} instructions, {total:.0f} samples; {shares}")
        top = sorted(range(len(data)), key=lambda i: -num(data[i], col))[:a.top]
        for i in sorted(top):
            r = data[i]
            two = sorted(((num(r, ix[h]), h[6:]) for h in reasons), reverse=True)[:2]
            print(f"{i:5d} {num(r, col) / total * 100:5.1f}%  {r[ix['Source']][:70]:70s} "
                  + " ".join(f"{n}:{v:.0f}" for v, n in two))


if __name__ == "__main__":
    main()
