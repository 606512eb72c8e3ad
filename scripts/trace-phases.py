#!/usr/bin/env python3
"""Summarizes DEEPINFER_CUDA_TRACE reports of one pass each: per kernel name, the median of its
launches' shares (us from its first wait to the next launch's), of its phases' first / last
sampled block (us after the first wait), and of the gap from the latest phase stamp of its last
sampled block to the next launch's first wait (where the memory idles between launches).

    scripts/trace-phases.py trace-a.txt [trace-b.txt ...] [--kernel moe_ffn1] [--skip 1]
    scripts/trace-phases.py trace-all.txt --after moe_ffn1

--after prints what follows each launch of a kernel instead: the next launch's first
instruction (where it stamps p7), first start and first wait after the kernel's latest stamp.

--kernel keeps the kernels whose names start with it (default: every kernel); --skip drops each
name's first N launches (default 1: the first layer's launches often differ).
"""
import argparse
import re
import statistics

ROW = re.compile(r"\s*(\d+) (\S+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*(.*)")
PHASE = re.compile(r"p(\d) ([+-][\d.]+)/([+-][\d.]+)")


def load(path):
    rows = []
    with open(path) as f:
        for line in f:
            m = ROW.match(line)
            if not m:
                continue
            phases = {int(p.group(1)): (float(p.group(2)), float(p.group(3))) for p in PHASE.finditer(m.group(10))}
            rows.append(
                {
                    "name": m.group(2),
                    "start": float(m.group(5)),
                    "wait": float(m.group(7)),
                    "share": float(m.group(9)),
                    "phases": phases,
                }
            )
    return rows


def family(name):
    # the kernel without its type and shape suffixes (moe_ffn1_bf16 -> moe_ffn1)
    return re.sub(r"_(bf16|f32|f16|wbf16|bf16w).*$", "", name)


def latest(r):
    """When a launch's last sampled block reached its latest phase (us into the pass): the phase
    stamped latest, not the highest number (some kernels stamp a phase at their wait)."""
    return r["wait"] + max(b for _, b in r["phases"].values())


def summarize(path, prefix, skip):
    rows = load(path)
    by = {}
    for i, r in enumerate(rows):
        r["gap"] = None
        if r["phases"] and i + 1 < len(rows):
            r["gap"] = rows[i + 1]["wait"] - latest(r)
        by.setdefault(family(r["name"]), []).append(r)
    print(f"{path}: {len(rows)} launches")
    for name, rs in by.items():
        if prefix and not name.startswith(prefix):
            continue
        rs = rs[skip:] or rs
        med = statistics.median
        line = f"  {name:<24} n={len(rs):<3} share {med(r['share'] for r in rs):7.2f}"
        for p in sorted({p for r in rs for p in r["phases"]}):
            have = [r["phases"][p] for r in rs if p in r["phases"]]
            line += f"  p{p} {med(a for a, _ in have):+.2f}/{med(b for _, b in have):+.2f}"
        gaps = [r["gap"] for r in rs if r["gap"] is not None]
        if gaps:
            line += f"  gap {med(gaps):.2f}"
        print(line)


def after(path, prefix, skip):
    """What follows each launch of `prefix`: from its latest phase stamp (its last block's end,
    when every block stamps: DI_TRACE_ALL) to the next launch's first p7 (gemvp: a block's first
    instruction), first start (trigger) and first wait, medians over the launches."""
    rows = load(path)
    ends = []
    for i, r in enumerate(rows[:-1]):
        if not family(r["name"]).startswith(prefix) or not r["phases"]:
            continue
        end = latest(r)
        n = rows[i + 1]
        ends.append(
            {
                "next": family(n["name"]),
                "p7": n["wait"] + n["phases"][7][0] - end if 7 in n["phases"] else None,
                "start": n["start"] - end,
                "wait": n["wait"] - end,
            }
        )
    ends = ends[skip:] or ends
    if not ends:
        print(f"{path}: no launch of {prefix} with phases")
        return
    med = statistics.median
    p7 = [e["p7"] for e in ends if e["p7"] is not None]
    nexts = sorted({e["next"] for e in ends})
    line = f"{path}: after {prefix} (n={len(ends)}; next: {', '.join(nexts)}), us from its latest stamp:"
    if p7:
        line += f" next's first instruction {med(p7):+.2f},"
    line += f" first start {med(e['start'] for e in ends):+.2f}, first wait {med(e['wait'] for e in ends):+.2f}"
    print(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--kernel", default="")
    ap.add_argument("--skip", type=int, default=1)
    ap.add_argument("--after", default="", help="what follows each launch of this kernel (see after())")
    a = ap.parse_args()
    for t in a.traces:
        if a.after:
            after(t, a.after, a.skip)
        else:
            summarize(t, a.kernel, a.skip)


if __name__ == "__main__":
    main()
