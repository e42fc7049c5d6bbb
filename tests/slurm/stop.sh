#!/usr/bin/env bash
# tests/slurm/stop.sh — stop the daemons tests/slurm/start.sh started (found by their pid files in
# $TRAINQ_SLURM_DIR); cancel the cluster's jobs first so no job process outlives slurmd. Idempotent.
# --keep-munge leaves munged running (start.sh uses it to restart Slurm with a new configuration).
set -uo pipefail
BASE=${TRAINQ_SLURM_DIR:-/run/trainq-test-slurm}
export SLURM_CONF=$BASE/slurm.conf
daemons=(slurmd slurmctld slurmdbd mariadbd munged)   # slurmdbd and mariadbd: TRAINQ_SLURM_ACCOUNTING=1
[ "${1:-}" = --keep-munge ] && daemons=(slurmd slurmctld slurmdbd mariadbd)

alive() {
  local pid
  pid=$(cat "$BASE/$1.pid" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ]
}

if alive slurmctld && alive slurmd; then
  jobs=$(timeout 20 squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    # shellcheck disable=SC2086
    timeout 20 scancel $jobs 2>/dev/null
    for _ in $(seq 100); do [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
  fi
fi
rc=0
for d in "${daemons[@]}"; do
  alive "$d" || { rm -f "$BASE/$d.pid"; continue; }
  pid=$(cat "$BASE/$d.pid")
  kill -CONT "$pid" 2>/dev/null   # a test may have left it SIGSTOPped
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 100); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
  if [ -d "/proc/$pid" ]; then
    kill -KILL "$pid" 2>/dev/null; sleep 0.3
    [ -d "/proc/$pid" ] && { echo "tests/slurm/stop.sh: $d ($pid) is still alive" >&2; rc=1; continue; }
  fi
  rm -f "$BASE/$d.pid"
done
exit $rc
