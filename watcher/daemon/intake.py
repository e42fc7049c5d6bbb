"""What enters pending/, and stays valid there: inbox files admitted (``Intake``), pending job files edited in place
(``PendingEdits``). Both are steps of the Watcher's loop.

Admitting: each complete inbox file is validated, then claimed into pending/ (accepted), into failed/
(rejected, its problems in run.json), or left where it is while it awaits approval. A burst is validated
and claimed on a small thread pool, in drop order, at most ``ADMIT_BATCH`` files a pass. A heavy file (a
sweep, whose validation checks every combination, or one of ``HEAVY_FILE_BYTES`` or more) is validated on
that pool while the loop goes on, and a later pass acts on the result.

Editing: a pending job's job.yaml edited by any means (an editor, ``trainq edit``, ``trainq priority``) is
read again. Valid: its new priority, name, command and resources are used from then on (the job keeps its
place among jobs of its priority). Invalid: the job fails as ``rejected`` with the problems in run.json,
like a bad inbox file. A pending folder the user removed (``rm -r pending/ID``) is forgotten. Each rescan
looks at up to ``CHECK_BATCH`` pending jobs in turn (one ``stat`` each), and a changed file is read once it
has stood still for ``settle_s``, so a half-written save is never judged.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from trainq.watcher.daemon import records
from trainq.watcher.daemon.diskfull import is_disk_full
from trainq.watcher.daemon.inbox import Inbox, name_problem, printable_name
from trainq.watcher.daemon.jobs import Job, new_run
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import InvalidJobSpec, Problem
from trainq.watcher.spec.folders import JobState, id_from_name
from trainq.watcher.spec.jobspec import JobSpec, check_submission, load_job_file
from trainq.watcher.spec.refusals import base_of
from trainq.watcher.spec.units import iso_utc

if TYPE_CHECKING:
    from trainq.watcher.daemon.containment import Containment
    from trainq.watcher.daemon.diskfull import DiskFullHandling
    from trainq.watcher.daemon.state import LoopState
    from trainq.watcher.daemon.workflows import Workflows

logger = logging.getLogger(__name__)

#: how many inbox files one tick takes at most, so status stays fresh during a 10,000-file burst
ADMIT_BATCH = 2000
#: threads that validate heavy files off the loop
ADMIT_THREADS = 2
#: inbox files this big, or naming a sweep (whose validation checks every combination), are validated on a worker
#: thread while the loop goes on (a 9,000-key sweep takes seconds); a later pass takes the result
HEAVY_FILE_BYTES = 64 * 1024
#: the word that makes an inbox file heavy whatever its size
_SWEEP_WORD = b"sweep"
#: most pending jobs whose job.yaml one rescan stats (a 10,000-job queue is covered in a few rescans)
CHECK_BATCH = 2000


class Intake:
    """Admits inbox files: validates each, claims it into pending/ (or failed/ when invalid), or keeps it awaiting.

    Reads the state's config, env and root, and the inbox (set by ``Watcher.start``). Changes the state's
    ``jobs`` (accepted jobs), order counter and ``deps.finished`` (a rejected id), claims files through the
    state's folders, and tells the report what it saw. A file's failure goes to ``guard``, a full disk to
    ``disk``; accepted jobs, sweeps and rejections go to ``workflows``. Owns what awaits approval.
    """

    def __init__(self, state: LoopState, guard: Containment, disk: DiskFullHandling, workflows: Workflows) -> None:
        self.state = state
        self.guard = guard
        self.disk = disk
        self.workflows = workflows
        self.inbox: Inbox | None = None
        self._awaiting: dict[str, tuple[tuple, dict]] = {}
        self._unclaimable: dict[str, tuple] = {}  # inbox files not even rejectable (a second fault): name -> signature
        self._pool: ThreadPoolExecutor | None = None
        self._heavy: dict[str, tuple] = {}  # inbox name -> (candidate, future of _take) validating off the loop

    def close(self) -> None:
        """Stop the threads that validate a burst."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    @property
    def _inbox(self) -> Inbox:
        """The inbox (``Watcher.start`` sets it before the first pass)."""
        assert self.inbox is not None, "Intake used before Watcher.start"
        return self.inbox

    def forget_awaiting(self) -> None:
        """Forget the files found awaiting approval (read again on the next pass)."""
        self._awaiting.clear()

    def _forget(self, name: str) -> None:
        """The inbox file ``name`` was taken: the inbox and the awaiting list forget it."""
        self._inbox.taken(name)
        self._awaiting.pop(name, None)

    def admit_inbox(self, now: float) -> None:
        """Validate every complete inbox file: accept, reject, or leave it awaiting approval."""
        candidates = self._inbox.scan()
        self.state.report.inbox_seen(candidates, self._inbox.ignored)
        self._collect_heavy(now)
        todo = [
            c for c in self._inbox.ready(candidates, now) if not self._known_awaiting(c) and c.name not in self._heavy
        ]
        for cand in [c for c in todo if _is_heavy(c)]:
            self._validate_off_loop(cand, now)
            todo.remove(cand)
        if len(todo) > ADMIT_BATCH:
            todo = todo[:ADMIT_BATCH]
            self.state.wake()  # the rest next pass, so status.json stays fresh during a burst
        for cand, taken in self._taken(todo, now):
            self._admit_taken(cand, taken, now)
        live = {c.name for c in candidates}
        for name in [n for n in self._awaiting if n not in live]:
            del self._awaiting[name]
        for name in [n for n in self._unclaimable if n not in live]:
            del self._unclaimable[name]
        self.state.report.awaiting(self._awaiting)

    def _admit_taken(self, cand, taken: _Taken, now: float) -> None:
        """What ``_take`` found, acted on (on the loop's thread): accepted, rejected, awaiting or held back."""
        if taken.disk_full is not None:
            self.disk.note_disk_full(taken.disk_full, f"inbox/{cand.name}")
            return
        try:
            self._admit_one(cand, taken, now)
        except Exception as exc:
            self._contain_admitted(cand, taken, exc)

    def _validate_off_loop(self, cand, now: float) -> None:
        """Validate (and, a plain job, claim) a heavy inbox file on a worker thread; the loop goes on."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=ADMIT_THREADS, thread_name_prefix="trainq-admit")
        future = self._pool.submit(self._take, cand, self.state.next_order(), now)
        future.add_done_callback(lambda _done: self.state.wake())
        self._heavy[cand.name] = (cand, future)
        logger.debug("inbox/%s: validating off the loop (%d bytes)", printable_name(cand.name), cand.size)

    def _collect_heavy(self, now: float) -> None:
        """Act on heavy files whose validation ended; one changed since it was read is read again."""
        for name, (cand, future) in list(self._heavy.items()):
            if not future.done():
                continue
            del self._heavy[name]
            if future.cancelled():
                continue
            taken = future.result()  # _take turns every exception into a result
            if taken.claimed is None and taken.disk_full is None and _changed(cand):
                continue  # unclaimed (a sweep, unapproved) and written again meanwhile: the next scan reads it
            self._admit_taken(cand, taken, now)

    def _contain_admitted(self, cand, taken: _Taken, exc: Exception) -> None:
        if taken.claimed is None:
            logger.error(
                "inbox/%s: internal error while admitting it", cand.name, exc_info=(type(exc), exc, exc.__traceback__)
            )
            return
        job_id, path = taken.claimed
        state = JobState.PENDING if path.parent.name == JobState.PENDING.value else JobState.FAILED
        job = self.state.jobs.get(job_id) or Job(job_id, state, path, dict(taken.run or {}, id=job_id))
        self.guard.job_failed_in(job, "admit", exc)

    def _known_awaiting(self, cand) -> bool:
        """A file already found valid but unapproved, unchanged since: nothing to do."""
        sig = (cand.size, cand.mtime_ns, cand.ino)
        cached = self._awaiting.get(cand.name)
        return (cached is not None and cached[0] == sig) or self._unclaimable.get(cand.name) == sig

    def _taken(self, cands: list, now: float):
        """(candidate, _Taken) in drop order: each file validated and, unless it awaits approval, claimed.

        Acceptance order is fixed here, in drop order, before any work starts; then one file at a time, on the
        loop's thread. Two threads used to validate and claim a burst, so that claims (filesystem calls that
        release the GIL) overlapped the next file's validation; on two cores the hand-offs cost more than the
        overlap gave: a 10,000-file burst took 14.9 s with them and 9.8 s without, and a trivial job 0.5 ms
        more of the watcher's CPU (docs/benchmarks.md).
        """
        orders = [self.state.next_order() for _ in cands]
        return ((c, self._take(c, order, now)) for c, order in zip(cands, orders, strict=False))

    def _take(self, cand, order: int, now: float) -> _Taken:
        """Validate one inbox file and claim it into pending/ (or failed/ when invalid); any thread.

        The admit step's guard: a full disk is reported back; anything unexpected rejects the file.
        """
        try:
            self.guard.faults.check("admit", id_from_name(cand.name))
            return self._take_unguarded(cand, order, now)
        except Exception as exc:
            if is_disk_full(exc):
                return _Taken(None, disk_full=exc)
            return self._reject_internal(cand, order, now, exc)

    def _reject_internal(self, cand, order: int, now: float, exc: Exception) -> _Taken:
        """Admitting ``cand`` raised: reject it with the exception as its error (traceback in watcher.log)."""
        logger.error(
            "inbox/%s: internal error while admitting it; rejecting the file",
            cand.name,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        problem = Problem(
            "",
            f"internal error while admitting this file ({type(exc).__name__}: {exc}); see watcher.log, and report it",
        )
        result = InvalidJobSpec(f"inbox/{cand.name}", [problem])
        run = new_run(None, order, now, name=_stem(cand.name))
        run.update(status="rejected", finished_at=iso_utc(now), errors=[problem.to_dict()], error=result.lines()[0])
        try:
            return _Taken(result, run, self.state.folders.claim(cand.path, JobState.FAILED, run))
        except Exception as exc2:
            if is_disk_full(exc2):
                return _Taken(None, disk_full=exc2)
            logger.error("inbox/%s: could not reject it either (%s); leaving it in the inbox", cand.name, exc2)
            return _Taken(None, unclaimable=True)

    def _take_unguarded(self, cand, order: int, now: float) -> _Taken:
        result = self._validate(cand)
        if result is None or (isinstance(result, JobSpec) and (not result.approved or result.sweep)):
            return _Taken(result)  # a sweep is claimed on the loop's thread (workflows.py)
        if isinstance(result, InvalidJobSpec) and self._maybe_unfinished(cand):
            return _Taken(result, unfinished=True)  # read again once it stood still, before it is rejected
        if isinstance(result, InvalidJobSpec):
            run = new_run(None, order, now, name=_stem(printable_name(cand.name)))
            run.update(
                status="rejected",
                finished_at=iso_utc(now),
                errors=[p.to_dict() for p in result.problems],
                error=result.lines()[0] if result.problems else "invalid job file",
            )
            return _Taken(result, run, self.state.folders.claim(cand.path, JobState.FAILED, run))
        run = new_run(result, order, now, name=_stem(printable_name(cand.name)))
        run["submitted_from"] = base_of(result, self.state.root.path)
        if result.fork_of:
            run["lineage"] = self.workflows.lineage_of(result.fork_of)
        if result.rerun_of:
            run["lineage"] = self.workflows.lineage_of(result.rerun_of, "rerun_of")
        return _Taken(result, run, self.state.folders.claim(cand.path, JobState.PENDING, run))

    def _validate(self, cand) -> JobSpec | InvalidJobSpec | None:
        """The file's JobSpec, the InvalidJobSpec listing its problems, or None when it vanished."""
        display = f"inbox/{printable_name(cand.name)}"
        bad_name = name_problem(cand.name)
        if bad_name is not None:
            return InvalidJobSpec(display, [bad_name])
        try:
            spec = load_job_file(cand.path, display)
            self.state.check_allowed(spec, display, cand.name)
            check_submission(spec, display, time.time())
            self.state.check_pool(spec, display, self.state.root.job_dir(JobState.PENDING, id_from_name(cand.name)))
        except InvalidJobSpec as exc:
            return exc
        except FileNotFoundError:
            return None
        return spec

    def _maybe_unfinished(self, cand) -> bool:
        """Written less than settle_s ago and not renamed in: a writer may still be appending to it."""
        return cand.name not in self._inbox.moved_in and not self._inbox.is_still(cand, time.time())

    def _admit_one(self, cand, taken: _Taken, now: float) -> None:
        result = taken.result
        if taken.unclaimable:
            self._unclaimable[cand.name] = (cand.size, cand.mtime_ns, cand.ino)
        if result is None:
            return
        if taken.unfinished:
            self._inbox.hold_back(cand)
            logger.debug("inbox/%s: not valid yet, written a moment ago; read again once it stands still", cand.name)
        elif isinstance(result, InvalidJobSpec):
            self._rejected(cand, taken, result, now)
        elif not result.approved:
            if self._maybe_unfinished(cand):
                self._inbox.hold_back(cand)  # lines may still be coming (approved: true among them)
            sig = (cand.size, cand.mtime_ns, cand.ino)
            self._awaiting[cand.name] = (sig, {"name": cand.name, "spec": result, "seen_at": now})
        elif result.sweep:
            self.workflows.admit_sweep(cand, result, now, self._forget)
        else:
            self._accepted(cand, taken, result, now)

    def _accepted(self, cand, taken: _Taken, spec: JobSpec, now: float) -> None:
        self._awaiting.pop(cand.name, None)
        self._inbox.taken(cand.name)
        if taken.claimed is None:
            return  # it vanished meanwhile
        job_id, path = taken.claimed
        run = cast(dict, taken.run)  # a claimed file has its run.json
        run["id"] = job_id
        job = Job(job_id, JobState.PENDING, path, run, spec, spec_sig=(cand.size, cand.mtime_ns, cand.ino))
        self.state.jobs.add(job)
        records.accepted(job.paths, run, cand.name, cand.mtime_ns / 1e9, now)
        logger.info("job %s: inbox/%s -> pending (priority %d)", job_id, printable_name(cand.name), spec.priority)
        self.state.report.touch()
        self.workflows.admit_workflow(job, now)

    def _rejected(self, cand, taken: _Taken, invalid: InvalidJobSpec, now: float) -> None:
        self._inbox.taken(cand.name)
        self._awaiting.pop(cand.name, None)
        if taken.claimed is None:
            return
        job_id, path = taken.claimed
        run = cast(dict, taken.run)  # a claimed file has its run.json
        run["id"] = job_id
        for line in invalid.lines():
            logger.warning("job %s: rejected: %s", job_id, line)
        records.rejected(JobPaths(path), run, cand.name, cand.mtime_ns / 1e9, now)
        logger.info("job %s: inbox/%s -> failed, rejected", job_id, printable_name(cand.name))
        self.state.report.finished(Job(job_id, JobState.FAILED, path, run, None), now)
        self.state.deps.finished[job_id] = "rejected"
        self.workflows.deps_changed(job_id, now)


