#!/usr/bin/env python3
"""The DeepSpeed engine against the Accelerator on the same GPT and the same ZeRO stage: tokens/s of
examples/gpt_deepspeed (xlr8::deepspeed::initialize from a JSON) over examples/gpt (Accelerator, launched
with --use_deepspeed --zero_stage S), alternated REPS times in one invocation; medians and the ratio.

    REPS=5 STEPS=40 STAGES="2 3" RANKS=2 bench/deepspeed_engine.py
The JSON matches what the Accelerator run does: micro-batch 16, no accumulation, no clipping (the
example does not clip), LibTorch's AdamW defaults at lr 3e-4 (weight decay 0.01), no scheduler, the
Accelerator's 25 MB gradient buckets (6,553,600 float32 elements) and no persistence threshold (DeepSpeed's
default of 100,000 elements would keep every tensor of this small model whole). examples/gpt also measures its own
memory every step (two walks over parameters and optimizer state), which the engine example does not.
Writes bench/deepspeed_engine_results.json (OUT=path elsewhere).
"""
import json
import os
import platform
import statistics
import tempfile

from bench_common import BUILD, ROOT, XLR8, run_json

REPS = int(os.environ.get("REPS", "5"))
STEPS = os.environ.get("STEPS", "40")
STAGES = [int(s) for s in os.environ.get("STAGES", "2 3").split()]
RANKS = int(os.environ.get("RANKS", "2"))
OUT = os.environ.get("OUT", os.path.join(ROOT, "bench", "deepspeed_engine_results.json"))


def config(stage):
    return {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": 100000,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 6553600,
                                  "stage3_param_persistence_threshold": 0}}


def run(cmd):
    return run_json(cmd)["tokens_per_s"]


def main():
    launch = [XLR8, "launch", "--num_processes", str(RANKS), "--num_cpu_threads_per_process", "1"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in STAGES:
            path = os.path.join(tmp, f"zero{stage}.json")
            with open(path, "w") as f:
                json.dump(config(stage), f)
            accelerator = launch + ["--use_deepspeed", "--zero_stage", str(stage), "--gradient_clipping", "0", os.path.join(BUILD, "bin", "gpt"),
                                    "--max_steps", STEPS, "--log_every", "100000", "--batch_size", "16",
                                    "--output_dir", os.path.join(tmp, "gpt"), "--val_windows", "16"]
            engine = launch + [os.path.join(BUILD, "bin", "gpt_deepspeed"), "--deepspeed_config", path,
                               "--max_steps", STEPS, "--log_every", "100000"]
            a, e = [], []
            for rep in range(REPS):  # alternated, so that drift in the machine's speed hits both alike
                a.append(run(accelerator))
                e.append(run(engine))
                print(f"zero{stage} rep {rep + 1}: accelerator {a[-1]:.0f} tokens/s, engine {e[-1]:.0f} tokens/s",
                      flush=True)
            ratios = [x / y for x, y in zip(e, a)]
            rows.append({"stage": stage, "ranks": RANKS, "accelerator_tokens_per_s": a, "engine_tokens_per_s": e,
                         "median_ratio_engine_over_accelerator": statistics.median(ratios),
                         "median_accelerator": statistics.median(a), "median_engine": statistics.median(e)})
    result = {"machine": f"{platform.node()} {os.cpu_count()} cores", "steps": STEPS, "reps": REPS, "rows": rows,
              "command": f"REPS={REPS} STEPS={STEPS} STAGES=\"{' '.join(map(str, STAGES))}\" RANKS={RANKS} "
                         "bench/deepspeed_engine.py"}
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)
    print("| stage | ranks | Accelerator tokens/s (median) | engine tokens/s (median) | engine / Accelerator (median of pairs) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| zero{r['stage']} | {r['ranks']} | {r['median_accelerator']:.0f} | {r['median_engine']:.0f} | "
              f"{r['median_ratio_engine_over_accelerator']:.3f} |")


if __name__ == "__main__":
    main()
