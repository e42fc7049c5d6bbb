"""``Watcher.run()`` and ``Watcher.tick(now)``: the loop that wires the other modules together.

One pass of ``tick`` reads like a table of contents: reap_finished → honor_job_flags →
admit_inbox → start_pending → watch_running → write status. Tests call ``tick`` directly.
Starting lives in starting.py, finishing, retries and flags in finishing.py (mixins of Watcher).
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
from trainq.watcher.daemon.containment import ENV_WATCHER_FAULTS, Containment, Faults, is_disk_full
from trainq.watcher.daemon.crashpoints import ENV_WATCHER_CRASH, CrashPoints
from trainq.watcher.daemon.diskfull import DISK_FULL_RETRY_S, DiskFullHandling, take_reserve
from trainq.watcher.daemon.executor import make_executor
from trainq.watcher.daemon.finishing import RUNNING_POLL_S, Finishing
from trainq.watcher.daemon.inbox import Inbox, InboxEvents, name_problem, printable_name, schedule, start_observer
from trainq.watcher.daemon.jobs import Job, JobIndex, new_run
from trainq.watcher.daemon.pending_edits import PendingEdits
from trainq.watcher.daemon.recovery import recover
from trainq.watcher.daemon.report import Report
from trainq.watcher.daemon.resources import ResourceProbe
from trainq.watcher.daemon.starting import Starting
from trainq.watcher.daemon.vitals import Vitals
from trainq.watcher.daemon.walls import Walls
from trainq.watcher.daemon.workflows import Workflows
from trainq.watcher.spec.config import WatcherConfig, check_command_allowed
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import InvalidJobSpec, Problem, QueueLayoutError, QueueLocked
from trainq.watcher.spec.folders import Folders, JobState, QueueRoot, id_from_name
from trainq.watcher.spec.fsutil import drain, remove_quietly
from trainq.watcher.spec.interpreter import job_path
from trainq.watcher.spec.jobspec import JobSpec, check_submission, load_job_file
from trainq.watcher.spec.pools import paused_pools, unknown_pool_words
from trainq.watcher.spec.ranks import nodes_problem
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


class Watcher(Starting, Finishing, Workflows, Containment, DiskFullHandling, Walls, Vitals):
    """The daemon: owns the queue root while it runs."""

    def __init__(self, root: Path, config: WatcherConfig, *, polling: bool = False, env: dict | None = None):
        self.root = QueueRoot(Path(root).resolve())
        self.config = config
        self.polling = polling
        self.env = dict(os.environ if env is None else env)
        self.folders = Folders(self.root)
        self.executor = make_executor(config, self.root.path)
        self.probe = ResourceProbe(simulate_gpus=config.simulate_gpus, env=self.env)
        self.jobs = JobIndex()
        self.faults = Faults.parse(self.env.get(ENV_WATCHER_FAULTS))  # a test switch (README, "Switches")
        self.crashes = CrashPoints.parse(self.env.get(ENV_WATCHER_CRASH))  # a test switch (docs/reliability.md)
        self.disk_full = None  # a DiskFull while writes fail for lack of space (diskfull.py)
        self.report = Report(self.root, config, started_at=time.time())
        self.inbox: Inbox | None = None
        self.paused = False
        self.paused_pools: set[str] = set()  # pause.POOL.flag at the root (CONTRACT section 14)
        self.stopping = False
        self._awaiting: dict[str, tuple[tuple, dict]] = {}
        self._unclaimable: dict[str, tuple] = {}
        self._loop_errors: dict[
            str, int
        ] = {}  # errors outside any job's guard, by text: how often  # inbox files not even rejectable (a second fault): name -> signature
        self._concluded: list = []  # (Job, Outcome) out of the live index, final write pending (finishing.py)
        self._order_last = 0
        self._lock_fd: int | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._observer = None
        self._signals = None
        self._pool: ThreadPoolExecutor | None = None
        self._last_rescan = 0.0
        self._last_running_poll = 0.0
        self._plan_due = True
        self._last_plan = 0.0
        self.init_workflows()
        self.pending_edits = PendingEdits()
        self.init_walls()
        self.init_vitals()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, *, install_signals: bool = True) -> None:
        """Take the root, recover what a previous watcher left, start watching the inbox."""
        self.root.ensure_layout(create=True)
        self.root.check_single_filesystem()
        self._take_root_lock()
        self._take_reserve()
        remove_quietly(self.root.stop_flag)
        events = InboxEvents(self.root.inbox, self.wake, flags=(self.root.stop_flag, self.root.pause_flag))
        self.inbox = Inbox(self.root.inbox, self.config.settle_s, events)
        self._observer = start_observer(self.root.inbox, self.root.path, events, self.polling)
        if install_signals:
            self._signals = install_watcher_signal_handlers(self._wake_w)
        self.executor.start()
        recover(self)
        logger.info("watcher %d: watching %s (trainq %s)", os.getpid(), self.root.path, __version__)

    def close(self) -> None:
        """Stop watching; running jobs keep running (a later watcher re-adopts them)."""
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
            self._observer = None
        if self.disk_full is None:  # else the next watcher's recover() finishes from the folders
            self.retire_concluded(time.time())
            self._save_started(time.time(), all_now=True)
        try:
            self.write_status(time.time(), force=True, state="stopped")
        except Exception as exc:
            logger.error("watcher: could not write the final status.json: %s", exc)
        self.probe.close()
        self.hooks.close()
        self.executor.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        logger.info("watcher %d: stopped; %d running job(s) keep running", os.getpid(), self._count(JobState.RUNNING))

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
            self.note_disk_full(exc, "the loop")
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
        if self._count(JobState.RUNNING):
            wait = min(wait, RUNNING_POLL_S)
            save_in = self._next_started_save_s(time.time())
            if save_in is not None:
                wait = min(wait, save_in)
        return wait

    def _take_reserve(self) -> None:
        try:
            take_reserve(self.root.reserve_file)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self.note_disk_full(exc, self.root.reserve_file.name)

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
        if self.disk_full is not None:
            self.retry_after_disk_full(now)
        if self.disk_full is None:
            self._work(now)
        else:
            self.watch_running(now)
        self.hooks.reap()
        self.write_status(now)

    def _work(self, now: float) -> None:
        self.reap_finished(now)
        rescan = now - self._last_rescan >= self.config.rescan_s
        if rescan and self.disk_full is None:
            self._last_rescan = now
            self.honor_job_flags(now)
            self.recheck_unknown(now)
            self.pending_edits.check(self, now)
        try:
            if self.disk_full is None:
                self.admit_inbox(now)
                self.keep_status_fresh()
            if self.disk_full is None:
                self.start_pending(now)  # before retiring: the next job need not wait for the last one's writes
                self.keep_status_fresh()
        finally:
            self.retire_concluded(now)
        if self.deps_released and self.disk_full is None:
            self._start_released(now)
        self.watch_running(now)
        self.keep_walls(now)

    def _start_released(self, now: float) -> None:
        """Dependents released by a job retired in this pass start in this same pass (a chain: one link a pass)."""
        self.deps_released = False
        try:
            self.start_pending(now)
        finally:
            self.retire_concluded(now)

    def keep_status_fresh(self) -> None:
        """status.json between the steps of a long pass (a burst admitted, a thousand sbatch answers taken), so
        its heartbeat is never a whole pass old; a no-op unless a write is due (status_s, heartbeat_s)."""
        if self.disk_full is None:
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
            self.note_disk_full(exc, "status.json")

    def rebuild_from_disk(self) -> None:
        """Forget the in-memory index and read it again from the folders (after a full disk)."""
        self.jobs = JobIndex()
        self.deps = type(self.deps)()  # rebuilt from job.yaml files by recover(), as at start-up
        self._deps_queue = []
        self._concluded = []
        self._awaiting.clear()
        self._plan_due = True
        recover(self)

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
                self._drop(job)

    def honor_root_flags(self) -> None:
        """``stop.flag`` at the root: exit (jobs keep running); ``pause.flag``: start nothing new."""
        if self.root.stop_flag.exists():
            remove_quietly(self.root.stop_flag)
            logger.info("watcher %d: stop.flag found; exiting, running jobs keep running", os.getpid())
            self.stopping = True
        paused = self.root.pause_flag.exists()
        if paused != self.paused:
            logger.info("watcher %d: %s", os.getpid(), "paused (pause.flag)" if paused else "resumed")
            self.paused = paused
            self._plan_due = True
            self.report.touch()
        pools = paused_pools(self.root.path)
        if pools != self.paused_pools:
            logger.info("watcher %d: paused pools: %s", os.getpid(), ", ".join(sorted(pools)) or "none")
            self.paused_pools = pools
            self._plan_due = True
            self.report.touch()

    # -- the inbox ---------------------------------------------------------------------------
    def admit_inbox(self, now: float) -> None:
        """Validate every complete inbox file: accept, reject, or leave it awaiting approval."""
        candidates = self.inbox.scan()
        self.report.inbox_seen(candidates, self.inbox.ignored)
        todo = [c for c in self.inbox.ready(candidates, now) if not self._known_awaiting(c)]
        if len(todo) > ADMIT_BATCH:
            todo = todo[:ADMIT_BATCH]
            self.wake()  # the rest next pass, so status.json stays fresh during a burst
        for cand, taken in self._taken(todo, now):
            if taken.disk_full is not None:
                self.note_disk_full(taken.disk_full, f"inbox/{cand.name}")
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
        self.report.awaiting(self._awaiting)

    def _contain_admitted(self, cand, taken: _Taken, exc: Exception) -> None:
        if taken.claimed is None:
            logger.error(
                "inbox/%s: internal error while admitting it", cand.name, exc_info=(type(exc), exc, exc.__traceback__)
            )
            return
        job_id, path = taken.claimed
        state = JobState.PENDING if path.parent.name == JobState.PENDING.value else JobState.FAILED
        job = self.jobs.get(job_id) or Job(job_id, state, path, dict(taken.run, id=job_id))
        self.job_failed_in(job, "admit", exc)

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
        orders = [self._next_order() for _ in cands]
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
            self.faults.check("admit", id_from_name(cand.name))
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
            return _Taken(result, run, self.folders.claim(cand.path, JobState.FAILED, run))
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
            return _Taken(result, run, self.folders.claim(cand.path, JobState.FAILED, run))
        run = new_run(result, order, now, name=_stem(printable_name(cand.name)))
        if result.fork_of:
            run["lineage"] = self.lineage_of(result.fork_of)
        if result.rerun_of:
            run["lineage"] = self.lineage_of(result.rerun_of, "rerun_of")
        return _Taken(result, run, self.folders.claim(cand.path, JobState.PENDING, run))

    def _validate(self, cand) -> JobSpec | InvalidJobSpec | None:
        """The file's JobSpec, the InvalidJobSpec listing its problems, or None when it vanished."""
        display = f"inbox/{printable_name(cand.name)}"
        bad_name = name_problem(cand.name)
        if bad_name is not None:
            return InvalidJobSpec(display, [bad_name])
        try:
            spec = load_job_file(cand.path, display)
            self.check_allowed(spec, display, cand.name)
            check_submission(spec, display, time.time())
            self._check_pool(spec, display)
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
            self.admit_sweep(cand, result, now)
        else:
            self._accepted(cand, taken, now)

    def check_allowed(self, spec: JobSpec, display: str, file_name: str) -> None:
        """allow_commands at acceptance, placeholders expanded as they will be (job_dir's depth is every state's);
        also what needs the executor: several nodes only with Slurm."""
        nodes = nodes_problem(spec.raw, self.config.executor)
        if nodes is not None:
            raise InvalidJobSpec(display, [nodes])
        if self.config.allow_commands is None and self.config.allow_env is None:
            return
        job_id = id_from_name(file_name)
        values = {"job_dir": str(self.root.job_dir(JobState.PENDING, job_id)), "job_id": job_id, "attempt": "1"}
        problem = check_command_allowed(spec, self.config, values, job_path(self.env.get("PATH", "")))
        if problem is not None:
            raise InvalidJobSpec(display, [problem])

    def _check_pool(self, spec: JobSpec, display: str) -> None:
        """A job's pool must be one watcher.yaml names (or the default pool)."""
        words = unknown_pool_words(spec.pool, self.config.pool_limits())
        if words is not None:
            raise InvalidJobSpec(display, [Problem("pool", words + "; fix pool: or add it to watcher.yaml")])

    def _next_order(self) -> int:
        self._order_last = max(self._order_last + 1, time.time_ns())
        return self._order_last

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
        self.jobs.add(job)
        records.accepted(job.paths, taken.run, cand.name, cand.mtime_ns / 1e9, now)
        logger.info(
            "job %s: inbox/%s -> pending (priority %d)", job_id, printable_name(cand.name), taken.result.priority
        )
        self.report.touch()
        self.admit_workflow(job, now)

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
        self.report.finished(Job(job_id, JobState.FAILED, path, taken.run, None), now)
        self.deps.finished[job_id] = "rejected"
        self.deps_changed(job_id, now)

    # -- helpers -----------------------------------------------------------------------------
    def _jobs_in(self, state: JobState) -> list[Job]:
        return self.jobs.in_state(state)

    def _count(self, state: JobState) -> int:
        return self.jobs.count(state)


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
