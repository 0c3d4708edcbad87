#!/usr/bin/env bash
# The scale headline: does a GPT of a given shape train 3 steps with 4 ranks on this machine under a
# strategy? Prints one line per try with the parameter count, peak RSS per rank and the outcome.
#   bench/scale.sh ddp 2048 6        # strategy (ddp | zero2 | full_shard), d_model, n_layer
set -uo pipefail
cd "$(dirname "$0")/.."
strategy=$1 d_model=$2 n_layer=$3
case $strategy in
  ddp) flags=() ;;
  zero2) flags=(--use_fsdp --fsdp_sharding_strategy SHARD_GRAD_OP) ;;
  full_shard) flags=(--use_fsdp --fsdp_sharding_strategy FULL_SHARD --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP
                     --fsdp_transformer_layer_cls_to_wrap Block) ;;
  *) echo "unknown strategy $strategy" >&2; exit 2 ;;
esac
out=$(mktemp -d)
start=$(date +%s)
log=$(build/bin/xlr8 launch --num_processes 4 --num_cpu_threads_per_process 1 "${flags[@]}" build/bin/gpt \
  --d_model "$d_model" --n_layer "$n_layer" --n_head $((d_model / 64)) --seq_len 32 --batch_size 1 --max_steps 3 \
  --val_windows 1 --log_every 1 --output_dir "$out" 2>&1)
rc=$?
json=$(grep -o '{.*"final_train_loss".*' <<<"$log" | tail -1)
echo "strategy=$strategy d_model=$d_model n_layer=$n_layer exit=$rc seconds=$(( $(date +%s) - start )) ${json:-$(tail -3 <<<"$log" | tr '\n' ' ')}"
rm -rf "$out"
