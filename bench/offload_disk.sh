#!/bin/sh
# Offload's disk tier, the headline of issue 47: a GPT whose fp32 training state (parameters, gradients and AdamW's
# two moments: 16 bytes a parameter) is larger than this machine's memory trains with its parameter shards and
# optimizer state on disk (ZeRO-3, offload_param and offload_optimizer device nvme), one process. Reported: the
# state's bytes, the process's peak RSS (/usr/bin/time), the swap files' size and the bytes moved, and the disk's
# own direct-I/O speed (dd) against the swap's in the same run.
# PREFETCH_BUCKET=0 (stage3_prefetch_bucket_size; DeepSpeed's default 5e7 when unset) turns off fetching ahead,
# the parameter shards' read-ahead from disk included.
# GRADIENTS="0 1" runs the training twice in this invocation, with the gradients in memory and then on disk too
# (XLR8_GRADIENTS_ON_DISK=1: each group's reduced gradient waits for the step in the swap file); default "0".
# ZERO3_INIT="0 1" runs without and then with DeepSpeed's zero3_init_flag (default "0"): the build is recorded, not
# run, and each unit's group computes its own values when it is made (bitwise the whole build's), so the model is
# never whole in memory.
# Usage: [ZERO3_INIT=0 LAYERS=40 WIDTH=2048 HEADS=16 STEPS=3 MAX_LIVE=100000000 PREFETCH_BUCKET=50000000 CHECKPOINT=0 GRADIENTS=0 SWAP=/var/tmp/xlr8-swap-bench] bench/offload_disk.sh [build-dir]
set -eu
. "$(dirname "$0")/common.sh"
LAYERS=${LAYERS:-40}; WIDTH=${WIDTH:-2048}; STEPS=${STEPS:-3}; SWAP=${SWAP:-/var/tmp/xlr8-swap-bench}
mkdir -p "$SWAP"
trap 'rm -rf "$OUT" "$SWAP"' EXIT
echo "disk: dd with direct I/O, 2 GiB each way, in $SWAP"
dd if=/dev/zero of="$SWAP/dd.bin" bs=1M count=2048 oflag=direct 2>&1 | tail -1
dd if="$SWAP/dd.bin" of=/dev/null bs=1M iflag=direct 2>&1 | tail -1
rm -f "$SWAP/dd.bin"
# DeepSpeed's JSON: both sections on disk, two parameter buffers, at most 1e8 gathered parameters kept live
# (DeepSpeed's default, 1e9, would keep 4 GB of gathered units in memory between uses), and each Block one unit
# (leaf_module): its attention and MLP open no guard of their own, so as units of their own they would stay
# gathered through the whole first step (until the first backward shows they ride with their block).
cat >"$OUT/ds.json" <<JSON
{"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
 "zero_optimization": {"stage": 3, "stage3_max_live_parameters": ${MAX_LIVE:-100000000},
   "stage3_prefetch_bucket_size": ${PREFETCH_BUCKET:-50000000},
   "leaf_module": {"classes": ["Block"]},
   "offload_optimizer": {"device": "nvme", "nvme_path": "$SWAP", "buffer_count": 4},
   "offload_param": {"device": "nvme", "nvme_path": "$SWAP", "buffer_count": 2}},
 "aio": {"block_size": 1048576, "intra_op_parallelism": 2}}
