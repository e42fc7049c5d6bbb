"""``recover()``: run once at start-up to finish whatever a previous watcher left half done.

Every folder in running/ is re-adopted (its supervisor still holds the job's lock), finished
from its exit record, put back to pending (never started), or failed with diagnosis
``killed`` (its supervisor vanished). Claims interrupted by a crash are completed or undone.
Nothing is guessed from a bare pid.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trainq.watcher.daemon.jobs import FINAL_STATUSES, Job, judge_exit, load_job, new_run
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import InvalidJobSpec
from trainq.watcher.spec.folders import CLAIM_PREFIX, JobState, remove_tree, return_to_inbox
from trainq.watcher.spec.fsutil import atomic_write_json, remove_quietly, remove_stale_temps
from trainq.watcher.spec.jobspec import load_job_file
from trainq.watcher.spec.tombstones import prune_tombstones, settle_known_ids
from trainq.watcher.spec.units import iso_utc
from trainq.watcher.supervisor import cgroups

if TYPE_CHECKING:
    from trainq.watcher.daemon.containment import Containment
    from trainq.watcher.daemon.finishing import Finishing
    from trainq.watcher.daemon.state import LoopState
    from trainq.watcher.daemon.workflows import Workflows


logger = logging.getLogger(__name__)


def recover(loop: LoopState, guard: Containment, workflows: Workflows, finishing: Finishing) -> None:
    """Rebuild the daemon's index from the folders and repair interrupted steps.

    Fills the loop's ``jobs`` and order counter; each job's repair runs inside ``guard``; ``workflows``
    holds pending jobs again and resumes sweeps and hooks; ``finishing`` ends attempts that ended unseen.
    """
    now = time.time()
    _clear_staging(loop)  # before any id is read: a half-built folder was never a job
    found = loop.folders.load_ids()
    _unlink_claimed_inbox_names(loop, found)
    prune_tombstones(loop.root.path)
    _remove_stale_temp_files(loop, found)
    for job_id in found[JobState.PENDING]:
        guard.guarded_id(job_id, JobState.PENDING, "recover", _recover_pending, loop, job_id, now)
    workflows.resume_sweeps(now)
    for job_id in found[JobState.RUNNING]:
        guard.guarded_id(job_id, JobState.RUNNING, "recover", _recover_running, loop, finishing, job_id, now)
    present = {job_id for ids in found.values() for job_id in ids} | set(loop.folders.ids_in(JobState.PENDING))
    gone = settle_known_ids(loop.root.path, present, now)  # folders removed while no watcher ran
    if gone:
        logger.warning(
            "watcher: %d job folder(s) were removed while no watcher ran (%s%s); their dependents count "
            "them as removed",
            len(gone),
            ", ".join(gone[:5]),
            " ..." if len(gone) > 5 else "",
        )
    for job in sorted(loop.jobs.in_state(JobState.PENDING), key=lambda j: j.order):
        guard.guarded(
            job, "recover", workflows.admit_workflow, job, now
        )  # hold again on dependencies (kept only in job.yaml)
    loop.report.recount()
    _seed_recent(loop, workflows)
    workflows.hooks.recover(loop.root.path)  # every due hook, however many finished jobs there are
    _remove_empty_cgroups(loop)
    orders = [j.order for j in loop.jobs.values()]
    loop.order_last = max([*orders, time.time_ns()])
    running = loop.jobs.count(JobState.RUNNING)
    logger.info("watcher: recovered %d pending and %d running job(s)", len(loop.jobs) - running, running)


def _recover_pending(loop: LoopState, job_id: str, now: float) -> None:
    path = loop.root.job_dir(JobState.PENDING, job_id)
    paths = JobPaths(path)
    remove_stale_temps(path, (paths.run.name,))
    remove_quietly(paths.retry_flag)  # a retry interrupted after its move (finishing.py): it is done
    if not paths.spec.exists() and not paths.spec.is_symlink():
        _remove_abandoned_claim(paths)
        loop.folders.forget(job_id)
        return
    job = load_job(path, JobState.PENDING)
    if job is None:  # job.yaml landed but run.json did not: finish the claim
        atomic_write_json(paths.run, dict(new_run(None, time.time_ns(), now, name=job_id), id=job_id))
        job = load_job(path, JobState.PENDING)
        assert job is not None, "its run.json was just written"
        if job.spec is not None:
            job.run.update(priority=job.spec.priority, name=job.spec.name or job_id)
    if job.spec is None:
        error, errors = _validation_error(paths, job_id)
        logger.warning("job %s: pending/%s/job.yaml no longer validates; failing it: %s", job_id, job_id, error)
        job.run.update(status="rejected", finished_at=iso_utc(now), error=error, errors=errors)
    if job.run.get("status") in FINAL_STATUSES:  # the move to failed/ was interrupted
        job.save()
        job.dir = loop.folders.fail(job_id, JobState.PENDING)
        loop.jobs.move(job, JobState.FAILED)
        return
    job.run["status"] = "pending"
    loop.jobs.add(job)


def _validation_error(paths: JobPaths, job_id: str) -> tuple[str, list[dict]]:
    """The first error line and every problem of a job.yaml that does not validate (named by field)."""
    try:
        load_job_file(paths.spec, f"pending/{job_id}/job.yaml")
    except InvalidJobSpec as exc:
        return exc.lines()[0], [p.to_dict() for p in exc.problems]
    except OSError as exc:
        return f"pending/{job_id}/job.yaml: cannot be read ({exc.strerror or exc})", []
    return f"pending/{job_id}/job.yaml no longer validates", []


def _recover_running(loop: LoopState, finishing: Finishing, job_id: str, now: float) -> None:
    path = loop.root.job_dir(JobState.RUNNING, job_id)
    job = load_job(path, JobState.RUNNING)
    if job is None:
        job = Job(job_id, JobState.RUNNING, path, new_run(None, time.time_ns(), now, name=job_id))
        job.run["id"] = job_id
    executor = loop.executor
    started = executor.read_started(job.paths)
    loop.jobs.add(job)
    attempt = job.current_attempt() or {}
    if executor.is_alive(job.paths, attempt):
        _adopt(job, started, now)
        return
    record = executor.read_exit(job.paths, attempt)
    if (started is None and record is None) or _of_an_ended_attempt(job, started or record):
        _never_started(loop, job)
        return
    _sync_attempt(job, started or record)
    if record is not None and record.get("attempt") == job.attempt:
        logger.info("job %s: its attempt ended unseen (no watcher, or a full disk); recording its exit", job_id)
        finishing.finish(job, judge_exit(job.run, record, job.paths, job.spec), record, now)
    else:
        finishing.finish_lost(job, now)


def _adopt(job: Job, started: dict | None, now: float) -> None:
    """A live attempt: keep watching it as if this watcher had started it."""
    _sync_attempt(job, started)
    if job.run.get("status") not in ("running", "stopping"):
        job.run["status"] = "running"
    if job.paths.stop_flag.exists():
        job.run["status"] = "stopping"
    job.health = "stopping" if job.run["status"] == "stopping" else "healthy"
    job.last_activity = now
    job.save()
    logger.info(
        "job %s: re-adopted running attempt %d (supervisor pid %s)",
        job.id,
        job.attempt,
        (started or {}).get("supervisor_pid"),
    )


def _sync_attempt(job: Job, record: dict | None) -> None:
    """run.json may lag the supervisor's records by one write if the watcher died mid-launch."""
    if not record:
        return
    n = int(record.get("attempt") or 0)
    attempts = job.run.setdefault("attempts", [])
    if n > job.attempt or not attempts:
        job.run["attempt"] = n
        attempts.append({"n": n, "pid": record.get("supervisor_pid"), "started_at": record.get("started_at")})
    current = attempts[-1]
    current.setdefault("job_pid", record.get("job_pid"))
    if current.get("pid") is None:
        current["pid"] = record.get("supervisor_pid")
    job.run["started_at"] = job.run.get("started_at") or record.get("started_at")


