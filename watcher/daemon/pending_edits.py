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
from collections.abc import Callable
from typing import TYPE_CHECKING

from trainq.watcher.spec.errors import InvalidJobSpec
from trainq.watcher.spec.folders import JobState
from trainq.watcher.spec.jobspec import load_job_file
from trainq.watcher.spec.units import iso_utc

if TYPE_CHECKING:
    from trainq.watcher.daemon.containment import Containment
    from trainq.watcher.daemon.jobs import Job
    from trainq.watcher.daemon.state import LoopState
    from trainq.watcher.daemon.workflows import Workflows

logger = logging.getLogger(__name__)

#: most pending jobs whose job.yaml one rescan stats (a 10,000-job queue is covered in a few rescans)
CHECK_BATCH = 2000


class PendingEdits:
    """Re-reads pending job files edited in place; owns which pending job the next rescan looks at first.

    Reads the state's config. Changes the state's ``jobs`` (a new priority re-sorts, a rejected job leaves)
    and ``plan_due``, ``deps`` (an edited after:), pending jobs' run.json and folders, and touches the
    report. A removed folder goes to ``guard``, a new after: to ``workflows``, a rejected job to ``retire``.
    """

    def __init__(
        self, state: LoopState, guard: Containment, workflows: Workflows, *, retire: Callable[[Job, float], None]
    ) -> None:
        self.state = state
        self.guard = guard
        self.workflows = workflows
        self.retire = retire
        self._cursor = 0  # round robin over the pending jobs

    def check(self, now: float) -> None:
        """Stat the next batch of pending job files; re-read those that changed and have settled."""
        pending = self.state.jobs.in_state(JobState.PENDING)
        if not pending:
            return
        start = self._cursor % len(pending)
        batch = (pending[start:] + pending[:start])[:CHECK_BATCH]
        self._cursor = start + len(batch)
        for job in batch:
            if job.state is JobState.PENDING:
                _check_one(self, job, now)

    def ready_to_start(self, job: Job, now: float) -> bool:
        """Right before a start: True unless job.yaml changed since it was read (``_ready_to_start``)."""
        return _ready_to_start(self, job, now)


def file_sig(st: os.stat_result) -> tuple[int, int, int]:
    """What tells one version of a job file from the next: size, mtime and inode (an editor's rename)."""
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _check_one(edits: PendingEdits, job: Job, now: float) -> None:
    try:
        sig = file_sig(os.stat(job.paths.spec))
    except FileNotFoundError:
        _vanished(edits, job, now)
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
    if now - job.spec_change[1] < edits.state.config.settle_s:
        return
    job.spec_sig, job.spec_change = sig, None
    _reread(edits, job, now)


def _ready_to_start(edits: PendingEdits, job: Job, now: float) -> bool:
    """Right before a start: one ``stat`` of job.yaml against the version the spec was read from.

    An edit that landed since (even milliseconds ago) is read now, and the job is planned again
    with it on the next pass (False). An edit that does not validate yet is judged only once it
    has stood still for ``settle_s`` (a save in progress); until then the job does not start.
    """
    try:
        sig = file_sig(os.stat(job.paths.spec))
    except FileNotFoundError:
        _vanished(edits, job, now)
        return False
    if job.spec_sig is None or sig == job.spec_sig:
        return True
    if now - sig[1] / 1e9 < edits.state.config.settle_s:
        try:
            load_job_file(job.paths.spec, f"pending/{job.id}/job.yaml")
        except InvalidJobSpec:
            if job.spec_change is None or job.spec_change[0] != sig:
                job.spec_change = (sig, now)  # pending_edits.check judges it once settled
            return False
        except OSError:
            return False
    job.spec_sig, job.spec_change = sig, None
    _reread(edits, job, now)
    edits.state.plan_due = True
    edits.state.wake()  # planned again at once, with what the file says now
    return False


def _vanished(edits: PendingEdits, job: Job, now: float) -> None:
    if job.dir.exists():
        _reject(edits, job, InvalidJobSpec(f"pending/{job.id}/job.yaml", []), now, "job.yaml was removed")
        return
    edits.guard.forget_removed(job)  # containment.py: one log line, the id free again


def _reread(edits: PendingEdits, job: Job, now: float) -> None:
    display = f"pending/{job.id}/job.yaml"
    try:
        spec = load_job_file(job.paths.spec, display)
        edits.state.check_allowed(spec, display, f"{job.id}.yaml")
    except InvalidJobSpec as exc:
        _reject(edits, job, exc, now)
        return
    except FileNotFoundError:
        return  # it moved meanwhile; the next pass sees where
    before, old_after = job.priority, (job.spec.after if job.spec is not None else ())
    job.spec = spec
    job.run.update(priority=spec.priority, name=spec.name or job.run.get("name") or job.id)
    job.checked = False  # new resources: admission checks again whether this machine can ever run it
    edits.state.jobs.add(job)  # re-sorted by its (new) priority
    _rewire_dependencies(edits, job, old_after, now)
    if job.state is not JobState.PENDING:
        return  # the new after: closed a cycle: rejected
    job.save(durable=False)
    edits.state.plan_due = True
    edits.state.report.touch()
    logger.info("job %s: job.yaml changed; re-read (priority %d -> %d)", job.id, before, spec.priority)


def _rewire_dependencies(edits: PendingEdits, job: Job, old_after: tuple, now: float) -> None:
    """An edited after: is followed: the old dependencies forgotten, the new ones held on (or a cycle rejected)."""
    if old_after:
        edits.state.deps.forget(job.id, old_after)
    if job.held and not job.spec.after:
        edits.state.jobs.release(job)
        job.run["waiting_for"] = None
    if job.spec.after:
        edits.workflows.admit_workflow(job, now)


def _reject(edits: PendingEdits, job: Job, exc: InvalidJobSpec, now: float, why: str | None = None) -> None:
    lines = exc.lines() if exc.problems else [f"{exc.file}: {why}"]
    job.run.update(
        status="rejected",
        finished_at=iso_utc(now),
        waiting_for=None,
        error=lines[0],
        errors=[p.to_dict() for p in exc.problems] or [{"path": "", "message": why}],
    )
    job.save()
    job.dir = edits.state.folders.fail(job.id, JobState.PENDING)
    edits.state.jobs.move(job, JobState.FAILED)
    for line in lines:
        logger.warning("job %s: rejected after an edit: %s", job.id, line)
    logger.info("job %s: pending -> failed, rejected (job.yaml no longer validates)", job.id)
    edits.retire(job, now)
