#!/usr/bin/env python3
"""Throughput of one GPT training step: xlr8 (bench/gpt_throughput.cpp) against the same model in plain
PyTorch eager and under torch.compile (bench/gpt_torch.py), in one invocation.

Runs alternate (each round rotates the order of the implementations), warm-up steps are excluded, each run is
timed after the device finishes; the table shows medians over the rounds, the ratios of xlr8 to each
baseline, the peak of allocated device memory and, on a GPU, the model FLOP utilisation:
    FLOPs per token = 6 N + 12 L d T   (N parameters, L layers, d width, T sequence: PaLM's appendix B)
    MFU = tokens/s x FLOPs per token / the device's dense bf16 peak (--peak_tflops, 989 for H100 SXM / H200).

  python3 bench/gpt_throughput.py --build build                       # the CPU: the tiny shape, no MFU
  python3 bench/gpt_throughput.py --build B --shapes small,wide --rounds 3 --json out.json   # a GPU
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# name: layers, width, heads, sequence, batch (windows per step)
SHAPES = {
    "tiny": (2, 64, 2, 64, 4),
    "cpu_wide": (4, 256, 4, 128, 8),  # wide enough on the CPU for the gemms to dominate (fp8's cost)
    "small": (12, 768, 12, 1024, 16),  # GPT-2 small's body
    "wide": (24, 2048, 16, 2048, 8),
}
IMPLS = ["xlr8", "torch_eager", "torch_compile"]


def command(impl, shape, a):
    layers, width, heads, seq, batch = SHAPES[shape]
    flags = ["--n_layer", layers, "--d_model", width, "--n_head", heads, "--seq_len", seq, "--batch_size", batch,
             "--warmup", a.warmup, "--steps", a.steps, "--precision", a.precision]
    flags = [str(f) for f in flags] + (["--cpu"] if a.cpu else [])
    if impl == "xlr8":
        return [os.path.join(a.build, "bin", "gpt_throughput")] + flags
    return [a.python, os.path.join(HERE, "gpt_torch.py")] + flags + (["--compile"] if impl == "torch_compile" else [])


def run_one(impl, shape, a):
    env = dict(os.environ, XLR8_PROGRESS="off")
    began = time.monotonic()
    try:
        done = subprocess.run(command(impl, shape, a), capture_output=True, text=True, timeout=a.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "error": f"timed out after {a.timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stdout + done.stderr).strip().splitlines()[-6:]
        return {"impl": impl, "error": f"exit {done.returncode}: " + " | ".join(tail)}
    result = json.loads(lines[-1])
    result["wall_s"] = time.monotonic() - began
    return result


def flops_per_token(shape, parameters):
    layers, width, _, seq, _ = SHAPES[shape]
    return 6 * parameters + 12 * layers * width * seq


def summarise(shape, runs, a):
    rows = {}
    for impl in a.impls:
        ok = [r for r in runs if r["impl"] == impl and "error" not in r]
        errors = [r["error"] for r in runs if r["impl"] == impl and "error" in r]
        if not ok:
            rows[impl] = {"error": errors[0] if errors else "not run"}
            continue
        tps = statistics.median(r["tokens_per_s"] for r in ok)
        row = {"tokens_per_s": tps, "tokens_per_s_runs": [round(r["tokens_per_s"]) for r in ok],
               "step_ms": statistics.median(r["step_ms"] for r in ok), "parameters": ok[0]["parameters"],
               "peak_device_bytes": max((r["peak_device_bytes"] or 0) for r in ok), "loss": ok[-1]["loss"],
               "device": ok[0]["device"], "failed_runs": len(errors)}
        if row["device"].startswith("cuda"):
            row["mfu"] = tps * flops_per_token(shape, row["parameters"]) / (a.peak_tflops * 1e12)
        rows[impl] = row
    base = rows.get("xlr8", {}).get("tokens_per_s")
    for impl, row in rows.items():
        if base and impl != "xlr8" and "tokens_per_s" in row:
            row["xlr8_ratio"] = base / row["tokens_per_s"]
    return rows


def print_table(summary, a):
    print(f"| shape | implementation | tokens/s (median of {a.rounds}) | runs | step ms | xlr8 / this | peak device "
          "memory | MFU | loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, rows in summary.items():
        for impl, r in rows.items():
            if "error" in r:
                print(f"| {shape} | {impl} | failed: {r['error'][:160]} | | | | | | |")
                continue
            ratio = f"{r['xlr8_ratio']:.3f}" if "xlr8_ratio" in r else ""
            mfu = f"{100 * r['mfu']:.1f} %" if "mfu" in r else ""
            peak = f"{r['peak_device_bytes'] / 2**30:.2f} GiB" if r["peak_device_bytes"] else ""
            print(f"| {shape} | {impl} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s_runs']} | {r['step_ms']:.1f} | "
                  f"{ratio} | {peak} | {mfu} | {r['loss']:.4f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build", help="the build folder with bin/gpt_throughput")
    ap.add_argument("--shapes", default=None, help="comma-separated, of " + ", ".join(SHAPES) +
                    " (default: small,wide on a GPU, tiny on the CPU)")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--rounds", type=int, default=3, help="runs of each implementation, alternated")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even with a GPU")
    ap.add_argument("--peak_tflops", type=float, default=989.0, help="the device's dense bf16 peak")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--python", default=sys.executable, help="the Python whose torch runs the baselines")
    ap.add_argument("--json", help="write every run and the summary here")
    a = ap.parse_args()
    a.impls = a.impls.split(",")
    import torch  # the baselines' torch: which device they will see
    on_gpu = torch.cuda.is_available() and not a.cpu
    a.cpu = not on_gpu
    shapes = (a.shapes or ("small,wide" if on_gpu else "tiny")).split(",")
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    print(f"device: {device}; torch {torch.__version__}; {a.rounds} rounds of {a.warmup} + {a.steps} steps; "
          f"{a.precision}", flush=True)
    runs, summary = {s: [] for s in shapes}, {}
    for shape in shapes:
        for k in range(a.rounds):
            for impl in a.impls[k % len(a.impls):] + a.impls[:k % len(a.impls)]:
                result = run_one(impl, shape, a)
                runs[shape].append(result)
                print(f"  {shape} round {k + 1} {impl}: " +
                      (result["error"] if "error" in result else
                       f"{result['tokens_per_s']:,.0f} tokens/s ({result['wall_s']:.0f} s)"), flush=True)
        summary[shape] = summarise(shape, runs[shape], a)
    print_table(summary, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "rounds": a.rounds, "steps": a.steps,
                       "warmup": a.warmup, "precision": a.precision, "peak_tflops": a.peak_tflops,
                       "summary": summary, "runs": runs}, f, indent=1)
    failed = [(s, i) for s, rows in summary.items() for i, r in rows.items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
