#!/bin/bash
# slurm_up.sh — throwaway one-node Slurm cluster in a directory, on 127.0.0.1
# (used by tests/test_slurm.py; tested with Debian 12's slurm-wlm 22.05 and munge 0.5.15).
#
#   slurm_up.sh DIR            create DIR/slurm.conf, start munged (if used),
#                              slurmctld and slurmd, wait until the node is
#                              idle, then print ONE line on stdout:
#                                export SLURM_CONF=DIR/slurm.conf
#                              (so: eval "$(slurm_up.sh DIR)")
#   slurm_up.sh --down DIR     cancel all jobs, stop every daemon and job
#                              process of that cluster, remove its state
#                              (DIR/log/ is kept for post-mortems)
#   slurm_up.sh --down --purge DIR   same, and rm -rf DIR
#
# Environment knobs (all optional):
#   SLURM_UP_AUTH=munge|none        default munge. "none" needs auth_none.so
#                                   (present in Slurm 22.05 / Debian 12).
#   SLURM_UP_PROCTRACK=linuxproc|cgroup   default linuxproc (see notes: with
#                                   cgroup, scancel SIGTERMs only the batch
#                                   shell, not its children).
#   SLURM_UP_CPUS=N                 advertise N CPUs (> hardware allowed via
#                                   SlurmdParameters=config_overrides) so N
#                                   array tasks run at once. Default: hardware.
#   SLURM_UP_MEMORY=MiB             advertise this RealMemory (also through
#                                   config_overrides), e.g. so that a script's
#                                   --mem=32G is accepted. Default: hardware.
#   SLURM_UP_NODENAME=name          default "localhost".
#   SLURM_UP_KILLWAIT=s             default 5.
#   SLURM_UP_TIMEOUT=s              seconds to wait for the node to be idle (30).
#
# Needs: slurmctld slurmd sinfo (Debian: slurmctld slurmd slurm-client),
#        munged/mungekey (Debian: munge) unless SLURM_UP_AUTH=none, python3
#        (only to pick free ports). Must run as root (SlurmUser=root).
# Exit codes: 0 ok, 1 failed to start (logs dumped to stderr, cluster torn
#             down), 2 usage / missing binaries.

set -u
PATH="$PATH:/usr/sbin:/sbin"
ME="slurm_up.sh"
log() { echo "$ME: $*" >&2; }
die() { log "$1"; exit "${2:-1}"; }

usage() { sed -n '2,/^$/p' "$0" >&2; exit 2; }

# ---------------------------------------------------------------- helpers
pid_alive() {  # running and not a zombie
    [ -n "${1:-}" ] && [ -r "/proc/$1/stat" ] || return 1
    local st
    st=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)
    [ -n "$st" ] && [ "$st" != Z ]
}

# pids (other than this script and its ancestors) whose environment holds
# the exact entry $1, e.g. SLURM_UP_DIR=/x (our daemons and the slurmstepds
# they fork) or SLURM_CLUSTER_NAME=suXXXX (processes of that cluster's jobs)
pids_with_env() {
    local want=$1 p a ancestors=" "
    a=$$
    while [ -n "$a" ] && [ "$a" != 0 ]; do
        ancestors="$ancestors$a "
        a=$(ps -o ppid= -p "$a" 2>/dev/null | tr -d ' ')
    done
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        case $ancestors in *" $p "*) continue ;; esac
        grep -qzxF "$want" "/proc/$p/environ" 2>/dev/null && echo "$p"
    done
}

stop_pids() {  # stop_pids PID...: TERM all at once, wait up to 10 s, then KILL
    local live="" pid i
    for pid in "$@"; do pid_alive "$pid" && live="$live $pid"; done
    [ -n "$live" ] || return 0
    # shellcheck disable=SC2086
    kill -TERM $live 2>/dev/null
    for i in $(seq 100); do
        local still=""
        for pid in $live; do pid_alive "$pid" && still="$still $pid"; done
        [ -z "$still" ] && return 0
        sleep 0.1
    done
    log "pids$still ignored SIGTERM for 10 s, sending SIGKILL"
    # shellcheck disable=SC2086
    kill -KILL $still 2>/dev/null
    for i in $(seq 20); do
        local any=0
        for pid in $still; do pid_alive "$pid" && any=1; done
        [ $any = 0 ] && return 0
        sleep 0.1
    done
}

