#!/usr/bin/env bash
# tests/slurm/start.sh — a one-node Slurm (munged + slurmctld + slurmd) for trainq's tests, without systemd.
#
# Needs root and Debian's packages (`slurmctld slurmd slurm-client munge`, see .ci/system-deps). It never
# touches /etc/slurm: its slurm.conf lives in $TRAINQ_SLURM_DIR, and every Slurm command finds it through
# SLURM_CONF (print it with `tests/slurm/start.sh --env`). Idempotent: when the cluster is up it only checks it.
#
#   TRAINQ_SLURM_DIR   where config, state, spool, logs and pid files go (default /run/trainq-test-slurm)
#   SLURM_FAKE_GPUS=N  fake GPUs declared as GRES (default 2): char devices like /dev/null, so `--gres=gpu:1`
#                      jobs get distinct CUDA_VISIBLE_DEVICES on a machine without GPUs
#   SLURM_CPUS=N       CPUs the node advertises (default 8, more than a small VM has, so several test jobs
#                      run at once; above the real count Slurm needs SlurmdParameters=config_overrides)
#   SLURM_READY_TIMEOUT seconds to wait for the node to be idle (default 60)
#   TRAINQ_SLURM_NODES=N  N slurmd (default 1). N=1 is one node named after this machine at 127.0.0.1. N>=2 starts
#                      node1..nodeN, each in its own network and UTS namespace (`trainq-nodeK`, its own host name)
#                      with the address 10.213.0.K on a bridge (trainq-br0, the controller's side 10.213.0.254),
#                      sharing the filesystem and munge; /etc/hosts gets one line per node (marked, stop.sh removes
#                      them) so every node resolves every other. A start with another N restarts the cluster.
#   TRAINQ_SLURM_ACCOUNTING=1  also run slurmdbd on a private MariaDB (Debian's `slurmdbd mariadb-server`; exit 3
#                      without them), so sacct answers, and purge finished jobs from slurmctld after MinJobAge=2 s
#                      (every 10 s): the cluster of a site with accounting, whose squeue soon forgets ended jobs.
#                      A start without it switches back (the configuration changed: Slurm restarts).
# Partitions: debug (the default) and urgent, whose jobs preempt debug's (preempt/partition_prio, PreemptMode=CANCEL),
# so tests can have Slurm itself take a running job away.
# Exit 0 and the line `SLURM_CONF=...` on stdout when the node is ready; exit 1 with the reason on stderr;
# exit 3 when Slurm's packages are missing (tests skip then).
set -euo pipefail
BASE=${TRAINQ_SLURM_DIR:-/run/trainq-test-slurm}
CONF=$BASE/slurm.conf
if [ "${1:-}" = --env ]; then echo "SLURM_CONF=$CONF"; exit 0; fi
FAKE_GPUS=${SLURM_FAKE_GPUS:-2}
ACCOUNTING=${TRAINQ_SLURM_ACCOUNTING:-0}
NODES=${TRAINQ_SLURM_NODES:-1}
NET=10.213.0      # the multi-node cluster's private /24: only on trainq-br0 and in the nodes' namespaces
BRIDGE=trainq-br0
HOSTS_MARK="# trainq tests/slurm/start.sh"   # ends every /etc/hosts line this script adds
DB_PORT=3307      # the private MariaDB's TCP port on 127.0.0.1 (not 3306: a site's own database may use it)
DBD_PORT=6819
READY_TIMEOUT=${SLURM_READY_TIMEOUT:-60}
log() { printf '[tests/slurm/start %s] %s\n' "$(date +%T)" "$*" >&2; }
die() {
  printf 'tests/slurm/start.sh: %s\n' "$*" >&2
  for f in "$BASE/log/slurmctld.log" "$BASE"/log/slurmd*.log; do
    [ -f "$f" ] && { echo "---- tail $f" >&2; tail -n 8 "$f" >&2; }
  done
  exit 1
}
for tool in munged munge slurmctld slurmd sbatch squeue; do
  command -v "$tool" >/dev/null 2>&1 || { echo "tests/slurm/start.sh: $tool not installed (apt-get install slurmctld slurmd slurm-client munge)" >&2; exit 3; }
done
if [ "$ACCOUNTING" = 1 ]; then
  for tool in slurmdbd sacctmgr mariadbd mariadb-install-db mariadb; do
    command -v "$tool" >/dev/null 2>&1 || { echo "tests/slurm/start.sh: $tool not installed (apt-get install slurmdbd mariadb-server)" >&2; exit 3; }
  done
