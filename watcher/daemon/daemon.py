"""``Watcher.run()`` and ``Watcher.tick(now)``: the loop that wires the loop's steps together.

One pass of ``tick`` reads like a table of contents: reap_finished → honor_job_flags →
admit_inbox → start_pending → watch_running → write status. Tests call ``tick`` directly.
Each step is an object the Watcher builds and owns, given what it reads and changes (its class
docstring says which): ``Intake`` (below: inbox files validated, claimed, rejected), ``Starting``
(starting.py), ``Finishing`` (finishing.py: attempts' ends, retries, flags), ``Workflows``
(workflows.py), ``Containment`` (containment.py: the per-job guard), ``DiskFullHandling``
(diskfull.py), ``Walls`` (walls.py), ``Vitals`` (vitals.py) and ``PendingEdits`` (pending_edits.py).
What several steps share (the job index, folders, report, config, executor) is one ``LoopState``
(state.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trainq.watcher import __version__
from trainq.watcher.daemon import records
from trainq.watcher.daemon.containment import (
    ENV_WATCHER_CRASH,
    ENV_WATCHER_FAULTS,
    Containment,
    CrashPoints,
    Faults,
)
from trainq.watcher.daemon.diskfull import DISK_FULL_RETRY_S, DiskFull, DiskFullHandling, is_disk_full, take_reserve
from trainq.watcher.daemon.executor import Executor, make_executor
from trainq.watcher.daemon.finishing import RUNNING_POLL_S, Finishing
from trainq.watcher.daemon.inbox import (
    Inbox,
    InboxEvents,
    name_problem,
    printable_name,
    schedule,
    start_observer,
)
from trainq.watcher.daemon.jobs import Job, JobIndex, new_run
from trainq.watcher.daemon.pending_edits import PendingEdits
from trainq.watcher.daemon.recovery import recover
from trainq.watcher.daemon.report import Report
from trainq.watcher.daemon.resources import ResourceProbe
from trainq.watcher.daemon.starting import Starting
from trainq.watcher.daemon.state import LoopState
from trainq.watcher.daemon.vitals import Vitals
from trainq.watcher.daemon.walls import Walls
from trainq.watcher.daemon.workflows import Workflows
from trainq.watcher.spec.config import WatcherConfig
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import InvalidJobSpec, Problem, QueueLayoutError, QueueLocked
from trainq.watcher.spec.folders import Folders, JobState, QueueRoot, id_from_name
from trainq.watcher.spec.fsutil import drain, remove_quietly
from trainq.watcher.spec.jobspec import JobSpec, check_submission, load_job_file
from trainq.watcher.spec.pools import paused_pools
from trainq.watcher.spec.units import iso_utc
from trainq.watcher.supervisor.signals import install_watcher_signal_handlers

logger = logging.getLogger(__name__)

#: how many inbox files one tick takes at most, so status stays fresh during a 10,000-file burst
ADMIT_BATCH = 2000
#: from this many ready files on, validation and claims run on a small thread pool
PARALLEL_VALIDATE_MIN = 16
#: threads that validate and claim a burst
ADMIT_THREADS = 2
#: pause after an error no job's guard caught, so a repeating one does not spin the CPU, seconds
LOOP_ERROR_PAUSE_S = 0.5


class Watcher:
    """The daemon: owns the queue root while it runs, builds the loop's steps and calls them in order."""

    def __init__(self, root: Path, config: WatcherConfig, *, polling: bool = False, env: dict | None = None):
        self.root = QueueRoot(Path(root).resolve())
        self.config = config
        self.polling = polling
        self.env = dict(os.environ if env is None else env)
        folders = Folders(self.root)
        executor = make_executor(config, self.root.path)
        probe = ResourceProbe(simulate_gpus=config.simulate_gpus, env=self.env)
        faults = Faults.parse(self.env.get(ENV_WATCHER_FAULTS))  # a test switch (README, "Switches")
        crashes = CrashPoints.parse(self.env.get(ENV_WATCHER_CRASH))  # a test switch (docs/reliability.md)
        self.report = Report(self.root, config, started_at=time.time())
        self.state = LoopState(self.root, config, self.env, folders, executor, probe, self.report, self.wake)
        self.stopping = False
        self._loop_errors: dict[str, int] = {}  # errors outside any job's guard, by text: how often
        self._lock_fd: int | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._observer = None
        self._signals = None
        self._last_rescan = 0.0
        self.disk = DiskFullHandling(self.root, self.report)
        self.guard = Containment(self.state, self.disk, faults, retire=self._retire, deps_changed=self._deps_changed)
        self.workflows = Workflows(self.state, self.guard, retire=self._retire)
        self.walls = Walls(self.state, self.guard)
        self.vitals = Vitals(executor, self.report)
        self.finishing = Finishing(self.state, self.guard, self.disk, self.workflows, self.walls, self.vitals, crashes)
        self.edits = PendingEdits(self.state, self.guard, self.workflows, retire=self._retire)
        self.starting = Starting(
            self.state, self.guard, self.disk, self.finishing, self.workflows, self.walls, self.edits, crashes
        )
        self.intake = Intake(self.state, self.guard, self.disk, self.workflows)

    # -- what the report and the command line read ------------------------------------------
    @property
    def jobs(self) -> JobIndex:
        """The live jobs (pending and running)."""
        return self.state.jobs

    @property
    def executor(self) -> Executor:
        """Where attempts run (this machine, or Slurm)."""
        return self.state.executor

    @property
    def probe(self) -> ResourceProbe:
        """The machine's free GPUs, RAM and disk."""
        return self.state.probe

    @property
    def paused(self) -> bool:
        """pause.flag at the root: nothing new starts."""
        return self.state.paused

    @property
    def disk_full(self) -> DiskFull | None:
        """The DiskFull while writes fail for lack of space, else None."""
        return self.disk.disk_full

    @property
    def inbox(self) -> Inbox | None:
        """The inbox being watched (None before ``start``)."""
        return self.intake.inbox

    def problems(self) -> list[str]:
        """What is wrong with the watcher itself, one line each (status.json ``watcher.problems``)."""
        return self.disk.problems()

    def window_now(self, now: float) -> dict | None:
        """status.json's ``window`` (walls.py)."""
        return self.walls.window_now(now)

    def cost_now(self, now: float) -> dict | None:
        """status.json's ``cost`` (walls.py)."""
        return self.walls.cost_now(now)

    def holding(self, job: Job):
        """What a running job holds, as admission counts it (starting.py)."""
        return self.starting.holding(job)

    # -- where the steps meet: a retired job tells workflows, and workflows retires the jobs it ends -----
    def _retire(self, job: Job, now: float) -> None:
        self.finishing.retire(job, now)

    def _deps_changed(self, job_id: str, now: float) -> None:
        self.workflows.deps_changed(job_id, now)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, *, install_signals: bool = True) -> None:
        """Take the root, recover what a previous watcher left, start watching the inbox."""
        self.root.ensure_layout(create=True)
        self.root.check_single_filesystem()
        self._take_root_lock()
        self._take_reserve()
        remove_quietly(self.root.stop_flag)
        events = InboxEvents(self.root.inbox, self.wake, flags=(self.root.stop_flag, self.root.pause_flag))
        self.intake.inbox = Inbox(self.root.inbox, self.config.settle_s, events)
        self._observer = start_observer(self.root.inbox, self.root.path, events, self.polling)
        if install_signals:
            self._signals = install_watcher_signal_handlers(self._wake_w)
        self.executor.start()
        self._recover()
        logger.info("watcher %d: watching %s (trainq %s)", os.getpid(), self.root.path, __version__)

    def _recover(self) -> None:
        recover(self.state, self.guard, self.workflows, self.finishing)

    def close(self) -> None:
        """Stop watching; running jobs keep running (a later watcher re-adopts them)."""
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
            self._observer = None
        if self.disk.disk_full is None:  # else the next watcher's recover() finishes from the folders
            self.finishing.retire_concluded(time.time())
            self.finishing.save_started(time.time(), all_now=True)
        try:
            self.write_status(time.time(), force=True, state="stopped")
        except Exception as exc:
            logger.error("watcher: could not write the final status.json: %s", exc)
        self.probe.close()
        self.workflows.hooks.close()
        self.executor.close()
        self.intake.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        logger.info(
            "watcher %d: stopped; %d running job(s) keep running", os.getpid(), self.jobs.count(JobState.RUNNING)
        )

    def run(self) -> None:
        """Repeat ``tick`` until SIGINT/SIGTERM or the root's stop.flag."""
        while not self._should_exit():
            now = time.time()
            try:
                self.tick(now)
            except QueueLayoutError as exc:
                logger.error("watcher: %s", exc)
            except Exception as exc:
                self._loop_failed(exc)
            self._wait(self._next_wait_s())

    def _loop_failed(self, exc: Exception) -> None:
        """An error outside every job's guard: log it (the traceback once per kind), pause a moment, go on."""
        if is_disk_full(exc):
            self.disk.note_disk_full(exc, "the loop")
            return
        key = f"{type(exc).__name__}: {exc}"[:300]
        seen = self._loop_errors.get(key, 0)
        self._loop_errors[key] = seen + 1
        if seen == 0:
            logger.error("watcher: internal error outside any one job; the loop goes on", exc_info=exc)
        elif seen % 60 == 0:
            logger.error("watcher: the same internal error again (%d times): %s", seen + 1, key)
        time.sleep(LOOP_ERROR_PAUSE_S)  # the next pass should not spin on the same error

    def _should_exit(self) -> bool:
        return self.stopping or bool(self._signals and self._signals.stop_requested)

    def wake(self) -> None:
        """Wake the loop now (called from the observer thread)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _wait(self, timeout_s: float) -> None:
        wake_fds = [self._wake_r, *self.executor.wake_fds()]  # the spawner helper says when a job ended
        readable, _, _ = select.select(wake_fds, [], [], max(0.0, timeout_s))
        if self._wake_r in readable:
            drain(self._wake_r)

    def _next_wait_s(self) -> float:
        wait = min(self.config.rescan_s, self.config.status_s, DISK_FULL_RETRY_S)
        held_back = self.inbox.next_due_s() if self.inbox is not None else None
        if held_back is not None:
            wait = min(wait, held_back)
        if self.jobs.count(JobState.RUNNING):
            wait = min(wait, RUNNING_POLL_S)
            save_in = self.finishing.next_started_save_s(time.time())
            if save_in is not None:
                wait = min(wait, save_in)
        return wait

    def _take_reserve(self) -> None:
        try:
            take_reserve(self.root.reserve_file)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self.disk.note_disk_full(exc, self.root.reserve_file.name)

    def _take_root_lock(self) -> None:
        fd = os.open(self.root.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip()
            os.close(fd)
            raise QueueLocked(str(self.root.path), int(holder) if holder.isdigit() else None) from None
        except OSError as exc:  # ENOLCK, EOPNOTSUPP: a shared filesystem without (working) flock
            logger.warning(
                "cannot flock %s (%s): nothing stops a second watcher on this queue root; run only one",
                self.root.lock_file,
                exc.strerror,
            )
        self._lock_fd = fd
        pid = f"{os.getpid()}\n".encode()
        try:  # over the old bytes first: on a full disk that needs no new block
            os.pwrite(fd, pid, 0)
            os.ftruncate(fd, len(pid))
        except OSError as exc:  # the pid is only for the "locked by" message; a full disk must not stop us
            if not is_disk_full(exc):
                raise

    # -- the loop --------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """One pass over the queue; with a full disk only watching, and retrying until space frees."""
        self.executor.reap()
        self.check_layout()
        self.honor_root_flags()
        if self.disk.disk_full is not None:
            self.disk.retry_after_disk_full(now, self, self.rebuild_from_disk)
        if self.disk.disk_full is None:
            self._work(now)
        else:
            self.finishing.watch_running(now)
        self.workflows.hooks.reap()
        self.write_status(now)

    def _work(self, now: float) -> None:
        self.finishing.reap_finished(now)
        rescan = now - self._last_rescan >= self.config.rescan_s
        if rescan and self.disk.disk_full is None:
            self._last_rescan = now
            self.finishing.honor_job_flags(now)
            self.workflows.recheck_unknown(now)
            self.edits.check(now)
        try:
            if self.disk.disk_full is None:
                self.intake.admit_inbox(now)
                self.keep_status_fresh()
            if self.disk.disk_full is None:
                # before retiring: the next job need not wait for the last one's writes
                self.starting.start_pending(now)
                self.keep_status_fresh()
        finally:
            self.finishing.retire_concluded(now)
        if self.workflows.deps_released and self.disk.disk_full is None:
            self._start_released(now)
        self.finishing.watch_running(now)
        self.walls.keep_walls(now)

    def _start_released(self, now: float) -> None:
        """Dependents released by a job retired in this pass start in this same pass (a chain: one link a pass)."""
        self.workflows.deps_released = False
        try:
            self.starting.start_pending(now)
        finally:
            self.finishing.retire_concluded(now)

    def keep_status_fresh(self) -> None:
        """status.json between the steps of a long pass (a burst admitted, a thousand sbatch answers taken), so
        its heartbeat is never a whole pass old; a no-op unless a write is due (status_s, heartbeat_s)."""
        if self.disk.disk_full is None:
            try:
                self.write_status(time.time())
            except Exception:
                logger.debug("status.json between steps could not be written", exc_info=True)

    def write_status(self, now: float, *, force: bool = False, state: str | None = None) -> None:
        """status.json and status.html; a full disk is noted, not raised."""
        try:
            self.report.write(self, now, force=force, state=state)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self.disk.note_disk_full(exc, "status.json")

    def rebuild_from_disk(self) -> None:
        """Forget the in-memory index and read it again from the folders (after a full disk)."""
        self.state.jobs = JobIndex()
        self.workflows.reset()  # rebuilt from job.yaml files by recover(), as at start-up
        self.state.concluded = []
        self.intake.forget_awaiting()
        self.state.plan_due = True
        self._recover()

    def check_layout(self) -> None:
        """Recreate queue folders a user deleted, instead of crash-looping."""
        created = self.root.ensure_layout(create=True)
        for folder in created:
            logger.warning("queue: %s was missing; recreated it", folder)
        if self.root.inbox in created and self._observer is not None:
            self._observer.unschedule_all()
            schedule(self._observer, self.root.inbox, self.root.path, self.inbox.events)
        if any(f != self.root.inbox for f in created):
            self._forget_vanished_jobs()

    def _forget_vanished_jobs(self) -> None:
        for job in list(self.jobs.values()):
            if not job.dir.exists():
                logger.warning("job %s: its folder %s vanished; forgetting it", job.id, job.dir)
                self.finishing.drop(job)

    def honor_root_flags(self) -> None:
        """``stop.flag`` at the root: exit (jobs keep running); ``pause.flag``: start nothing new."""
        if self.root.stop_flag.exists():
            remove_quietly(self.root.stop_flag)
            logger.info("watcher %d: stop.flag found; exiting, running jobs keep running", os.getpid())
            self.stopping = True
        paused = self.root.pause_flag.exists()
        if paused != self.state.paused:
            logger.info("watcher %d: %s", os.getpid(), "paused (pause.flag)" if paused else "resumed")
            self.state.paused = paused
            self.state.plan_due = True
            self.report.touch()
        pools = paused_pools(self.root.path)
        if pools != self.state.paused_pools:
            logger.info("watcher %d: paused pools: %s", os.getpid(), ", ".join(sorted(pools)) or "none")
            self.state.paused_pools = pools
            self.state.plan_due = True
            self.report.touch()


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

    def close(self) -> None:
        """Stop the threads that validate a burst."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def forget_awaiting(self) -> None:
        """Forget the files found awaiting approval (read again on the next pass)."""
        self._awaiting.clear()

    def _forget(self, name: str) -> None:
        """The inbox file ``name`` was taken: the inbox and the awaiting list forget it."""
        self.inbox.taken(name)
        self._awaiting.pop(name, None)

    def admit_inbox(self, now: float) -> None:
        """Validate every complete inbox file: accept, reject, or leave it awaiting approval."""
        candidates = self.inbox.scan()
        self.state.report.inbox_seen(candidates, self.inbox.ignored)
        todo = [c for c in self.inbox.ready(candidates, now) if not self._known_awaiting(c)]
        if len(todo) > ADMIT_BATCH:
            todo = todo[:ADMIT_BATCH]
            self.state.wake()  # the rest next pass, so status.json stays fresh during a burst
        for cand, taken in self._taken(todo, now):
            if taken.disk_full is not None:
                self.disk.note_disk_full(taken.disk_full, f"inbox/{cand.name}")
                continue
            try:
                self._admit_one(cand, taken, now)
            except Exception as exc:
                self._contain_admitted(cand, taken, exc)
        live = {c.name for c in candidates}
        for name in [n for n in self._awaiting if n not in live]:
            del self._awaiting[name]
        for name in [n for n in self._unclaimable if n not in live]:
            del self._unclaimable[name]
        self.state.report.awaiting(self._awaiting)

    def _contain_admitted(self, cand, taken: _Taken, exc: Exception) -> None:
        if taken.claimed is None:
            logger.error(
                "inbox/%s: internal error while admitting it", cand.name, exc_info=(type(exc), exc, exc.__traceback__)
            )
            return
        job_id, path = taken.claimed
        state = JobState.PENDING if path.parent.name == JobState.PENDING.value else JobState.FAILED
        job = self.state.jobs.get(job_id) or Job(job_id, state, path, dict(taken.run, id=job_id))
        self.guard.job_failed_in(job, "admit", exc)

    def _known_awaiting(self, cand) -> bool:
        """A file already found valid but unapproved, unchanged since: nothing to do."""
        sig = (cand.size, cand.mtime_ns, cand.ino)
        cached = self._awaiting.get(cand.name)
        return (cached is not None and cached[0] == sig) or self._unclaimable.get(cand.name) == sig

    def _taken(self, cands: list, now: float):
        """(candidate, _Taken) in drop order: each file validated and, unless it awaits approval, claimed.

        Acceptance order is fixed here, in drop order, before any work starts. A burst is then
        validated and claimed on ADMIT_THREADS threads: claims are filesystem calls (mkdir,
        create, link, unlink) that release the GIL, so they overlap with the next file's
        validation. The index, the report and the inbox's bookkeeping stay on the loop's thread.
        """
        orders = [self.state.next_order() for _ in cands]
        if len(cands) < PARALLEL_VALIDATE_MIN:
            return ((c, self._take(c, order, now)) for c, order in zip(cands, orders, strict=False))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=ADMIT_THREADS, thread_name_prefix="trainq-admit")
        return zip(cands, self._pool.map(self._take, cands, orders, [now] * len(cands)), strict=False)

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
            self.state.check_pool(spec, display)
        except InvalidJobSpec as exc:
            return exc
        except FileNotFoundError:
            return None
        return spec

    def _maybe_unfinished(self, cand) -> bool:
        """Written less than settle_s ago and not renamed in: a writer may still be appending to it."""
        return cand.name not in self.inbox.moved_in and not self.inbox.is_still(cand, time.time())

    def _admit_one(self, cand, taken: _Taken, now: float) -> None:
        result = taken.result
        if taken.unclaimable:
            self._unclaimable[cand.name] = (cand.size, cand.mtime_ns, cand.ino)
        if result is None:
            return
        if taken.unfinished:
            self.inbox.hold_back(cand)
            logger.debug("inbox/%s: not valid yet, written a moment ago; read again once it stands still", cand.name)
        elif isinstance(result, InvalidJobSpec):
            self._rejected(cand, taken, now)
        elif not result.approved:
            if self._maybe_unfinished(cand):
                self.inbox.hold_back(cand)  # lines may still be coming (approved: true among them)
            sig = (cand.size, cand.mtime_ns, cand.ino)
            self._awaiting[cand.name] = (sig, {"name": cand.name, "spec": result, "seen_at": now})
        elif result.sweep:
            self.workflows.admit_sweep(cand, result, now, self._forget)
        else:
            self._accepted(cand, taken, now)

    def _accepted(self, cand, taken: _Taken, now: float) -> None:
        self._awaiting.pop(cand.name, None)
        self.inbox.taken(cand.name)
        if taken.claimed is None:
            return  # it vanished meanwhile
        job_id, path = taken.claimed
        taken.run["id"] = job_id
        job = Job(
            job_id, JobState.PENDING, path, taken.run, taken.result, spec_sig=(cand.size, cand.mtime_ns, cand.ino)
        )
        self.state.jobs.add(job)
        records.accepted(job.paths, taken.run, cand.name, cand.mtime_ns / 1e9, now)
        logger.info(
            "job %s: inbox/%s -> pending (priority %d)", job_id, printable_name(cand.name), taken.result.priority
        )
        self.state.report.touch()
        self.workflows.admit_workflow(job, now)

    def _rejected(self, cand, taken: _Taken, now: float) -> None:
        self.inbox.taken(cand.name)
        self._awaiting.pop(cand.name, None)
        if taken.claimed is None:
            return
        job_id, path = taken.claimed
        taken.run["id"] = job_id
        for line in taken.result.lines():
            logger.warning("job %s: rejected: %s", job_id, line)
        records.rejected(JobPaths(path), taken.run, cand.name, cand.mtime_ns / 1e9, now)
        logger.info("job %s: inbox/%s -> failed, rejected", job_id, printable_name(cand.name))
        self.state.report.finished(Job(job_id, JobState.FAILED, path, taken.run, None), now)
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


def _stem(file_name: str) -> str:
    """``lora.yaml`` → ``lora``: the display name of a job without ``name:``."""
    stem, dot, suffix = file_name.rpartition(".")
    return stem if dot and suffix.lower() in ("yaml", "yml") and stem else file_name
