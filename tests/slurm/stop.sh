#!/usr/bin/env bash
# tests/slurm/stop.sh — stop the daemons tests/slurm/start.sh started (found by their pid files in
# $TRAINQ_SLURM_DIR); cancel the cluster's jobs first so no job process outlives slurmd. Idempotent.
# With several nodes (TRAINQ_SLURM_NODES=N) it also removes what start.sh made for them: the namespaces
# trainq-node*, their veth pairs, the bridge trainq-br0 and its marked lines in /etc/hosts.
# --keep-munge leaves munged running (start.sh uses it to restart Slurm with a new configuration).
set -uo pipefail
BASE=${TRAINQ_SLURM_DIR:-/run/trainq-test-slurm}
export SLURM_CONF=$BASE/slurm.conf
BRIDGE=trainq-br0
HOSTS_MARK="# trainq tests/slurm/start.sh"
keep_munge=0
[ "${1:-}" = --keep-munge ] && keep_munge=1

alive() {   # alive NAME [COMM]: the process whose pid is in $BASE/NAME.pid runs and is called COMM (default NAME)
  local pid
  pid=$(cat "$BASE/$1.pid" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "${2:-$1}" ]
}

running() {   # running PID: the process exists and is not a zombie (a daemon's parent, init, may reap it late)
  [ -d "/proc/$1" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null
}

# every slurmd start.sh started: slurmd.pid (one node) or slurmd-nodeK.pid (several)
slurmds=()
# (not slurmd*.pid: that matched slurmdbd.pid, whose pid file was then dropped and slurmdbd left running)
for f in "$BASE"/slurmd.pid "$BASE"/slurmd-*.pid; do [ -e "$f" ] && slurmds+=("$(basename "$f" .pid)"); done

any_slurmd=0
for d in "${slurmds[@]}"; do alive "$d" slurmd && any_slurmd=1; done
if alive slurmctld && [ $any_slurmd = 1 ]; then
  jobs=$(timeout 20 squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    # shellcheck disable=SC2086
    timeout 20 scancel $jobs 2>/dev/null
    for _ in $(seq 100); do [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
  fi
fi
daemons=("${slurmds[@]}" slurmctld slurmdbd mariadbd)   # slurmdbd and mariadbd: TRAINQ_SLURM_ACCOUNTING=1
[ $keep_munge = 1 ] || daemons+=(munged)
rc=0
for d in "${daemons[@]}"; do
  comm=$d; [[ "$d" == slurmd || "$d" == slurmd-* ]] && comm=slurmd
  alive "$d" "$comm" || { rm -f "$BASE/$d.pid"; continue; }
  pid=$(cat "$BASE/$d.pid")
  kill -CONT "$pid" 2>/dev/null   # a test may have left it SIGSTOPped
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 100); do running "$pid" || break; sleep 0.1; done
  if running "$pid"; then
    kill -KILL "$pid" 2>/dev/null
    for _ in $(seq 50); do running "$pid" || break; sleep 0.1; done
    running "$pid" && { echo "tests/slurm/stop.sh: $d ($pid) is still alive" >&2; rc=1; continue; }
  fi
  rm -f "$BASE/$d.pid"
done

# the nodes' network: deleting a namespace deletes the veth pair whose one end is in it
for ns in /run/netns/trainq-node*; do
  [ -e "$ns" ] || continue
  ip netns del "$(basename "$ns")" 2>/dev/null || { echo "tests/slurm/stop.sh: cannot delete namespace $ns" >&2; rc=1; }
done
for link in $(ip -o link show 2>/dev/null | sed -n 's/^[0-9]*: \(trainq-v[0-9]*\)[@:].*/\1/p'); do
  ip link del "$link" 2>/dev/null
done
if ip link show "$BRIDGE" >/dev/null 2>&1; then
  ip link del "$BRIDGE" || { echo "tests/slurm/stop.sh: cannot delete the bridge $BRIDGE" >&2; rc=1; }
fi
if grep -q -F "$HOSTS_MARK" /etc/hosts 2>/dev/null; then
  { grep -v -F "$HOSTS_MARK" /etc/hosts >/etc/hosts.trainq-tmp && chmod 0644 /etc/hosts.trainq-tmp \
    && mv /etc/hosts.trainq-tmp /etc/hosts; } || { echo "tests/slurm/stop.sh: cannot clean /etc/hosts" >&2; rc=1; }
fi
exit $rc
