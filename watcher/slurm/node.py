"""The Slurm node's side of one attempt: ``python -m trainq.watcher.slurm.node JOB_DIR --attempt N``.

slurm.sh execs this as the batch job's main process. It

1. refuses a stale or duplicate submission: ``launch.json`` must still describe attempt N (the watcher rewrites
   it for the next attempt), and the first Slurm job that starts attempt N creates ``slurm-attempt-N.claim``
   with O_EXCL, which is atomic on every shared filesystem trainq supports (NFSv3+, Lustre, BeeGFS, GPFS),
   with or without working locks. Another Slurm job of the same attempt finds the claim and exits without
   running anything; Slurm requeueing the *same* job id goes on;
2. rewrites ``heartbeat.json`` every HEARTBEAT_S seconds while the attempt lives, so the watcher can tell a
   live node-side supervisor from a dead one without flock;
3. under srun, watches for a node that went silent after a rank failed (silent.py), so the attempt ends within
   seconds of the collective timeout rather than at Slurm's SlurmdTimeout;
4. runs the attempt's supervisor in the foreground (``supervisor.run_in_foreground``) with flock as an
   extra signal only: where flock fails the attempt runs on and output.log says so.

It asks Slurm nothing but, once a rank failed under srun, the addresses of the job's nodes (silent.py); the
watcher's squeue is the other half of liveness (polling.py, liveness.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from trainq.watcher.slurm.batch import EARLY_WARNING_ENV
from trainq.watcher.slurm.silent import SilentNodeWatch
from trainq.watcher.spec.contract import EXIT_USAGE, JobPaths
from trainq.watcher.spec.errors import SpawnFailed
from trainq.watcher.spec.fsutil import atomic_write_json, read_json
from trainq.watcher.spec.units import iso_utc
from trainq.watcher.supervisor import LaunchSpec, run_in_foreground, shell_status
from trainq.watcher.supervisor.attempt import hold_time_limit_warning

#: seconds between two writes of heartbeat.json by a live node-side supervisor
HEARTBEAT_S = 10.0
#: exit status of a duplicate or stale submission that ran nothing (sysexits EX_TEMPFAIL)
EXIT_NOT_MINE = 75


class Heartbeat:
    """A daemon thread rewriting heartbeat.json (a counter, the node, the Slurm job, the time) every period_s."""

    def __init__(self, paths: JobPaths, attempt: int, slurm_job_id: str, period_s: float = HEARTBEAT_S):
        self.paths, self.attempt, self.slurm_job_id, self.period_s = paths, attempt, slurm_job_id, period_s
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainq-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()  # before the supervisor starts: the watcher sees it as soon as it sees supervisor.json
        self._thread.start()
        return self

    def beat(self, ended: bool = False) -> None:
        self.beats += 1
        record = {
            "attempt": self.attempt,
            "slurm_job_id": self.slurm_job_id,
            "node": socket.gethostname(),
            "pid": os.getpid(),
            "beats": self.beats,
            "at": iso_utc(time.time()),
            "period_s": self.period_s,
            "ended": ended,
        }
        try:
            atomic_write_json(self.paths.heartbeat, record, durable=False)
        except OSError as exc:  # a full or unreachable filesystem must not end the attempt
            print(f"trainq: cannot write {self.paths.heartbeat}: {exc.strerror}", file=sys.stderr)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period_s)
        self.beat(ended=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.beat()


def claim(paths: JobPaths, attempt: int, slurm_job_id: str) -> str | None:
    """Claim attempt ``attempt`` for this Slurm job: None when it is ours, else the Slurm job id that holds it."""
    path = paths.slurm_claim(attempt)
    body = (
        json.dumps(
            {
                "attempt": attempt,
                "slurm_job_id": slurm_job_id,
                "node": socket.gethostname(),
                "claimed_at": iso_utc(time.time()),
            }
        )
        + "\n"
    )
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        holder = str((read_json(path) or {}).get("slurm_job_id") or "")
        return None if holder == slurm_job_id else (holder or "another Slurm job")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(body)
    return None


def own_slurm_id(env: Mapping[str, str]) -> str:
    """This batch job's id as the watcher's squeue shows it: ``<array id>_<index>`` for a task of a job array."""
    array, index = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{index}" if array and index else env.get("SLURM_JOB_ID", "")


def early_warning(env: dict[str, str] | os._Environ) -> float | None:
    """When slurm.sh caught Slurm's time-limit warning (its first line traps it), the time it came; the variable
    goes, so the job never sees it."""
    text = env.pop(EARLY_WARNING_ENV, None)
    try:
        return float(text) if text else None
    except ValueError:
        return None


def runs_srun(spec: LaunchSpec) -> bool:
    """Whether the attempt's command is srun over several tasks (``resources.nodes`` > 1, ``tasks_per_node`` > 1)."""
    return bool(spec.argv) and os.path.basename(spec.argv[0]) == "srun"


def main(argv: list[str] | None = None) -> int:
    hold_time_limit_warning()  # first: Slurm may send it at once, and its default action ends the batch job
    warned_at = early_warning(os.environ)
    parser = argparse.ArgumentParser(
        prog="python -m trainq.watcher.slurm.node",
        description="Run one attempt of a trainq job inside a Slurm batch job.",
    )
    parser.add_argument("job_dir", help="the job folder, on the filesystem the watcher shares with the nodes")
    parser.add_argument("--attempt", type=int, required=True, help="the attempt this submission was made for")
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        default=HEARTBEAT_S,
        help=f"seconds between two writes of heartbeat.json (watcher.yaml slurm.heartbeat_s; default {HEARTBEAT_S:g})",
    )
    args = parser.parse_args(argv)
    paths = JobPaths(Path(os.path.abspath(args.job_dir)))
    slurm_job_id = own_slurm_id(os.environ)
    try:
        data = json.loads(paths.launch_spec.read_text(encoding="utf-8"))
        spec = LaunchSpec.from_dict({**data, "job_dir": str(paths.dir)} if isinstance(data, dict) else data)
    except (OSError, ValueError, TypeError) as exc:
        print(f"trainq: {paths.launch_spec}: {exc}; fix the launch spec", file=sys.stderr)
        return EXIT_USAGE
    if spec.attempt != args.attempt:
        print(
            f"trainq: Slurm job {slurm_job_id} was submitted for attempt {args.attempt}, but the job is at attempt "
            f"{spec.attempt} now; running nothing",
            file=sys.stderr,
        )
        return EXIT_NOT_MINE
    holder = claim(paths, spec.attempt, slurm_job_id)
    if holder is not None:
        print(
            f"trainq: attempt {spec.attempt} already runs as Slurm job {holder}; this duplicate submission "
            f"(Slurm job {slurm_job_id}) runs nothing",
            file=sys.stderr,
        )
        return EXIT_NOT_MINE
    heartbeat = Heartbeat(paths, spec.attempt, slurm_job_id, max(0.1, args.heartbeat_s)).start()
    silent = SilentNodeWatch(paths, spec.attempt, os.environ).start() if runs_srun(spec) else None
    try:
        record = run_in_foreground(
            spec, lock_required=False, warned_at=warned_at, amend=silent.amend if silent else None
        )
    except SpawnFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        heartbeat.stop()
        if silent is not None:
            silent.stop()
    return shell_status(record)


if __name__ == "__main__":
    sys.exit(main())
