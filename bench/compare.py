#!/usr/bin/env python3
"""The bench/run driver: alternating runs, medians, ratios, a table and bench/results.json."""
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("XLR8_BUILD_DIR", os.path.join(ROOT, "build"))
XLR8 = os.path.join(BUILD, "bin", "xlr8")
BENCH = os.path.join(BUILD, "bin", "xlr8-bench")
PYBENCH = [sys.executable, os.path.join(ROOT, "bench", "torch_ddp.py")]
REPS = int(os.environ.get("REPS", "5"))
STEPS = os.environ.get("STEPS", "50")
MODELS = os.environ.get("MODELS", "mlp transformer").split()
SPEC = {"mlp": {"batch": "64", "steps": STEPS, "warmup": "5"},
        "transformer": {"batch": "8", "steps": str(min(int(STEPS), 20)), "warmup": "3"}}


def launch(n, cmd):
    return [XLR8, "launch", "--num_processes", str(n), "--num_cpu_threads_per_process", "1"] + cmd


# glibc settings equal to xlr8's allocator tuning (ProcessState), for baselines run on equal terms.
TUNED_MALLOC = ["/usr/bin/env", "GLIBC_TUNABLES=glibc.malloc.mmap_threshold=134217728:glibc.malloc.trim_threshold=268435456"]


def configs(model):
    s = SPEC[model]
    only = os.environ.get("ONLY", "").split()  # e.g. ONLY="b_xlr8_1 c_xlr8_ddp_2": just those configs
    args = ["--model", model, "--batch", s["batch"], "--steps", s["steps"], "--warmup", s["warmup"], "--threads", "1"]
    every = {
        "a_handwritten_1": [BENCH, "--impl", "handwritten"] + args,
        "a2_handwritten_1_tuned_malloc": TUNED_MALLOC + [BENCH, "--impl", "handwritten"] + args,
        "b_xlr8_1": [BENCH, "--impl", "xlr8"] + args,
        # Two unrelated single processes at once: the most 2 ranks could reach on this machine with no
        # communication at all (they still share memory bandwidth and caches).
        "h_two_independent_xlr8_1": Together([[BENCH, "--impl", "xlr8"] + args] * 2),
        "c_xlr8_ddp_2": launch(2, [BENCH, "--impl", "xlr8"] + args),
        # Diagnostic: the ranks kept in lockstep by a barrier per step, with no gradient all-reduce at all.
        "i_xlr8_2_lockstep_only": launch(2, [BENCH, "--impl", "xlr8", "--lockstep_only"] + args),
        "g_xlr8_ddp_2_gloo": ["/usr/bin/env", "XLR8_SHM=0"] + launch(2, [BENCH, "--impl", "xlr8"] + args),
        "d_pytorch_ddp_2": launch(2, PYBENCH + args),
        "d2_pytorch_ddp_2_tuned_malloc": TUNED_MALLOC + launch(2, PYBENCH + args),
        "f_xlr8_ddp_2_bf16_wire": launch(2, [BENCH, "--impl", "xlr8", "--compress_bf16"] + args),
        "e_pytorch_1": PYBENCH + args,
        # The same xlr8 runs with xlr8::optim::FusedAdamW instead of LibTorch's AdamW.
        "b_f_xlr8_1_fused_adamw": [BENCH, "--impl", "xlr8", "--optimizer", "fused_adamw"] + args,
        "h_f_two_independent_xlr8_1_fused_adamw": Together([[BENCH, "--impl", "xlr8", "--optimizer", "fused_adamw"] + args] * 2),
        "c_f_xlr8_ddp_2_fused_adamw": launch(2, [BENCH, "--impl", "xlr8", "--optimizer", "fused_adamw"] + args),
        # ZeRO-1 on 2 ranks: xlr8's (--use_deepspeed --zero_stage 1) against PyTorch's own
        # ZeroRedundancyOptimizer over DDP; both report their bytes per rank (state_bytes_per_rank).
        "z_xlr8_zero1_2": launch(2, ["--use_deepspeed", "--zero_stage", "1", "--gradient_clipping", "0", BENCH, "--impl", "xlr8"] + args),
        "z_f_xlr8_zero1_2_fused_adamw": launch(2, ["--use_deepspeed", "--zero_stage", "1", "--gradient_clipping", "0", BENCH, "--impl", "xlr8",
                                                   "--optimizer", "fused_adamw"] + args),
        "zp_pytorch_zero1_2": launch(2, PYBENCH + ["--zero"] + args),
        # (c_f) with each rank bound to its own cores (xlr8 launch --enable_cpu_affinity).
        "c_fa_xlr8_ddp_2_fused_adamw_cpu_affinity": launch(2, ["--enable_cpu_affinity", BENCH, "--impl", "xlr8",
                                                               "--optimizer", "fused_adamw"] + args),
    }
    return {name: cmd for name, cmd in every.items() if not only or name in only}


