#!/bin/sh
# The largest GPT block that trains on 4 processes under one memory limit: FULL_SHARD over 4 ranks (each
# gathers the whole block, and its whole gradient, once per step) against dp_shard 2 x tp 2 (each gathers
# half a block). One layer, d_model swept, batch 1 x 64 tokens, 2 steps; every run in a memory cgroup of
# LIMIT_MB (3072 by default; cgroup v1, as root) for all 4 processes together, where going over is the
# kernel's OOM kill. With PER_RANK_MB set, each rank instead runs in a memory cgroup of its own of that size
# (bench/cp_rank_cgroup.sh: one "device" per rank, as GPUs each have their memory).
# Usage: bench/tensor_parallel_scale.sh [build dir]   (SWEEP="1024 1536 2048 2560 3072", PER_RANK_MB unset)
set -eu
BUILD=${1:-build}
X=$BUILD/bin/xlr8; G=$BUILD/bin/gpt
OUT=$(mktemp -d)
CG=/sys/fs/cgroup/memory/xlr8-scale-$$
trap 'rmdir "$CG" 2>/dev/null; rm -rf "$OUT"' EXIT
export XLR8_PROGRESS=off
if ! mkdir "$CG" 2>/dev/null; then
  echo "skipped: cannot create $CG (needs root and cgroup v1's memory controller)"
  exit 0
fi
LIMIT=$((${LIMIT_MB:-3072} * 1024 * 1024))
echo "$LIMIT" > "$CG/memory.limit_in_bytes"
[ -f "$CG/memory.memsw.limit_in_bytes" ] && echo "$LIMIT" > "$CG/memory.memsw.limit_in_bytes"
RANK_WRAP=""
if [ -n "${PER_RANK_MB:-}" ]; then
  export LIMIT_MB=$PER_RANK_MB
  RANK_WRAP=$(cd "$(dirname "$0")" && pwd)/cp_rank_cgroup.sh
  trap 'rmdir "$CG" 2>/dev/null; rm -rf "$OUT"; for d in /sys/fs/cgroup/memory/xlr8-rank-*; do [ -d "$d" ] && rmdir "$d" 2>/dev/null; done; true' EXIT
fi
LABEL=${PER_RANK_MB:+${PER_RANK_MB} MiB per rank}
LABEL=${LABEL:-${LIMIT_MB:-3072} MiB}
WRAP="--use_fsdp --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap Block"
field() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }
for layout in "full_shard:" "dp_shard2_tp2:--parallelism_config_dp_shard_size 2 --parallelism_config_tp_size 2"; do
  name=${layout%%:*}; flags=${layout#*:}
  longest=none
  for d in ${SWEEP:-1024 1536 2048 2560 3072}; do
    # shellcheck disable=SC2086
    if sh -c "echo \$\$ > $CG/cgroup.procs; exec $X launch --num_processes 4 $WRAP $flags $RANK_WRAP $G --n_layer 1 \
        --d_model $d --n_head 8 --seq_len 64 --batch_size 1 --max_steps 2 --val_windows 4 --log_every 1000 \
        --output_dir $OUT/run" > "$OUT/log" 2>&1; then
      longest=$d
      line=$(tail -1 "$OUT/log")
      echo "limit $LABEL $name d_model $d trains: parameters $(echo "$line" | field parameters) state_bytes_per_rank $(echo "$line" | field state_bytes_per_rank) peak_state_bytes_per_rank $(echo "$line" | field peak_state_bytes_per_rank) peak_rss_mb $(echo "$line" | field peak_rss_mb) cgroup_peak_mb $(($(cat "$CG/memory.max_usage_in_bytes") / 1048576))"
    else
      echo "limit $LABEL $name d_model $d fails: $(grep -o -m1 'killed by SIG[A-Z]*' "$OUT/log" || echo "exit non-zero: $(tail -1 "$OUT/log")"), oom_kill $(sed -n 's/^oom_kill //p' "$CG/memory.oom_control")"
    fi
    echo 0 > "$CG/memory.max_usage_in_bytes"
  done
  echo "limit $LABEL $name largest_d_model $longest"
done