fi
[[ "$NODES" =~ ^[1-9][0-9]?$ ]] && [ "$NODES" -le 50 ] || die "TRAINQ_SLURM_NODES must be a whole number from 1 to 50 (got '$NODES')"
[ "$(id -u)" = 0 ] || die "needs root (slurmd runs jobs as their users)"
if [ "$NODES" -gt 1 ]; then
  for tool in ip nsenter unshare; do
    command -v "$tool" >/dev/null 2>&1 || { echo "tests/slurm/start.sh: $tool not installed (apt-get install iproute2 util-linux), needed for TRAINQ_SLURM_NODES=$NODES" >&2; exit 3; }
  done
fi
export SLURM_CONF=$CONF

alive() {   # alive NAME [COMM]: the process whose pid is in $BASE/NAME.pid runs and is called COMM (default NAME)
  local pid
  pid=$(cat "$BASE/$1.pid" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "${2:-$1}" ]
}
any_slurmd() {   # one of the slurmd this script started (any mode) runs
  local f
  for f in "$BASE"/slurmd.pid "$BASE"/slurmd-*.pid; do [ -e "$f" ] && alive "$(basename "$f" .pid)" slurmd && return 0; done
  return 1
}

mkdir -p "$BASE"/{state,spool,log,fakegpu}
chmod 0755 "$BASE"

# munge: Slurm's authentication. Use a munged that already answers, else start one (system paths).
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge
  chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key; chmod 0755 /run/munge
  rm -f /run/munge/munged.pid /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
  runuser -u munge -- munged || die "munged did not start"
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null 2>&1 || die "munged runs but munge -n | unmunge fails"
  cp /run/munge/munged.pid "$BASE/munged.pid"   # ours: stop.sh stops it
fi

# slurm.conf: the real topology, CPUs as asked, 90 % of the memory (a node is drained for less than it says)
hw=$(slurmd -C | head -n 1)
field() { sed -n "s/.* $1=\([0-9]*\).*/\1/p" <<<"$hw"; }
REAL_CPUS=$(field CPUs); MEM=$(( $(field RealMemory) * 9 / 10 ))
CPUS=${SLURM_CPUS:-8}
HOST=$(hostname -s)
# a node set DOWN by hand comes back by itself with one node (ReturnToService=2), so tests need not resume it;
# with several it stays DOWN until resumed (1: only a node that stopped answering returns), as on a real cluster,
# so a test sees which node is down while a job fails over to the others
RETURN_TO_SERVICE=2
# how long a node's slurmd may stay silent before Slurm marks it DOWN (Slurm's default 300 s; 120 s with several
# nodes, so a test that cuts a node's link sees the end within minutes)
SLURMD_TIMEOUT=300
if [ "$NODES" = 1 ]; then   # the machine itself, as before there were several
  NODE_NAMES=("$HOST"); CTL_ADDR=127.0.0.1; GRES_NODES=$HOST
  SLURMD_FILES="SlurmdSpoolDir=$BASE/spool
SlurmdPidFile=$BASE/slurmd.pid
SlurmdLogFile=$BASE/log/slurmd.log"
else                        # node1..nodeN in their namespaces; the controller on the bridge's host side
  NODE_NAMES=(); for ((k = 1; k <= NODES; k++)); do NODE_NAMES+=("node$k"); done
  CTL_ADDR=$NET.254; GRES_NODES="node[1-$NODES]"; RETURN_TO_SERVICE=1; SLURMD_TIMEOUT=120
  SLURMD_FILES="SlurmdSpoolDir=$BASE/spool/%n
SlurmdPidFile=$BASE/slurmd-%n.pid
SlurmdLogFile=$BASE/log/slurmd-%n.log"
fi
gres_node=""; gres_types=""; overrides=""
accounting="AccountingStorageType=accounting_storage/none"; min_job_age=3600
if [ "$ACCOUNTING" = 1 ]; then
  accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStorageEnforce=associations,limits,qos"
  min_job_age=2
fi
[ "$CPUS" -gt "$REAL_CPUS" ] && overrides="SlurmdParameters=config_overrides"
if [ "$FAKE_GPUS" -gt 0 ]; then
  gres_types="GresTypes=gpu"; gres_node="Gres=gpu:$FAKE_GPUS"
  for ((i = 0; i < FAKE_GPUS; i++)); do
    [ -c "$BASE/fakegpu/gpu$i" ] || { rm -f "$BASE/fakegpu/gpu$i"; mknod "$BASE/fakegpu/gpu$i" c 1 3; }
  done
fi
# --mem is enforced without cgroups: jobacct_gather/linux samples every second and OverMemoryKill kills a job
# over its --mem (it ends FAILED with "exceeded memory limit" in its output; with cgroups it would be
# OUT_OF_MEMORY). DefMemPerCPU shares the node's memory among its CPUs, so 8 default jobs still fit.
node_lines=""
for ((k = 1; k <= NODES; k++)); do
  addr=127.0.0.1; [ "$NODES" = 1 ] || addr=$NET.$k
  node_lines+="NodeName=${NODE_NAMES[k - 1]} NodeAddr=$addr CPUs=$CPUS RealMemory=$MEM $gres_node State=UNKNOWN"$'\n'
