"""The commands that act on one job through its folder: ``trainq logs ID`` (print output.log, follow it),
``trainq stop ID`` (touch its stop.flag; a sweep id stops every pending or running job of the sweep) and
``trainq retry ID`` (touch a failed job's retry.flag). Each does what a user could do by hand with
``cat`` and ``touch``, and says what will happen next.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from trainq.watcher.cli.manage import UsageError
from trainq.watcher.spec.fsutil import read_json

#: exit status: success, a failure, invalid input (an unknown id, a job in the wrong state)
EXIT_OK, EXIT_ERROR, EXIT_INVALID = 0, 1, 2


def add_job_commands(
    sub: argparse._SubParsersAction,
    root_of: Callable[[argparse.Namespace], Path],
    id_argument: Callable[..., None],
) -> None:
    """Register logs, stop and retry; ``root_of`` resolves the queue root, ``id_argument`` adds ID, as main.py does."""
    p = sub.add_parser("logs", help="print a job's output.log")
    id_argument(p)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job finishes")
    p.add_argument("-n", "--tail", type=int, metavar="N", help="start with the last N lines only")
    p.set_defaults(func=lambda args: cmd_logs(root_of(args), args))

    p = sub.add_parser("stop", help="stop a job, or every job of a sweep (touches their stop.flag)")
    id_argument(p, help="a job id (or name), or a sweep id for all of its pending and running jobs")
    p.add_argument("--now", action="store_true", help="skip the job's stop_grace (stop.flag holds `now`)")
    p.set_defaults(func=lambda args: cmd_stop(root_of(args), args))

    p = sub.add_parser(
        "retry",
        help="run a failed job again under its id (touches retry.flag); it resumes from its "
        "latest checkpoint when it can (train jobs, resume_args)",
    )
    id_argument(p)
    p.set_defaults(func=lambda args: cmd_retry(root_of(args), args))


def _fail(message: str, code: int = EXIT_ERROR) -> int:
    print(f"trainq: {message}", file=sys.stderr)
    return code


def cmd_logs(root: Path, args: argparse.Namespace) -> int:
    """``trainq logs ID``: print output.log (the last N lines; following it until the job finishes)."""
    from trainq.watcher.cli.manage import find_job, no_such_job, wait_for_claim
    from trainq.watcher.cli.show import no_output_words
    from trainq.watcher.spec.contract import JobPaths

    found = find_job(root, args.id) or wait_for_claim(root, args.id)
    if found is None:
        return _fail(no_such_job(root, args.id), EXIT_INVALID)
    words = no_output_words(root, found)
    if words:
        print(words, file=sys.stderr if args.follow else sys.stdout, flush=True)
        if not args.follow:
            return EXIT_OK
    offset = 0
    if args.tail is not None:
        offset = tail_offset(JobPaths(found.path).log, max(0, args.tail))
    while True:
        found = find_job(root, args.id) or found
        offset = _print_from(JobPaths(found.path).log, offset)
        if not args.follow or found.state in ("done", "failed"):
            return EXIT_OK
        time.sleep(0.5)


def tail_offset(path: Path, lines: int, block: int = 65536) -> int:
    """The byte offset where the last ``lines`` lines of ``path`` begin (read backwards, block by block)."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            pos, seen = end, 0
            if lines == 0:
                return end
            while pos > 0:
                step = min(block, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step)
                if pos + step == end and data.endswith(b"\n"):
                    data = data[:-1]  # the last line's own newline does not start another line
                i = len(data)
                while (i := data.rfind(b"\n", 0, i)) >= 0:
                    seen += 1
                    if seen == lines:
                        return pos + i + 1
            return 0
    except FileNotFoundError:
        return 0


def _print_from(path: Path, offset: int) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    sys.stdout.buffer.write(data)
    sys.stdout.flush()
    return offset + len(data)


def cmd_stop(root: Path, args: argparse.Namespace) -> int:
    """``trainq stop ID``: touch the job's stop.flag (every pending or running job's, for a sweep id)."""
    from trainq.watcher.cli.manage import find_job, request_stop, sweeps_of

    size = sweeps_of(root, args.id).get(args.id) if find_job(root, args.id) is None else None
    if size:
        return _stop_sweep(root, args.id, size, args.now)
    return _flag(
        root,
        args,
        ("pending", "running"),
        lambda path: request_stop(path, now=args.now),
        _stop_words(root, args.id, args.now),
    )


def _stop_words(root: Path, job_id: str, now: bool) -> str:
    """What a stop will do: cancel a pending job; a running one shows `stopping` for up to its stop_grace."""
    from trainq.watcher.cli.manage import find_job
    from trainq.watcher.spec.errors import InvalidJobSpec
    from trainq.watcher.spec.jobspec import load_job_file

    found = find_job(root, job_id)
    if found is None or found.state != "running":
        return "stop requested; it ends cancelled without running"
    if now:
        return "stop requested, without the grace: its processes are terminated now, then it ends cancelled"
    try:
        grace = load_job_file(found.path / "job.yaml").stop_grace_s
    except (InvalidJobSpec, OSError):
        return "stop requested; it shows `stopping` until it has checkpointed and exited (at most its stop_grace)"
    return (
        f"stop requested; it shows `stopping` for up to its stop_grace ({grace:g}s) while it checkpoints and "
        f"exits, then its processes are terminated; `trainq stop --now {found.id}` skips the wait"
    )


