#!/usr/bin/env python3
"""Pipeline schedules (issue 46): each stage's idle fraction measured from its own trace (the seconds
Pipeline::step spent waiting for a neighbour over its seconds in the step, steps after the first) against the
schedule's formula (p - 1) / (v m + p - 1) (InterleavedZeroBubble's (p - 1) / (3 v m + p - 1)); the most
micro-batches whose activations a stage held at once (1F1B: at most p - stage, GPipe: all m, InterleavedZeroBubble:
p); and the point-to-point bytes a stage sent in a step against the formula
(2 x micro-batches x chunks' boundary tensors, plus their headers). examples/pipeline through `xlr8 launch`, every
schedule in one invocation, alternating over rounds; medians.

  python3 bench/pipeline_bubble.py --stages 2 --micro_batches 4,8       # this 2-core machine: p = 2
  python3 bench/pipeline_bubble.py --stages 4 --micro_batches 8 --json out.json
  python3 bench/pipeline_bubble.py --stages 4 --micro_batches 4,8 --simulated_ms 20 --width 16 --batch 64
      # p = 4 on 2 cores: each of 8 equal blocks sleeps 20 ms forward and 40 ms backward instead of computing, so
      # the stages wait only for each other; the idle fraction the schedule itself leaves
  python3 bench/pipeline_bubble.py --stages 2 --micro_batches 8 --schedules 1F1B,InterleavedZeroBubble \
      --checkpoint_intervals 0,1
      # each schedule with and without every block recomputed in backward (activation checkpointing per stage):
      # the zero-bubble schedule splits the recomputed regions' backwards too ("split regions")
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_common import BUILD  # noqa: E402

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"]


def run(a, schedule, m, interval):
    cmd = [os.path.join(a.build, "bin", "xlr8"), "launch", "--num_processes", str(a.stages),
           "--parallelism_config_pp_size", str(a.stages), "--parallelism_config_pp_schedule", schedule,
           "--parallelism_config_pp_microbatches", str(m), os.path.join(a.build, "bin", "pipeline"),
           "--steps", str(a.steps), "--width", str(a.width), "--batch_size", str(a.batch)]
    if interval > 0:
        cmd += ["--checkpoint_interval", str(interval)]
    if a.simulated_ms > 0:
        cmd += ["--simulated_ms", str(a.simulated_ms), "--equal_blocks", str(a.equal_blocks)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    line = [l for l in out.stdout.splitlines() if '"pipeline"' in l][-1]
    return json.loads(line[line.index("{"):])["pipeline"]


def boundary_bytes(a, schedule, m, stage):
    """What a stage sends in a step: each micro-batch's activation forward (all but the last virtual stage) and its
    gradient backward (all but the first), fp32 [batch / m, width] each, with a 10-int64 header."""
    v = 2 if schedule == "Interleaved1F1B" else 1
    one = (a.batch // m) * a.width * 4 + 10 * 8
    virtual = [c * a.stages + stage for c in range(v)]
    last = a.stages * v - 1
    sends = sum((vs != last) + (vs != 0) for vs in virtual)
    return sends * m * one


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=BUILD)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro_batches", default="4,8")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=192)
    p.add_argument("--simulated_ms", type=float, default=0,
                   help="each block's forward sleeps this long, its backward twice that (stages of equal, known times "
                        "that share few cores without contending); the blocks are --equal_blocks of one width")
    p.add_argument("--equal_blocks", type=int, default=8)
    p.add_argument("--checkpoint_intervals", default="0",
                   help="comma-separated: each case also runs with each run of that many layers recomputed (0: none)")
    p.add_argument("--json")
    a = p.parse_args()
    cases = [(s, int(m), int(i)) for m in a.micro_batches.split(",") for i in a.checkpoint_intervals.split(",")
             for s in a.schedules.split(",")]
    runs = {c: [] for c in cases}
    for r in range(a.rounds):
        for c in cases[r % len(cases):] + cases[:r % len(cases)]:
            runs[c].append(run(a, *c))
    table = []
    for (schedule, m, interval), rounds in runs.items():
        for stage in range(a.stages):
            mine = [next(x for x in rnd if x["stage"] == stage) for rnd in rounds]
            row = {"schedule": schedule, "micro_batches": m, "checkpoint_interval": interval, "stage": stage,
                   "idle_measured": statistics.median(x["idle_fraction"] for x in mine),
                   "step_seconds": statistics.median(x["mean_step_seconds"] for x in mine),
                   "idle_formula": mine[0]["bubble_formula"],
                   "peak_held": mine[0]["peak_held_micro_batches"],
                   "bytes_sent": mine[0]["bytes_sent"], "bytes_formula": boundary_bytes(a, schedule, m, stage),
                   "whole_backwards": mine[0].get("whole_backwards", 0),
                   "split_regions": mine[0].get("split_regions", 0)}
            table.append(row)
            recomputed = f" ckpt {interval}" if interval else ""
            print(f"{schedule:21} m {m:2}{recomputed} stage {stage}: step {row['step_seconds']:.4f} s, idle {row['idle_measured']:.3f} (formula "
                  f"{row['idle_formula']:.3f}), held {row['peak_held']:2} micro-batches, sent {row['bytes_sent']} B "
                  f"(formula {row['bytes_formula']}), whole backwards {row['whole_backwards']}, split regions "
                  f"{row['split_regions']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"stages": a.stages, "width": a.width, "batch": a.batch, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