done
conf="# written by trainq's tests/slurm/start.sh: $NODES node(s), no cgroups; a job in partition urgent
# preempts (cancels: SIGTERM, SIGKILL after KillWait) the debug jobs in its way
ClusterName=trainqtest
SlurmctldHost=$HOST($CTL_ADDR)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$((MEM / CPUS))
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=1
JobAcctGatherParams=OverMemoryKill
$accounting
JobCompType=jobcomp/filetxt
JobCompLoc=$BASE/log/jobcomp.txt
ReturnToService=$RETURN_TO_SERVICE
SlurmdTimeout=$SLURMD_TIMEOUT
MinJobAge=$min_job_age
KillWait=5
SchedulerParameters=sched_min_interval=100000
StateSaveLocation=$BASE/state
SlurmctldPidFile=$BASE/slurmctld.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
$SLURMD_FILES
$gres_types
$overrides
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
$node_lines
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF"
gres="AutoDetect=off"
[ "$FAKE_GPUS" -gt 0 ] && gres+=$'\n'"NodeName=$GRES_NODES Name=gpu File=$BASE/fakegpu/gpu[0-$((FAKE_GPUS - 1))]"

changed=0
[ "$(cat "$CONF" 2>/dev/null)" = "$conf" ] || { printf '%s\n' "$conf" >"$CONF"; changed=1; }
[ "$(cat "$BASE/gres.conf" 2>/dev/null)" = "$gres" ] || { printf '%s\n' "$gres" >"$BASE/gres.conf"; changed=1; }
if [ $changed = 1 ] && { alive slurmctld || any_slurmd; }; then
  log "configuration changed: restarting slurmd and slurmctld"
  "$(dirname "$0")/stop.sh" --keep-munge >&2
fi

busy() { ss -Hltn "sport = :$1" 2>/dev/null | grep -q .; }
if [ "$ACCOUNTING" = 1 ]; then
  # a private MariaDB for slurmdbd: data in $BASE/mysql, socket, pid and log in $BASE/mariadb (the mysql user's),
  # TCP on 127.0.0.1:$DB_PORT; root logs in by the unix socket only
  if ! alive mariadbd; then
    busy "$DB_PORT" && die "port $DB_PORT is taken by a database this script did not start"
    mkdir -p "$BASE/mysql" "$BASE/mariadb"; chown mysql:mysql "$BASE/mysql" "$BASE/mariadb"
    if [ ! -d "$BASE/mysql/mysql" ]; then
      mariadb-install-db --user=mysql --datadir="$BASE/mysql" --skip-test-db >"$BASE/log/mariadb-install.log" 2>&1 \
        || die "mariadb-install-db failed (see $BASE/log/mariadb-install.log)"
    fi
    rm -f "$BASE/mariadb/mariadbd.pid"
    setsid mariadbd --user=mysql --datadir="$BASE/mysql" --socket="$BASE/mariadb/mariadb.sock" --port="$DB_PORT" \
      --bind-address=127.0.0.1 --skip-name-resolve --pid-file="$BASE/mariadb/mariadbd.pid" \
      --log-error="$BASE/mariadb/mariadb.log" </dev/null >/dev/null 2>&1 &
    for _ in $(seq 150); do mariadb --socket="$BASE/mariadb/mariadb.sock" -e 'select 1' >/dev/null 2>&1 && break; sleep 0.2; done
    mariadb --socket="$BASE/mariadb/mariadb.sock" -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY
      'trainq-test'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;" \
      || die "MariaDB did not start (see $BASE/mariadb/mariadb.log)"
    cp "$BASE/mariadb/mariadbd.pid" "$BASE/mariadbd.pid"   # ours: stop.sh stops it
  fi
  dbd="# written by trainq's tests/slurm/start.sh
AuthType=auth/munge
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=trainq-test
StorageLoc=slurm_acct_db
PidFile=$BASE/slurmdbd.pid
LogFile=$BASE/log/slurmdbd.log"
  [ "$(cat "$BASE/slurmdbd.conf" 2>/dev/null)" = "$dbd" ] || { printf '%s\n' "$dbd" >"$BASE/slurmdbd.conf"; }
  chmod 0600 "$BASE/slurmdbd.conf"
  if ! alive slurmdbd; then
    busy "$DBD_PORT" && die "port $DBD_PORT is taken by a slurmdbd this script did not start"
    slurmdbd || die "slurmdbd did not start"
    for _ in $(seq 150); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.2; done
  fi
  sacctmgr -n list cluster format=cluster 2>/dev/null | grep -qw trainqtest \
    || sacctmgr -i add cluster trainqtest >/dev/null || die "sacctmgr could not add the cluster"
  # limits are enforced (a test sets a QOS submit limit): the users who submit need an association
  sacctmgr -n list account format=account 2>/dev/null | grep -qw trainq \
    || sacctmgr -i add account trainq Cluster=trainqtest Description=trainq-tests >/dev/null \
    || die "sacctmgr could not add the account"
  sacctmgr -n list user format=user 2>/dev/null | grep -qw root \
    || sacctmgr -i add user root Account=trainq DefaultAccount=trainq >/dev/null || die "sacctmgr could not add root"
