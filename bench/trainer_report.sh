#!/bin/sh
# What a Trainer checkpoint costs (issue 41 §14): the trainer example on 2 local workers with its tiny model
# (one Linear(49, 10): a 6 KB checkpoint), save_state + report() every step against the same run that never
# reports; then the mean save_state and report() latency (the example's "checkpoint costs" line, rank 0) as
# the checkpoint grows by --extra_state_kb. Wall times include the start (launch, rendezvous, data), so the
# per-step figure is (with - without) / steps.
# Usage: [REPS=3] [WORKERS=2] [STEPS=30] [SIZES_KB="0 256 4096 65536"] bench/trainer_report.sh [build-dir]
set -eu
. "$(dirname "$0")/common.sh"
T=$BUILD/bin/trainer
REPS=${REPS:-3}; WORKERS=${WORKERS:-2}; STEPS=${STEPS:-30}; SIZES_KB=${SIZES_KB:-0 256 4096 65536}
now() { date +%s.%N; }
# run NAME FLAGS...: one fit; its wall time in WALL, its output in $OUT/NAME.out
run() {
  name=$1; shift
  t0=$(now)
  if ! "$T" --num_workers "$WORKERS" --storage_path "$OUT" --name "$name" --model tiny --steps "$STEPS" "$@" \
      >"$OUT/$name.out" 2>"$OUT/$name.err"; then
    echo "trainer_report: run $name failed; its stderr ended with:" >&2
    tail -5 "$OUT/$name.err" >&2
    exit 1
  fi
  WALL=$(echo "$t0 $(now)" | awk '{printf "%.2f", $2 - $1}')
}
# costs NAME: "save_ms report_ms bytes" from the run's last "checkpoint costs" line
costs() {
  sed -n 's/.*checkpoint costs: save_state \([0-9.]*\) ms, report \([0-9.]*\) ms (means of [0-9]*; \([0-9]*\) bytes each).*/\1 \2 \3/p' \
    "$OUT/$1.out" | tail -1
}
echo "trainer checkpoint cost: $WORKERS workers, tiny model, $STEPS steps"
for rep in $(seq "$REPS"); do
  run "never$rep" --checkpoint_every 0; without=$WALL
  run "every$rep" --checkpoint_every 1; with=$WALL
  set -- $(costs "every$rep")
  echo "$rep $with $without $STEPS $1 $2 $3" | awk '{printf "rep %d: reporting every step %.2f s vs %.2f s without (x%.2f, +%.1f ms a step); save_state %s ms, report %s ms (%d bytes)\n", $1, $2, $3, $2 / $3, 1000 * ($2 - $3) / $4, $5, $6, $7}'
done
echo "latency against checkpoint size (a report every step):"
for kb in $SIZES_KB; do
  run "size$kb" --checkpoint_every 1 --extra_state_kb "$kb"
  set -- $(costs "size$kb")
  echo "  $3 bytes: save_state $1 ms, report $2 ms"
done
