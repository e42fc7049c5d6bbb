"""A pending job's job.yaml edited by any means (an editor, ``trainq edit``, ``trainq priority``) is read again.

Valid: its new priority, name, command and resources are used from then on (the job keeps its
place among jobs of its priority). Invalid: the job fails as ``rejected`` with the problems in
run.json, like a bad inbox file. A pending folder the user removed (``rm -r pending/ID``) is
forgotten. Each rescan looks at up to ``CHECK_BATCH`` pending jobs in turn (one ``stat`` each), and
a changed file is read once it has stood still for ``settle_s``, so a half-written save is never judged.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Protocol

from trainq.watcher.spec.errors import InvalidJobSpec
from trainq.watcher.spec.folders import JobState
from trainq.watcher.spec.jobspec import load_job_file
from trainq.watcher.spec.units import iso_utc

if TYPE_CHECKING:
    from trainq.watcher.daemon.jobs import Job
    from trainq.watcher.spec.jobspec import JobSpec

logger = logging.getLogger(__name__)

#: most pending jobs whose job.yaml one rescan stats (a 10,000-job queue is covered in a few rescans)
CHECK_BATCH = 2000


class EditHost(Protocol):
    """What re-reading a pending job needs from the loop (the Watcher provides it; no import of it here)."""

    config: object
    jobs: object
    folders: object
    deps: object
    report: object
    _plan_due: bool

    def check_allowed(self, spec: JobSpec, display: str, file_name: str) -> None: ...
    def admit_workflow(self, job: Job, now: float) -> None: ...
    def forget_removed(self, job: Job) -> None: ...
    def _retire(self, job: Job, now: float) -> None: ...
    def wake(self) -> None: ...


class PendingEdits:
    """Which pending job the next rescan looks at first (round robin over the pending jobs)."""

    def __init__(self) -> None:
        self._cursor = 0

    def check(self, watcher: EditHost, now: float) -> None:
        """Stat the next batch of pending job files; re-read those that changed and have settled."""
        pending = watcher.jobs.in_state(JobState.PENDING)
        if not pending:
            return
        start = self._cursor % len(pending)
        batch = (pending[start:] + pending[:start])[:CHECK_BATCH]
        self._cursor = start + len(batch)
        for job in batch:
            if job.state is JobState.PENDING:
                _check_one(watcher, job, now)


def file_sig(st: os.stat_result) -> tuple[int, int, int]:
    """What tells one version of a job file from the next: size, mtime and inode (an editor's rename)."""
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _check_one(watcher: EditHost, job: Job, now: float) -> None:
    try:
        sig = file_sig(os.stat(job.paths.spec))
    except FileNotFoundError:
        _vanished(watcher, job, now)
        return
    if job.spec_sig is None:
        job.spec_sig = sig  # recovered at start-up: the spec was read from this very file
        return
    if sig == job.spec_sig:
        job.spec_change = None
        return
    if job.spec_change is None or job.spec_change[0] != sig:
        job.spec_change = (sig, now)  # changed: judged once it has stood still (never half-written)
        return
    if now - job.spec_change[1] < watcher.config.settle_s:
        return
    job.spec_sig, job.spec_change = sig, None
    _reread(watcher, job, now)


def ready_to_start(watcher: EditHost, job: Job, now: float) -> bool:
    """Right before a start: one ``stat`` of job.yaml against the version the spec was read from.

    An edit that landed since (even milliseconds ago) is read now, and the job is planned again
    with it on the next pass (False). An edit that does not validate yet is judged only once it
    has stood still for ``settle_s`` (a save in progress); until then the job does not start.
    """
    try:
        sig = file_sig(os.stat(job.paths.spec))
    except FileNotFoundError:
        _vanished(watcher, job, now)
        return False
    if job.spec_sig is None or sig == job.spec_sig:
        return True
    if now - sig[1] / 1e9 < watcher.config.settle_s:
        try:
            load_job_file(job.paths.spec, f"pending/{job.id}/job.yaml")
        except InvalidJobSpec:
            if job.spec_change is None or job.spec_change[0] != sig:
                job.spec_change = (sig, now)  # pending_edits.check judges it once settled
            return False
        except OSError:
            return False
    job.spec_sig, job.spec_change = sig, None
    _reread(watcher, job, now)
    watcher._plan_due = True
    watcher.wake()  # planned again at once, with what the file says now
    return False


def _vanished(watcher: EditHost, job: Job, now: float) -> None:
    if job.dir.exists():
        _reject(watcher, job, InvalidJobSpec(f"pending/{job.id}/job.yaml", []), now, "job.yaml was removed")
        return
    watcher.forget_removed(job)  # containment.py: one log line, the id free again


def _reread(watcher: EditHost, job: Job, now: float) -> None:
    display = f"pending/{job.id}/job.yaml"
    try:
        spec = load_job_file(job.paths.spec, display)
        watcher.check_allowed(spec, display, f"{job.id}.yaml")
    except InvalidJobSpec as exc:
        _reject(watcher, job, exc, now)
        return
    except FileNotFoundError:
        return  # it moved meanwhile; the next pass sees where
    before, old_after = job.priority, (job.spec.after if job.spec is not None else ())
    job.spec = spec
    job.run.update(priority=spec.priority, name=spec.name or job.run.get("name") or job.id)
    job.checked = False  # new resources: admission checks again whether this machine can ever run it
    watcher.jobs.add(job)  # re-sorted by its (new) priority
    _rewire_dependencies(watcher, job, old_after, now)
    if job.state is not JobState.PENDING:
        return  # the new after: closed a cycle: rejected
    job.save(durable=False)
    watcher._plan_due = True
    watcher.report.touch()
    logger.info("job %s: job.yaml changed; re-read (priority %d -> %d)", job.id, before, spec.priority)


def _rewire_dependencies(watcher: EditHost, job: Job, old_after: tuple, now: float) -> None:
    """An edited after: is followed: the old dependencies forgotten, the new ones held on (or a cycle rejected)."""
    if old_after:
        watcher.deps.forget(job.id, old_after)
    if job.held and not job.spec.after:
        watcher.jobs.release(job)
        job.run["waiting_for"] = None
    if job.spec.after:
        watcher.admit_workflow(job, now)


def _reject(watcher: EditHost, job: Job, exc: InvalidJobSpec, now: float, why: str | None = None) -> None:
    lines = exc.lines() if exc.problems else [f"{exc.file}: {why}"]
    job.run.update(
        status="rejected",
        finished_at=iso_utc(now),
        waiting_for=None,
        error=lines[0],
        errors=[p.to_dict() for p in exc.problems] or [{"path": "", "message": why}],
    )
    job.save()
    job.dir = watcher.folders.fail(job.id, JobState.PENDING)
    watcher.jobs.move(job, JobState.FAILED)
    for line in lines:
        logger.warning("job %s: rejected after an edit: %s", job.id, line)
    logger.info("job %s: pending -> failed, rejected (job.yaml no longer validates)", job.id)
    watcher._retire(job, now)
