"""One attempt in the foreground: ``run_in_foreground`` (a Slurm node, or by hand) and ``main``, the entry point of
``python -m trainq.watcher.supervisor JOB_DIR --spec FILE.json``, which exits with the job's status as a shell
reports it (``shell_status``). The supervision itself is attempt.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from trainq.watcher.spec.contract import EXIT_FAILED, EXIT_USAGE, JobPaths
from trainq.watcher.spec.errors import SpawnFailed
from trainq.watcher.spec.fsutil import remove_quietly
from trainq.watcher.supervisor.attempt import (
    TIME_LIMIT_SIGNAL,
    _die_reporting,
    _load_prctl,
    _reset_signals,
    _supervise,
)
from trainq.watcher.supervisor.attempt_io import LaunchSpec, _note, _take_lock, open_job_log


def run_in_foreground(
    spec: LaunchSpec,
    *,
    lock_required: bool = True,
    warned_at: float | None = None,
    amend: Callable[[dict], dict] | None = None,
) -> dict:
    """Take the lock and supervise in this process (Slurm, by hand); returns the exit record.

    ``lock_required=False`` (a Slurm node) runs on, with a note in output.log, where flock does not work.
    A time-limit warning stays blocked until the supervisor's handler exists; ``warned_at``: one that came even
    before this process ran (Slurm's batch script caught it). ``amend`` turns the exit record into the one written.
    """
    spec = dataclasses.replace(spec, job_dir=os.path.abspath(spec.job_dir))
    paths = JobPaths(Path(spec.job_dir))
    lock_fd, unlocked = _take_lock(paths, spec.attempt, required=lock_required)
    remove_quietly(paths.exit_record)
    remove_quietly(paths.started)
    _reset_signals(hold=(TIME_LIMIT_SIGNAL,))
    log_fd = open_job_log(paths.log)
    if unlocked:
        _note(
            log_fd,
            f"{unlocked}; running without the lock (Slurm's job state and "
            f"{paths.heartbeat.name} tell the watcher this attempt is alive)",
        )
    try:
        return _supervise(spec, log_fd, _load_prctl(), warned_at=warned_at, amend=amend)
    except BaseException:
        _die_reporting(log_fd)
        raise
    finally:
        os.close(log_fd)
        os.close(lock_fd)


def shell_status(record: dict) -> int:
    """The exit record as a shell would report it: the exit code, or 128 + the signal number."""
    if record.get("exit_code") is not None:
        return int(record["exit_code"])
    return 128 + int(record.get("signal") or 0)


def main(argv: list[str] | None = None) -> int:
    """``python -m trainq.watcher.supervisor JOB_DIR --spec FILE.json``: exits with the job's status."""
    parser = argparse.ArgumentParser(
        prog="python -m trainq.watcher.supervisor",
        description="Run one attempt of a trainq job in the foreground under its supervisor.",
    )
    parser.add_argument("job_dir", help="the job folder (its lock, output.log and records live there)")
    parser.add_argument("--spec", required=True, help="LaunchSpec as JSON (job_dir inside it is replaced)")
    args = parser.parse_args(argv)
    try:
        data = json.loads(Path(args.spec).read_text(encoding="utf-8"))
        spec = LaunchSpec.from_dict({**data, "job_dir": args.job_dir} if isinstance(data, dict) else data)
    except (OSError, ValueError, TypeError) as exc:
        print(f"{args.spec}: {exc}; fix the launch spec", file=sys.stderr)
        return EXIT_USAGE
    try:
        record = run_in_foreground(spec)
    except SpawnFailed as exc:
        print(exc, file=sys.stderr)
        return EXIT_FAILED
    return shell_status(record)
