#!/bin/sh
# The longest sequence the GPT trains when every rank has LIMIT_MB of memory (1024 by default; each rank in
# a memory cgroup of its own, bench/cp_rank_cgroup.sh, as each GPU has its own memory): 1 process against
# cp 2 (allgather: each rank scores its half of the queries against every key) and cp 2 / cp 4 on the ring
# (alltoall: blocks of T/(2cp) tokens, nothing of size T x T kept). 2 layers, d_model 128, 4 heads, one
# window per step, 2 steps; SEQS swept. Also tokens/s and the attention traffic per micro-step. Ulysses
# (sp 2, sp 4: each rank attends over the whole sequence for its share of the heads) in the same sweep.
# Usage: bench/context_parallel.sh [build dir]   (LIMIT_MB=1024 SEQS="1024 2048 4096 8192"
#        LAYOUTS="1:1:allgather 2:2:allgather 2:2:alltoall 4:4:alltoall 2:2:ulysses 4:4:ulysses")
set -eu
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
trap 'rm -rf "$OUT"; for d in /sys/fs/cgroup/memory/xlr8-rank-*; do [ -d "$d" ] && rmdir "$d" 2>/dev/null; done; true' EXIT
export LIMIT_MB=${LIMIT_MB:-1024}
if ! mkdir /sys/fs/cgroup/memory/xlr8-rank-probe 2>/dev/null; then
  echo "skipped: cannot create a memory cgroup (needs root and cgroup v1's memory controller)"
  exit 0
fi
rmdir /sys/fs/cgroup/memory/xlr8-rank-probe
WRAP=$(cd "$(dirname "$0")" && pwd)/cp_rank_cgroup.sh
for layout in ${LAYOUTS:-1:1:allgather 2:2:allgather 2:2:alltoall 4:4:alltoall 2:2:ulysses 4:4:ulysses}; do
  n=${layout%%:*}; rest=${layout#*:}; cp=${rest%%:*}; strategy=${rest#*:}
  flags=""
  [ "$cp" -gt 1 ] && flags="--parallelism_config_cp_size $cp --parallelism_config_cp_comm_strategy $strategy"
  name="cp$cp-$strategy"; [ "$cp" -eq 1 ] && name="one-process"
  if [ "$strategy" = ulysses ]; then flags="--parallelism_config_sp_size $cp"; name="sp$cp-ulysses"; fi
  longest=none
  for seq in ${SEQS:-1024 2048 4096 8192}; do
    # shellcheck disable=SC2086
    if $X launch --num_processes "$n" $flags "$WRAP" "$G" --n_layer 2 --d_model 128 --n_head 4 --seq_len "$seq" \
        --batch_size 1 --max_steps 2 --val_windows 1 --log_every 1000 --output_dir "$OUT/run" > "$OUT/log" 2>&1; then
      longest=$seq
      line=$(tail -1 "$OUT/log")
      echo "limit $LIMIT_MB MiB/rank $name seq_len $seq trains: peak_rss_mb $(echo "$line" | field peak_rss_mb) tokens_per_s $(echo "$line" | field tokens_per_s) cp_wire_bytes_per_micro_step $(echo "$line" | field cp_wire_bytes_per_micro_step)"
    else
      echo "limit $LIMIT_MB MiB/rank $name seq_len $seq fails: $(grep -o -m1 'killed by SIG[A-Z]*' "$OUT/log" || echo "exit non-zero: $(tail -1 "$OUT/log")")"
    fi
  done
  echo "limit $LIMIT_MB MiB/rank $name longest_seq_len $longest"
done
