#!/usr/bin/env python3
"""Device time by kernel in Chrome traces (gpt_throughput --trace, gpt_torch.py --trace): where two
implementations of the same step spend the GPU differently.

  python3 bench/trace_kernels.py xlr8.json torch.json [--top 25]

Sums the duration of every event of category "kernel" (and, with --cpu, CPU operators, category
"cpu_op") by name, per trace; prints each trace's total and the names whose totals differ most.
"""
import argparse
import collections
import json


def totals(path, category):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    sums, counts = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == category and "dur" in e:
            sums[e["name"]] += float(e["dur"])
            counts[e["name"]] += 1
    return sums, counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--cpu", action="store_true", help="CPU operators instead of device kernels")
    a = ap.parse_args()
    category = "cpu_op" if a.cpu else "kernel"
    data = [totals(p, category) for p in a.traces]
    for path, (sums, counts) in zip(a.traces, data):
        print(f"{path}: {sum(sums.values()) / 1e3:.1f} ms in {sum(counts.values())} {category} events")
    names = set().union(*(s.keys() for s, _ in data))
    spread = sorted(names, key=lambda n: -(max(s[n] for s, _ in data) - min(s[n] for s, _ in data)))
    print("ms (count) per trace | name")
    for n in spread[:a.top]:
        cells = " | ".join(f"{s[n] / 1e3:8.2f} ({c[n]:4d})" for s, c in data)
        print(f"{cells} | {n[:110]}")


if __name__ == "__main__":
    main()