def _stop_sweep(root: Path, sweep_id: str, size: int, now: bool) -> int:
    """``trainq stop SWEEP``: a stop.flag in every pending or running job of the sweep (on Slurm: one scancel)."""
    from trainq.watcher.cli.manage import find_job, request_stop

    stopped, ended = [], 0
    for index in range(1, size + 1):
        found = find_job(root, f"{sweep_id}-{index}")
        if found is not None and found.state in ("pending", "running"):
            request_stop(found.path, now=now)
            stopped.append(f"{sweep_id}-{index}")
        else:
            ended += 1
    if not stopped:
        return _fail(
            f"sweep {sweep_id}: none of its {size} job(s) is pending or running; nothing to stop", EXIT_INVALID
        )
    listed = stopped[0] if len(stopped) == 1 else f"{stopped[0]} … {stopped[-1]}"
    print(
        f"sweep {sweep_id}: stop requested for {len(stopped)} job(s) ({listed})"
        + (", without the grace" if now else "")
        + (f"; {ended} already finished" if ended else "")
    )
    return EXIT_OK


def cmd_retry(root: Path, args: argparse.Namespace) -> int:
    """``trainq retry ID``: touch a failed job's retry.flag, unless it cannot run again as it is."""
    from trainq.watcher.spec.contract import JobPaths
    from trainq.watcher.spec.fsutil import touch

    def retry(path: Path) -> Path:
        from trainq.watcher.cli.again import blocking_dependency
        from trainq.watcher.spec.errors import InvalidJobSpec
        from trainq.watcher.spec.jobspec import load_job_file

        run = read_json(JobPaths(path).run) or {}
        if run.get("status") == "rejected" and not _validates(JobPaths(path).spec):
            raise UsageError(
                f"job {path.name} was rejected: its job file is invalid, so it cannot run again. "
                f"Fix it with `trainq edit {path.name}` (checked, then run under the same id; "
                f"`trainq show {path.name}` lists the problems)"
            )
        try:
            spec = load_job_file(JobPaths(path).spec)
        except (InvalidJobSpec, OSError):
            spec = None
        blocked = blocking_dependency(root, spec)
        if blocked:
            raise UsageError(
                f"job {path.name} runs after {blocked[0]}, which ended {blocked[1]}: retry that first "
                f"(`trainq retry {blocked[0]}`), then this one; nothing done"
            )
        touch(JobPaths(path).retry_flag)
        return JobPaths(path).retry_flag

    return _flag(root, args, ("failed",), retry, _retry_plan(root, args.id))


def _validates(path: Path) -> bool:
    from trainq.watcher.spec.errors import InvalidJobSpec
    from trainq.watcher.spec.jobspec import load_job_file

    try:
        return not load_job_file(path).sweep
    except (InvalidJobSpec, OSError):
        return False


def _retry_plan(root: Path, job_id: str) -> str:
    """What ``trainq retry`` will do: which checkpoint the next attempt resumes from, or that none exists."""
    from trainq.watcher.cli.manage import find_job
    from trainq.watcher.daemon.jobs import load_job, resume_point
    from trainq.watcher.spec.folders import JobState

    found = find_job(root, job_id)
    job = load_job(found.path, JobState.FAILED) if found is not None and found.state == "failed" else None
    if job is None or job.spec is None:
        return "retry requested"
    if not job.spec.has_resume:
        return "retry requested; it starts from the beginning (job.yaml has no resume_args)"
    checkpoint = resume_point(job)
    if checkpoint is None:
        return "retry requested; no checkpoint found, it starts from the beginning"
    return f"retry requested, resuming from {checkpoint}"


def _flag(root: Path, args: argparse.Namespace, states: tuple[str, ...], act: Callable[[Path], Path], what: str) -> int:
    """Create a job's stop.flag or retry.flag, exactly as a user would by hand."""
    from trainq.watcher.cli.manage import find_job, no_such_job

    found = find_job(root, args.id)
    if found is None:
        return _fail(no_such_job(root, args.id), EXIT_INVALID)
    if found.state not in states:
        return _fail(
            f"job {found.id} is in {found.state}/; this works only for jobs in {' or '.join(s + '/' for s in states)}",
            EXIT_INVALID,
        )
    try:
        flag_path = act(found.path)
    except UsageError as exc:
        return _fail(str(exc), EXIT_INVALID)
    print(f"job {found.id}: {what} ({found.state}/{found.id}/{flag_path.name})")
    return EXIT_OK