@dataclass
class _Taken:
    """What ``Watcher._take`` did with one inbox file."""

    result: JobSpec | InvalidJobSpec | None
    run: dict | None = None
    claimed: tuple[str, Path] | None = None  # (id, folder), None when the file vanished or was not claimed
    disk_full: OSError | None = None  # claiming it ran out of space (the file stays in the inbox)
    unclaimable: bool = False  # admitting it failed, and so did rejecting it
    unfinished: bool = False  # invalid, but written a moment ago: held back until it stands still


def _is_heavy(cand) -> bool:
    """A file whose validation may take long: big, or a sweep (every combination is checked)."""
    if cand.is_symlink:
        return False  # refused at once, unread
    if cand.size >= HEAVY_FILE_BYTES:
        return True
    try:
        fd = os.open(cand.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return _SWEEP_WORD in os.read(fd, HEAVY_FILE_BYTES)
    except OSError:
        return False
    finally:
        os.close(fd)


def _changed(cand) -> bool:
    """The inbox file is not the one ``cand`` saw (written again, replaced or gone)."""
    try:
        st = os.stat(cand.path, follow_symlinks=False)
    except OSError:
        return True
    return (st.st_size, st.st_mtime_ns, st.st_ino) != (cand.size, cand.mtime_ns, cand.ino)


def _stem(file_name: str) -> str:
    """``lora.yaml`` → ``lora``: the display name of a job without ``name:``."""
    stem, dot, suffix = file_name.rpartition(".")
    return stem if dot and suffix.lower() in ("yaml", "yml") and stem else file_name


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
    if job.held and not job.known_spec.after:
        edits.state.jobs.release(job)
        job.run["waiting_for"] = None
    if job.known_spec.after:
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
