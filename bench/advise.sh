#!/bin/sh
# xlr8 advise against an exhaustive sweep (issue 27), on the GPT example, 2 processes: the strategy advise
# picks and the time it takes, then every candidate run for STEPS full steps (tokens/s from the example's own
# JSON), so the advised one's throughput can be read against the sweep's best, and advise's time against
# the sweep's. SIZE: "small" (3.2 M parameters, DDP fits: no memory limit), "large" (the same model,
# --max_memory_per_rank below DDP's, ZeRO-1's and ZeRO-2's need) or "big" (25.4 M parameters, 8 layers x 512, a
# limit only FULL_SHARD and the meshes over it meet).
# Usage: [STEPS=30] [SIZE=small|large|big] bench/advise.sh [build-dir]
set -eu
. "$(dirname "$0")/common.sh"
STEPS=${STEPS:-30}; SIZE=${SIZE:-small}
case "$SIZE" in small|large|big) ;; *) echo "SIZE=$SIZE: small, large or big" >&2; exit 2 ;; esac
MODEL="--n_layer 4 --d_model 256 --n_head 4"
[ "$SIZE" = big ] && MODEL="--n_layer 8 --d_model 512 --n_head 8"
GPT="$G $MODEL --seq_len 64 --batch_size 8 --output_dir $OUT/run"
WRAP="--fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap BlockImpl"
LIMIT=""
[ "$SIZE" = large ] && LIMIT="--max_memory_per_rank 30MB"
[ "$SIZE" = big ] && LIMIT="--max_memory_per_rank 230MB"
now() { date +%s.%N; }
t0=$(now)
# shellcheck disable=SC2086
"$X" advise --num_processes 2 $LIMIT $WRAP --output "$OUT/advised.yaml" $GPT --max_steps 100000 >"$OUT/advise.out" 2>/dev/null
t1=$(now)
grep -v '^\[' "$OUT/advise.out"
echo "advise took $(echo "$t1 $t0" | awk '{printf "%.1f", $1 - $2}') s"
sweep() {  # name, launch flags
  name=$1; shift
  s0=$(now)
  # shellcheck disable=SC2086
  tps=$("$X" launch --num_processes 2 "$@" $GPT --max_steps "$STEPS" 2>/dev/null | field tokens_per_s | tail -1)
  s1=$(now)
  echo "$name|$tps|$(echo "$s1 $s0" | awk '{printf "%.1f", $1 - $2}')"
}
FS="--use_fsdp --fsdp_sharding_strategy FULL_SHARD $WRAP"
{
  [ "$SIZE" = small ] && sweep "DDP" && sweep "DDP, bf16" --mixed_precision bf16 &&
    sweep "ZeRO-1" --use_deepspeed --zero_stage 1 && sweep "SHARD_GRAD_OP (ZeRO-2)" --use_fsdp --fsdp_sharding_strategy SHARD_GRAD_OP $WRAP
  # shellcheck disable=SC2086
  sweep "FULL_SHARD (ZeRO-3)" $FS --fsdp_backward_prefetch NO_PREFETCH
  # shellcheck disable=SC2086
  sweep "FULL_SHARD, prefetch" $FS --fsdp_backward_prefetch BACKWARD_PRE --fsdp_forward_prefetch true
  # shellcheck disable=SC2086
  sweep "FULL_SHARD, activation checkpointing" $FS --fsdp_activation_checkpointing true
  # shellcheck disable=SC2086
  sweep "FULL_SHARD, bf16" $FS --mixed_precision bf16
  sweep "tp 2, bf16" --mixed_precision bf16 --parallelism_config_tp_size 2
  # shellcheck disable=SC2086
  sweep "cp 2 (ring), FULL_SHARD, bf16" $FS --mixed_precision bf16 --parallelism_config_cp_size 2 \
    --parallelism_config_cp_comm_strategy alltoall
  # shellcheck disable=SC2086
  sweep "sp 2 (Ulysses), FULL_SHARD, bf16" $FS --mixed_precision bf16 --parallelism_config_sp_size 2
} >"$OUT/sweep"
echo "sweep ($STEPS steps each): strategy | tokens/s | wall s"
cat "$OUT/sweep"
awk -F'|' '{t += $3; if ($2 > best) {best = $2; who = $1}} END {printf "sweep: best %s at %.0f tokens/s, %.1f s in all\n", who, best, t}' "$OUT/sweep"
winner=$(sed -n 's/^xlr8 advise: \(.*\) on 2 processes.*/\1/p' "$OUT/advise.out")
awk -F'|' -v w="$winner" '$1 == w {printf "advised: %s at %.0f tokens/s in the sweep\n", w, $2}' "$OUT/sweep"
