#!/usr/bin/env bash
# Throw-away single-node Slurm cluster for tests.
#
# Usage:
#   slurm_cluster.sh start DIR [PID]  # writes DIR/slurm.conf, starts slurmctld + slurmd,
#                                # returns once the node is idle (~0.1 s); with PID, a watchdog
#                                # stops the cluster once that process is gone (a killed test)
#   slurm_cluster.sh stop DIR    # cancels jobs, shuts the daemons down, waits for them (~0.2 s)
#
# After `start`, the caller exports SLURM_CONF=DIR/slurm.conf itself and then
# uses srun/sbatch/squeue/scontrol as usual. Prints nothing but errors.
#
# Requirements: Debian's slurmctld, slurmd, slurm-client (22.05), run as root.
# No munge (auth/none, cred/none), no cgroup, no systemd. Each cluster gets its
# own ports, name and state dir, so several may run side by side.
#
# Environment knobs (optional):
#   SLURM_CLUSTER_CPUS     CPUs declared for the node (default: max(8, nproc)).
#                          More than the real core count is fine (config_overrides),
#                          so `srun -n 4` works on a 2-core machine.
#   SLURM_CLUSTER_TIMEOUT  seconds to wait for the node to become idle (default 20).
set -u

die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }

usage() { die "usage: $0 {start|stop} DIR"; }

[ $# -eq 2 ] || [ $# -eq 3 ] || usage
cmd=$1
dir=$2
watch_pid=${3:-}
[ -n "$dir" ] || usage

# Work with an absolute path: the daemons chdir and Slurm wants absolute paths.
if [ -d "$dir" ]; then
    dir=$(cd "$dir" && pwd -P) || die "cannot enter $dir"
elif [ "$cmd" = start ]; then
    mkdir -p "$dir" || die "cannot create $dir"
    dir=$(cd "$dir" && pwd -P) || die "cannot enter $dir"
else
    exit 0 # stop on a directory that does not exist: nothing to do
fi

conf=$dir/slurm.conf
export SLURM_CONF=$conf
# Do not let a surrounding job's environment confuse the client commands.
unset SLURM_JOB_ID SLURM_JOBID SLURM_STEP_ID SLURM_STEPID

for d in /usr/sbin /sbin /usr/bin; do
    case ":$PATH:" in *":$d:"*) ;; *) PATH=$PATH:$d ;; esac
done

log_tails() {
    local f
    for f in "$dir"/log/slurmctld.log "$dir"/log/slurmd.log "$dir"/log/slurmctld.out "$dir"/log/slurmd.out; do
        [ -s "$f" ] || continue
        echo "---- tail of $f ----" >&2
        tail -n 25 "$f" >&2
    done
}