JSON
# One launch, reported: the losses, the state's size, what moved, the peak RSS. $1: the run's name; the rest: flags.
run_gpt() {
  name=$1; shift
  /usr/bin/time -v "$X" launch --num_processes 1 --use_deepspeed --deepspeed_config_file "$OUT/ds.json" \
    --zero3_init_flag "$([ "${init:-0}" = 1 ] && echo true || echo false)" \
    "$G" --n_layer "$LAYERS" --d_model "$WIDTH" --n_head "${HEADS:-16}" --seq_len 64 --batch_size 1 \
    --lr 3e-5 --val_windows 4 --log_every 1 --output_dir "$OUT/run" "$@" >"$OUT/stdout" 2>"$OUT/stderr" || {
    tail -30 "$OUT/stderr"; exit 1; }
  echo "== $name"
  grep -E "step|loss" "$OUT/stdout" | tail -8
  python3 - "$(grep '^{' "$OUT/stdout" | tail -1)" <<'EOF'
import json, sys
r = json.loads(sys.argv[1])
n = r["parameters"]
o, p = r.get("optimizer_on_disk") or {}, r.get("parameters_on_disk") or {}
print(f"parameters {n/1e9:.3f} G: fp32 training state {16*n/1e9:.1f} GB (parameters, gradients, 2 moments)")
print(f"final train loss {r['final_train_loss']:.4f}, val {r['val_loss']:.4f}, tokens/s {r['tokens_per_s']:.1f}")
print(f"setup peak {r.get('setup_peak_rss_mb_by_rank',[0])[0]/1024:.2f} GiB (building and preparing the model; "
      f"groups computing their own values: {r.get('groups_computed_when_made',0)})")
print(f"resident between steps {r.get('between_steps_rss_mb',0)/1024:.2f} GiB (after the last step; the heap trimmed "
      f"after each step in {r.get('heap_trim_seconds',0):.2f} s in all)")
print(f"swap files: state {o.get('swap_file_bytes',0)/1e9:.1f} GB, parameters {p.get('swap_file_bytes',0)/1e9:.1f} GB")
read = o.get("swap_bytes_read", 0) + p.get("swap_bytes_read", 0)
written = o.get("swap_bytes_written", 0) + p.get("swap_bytes_written", 0)
print(f"parameter shards: {p.get('shard_reads',0)} reads, {p.get('swap_reads_ahead',0)} started ahead, "
      f"{p.get('swap_reads_found_ahead',0)} found coming")
print(f"moved: read {read/1e9:.1f} GB, written {written/1e9:.1f} GB; optimizer steps' swap GB/s "
      f"{o.get('swapped_step_gb_per_s',0):.2f} over {o.get('swapped_step_seconds',0):.0f} s")
if o.get("gradients_on_disk"):
    print(f"gradients on disk: {o.get('gradient_writes',0)} writes, {o.get('gradient_reads',0)} reads by the steps, "
          f"{o.get('gradient_reads_for_norms',0)} for norms")
print(f"save_state {r.get('save_state_seconds',0):.0f} s, load_state {r.get('load_state_seconds',0):.0f} s; groups of "
      f"state in memory at once for a checkpoint: at most {o.get('checkpoint_groups_in_memory_most',0)} of "
      f"{o.get('swapped_groups',0)}")
EOF
  grep -E "Maximum resident set size|Elapsed \(wall" "$OUT/stderr"
}

# CHECKPOINT=1: the run saves a checkpoint after its last step (save_state), and a second run resumes from it
# (load_state) for one step more: the state on disk goes to the checkpoint and back one group at a time.
if [ "${CHECKPOINT:-0}" = 1 ]; then
  run_gpt "train $STEPS steps, then save_state" --max_steps "$STEPS" --checkpoint_every "$STEPS"
  du -sh "$OUT/run/checkpoints"/* | tail -1
  run_gpt "resume (load_state), 1 step more" --max_steps "$((STEPS + 1))" --resume_from latest
else
  for init in ${ZERO3_INIT:-0}; do
    for on in ${GRADIENTS:-0}; do
      if [ "$on" = 1 ]; then export XLR8_GRADIENTS_ON_DISK=1; else unset XLR8_GRADIENTS_ON_DISK; fi
      run_gpt "train $STEPS steps, gradients $([ "$on" = 1 ] && echo on disk || echo in memory), zero3_init_flag $init" \
        --max_steps "$STEPS"
    done
  done
fi
