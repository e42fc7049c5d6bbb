#!/bin/sh
# A job that tries to outlive its stop: a pid hopper, and a grandchild in a session of its own
# with an empty environment (no TRAINQ_JOB_DIR, not in the job's process group). It ignores SIGTERM.
# Usage: escaper.sh PYTHON HOPPER MARKER DIR  (DIR gets hopper.ready and grandchild.pid)
trap '' TERM
"$1" "$2" "$3" "$4/hopper.ready" &
setsid env -i /bin/sh -c "echo \$\$ > '$4/grandchild.pid.tmp' && mv '$4/grandchild.pid.tmp' '$4/grandchild.pid' && exec sleep 600" &
echo ready
while :; do sleep 1; done
