#!/usr/bin/env python3
"""Kernel times of one decode step from an `ncu --csv --metrics gpu__time_duration.sum` log.

    scripts/ncu-step.py ncu.csv [--list N]

The step is the launches between the last two argmax launches (a decode step ends with one).
Prints the step's total and, per kernel name, the sum, the count and the mean in microseconds,
largest first; --list N also prints the step's first N launches in order.
"""
import argparse
import collections
import csv

UNIT_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--list", type=int, default=0, metavar="N")
    a = ap.parse_args()
    with open(a.log) as f:
        rows = [r for r in csv.DictReader(l for l in f if not l.startswith("=="))
                if r.get("Metric Name") == "gpu__time_duration.sum"]
    runs = [(r["Kernel Name"].split("(")[0],
             float(r["Metric Value"].replace(",", "")) * UNIT_US.get(r["Metric Unit"], 1.0)) for r in rows]
    marks = [i for i, (n, _) in enumerate(runs) if n.startswith("argmax")]
    lo, hi = (marks[-2] + 1, marks[-1] + 1) if len(marks) >= 2 else (0, len(runs))
    step = runs[lo:hi]
    agg = collections.OrderedDict()
    for n, us in step:
        c, t = agg.get(n, (0, 0.0))
        agg[n] = (c + 1, t + us)
    print(f"step: {len(step)} launches, {sum(us for _, us in step):.1f} us")
    for n, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"{t:9.1f} us  {c:4d} x {t / c:7.2f}  {n}")
    for n, us in step[:a.list]:
        print(f"{us:8.2f}  {n}")


if __name__ == "__main__":
    main()
