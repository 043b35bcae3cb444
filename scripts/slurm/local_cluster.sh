#!/usr/bin/env bash
# A throw-away Slurm cluster on this one host, for testing srun launches without a real cluster.
#
#   scripts/slurm/local_cluster.sh start DIR [NODES] [CPUS_PER_NODE]   # prints the SLURM_CONF to export
#   SLURM_CONF=DIR/slurm.conf srun -N 2 --ntasks-per-node=2 hostname
#   scripts/slurm/local_cluster.sh stop DIR
#
# start: installs Debian's slurmctld, slurmd, slurm-client and munge if they are missing (root, apt), writes
# every file under DIR (config, keys, state, logs, pid files), starts one munged, one slurmctld and NODES
# slurmd daemons ("node1".."nodeN", each `slurmd -N nodeK` on its own port: Debian's build lets several
# slurmd share a host), and returns once every node is idle. Idempotent: a second start on a running DIR
# only waits for idle nodes. stop: cancels the jobs first (slurmstepd ignores SIGTERM), then ends exactly
# the daemons whose pid files are in DIR, nothing else on the machine.
#
# Node names do not resolve: jobs that need a rendezvous address set MASTER_ADDR=127.0.0.1 themselves.
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR [NODES=2] [CPUS_PER_NODE=4]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
action=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)
nodes=${3:-2}
cpus=${4:-4}
conf=$dir/slurm.conf
export SLURM_CONF=$conf
# Debian puts the daemons and mungekey in the sbin directories, which a non-login shell or a cleaned
# environment (env -i, as scripts/fresh_clone_check.sh runs the tests) may leave off PATH.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

log() { echo "local_cluster: $*" >&2; }

