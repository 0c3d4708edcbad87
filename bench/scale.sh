#!/usr/bin/env bash
# The scale headline: does a GPT of a given shape train 3 steps with 4 ranks on this machine under a
# strategy? Prints one line per try with the parameter count, peak RSS per rank and the outcome.
#   bench/scale.sh ddp 2048 6        # strategy (ddp | zero2 | full_shard | ds_zero3 | pp4), d_model, n_layer
# ds_zero3: DeepSpeed ZeRO-3 from a JSON with the blocks as leaf modules; ZERO3_INIT=true|false sets
# zero3_init_flag (unset: on, Accelerate's default at ZeRO-3). RANKS=N changes the 4 processes, STEPS=N the 3 steps (not pp4).
set -uo pipefail
cd "$(dirname "$0")/.."
strategy=$1 d_model=$2 n_layer=$3
case $strategy in
  ddp) flags=() ;;
  zero2) flags=(--use_fsdp --fsdp_sharding_strategy SHARD_GRAD_OP) ;;
  full_shard) flags=(--use_fsdp --fsdp_sharding_strategy FULL_SHARD --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP
                     --fsdp_transformer_layer_cls_to_wrap Block) ;;
  ds_zero3)
    ds_json=$(mktemp --suffix .json)
    echo '{"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "zero_optimization": {"stage": 3, "leaf_module": {"classes": ["Block"]}}}' >"$ds_json"
    flags=(--use_deepspeed --deepspeed_config_file "$ds_json" ${ZERO3_INIT:+--zero3_init_flag "$ZERO3_INIT"}) ;;
  pp4) ;;  # 4 pipeline stages of examples/gpt_deepspeed --pipeline, each rank building only its stage's layers
  *) echo "unknown strategy $strategy" >&2; exit 2 ;;
esac
if [ "$strategy" = pp4 ]; then
  json=$(mktemp)
  echo '{"train_batch_size": 4, "gradient_accumulation_steps": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
         "steps_per_print": 1000}' >"$json"
  start=$(date +%s)
  # GNU time's maximum resident set: the largest worker's (the launcher waits for each).
  log=$( { /usr/bin/time -f "max_rss_kb=%M" build/bin/xlr8 launch --num_processes 4 --num_cpu_threads_per_process 1 \
    --parallelism_config_pp_size 4 build/bin/gpt_deepspeed --deepspeed_config "$json" --pipeline --max_steps 3 \
    --d_model "$d_model" --n_layer "$n_layer" --n_head $((d_model / 64)) --seq_len 32; } 2>&1)
  rc=$?
  echo "strategy=pp4 d_model=$d_model n_layer=$n_layer exit=$rc seconds=$(( $(date +%s) - start ))" \
    "$(grep -o 'max_rss_kb=[0-9]*' <<<"$log") $(grep -o '{.*"losses".*' <<<"$log" | tail -1)"
  rm -f "$json"
  exit 0
fi
out=$(mktemp -d)
start=$(date +%s)
log=$(build/bin/xlr8 launch --num_processes "${RANKS:-4}" --num_cpu_threads_per_process 1 "${flags[@]}" build/bin/gpt \
  --d_model "$d_model" --n_layer "$n_layer" --n_head $((d_model / 64)) --seq_len 32 --batch_size 1 --max_steps "${STEPS:-3}" \
  --val_windows 1 --log_every 1 --output_dir "$out" 2>&1)
rc=$?
json=$(grep -o '{.*"final_train_loss".*' <<<"$log" | tail -1)
echo "strategy=$strategy d_model=$d_model n_layer=$n_layer exit=$rc seconds=$(( $(date +%s) - start )) ${json:-$(tail -3 <<<"$log" | tr '\n' ' ')}"
rm -rf "$out" ${ds_json:+"$ds_json"}
