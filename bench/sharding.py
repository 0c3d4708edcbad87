#!/usr/bin/env python3
"""Sharded strategies on the GPT example: tokens/s, bytes per rank and peak RSS of DDP, ZeRO-1, ZeRO-2
(SHARD_GRAD_OP) and FULL_SHARD (ZeRO-3 with Block units), fp32 and bf16, on 2 and 4 ranks. Every
configuration of one (ranks, precision) pair is alternated REPS times in one invocation; the table gives
medians and the ratio of each strategy's tokens/s to DDP's measured alongside it.

    REPS=3 STEPS=30 RANKS="2 4" PRECISIONS="no bf16" bench/sharding.py   (bench/run-sharding wraps it)
Writes bench/sharding_results.json (OUT=path elsewhere). ONLY="ddp zero3_full_shard ..." runs a subset
(DDP is always run: the ratios are to it). BASELINE_BUILD=dir (a build of another commit) runs every
configuration with that build's binaries too, alternated with this one's in each repetition, and adds
a table of this build's figures over the baseline's.
"""
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("XLR8_BUILD_DIR", os.path.join(ROOT, "build"))
BASELINE = os.environ.get("BASELINE_BUILD", "")
BUILDS = [("", BUILD)] + ([("baseline ", BASELINE)] if BASELINE else [])
REPS = int(os.environ.get("REPS", "3"))
STEPS = os.environ.get("STEPS", "30")
RANKS = [int(n) for n in os.environ.get("RANKS", "2 4").split()]
PRECISIONS = os.environ.get("PRECISIONS", "no bf16").split()
# Extra gpt flags for the model shape (default: the example's default, ~200 ms a step on 2 ranks here).
SHAPE = os.environ.get("SHAPE", "").split()

STRATEGIES = {
    "ddp": [],
    "zero1": ["--use_deepspeed", "--zero_stage", "1", "--gradient_clipping", "0"],  # unclipped, as the others
    "zero2_shard_grad_op": ["--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP"],
    "zero3_full_shard": ["--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD", "--fsdp_auto_wrap_policy",
                         "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Block"],
}
# FULL_SHARD with FSDP's prefetching: the next block's all-gather issued when a block's forward and
# backward begin.
STRATEGIES["zero3_full_shard_prefetch"] = STRATEGIES["zero3_full_shard"] + [
    "--fsdp_forward_prefetch", "true", "--fsdp_backward_prefetch", "BACKWARD_PRE"]
ONLY = os.environ.get("ONLY", "").split()
if ONLY:
    STRATEGIES = {name: flags for name, flags in STRATEGIES.items() if name in ONLY or name == "ddp"}
OUT = os.environ.get("OUT", os.path.join(ROOT, "bench", "sharding_results.json"))


def run_once(ranks, precision, flags, build=BUILD):
    xlr8, gpt = os.path.join(build, "bin", "xlr8"), os.path.join(build, "bin", "gpt")
    cmd = [xlr8, "launch", "--num_processes", str(ranks), "--num_cpu_threads_per_process", "1",
           "--mixed_precision", precision] + flags + [gpt, "--max_steps", STEPS, "--log_every", "1000",
           "--output_dir", "/tmp/xlr8-bench-sharding", "--val_windows", "16"] + SHAPE
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    line = [l for l in out.stdout.splitlines() if "{" in l][-1]
    return json.loads(line[line.index("{"):]), cmd


def main():
    results = []
    for ranks in RANKS:
        for precision in PRECISIONS:
            samples = {label + name: [] for label, _ in BUILDS for name in STRATEGIES}
            commands = {}
            for rep in range(REPS):
                for name, flags in STRATEGIES.items():  # alternated: drift hits every strategy alike
                    for label, build in BUILDS:
                        result, cmd = run_once(ranks, precision, flags, build)
                        samples[label + name].append(result)
                        commands[label + name] = " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c
                                                          for c in cmd)
            for label, _ in BUILDS:
                ddp_tps = statistics.median(r["tokens_per_s"] for r in samples[label + "ddp"])
                for name in STRATEGIES:
                    runs = samples[label + name]
                    tps = statistics.median(r["tokens_per_s"] for r in runs)
                    results.append({
                        "ranks": ranks, "precision": precision, "strategy": label + name,
                        "tokens_per_s": tps, "ratio_to_ddp": tps / ddp_tps,
                        "state_bytes_per_rank": runs[0]["state_bytes_per_rank"],
                        "peak_state_bytes_per_rank": runs[0]["peak_state_bytes_per_rank"],
                        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
                        "parameters": runs[0]["parameters"], "final_train_loss": runs[0]["final_train_loss"],
                        "command": commands[label + name]})
    print("| ranks | precision | strategy | tokens/s | × DDP | state bytes/rank | bytes/param | peak state bytes | peak RSS MB |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['ranks']} | {r['precision']} | {r['strategy']} | {r['tokens_per_s']:.0f} | {r['ratio_to_ddp']:.3f} | "
              f"{r['state_bytes_per_rank']:,} | {r['state_bytes_per_rank'] / r['parameters']:.2f} | "
              f"{r['peak_state_bytes_per_rank']:,} | {r['peak_rss_mb']:.0f} |")
    if BASELINE:
        print("\n| ranks | precision | strategy | tokens/s over baseline | state bytes over baseline | peak RSS over baseline |")
        print("|---:|---|---|---:|---:|---:|")
        base = {(r["ranks"], r["precision"], r["strategy"]): r for r in results}
        for r in results:
            b = base.get((r["ranks"], r["precision"], "baseline " + r["strategy"]))
            if b:
                print(f"| {r['ranks']} | {r['precision']} | {r['strategy']} | {r['tokens_per_s'] / b['tokens_per_s']:.3f} | "
                      f"{r['state_bytes_per_rank'] / b['state_bytes_per_rank']:.3f} | {r['peak_rss_mb'] / b['peak_rss_mb']:.3f} |")
    meta = {"date": time.strftime("%Y-%m-%d"), "baseline_build": BASELINE, "machine": platform.platform(), "cores": os.cpu_count(),
            "reps": REPS, "steps": STEPS, "shape": SHAPE}
    with open(OUT, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
