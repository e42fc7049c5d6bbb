"""What one attempt's supervisor adds to the job's records: its snapshot, and its events in events.jsonl.

``started``, ``checkpoint`` (each checkpoint record the job appends to metrics.jsonl), ``stopping``,
``preempted`` and ``exited`` (docs/records.md). attempt.py calls these at the matching moments;
they never raise, so a record can never keep a job from running or its exit from being recorded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from trainq.watcher.spec import events
from trainq.watcher.spec.contract import ENV_RESUME_FROM, JobPaths
from trainq.watcher.spec.fsutil import exists
from trainq.watcher.supervisor import snapshot as snapshots

#: how often the supervisor looks for new checkpoint records in metrics.jsonl, seconds
CHECKPOINT_LOOK_S = 1.0


def read_snapshot(
    request: dict | None, job_dir: str, attempt: int, env: dict[str, str], note: Callable[[str], None]
) -> snapshots.Taken | None:
    """What snapshot/ will say for this attempt, read before the job starts (None when off or when it failed,
    noted); ``write_snapshot`` writes it as the job starts."""
    if request is None:
        return None
    try:
        return snapshots.read(snapshots.SnapshotRequest.from_dict(request), job_dir, attempt, env)
    except Exception as exc:
        note(f"snapshot incomplete: {type(exc).__name__}: {exc}")
        return None


def write_snapshot(taken: snapshots.Taken | None, note: Callable[[str], None]) -> dict:
    """snapshot/'s records; the code summary for ``started`` ({} when off or when it failed, noted)."""
    if taken is None:
        return {}
    try:
        snapshots.write(taken)
    except Exception as exc:
        note(f"snapshot incomplete: {type(exc).__name__}: {exc}")
    return taken.code


def started(paths: JobPaths, attempt: int, at: float, job_pid: int, env: dict[str, str], code: dict) -> None:
    """``started``: attempt, host, pids, GPUs, Slurm job, resume point, code summary."""
    events.emit(
        paths,
        "started",
        at,
        attempt=attempt,
        host=os.uname().nodename,
        pid=job_pid,
        supervisor_pid=os.getpid(),
        gpus=env.get("CUDA_VISIBLE_DEVICES"),
        slurm_job_id=env.get("SLURM_JOB_ID"),
        resume_from=env.get(ENV_RESUME_FROM),
        code=code or None,
    )


def stop_requested(paths: JobPaths, attempt: int, how: str, reason: str | None, at: float, grace_s: float) -> None:
    """``preempted`` for the supervisor's own SIGTERM, ``stopping`` for stop.flag or the timeout.

    ``how`` is the mechanism (stop_flag, timeout, sigterm, folder_removed); ``reason`` the docs/contract.md, why a job stopped
    word the ``stopping`` record carries (user, deadline, window, stalled, timeout, watcher).
    """
    if how == "sigterm":
        events.emit(paths, "preempted", at, attempt=attempt, by="a stop signal to the job's supervisor")
    elif how != "folder_removed":
        events.emit(paths, "stopping", at, attempt=attempt, reason=reason, grace_s=grace_s)


def exited(paths: JobPaths, record: dict) -> None:
    """``exited``, written before the exit record, so the watcher's events follow it."""
    events.emit(
        paths,
        "exited",
        attempt=record["attempt"],
        code=record["exit_code"],
        signal=record["signal_name"],
        # the reason word (docs/contract.md, why a job stopped) where there is one (deadline, user, ...); else the mechanism (sigterm)
        reason=record.get("reason"),
        stop_reason=None if record.get("reason") else record["stop_reason"],
        spawn_error=record["spawn_error"],
    )


@dataclass
class CheckpointWatch:
    """Reads the job's metrics.jsonl from where this attempt began, for checkpoint records."""

    paths: JobPaths
    attempt: int
    offset: int = 0
    next_look: float = 0.0

    @classmethod
    def from_now(cls, paths: JobPaths, attempt: int) -> CheckpointWatch:
        """Start at the current end of metrics.jsonl: earlier attempts' records are not this one's."""
        try:
            offset = os.stat(paths.metrics).st_size if exists(paths.metrics) else 0  # most jobs write none
        except OSError:
            offset = 0
        return cls(paths, attempt, offset)

    def due(self, now: float) -> bool:
        """True once every CHECKPOINT_LOOK_S (monotonic seconds)."""
        if now < self.next_look:
            return False
        self.next_look = now + CHECKPOINT_LOOK_S
        return True

    def look(self) -> None:
        """A ``checkpoint`` event for each checkpoint record appended since the last look."""
        if not exists(self.paths.metrics):
            return  # a job that writes none (no exception raised and caught every look)
        try:
            with open(self.paths.metrics, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind(b"\n") + 1  # a half-written last line is read next time
        self.offset += end
        for line in chunk[:end].splitlines():
            if b"checkpoint" in line:
                self._note(line)

    def _note(self, line: bytes) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            return
        if isinstance(record, dict) and record.get("type") == "checkpoint":
            events.emit(
                self.paths, "checkpoint", attempt=self.attempt, path=record.get("path"), step=record.get("step")
            )
