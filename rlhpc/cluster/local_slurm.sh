#!/usr/bin/env bash
# local_slurm.sh — a real Slurm cluster on one machine, for trying rlhpc's Slurm path on a laptop or CI box.
#
#   local_slurm.sh install  only install the packages 'up' needs (if missing); starts nothing
#   local_slurm.sh up       install (if missing) and start munged, MariaDB, slurmdbd, slurmctld, N slurmd's, a waker
#   local_slurm.sh down     cancel all jobs, stop exactly the processes 'up' started, wait until they are gone
#   local_slurm.sh status   show what runs (exit 0: up, 1: partly up, 3: down)
#   local_slurm.sh purge    'down', then delete the state dir and the config files this script wrote
#
# Debian/Ubuntu, run as root, no systemd needed. Every wait has a timeout. 'up' is idempotent: a second run finds the
# cluster running and returns at once. PIDs (with their start times, so a recycled PID is never mistaken for ours)
# are recorded under $STATE/pids; 'down' ends those and nothing else.
#
# Environment (all optional):
#   RLHPC_SLURM_STATE      state dir (default /var/lib/rlhpc-slurm; 'down'/'status' read it from slurm.conf if unset)
#   RLHPC_SLURM_CLUSTER    cluster name (default rlhpc)         RLHPC_SLURM_PARTITION  partition (default debug)
#   RLHPC_SLURM_NODES      number of nodes n1..nN (default 4)   RLHPC_SLURM_CPUS       CPUs per node (default 4)
#   RLHPC_SLURM_MEM_MB     RealMemory per node (default 4096)   RLHPC_SLURM_PORT_BASE  first port (default 6817)
#   RLHPC_SLURM_WAKE_S     waker period in seconds (default 5)  RLHPC_SLURM_TIMEOUT    per-wait timeout (default 60)
#   RLHPC_SLURM_OVERWRITE  1: replace a slurm.conf/slurmdbd.conf not written by this script (a backup is kept)
#   RLHPC_SLURM_NO_APT     1: never call apt-get (fail if a package is missing)
set -euo pipefail
set +m
umask 022

PROG="rlhpc-slurm"
MARK="# Managed by rlhpc (rlhpc/cluster/local_slurm.sh). Rewritten by 'up'; do not edit."
CONF_DIR=/etc/slurm
SLURM_CONF="$CONF_DIR/slurm.conf"
DBD_CONF="$CONF_DIR/slurmdbd.conf"
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)

CLUSTER="${RLHPC_SLURM_CLUSTER:-rlhpc}"
PARTITION="${RLHPC_SLURM_PARTITION:-debug}"
NNODES="${RLHPC_SLURM_NODES:-4}"
CPUS="${RLHPC_SLURM_CPUS:-4}"
MEM_MB="${RLHPC_SLURM_MEM_MB:-4096}"
PORT_BASE="${RLHPC_SLURM_PORT_BASE:-6817}"
WAKE_S="${RLHPC_SLURM_WAKE_S:-5}"
TIMEOUT="${RLHPC_SLURM_TIMEOUT:-60}"

CTLD_PORT=$PORT_BASE
DBD_PORT=$((PORT_BASE + 2))
DB_PORT=$((PORT_BASE + 3))
SLURMD_PORT0=$((PORT_BASE + 4))            # n1 listens on SLURMD_PORT0, n2 on SLURMD_PORT0+1, ...
NODES=()
for ((i = 1; i <= NNODES; i++)); do NODES+=("n$i"); done
NODELIST="n[1-$NNODES]"
[[ $NNODES -eq 1 ]] && NODELIST="n1"