# A pid from DIR's pid file, only while that process is still ours (its command line names DIR):
# a pid file left from an earlier run must not make us signal an unrelated process that reused the number.
our_pid() {
    local pidfile=$1 pid
    [[ -s $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$dir" && echo "$pid"
}

install_if_missing() {
    local missing=()
    for tool in slurmctld slurmd srun munged mungekey; do command -v "$tool" >/dev/null || missing+=("$tool"); done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    [[ $(id -u) -eq 0 ]] || { log "missing ${missing[*]}; installing them needs root (apt-get)"; exit 3; }
    command -v apt-get >/dev/null || { log "missing ${missing[*]} and no apt-get to install them"; exit 3; }
    log "installing slurmctld slurmd slurm-client munge (missing: ${missing[*]})"
    # The packages' maintainer scripts would start their own daemons with the system's config; a
    # policy-rc.d that exits 101 ("action forbidden") stops that. An existing one (a container's) is kept.
    local policy=/usr/sbin/policy-rc.d ours=0
    if [[ ! -e $policy ]]; then printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 755 "$policy"; ours=1; fi
    local packages=(slurmctld slurmd slurm-client munge) ok=0
    # --no-install-recommends: 8 small packages instead of 40+ (slurm-wlm pulls docs, plugins, X libs).
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=120 --no-install-recommends "${packages[@]}" >&2 && ok=1
    if [[ $ok -eq 0 ]]; then  # a fresh machine may have no package lists yet
        apt-get update -qq -o DPkg::Lock::Timeout=120 >&2 &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=120 --no-install-recommends "${packages[@]}" >&2 && ok=1
    fi
    [[ $ours -eq 1 ]] && rm -f "$policy"
    [[ $ok -eq 1 ]] || { log "apt-get install ${packages[*]} failed"; exit 3; }
}

free_ports() {  # N TCP ports nobody listens on right now
    "$(command -v python3 || command -v python)" - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

write_config() {
    local ports ctld_port
    read -r -a ports <<<"$(free_ports $((nodes + 1)))"
    ctld_port=${ports[0]}
    mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/run"
    # munged refuses a socket directory that others cannot enter (700), and a key others can read.
    mkdir -p "$dir/munge"
    chmod 755 "$dir" "$dir/munge"
    [[ -s $dir/munge/munge.key ]] || mungekey --create --keyfile="$dir/munge/munge.key"
    chmod 600 "$dir/munge/munge.key"
    {
        echo "# Written by scripts/slurm/local_cluster.sh: $nodes emulated nodes on this host."
        echo "ClusterName=local"
        echo "SlurmctldHost=localhost(127.0.0.1)"
        echo "SlurmctldPort=$ctld_port"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "AuthInfo=socket=$dir/munge/munge.socket"  # our munged, not the system's
        echo "StateSaveLocation=$dir/state"
        echo "SlurmdSpoolDir=$dir/spool/%n"              # one per emulated node
        echo "SlurmctldPidFile=$dir/run/slurmctld.pid"
        echo "SlurmdPidFile=$dir/run/slurmd-%n.pid"
        echo "SlurmctldLogFile=$dir/log/slurmctld.log"
        echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
        # No cgroups, no accounting daemon: a container or CI machine has neither.
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "MpiDefault=none"
        echo "SwitchType=switch/none"
        echo "MailProg=/bin/true"
        echo "SchedulerType=sched/builtin"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        # The emulated nodes advertise more CPUs than the host has; without config_overrides they drain.
        echo "SlurmdParameters=config_overrides"
        # A job larger than the cluster fails at once instead of pending forever.
        echo "EnforcePartLimits=ALL"
        echo "ReturnToService=2"
        echo "SlurmdTimeout=60"
        echo "InactiveLimit=0"
        echo "KillWait=5"
        for k in $(seq 1 "$nodes"); do
            echo "NodeName=node$k NodeHostname=localhost NodeAddr=127.0.0.1 Port=${ports[$k]} CPUs=$cpus State=UNKNOWN"
        done
        echo "PartitionName=local Nodes=node[1-$nodes] Default=YES MaxTime=INFINITE State=UP"
    } >"$conf"
}

# Daemons run in the foreground (-D / -F) as background jobs of this script, so that each pid file holds
# the daemon's own pid; their output goes to files (a pipe left open would block whoever runs this script).
spawn() {
    local pidfile=$1 logfile=$2
    shift 2
    nohup "$@" </dev/null >>"$logfile" 2>&1 &
    echo $! >"$pidfile"
}

wait_for() {  # SECONDS DESCRIPTION COMMAND...
    local deadline=$((SECONDS + $1)) what=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            log "timed out waiting for $what; logs in $dir/log:"
            tail -n 20 "$dir"/log/*.log >&2 || true
            exit 4
        fi
        sleep 0.5
    done
}

nodes_idle() { [[ $(sinfo -h -N -o '%N %T' | grep -c ' idle$') -eq $nodes ]]; }

start() {
    install_if_missing
    if our_pid "$dir/run/slurmctld.local.pid" >/dev/null; then
        wait_for 60 "$nodes idle nodes" nodes_idle
        echo "SLURM_CONF=$conf"
        return
    fi
    write_config
    spawn "$dir/run/munged.local.pid" "$dir/log/munged.out" \
        munged -F --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
    wait_for 20 munged bash -c "munge -n -S '$dir/munge/munge.socket' | unmunge -S '$dir/munge/munge.socket'"
    spawn "$dir/run/slurmctld.local.pid" "$dir/log/slurmctld.out" slurmctld -D -c -f "$conf"
    wait_for 30 slurmctld scontrol ping
    for k in $(seq 1 "$nodes"); do
        spawn "$dir/run/slurmd-node$k.local.pid" "$dir/log/slurmd-node$k.out" slurmd -D -N "node$k" -f "$conf"
    done
    wait_for 60 "$nodes idle nodes" nodes_idle
    echo "SLURM_CONF=$conf"
}

stop() {
    if our_pid "$dir/run/slurmctld.local.pid" >/dev/null; then
        local jobs
        jobs=$(squeue -h -o %i | paste -sd, -)
        [[ -z $jobs ]] || scancel --quiet "$jobs" || true
        local deadline=$((SECONDS + 30))
        while [[ -n $(squeue -h -o %i 2>/dev/null) ]] && ((SECONDS < deadline)); do sleep 0.5; done
    fi
    local pids=() pid
    for pidfile in "$dir"/run/slurmd-node*.local.pid "$dir/run/slurmctld.local.pid" "$dir/run/munged.local.pid"; do
        pid=$(our_pid "$pidfile") && pids+=("$pid")
        rm -f "$pidfile"
    done
    [[ ${#pids[@]} -eq 0 ]] && return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 40); do
        kill -0 "${pids[@]}" 2>/dev/null || return 0
        sleep 0.25
    done
    log "daemons ${pids[*]} ignored SIGTERM for 10 s; killing them"
    kill -KILL "${pids[@]}" 2>/dev/null || true
}

case $action in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
