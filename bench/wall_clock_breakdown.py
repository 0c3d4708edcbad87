#!/usr/bin/env python3
"""DeepSpeed's wall_clock_breakdown through the engine: do the phases (forward, backward = inner +
allreduce, step) add up to the step time the program measures around forward .. step()? And what does
timing cost? examples/gpt_deepspeed with the JSON's wall_clock_breakdown on and off, alternated REPS
times in one invocation per stage; the ratio (sum of phases) / (measured forward-to-step time) of the
main process, and tokens/s on / off.

    REPS=3 STEPS=40 STAGES="0 2 3" RANKS=2 bench/wall_clock_breakdown.py
Writes bench/wall_clock_breakdown_results.json (OUT=path elsewhere).
"""
import json
import os
import platform
import statistics
import tempfile

from bench_common import BUILD, ROOT, XLR8, run_json

REPS = int(os.environ.get("REPS", "3"))
STEPS = os.environ.get("STEPS", "40")
STAGES = [int(s) for s in os.environ.get("STAGES", "0 2 3").split()]
RANKS = int(os.environ.get("RANKS", "2"))
OUT = os.environ.get("OUT", os.path.join(ROOT, "bench", "wall_clock_breakdown_results.json"))


def config(stage, breakdown):
    return {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "steps_per_print": 20, "wall_clock_breakdown": breakdown,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 6553600,
                                  "stage3_param_persistence_threshold": 0}}


def main():
    launch = [XLR8, "launch", "--num_processes", str(RANKS), "--num_cpu_threads_per_process", "1"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in STAGES:
            cmds = {}
            for on in (True, False):
                path = os.path.join(tmp, f"zero{stage}_{on}.json")
                with open(path, "w") as f:
                    json.dump(config(stage, on), f)
                cmds[on] = launch + [os.path.join(BUILD, "bin", "gpt_deepspeed"), "--deepspeed_config", path,
                                     "--max_steps", STEPS, "--log_every", "100000"]
            sums, on_tps, off_tps, phases = [], [], [], []
            for rep in range(REPS):
                timed = run_json(cmds[True])
                w = timed["wall_clock_ms"]
                total = w["forward"] + w["backward"] + w["step"]
                sums.append(total / timed["measured_step_ms"])
                phases.append(w)
                on_tps.append(timed["tokens_per_s"])
                off_tps.append(run_json(cmds[False])["tokens_per_s"])
                print(f"zero{stage} rep {rep + 1}: phases {total:.0f} ms of {timed['measured_step_ms']:.0f} ms measured "
                      f"({sums[-1]:.3f}); {w}; tokens/s on {on_tps[-1]:.0f} off {off_tps[-1]:.0f}", flush=True)
            rows.append({"stage": stage, "ranks": RANKS, "phases_over_measured": sums, "phases_ms": phases,
                         "median_phases_over_measured": statistics.median(sums),
                         "median_tokens_per_s_on_over_off": statistics.median([a / b for a, b in zip(on_tps, off_tps)])})
    result = {"machine": f"{platform.node()} {os.cpu_count()} cores", "steps": STEPS, "reps": REPS, "rows": rows,
              "command": f"REPS={REPS} STEPS={STEPS} STAGES=\"{' '.join(map(str, STAGES))}\" RANKS={RANKS} "
                         "bench/wall_clock_breakdown.py"}
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)
    print("| stage | ranks | (fwd + bwd + step) / measured step time (median) | tokens/s breakdown on / off (median) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| zero{r['stage']} | {r['ranks']} | {r['median_phases_over_measured']:.3f} | "
              f"{r['median_tokens_per_s_on_over_off']:.3f} |")


if __name__ == "__main__":
    main()
