"""``Watcher.run()`` and ``Watcher.tick(now)``: the loop that wires the other modules together.

One pass of ``tick`` reads like a table of contents: reap_finished → honor_flags →
admit_inbox → start_pending → watch_running → write_status. Tests call ``tick`` directly.
"""
from __future__ import annotations

import dataclasses
import fcntl
import heapq
import logging
import os
import select
import sys
import time
from pathlib import Path

from . import __version__
from .config import WatcherConfig, check_command_allowed
from .contract import (
    ATTEMPT_BANNER_PREFIX,
    ENV_ATTEMPT,
    ENV_JOB_DIR,
    ENV_JOB_ID,
    ENV_METRICS,
    ENV_RESUME_FROM,
    ENV_STOP_FLAG,
    JobPaths,
)
from .errors import InvalidJobSpec, QueueLocked, QueueLayoutError, SpawnFailed
from .folders import Folders, JobState, QueueRoot
from .fsutil import remove_quietly, touch
from .inbox import Inbox, InboxEvents, start_observer
from .jobs import Job, JobIndex, judge_exit, latest_checkpoint, load_job, new_run, relative_to_job, should_retry, supervisor_lost
from .jobspec import JobSpec, load_job_file
from .recovery import recover
from .report import Report
from .admission import Holding, Limits, Request, plan
from .resources import ResourceProbe
from .executor import ExecutorUnavailable, make_executor
from .supervisor import LaunchSpec, install_watcher_signal_handlers
from .units import iso_utc

logger = logging.getLogger(__name__)

#: how often running jobs are polled for exit records when no SIGCHLD can tell us (re-adopted jobs), seconds
RUNNING_POLL_S = 0.2
#: how many inbox files one tick takes at most, so status stays fresh during a 10,000-file burst
ADMIT_BATCH = 2000
#: how many pending jobs, in start order, admission plans per pass (plus 2 x max_concurrent)
PLAN_HEAD = 50
#: how often admission re-plans when nothing of ours changed (free RAM, GPUs may have), seconds
PLAN_EVERY_S = 0.5


