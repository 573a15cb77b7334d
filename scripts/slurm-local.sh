#!/usr/bin/env bash
# A single-node SLURM cluster on localhost, with accounting and 8 fake GPUs.
#
#   scripts/slurm-local.sh start|stop|status|env [STATE_DIR]
#
# start   installs the Debian packages if missing (apt, --no-install-recommends), then starts
#         munged, a private MariaDB, slurmdbd, slurmctld and slurmd; waits until the node is idle
# stop    cancels leftover jobs, then TERMs every daemon through its PID file in reverse order
#         (KILL after 15 s); exits non-zero if a daemon is still alive
# status  each daemon's PID and whether it is alive, then sinfo; exit 0 only if all are up
# env     prints `export SLURM_CONF=...` for clients (sbatch, sacct, packline run --executor slurm)
#
# Everything (configs, munge key and socket, database, state, spool, PID and log files, fake GPU
# devices) lives under STATE_DIR (default $PACKLINE_SLURM_STATE or /tmp/packline-slurm); nothing
# is written to /etc/slurm or /etc/munge. Clients find the cluster through SLURM_CONF.
# Ports: PACKLINE_SLURM_PORT_BASE (default 6817) for slurmctld, +1 slurmd, +2 slurmdbd, +3 MariaDB.
# Needs root (or passwordless sudo). Recipe and pitfalls: shared/reference/slurm-nemo-run-mlflow.md.
set -euo pipefail

CMD="${1:-}"
STATE="${2:-${PACKLINE_SLURM_STATE:-/tmp/packline-slurm}}"
PORT_BASE="${PACKLINE_SLURM_PORT_BASE:-6817}"
CTLD_PORT=$PORT_BASE
SLURMD_PORT=$((PORT_BASE + 1))
DBD_PORT=$((PORT_BASE + 2))
DB_PORT=$((PORT_BASE + 3))
NUM_GPUS=8
PACKAGES=(slurmctld slurmd slurmdbd slurm-client munge mariadb-server)
# Daemons in start order; stop goes in reverse.
DAEMONS=(munged mariadbd slurmdbd slurmctld slurmd)

usage() {
    echo "usage: $0 start|stop|status|env [STATE_DIR]" >&2
    exit 2
}

log() { echo "[slurm-local] $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

if [[ $EUID -ne 0 ]]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        exec sudo -n --preserve-env=PACKLINE_SLURM_STATE,PACKLINE_SLURM_PORT_BASE "$0" "$@"
    fi
    die "needs root or passwordless sudo (apt-get, daemons running as munge/mysql users)"
fi

STATE="$(mkdir -p "$STATE" && cd "$STATE" && pwd)"
ETC="$STATE/etc"
PIDS="$STATE/pid"
LOGS="$STATE/log"
CONF="$ETC/slurm.conf"
export SLURM_CONF="$CONF"
HOST="$(hostname -s)"

pid_file() {
    case "$1" in
    munged) echo "$STATE/munge/munged.pid" ;;
    mariadbd) echo "$STATE/mysql/run/mariadbd.pid" ;;
    *) echo "$PIDS/$1.pid" ;;
    esac
}

pid_of() {
    local f
    f="$(pid_file "$1")"
    [[ -s "$f" ]] && tr -d '[:space:]' <"$f" || true
}

running() { # a live process, not a zombie waiting for its reaper
    kill -0 "$1" 2>/dev/null && [[ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]]
}

pid_of_daemon() { # the PID in NAME's PID file, if that process is still NAME (not a reused PID)
    local pid
    pid="$(pid_of "$1")"
    [[ -n "$pid" && "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$1" ]] && echo "$pid" || true
}

alive() {
    local pid
    pid="$(pid_of_daemon "$1")"
    [[ -n "$pid" ]] && running "$pid"
}

