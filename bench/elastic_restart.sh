#!/bin/sh
# Restart latency of an elastic job on 2 hosts (issue 26): each host a network namespace with its own
# address and its own `xlr8 launch --rdzv_backend c10d` (2 ranks each: 4 ranks). The oracle worker
# (tests' xlr8_train_worker: 60 steps of 100 ms at least, a checkpoint every 5) is hit three ways:
#   worker: rank 3 (host 1) SIGKILLed    -> both hosts restart, 4 ranks
#   host:   host 1's processes SIGKILLed -> host 0 restarts alone, 2 ranks (closed connections: at once)
#   link:   host 1's link down, then its processes killed -> host 0 restarts alone after the rendezvous
#           hears nothing for keep_alive_interval x keep_alive_max_attempt (here 1 s x 3)
# Reported: kill -> host 0's rank 0 training again ("start at step N", printed once load_state returned).
# BACKEND=etcd: the rendezvous in a three-member etcd cluster, one member on each of three hosts; the agents
# on hosts 0 and 1. The machine that started first (host 0, with its etcd member) is hit:
#   first:      host 0's processes SIGKILLed (its lease expires: keep_alive_interval x keep_alive_max_attempt)
#   first-link: host 0's link down, then its processes killed
# reported as kill -> host 1's rank 0 training again. (With c10d the first machine serves the rendezvous:
# losing it ends the job.)
# Needs root and `ip netns`. The namespaces have no default route; the root namespace gets an unreachable
# route for their /24 while they exist; everything is removed on exit.
# Usage: [REPS=3] [BACKEND=c10d|etcd] bench/elastic_restart.sh [build-dir]
set -eu
. "$(dirname "$0")/common.sh"
W=$BUILD/tests/xlr8_train_worker
REPS=${REPS:-3}; BACKEND=${BACKEND:-c10d}
HOSTS="0 1"; [ "$BACKEND" = etcd ] && HOSTS="0 1 2"
[ "$(id -u)" = 0 ] || { echo "elastic_restart.sh: needs root (network namespaces)"; exit 1; }
S=10.214.$(( $$ % 250 )); NS=xlr8b$$; I=xb$$
cleanup() {
  for h in $HOSTS; do for p in $(ip netns pids ${NS}h$h 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done; done
  for h in $HOSTS; do ip netns del ${NS}h$h 2>/dev/null || true; done
  ip netns del ${NS}sw 2>/dev/null || true
  ip route del unreachable $S.0/24 2>/dev/null || true
  rm -rf "$OUT"
}
trap cleanup EXIT INT TERM
ip route add unreachable $S.0/24
ip netns add ${NS}sw; ip -n ${NS}sw link add br0 type bridge; ip -n ${NS}sw link set br0 up
for h in $HOSTS; do
  ip netns add ${NS}h$h
  ip link add ${I}h$h netns ${NS}h$h type veth peer name ${I}s$h netns ${NS}sw
  ip -n ${NS}sw link set ${I}s$h master br0; ip -n ${NS}sw link set ${I}s$h up
  ip -n ${NS}h$h addr add $S.$((h + 1))/24 dev ${I}h$h; ip -n ${NS}h$h link set ${I}h$h up; ip -n ${NS}h$h link set lo up
done
now() { date +%s.%N; }
ETCD=$S.1:2379,$S.2:2379,$S.3:2379
RDZV="--rdzv_backend c10d --rdzv_endpoint $S.1:29400"; [ "$BACKEND" = etcd ] && RDZV="--rdzv_backend etcd --rdzv_endpoint $ETCD"
etcd_start() {  # a fresh three-member cluster, one member per host
  for h in 0 1 2; do
    ip netns exec ${NS}h$h etcd --name m$h --data-dir "$OUT/etcd$h" --listen-client-urls http://$S.$((h + 1)):2379 \
      --advertise-client-urls http://$S.$((h + 1)):2379 --listen-peer-urls http://$S.$((h + 1)):2380 \
      --initial-advertise-peer-urls http://$S.$((h + 1)):2380 --initial-cluster-state new --initial-cluster \
      m0=http://$S.1:2380,m1=http://$S.2:2380,m2=http://$S.3:2380 >"$OUT/etcd$h.log" 2>&1 &
  done
  until ip netns exec ${NS}h2 env ETCDCTL_API=3 etcdctl --endpoints=$ETCD endpoint health >/dev/null 2>&1; do sleep 0.1; done
}
etcd_stop() {
  for h in 0 1 2; do for p in $(ip netns pids ${NS}h$h); do kill -9 "$p" 2>/dev/null || true; done; done
  rm -rf "$OUT"/etcd?
}
agent() {  # host, output folder, extra worker flags
  h=$1; dir=$2; shift 2
  ip netns exec ${NS}h$h "$X" launch --nnodes 1:2 --nproc_per_node 2 $RDZV \
    --rdzv_id bench --rdzv_conf last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3 --max_restarts 3 \
    "$W" --split_batches --batch 12 --steps 60 --save_every 5 --resume_latest --print_steps --step_sleep_ms 100 \
    --out "$dir" "$@"
}
wait_line() {  # file, pattern: polls until it appears
  while ! grep -q "$2" "$1" 2>/dev/null; do sleep 0.02; done
}
if [ "$BACKEND" = etcd ]; then
  echo "elastic restart (etcd): 2 namespace hosts x 2 ranks, a 3-member etcd cluster, checkpoint every 5 steps"
  for rep in $(seq "$REPS"); do
    for how in first first-link; do
      d=$OUT/$how$rep; mkdir -p "$d"; etcd_start
      agent 0 "$d" >"$d/a.out" 2>"$d/a.err" & a=$!
      wait_line "$d/a.err" "joined the etcd rendezvous"
      agent 1 "$d" >"$d/b.out" 2>"$d/b.err" & b=$!
      wait_line "$d/a.out" "step 12$"
      [ $how = first-link ] && ip -n ${NS}h0 link set ${I}h0 down
      t0=$(now); for p in $(ip netns pids ${NS}h0); do kill -9 "$p" 2>/dev/null || true; done
      wait_line "$d/b.out" "start at step"
      t1=$(now)
      line=$(grep "start at step" "$d/b.out" | tail -1 | sed 's/.*start at step/step/')
      echo "$rep $how $t0 $t1" | awk -v l="$line" '{printf "rep %d %-10s kill -> host 1 training again %.2f s (%s)\n", $1, $2, $4 - $3, l}'
      wait $b || echo "host 1 failed: $(tail -3 "$d/b.err")"
      wait $a 2>/dev/null || true
      ip -n ${NS}h0 link set ${I}h0 up; etcd_stop
    done
  done
  exit 0
fi
echo "elastic restart: 2 namespace hosts x 2 ranks, checkpoint every 5 steps"
for rep in $(seq "$REPS"); do
  for how in worker host link; do
    d=$OUT/$how$rep; mkdir -p "$d"
    agent 0 "$d" >"$d/a.out" 2>"$d/a.err" & a=$!
    wait_line "$d/a.err" "serving the rendezvous"
    agent 1 "$d" >"$d/b.out" 2>"$d/b.err" & b=$!
    wait_line "$d/a.out" "step 12$"
    if [ $how = worker ]; then
      # rank 3 is host 1's second worker: found by the RANK in its environment
      for p in $(ip netns pids ${NS}h1); do
        if tr '\0' '\n' </proc/$p/environ 2>/dev/null | grep -qx 'RANK=3'; then t0=$(now); kill -9 "$p"; fi
      done
    else
      [ $how = link ] && ip -n ${NS}h1 link set ${I}h1 down
      t0=$(now); for p in $(ip netns pids ${NS}h1); do kill -9 "$p" 2>/dev/null || true; done
    fi
    n=$(grep -c "start at step" "$d/a.out")
    while [ "$(grep -c "start at step" "$d/a.out")" -le "$n" ]; do sleep 0.02; done
    t1=$(now)
    line=$(grep "start at step" "$d/a.out" | tail -1 | sed 's/.*start at step/step/')
    echo "$rep $how $t0 $t1" | awk -v l="$line" '{printf "rep %d %-6s kill -> host 0 training again %.2f s (%s)\n", $1, $2, $4 - $3, l}'
    wait $a || echo "host 0 failed: $(tail -3 "$d/a.err")"
    wait $b 2>/dev/null || true
    [ $how = link ] && ip -n ${NS}h1 link set ${I}h1 up
  done
done