free_ports() {  # print two distinct free TCP ports on 127.0.0.1
    python3 - <<'PY'
import socket
socks = []
for _ in range(2):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(*[s.getsockname()[1] for s in socks])
PY
}

# ---------------------------------------------------------------- down
down() {
    local D=$1 purge=$2
    [ -d "$D" ] || { log "no such dir $D"; return 0; }
    D=$(cd "$D" && pwd -P)
    if [ ! -f "$D/.slurm_up" ]; then
        log "no cluster of $ME in $D (no .slurm_up marker): nothing to stop"; return 0
    fi
    # shellcheck disable=SC1091
    . "$D/.slurm_up"        # CLUSTER NODENAME PROCTRACK AUTH KILLWAIT
    local conf="$D/slurm.conf" i

    # 1. cancel every job while the daemons are still there, so Slurm itself
    #    delivers SIGCONT/SIGTERM, waits KillWait, then SIGKILLs.
    local ctld_pid d_pid
    ctld_pid=$(cat "$D/run/slurmctld.pid" 2>/dev/null)
    d_pid=$(cat "$D/run/slurmd.pid" 2>/dev/null)
    if pid_alive "$ctld_pid" && pid_alive "$d_pid"; then
        if [ -n "$(SLURM_CONF=$conf squeue -h -o %A 2>/dev/null)" ]; then
            SLURM_CONF=$conf scancel --quiet --user=root 2>/dev/null
            for i in $(seq $(( (KILLWAIT + 5) * 10 ))); do
                [ -z "$(SLURM_CONF=$conf squeue -h -o %A 2>/dev/null)" ] && break
                sleep 0.1
            done
        fi
    fi

    # 2. stop slurmd, slurmctld and munged together (SIGTERM; each needs up to
    #    ~1.5 s to exit, so in parallel the stop takes < 2 s)
    local m_pid
    m_pid=$(cat "$D/munge/munged.pid" 2>/dev/null)
    stop_pids "$d_pid" "$ctld_pid" "$m_pid"

    # 3. sweep: leftover processes of this cluster -> SIGKILL. Two sources:
    #    a) anything carrying our daemon marker (a slurmstepd orphaned because
    #       slurmd died before its job ended) plus every process of its
    #       session (its job's processes live there);
    #    b) anything whose environment says SLURM_CLUSTER_NAME=$CLUSTER: job
    #       processes that escaped, e.g. with proctrack/linuxproc a child that
    #       survives SIGTERM after its batch shell died is reparented to init
    #       and Slurm forgets it (the job is reported CANCELLED at once).
    local p sid mysid victims=""
    mysid=$(ps -o sid= -p $$ | tr -d ' ')
    for p in $(pids_with_env "SLURM_UP_DIR=$D"); do
        victims="$victims $p"
        sid=$(ps -o sid= -p "$p" 2>/dev/null | tr -d ' ')
        if [ -n "$sid" ] && [ "$sid" != 0 ] && [ "$sid" != "$mysid" ]; then
            victims="$victims $(ps -e -o pid=,sid= | awk -v s="$sid" '$2==s {print $1}')"
        fi
    done
    [ -n "${CLUSTER:-}" ] && victims="$victims $(pids_with_env "SLURM_CLUSTER_NAME=$CLUSTER")"
    victims=$(echo "$victims" | tr ' ' '\n' | grep -v "^$$\$" | grep -v '^$' | sort -u | tr '\n' ' ')
    local live=""
    for p in $victims; do pid_alive "$p" && live="$live $p"; done
    if [ -n "$live" ]; then
        log "killing leftover processes:$(for v in $live; do printf ' %s(%s)' "$v" "$(ps -o comm= -p "$v" 2>/dev/null)"; done)"
        # shellcheck disable=SC2086
        kill -KILL $live 2>/dev/null
        sleep 0.2
    fi

    # 4. proctrack/cgroup leaves /sys/fs/cgroup/freezer/slurm_<node> behind
    if [ "$PROCTRACK" = cgroup ] && [ -d "/sys/fs/cgroup/freezer/slurm_$NODENAME" ]; then
        find "/sys/fs/cgroup/freezer/slurm_$NODENAME" -depth -type d -exec rmdir {} \; 2>/dev/null
    fi

    # 5. state
    if [ "$purge" = 1 ]; then
        rm -rf "$D"
    else
        rm -rf "$D/state" "$D/spool" "$D/munge" "$D/run" "$D/slurm.conf" "$D/cgroup.conf" "$D/.slurm_up"
    fi
    return 0
}

