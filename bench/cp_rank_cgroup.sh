#!/bin/sh
# Runs the rest of the command line in a memory cgroup of its own, of LIMIT_MB (cgroup v1, as root): one
# rank's "device memory", so that a job's ranks each have the limit, as GPUs each have theirs. Going over
# is the kernel's OOM kill of this rank. Used by bench/context_parallel.sh through `xlr8 launch`.
set -u
CG=/sys/fs/cgroup/memory/xlr8-rank-$$
mkdir "$CG" || exit 99
LIMIT=$((${LIMIT_MB:?} * 1024 * 1024))
echo "$LIMIT" > "$CG/memory.limit_in_bytes"
[ -f "$CG/memory.memsw.limit_in_bytes" ] && echo "$LIMIT" > "$CG/memory.memsw.limit_in_bytes"
cleanup() {
  echo $$ > /sys/fs/cgroup/memory/cgroup.procs 2>/dev/null
  rmdir "$CG" 2>/dev/null
}
trap 'cleanup; exit 143' TERM INT
echo $$ > "$CG/cgroup.procs"
"$@"
rc=$?
cleanup
exit $rc