T0=$(date +%s.%N)
log() { printf '[%s %6.2fs] %s\n' "$PROG" "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN { print a - b }')" "$*"; }
IN_UP=0
die() {
    printf '[%s] ERROR: %s\n' "$PROG" "$*" >&2
    if [[ $IN_UP == 1 ]] && ls "$PIDS"/* >/dev/null 2>&1; then
        printf '[%s] what was started so far keeps running; '"'"'%s down'"'"' stops it\n' "$PROG" "$0" >&2
    fi
    exit 1
}

# ---------------------------------------------------------------------------------------------------------------
# state dir: env, else the one named in our slurm.conf, else the default
resolve_state() {
    if [[ -n "${RLHPC_SLURM_STATE:-}" ]]; then
        STATE="$RLHPC_SLURM_STATE"
    elif [[ -f "$SLURM_CONF" ]] && grep -qF "$MARK" "$SLURM_CONF"; then
        STATE=$(sed -n 's/^# rlhpc-state-dir: //p' "$SLURM_CONF" | head -n1)
        [[ -n "$STATE" ]] || STATE=/var/lib/rlhpc-slurm
    else
        STATE=/var/lib/rlhpc-slurm
    fi
    [[ "$STATE" == /* ]] || die "RLHPC_SLURM_STATE must be an absolute path (got '$STATE')"
    PIDS="$STATE/pids"
    LOGS="$STATE/log"
    DB_DIR="$STATE/mariadb"
    DB_SOCK="$DB_DIR/run/mysqld.sock"
}

need_root() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts system daemons); try: sudo $0 $*"
}

lock() {
    mkdir -p "$STATE"
    exec 9>"$STATE/.lock"
    flock -w "$TIMEOUT" 9 || die "another '$PROG' is running (lock $STATE/.lock held for ${TIMEOUT}s)"
}

# ---------------------------------------------------------------------------------------------------------------
# process bookkeeping: $PIDS/<name> holds "pid starttime"
starttime_of() { # pid -> starttime (field 22 of /proc/pid/stat); fails if no such process or a zombie
    local s
    s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    s=${s##*) }
    # shellcheck disable=SC2086
    set -- $s
    [[ "$1" != Z ]] || return 1
    echo "${20}"
}

alive() { # name -> 0 if the recorded process is still the one we started
    local f="$PIDS/$1" pid st now
    [[ -f "$f" ]] || return 1
    read -r pid st <"$f" || return 1
    [[ -n "$pid" && -n "$st" ]] || return 1
    now=$(starttime_of "$pid") || return 1
    [[ "$now" == "$st" ]]
}

pid_of() {
    local pid
    read -r pid _ <"$PIDS/$1" && echo "$pid"
}

start_bg() { # name logfile cmd... : start cmd in its own session, stdin/out/err detached, record pid
    local name=$1 logf=$2
    shift 2
    mkdir -p "$PIDS" "$LOGS"
    # 9>&- : the daemons must not inherit our lock
    setsid "$@" </dev/null >>"$logf" 2>&1 9>&- &
    local pid=$! st
    st=$(starttime_of "$pid") || die "$name exited immediately; see $logf:
$(tail -n 20 "$logf" 2>/dev/null)"
    echo "$pid $st" >"$PIDS/$name"
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

check_port_free() { # name port
    if port_busy "$2"; then
        die "port $2 (for $1) is already in use by a process not started by rlhpc.
  Stop it, or pick other ports with RLHPC_SLURM_PORT_BASE=... (uses BASE..BASE+$((4 + NNODES - 1)))."
    fi
}

wait_for() { # description timeout_s name_of_process_or_- logfile cmd... : poll cmd until it succeeds
    local what=$1 tmo=$2 name=$3 logf=$4
    shift 4
    local deadline=$(($(date +%s) + tmo))
    while true; do
        if "$@" >/dev/null 2>&1; then return 0; fi
        if [[ "$name" != "-" ]] && ! alive "$name"; then
            die "$name died while waiting for $what; last lines of $logf:
$(tail -n 25 "$logf" 2>/dev/null)"
        fi
        if (($(date +%s) >= deadline)); then
            die "timed out after ${tmo}s waiting for $what; last lines of $logf:
$(tail -n 25 "$logf" 2>/dev/null)"
        fi
        sleep 0.2
    done
}

stop_proc() { # name [group] : TERM, wait, KILL; only if it is the process we recorded
    local name=$1 group=${2:-} pid i
    if ! alive "$name"; then
        rm -f "$PIDS/$name"
        return 0
    fi
    pid=$(pid_of "$name")
    if [[ -n "$group" ]]; then kill -TERM -- "-$pid" 2>/dev/null || true; else kill -TERM "$pid" 2>/dev/null || true; fi
    for ((i = 0; i < TIMEOUT * 5; i++)); do
        alive "$name" || break
        sleep 0.2
    done
    if alive "$name"; then
        log "$name (pid $pid) ignored SIGTERM for ${TIMEOUT}s; sending SIGKILL"
        if [[ -n "$group" ]]; then kill -KILL -- "-$pid" 2>/dev/null || true; else kill -KILL "$pid" 2>/dev/null || true; fi
        for ((i = 0; i < 50; i++)); do
            alive "$name" || break
            sleep 0.2
        done
        alive "$name" && die "could not end $name (pid $pid)"
    fi
    rm -f "$PIDS/$name"
    log "stopped $name (pid $pid)"
}

# ---------------------------------------------------------------------------------------------------------------
ensure_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" == "install ok installed" ]] || missing+=("$p")
    done
    if [[ ${#missing[@]} -eq 0 ]]; then
        return 0
    fi
    [[ "${RLHPC_SLURM_NO_APT:-0}" == 1 ]] && die "missing packages: ${missing[*]} (and RLHPC_SLURM_NO_APT=1)"
    command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get: this script supports Debian/Ubuntu"
    log "installing ${missing[*]} with apt-get (services are not auto-started)"
    # Keep the packages' init scripts from starting daemons we would not own.
    local made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        made_policy=1
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    local aptlog="/tmp/rlhpc-slurm-apt.$$.log"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >"$aptlog" 2>&1; then
        log "apt-get install failed; running apt-get update and retrying"
        apt-get update -q >>"$aptlog" 2>&1 || true
        apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$aptlog" 2>&1 ||
            die "apt-get install ${missing[*]} failed; see $aptlog:
$(tail -n 20 "$aptlog")"
    fi
    rm -f "$aptlog"
    if [[ $made_policy == 1 ]]; then
        rm -f /usr/sbin/policy-rc.d
        trap - EXIT
    fi
    if [[ -d /run/systemd/system ]]; then
        log "note: systemd is running here; the packages may have enabled their own services (munge, mariadb," \
            "slurmctld, slurmd, slurmdbd). 'systemctl disable --now slurmctld slurmd slurmdbd' keeps them out of the way."
    fi
    log "packages installed"
}

ensure_munge_key() {
    local key=/etc/munge/munge.key
    id munge >/dev/null 2>&1 || die "user 'munge' does not exist (is the munge package installed?)"
    mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
    chmod 700 /etc/munge /var/lib/munge /var/log/munge
    chmod 755 /run/munge
    if [[ ! -s "$key" ]]; then
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile="$key" >/dev/null 2>&1 || dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
        else
            dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
        fi
        log "created munge key $key"
    fi
    chown munge:munge "$key"
    chmod 400 "$key"
}

munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

# ---------------------------------------------------------------------------------------------------------------
render_slurm_conf() {
    cat <<EOF
$MARK
# rlhpc-state-dir: $STATE
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# short credential lifetime: a requeued job may start again after ~10 s instead of 120 s
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# several slurmd on one host, each declaring its own (fake) CPUs and memory
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
KillWait=5
InactiveLimit=0
MinJobAge=300
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
NodeName=$NODELIST NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$SLURMD_PORT0-$((SLURMD_PORT0 + NNODES - 1))] CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODELIST Default=YES MaxTime=INFINITE State=UP
EOF
}

render_dbd_conf() {
    cat <<EOF
$MARK
# rlhpc-state-dir: $STATE
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOGS/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$STATE/db.pass")
StorageLoc=slurm_acct_db
EOF
}

CONF_CHANGED=0
install_conf() { # path mode renderer
    local path=$1 mode=$2 renderer=$3 tmp
    tmp=$(mktemp "$path.XXXXXX")
    "$renderer" >"$tmp"
    chmod "$mode" "$tmp"
    if [[ -f "$path" ]] && cmp -s "$tmp" "$path"; then
        rm -f "$tmp"
        return 0
    fi
    if [[ -f "$path" ]] && ! grep -qF "$MARK" "$path"; then
        if [[ "${RLHPC_SLURM_OVERWRITE:-0}" != 1 ]]; then
            rm -f "$tmp"
            die "$path exists and was not written by rlhpc. Move it aside, or set RLHPC_SLURM_OVERWRITE=1 to replace it (a backup is kept)."
        fi
        cp -p "$path" "$path.rlhpc-backup.$(date +%Y%m%d%H%M%S)"
        log "backed up the existing $path"
    fi
    [[ -f "$path" ]] && CONF_CHANGED=1
    mv -f "$tmp" "$path"
    log "wrote $path"
}

guard_other_state() { # refuse to rewrite slurm.conf under a cluster started from another state dir
    [[ -f "$SLURM_CONF" ]] && grep -qF "$MARK" "$SLURM_CONF" || return 0
    local other f
    other=$(sed -n 's/^# rlhpc-state-dir: //p' "$SLURM_CONF" | head -n1)
    [[ -n "$other" && "$other" != "$STATE" && -d "$other/pids" ]] || return 0
    for f in "$other"/pids/*; do
        [[ -e "$f" ]] || continue
        if PIDS="$other/pids" alive "$(basename "$f")"; then
            die "a cluster started from state dir $other is running and owns $SLURM_CONF;
  stop it first: RLHPC_SLURM_STATE=$other $0 down"
        fi
    done
}

write_configs() {
    guard_other_state
    mkdir -p "$CONF_DIR" "$STATE"/{run,slurmctld,pids,log} "$LOGS"
    for n in "${NODES[@]}"; do mkdir -p "$STATE/slurmd/$n"; done
    chmod 755 "$STATE"
    if [[ ! -s "$STATE/db.pass" ]]; then
        (umask 077 && head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$STATE/db.pass")
    fi
    install_conf "$SLURM_CONF" 644 render_slurm_conf
    install_conf "$DBD_CONF" 600 render_dbd_conf
}

# ---------------------------------------------------------------------------------------------------------------
start_munge() {
    if alive munged; then
        log "munged already running (pid $(pid_of munged))"
        return 0
    fi
    if munge_ok; then
        log "a munged not started by rlhpc answers on the default socket; using it"
        return 0
    fi
    ensure_munge_key
    start_bg munged "$LOGS/munged.out" setpriv --reuid=munge --regid=munge --init-groups -- /usr/sbin/munged --foreground
    wait_for "munged" "$TIMEOUT" munged "$LOGS/munged.out" munge_ok
    log "started munged (pid $(pid_of munged))"
}

db_sql() { mariadb --no-defaults --socket="$DB_SOCK" -u root -N -B -e "$1"; }

start_mariadb() {
    if alive mariadb; then
        log "mariadb already running (pid $(pid_of mariadb))"
        return 0
    fi
    id mysql >/dev/null 2>&1 || die "user 'mysql' does not exist (is mariadb-server installed?)"
    mkdir -p "$DB_DIR/run"
    chown mysql:mysql "$DB_DIR" "$DB_DIR/run"
    chmod 750 "$DB_DIR"
    chmod 755 "$DB_DIR/run"
    chmod o+x "$DB_DIR"
    if [[ ! -d "$DB_DIR/data/mysql" ]]; then
        log "initialising a private MariaDB datadir in $DB_DIR/data"
        rm -rf "$DB_DIR/data"
        mariadb-install-db --no-defaults --user=mysql --datadir="$DB_DIR/data" --auth-root-authentication-method=socket \
            --skip-test-db --skip-name-resolve >"$LOGS/mariadb-install.log" 2>&1 ||
            die "mariadb-install-db failed; see $LOGS/mariadb-install.log:
$(tail -n 20 "$LOGS/mariadb-install.log")"
    fi
    check_port_free mariadb "$DB_PORT"
    start_bg mariadb "$LOGS/mariadb.out" /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DB_DIR/data" \
        --socket="$DB_SOCK" --pid-file="$DB_DIR/run/mysqld.pid" --port="$DB_PORT" --bind-address=127.0.0.1 \
        --skip-name-resolve --log-error="$LOGS/mariadb.log" --innodb-buffer-pool-size=128M \
        --innodb-lock-wait-timeout=900 --max-allowed-packet=64M
    wait_for "mariadb" "$TIMEOUT" mariadb "$LOGS/mariadb.log" db_sql "SELECT 1"
    local pw
    pw=$(cat "$STATE/db.pass")
    db_sql "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
            CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
            ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" ||
        die "could not create the accounting database and user in MariaDB"
    log "started mariadb (pid $(pid_of mariadb), 127.0.0.1:$DB_PORT, datadir $DB_DIR/data)"
}

dbd_ok() { sacctmgr -n -P show cluster format=cluster; }

start_slurmdbd() {
    if alive slurmdbd; then
        log "slurmdbd already running (pid $(pid_of slurmdbd))"
        return 0
    fi
    check_port_free slurmdbd "$DBD_PORT"
    start_bg slurmdbd "$LOGS/slurmdbd.out" /usr/sbin/slurmdbd -D
    wait_for "slurmdbd (port $DBD_PORT)" "$TIMEOUT" slurmdbd "$LOGS/slurmdbd.log" dbd_ok
    if ! sacctmgr -n -P show cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster $CLUSTER failed"
        log "registered cluster '$CLUSTER' in the accounting database"
    fi
    log "started slurmdbd (pid $(pid_of slurmdbd), port $DBD_PORT)"
}

ctld_ok() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

start_slurmctld() {
    if alive slurmctld; then
        if [[ $CONF_CHANGED == 1 ]]; then
            if scontrol reconfigure >/dev/null 2>&1; then
                log "slurm.conf changed: ran 'scontrol reconfigure'"
            else
                log "slurm.conf changed but 'scontrol reconfigure' failed; run '$0 down' and '$0 up'"
            fi
        fi
        log "slurmctld already running (pid $(pid_of slurmctld))"
        return 0
    fi
    check_port_free slurmctld "$CTLD_PORT"
    start_bg slurmctld "$LOGS/slurmctld.out" /usr/sbin/slurmctld -D
    wait_for "slurmctld (port $CTLD_PORT)" "$TIMEOUT" slurmctld "$LOGS/slurmctld.log" ctld_ok
    log "started slurmctld (pid $(pid_of slurmctld), port $CTLD_PORT)"
}

start_slurmds() {
    local i n started=()
    for ((i = 0; i < NNODES; i++)); do
        n=${NODES[$i]}
        if alive "slurmd-$n"; then continue; fi
        check_port_free "slurmd $n" $((SLURMD_PORT0 + i))
        start_bg "slurmd-$n" "$LOGS/slurmd-$n.out" /usr/sbin/slurmd -D -N "$n"
        started+=("$n:$(pid_of "slurmd-$n")")
    done
    if [[ ${#started[@]} -gt 0 ]]; then
        log "started slurmd ${started[*]} (ports $SLURMD_PORT0-$((SLURMD_PORT0 + NNODES - 1)))"
    else
        log "slurmd's already running"
    fi
}

nodes_ready() { # all nodes idle/mix/alloc/comp, i.e. registered and usable
    local out bad
    out=$(sinfo -h -N -p "$PARTITION" -o '%N %t' 2>/dev/null) || return 1
    [[ $(wc -l <<<"$out") -ge $NNODES ]] || return 1
    bad=$(awk '$2 !~ /^(idle|mix|alloc|comp)$/' <<<"$out")
    [[ -z "$bad" ]]
}

wait_nodes() {
    local deadline=$(($(date +%s) + TIMEOUT)) resumed=0 t_resume=$(($(date +%s) + 3))
    while ! nodes_ready; do
        for n in "${NODES[@]}"; do
            alive "slurmd-$n" || die "slurmd for $n died; last lines of $LOGS/slurmd-$n.log:
$(tail -n 25 "$LOGS/slurmd-$n.log" 2>/dev/null)"
        done
        # nodes left DOWN/DRAINED by an earlier run, whose slurmd does answer (no '*'): resume them once
        if [[ $resumed == 0 && $(date +%s) -ge $t_resume ]]; then
            local stuck
            stuck=$(sinfo -h -N -p "$PARTITION" -o '%N %t' 2>/dev/null | awk '$2 ~ /^(down|drain|drng|fail)$/ {print $1}' | paste -sd, -)
            if [[ -n "$stuck" ]]; then
                scontrol update nodename="$stuck" state=resume >/dev/null 2>&1 || true
                log "resumed nodes left down/drained by an earlier run: $stuck"
            fi
            resumed=1
        fi
        if (($(date +%s) >= deadline)); then
            die "timed out after ${TIMEOUT}s waiting for nodes to become idle:
$(sinfo -N -p "$PARTITION" 2>&1)"
        fi
        sleep 0.2
    done
}

start_waker() {
    if alive waker; then return 0; fi
    # A requeued heterogeneous job waits until the scheduler's state changes; a periodic no-op update wakes it.
    # It only fires while some job is pending, to keep slurmctld's log quiet.
    start_bg waker "$LOGS/waker.out" bash -c "trap 'exit 0' TERM; while :; do
        if [[ -n \$(squeue -h -t pending -o %i 2>/dev/null) ]]; then
            scontrol update partitionname=$PARTITION state=up >/dev/null 2>&1; fi
        sleep $WAKE_S & wait \$!; done"
    log "started waker (pid $(pid_of waker)): 'scontrol update partitionname=$PARTITION state=up' every ${WAKE_S}s while jobs are pending"
}

all_alive() {
    local c
    for c in munged mariadb slurmdbd slurmctld waker; do alive "$c" || return 1; done
    for c in "${NODES[@]}"; do alive "slurmd-$c" || return 1; done
}

# ---------------------------------------------------------------------------------------------------------------
cmd_up() {
    need_root up
    resolve_state
    lock
    # fast path: everything we started is still there and answers
    if all_alive && [[ -f "$SLURM_CONF" ]] && [[ "$(render_slurm_conf)" == "$(cat "$SLURM_CONF")" ]] && ctld_ok && nodes_ready; then
        log "cluster '$CLUSTER' is already up ($NNODES nodes in partition '$PARTITION'; state in $STATE)"
        return 0
    fi
    IN_UP=1
    ensure_packages
    write_configs
    start_munge
    start_mariadb
    start_slurmdbd
    start_slurmctld
    start_slurmds
    wait_nodes
    start_waker
    log "cluster '$CLUSTER' is up: partition '$PARTITION' = $NODELIST ($CPUS CPUs, $MEM_MB MB each); state and logs in $STATE"
    sinfo -N -p "$PARTITION" -o '%N %P %t %c %m' | sed 's/^/    /'
}

cancel_jobs() {
    ctld_ok || return 0
    local ids
    ids=$(squeue -h -o '%F' 2>/dev/null | sort -u | tr '\n' ' ')
    [[ -n "${ids// /}" ]] || return 0
    log "cancelling jobs: $ids"
    # shellcheck disable=SC2086
    scancel $ids 2>/dev/null || true
    local wait_s=$((TIMEOUT < 20 ? TIMEOUT : 20))
    local deadline=$(($(date +%s) + wait_s))
    while [[ -n "$(squeue -h -t running,completing,configuring 2>/dev/null)" ]]; do
        if (($(date +%s) >= deadline)); then
            log "jobs still running after ${wait_s}s; stopping the daemons anyway"
            break
        fi
        sleep 0.5
    done
}

descendants() { # pid -> its descendants, deepest last
    local kids k
    kids=$(ps -eo pid=,ppid= | awk -v p="$1" '$2 == p {print $1}')
    for k in $kids; do
        echo "$k"
        descendants "$k"
    done
}

kill_our_stepds() { # slurmstepd's that outlived their slurmd (ours hold our SlurmdLogFile open), and their tasks
    local p fd victims=() killed=()
    for p in $(pgrep -x slurmstepd 2>/dev/null); do
        for fd in /proc/"$p"/fd/*; do
            if [[ "$(readlink "$fd" 2>/dev/null)" == "$LOGS"/slurmd-* ]]; then
                mapfile -t victims < <(descendants "$p")
                kill -KILL "$p" "${victims[@]}" 2>/dev/null || true
                killed+=("$p" "${victims[@]}")
                break
            fi
        done
    done
    [[ ${#killed[@]} -eq 0 ]] || log "killed leftover slurmstepd's and their tasks: ${killed[*]}"
}

cmd_down() {
    need_root down
    resolve_state
    [[ -d "$STATE" ]] || {
        log "nothing to stop (no state dir $STATE)"
        return 0
    }
    lock
    if alive slurmctld; then cancel_jobs; fi
    stop_proc waker group
    local n
    for n in "${NODES[@]}"; do stop_proc "slurmd-$n"; done
    # nodes from an earlier, larger cluster
    for f in "$PIDS"/slurmd-*; do [[ -e "$f" ]] && stop_proc "$(basename "$f")"; done
    kill_our_stepds
    stop_proc slurmctld
    stop_proc slurmdbd
    stop_proc mariadb
    stop_proc munged
    local left
    left=$(find "$PIDS" -mindepth 1 -maxdepth 1 -printf '%f ' 2>/dev/null)
    [[ -z "${left// /}" ]] || die "still recorded as running: $left"
    log "cluster '$CLUSTER' is down (state kept in $STATE; '$0 purge' deletes it)"
}

cmd_purge() {
    cmd_down
    exec 9>&-
    local f
    for f in "$SLURM_CONF" "$DBD_CONF"; do
        if [[ -f "$f" ]] && grep -qF "$MARK" "$f"; then rm -f "$f" && log "removed $f"; fi
    done
    rm -rf "$STATE"
    log "removed $STATE"
}

cmd_status() {
    resolve_state
    local c up=0 total=0 line
    for c in munged mariadb slurmdbd slurmctld $(printf 'slurmd-%s ' "${NODES[@]}") waker; do
        total=$((total + 1))
        if alive "$c" 2>/dev/null; then
            up=$((up + 1))
            line="running (pid $(pid_of "$c"))"
        else
            line="not running"
        fi
        printf '  %-12s %s\n' "$c" "$line"
    done
    if ctld_ok; then
        sinfo -N -o '%N %P %t %c %m' | sed 's/^/    /'
    fi
    echo "state dir: $STATE; config: $SLURM_CONF"
    if [[ $up -eq $total ]]; then
        echo "cluster '$CLUSTER' is up"
        return 0
    elif [[ $up -eq 0 ]]; then
        echo "cluster '$CLUSTER' is down"
        return 3
    fi
    echo "cluster '$CLUSTER' is partly up ($up/$total); '$0 up' starts the rest, '$0 down' stops it"
    return 1
}

case "${1:-}" in
install) ensure_packages ;;
up) cmd_up ;;
down) cmd_down ;;
status) cmd_status ;;
purge) cmd_purge ;;
*)
    echo "usage: $0 install|up|down|status|purge" >&2
    exit 2
    ;;
esac
