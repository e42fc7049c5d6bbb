"""Containment: one job's trouble stays that job's (a supervisor tree's "let it crash, one child at a time").

Every per-job step of the loop (admit, plan, start, watch, finish, retry, recover) runs inside
``guard.guarded(job, step, fn, *args)`` (``Containment``, one of the Watcher's steps). Two expected conditions are handled by name: a job folder
removed by hand (``JobFolderRemoved``) is forgotten with one log line, and a full disk
(ENOSPC/EDQUOT) puts the watcher in its disk-full state without touching the job. Anything else
fails that one job (``rejected`` in admit, else ``failed`` with diagnosis ``unknown`` and the
exception as evidence, the traceback in watcher.log) and the loop goes on.

Two documented test switches make that trouble on purpose, for the jobs whose id matches a glob:
``TRAINQ_WATCHER_FAULTS`` raises a real exception inside a named step, so tests exercise every
boundary with real processes; ``TRAINQ_WATCHER_CRASH`` ends the watcher process at a named point
(``os._exit(CRASH_EXIT_CODE)``, as a SIGKILL would: no cleanup, no final status.json), so tests check
that every crash between two writes of a multi-step change (a retry, a start) is finished by the next
watcher. Never set either outside tests.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, TypeVar

from trainq.watcher.daemon.diagnosis import Diagnosis
from trainq.watcher.daemon.diskfull import DISK_FULL_ERRNOS, is_disk_full  # noqa: F401 (re-exported)
from trainq.watcher.daemon.jobs import Job, load_job, new_run
from trainq.watcher.spec.errors import JobFolderRemoved, WatcherError
from trainq.watcher.spec.folders import JobState
from trainq.watcher.spec.fsutil import atomic_write_json, raise_flag, read_json
from trainq.watcher.spec.tombstones import ended_status, read_tombstone, record_removal
from trainq.watcher.spec.units import iso_utc

if TYPE_CHECKING:
    from pathlib import Path

    from trainq.watcher.daemon.diskfull import DiskFullHandling
    from trainq.watcher.daemon.state import LoopState

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: env variable of the fault-injection test switch: ``STEP:GLOB[,STEP:GLOB…]``
ENV_WATCHER_FAULTS = "TRAINQ_WATCHER_FAULTS"
#: the loop's per-job steps, each behind a guard
STEPS = ("admit", "plan", "start", "watch", "finish", "retry", "recover")
#: env variable of the crash-point test switch: ``POINT:GLOB[,POINT:GLOB…]``
ENV_WATCHER_CRASH = "TRAINQ_WATCHER_CRASH"
#: the exit status of a watcher ended by a crash point (tests tell it from a real failure)
CRASH_EXIT_CODE = 86
#: the named points, in the order a retry.flag is honoured (finishing.py), a job starts (starting.py) and an
#: inbox file is claimed (spec/folders.py)
POINTS = (
    "retry-saved",  # run.json says pending, the folder is still in failed/ with its retry.flag
    "retry-moved",  # the folder is in pending/, its retry.flag not yet removed
    "retry-done",  # retry.flag removed; only in-memory bookkeeping remained
    "start-moved",  # the folder is in running/, no supervisor forked yet
    "concluded",  # an attempt's end is known in memory; run.json and the folder move not yet written
    "claim-staged",  # a claim's folder is whole in .claiming/, not yet renamed into place (folders.py)
    "claim-placed",  # the claimed folder is in place; the inbox file's name not yet removed
)
#: run.json's ``stop_requested_by`` for a live attempt stopped because the watcher failed on it
STOPPED_BY_INTERNAL_ERROR = "internal_error"


class InjectedFault(RuntimeError):
    """Raised inside a guarded step by the TRAINQ_WATCHER_FAULTS test switch."""


class BadFaultSpec(WatcherError):
    """Raised when TRAINQ_WATCHER_FAULTS cannot be parsed."""


class BadCrashSpec(WatcherError):
    """Raised when TRAINQ_WATCHER_CRASH cannot be parsed."""


@dataclass(frozen=True)
class Faults:
    """Parsed TRAINQ_WATCHER_FAULTS: (step, job id glob) pairs."""

    rules: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, value: str | None) -> Faults:
        """``"start:boom-*,finish:x"`` → Faults; BadFaultSpec naming the bad part."""
        rules = []
        for part in (value or "").split(","):
            if not part.strip():
                continue
            step, sep, glob = part.strip().partition(":")
            if not sep or step not in STEPS or not glob:
                raise BadFaultSpec(
                    f"{ENV_WATCHER_FAULTS}: {part!r} is not STEP:GLOB with STEP one of {', '.join(STEPS)}"
                )
            rules.append((step, glob))
        return cls(tuple(rules))

    def check(self, step: str, job_id: str) -> None:
        """Raise InjectedFault when a rule names this step and job."""
        for rule_step, glob in self.rules:
            if rule_step == step and fnmatchcase(job_id, glob):
                raise InjectedFault(f"fault injected into step {step} by {ENV_WATCHER_FAULTS}")


@dataclass(frozen=True)
class CrashPoints:
    """Parsed TRAINQ_WATCHER_CRASH: (point, job id glob) pairs."""

    rules: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, value: str | None) -> CrashPoints:
        """``"retry-saved:job-*"`` → CrashPoints; BadCrashSpec naming the bad part."""
        rules = []
        for part in (value or "").split(","):
            if not part.strip():
                continue
            point, sep, glob = part.strip().partition(":")
            if not sep or point not in POINTS or not glob:
                raise BadCrashSpec(
                    f"{ENV_WATCHER_CRASH}: {part!r} is not POINT:GLOB with POINT one of {', '.join(POINTS)}"
                )
            rules.append((point, glob))
        return cls(tuple(rules))

    def reached(self, point: str, job_id: str) -> None:
        """End the process at once when a rule names this point and job (a test switch)."""
        for rule_point, glob in self.rules:
            if rule_point == point and fnmatchcase(job_id, glob):
                logger.warning("job %s: crash point %s reached (%s); exiting now", job_id, point, ENV_WATCHER_CRASH)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os._exit(CRASH_EXIT_CODE)


def internal_error_diagnosis(step: str, exc: BaseException) -> Diagnosis:
    """The diagnosis of a job the watcher failed on: kind unknown, the exception as evidence."""
    return Diagnosis(
        "unknown",
        f"trainq's watcher hit an internal error in step '{step}' while handling this job; the traceback is "
        "in watcher.log. Please report it; `trainq retry ID` runs the job again.",
        f"{type(exc).__name__}: {exc}"[:500],
    )


class Containment:
    """The guard and what it does on failure.

    Reads ``faults`` and the state's root, folders and executor. Changes the state's ``jobs``,
    ``concluded``, ``plan_due`` and ``deps.finished``, and a failed job's run.json and folder. Tells
    ``disk`` of a full disk, ``retire`` of a job it failed, ``deps_changed`` of a job whose folder vanished.
    """

    def __init__(
        self,
        state: LoopState,
        disk: DiskFullHandling,
        faults: Faults,
        *,
        retire: Callable[[Job, float], None],
        deps_changed: Callable[[str, float], None],
    ) -> None:
        self.state = state
        self.disk = disk
        self.faults = faults
        self.retire = retire
        self.deps_changed = deps_changed

    def guarded(self, job: Job, step: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``fn(*args, **kwargs)``, one step for one job: its failure becomes the job's (then None), never the loop's."""
        try:
            self.faults.check(step, job.id)
            return fn(*args, **kwargs)
        except Exception as exc:
            self.job_failed_in(job, step, exc)
            return None

    def guarded_id(self, job_id: str, state: JobState, step: str, fn: Callable[..., T], *args: Any) -> T | None:
        """``guarded`` for a job known only by its folder (recovery, retry.flag)."""
        try:
            self.faults.check(step, job_id)
            return fn(*args)
        except Exception as exc:
            job = self.state.jobs.get(job_id) or _job_from_folder(self.state.root.job_dir(state, job_id), state)
            self.job_failed_in(job, step, exc)
            return None

    def job_failed_in(self, job: Job, step: str, exc: Exception) -> None:
        """The expected conditions by name (folder removed, disk full); anything else fails the job."""
        if is_disk_full(exc):
            self.disk.note_disk_full(exc, f"job {job.id}: {step}")
        elif isinstance(exc, JobFolderRemoved) or (not job.dir.exists() and job.state is not JobState.FAILED):
            self.forget_removed(job)
        else:
            self.contain(job, step, exc)

    def forget_removed(self, job: Job) -> None:
        """A job folder removed by hand: forget the job (its supervisor stops the attempt by itself)."""
        if self.state.jobs.get(job.id) is not job and not any(j is job for j, _ in self.state.concluded):
            return
        self.state.jobs.remove(job.id)
        self.state.drop_concluded(job)
        self.state.folders.forget(job.id)
        running = job.state is JobState.RUNNING
        logger.warning(
            "job %s: folder %s/%s was removed; forgetting the job%s",
            job.id,
            job.state.value,
            job.id,
            " (its supervisor stops it as a stop.flag would)" if running else "",
        )
        self.state.plan_due = True
        self.state.report.touch()
        if running:  # it ended for the reason `removed` (docs/contract.md, why a job stopped): history.jsonl keeps that (its folder cannot)
            self.state.report.removed_while_running(job, time.time())
        self.note_removed(job.id, job.state.value, job.status, job.run.get("sweep"))

    def note_removed(self, job_id: str, state: str, status: str | None, sweep: dict | None = None) -> None:
        """A job folder is gone: leave a tombstone (restarts remember it) and end it for its dependents."""
        try:
            record_removal(self.state.root.path, job_id, state, status, by="its folder vanished", sweep=sweep)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self.disk.note_disk_full(exc, f"job {job_id}: tombstone")
        stone = read_tombstone(self.state.root.path, job_id) or {"status": status}
        self.state.deps.finished[job_id] = ended_status(stone)
        self.deps_changed(job_id, time.time())

    def forget_removed_folders(self) -> None:
        """Notice job folders removed by hand (one listing per live state, not a stat per job)."""
        for job_id, state in self.state.report.forget_removed_recent():
            logger.warning("job %s: folder %s/%s was removed; forgetting the job", job_id, state, job_id)
            self.note_removed(job_id, state, self.state.deps.finished.get(job_id) or state)
        for state in (JobState.PENDING, JobState.RUNNING):
            live = self.state.jobs.in_state(state)
            if not live:
                continue
            present = _names_in(self.state.root.state_dir(state))
            for job in live:
                if job.id not in present and not job.dir.exists():
                    self.forget_removed(job)

    def contain(self, job: Job, step: str, exc: Exception) -> None:
        """Fail ``job`` because ``step`` raised ``exc``; if even that fails, drop it from the loop."""
        if job.contained is None:
            logger.error(
                "job %s: internal error in step %s; failing this job, the queue goes on",
                job.id,
                step,
                exc_info=(type(exc), exc, exc.__traceback__),
            )
            job.contained = step
        elif job.state is JobState.RUNNING and self.state.executor.is_alive(job.paths, job.current_attempt() or {}):
            logger.debug("job %s: %s failed again while it stops: %r", job.id, step, exc)
            return  # already stopping; once its attempt has ended it is failed below without that step
        try:
            self._fail_contained(job, step, exc, time.time())
        except Exception as again:
            if is_disk_full(again) or isinstance(again, JobFolderRemoved):
                self.job_failed_in(job, step, again)  # noted (retried once space frees) or forgotten
                return
            logger.error(
                "job %s: could not record that failure either; leaving its folder %s as it is until "
                "the watcher restarts",
                job.id,
                job.dir,
                exc_info=True,
            )
            self.state.jobs.remove(job.id)
            self.state.drop_concluded(job)
            self.state.report.touch()

    def _fail_contained(self, job: Job, step: str, exc: Exception, now: float) -> None:
        diagnosis = internal_error_diagnosis(step, exc).to_dict()
        error = f"internal error in step {step}: {type(exc).__name__}: {exc}"[:500]
        if job.state is JobState.DONE:  # the failure came after the job had ended well: it stays done
            self._forget_finished(job)
            return
        if job.state is JobState.FAILED:  # retry.flag on a failed job: it stays failed, now saying why
            run = read_json(job.paths.run) or job.run
            atomic_write_json(job.paths.run, dict(run, error=error), redact=True)
            self._forget_finished(job)
            return
        if job.state is JobState.RUNNING and self.state.executor.is_alive(job.paths, job.current_attempt() or {}):
            self._stop_contained(job, error, diagnosis, now)
            return
        if job.state is JobState.RUNNING:
            self.state.executor.kill_leftovers(job.paths, job.current_attempt() or {})
        job.run.update(
            status="rejected" if step == "admit" else "failed",
            finished_at=iso_utc(now),
            waiting_for=None,
            gpus=[],
            error=error,
            diagnosis=diagnosis,
        )
        job.save()
        self.state.drop_concluded(job)
        if job.state in (JobState.PENDING, JobState.RUNNING):
            job.dir = self.state.folders.fail(job.id, job.state)
            self.state.jobs.move(job, JobState.FAILED)
        logger.info("job %s: -> failed, internal error in step %s", job.id, step)
        self.retire(job, now)

    def _forget_finished(self, job: Job) -> None:
        if self.state.jobs.get(job.id) is job:
            self.state.jobs.remove(job.id)
        self.state.drop_concluded(job)
        self.state.report.touch()

    def _stop_contained(self, job: Job, error: str, diagnosis: dict, now: float) -> None:
        """A live attempt: stop it like a stop.flag; it ends failed (judge_exit reads stop_requested_by)."""
        job.run.update(
            status="stopping",
            stop_requested_at=iso_utc(now),
            stop_requested_by=STOPPED_BY_INTERNAL_ERROR,
            reason="watcher",
            error=error,
            diagnosis=diagnosis,
        )
        job.health = "stopping"
        job.save(durable=False)
        raise_flag(job.paths.stop_flag, "watcher")
        if job.id not in self.state.jobs:
            self.state.jobs.add(job)
        logger.info("job %s: stopping it (internal error); it ends failed", job.id)
        self.state.report.touch()


def _job_from_folder(path: Path, state: JobState) -> Job:
    """The job in ``path`` as far as it can be read (for containing a failure before it was loaded)."""
    try:
        job = load_job(path, state)
    except Exception:
        job = None
    if job is None:
        run = read_json(path / "run.json") or new_run(None, time.time_ns(), time.time(), name=path.name)
        job = Job(path.name, state, path, dict(run, id=path.name))
    return job


def _names_in(folder: Path) -> set[str]:
    try:
        return {e.name for e in os.scandir(folder)}
    except FileNotFoundError:
        return set()