wait_for() { # wait_for SECONDS DESCRIPTION COMMAND...
    local seconds=$1 what=$2
    shift 2
    local deadline=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "timed out after ${seconds}s waiting for $what (logs: $LOGS)"
        sleep 0.2
    done
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

install_packages() {
    local missing=()
    for bin in slurmctld slurmd slurmdbd sbatch sacct munged mariadbd mariadb-install-db; do
        command -v "$bin" >/dev/null || missing+=("$bin")
    done
    ((${#missing[@]} == 0)) && return 0
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
    log "installing ${PACKAGES[*]} (missing: ${missing[*]})"
    # Never let package scripts start system-wide services: everything runs from STATE.
    local policy=/usr/sbin/policy-rc.d own_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && own_policy=1
    fi
    local rc=0
    {
        apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                "${PACKAGES[@]}" >"$LOGS/apt.log" 2>&1
    } || rc=$?
    ((own_policy)) && rm -f "$policy"
    ((rc == 0)) || die "apt-get install failed (rc $rc); see $LOGS/apt.log"
}

write_configs() {
    local cpus=16 mem
    mem=$(($(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo) - 512))
    mkdir -p "$ETC" "$STATE/slurmctld" "$STATE/slurmd"
    cat >"$CONF" <<EOF
# Written by scripts/slurm-local.sh: a one-node cluster on localhost.
ClusterName=packline
SlurmctldHost=$HOST
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket
CryptoType=crypto/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$STATE/munge/munge.socket
AccountingStorageTRES=gres/gpu
JobCompType=jobcomp/filetxt
JobCompLoc=$LOGS/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$(pid_file slurmctld)
SlurmdPidFile=$(pid_file slurmd)
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
MinJobAge=300
KillWait=5
InactiveLimit=0
Waittime=0
NodeName=$HOST CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem Gres=gpu:$NUM_GPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    cat >"$ETC/gres.conf" <<EOF
AutoDetect=off
NodeName=$HOST Name=gpu File=$STATE/fakegpu[0-$((NUM_GPUS - 1))]
EOF
    # Character devices with /dev/null's numbers: slurmd counts them and sets CUDA_VISIBLE_DEVICES.
    for ((i = 0; i < NUM_GPUS; i++)); do
        [[ -c "$STATE/fakegpu$i" ]] || mknod "$STATE/fakegpu$i" c 1 3
    done
    (
        umask 077
        cat >"$ETC/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOGS/slurmdbd.log
PidFile=$(pid_file slurmdbd)
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$STATE/mysql/slurm.pass")
StorageLoc=slurm_acct_db
EOF
    )
    chmod 600 "$ETC/slurmdbd.conf"
}

start_munge() {
    local dir="$STATE/munge"
    mkdir -p "$dir"
    chown munge:munge "$dir"
    chmod 755 "$dir" # clients need to reach the socket
    if [[ ! -s "$dir/munge.key" ]]; then
        dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none
    fi
    chown munge:munge "$dir/munge.key"
    chmod 400 "$dir/munge.key"
    alive munged && return 0
    runuser -u munge -- munged --socket="$dir/munge.socket" --key-file="$dir/munge.key" \
        --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munged.seed"
    wait_for 15 munged bash -c "munge -n --socket='$dir/munge.socket' | unmunge --socket='$dir/munge.socket'"
}

start_mariadb() {
    local dir="$STATE/mysql"
    mkdir -p "$dir/data" "$dir/run"
    chown -R mysql:mysql "$dir/data" "$dir/run"
    if [[ ! -s "$dir/slurm.pass" ]]; then
        (umask 077 && head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/slurm.pass")
    fi
    if [[ ! -d "$dir/data/mysql" ]]; then
        mariadb-install-db --user=mysql --datadir="$dir/data" --skip-test-db \
            >"$LOGS/mariadb-install.log" 2>&1 || die "mariadb-install-db failed; see $LOGS"
    fi
    if ! alive mariadbd; then
        # mariadbd does not fork: run it in the background, detached from this shell.
        setsid mariadbd --no-defaults --user=mysql --datadir="$dir/data" \
            --socket="$dir/run/mariadbd.sock" --pid-file="$(pid_file mariadbd)" \
            --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
            --log-error="$dir/run/mariadbd.log" </dev/null >/dev/null 2>&1 &
        wait_for 60 mariadbd mariadb-admin --socket="$dir/run/mariadbd.sock" ping
    fi
    mariadb --socket="$dir/run/mariadbd.sock" -u root <<EOF
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$dir/slurm.pass")';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
EOF
}

start() {
    mkdir -p "$ETC" "$PIDS" "$LOGS"
    chmod 755 "$STATE"
    install_packages
    getent hosts "$HOST" >/dev/null || echo "127.0.0.1 $HOST" >>/etc/hosts
    start_munge
    start_mariadb
    write_configs
    if ! alive slurmdbd; then
        slurmdbd
        wait_for 30 "slurmdbd on port $DBD_PORT" port_open "$DBD_PORT"
    fi
    if ! alive slurmctld; then
        slurmctld -i
        wait_for 30 slurmctld scontrol ping
    fi
    if ! alive slurmd; then
        slurmd
    fi
    wait_for 60 "node $HOST idle" bash -c "sinfo -h -N -o %T | grep -qx idle"
    log "up: $(sinfo -h -N -o '%N %T %G') — clients need: export SLURM_CONF=$CONF"
}

stop() {
    if alive slurmctld && command -v squeue >/dev/null; then
        local jobs
        jobs="$(squeue -h -o %i 2>/dev/null || true)"
        if [[ -n "$jobs" ]]; then
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            local deadline=$((SECONDS + 20))
            while [[ -n "$(squeue -h -o %i 2>/dev/null)" ]] && ((SECONDS < deadline)); do
                sleep 0.5
            done
        fi
    fi
    local failed=0
    for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
        local name=${DAEMONS[$i]} pid
        pid="$(pid_of_daemon "$name")"
        if [[ -z "$pid" ]]; then
            rm -f "$(pid_file "$name")" # stale: that process is gone
            continue
        fi
        if running "$pid"; then
            kill -TERM "$pid" 2>/dev/null || true
            local deadline=$((SECONDS + 15))
            while running "$pid" && ((SECONDS < deadline)); do sleep 0.2; done
            if running "$pid"; then
                log "$name ($pid) ignored TERM for 15 s: KILL"
                kill -KILL "$pid" 2>/dev/null || true
                sleep 0.5
            fi
        fi
        if running "$pid"; then
            log "$name ($pid) is still alive"
            failed=1
        else
            rm -f "$(pid_file "$name")"
        fi
    done
    ((failed == 0)) || exit 1
    log "stopped (state kept in $STATE)"
}

status() {
    local down=0
    for name in "${DAEMONS[@]}"; do
        if alive "$name"; then
            echo "$name running pid $(pid_of "$name")"
        else
            echo "$name stopped"
            down=1
        fi
    done
    if ((down == 0)); then
        sinfo -N -o '%N %T %c %m %G' || down=1
    fi
    return $down
}

case "$CMD" in
start) start ;;
stop) stop ;;
status) status ;;
env) echo "export SLURM_CONF=$CONF" ;;
*) usage ;;
esac
