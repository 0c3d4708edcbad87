#!/usr/bin/env python3
"""The table of scripts/gpu-check's offload step (issue 47): each run's loss, tokens/s, the ratio against the same
strategy without offload (the run named by the part before the first '_offload' / '_nvme'), and where its training
state lived: bytes on the device and in host memory on rank 0, and the disk tier's swap files and throughput.

    scripts/offload_summary.py OUT_DIR RUN [RUN ...]     (reads OUT_DIR/offload_RUN.log, the gpt example's JSON line)
"""
import json
import re
import sys


def last_json(path):
    try:
        lines = [line for line in open(path, encoding="utf-8", errors="replace") if line.startswith("{")]
    except FileNotFoundError:
        return None
    return json.loads(lines[-1]) if lines else None


def disk(result):
    """Bytes in the swap files and bytes moved, optimizer and parameters together; the optimizer swap's GB/s."""
    opt = result.get("optimizer_on_disk") or {}
    par = result.get("parameters_on_disk") or {}
    files = sum(int(s.get("swap_file_bytes", 0)) for s in (opt, par))
    moved = sum(int(s.get(k, 0)) for s in (opt, par) for k in ("swap_bytes_read", "swap_bytes_written"))
    return files, moved, float(opt.get("swapped_step_gb_per_s", 0.0))


def main():
    out_dir, runs = sys.argv[1], sys.argv[2:]
    results = {run: last_json(f"{out_dir}/offload_{run}.log") for run in runs}
    print("| run | final loss | tokens/s | / without offload | device state bytes | host state bytes "
          "| swap file bytes | swapped bytes | optimizer swap GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    failed = 0
    for run in runs:
        r = results[run]
        if r is None:
            failed += 1
            print(f"| {run} | FAILED (see offload_{run}.log) | | | | | | | |")
            continue
        base = results.get(re.split(r"_(offload|nvme)", run)[0])
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base and base is not r else ""
        files, moved, gbps = disk(r)
        print(f"| {run} | {r['final_train_loss']:.4f} | {r['tokens_per_s']:,.0f} | {ratio} "
              f"| {r['device_state_bytes_rank0']:,} | {r['host_state_bytes_rank0']:,} | {files:,} | {moved:,} "
              f"| {gbps:.2f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
