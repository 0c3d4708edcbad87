#!/bin/sh
# Activation checkpointing (fsdp_activation_checkpointing) on the GPT example: peak resident memory and
# tokens/s with and without it, at growing sequence lengths, alternated REPS times in one invocation. One
# process under FSDP (FULL_SHARD over 1 rank: the parameters stay whole), every Block a unit.
# Usage: bench/activation_checkpointing.sh [build dir]   (REPS=2 STEPS=4 SEQS="256 512 1024" by default)
set -eu
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
FSDP="--use_fsdp --fsdp_sharding_strategy FULL_SHARD --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap Block"
rep=1
while [ "$rep" -le "${REPS:-2}" ]; do
  for seq in ${SEQS:-256 512 1024}; do
    for ac in false true; do
      # shellcheck disable=SC2086
      line=$($X launch --num_processes 1 $FSDP --fsdp_activation_checkpointing $ac "$G" --n_layer 4 --d_model 128 \
        --n_head 4 --seq_len "$seq" --batch_size 4 --max_steps "${STEPS:-4}" --val_windows 4 --log_every 1000 \
        --output_dir "$OUT/run" 2>&1 | tail -1)
      echo "rep $rep seq_len $seq checkpointing $ac peak_rss_mb $(echo "$line" | field peak_rss_mb) tokens_per_s $(echo "$line" | field tokens_per_s) final_train_loss $(echo "$line" | field final_train_loss)"
    done
  done
  rep=$((rep + 1))
done

# The longest sequence that trains under a memory limit (LIMIT_MB, 1024 by default): each run in a memory
# cgroup of its own (cgroup v1, as root), where going over the limit is the kernel's OOM kill, not a guess
# from a measured peak. Skipped, with a line saying so, where no such cgroup can be made.
CG=/sys/fs/cgroup/memory/xlr8-bench-$$
if ! mkdir "$CG" 2>/dev/null; then
  echo "memory-limit sweep skipped: cannot create $CG (needs root and cgroup v1's memory controller)"
  exit 0
fi
trap 'rmdir "$CG" 2>/dev/null; rm -rf "$OUT"' EXIT
echo $((${LIMIT_MB:-1024} * 1024 * 1024)) > "$CG/memory.limit_in_bytes"
[ -f "$CG/memory.memsw.limit_in_bytes" ] && echo $((${LIMIT_MB:-1024} * 1024 * 1024)) > "$CG/memory.memsw.limit_in_bytes"
for ac in false true; do
  longest=none
  for seq in ${SWEEP:-512 768 1024 1280 1536 2048}; do
    # shellcheck disable=SC2086
    if sh -c "echo \$\$ > $CG/cgroup.procs; exec $X launch --num_processes 1 $FSDP --fsdp_activation_checkpointing $ac $G \
        --n_layer 4 --d_model 128 --n_head 4 --seq_len $seq --batch_size 4 --max_steps 2 --val_windows 4 \
        --log_every 1000 --output_dir $OUT/limit" > "$OUT/limit.log" 2>&1; then
      verdict=trains; longest=$seq
    else
      verdict="fails: $(grep -o -m1 'killed by SIG[A-Z]*' "$OUT/limit.log" || echo "exit non-zero"), oom_kill $(sed -n 's/^oom_kill //p' "$CG/memory.oom_control")"
    fi
    echo "limit ${LIMIT_MB:-1024} MiB checkpointing $ac seq_len $seq $verdict"
  done
  echo "limit ${LIMIT_MB:-1024} MiB checkpointing $ac longest_seq_len $longest"
done