class Together(list):
    """Commands run at the same time; their result adds samples/s and takes the slowest of the rest."""


def run_json(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if isinstance(cmd, Together):
        procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for c in cmd]
        outs = [p.communicate(timeout=900) for p in procs]
        for c, p, (_, err) in zip(cmd, procs, outs):
            if p.returncode != 0:
                raise SystemExit(f"bench: {' '.join(c)} failed ({p.returncode}):\n{err[-2000:]}")
        rows = [json.loads(o[o.index("{"):].splitlines()[0]) for o, _ in outs]
        joined = {k: (max(r[k] for r in rows) if isinstance(v, float) else v) for k, v in rows[0].items()}
        joined["samples_per_s"] = sum(r["samples_per_s"] for r in rows)
        joined["nproc"] = len(rows)
        return [joined]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    lines = [l[l.index("{"):] for l in out.stdout.splitlines() if "{" in l]
    return [json.loads(l) for l in lines]


def main():
    results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d")},
               "reps": REPS, "models": {}}
    for model in MODELS:
        cfgs = configs(model)
        samples = {name: [] for name in cfgs}
        for rep in range(REPS):  # alternate, so drift in the machine affects every implementation alike
            for name, cmd in cfgs.items():
                samples[name].append(run_json(cmd)[-1])
            print(f"bench: {model} repetition {rep + 1}/{REPS} done", file=sys.stderr, flush=True)
        keys = ("step_ms_median", "samples_per_s", "peak_rss_mb", "forward_ms_median", "backward_ms_median",
                "optimizer_ms_median", "comm_wait_ms_median", "state_bytes_per_rank")
        med = {name: {k: statistics.median(r[k] for r in runs) for k in keys if k in runs[0]}
               for name, runs in samples.items()}
        sps = {k: v["samples_per_s"] for k, v in med.items()}
        step = {k: v["step_ms_median"] for k, v in med.items()}
        # (name, numerator, denominator, kind): a ratio of samples/s, or an overhead in % of step time.
        wanted = [
            ("xlr8_overhead_vs_handwritten_pct", "b_xlr8_1", "a_handwritten_1", "pct"),
            ("xlr8_overhead_vs_handwritten_same_malloc_pct", "b_xlr8_1", "a2_handwritten_1_tuned_malloc", "pct"),
            ("xlr8_ddp2_vs_xlr8_1", "c_xlr8_ddp_2", "b_xlr8_1", "x"),
            ("two_independent_vs_xlr8_1", "h_two_independent_xlr8_1", "b_xlr8_1", "x"),
            ("xlr8_ddp2_vs_two_independent", "c_xlr8_ddp_2", "h_two_independent_xlr8_1", "x"),
            ("lockstep_only_vs_two_independent", "i_xlr8_2_lockstep_only", "h_two_independent_xlr8_1", "x"),
            ("xlr8_ddp2_vs_pytorch_ddp2_same_malloc", "c_xlr8_ddp_2", "d2_pytorch_ddp_2_tuned_malloc", "x"),
            ("xlr8_ddp2_vs_pytorch_ddp2", "c_xlr8_ddp_2", "d_pytorch_ddp_2", "x"),
            ("pytorch_ddp2_vs_pytorch_1", "d_pytorch_ddp_2", "e_pytorch_1", "x"),
            ("xlr8_ddp2_bf16_wire_vs_xlr8_1", "f_xlr8_ddp_2_bf16_wire", "b_xlr8_1", "x"),
            ("xlr8_ddp2_bf16_wire_vs_pytorch_ddp2", "f_xlr8_ddp_2_bf16_wire", "d_pytorch_ddp_2", "x"),
            ("xlr8_ddp2_shm_vs_xlr8_ddp2_gloo", "c_xlr8_ddp_2", "g_xlr8_ddp_2_gloo", "x"),
            ("fused_adamw: xlr8_1_vs_xlr8_1_adamw", "b_f_xlr8_1_fused_adamw", "b_xlr8_1", "x"),
            ("fused_adamw: xlr8_ddp2_vs_xlr8_1", "c_f_xlr8_ddp_2_fused_adamw", "b_f_xlr8_1_fused_adamw", "x"),
            ("fused_adamw: two_independent_vs_xlr8_1", "h_f_two_independent_xlr8_1_fused_adamw", "b_f_xlr8_1_fused_adamw", "x"),
            ("fused_adamw: xlr8_ddp2_vs_pytorch_ddp2", "c_f_xlr8_ddp_2_fused_adamw", "d_pytorch_ddp_2", "x"),
            ("fused_adamw: xlr8_ddp2_vs_pytorch_ddp2_same_malloc", "c_f_xlr8_ddp_2_fused_adamw", "d2_pytorch_ddp_2_tuned_malloc", "x"),
            ("xlr8_zero1_2_vs_pytorch_zero1_2", "z_xlr8_zero1_2", "zp_pytorch_zero1_2", "x"),
            ("fused_adamw: xlr8_zero1_2_vs_pytorch_zero1_2", "z_f_xlr8_zero1_2_fused_adamw", "zp_pytorch_zero1_2", "x"),
            ("xlr8_zero1_2_vs_xlr8_ddp2", "z_xlr8_zero1_2", "c_xlr8_ddp_2", "x"),
            ("fused_adamw: xlr8_ddp2_cpu_affinity_vs_xlr8_1", "c_fa_xlr8_ddp_2_fused_adamw_cpu_affinity", "b_f_xlr8_1_fused_adamw", "x"),
            ("fused_adamw: xlr8_ddp2_cpu_affinity_vs_without", "c_fa_xlr8_ddp_2_fused_adamw_cpu_affinity", "c_f_xlr8_ddp_2_fused_adamw", "x"),
        ]
        ratios = {name: (step[a] / step[b] - 1) * 100 if kind == "pct" else sps[a] / sps[b]
                  for name, a, b, kind in wanted if a in med and b in med}
        results["models"][model] = {"medians": med, "ratios": ratios, "runs": samples}
        print(f"\n{model}: medians of {REPS} alternating runs")
        print(f"{'impl':<40}{'step ms':>10}{'samples/s':>12}{'peak RSS MB':>13}{'fwd ms':>9}{'bwd ms':>9}{'opt ms':>9}"
              f"{'wait ms':>9}{'state MB':>10}")
        for name, m in med.items():
            phases = "".join(f"{m[k]:>9.1f}" if k in m else f"{'-':>9}"
                             for k in ("forward_ms_median", "backward_ms_median", "optimizer_ms_median",
                                       "comm_wait_ms_median"))
            state = f"{m['state_bytes_per_rank'] / 1e6:>10.1f}" if "state_bytes_per_rank" in m else f"{'-':>10}"
            print(f"{name:<40}{m['step_ms_median']:>10.1f}{m['samples_per_s']:>12.0f}{m['peak_rss_mb']:>13.0f}{phases}{state}")
        for k, v in ratios.items():
            print(f"  {k}: {v:.3f}")
    if os.environ.get("ONLY"):
        print("\nbench: ONLY is set, so no collectives and no results.json")
        return
    # Collectives: REPS alternating invocations; per size and column, the median over invocations.
    runs = [run_json(launch(2, [BENCH, "--collectives", "--max_mb", "64"])) for _ in range(REPS)]
    coll = []
    for rows in zip(*runs):
        coll.append({k: (statistics.median(r[k] for r in rows) if isinstance(v, float) else v) for k, v in rows[0].items()})
    results["collectives"] = coll
    print(f"\ncollectives on 2 ranks (GB/s of payload, medians of {REPS} invocations; ours vs raw c10d Gloo;"
          " 'sym' = operand from symmetric_empty, read in place)")
    cols = [("all_reduce", "all_reduce_gb_per_s"), ("ar_sym", "all_reduce_symmetric_gb_per_s"),
            ("gloo_ar", "raw_gloo_all_reduce_gb_per_s"), ("red_scat", "reduce_scatter_gb_per_s"),
            ("rs_sym", "reduce_scatter_symmetric_gb_per_s"), ("gloo_rs", "raw_gloo_reduce_scatter_gb_per_s"),
            ("all_gather", "all_gather_gb_per_s"), ("gloo_ag", "raw_gloo_all_gather_gb_per_s")]
    print(f"{'bytes':>10}" + "".join(f"{name:>11}" for name, _ in cols) + f"{'ar/gloo':>9}{'ar_sym/gloo':>12}")
    for c in coll:
        if "memcpy_gb_per_s" in c:
            print(f"memcpy ceiling: {c['memcpy_gb_per_s']:.1f} GB/s")
            continue
        gloo = c["raw_gloo_all_reduce_gb_per_s"]
        print(f"{c['bytes']:>10}" + "".join(f"{c[key]:>11.2f}" for _, key in cols) +
              f"{c['all_reduce_gb_per_s'] / gloo:>9.1f}{c['all_reduce_symmetric_gb_per_s'] / gloo:>12.1f}")
    path = os.path.join(ROOT, "bench", "results.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