class Watcher:
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
        self.report = Report(self.root, config, started_at=time.time())
        self.inbox: Inbox | None = None
        self.paused = False
        self.stopping = False
        self._awaiting: dict[str, tuple[tuple, dict]] = {}
        self._order_last = 0
        self._lock_fd: int | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._observer = None
        self._signals = None
        self._last_rescan = 0.0
        self._last_running_poll = 0.0
        self._plan_due = True
        self._last_plan = 0.0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, *, install_signals: bool = True) -> None:
        """Take the root, recover what a previous watcher left, start watching the inbox."""
        self.root.ensure_layout(create=True)
        self.root.check_single_filesystem()
        self._take_root_lock()
        remove_quietly(self.root.stop_flag)
        events = InboxEvents(self.root.inbox, self.wake)
        self.inbox = Inbox(self.root.inbox, self.config.settle_s, events)
        self._observer = start_observer([self.root.inbox, self.root.path], events, self.polling)
        if install_signals:
            self._signals = install_watcher_signal_handlers(self._wake_w)
        recover(self)
        logger.info("watcher %d: watching %s (trainq %s)", os.getpid(), self.root.path, __version__)

    def close(self) -> None:
        """Stop watching; running jobs keep running (a later watcher re-adopts them)."""
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
            self._observer = None
        self.report.write(self, time.time(), force=True, state="stopping")
        self.probe.close()
        self.executor.close()
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
            self._wait(self._next_wait_s())

    def _should_exit(self) -> bool:
        return self.stopping or bool(self._signals and self._signals.stop_requested)

    def wake(self) -> None:
        """Wake the loop now (called from the observer thread)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _wait(self, timeout_s: float) -> None:
        readable, _, _ = select.select([self._wake_r], [], [], max(0.0, timeout_s))
        if readable:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass

    def _next_wait_s(self) -> float:
        wait = min(self.config.rescan_s, self.config.status_s)
        if self._count(JobState.RUNNING):
            wait = min(wait, RUNNING_POLL_S)
        return wait

    def _take_root_lock(self) -> None:
        fd = os.open(self.root.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip()
            os.close(fd)
            raise QueueLocked(str(self.root.path), int(holder) if holder.isdigit() else None) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    # -- the loop --------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """One pass over the queue."""
        self.executor.reap()
        self.check_layout()
        self.honor_root_flags()
        self.reap_finished(now)
        rescan = now - self._last_rescan >= self.config.rescan_s
        if rescan:
            self._last_rescan = now
            self.honor_job_flags(now)
        self.admit_inbox(now)
        self.start_pending(now)
        self.watch_running(now)
        self.report.write(self, now)

    def check_layout(self) -> None:
        """Recreate queue folders a user deleted, instead of crash-looping."""
        created = self.root.ensure_layout(create=True)
        for folder in created:
            logger.warning("queue: %s was missing; recreated it", folder)
        if self.root.inbox in created and self._observer is not None:
            self._observer.unschedule_all()
            self._observer.schedule(self.inbox.events, str(self.root.inbox), recursive=False)
            self._observer.schedule(self.inbox.events, str(self.root.path), recursive=False)
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

    # -- finishing ---------------------------------------------------------------------------
    def reap_finished(self, now: float) -> None:
        """Finish every running job whose attempt ended (exit record, or a supervisor that vanished)."""
        forced = now - self._last_running_poll >= RUNNING_POLL_S
        for job in self._jobs_in(JobState.RUNNING):
            attempt = job.current_attempt() or {}
            record = self.executor.read_exit(job.paths, attempt)
            if record is not None and record.get("attempt") == job.attempt:
                self._finish(job, judge_exit(job.run, record, job.paths), record, now)
            elif forced and not self.executor.is_alive(job.paths, attempt):
                record = self.executor.read_exit(job.paths, attempt)  # it may have landed just now
                if record is not None and record.get("attempt") == job.attempt:
                    self._finish(job, judge_exit(job.run, record, job.paths), record, now)
                else:
                    self._finish_lost(job, now)
        if forced:
            self._last_running_poll = now

    def _finish_lost(self, job: Job, now: float) -> None:
        killed = self.executor.kill_leftovers(job.paths, job.current_attempt() or {})
        if killed:
            logger.warning("job %s: killed %d leftover process(es) of a dead supervisor", job.id, killed)
        self._finish(job, supervisor_lost(self.executor.read_started(job.paths)), {}, now)

    def _finish(self, job: Job, outcome, record: dict, now: float) -> None:
        attempt = job.current_attempt()
        if attempt is not None:
            started = self.executor.read_started(job.paths) or {}
            if started.get("attempt") == job.attempt:
                attempt["job_pid"] = started.get("job_pid")
            attempt.update(
                ended_at=record.get("ended_at") or iso_utc(now),
                exit_code=record.get("exit_code"),
                signal=record.get("signal"),
                signal_name=record.get("signal_name"),
                stop_reason=record.get("stop_reason"),
                diagnosis=outcome.diagnosis.to_dict() if outcome.diagnosis else None,
            )
        job.run["diagnosis"] = outcome.diagnosis.to_dict() if outcome.diagnosis else None
        job.run["error"] = record.get("spawn_error") or (outcome.diagnosis.evidence if outcome.diagnosis else None)
        if should_retry(job, outcome):
            self._requeue_for_retry(job, outcome, now)
            return
        job.run.update(status=outcome.status, finished_at=iso_utc(now), waiting_for=None, gpus=[])
        job.save()
        ok = outcome.status == "done"
        job.dir = self.folders.finish(job.id, ok)
        self.jobs.move(job, JobState.DONE if ok else JobState.FAILED)
        kind = f" ({outcome.diagnosis.kind})" if outcome.diagnosis else ""
        logger.info("job %s: running -> %s, %s%s", job.id, job.state.value, outcome.status, kind)
        self._retire(job, now)

    def _requeue_for_retry(self, job: Job, outcome, now: float) -> None:
        backoff_s = job.spec.retries.backoff_s if job.spec else 0.0
        resume = relative_to_job(latest_checkpoint(job.paths), job.paths) if job.spec and job.spec.has_resume else None
        total = 1 + (job.spec.retries.max if job.spec else 0)
        job.run.update(
            status="pending",
            not_before=iso_utc(now + backoff_s),
            resume_from=resume,
            stop_requested_at=None,
            gpus=[],
            waiting_for=f"retry {job.attempt + 1} of {total} after {outcome.diagnosis.kind}, backoff {backoff_s:g}s",
        )
        job.run.pop("stop_requested_by", None)
        remove_quietly(job.paths.stop_flag)
        job.save()
        job.dir = self.folders.requeue(job.id, JobState.RUNNING)
        self.jobs.move(job, JobState.PENDING)
        job.readers = None
        self._plan_due = True
        logger.info("job %s: running -> pending, retry after %s in %gs%s", job.id, outcome.diagnosis.kind,
                    backoff_s, f" (resume from {resume})" if resume else "")
        self.report.touch()

    def _retire(self, job: Job, now: float) -> None:
        """A job reached done/ or failed/: it leaves the live index, the report keeps it as recent."""
        self._plan_due = True
        self.jobs.remove(job.id)
        self.report.finished(job, now)

    def _drop(self, job: Job) -> None:
        self.jobs.remove(job.id)
        self.folders.forget(job.id)
        self.report.touch()

    # -- flags -------------------------------------------------------------------------------
    def honor_job_flags(self, now: float) -> None:
        """stop.flag in pending/ cancels; retry.flag in failed/ requeues with resume."""
        for job in self._jobs_in(JobState.PENDING):
            if job.paths.stop_flag.exists():
                self.cancel_pending(job, now)
        for job_id in _ids_with_retry_flag(self.root.state_dir(JobState.FAILED)):
            self.retry_finished(job_id, JobState.FAILED, now)

    def cancel_pending(self, job: Job, now: float) -> None:
        job.run.update(status="cancelled", finished_at=iso_utc(now), waiting_for=None,
                       stop_requested_at=iso_utc(now))
        job.save()
        job.dir = self.folders.fail(job.id, JobState.PENDING)
        self.jobs.move(job, JobState.FAILED)
        logger.info("job %s: pending -> failed, cancelled (stop.flag)", job.id)
        self._retire(job, now)

    def retry_finished(self, job_id: str, state: JobState, now: float) -> None:
        """retry.flag: back to pending as a new attempt that resumes from the latest checkpoint."""
        paths = JobPaths(self.root.job_dir(state, job_id))
        remove_quietly(paths.retry_flag)
        remove_quietly(paths.stop_flag)
        job = load_job(paths.dir, state)
        if job is None or job.run.get("status") == "rejected":
            logger.warning("job %s: retry.flag ignored (%s)", job_id,
                           "rejected jobs cannot run; fix and resubmit the file" if job else "unreadable run.json")
            return
        resume = relative_to_job(latest_checkpoint(paths), paths) if job.spec and job.spec.has_resume else None
        job.run.update(status="pending", finished_at=None, not_before=None, resume_from=resume,
                       waiting_for=None, diagnosis=None, error=None, stop_requested_at=None)
        job.run.pop("stop_requested_by", None)
        job.save()
        job.dir = self.folders.requeue(job_id, state)
        self.jobs.move(job, JobState.PENDING)
        self.jobs.add(job)
        self.report.unfinished(job_id, state)
        logger.info("job %s: %s -> pending, retry requested%s", job_id, state.value,
                    f" (resume from {resume})" if resume else "")

    # -- the inbox ---------------------------------------------------------------------------
    def admit_inbox(self, now: float) -> None:
        """Validate every complete inbox file: accept, reject, or leave it awaiting approval."""
        candidates = self.inbox.scan()
        self.report.inbox_seen(candidates)
        taken = 0
        for cand in self.inbox.ready(candidates, now):
            if taken >= ADMIT_BATCH:
                self.wake()
                break
            if self._admit_one(cand, now):
                taken += 1
        live = {c.name for c in candidates}
        for name in [n for n in self._awaiting if n not in live]:
            del self._awaiting[name]
        self.report.awaiting(self._awaiting)

    def _admit_one(self, cand, now: float) -> bool:
        sig = (cand.size, cand.mtime_ns, cand.ino)
        cached = self._awaiting.get(cand.name)
        if cached is not None and cached[0] == sig:
            return False
        display = f"inbox/{cand.name}"
        try:
            spec = load_job_file(cand.path, display)
            self._check_allowed(spec, display)
        except InvalidJobSpec as exc:
            self._reject(cand, exc, now)
            return True
        except FileNotFoundError:
            return False
        if not spec.approved:
            self._awaiting[cand.name] = (sig, {"name": cand.name, "spec": spec, "seen_at": now})
            return False
        self._awaiting.pop(cand.name, None)
        self._accept(cand, spec, now)
        return True

    def _check_allowed(self, spec: JobSpec, display: str) -> None:
        problem = check_command_allowed(spec, self.config)
        if problem is not None:
            raise InvalidJobSpec(display, [problem])

    def _next_order(self) -> int:
        self._order_last = max(self._order_last + 1, time.time_ns())
        return self._order_last

    def _accept(self, cand, spec: JobSpec, now: float) -> None:
        run = new_run(spec, self._next_order(), now, name=_stem(cand.name))
        claimed = self.folders.claim(cand.path, JobState.PENDING, run)
        self.inbox.taken(cand.name)
        if claimed is None:
            return
        job_id, path = claimed
        run["id"] = job_id
        self.jobs.add(Job(job_id, JobState.PENDING, path, run, spec))
        logger.info("job %s: inbox/%s -> pending (priority %d)", job_id, cand.name, spec.priority)
        self.report.touch()

    def _reject(self, cand, exc: InvalidJobSpec, now: float) -> None:
        run = new_run(None, self._next_order(), now, name=_stem(cand.name))
        run.update(status="rejected", finished_at=iso_utc(now), errors=[p.to_dict() for p in exc.problems],
                   error=exc.lines()[0] if exc.problems else "invalid job file")
        claimed = self.folders.claim(cand.path, JobState.FAILED, run)
        self.inbox.taken(cand.name)
        self._awaiting.pop(cand.name, None)
        if claimed is None:
            return
        job_id, path = claimed
        run["id"] = job_id
        for line in exc.lines():
            logger.warning("job %s: rejected: %s", job_id, line)
        logger.info("job %s: inbox/%s -> failed, rejected", job_id, cand.name)
        self.report.finished(Job(job_id, JobState.FAILED, path, run, None), now)

    # -- starting ----------------------------------------------------------------------------
    def start_pending(self, now: float) -> None:
        """Ask admission which pending jobs fit now, and start them.

        Only the head of the queue (in start order) is planned each pass: a job deep in a
        10,000-job queue cannot start before those ahead of it, and planning all of them every
        tick made throughput fall with queue length. Every job is still checked once, when it
        first becomes pending, for whether this machine can ever run it.
        """
        pending = self._jobs_in(JobState.PENDING)
        if not pending:
            return
        running = self._jobs_in(JobState.RUNNING)
        unchecked = [j for j in pending if not j.checked]
        if not self._plan_due and not unchecked and now - self._last_plan < PLAN_EVERY_S:
            return
        self._plan_due, self._last_plan = False, now
        head = heapq.nsmallest(PLAN_HEAD + 2 * self.config.max_concurrent, pending, key=Job.sort_key)
        machine = self.probe.sample(self._disk_paths(head + running))
        limits = self._limits()
        holdings = [self._holding(j) for j in running]
        self._reject_unsatisfiable(unchecked, holdings, machine, limits, now)
        unavailable = self.executor.unavailable(now)
        if unavailable:
            self._all_wait(head, unavailable)
            return
        requests = [self._request(j) for j in head if j.state is JobState.PENDING and not _later(j, now)]
        for decision in plan(requests, holdings, machine, limits):
            job = self.jobs.get(decision.job_id)
            if job is None or job.state is not JobState.PENDING:
                continue
            if decision.unsatisfiable:
                self._fail_unsatisfiable(job, decision.unsatisfiable, now)
            elif decision.start:
                self._launch(job, decision, now)
            elif job.run.get("waiting_for") != decision.waiting_for:
                job.run["waiting_for"] = decision.waiting_for
                self.report.touch()

    def _limits(self) -> Limits:
        return Limits(
            max_concurrent=self.config.max_concurrent,
            gpu_ids=self.config.gpus,
            min_free_ram_gb=self.config.min_free_ram_gb,
            min_free_disk_gb=self.config.min_free_disk_gb,
            paused=self.paused,
        )

    def _reject_unsatisfiable(self, jobs: list[Job], holdings, machine, limits: Limits, now: float) -> None:
        """A job this machine can never run fails at once instead of waiting forever."""
        if not jobs:
            return
        as_if_paused = dataclasses.replace(limits, paused=True)  # only the "never" checks run
        never = {d.job_id: d.unsatisfiable for d in plan([self._request(j) for j in jobs], holdings, machine, as_if_paused)}
        for job in jobs:
            job.checked = True
            if never.get(job.id):
                self._fail_unsatisfiable(job, never[job.id], now)

    def _all_wait(self, jobs: list[Job], reason: str) -> None:
        for job in jobs:
            if job.run.get("waiting_for") != reason:
                job.run["waiting_for"] = reason
                self.report.touch()

    def _request(self, job: Job) -> Request:
        res = job.spec.resources
        if getattr(self.executor, "places_resources", False):
            # Slurm places GPUs and RAM on its nodes; only the queue's disk is this machine's to check
            return Request(job_id=job.id, priority=job.priority, order=job.order, gpus=0, disk_gb=res.disk_gb,
                           allow_battery=True, disk_path=self._disk_path(job))
        return Request(
            job_id=job.id, priority=job.priority, order=job.order, gpus=res.gpus,
            gpu_memory_gb=res.gpu_memory_gb, ram_gb=res.ram_gb, disk_gb=res.disk_gb,
            allow_battery=res.allow_battery, disk_path=self._disk_path(job),
        )

    def _holding(self, job: Job) -> Holding:
        res = job.spec.resources if job.spec and not getattr(self.executor, "places_resources", False) else None
        rss_gb = ((job.usage or {}).get("rss_mb") or 0.0) / 1024
        return Holding(job_id=job.id, gpus=tuple(job.run.get("gpus") or ()),
                       ram_gb=res.ram_gb if res else 0.0, disk_gb=res.disk_gb if res else 0.0, rss_gb=rss_gb,
                       pids=job.pids, disk_path=self._disk_path(job))

    def _disk_path(self, job: Job) -> Path:
        cwd = job.spec.cwd if job.spec else None
        if cwd and "{" not in cwd and os.path.isdir(cwd):
            return Path(cwd)
        return self.root.path

    def _disk_paths(self, jobs: list[Job]) -> list[Path]:
        return sorted({self._disk_path(j) for j in jobs[:50]} | {self.root.path})

    def _fail_unsatisfiable(self, job: Job, reason: str, now: float) -> None:
        job.run.update(
            status="failed", finished_at=iso_utc(now), waiting_for=None, error=reason,
            diagnosis={"kind": "unsatisfiable", "advice": "Lower the job's resources to what this machine has, "
                       "or run it on a bigger machine.", "evidence": reason},
        )
        job.save()
        job.dir = self.folders.fail(job.id, JobState.PENDING)
        self.jobs.move(job, JobState.FAILED)
        logger.info("job %s: pending -> failed, unsatisfiable: %s", job.id, reason)
        self._retire(job, now)

    def _launch(self, job: Job, decision, now: float) -> None:
        attempt = job.attempt + 1
        job.dir = self.folders.start(job.id)
        self.jobs.move(job, JobState.RUNNING)
        paths = job.paths
        # resolved now, where the folder is: it moved since the checkpoint was written
        resume_from = latest_checkpoint(paths) if job.spec.has_resume and job.run.get("resume_from") else None
        remove_quietly(paths.stop_flag)  # a stop for an earlier attempt (the supervisor clears its own records)
        values = {"job_dir": str(paths.dir), "job_id": job.id, "attempt": str(attempt), "resume_from": resume_from or ""}
        spec = LaunchSpec(
            job_dir=str(paths.dir),
            argv=tuple(job.spec.launch_argv(values, sys.executable, resume=bool(resume_from))),
            env=self._job_env(job, values, decision, resume_from),
            cwd=job.spec.launch_cwd(values) or str(paths.dir),
            attempt=attempt,
            stop_grace_s=job.spec.stop_grace_s,
            kill_after_s=self.config.kill_after_s,
            timeout_s=job.spec.timeout_s,
            banner=_banner(job.id, attempt, now, resume_from),
        )
        job.run.update(status="running", attempt=attempt, waiting_for=None, not_before=None,
                       gpus=list(decision.gpus), stop_requested_at=None)
        job.run["started_at"] = job.run.get("started_at") or iso_utc(now)
        record = {"n": attempt, "pid": None, "job_pid": None, "started_at": iso_utc(now),
                  "resumed_from": resume_from, "gpus": list(decision.gpus)}
        try:
            record.update(self.executor.launch(spec, job.run.get("name") or job.id, job.spec.slurm))
        except ExecutorUnavailable as exc:
            self._unlaunch(job, str(exc))
            return
        except SpawnFailed as exc:
            job.run["attempts"].append(record)
            self._finish(job, _spawn_outcome(str(exc)), {"spawn_error": str(exc)}, now)
            return
        job.run["attempts"].append(record)
        job.run["executor"] = self.executor.name
        if record.get("slurm_job_id"):
            job.run["slurm_job_id"] = record["slurm_job_id"]
        job.save(durable=False)
        job.health, job.last_activity, job.activity_sig, job.readers = "healthy", now, (), None
        gpus = ",".join(map(str, decision.gpus)) or "none"
        where = f"slurm job {record['slurm_job_id']}" if record.get("slurm_job_id") else f"pid {record.get('pid')}"
        logger.info("job %s: pending -> running (attempt %d, %s, gpus %s)", job.id, attempt, where, gpus)
        self.report.touch()

    def _unlaunch(self, job: Job, reason: str) -> None:
        """The executor could not take the attempt (Slurm down): back to pending, nothing lost."""
        job.run.update(status="pending", attempt=job.attempt - 1, waiting_for=reason, gpus=[])
        job.save(durable=False)
        job.dir = self.folders.requeue(job.id, JobState.RUNNING)
        self.jobs.move(job, JobState.PENDING)
        logger.warning("job %s: running -> pending, executor unavailable: %s", job.id, reason)
        self.report.touch()

    def _job_env(self, job: Job, values: dict, decision, resume_from: str | None) -> dict[str, str]:
        env = {k: v for k, v in self.env.items() if not k.startswith("TRAINQ_") or k == "TRAINQ_TRAINER_FAULTS"}
        env.update(job.spec.launch_env(values))
        env.update(decision.env)
        paths = job.paths
        env.update({
            ENV_JOB_ID: job.id,
            ENV_JOB_DIR: str(paths.dir),
            ENV_STOP_FLAG: str(paths.stop_flag),
            ENV_METRICS: str(paths.metrics),
            ENV_ATTEMPT: values["attempt"],
        })
        if resume_from:
            env[ENV_RESUME_FROM] = resume_from
        return env

    # -- running jobs ------------------------------------------------------------------------
    def watch_running(self, now: float) -> None:
        """Mark stop requests, track health (stalls) and progress of running jobs."""
        for job in self._jobs_in(JobState.RUNNING):
            if job.run.get("status") == "running" and job.paths.stop_flag.exists():
                job.run.update(status="stopping", stop_requested_at=iso_utc(now))
                job.health = "stopping"
                job.save(durable=False)
                logger.info("job %s: stop requested (stop.flag); grace %gs", job.id,
                            job.spec.stop_grace_s if job.spec else 0)
                self.report.touch()
            if job.run.get("status") == "stopping":
                requested = _parse_time(job.run.get("stop_requested_at")) or now
                grace = job.spec.stop_grace_s if job.spec else 0.0
                self.executor.enforce_stop(job.paths, job.current_attempt() or {}, requested, grace, now)
            self._note_executor_wait(job)
            self._check_stall(job, now)
        self.report.update_progress(self, now)

    def _note_executor_wait(self, job: Job) -> None:
        reason = self.executor.waiting_for(job.paths, job.current_attempt() or {})
        if job.run.get("waiting_for") != reason:
            job.run["waiting_for"] = reason
            self.report.touch()

    def _check_stall(self, job: Job, now: float) -> None:
        stall_after = job.spec.stall_after_s if job.spec else None
        if not stall_after:
            return
        sig = tuple(_mtime(p) for p in (job.paths.log, job.paths.metrics))
        if sig != job.activity_sig:
            job.activity_sig, job.last_activity = sig, now
            if job.health == "stalled":
                job.health = "healthy"
                self.report.touch()
            return
        if job.health != "healthy" or now - job.last_activity < stall_after:
            return
        job.health = "stalled"
        logger.warning("job %s: stalled: no new output for %gs", job.id, now - job.last_activity)
        self.report.touch()
        if "stalled" in job.spec.retries.on:  # the user opted in: end it (retried while attempts remain)
            job.run.update(stop_requested_by="stalled", stall_after_s=stall_after)
            job.save(durable=False)
            touch(job.paths.stop_flag)

    # -- helpers -----------------------------------------------------------------------------
    def _jobs_in(self, state: JobState) -> list[Job]:
        return self.jobs.in_state(state)

    def _count(self, state: JobState) -> int:
        return self.jobs.count(state)


def _banner(job_id: str, attempt: int, now: float, resume_from: str | None) -> str:
    resume = f", resuming from {resume_from}" if resume_from else ""
    return f"{ATTEMPT_BANNER_PREFIX}job {job_id}, attempt {attempt}, started {iso_utc(now)}{resume} ====="


def _spawn_outcome(message: str):
    from .diagnosis import Diagnosis
    from .jobs import Outcome

    return Outcome("failed", Diagnosis("unknown", "Check the job's command and cwd; the process could not be started.",
                                       message))


def _later(job: Job, now: float) -> bool:
    """A retry still inside its backoff."""
    not_before = _parse_time(job.run.get("not_before"))
    return bool(not_before and not_before > now)


def _parse_time(text: str | None) -> float | None:
    from .units import parse_iso

    return parse_iso(text)


def _mtime(path: Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def _ids_with_retry_flag(state_dir: Path) -> list[str]:
    """Ids of job folders in ``state_dir`` holding a retry.flag."""
    try:
        entries = list(os.scandir(state_dir))
    except FileNotFoundError:
        return []
    return [e.name for e in entries if not e.name.startswith(".") and JobPaths(Path(e.path)).retry_flag.exists()]




def _stem(file_name: str) -> str:
    """``lora.yaml`` → ``lora``: the display name of a job without ``name:``."""
    stem, dot, suffix = file_name.rpartition(".")
    return stem if dot and suffix.lower() in ("yaml", "yml") and stem else file_name
