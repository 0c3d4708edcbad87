#!/bin/sh
# Sequence splitting at 2 ranks on one shape: tokens/s of context parallelism's allgather and ring
# (alltoall) and of Ulysses (parallelism_config_sp_size 2), alternated REPS times in one invocation, and the ring's overlap: the time its steps computed blocks
# against the time they then waited for the next block (forward: the send started before the compute;
# backward: the gradient can only leave after its step), the largest rank's. GPT 2 layers, d_model 128,
# 4 heads, one window per step, STEPS steps. Usage: bench/context_parallel_speed.sh [build dir]
# (REPS=2 STEPS=3 SEQS="2048 8192" STRATEGIES="allgather alltoall ulysses")
set -eu
# shellcheck source=bench/common.sh
. "$(dirname "$0")/common.sh"
rep=1
while [ "$rep" -le "${REPS:-2}" ]; do
  for seq in ${SEQS:-2048 8192}; do
    for strategy in ${STRATEGIES:-allgather alltoall ulysses}; do
      case $strategy in
        ulysses) split="--parallelism_config_sp_size 2" ;;
        *) split="--parallelism_config_cp_size 2 --parallelism_config_cp_comm_strategy $strategy" ;;
      esac
      # shellcheck disable=SC2086 # $split is several flags
      line=$($X launch --num_processes 2 $split \
        "$G" --n_layer 2 --d_model 128 --n_head 4 --seq_len "$seq" --batch_size 1 --max_steps "${STEPS:-3}" \
        --val_windows 1 --log_every 1000 --output_dir "$OUT/run" 2>&1 | tail -1)
      echo "rep $rep seq_len $seq $strategy tokens_per_s $(echo "$line" | field tokens_per_s) ring_compute_s $(echo "$line" | field cp_ring_compute_s) ring_wait_s $(echo "$line" | field cp_ring_wait_s) wire_bytes_per_micro_step $(echo "$line" | field cp_wire_bytes_per_micro_step) final_train_loss $(echo "$line" | field final_train_loss)"
    done
  done
  rep=$((rep + 1))
done
