#!/usr/bin/env python3
"""fp8 against bf16 on the GPT's training step (issue 45): bench/gpt_throughput.cpp run with --precision bf16 and
--precision fp8 (each fp8 backend), alternating, in one invocation; medians over the rounds, the ratio to bf16's
tokens/s, the peak of allocated device memory, and the loss after the same steps (random tokens: a check that fp8
trains like bf16, not a quality figure).

  python3 bench/fp8_vs_bf16.py --shape tiny --cpu                      # the CPU: the fp8 path's cost
  python3 bench/fp8_vs_bf16.py --shape wide --rounds 3 --json out.json # a GPU (target: fp8 >= 1.25x bf16)
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
from gpt_throughput import SHAPES  # noqa: E402

RUNS = {"bf16": ("bf16", None), "fp8_ao": ("fp8", "AO"), "fp8_te": ("fp8", "TE")}


def run(name, a):
    precision, backend = RUNS[name]
    layers, width, heads, seq, batch = SHAPES[a.shape]
    cmd = [os.path.join(a.build, "bin", "gpt_throughput"), "--n_layer", layers, "--d_model", width, "--n_head", heads,
           "--seq_len", seq, "--batch_size", batch, "--warmup", a.warmup, "--steps", a.steps, "--precision", precision]
    cmd = [str(c) for c in cmd] + (["--cpu"] if a.cpu else [])
    env = dict(os.environ)
    if backend:  # as `xlr8 launch --mixed_precision fp8 --fp8_backend ...` exports them
        env.update({"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_FP8_BACKEND": backend})
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=BUILD)
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--runs", default="bf16,fp8_ao,fp8_te")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--json")
    a = p.parse_args()
    names = a.runs.split(",")
    results = {n: [] for n in names}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # each round starts with another run
        for n in order:
            results[n].append(run(n, a))
            print(f"round {r + 1} {n}: {results[n][-1]['tokens_per_s']:.0f} tokens/s, loss {results[n][-1]['loss']:.4f}",
                  flush=True)
    base = statistics.median(x["tokens_per_s"] for x in results[names[0]])
    table = {}
    print(f"\nshape {a.shape} {SHAPES[a.shape]} (layers, width, heads, sequence, batch), {a.rounds} rounds, medians")
    print(f"{'run':8} {'tokens/s':>12} {'vs ' + names[0]:>9} {'step ms':>9} {'peak MiB':>9} {'loss':>8}")
    for n in names:
        rows = results[n]
        tps = statistics.median(x["tokens_per_s"] for x in rows)
        peak = rows[-1].get("peak_device_bytes")
        table[n] = {"tokens_per_s": tps, "ratio": tps / base, "step_ms": statistics.median(x["step_ms"] for x in rows),
                    "peak_device_bytes": peak, "loss": statistics.median(x["loss"] for x in rows),
                    "device": rows[-1]["device"]}
        peak_text = f"{peak / 2**20:9.0f}" if peak else f"{'-':>9}"
        print(f"{n:8} {tps:12.0f} {tps / base:8.2f}x {table[n]['step_ms']:9.1f} {peak_text} {table[n]['loss']:8.4f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": a.shape, "rounds": a.rounds, "runs": table}, f, indent=1)


if __name__ == "__main__":
    main()
