#!/usr/bin/env python3
"""Pipeline against data parallelism on the GPT (issue 46): examples/gpt_deepspeed --pipeline (the GPT as layer
specs, engine->train_batch) on 2 processes as pp 2 (1F1B over the accumulation steps' micro-batches) and as
DDP 2 (pp 1: each rank runs every layer on half the batch), at the same global batch and steps, with one process
as the baseline, in one invocation, alternating over rounds; the median tokens/s of each and their ratios. Both
layouts train the same losses (tests/multiprocess/test_pipeline_deepspeed.cpp). A pipeline divides the model's
memory, not its work: on two cores it cannot beat DDP, whose ranks never wait for each other's activations.

  python3 bench/pipeline_vs_ddp.py                       # d_model 256, 4 layers, batch 32 in 8 micro-batches
  python3 bench/pipeline_vs_ddp.py --json out.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_common import BUILD  # noqa: E402

LAYOUTS = {"one process": (1, []), "DDP 2": (2, ["--parallelism_config_dp_shard_size", "2"]),
           "pp 2": (2, ["--parallelism_config_pp_size", "2"])}


def run(a, json_path, processes, flags):
    cmd = [os.path.join(a.build, "bin", "xlr8"), "launch", "--num_processes", str(processes), *flags,
           os.path.join(a.build, "bin", "gpt_deepspeed"), "--deepspeed_config", json_path, "--pipeline",
           "--max_steps", str(a.steps), "--n_layer", str(a.n_layer), "--d_model", str(a.d_model), "--n_head",
           str(a.n_head), "--seq_len", str(a.seq_len)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    line = [l for l in out.stdout.splitlines() if '"tokens_per_s"' in l][-1]
    return json.loads(line[line.index("{"):])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=BUILD)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro_batches", type=int, default=8)
    p.add_argument("--json")
    a = p.parse_args()
    config = {"train_batch_size": a.batch, "gradient_accumulation_steps": a.micro_batches, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "steps_per_print": 1000}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    speeds = {name: [] for name in LAYOUTS}
    losses = {}
    for _ in range(a.rounds):
        for name, (processes, flags) in LAYOUTS.items():
            r = run(a, f.name, processes, flags)
            speeds[name].append(r["tokens_per_s"])
            losses[name] = r["losses"][-1]
    median = {name: statistics.median(v) for name, v in speeds.items()}
    result = {"shape": vars(a), "tokens_per_s": median, "last_loss": losses,
              "ratio_to_one_process": {n: median[n] / median["one process"] for n in median},
              "pp2_over_ddp2": median["pp 2"] / median["DDP 2"]}
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