# ---------------------------------------------------------------- up
up() {
    local D=$1
    local AUTH=${SLURM_UP_AUTH:-munge}
    local PROCTRACK=${SLURM_UP_PROCTRACK:-linuxproc}
    local NODENAME=${SLURM_UP_NODENAME:-localhost}
    local KILLWAIT=${SLURM_UP_KILLWAIT:-5}
    local TIMEOUT=${SLURM_UP_TIMEOUT:-30}
    local CPUS=${SLURM_UP_CPUS:-}
    local MEMORY=${SLURM_UP_MEMORY:-}

    [ "$(id -u)" = 0 ] || die "must run as root (SlurmUser=root)" 2
    local b
    for b in slurmctld slurmd sinfo squeue scancel python3; do
        command -v "$b" >/dev/null || die "missing $b (apt-get install -y slurmctld slurmd slurm-client munge)" 2
    done
    case $AUTH in
        munge) for b in munged mungekey; do command -v "$b" >/dev/null || die "missing $b (apt-get install -y munge)" 2; done ;;
        none) ;;
        *) die "SLURM_UP_AUTH must be munge or none" 2 ;;
    esac
    case $PROCTRACK in linuxproc|cgroup) ;; *) die "bad SLURM_UP_PROCTRACK" 2 ;; esac

    mkdir -p "$D" || die "cannot create $D" 2
    D=$(cd "$D" && pwd -P)
    [ -e "$D/.slurm_up" ] && die "$D already holds a cluster; run $ME --down $D first" 2
    # unix socket paths are limited to 107 bytes (sun_path). The longest is
    # slurmstepd's DIR/spool/<node>_<jobid>.4294967291; past the limit a batch
    # job is silently requeued+held ("launch_failed_requeued_held").
    local maxlen=$((107 - ${#NODENAME} - 7 - 1 - 7 - 11))   # allow 7-digit job ids
    [ ${#D} -le $maxlen ] || die "DIR too long (${#D} > $maxlen chars): unix socket $D/spool/${NODENAME}_<jobid>.4294967291 would exceed 107 bytes" 2
    mkdir -p "$D/state" "$D/spool" "$D/log" "$D/run" || die "mkdir failed" 2
    chmod 755 "$D"

    # hardware line from slurmd -C, renamed to our node
    local hw mem
    hw=$(slurmd -C 2>/dev/null | head -1)
    mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
    [ -n "$mem" ] || die "slurmd -C gave no RealMemory: $hw"
    local nodeline sdparams=""
    if [ -n "$CPUS$MEMORY" ]; then
        [ -n "$CPUS" ] || CPUS=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
        nodeline="NodeName=$NODENAME NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=${MEMORY:-$mem} State=UNKNOWN"
        sdparams="SlurmdParameters=config_overrides"
    else
        # keep CPUs/Boards/SocketsPerBoard/CoresPerSocket/ThreadsPerCore/RealMemory
        local topo
        topo=$(tr ' ' '\n' <<<"$hw" | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore|RealMemory)=' | tr '\n' ' ')
        nodeline="NodeName=$NODENAME NodeHostname=localhost NodeAddr=127.0.0.1 ${topo}State=UNKNOWN"
    fi

    # unique ClusterName: slurmstepd puts SLURM_CLUSTER_NAME into every job's
    # environment (even with --export=NONE), which lets --down find job
    # processes that escaped proctrack/linuxproc by being reparented to init.
    local CLUSTER
    CLUSTER=su$(od -An -N5 -tx1 /dev/urandom | tr -d ' \n')
    cat > "$D/.slurm_up" <<EOF
CLUSTER=$CLUSTER
NODENAME=$NODENAME
PROCTRACK=$PROCTRACK
AUTH=$AUTH
KILLWAIT=$KILLWAIT
EOF

    local authlines
    if [ "$AUTH" = munge ]; then
        mkdir -p "$D/munge"
        authlines="AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.sock"
    else
        authlines="AuthType=auth/none
CredType=cred/none"
    fi

    if [ "$PROCTRACK" = cgroup ]; then
        # Without this file Slurm 22.05 mkdirs "/sys/fs/cgroup/freezer(null)"
        # and every job fails with "cgroup namespace 'freezer' not mounted".
        cat > "$D/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
CgroupAutomount=no
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
    fi

    local attempt ports p1 p2 ok=0 i state=""
    for attempt in 1 2 3; do
        ports=$(free_ports) || die "python3 failed to pick ports"
        read -r p1 p2 <<<"$ports"
        cat > "$D/slurm.conf" <<EOF
# generated by $ME
ClusterName=$CLUSTER
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$p1
SlurmdPort=$p2
SlurmUser=root
SlurmdUser=root
$authlines
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/run/slurmctld.pid.daemon
SlurmdPidFile=$D/run/slurmd.pid.daemon
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/$PROCTRACK
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
MaxArraySize=10001
KillWait=$KILLWAIT
ReturnToService=2
$sdparams
$nodeline
PartitionName=debug Nodes=$NODENAME Default=YES MaxTime=INFINITE State=UP
EOF
        export SLURM_CONF="$D/slurm.conf"

        if [ "$AUTH" = munge ] && ! pid_alive "$(cat "$D/munge/munged.pid" 2>/dev/null)"; then
            [ -f "$D/munge/munge.key" ] || mungekey -c -k "$D/munge/munge.key" || die "mungekey failed"
            # -f: munged insists that every parent dir of the socket be o+x
            # (pytest's /tmp/pytest-of-root is 0700); we run everything as root.
            SLURM_UP_DIR=$D munged -f --socket="$D/munge/munge.sock" \
                --key-file="$D/munge/munge.key" --pid-file="$D/munge/munged.pid" \
                --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed" \
                || { cat "$D/munge/munged.log" >&2; down "$D" 0; die "munged failed"; }
        fi

        # -D: stay in the foreground; setsid+nohup: detach from our session.
        # SLURM_UP_DIR marks these processes and the slurmstepds they fork.
        setsid nohup env SLURM_UP_DIR="$D" slurmctld -D -f "$SLURM_CONF" \
            >"$D/log/slurmctld.out" 2>&1 </dev/null &
        echo $! > "$D/run/slurmctld.pid"
        setsid nohup env SLURM_UP_DIR="$D" slurmd -D -N "$NODENAME" -f "$SLURM_CONF" \
            >"$D/log/slurmd.out" 2>&1 </dev/null &
        echo $! > "$D/run/slurmd.pid"

        for i in $(seq $((TIMEOUT * 10))); do
            state=$(sinfo -h -n "$NODENAME" -o %T 2>/dev/null)
            [ "$state" = idle ] && { ok=1; break; }
            pid_alive "$(cat "$D/run/slurmctld.pid")" && pid_alive "$(cat "$D/run/slurmd.pid")" || break
            sleep 0.1
        done
        [ $ok = 1 ] && break
        if grep -qsi "address already in use" "$D/log/slurmctld.log" "$D/log/slurmd.log" \
                "$D/log/slurmctld.out" "$D/log/slurmd.out"; then
            log "port clash on attempt $attempt, retrying with new ports"
            stop_pids "$(cat "$D/run/slurmd.pid")" "$(cat "$D/run/slurmctld.pid")"
            rm -rf "$D/state"/* "$D/spool"/*
            continue
        fi
        break
    done

    if [ $ok != 1 ]; then
        log "node never became idle (last state '${state}'); logs follow"
        for f in "$D"/log/*; do echo "----- $f" >&2; tail -n 30 "$f" >&2; done
        down "$D" 0
        exit 1
    fi
    echo "export SLURM_CONF=$D/slurm.conf"
}

# ---------------------------------------------------------------- main
[ $# -ge 1 ] || usage
case $1 in
    -h|--help) usage ;;
    --down)
        shift; purge=0
        [ "${1:-}" = --purge ] && { purge=1; shift; }
        [ $# = 1 ] || usage
        down "$1" "$purge"; exit $? ;;
    -*) usage ;;
    *) [ $# = 1 ] || usage; up "$1" ;;
esac
