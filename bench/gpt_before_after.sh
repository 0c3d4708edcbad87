#!/usr/bin/env bash
# The GPT example's tokens/s from two builds, alternated in one invocation: each round runs the "before"
# and the "after" binary in fp32 and bf16 (ACCELERATE_MIXED_PRECISION), one process, default shape.
#   bench/gpt_before_after.sh BEFORE_GPT AFTER_GPT [ROUNDS] [STEPS]
# e.g. git worktree add /tmp/base <rev> && XLR8_BUILD_DIR=/tmp/base/build /tmp/base/scripts/build gpt, then
#   bench/gpt_before_after.sh /tmp/base/build/bin/gpt build/bin/gpt
# Prints "round side precision tokens/s final_train_loss" per run.
set -uo pipefail
before=$1 after=$2 rounds=${3:-3} steps=${4:-60}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export XLR8_PROGRESS=off
for round in $(seq "$rounds"); do
  for side in before after; do
    bin=$before; [ "$side" = after ] && bin=$after
    for precision in no bf16; do
      line=$(ACCELERATE_MIXED_PRECISION=$precision "$bin" --max_steps "$steps" --log_every 1000 --output_dir "$out" \
               2>/dev/null | grep '^{')
      tps=$(sed -n 's/.*"tokens_per_s":\([0-9.e+-]*\).*/\1/p' <<<"$line")
      loss=$(sed -n 's/.*"final_train_loss":\([0-9.e+-]*\).*/\1/p' <<<"$line")
      echo "$round $side $precision ${tps:-FAILED} ${loss:-}"
    done
  done
done