fi
if [ "$NODES" -gt 1 ]; then
  # the nodes' network: a bridge with the controller's address, and per node a namespace holding one end of a veth
  # pair (eth0, $NET.K) whose other end is on the bridge. Every step is skipped when already done, and a link a
  # test cut (ip link set trainq-vK down) comes back up.
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge || die "cannot create the bridge $BRIDGE"
    ip addr add "$CTL_ADDR/24" dev "$BRIDGE" || die "cannot give $BRIDGE the address $CTL_ADDR"
  fi
  ip link set "$BRIDGE" up
  for ((k = 1; k <= NODES; k++)); do
    ns=trainq-node$k
    if [ ! -e "/run/netns/$ns" ]; then
      ip link del "trainq-v$k" >/dev/null 2>&1 || true
      ip netns add "$ns" || die "cannot create the network namespace $ns"
      ip link add "trainq-v$k" type veth peer name "trainq-p$k" || die "cannot create the veth pair of node$k"
      ip link set "trainq-p$k" netns "$ns"
      ip -n "$ns" link set "trainq-p$k" name eth0
      ip -n "$ns" addr add "$NET.$k/24" dev eth0
      ip -n "$ns" link set lo up
      ip -n "$ns" link set eth0 up
      ip link set "trainq-v$k" master "$BRIDGE"
    fi
    ip link set "trainq-v$k" up
  done
  # every node (and this machine) resolves every node's name; written to a temporary file, then renamed
  hosts=$(grep -v -F "$HOSTS_MARK" /etc/hosts || true)
  for ((k = 1; k <= NODES; k++)); do hosts+=$'\n'"$NET.$k node$k $HOSTS_MARK"; done
  if [ "$(cat /etc/hosts)" != "$hosts" ]; then
    printf '%s\n' "$hosts" >/etc/hosts.trainq-tmp && chmod 0644 /etc/hosts.trainq-tmp && mv /etc/hosts.trainq-tmp /etc/hosts \
      || die "cannot add the nodes to /etc/hosts"
  fi
fi
if ! alive slurmctld; then
  busy 6817 && die "port 6817 is taken by a slurmctld this script did not start (ss -ltnp | grep 6817)"
  slurmctld -f "$CONF" || die "slurmctld did not start"
fi
if [ "$NODES" = 1 ]; then
  if ! alive slurmd; then
    busy 6818 && die "port 6818 is taken by a slurmd this script did not start (ss -ltnp | grep 6818)"
    slurmd -f "$CONF" || die "slurmd did not start"
  fi
else
  mkdir -p "$BASE/spool"
  for ((k = 1; k <= NODES; k++)); do
    alive "slurmd-node$k" slurmd && continue
    # nsenter, not `ip netns exec`: that remounts /sys, and slurmd then finds no cgroup mount and fails to start
    nsenter --net="/run/netns/trainq-node$k" unshare --uts \
      sh -c "hostname node$k && exec slurmd -f '$CONF' -N node$k" || die "slurmd of node$k did not start"
  done
fi

slurmd_alive() {   # the slurmd of node NAME runs
  if [ "$NODES" = 1 ]; then alive slurmd; else alive "slurmd-$1" slurmd; fi
}
deadline=$(( $(date +%s) + READY_TIMEOUT )); resumed=" "
for node in "${NODE_NAMES[@]}"; do
  while :; do
    state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
    case "$state" in
      idle|mixed|allocated|completing) break ;;
      down*|drain*|fail*)
        [[ "$resumed" == *" $node "* ]] || {
          scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true; resumed+="$node "; } ;;
    esac
    [ "$(date +%s)" -lt "$deadline" ] || die "node $node not ready after ${READY_TIMEOUT}s (state '${state:-no answer}')"
    alive slurmctld || die "slurmctld died"
    slurmd_alive "$node" || die "the slurmd of $node died"
    sleep 0.2
  done
done
log "$NODES node(s) ${NODE_NAMES[*]} ready (each: CPUs=$CPUS, ${MEM} MB, $FAKE_GPUS fake GPUs)"
echo "SLURM_CONF=$CONF"