# Two free TCP ports, chosen by the kernel (bound at the same time so they differ).
free_ports() {
    local py
    for py in /usr/bin/python3 python3; do
        command -v "$py" >/dev/null 2>&1 || continue
        "$py" - <<'EOF' && return 0
import socket
socks = []
for _ in range(2):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
    done
    # Fallback without python: random high ports that nothing answers on.
    local p ports=()
    while [ ${#ports[@]} -lt 2 ]; do
        p=$((20000 + RANDOM % 30000))
        [ "${ports[0]:-}" = "$p" ] && continue
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            ports+=("$p")
        fi
    done
    echo "${ports[*]}"
}

# A process counts as alive unless it is gone or a zombie: daemons are
# re-parented to PID 1, which may reap them late (it does here).
alive() {
    local st=
    { read -r st <"/proc/$1/stat"; } 2>/dev/null
    [ -n "$st" ] || return 1
    st=${st##*) }
    [ "${st%% *}" != Z ]
}

pid_from() { # pid_from FILE -> pid if the file names a live process
    local pid
    [ -r "$1" ] || return 1
    read -r pid <"$1" 2>/dev/null || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    alive "$pid" || return 1
    echo "$pid"
}

# Processes named $1 (or $2...) whose environment holds SLURM_CONF=$conf:
# slurmstepd inherits it from slurmd, srun/sbatch/salloc from the caller.
cluster_procs() {
    local p comm name hit
    for p in /proc/[0-9]*; do
        comm=
        { read -r comm <"$p/comm"; } 2>/dev/null
        hit=
        for name in "$@"; do [ "$comm" = "$name" ] && hit=1; done
        [ -n "$hit" ] || continue
        if { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qxF "SLURM_CONF=$conf"; then
            echo "${p#/proc/}"
        fi
    done
}

descendants() { # descendants PID... -> all descendants (not the PIDs themselves)
    local -A kids=()
    local p stat rest ppid
    for p in /proc/[0-9]*; do
        stat=
        { read -r stat <"$p/stat"; } 2>/dev/null
        [ -n "$stat" ] || continue
        rest=${stat##*) }          # fields after "pid (comm) "
        ppid=${rest#* }; ppid=${ppid%% *}
        kids[$ppid]+="${p#/proc/} "
    done
    local queue=("$@") out=() c
    while [ ${#queue[@]} -gt 0 ]; do
        p=${queue[0]}; queue=("${queue[@]:1}")
        for c in ${kids[$p]:-}; do out+=("$c"); queue+=("$c"); done
    done
    echo "${out[*]:-}"
}

wait_gone() { # wait_gone TENTHS PID... -> 0 when all gone
    local n=$1; shift
    local p alive
    while :; do
        alive=
        for p in "$@"; do alive "$p" && alive=1; done
        [ -z "$alive" ] && return 0
        [ "$n" -le 0 ] && return 1
        n=$((n - 1))
        sleep 0.1
    done
}

now_ms() { local t=${EPOCHREALTIME/[.,]/}; echo $((t / 1000)); }

do_stop() {
    [ -f "$conf" ] || return 0
    local ctld slurmd stepds jobs p pids='' shutdown_sent='' until_ms patience=50
    ctld=$(pid_from "$dir/run/slurmctld.pid")
    slurmd=$(pid_from "$dir/run/slurmd.pid")

    if [ -n "$ctld" ]; then
        # Cancel whatever is left so slurmstepd reaps the tasks itself
        # (SIGTERM, then SIGKILL after KillWait=2 s); give it ~3 s.
        jobs=$(timeout 5 squeue -h -o %i 2>/dev/null)
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086
            timeout 5 scancel $jobs >/dev/null 2>&1
            until_ms=$(($(now_ms) + 3000))
            while [ -n "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && [ "$(now_ms)" -lt "$until_ms" ]; do
                sleep 0.1
            done
        fi
    fi

    # Step daemons of this cluster still there are stuck (or slurmctld is
    # gone): kill them and their tasks before shutting the daemons down.
    stepds=$(cluster_procs slurmstepd)
    if [ -n "$stepds" ]; then
        # shellcheck disable=SC2046,SC2086
        kill -KILL $(descendants $stepds) $stepds 2>/dev/null
        # shellcheck disable=SC2086
        wait_gone 20 $stepds
        # slurmd then keeps waiting for those steps and ignores shutdown
        # requests for many seconds: do not wait long for it below.
        patience=10
    fi

    if [ -n "$ctld" ]; then
        timeout 5 scontrol shutdown >/dev/null 2>&1 && shutdown_sent=1
    fi

    for p in $ctld $slurmd; do pids+="$p "; done
    if [ -n "$pids" ]; then
        # Without a successful `scontrol shutdown` go straight to SIGTERM.
        # shellcheck disable=SC2086
        if [ -z "$shutdown_sent" ] || ! wait_gone "$patience" $pids; then
            # shellcheck disable=SC2086
            kill -TERM $pids 2>/dev/null
            # shellcheck disable=SC2086
            wait_gone "$patience" $pids || kill -KILL $pids 2>/dev/null
            # shellcheck disable=SC2086
            wait_gone 20 $pids
        fi
    fi

    # Clients of this cluster (they hold SLURM_CONF=$conf) may wait forever
    # for daemons that are gone now.
    # shellcheck disable=SC2046
    kill -KILL $(cluster_procs srun salloc sbatch) 2>/dev/null
    return 0
}

# Stops the cluster once `pid` is gone: a test killed at its timeout never runs its own `stop`.
start_watchdog() {
    local pid=$1 self
    self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
    setsid bash -c 'while kill -0 "$1" 2>/dev/null && [ -f "$2/slurm.conf" ]; do sleep 1; done; "$3" stop "$2"' \
        _ "$pid" "$dir" "$self" </dev/null >/dev/null 2>&1 &
}

do_start() {
    local host ncpu cpus ctld_port slurmd_port name timeout
    if [ -n "$(pid_from "$dir/run/slurmctld.pid")$(pid_from "$dir/run/slurmd.pid")" ]; then
        die "a cluster is already running in $dir (stop it first)"
    fi
    host=$(hostname -s) || die "hostname -s failed"
    ncpu=$(nproc 2>/dev/null || echo 1)
    cpus=${SLURM_CLUSTER_CPUS:-$((ncpu > 8 ? ncpu : 8))}
    timeout=${SLURM_CLUSTER_TIMEOUT:-20}
    read -r ctld_port slurmd_port < <(free_ports)
    [ -n "${slurmd_port:-}" ] || die "could not find free TCP ports"
    # Private cluster name (lower case, short): t<pid><random>
    name=$(printf 't%x%04x' "$$" "$RANDOM")

    # A restart in the same DIR begins from scratch (the old state would hold
    # the old ClusterName, which slurmctld refuses).
    rm -rf "$dir/state" "$dir/spool" "$dir/log" "$dir/run"
    mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/run" || die "cannot create dirs in $dir"
    : >"$dir/plugstack.conf"

    cat >"$conf" <<EOF
# Generated by slurm_cluster.sh - single-node throw-away test cluster.
ClusterName=$name
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
PlugStackConfig=$dir/plugstack.conf
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
InactiveLimit=0
KillWait=2
MinJobAge=60
MessageTimeout=10
SlurmdTimeout=300
SlurmctldTimeout=120
FirstJobId=$((1000 + RANDOM % 100000))
NodeName=$host NodeAddr=127.0.0.1 NodeHostname=$host CPUs=$cpus Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=1 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF

    # Both daemons fork into the background; keep their stdio off the caller's pipes.
    (cd "$dir" && exec slurmctld -c -f "$conf" </dev/null >>"$dir/log/slurmctld.out" 2>&1) \
        || { log_tails; do_stop; die "slurmctld failed to start (see $dir/log)"; }
    # Start slurmd only once slurmctld listens: a slurmd that registers too
    # early retries only after a second.
    local t0=$SECONDS deadline=$((SECONDS + timeout))
    until timeout 5 scontrol ping >/dev/null 2>&1; do
        if [ $SECONDS -ge $deadline ] ||
            { [ $((SECONDS - t0)) -ge 2 ] && [ -z "$(pid_from "$dir/run/slurmctld.pid")" ]; }; then
            log_tails; do_stop; die "slurmctld does not answer on port $ctld_port (see $dir/log)"
        fi
        sleep 0.02
    done
    (cd "$dir" && exec slurmd -f "$conf" -N "$host" </dev/null >>"$dir/log/slurmd.out" 2>&1) \
        || { log_tails; do_stop; die "slurmd failed to start (see $dir/log)"; }

    local state=
    while :; do
        state=$(timeout 5 sinfo -h -o %t -n "$host" 2>/dev/null)
        if [ "$state" = idle ]; then
            [ -n "$watch_pid" ] && start_watchdog "$watch_pid"
            return 0
        fi
        if [ $SECONDS -ge $deadline ]; then
            echo "slurm_cluster.sh: node $host not idle after ${timeout}s (state: '${state:-none}')" >&2
            log_tails
            do_stop
            exit 1
        fi
        sleep 0.05
    done
}

case $cmd in
    start) do_start ;;
    stop) do_stop ;;
    *) usage ;;
esac
