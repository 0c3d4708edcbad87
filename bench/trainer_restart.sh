#!/bin/sh
# Restart latency of xlr8::train::Trainer (issue 26): the Fashion-MNIST trainer example on 2 local workers,
# rank 1 SIGKILLed at step 25 in the first group. Reports, per repetition, kill -> the new group's rank 0
# has loaded the checkpoint of step 20 (stop, restart, rendezvous, model and state load), and the whole
# run's wall time against the same run without the failure (the difference adds the 5 steps redone).
# Usage: [REPS=3] [WORKERS=2] bench/trainer_restart.sh [build-dir]
set -eu
. "$(dirname "$0")/common.sh"
T=$BUILD/bin/trainer
REPS=${REPS:-3}; WORKERS=${WORKERS:-2}
now() { date +%s.%N; }
echo "trainer restart: $WORKERS workers, 40 steps, checkpoint every 10, rank 1 killed at step 25"
for rep in $(seq "$REPS"); do
  t0=$(now)
  "$T" --num_workers "$WORKERS" --storage_path "$OUT" --name "straight$rep" >/dev/null 2>&1
  t1=$(now)
  "$T" --num_workers "$WORKERS" --storage_path "$OUT" --name "crash$rep" --max_failures 1 --crash 1:25:kill \
    >"$OUT/out$rep" 2>"$OUT/err$rep"
  t2=$(now)
  killed=$(sed -n 's/.*injecting kill at step 25 (unix time \([0-9.]*\)).*/\1/p' "$OUT/err$rep" | head -1)
  resumed=$(sed -n 's/.*resumed from .* at step 20 (unix time \([0-9.]*\)).*/\1/p' "$OUT/out$rep" | head -1)
  echo "$rep $t0 $t1 $t2 $killed $resumed" | awk '{printf "rep %d: kill -> resumed %.2f s; run %.2f s vs %.2f s without the failure (+%.2f s)\n", $1, $6 - $5, $4 - $3, $3 - $2, ($4 - $3) - ($3 - $2)}'
done
