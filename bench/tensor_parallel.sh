#!/bin/sh
# Tensor parallelism on the GPT example: per-rank state bytes, tokens/s and peak RSS at tp 1, 2, 4 (with and
# without sequence parallelism) against DDP on 2 processes, same global batch (8 windows of 128 bytes),
# alternated REPS times in one invocation.
# Usage: bench/tensor_parallel.sh [build dir]   (REPS=2 STEPS=20 by default)
set -eu
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
A="--n_layer 4 --d_model 128 --n_head 4 --seq_len 128 --max_steps ${STEPS:-20} --val_windows 8 --log_every 1000"
rep=1
while [ "$rep" -le "${REPS:-2}" ]; do
  # name:processes:launcher flags:batch per rank:program flags
  for layout in "1proc:1::8:" "ddp2:2::4:" "tp2:2:--parallelism_config_tp_size 2:8:" \
                "tp2sp:2:--parallelism_config_tp_size 2:8:--sequence_parallel" "tp4:4:--parallelism_config_tp_size 4:8:" \
                "tp4sp:4:--parallelism_config_tp_size 4:8:--sequence_parallel"; do
    name=${layout%%:*}; rest=${layout#*:}; n=${rest%%:*}; rest=${rest#*:}; flags=${rest%%:*}; rest=${rest#*:}
    batch=${rest%%:*}; program=${rest#*:}
    # shellcheck disable=SC2086
    line=$($X launch --num_processes "$n" $flags "$G" $A --batch_size "$batch" $program --output_dir "$OUT/$name" 2>&1 | tail -1)
    echo "rep $rep $name state_bytes_per_rank $(echo "$line" | field state_bytes_per_rank) tokens_per_s $(echo "$line" | field tokens_per_s) peak_rss_mb $(echo "$line" | field peak_rss_mb) tp_wire_bytes_per_micro_step $(echo "$line" | field tp_wire_bytes_per_micro_step) val_loss $(echo "$line" | field val_loss)"
  done
  rep=$((rep + 1))
done
