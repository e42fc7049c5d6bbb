"""``Watcher.run()`` and ``Watcher.tick(now)``: the loop that wires the loop's steps together.

One pass of ``tick`` reads like a table of contents: reap_finished → honor_job_flags →
admit_inbox → start_pending → watch_running → write status. Tests call ``tick`` directly.
Each step is an object the Watcher builds and owns, given what it reads and changes (its class
docstring says which): ``Intake`` (intake.py: inbox files validated, claimed, rejected), ``Starting``
(starting.py), ``Finishing`` (finishing.py: attempts' ends, retries, flags), ``Workflows``
(workflows.py), ``Containment`` (containment.py: the per-job guard), ``DiskFullHandling``
(diskfull.py), ``Walls`` (walls.py), ``Vitals`` (vitals.py) and ``PendingEdits`` (intake.py).
What several steps share (the job index, folders, report, config, executor) is one ``LoopState``
(state.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import time
from pathlib import Path

from watchdog.observers.api import BaseObserver

from trainq.watcher import __version__
from trainq.watcher.daemon.admission import Holding
from trainq.watcher.daemon.containment import ENV_WATCHER_CRASH, ENV_WATCHER_FAULTS, Containment, CrashPoints, Faults
from trainq.watcher.daemon.diskfull import DISK_FULL_RETRY_S, DiskFull, DiskFullHandling, is_disk_full, take_reserve
from trainq.watcher.daemon.executor import Executor, make_executor
from trainq.watcher.daemon.finishing import RUNNING_POLL_S, Finishing
from trainq.watcher.daemon.inbox import Inbox, InboxEvents, LoopWatch, schedule, start_observer
from trainq.watcher.daemon.intake import Intake, PendingEdits
from trainq.watcher.daemon.jobs import Job, JobIndex
from trainq.watcher.daemon.recovery import local_containment, recover
from trainq.watcher.daemon.report import Report
from trainq.watcher.daemon.resources import ResourceProbe
from trainq.watcher.daemon.starting import Starting
from trainq.watcher.daemon.state import LoopState
from trainq.watcher.daemon.vitals import Vitals
from trainq.watcher.daemon.walls import Walls
from trainq.watcher.daemon.workflows import Workflows
from trainq.watcher.spec.config import LiveSettings, WatcherConfig, paused_pools
from trainq.watcher.spec.errors import QueueLayoutError, QueueLocked
from trainq.watcher.spec.folders import Folders, JobState, QueueRoot
from trainq.watcher.spec.fsutil import drain, remove_quietly
from trainq.watcher.supervisor import cgroups
from trainq.watcher.supervisor.signals import WatcherSignals, install_watcher_signal_handlers

logger = logging.getLogger(__name__)

#: pause after an error no job's guard caught, so a repeating one does not spin the CPU, seconds
LOOP_ERROR_PAUSE_S = 0.5
#: a pass younger than this writes status.json between its steps only for a due heartbeat (seconds); a longer one
#: (a burst, a thousand sbatch answers) keeps status_s's cadence between its steps too
SHORT_PASS_S = 0.05


class Watcher:
    """The daemon: owns the queue root while it runs, builds the loop's steps and calls them in order."""

    def __init__(self, root: Path, config: WatcherConfig, *, polling: bool = False, env: dict | None = None):
        self.root = QueueRoot(Path(root).resolve())
        self.config = config
        self.polling = polling
        self.env = dict(os.environ if env is None else env)
        crashes = CrashPoints.parse(self.env.get(ENV_WATCHER_CRASH))  # a test switch (docs/reliability.md)
        folders = Folders(self.root, reached=crashes.reached)
        executor = make_executor(config, self.root.path)
        probe = ResourceProbe(simulate_gpus=config.simulate_gpus, env=self.env)
        faults = Faults.parse(self.env.get(ENV_WATCHER_FAULTS))  # a test switch (README, "Switches")
        self.report = Report(self.root, config, started_at=time.time())
        self.settings = LiveSettings(self.root.path, config, self.env, time.time())  # watcher.yaml is live
        self.state = LoopState(self.root, config, self.env, folders, executor, probe, self.report, self.wake)
        self.stopping = False
        self._loop_errors: dict[str, int] = {}  # errors outside any job's guard, by text: how often
        self._lock_fd: int | None = None
        self._pass_started = 0.0  # when the running pass began (keep_status_fresh)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._observer: BaseObserver | None = None
        #: the inbox's inotify watch read by the loop itself (inbox.py), else watchdog's observer (polling, no inotify)
        self._loop_watch: LoopWatch | None = None
        self._executor_problems: list[str] = []  # the last ones status.json was told of
        self._signals: WatcherSignals | None = None
        self._last_rescan = 0.0
        self.disk = DiskFullHandling(self.root, self.report)
        self.guard = Containment(self.state, self.disk, faults, retire=self._retire, deps_changed=self._deps_changed)
        self.workflows = Workflows(self.state, self.guard, retire=self._retire)
        self.walls = Walls(self.state, self.guard)
        self.vitals = Vitals(executor, self.report)
        self.finishing = Finishing(self.state, self.guard, self.disk, self.workflows, self.walls, self.vitals, crashes)
        self.edits = PendingEdits(self.state, self.guard, self.workflows, retire=self.finishing.retire)
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
        """What is wrong with the watcher itself, one line each (status.json ``watcher.problems``): a full disk, a
        window already past, watcher.yaml settings not applied, a spawner helper lost and not yet started again."""
        return (
            self.disk.problems()
            + self.walls.wall_problems(time.time())
            + self.settings.problems
            + self.executor.problems()
        )

    def window_now(self, now: float) -> dict | None:
        """status.json's ``window`` (walls.py)."""
        return self.walls.window_now(now)

    def cost_now(self, now: float) -> dict | None:
        """status.json's ``cost`` (walls.py)."""
        return self.walls.cost_now(now)

    def holding(self, job: Job) -> Holding:
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
        self.intake.inbox = Inbox(self.root.inbox, self.config.settle_s, events, self.config.inbox_settle_s)
        self._watch_inbox(events)
        if install_signals:
            self._signals = install_watcher_signal_handlers(self._wake_w)
        self.executor.start()
        self._recover()
        logger.info("watcher %d: watching %s (trainq %s)", os.getpid(), self.root.path, __version__)

    def _watch_inbox(self, events: InboxEvents) -> None:
        """inotify read by the loop (no thread hops); watchdog's observer when polling or where inotify is refused."""
        if not self.polling:
            try:
                self._loop_watch = LoopWatch(self.root.inbox, self.root.path, events)
                return
            except (OSError, ImportError) as exc:
                logger.info(
                    "watcher %d: inotify in the loop refused (%s); watchdog's observer watches", os.getpid(), exc
                )
        self._observer = start_observer(self.root.inbox, self.root.path, events, self.polling)

    def _recover(self) -> None:
        recover(self.state, self.guard, self.workflows, self.finishing)

    def close(self) -> None:
        """Stop watching; running jobs keep running (a later watcher re-adopts them)."""
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
            self._observer = None
        if self._loop_watch is not None:
            self._loop_watch.close()
            self._loop_watch = None
        if self.disk.disk_full is None:  # else the next watcher's recover() finishes from the folders
            self.finishing.retire_concluded(time.time())
            self.finishing.save_started(time.time(), all_now=True)
        try:
            self.write_status(time.time(), force=True, state="stopped")
        except Exception as exc:
            logger.error("watcher: could not write the final status.json: %s", exc)
        self.probe.close()
        self.workflows.hooks.close()
        containment = local_containment(self.state)
        self.executor.close()
        self.intake.close()
        if containment is not None:
            cgroups.remove_queue_folder(containment, self.root.path)  # kept between jobs, not after the last one
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
        """Until the next pass is due, something woke us, a job ended, or the inbox or a root flag changed (events of
        our own writes in the root, status.json's, only end the wait when the pass is due anyway)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            wake_fds = [self._wake_r, *self.executor.wake_fds()]  # the spawner helper says when a job ended
            watch = self._loop_watch
            if watch is not None:
                wake_fds.append(watch.fileno())
            readable, _, _ = select.select(wake_fds, [], [], max(0.0, deadline - time.monotonic()))
            if self._wake_r in readable:
                drain(self._wake_r)
            if watch is None or watch.fileno() not in readable or len(readable) > 1 or watch.read():
                return
            if time.monotonic() >= deadline:
                return

    def _next_wait_s(self) -> float:
        if self._quiet():
            # nothing in flight: only the rescan (flags in job folders) and the heartbeat come due; waking every
            # status_s as well cost an idle watcher a pass a second (the inbox and root flags wake it anyway)
            now = time.time()
            rescan_in = self._last_rescan + self.config.rescan_s - now
            return max(0.0, min(rescan_in, self.report.last_write + self.config.heartbeat_s - now))
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

    def _quiet(self) -> bool:
        """No job pending or running, no hook, no status change waiting to be written, the disk fine, a local
        executor, and no inbox file held back: nothing that a pass between rescans could move."""
        return (
            self.executor.name == "local"
            and not self.jobs.count(JobState.PENDING)
            and not self.jobs.count(JobState.RUNNING)
            and not self.state.concluded
            and not self.workflows.hooks.running()
            and not self.report.dirty
            and self.disk.disk_full is None
            and (self.inbox is None or self.inbox.next_due_s() is None)
        )

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
        if self._loop_watch is not None:
            self._loop_watch.read()  # the inbox's hints are current for this pass (tests call tick() alone)
        top = self.root.top()  # one listing of the root for the folder and flag checks
        self.check_layout(top)
        self.reload_settings(now)
        self.honor_root_flags(top)
        if self.disk.disk_full is not None:
            self.disk.retry_after_disk_full(now, self, self.rebuild_from_disk)
        if self.disk.disk_full is None:
            self._work(now)
        else:
            self.finishing.watch_running(now)
        self.workflows.hooks.reap()
        problems = self.executor.problems()  # after the launches: a launch may have found the helper lost
        changed, self._executor_problems = problems != self._executor_problems, problems
        self.write_status(now, force=changed)  # status.json says so (or stops saying so) in this pass

    def reload_settings(self, now: float) -> None:
        """watcher.yaml changed: apply what it says now, or say why not (spec/config.py, docs/settings.md)."""
        problems = list(self.settings.problems)
        config = self.settings.check(now)
        if config is not None:
            self.config = self.state.config = config
            self.report.apply(config)
            if self.inbox is not None:
                self.inbox.settle_s, self.inbox.written_settle_s = config.settle_s, config.inbox_settle_s
            self.state.plan_due = True  # new limits or pools may start a job now
        if config is not None or self.settings.problems != problems:
            self.report.touch()

    def _work(self, now: float) -> None:
        self._pass_started = now
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
                self.workflows.continue_sweeps(now)  # a big sweep's jobs, a slice a pass (workflows.py)
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
        """status.json between the steps of a long pass (a burst admitted, a thousand sbatch answers taken), so it
        is never a whole pass old; a no-op unless a write is due (status_s, heartbeat_s). In a pass younger than
        SHORT_PASS_S only a due heartbeat is written: the pass's end comes within milliseconds, and a write here,
        between a job's acceptance and its start, put a status.json and status.html write (and the fsync) into
        every drop→start."""
        if self.disk.disk_full is None:
            now = time.time()
            try:
                self.write_status(now, heartbeat_only=now - self._pass_started < SHORT_PASS_S)
            except Exception:
                logger.debug("status.json between steps could not be written", exc_info=True)

    def write_status(
        self, now: float, *, force: bool = False, state: str | None = None, heartbeat_only: bool = False
    ) -> None:
        """status.json and status.html; a full disk is noted, not raised."""
        try:
            self.report.write(self, now, force=force, state=state, heartbeat_only=heartbeat_only)
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

    def check_layout(self, top: dict[str, bool] | None = None) -> None:
        """Recreate queue folders a user deleted, instead of crash-looping (``top``: the root's listing)."""
        created = self.root.ensure_layout(create=True, top=top)
        for folder in created:
            logger.warning("queue: %s was missing; recreated it", folder)
        inbox = self.inbox
        if self.root.inbox in created and self._loop_watch is not None:
            self._loop_watch.rewatch()
        if self.root.inbox in created and self._observer is not None and inbox is not None and inbox.events is not None:
            self._observer.unschedule_all()  # started: start() made the inbox with its events and the observer
            schedule(self._observer, self.root.inbox, self.root.path, inbox.events)
        if any(f != self.root.inbox for f in created):
            self._forget_vanished_jobs()

    def _forget_vanished_jobs(self) -> None:
        for job in list(self.jobs.values()):
            if not job.dir.exists():
                logger.warning("job %s: its folder %s vanished; forgetting it", job.id, job.dir)
                self.finishing.drop(job)

    def honor_root_flags(self, top: dict[str, bool] | None = None) -> None:
        """``stop.flag`` at the root: exit (jobs keep running); ``pause.flag``: start nothing new (``top``: the root's
        listing, where a flag is a name)."""
        if top is None:  # the root could not be listed: ask for each flag
            top = {f.name: False for f in (self.root.stop_flag, self.root.pause_flag) if f.exists()}
            pools = paused_pools(self.root.path)
        else:
            pools = paused_pools(self.root.path, top)
        if self.root.stop_flag.name in top:
            remove_quietly(self.root.stop_flag)
            logger.info("watcher %d: stop.flag found; exiting, running jobs keep running", os.getpid())
            self.stopping = True
        paused = self.root.pause_flag.name in top
        if paused != self.state.paused:
            logger.info("watcher %d: %s", os.getpid(), "paused (pause.flag)" if paused else "resumed")
            self.state.paused = paused
            self.state.plan_due = True
            self.report.touch()
        if pools != self.state.paused_pools:
            logger.info("watcher %d: paused pools: %s", os.getpid(), ", ".join(sorted(pools)) or "none")
            self.state.paused_pools = pools
            self.state.plan_due = True
            self.report.touch()
