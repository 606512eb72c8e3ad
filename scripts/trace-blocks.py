#!/usr/bin/env python3
"""Which blocks reach a phase late: reads the per-block stamps a traced pass writes to
FILE.blocks when the kernels are compiled with DI_TRACE_BLOCKS (see backend/cuda/trace.rs) and,
for the launches of one kernel, prints per group of blocks (a thread-block cluster: --group,
default 8) the median over launches of when its last block reached the phase, its SMs, and
how often it was the latest group, so a late phase can be put on the clusters, SMs or ranks
that reach it late.

    DEEPINFER_CUDA_DEFINE=DI_TRACE_BLOCKS DEEPINFER_CUDA_TRACE=$OUT/t.txt ... bench decode ...
    scripts/trace-blocks.py t.txt.blocks --kernel mla_dec1 --phase 3 [--before 2] [--group 8]

--before K also prints when the group's last block reached phase K, so the step between K
and the phase is split from the lateness it inherits. --skip drops the first N launches
(default 1). Lines of FILE.blocks: launch, kernel, block, SM, trigger, wait, p0..p7 (µs
after the launch's first wait; "-" where not stamped).
"""
import argparse
import statistics
from collections import defaultdict


def load(path, prefix):
    # launch -> block -> (sm, [trigger, wait, p0..p7])
    launches = defaultdict(dict)
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) < 5 or not parts[1].startswith(prefix):
                continue
            times = [None if t == "-" else float(t) for t in parts[4:]]
            launches[int(parts[0])][int(parts[2])] = (int(parts[3]), times)
    return launches


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("blocks")
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--phase", type=int, default=3)
    ap.add_argument("--before", type=int)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--skip", type=int, default=1)
    a = ap.parse_args()
    launches = load(a.blocks, a.kernel)
    order = sorted(launches)[a.skip:] or sorted(launches)
    if not order:
        raise SystemExit(f"no launches of {a.kernel} in {a.blocks}")
    field = 2 + a.phase
    late = defaultdict(list)  # group -> its last block's phase time, a launch each
    before = defaultdict(list)
    sms = defaultdict(set)
    latest = defaultdict(int)  # group -> launches in which it was the latest
    for n in order:
        per = defaultdict(list)
        prev = defaultdict(list)
        for b, (sm, t) in launches[n].items():
            g = b // a.group
            sms[g].add(sm)
            if t[field] is not None:
                per[g].append(t[field])
            if a.before is not None and t[2 + a.before] is not None:
                prev[g].append(t[2 + a.before])
        if not per:
            continue
        last = {g: max(v) for g, v in per.items()}
        for g, v in last.items():
            late[g].append(v)
        for g, v in prev.items():
            before[g].append(max(v))
        latest[max(last, key=last.get)] += 1
    print(f"{a.blocks}: {a.kernel}, {len(order)} launches, groups of {a.group}, p{a.phase} of a group's last block "
          f"(µs after the first wait; median over launches, min..max)")
    for g in sorted(late, key=lambda g: statistics.median(late[g])):
        v = late[g]
        line = f"  group {g:>3}  p{a.phase} {statistics.median(v):6.2f} ({min(v):.2f}..{max(v):.2f})"
        if before[g]:
            line += f"  p{a.before} {statistics.median(before[g]):6.2f}"
        line += f"  latest {latest[g]:>3}x  SMs {sorted(sms[g])}"
        print(line)


if __name__ == "__main__":
    main()
