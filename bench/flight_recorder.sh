#!/bin/sh
# The flight recorder's cost (issue 26: at most 1 %): the bench MLP under DDP on 2 ranks, with the recorder
# off (XLR8_TRACE_BUFFER_SIZE=0) and on (the default, 64 entries), alternated REPS times in one invocation.
# Prints each run's median step time and the median of the per-pair ratios on/off, then what one collective's
# entry costs by itself (xlr8-bench --flight_recorder_ops: recorded and completed a million times).
# Usage: [REPS=5] [STEPS=200] bench/flight_recorder.sh [build-dir]
set -eu
. "$(dirname "$0")/common.sh"
B=$BUILD/bin/xlr8-bench
REPS=${REPS:-5}; STEPS=${STEPS:-200}
step_ms() {
  XLR8_TRACE_BUFFER_SIZE=$1 "$X" launch --num_processes 2 "$B" --model mlp --steps "$STEPS" --warmup 20 2>/dev/null |
    sed -n 's/.*"step_ms_median":\([0-9.e+-]*\).*/\1/p' | head -1
}
echo "flight recorder: bench MLP, DDP, 2 ranks, $STEPS steps; median step ms, recorder off / on"
ratios=""
for rep in $(seq "$REPS"); do
  off=$(step_ms 0); on=$(step_ms 64)
  ratio=$(echo "$on $off" | awk '{printf "%.4f", $1 / $2}')
  ratios="$ratios $ratio"
  echo "rep $rep: off $off ms, on $on ms, on/off $ratio"
done
echo "$ratios" | tr ' ' '\n' | sed '/^$/d' | sort -n | awk '{a[NR]=$1} END {printf "median on/off: %s (%d pairs)\n", a[int((NR+1)/2)], NR}'
for n in 0 64; do
  echo "recorder capacity $n: $(XLR8_TRACE_BUFFER_SIZE=$n "$B" --flight_recorder_ops 1000000)"
done