def _of_an_ended_attempt(job: Job, record: dict | None) -> bool:
    """The records in a running job's folder are those of an attempt run.json has already concluded, and run.json
    says pending: a retry (or a requeue) was moved into running/ for its next attempt, and the watcher died before
    any supervisor took that attempt (taking it clears the last attempt's records). The next attempt never started;
    reading the old exit record as its end would fail the job again without running it (the soak found it)."""
    if not record or job.run.get("status") != "pending":
        return False
    n = record.get("attempt")
    return any(a.get("n") == n and a.get("ended_at") for a in job.run.get("attempts") or [])


def _never_started(loop: LoopState, job: Job) -> None:
    """The watcher died between moving the folder and forking the supervisor: start it again later."""
    job.run.update(status="pending", waiting_for=None)
    job.save()
    job.dir = loop.folders.requeue(job.id, JobState.RUNNING)
    loop.jobs.move(job, JobState.PENDING)
    logger.info("job %s: running -> pending, its attempt never started", job.id)


def _remove_stale_temp_files(loop: LoopState, found: dict) -> None:
    """Temp files of atomic writes a killed watcher left: status.json's, status.html's, run.json's in running/."""
    root = loop.root
    removed = remove_stale_temps(root.path, (root.status_json.name, root.status_html.name))
    for job_id in found[JobState.RUNNING]:
        removed += remove_stale_temps(root.job_dir(JobState.RUNNING, job_id), ("run.json",))
    if removed:
        logger.info("queue: removed %d temp file(s) left by an interrupted write", removed)


