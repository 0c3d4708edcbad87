#!/bin/sh
# The time `xlr8 launch` takes to start a job, against the same launcher inside the program that loads LibTorch
# (xlr8-full, which every `xlr8 launch` was until 2026-11-25): RUNS alternating pairs of a 2-process launch of
# the GPT example for one step, wall seconds each, then the medians and their ratio.
# Usage: [RUNS=7] bench/launch_start.sh [build-dir]
set -eu
. "$(dirname "$0")/common.sh"
RUNS=${RUNS:-7}
now() { date +%s.%N; }
run() {  # launcher binary
  s0=$(now)
  "$1" launch --num_processes 2 "$G" --max_steps 1 --val_windows 8 --output_dir "$OUT/run" >/dev/null 2>&1
  s1=$(now)
  echo "$s1 $s0" | awk '{printf "%.3f\n", $1 - $2}'
}
: >"$OUT/thin"; : >"$OUT/full"
i=0
while [ "$i" -lt "$RUNS" ]; do
  run "$X" >>"$OUT/thin"
  run "$BUILD/bin/xlr8-full" >>"$OUT/full"
  i=$((i + 1))
done
median() { sort -n "$1" | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
echo "xlr8 launch (no LibTorch): $(tr '\n' ' ' <"$OUT/thin")"
echo "xlr8-full launch (LibTorch loaded): $(tr '\n' ' ' <"$OUT/full")"
t=$(median "$OUT/thin"); f=$(median "$OUT/full")
echo "median: $t s against $f s; ratio $(echo "$t $f" | awk '{printf "%.2f", $1 / $2}')"
