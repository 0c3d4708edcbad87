#!/usr/bin/env bash
# Checkpoint speed and memory: a GPT trained 2 steps on 4 ranks under FULL_SHARD saves its state as
# SHARDED_STATE_DICT (every rank writes its shards in parallel) and as FULL_STATE_DICT (the model
# streamed to rank 0 and written there; optimizer state sharded either way), is resumed on 2 ranks
# under SHARD_GRAD_OP (resharding), and the sharded one is merged with `xlr8 merge-weights`, whose
# peak RSS is measured against the model's size.
#   bench/checkpoint.sh [D_MODEL] [N_LAYER]      (default 1024 8: 101 M parameters)
set -euo pipefail
cd "$(dirname "$0")/.."
d_model=${1:-1024} n_layer=${2:-8}
shape=(--d_model "$d_model" --n_layer "$n_layer" --n_head $((d_model / 64)) --seq_len 64 --val_windows 1
       --log_every 1)
full_shard=(--use_fsdp --fsdp_sharding_strategy FULL_SHARD --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP
            --fsdp_transformer_layer_cls_to_wrap Block)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
field() { grep -o "\"$1\":[0-9.e+-]*" | tail -1 | cut -d: -f2; }
for type in SHARDED_STATE_DICT FULL_STATE_DICT; do
  out="$work/$type"
  json=$(build/bin/xlr8 launch --num_processes 4 --num_cpu_threads_per_process 1 "${full_shard[@]}" \
    --fsdp_state_dict_type "$type" build/bin/gpt "${shape[@]}" --batch_size 2 --max_steps 2 --checkpoint_every 2 --output_dir "$out" 2>&1)
  params=$(field parameters <<<"$json")
  save=$(field save_state_seconds <<<"$json")
  bytes=$(du -sb "$out/checkpoints/checkpoint_0" | cut -f1)
  resumed=$(build/bin/xlr8 launch --num_processes 2 --num_cpu_threads_per_process 1 --use_fsdp \
    --fsdp_sharding_strategy SHARD_GRAD_OP build/bin/gpt "${shape[@]}" --batch_size 4 --max_steps 3 \
    --resume_from latest --output_dir "$out" 2>&1)
  load=$(field load_state_seconds <<<"$resumed")
  echo "state_dict_type=$type parameters=$params checkpoint_bytes=$bytes save_s=$save load_on_2_ranks_s=$load"
done
model_mb=$(python3 -c "print(round($params * 4 / 2**20, 1))")
/usr/bin/time -f "%M %e" -o "$work/time" build/bin/xlr8 merge-weights "$work/SHARDED_STATE_DICT/checkpoints/checkpoint_0" \
  "$work/merged" >/dev/null
read -r rss_kb seconds <"$work/time"
largest_mb=$(python3 -c "print(round(4 * $d_model * $d_model * 4 / 2**20, 1))")
echo "merge-weights: model ${model_mb} MB, largest tensor ${largest_mb} MB, peak RSS $((rss_kb / 1024)) MB, ${seconds} s"