def _clear_staging(loop: LoopState) -> None:
    """Folders a killed watcher left half built in ``.claiming/`` (folders.py): none was ever visible as a job.

    A claim's job.yaml is the inbox file's second name until the folder is in place, so removing the staging
    folder leaves the file in the inbox to be claimed again; where it is the only name (a filesystem without
    hard links) it goes back into the inbox first. A job the watcher was writing (a sweep's) is written again
    from its sweep by ``resume_sweeps``.
    """
    staging = loop.root.claiming
    try:
        entries = sorted(os.listdir(staging))
    except FileNotFoundError:
        return
    for name in entries:
        folder = staging / name
        spec = JobPaths(folder).spec
        try:
            if name.startswith(CLAIM_PREFIX) and os.stat(spec, follow_symlinks=False).st_nlink == 1:
                return_to_inbox(spec, loop.root.inbox, name[len(CLAIM_PREFIX) :])
        except FileNotFoundError:
            pass
        remove_tree(folder)
        logger.info("queue: removed %s/%s, a job folder a stopped watcher left half built", staging.name, name)


def _remove_abandoned_claim(paths: JobPaths) -> None:
    """A claim interrupted before job.yaml moved in: the inbox file is still in the inbox."""
    remove_quietly(paths.run)
    remove_stale_temps(paths.dir, (paths.run.name,))
    try:
        paths.dir.rmdir()
        logger.info("queue: removed interrupted claim %s", paths.dir)
    except OSError:
        logger.warning("queue: %s has no job.yaml but is not empty; leaving it", paths.dir)


def _unlink_claimed_inbox_names(loop: LoopState, found: dict) -> None:
    """A crash between link and unlink leaves one file with two names; drop the inbox one."""
    suspects = {}
    try:
        for entry in os.scandir(loop.root.inbox):
            st = entry.stat(follow_symlinks=False)
            if st.st_nlink > 1:
                suspects[(st.st_dev, st.st_ino)] = Path(entry.path)
    except FileNotFoundError:
        return
    if not suspects:
        return
    for state in (JobState.PENDING, JobState.FAILED):
        for job_id in found[state]:
            try:
                st = os.stat(JobPaths(loop.root.job_dir(state, job_id)).spec, follow_symlinks=False)
            except OSError:
                continue
            name = suspects.pop((st.st_dev, st.st_ino), None)
            if name is not None:
                remove_quietly(name)
                logger.info("queue: %s was already claimed as %s; removed the inbox name", name.name, job_id)


def _remove_empty_cgroups(loop: LoopState) -> None:
    """Groups a killed supervisor or hook runner left empty (live attempts' groups are never empty)."""
    containment = local_containment(loop)
    if containment is not None and cgroups.remove_empty_groups(containment, loop.root.path):
        logger.info("queue: removed empty cgroups left by killed supervisors")
    if containment is not None and (gone := cgroups.remove_empty_queue_folders(containment)):
        logger.info("queue: removed %d empty queue folders of cgroups left by killed watchers", gone)


def local_containment(loop: LoopState) -> cgroups.Containment | None:
    """How this machine's attempts are contained, when they run here (None on an executor without one)."""
    return getattr(getattr(loop.executor, "supervisor", None), "containment", None)


def _seed_recent(loop: LoopState, workflows: Workflows) -> None:
    """List the most recently finished jobs (by folder change time) in status.json."""
    finished = []
    for state in (JobState.DONE, JobState.FAILED):
        try:
            entries = [e for e in os.scandir(loop.root.state_dir(state)) if not e.name.startswith(".")]
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                finished.append((entry.stat(follow_symlinks=False).st_ctime, state, Path(entry.path)))
            except OSError:
                continue
    finished.sort(key=lambda item: item[0])
    report = loop.report
    for _ctime, state, path in finished[-loop.config.keep_finished :]:
        job = load_job(path, state)
        if job is not None:
            report.finished(job, 0.0, count=False)  # recount() already counted it
            workflows.recovered_finished(job)
