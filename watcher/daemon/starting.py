"""Starting pending jobs: ask admission which fit, launch them through the executor, say why the rest wait."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trainq.watcher.daemon.admission import Holding, Limits, Request, plan
from trainq.watcher.daemon.diagnosis import Diagnosis, unsatisfiable_diagnosis
from trainq.watcher.daemon.jobs import Job, Outcome, resume_checkpoint
from trainq.watcher.daemon.records import gpu_facts, snapshot_request
from trainq.watcher.spec.allow import executable_for
from trainq.watcher.spec.capacity import default_gpus
from trainq.watcher.spec.config import check_command_allowed, passed_through
from trainq.watcher.spec.contract import (
    ATTEMPT_BANNER_PREFIX,
    ENV_ATTEMPT,
    ENV_INIT_FROM,
    ENV_JOB_DIR,
    ENV_JOB_ID,
    ENV_METRICS,
    ENV_RESUME_FROM,
    ENV_STOP_FLAG,
)
from trainq.watcher.spec.errors import ExecutorUnavailable, SpawnFailed
from trainq.watcher.spec.folders import JobState
from trainq.watcher.spec.fsutil import exists
from trainq.watcher.spec.interpreter import job_path, resolved_program
from trainq.watcher.spec.units import iso_utc, parse_iso
from trainq.watcher.spec.wall import ENV_COST
from trainq.watcher.supervisor import LaunchSpec

if TYPE_CHECKING:
    from trainq.watcher.daemon.containment import Containment, CrashPoints
    from trainq.watcher.daemon.diskfull import DiskFullHandling
    from trainq.watcher.daemon.finishing import Finishing
    from trainq.watcher.daemon.intake import PendingEdits
    from trainq.watcher.daemon.resources import MachineState
    from trainq.watcher.daemon.state import LoopState
    from trainq.watcher.daemon.walls import Walls
    from trainq.watcher.daemon.workflows import Workflows

logger = logging.getLogger(__name__)

#: how many pending jobs, in start order, admission plans per pass (plus 2 x max_concurrent)
PLAN_HEAD = 50
#: how often admission re-plans when nothing of ours changed (free RAM, GPUs may have), seconds
PLAN_EVERY_S = 0.5
#: jobs planned beyond the free slots when a slot frees between full plans
PLAN_MARGIN = 8
#: seconds of launching per pass; the rest start on the next pass, so status.json and stops keep their pace
#: while a thousand jobs start (each launch writes a few files; Slurm's also reads job.yaml for its options)
LAUNCH_BUDGET_S = 0.5


class Starting:
    """Turns pending jobs into running attempts: asks admission which fit, launches them, says why the rest wait.

    Reads the state's config, env, root, probe, executor, ``paused`` and ``paused_pools``, and ``disk``
    (nothing starts while the disk is full). Changes the state's ``jobs`` (pending -> running) and
    ``plan_due``, jobs' run.json and folders, and touches the report. Each job's step runs inside
    ``guard``; ``walls`` may hold a job, ``edits`` re-reads an edited job.yaml first, ``workflows`` gives
    ``{after:ID}`` values and hears of each start, and ``finishing`` ends an attempt that never started.
    """

    def __init__(
        self,
        state: LoopState,
        guard: Containment,
        disk: DiskFullHandling,
        finishing: Finishing,
        workflows: Workflows,
        walls: Walls,
        edits: PendingEdits,
        crashes: CrashPoints,
    ) -> None:
        self.state = state
        self.guard = guard
        self.disk = disk
        self.finishing = finishing
        self.workflows = workflows
        self.walls = walls
        self.edits = edits
        self.crashes = crashes
        self._last_plan = 0.0
        self._machine: MachineState | None = None  # the last probe: the GPUs' names for the snapshot (records.py)

    # -- starting ----------------------------------------------------------------------------
    def start_pending(self, now: float) -> None:
        """Ask admission which pending jobs fit now, and start them.

        Only the head of the queue (in start order) is planned: a job deep in a 10,000-job
        queue cannot start before those ahead of it. When a slot has just freed, the head is
        the free slots plus PLAN_MARGIN jobs; every PLAN_EVERY_S it is PLAN_HEAD jobs, which also
        refreshes why each listed job waits and lets a job further back fill a slot the head
        cannot use. Every job is still checked once, when it first becomes pending, for whether
        this machine can ever run it.
        """
        unchecked = self.state.jobs.take_unchecked()
        if not self.state.jobs.count(JobState.PENDING):
            self._flush_launches(now)  # submissions answered since (Slurm's sbatch runs off the loop)
            return
        full = now - self._last_plan >= PLAN_EVERY_S
        if not (self.state.plan_due or unchecked or full):
            return
        running = self.state.jobs.in_state(JobState.RUNNING)
        slots = sum(self.state.config.pool_limits().values())
        depth = PLAN_HEAD + 2 * slots
        if not full:
            depth = min(depth, max(0, slots - len(running)) + PLAN_MARGIN)
        else:
            self._last_plan = now
        self.state.plan_due = False
        head = self.state.jobs.pending_head(depth)
        machine = self.state.probe.sample(self._disk_paths(head + running))
        self._machine = machine  # the GPUs' names for the snapshot (records.py)
        limits = self._limits()
        holdings = self._per_job(running, self.holding, "plan")
        unavailable = self.state.executor.unavailable(now)
        waiting = [
            j
            for j in ([] if unavailable else head)
            if j.state is JobState.PENDING and not _later(j, now) and not self.walls.held_by_wall(j, now)
        ]
        # a new job this plan decides is checked by it (a decision looks at "never" first): only the others are
        # planned apart for that
        new_here = frozenset(j.id for j in unchecked) & frozenset(j.id for j in waiting)
        self._reject_unsatisfiable([j for j in unchecked if j.id not in new_here], holdings, machine, limits, now)
        if unavailable:
            self._all_wait(head, unavailable)
            return
        budget_ends = time.monotonic() + LAUNCH_BUDGET_S
        try:
            requests = self._per_job(waiting, self._request, "plan")
            for decision in self._plan(requests, holdings, machine, limits, until_full=not full, always=new_here):
                job = self.state.jobs.get(decision.job_id)
                if job is None or job.state is not JobState.PENDING:
                    continue
                job.checked = True
                if decision.unsatisfiable:
                    self.guard.guarded(job, "plan", self._fail_unsatisfiable, job, decision.unsatisfiable, now)
                elif decision.start and time.monotonic() > budget_ends:
                    self.state.plan_due = True  # out of time for this pass: the next one starts it
                elif decision.start:
                    self.guard.guarded(job, "start", self._launch, job, decision, now)
                elif job.run.get("waiting_for") != decision.waiting_for:
                    job.run["waiting_for"] = decision.waiting_for
                    self.state.report.touch()
                if self.disk.disk_full is not None:
                    return
        finally:
            self._flush_launches(now)

    def _per_job(self, jobs: list[Job], make, step: str) -> list:
        """``make(job)`` for each job, each inside its guard (a job whose value cannot be built is failed)."""
        made = [self.guard.guarded(job, step, make, job) for job in jobs]
        return [m for m in made if m is not None]

    def _plan(
        self,
        requests: list[Request],
        holdings: list[Holding],
        machine,
        limits: Limits,
        until_full: bool = False,
        always: frozenset[str] = frozenset(),
    ) -> list:
        """admission.plan; if it raises, plan each job alone to find the one it fails on, fail that one, plan the rest.

        ``until_full`` (a pass after a slot freed): the jobs behind the last slot taken are not decided; the
        full plan every PLAN_EVERY_S refreshes why each of them waits.
        """
        try:
            return plan(requests, holdings, machine, limits, until_full=until_full, always=always)
        except Exception:
            logger.debug("admission failed on a batch of %d; planning each job alone", len(requests), exc_info=True)
        fine = []
        for request in requests:
            job = self.state.jobs.get(request.job_id)
            if job is None:
                continue
            if self.guard.guarded(job, "plan", plan, [request], holdings, machine, limits) is not None:
                fine.append(request)
        return plan(fine, holdings, machine, limits, until_full=until_full, always=always)

    def _limits(self) -> Limits:
        return Limits(
            max_concurrent=self.state.config.max_concurrent,
            gpu_ids=self.state.config.gpus,
            min_free_ram_gb=self.state.config.min_free_ram_gb,
            min_free_disk_gb=self.state.config.min_free_disk_gb,
            paused=self.state.paused,
            pools=self.state.config.pool_limits() if self.state.config.pools else None,
            paused_pools=frozenset(self.state.paused_pools),
        )

    def _reject_unsatisfiable(self, jobs: list[Job], holdings, machine, limits: Limits, now: float) -> None:
        """A job this machine can never run fails at once instead of waiting forever."""
        if not jobs:
            return
        as_if_paused = dataclasses.replace(limits, paused=True)  # only the "never" checks run
        requests = self._per_job(jobs, self._request, "plan")
        never = {d.job_id: d.unsatisfiable for d in self._plan(requests, holdings, machine, as_if_paused)}
        for job in jobs:
            job.checked = True
            if never.get(job.id) and job.state is JobState.PENDING:
                self.guard.guarded(job, "plan", self._fail_unsatisfiable, job, never[job.id], now)

    def _all_wait(self, jobs: list[Job], reason: str) -> None:
        for job in jobs:
            if job.run.get("waiting_for") != reason:
                job.run["waiting_for"] = reason
                self.state.report.touch()

    def _request(self, job: Job) -> Request:
        """The job's admission request. Made again only when what it is made of changed (the spec re-read after an
        edit, a new priority, the executor): the pending jobs at the head are planned in every pass. A job with a
        ``cwd`` is not kept, as its disk is looked up each time (the folder may appear later)."""
        spec, places = job.known_spec, self.state.executor.places_resources
        key = (job.priority, job.order, places)
        kept = job.request
        if kept is not None and kept[0] is spec and kept[1] == key:  # the spec itself is kept: no id reused
            return kept[2]
        request = self._make_request(job, places)
        job.request = (spec, key, request) if not spec.cwd else None
        return request

    def _make_request(self, job: Job, places: bool) -> Request:
        res = job.known_spec.resources
        if places:
            # a scheduler places GPUs and RAM on its nodes; only the queue's disk is this machine's to check
            return Request(
                job_id=job.id,
                priority=job.priority,
                order=job.order,
                gpus=0,
                disk_gb=res.disk_gb,
                allow_battery=True,
                disk_path=self._disk_path(job),
                pool=job.known_spec.pool,
            )
        return Request(
            job_id=job.id,
            priority=job.priority,
            order=job.order,
            gpus=res.gpus,
            gpu_memory_gb=res.gpu_memory_gb,
            ram_gb=res.ram_gb,
            disk_gb=res.disk_gb,
            allow_battery=res.allow_battery,
            disk_path=self._disk_path(job),
            gpus_default=default_gpus(job.known_spec.raw),
            pool=job.known_spec.pool,
        )

    def holding(self, job: Job) -> Holding:
        res = job.spec.resources if job.spec and not getattr(self.state.executor, "places_resources", False) else None
        rss_gb = ((job.usage or {}).get("rss_mb") or 0.0) / 1024
        return Holding(
            job_id=job.id,
            gpus=tuple(job.run.get("gpus") or ()),
            ram_gb=res.ram_gb if res else 0.0,
            disk_gb=res.disk_gb if res else 0.0,
            rss_gb=rss_gb,
            pids=job.pids,
            disk_path=self._disk_path(job),
            pool=job.spec.pool if job.spec else "default",
        )

    def _disk_path(self, job: Job) -> Path:
        cwd = job.spec.cwd if job.spec else None
        if cwd and "{" not in cwd and os.path.isdir(cwd):
            return Path(cwd)
        return self.state.root.path

    def _disk_paths(self, jobs: list[Job]) -> list[Path]:
        return sorted({self._disk_path(j) for j in jobs[:50]} | {self.state.root.path})

    def _fail_unsatisfiable(self, job: Job, reason: str, now: float) -> None:
        job.run.update(
            status="failed",
            finished_at=iso_utc(now),
            waiting_for=None,
            error=reason,
            diagnosis=unsatisfiable_diagnosis(reason).to_dict(),
        )
        job.save()
        job.dir = self.state.folders.fail(job.id, JobState.PENDING)
        self.state.jobs.move(job, JobState.FAILED)
        logger.info("job %s: pending -> failed, unsatisfiable: %s", job.id, reason)
        self.finishing.retire(job, now)

    def _launch(self, job: Job, decision, now: float) -> None:
        if exists(job.paths.stop_flag):  # stopped after the last flag scan (a retry's requeue clears its old flag)
            self.finishing.cancel_pending(job, now)
            return
        if not self.edits.ready_to_start(job, time.time()):
            return  # job.yaml changed since it was read: re-read, planned again with the new values
        attempt = job.attempt + 1
        job.dir = self.state.folders.start(job.id)
        self.state.jobs.move(job, JobState.RUNNING)
        self.crashes.reached("start-moved", job.id)
        paths = job.paths
        # resolved now, where the folder is: it moved since the checkpoint was written
        resume_from = resume_checkpoint(job) if job.run.get("resume_from") else None
        if attempt == 1 and job.known_spec.from_checkpoint and not job.known_spec.is_train:
            # a fork started from its parent's checkpoint (docs/workflows.md); a relative path is the job folder's
            resume_from = os.path.join(str(paths.dir), os.path.expanduser(job.known_spec.from_checkpoint))
        values = {
            "job_dir": str(paths.dir),
            "job_id": job.id,
            "attempt": str(attempt),
            "resume_from": resume_from or "",
            **self.workflows.after_values(job),
        }
        problem = check_command_allowed(
            job.known_spec, self.state.config, values, job_path(self.state.env.get("PATH", ""))
        )
        if problem is not None:
            self._refuse(job, problem, now)
            return
        argv = tuple(job.known_spec.launch_argv(values, sys.executable, resume=bool(resume_from)))
        cwd = job.known_spec.launch_cwd(values) or str(paths.dir)
        spec = LaunchSpec(
            job_dir=str(paths.dir),
            argv=argv,
            env=self._job_env(job, values, decision, resume_from),
            cwd=cwd,
            attempt=attempt,
            stop_grace_s=job.known_spec.stop_grace_s,
            kill_after_s=self.state.config.kill_after_s,
            timeout_s=job.known_spec.timeout_s,
            banner=_banner(job.id, attempt, now, resume_from),
            executable=self._checked_executable(job, values),
            inherit_env=self.state.executor.inherits_environment,
            snapshot=self._snapshot_request(job, argv, cwd, values, decision),
        )
        job.run.update(
            status="running",
            attempt=attempt,
            waiting_for=None,
            not_before=None,
            gpus=list(decision.gpus),
            stop_requested_at=None,
        )
        job.run["started_at"] = job.run.get("started_at") or iso_utc(now)
        record = {
            "n": attempt,
            "pid": None,
            "job_pid": None,
            "started_at": iso_utc(now),
            "resumed_from": resume_from,
            "gpus": list(decision.gpus),
            "program": spec.executable,  # else looked up on PATH once the launch is out (below)
        }
        sweep = job.run.get("sweep") or {}
        group = (sweep["id"], sweep["index"]) if sweep.get("id") and isinstance(sweep.get("index"), int) else None
        try:
            record.update(
                self.state.executor.launch(
                    spec, job.run.get("name") or job.id, job.known_spec.options_for(self.state.executor.name), group
                )
            )
        except ExecutorUnavailable as exc:
            self._unlaunch(job, str(exc), getattr(exc, "retry_after_s", None), now)
            return
        except SpawnFailed as exc:
            job.run["attempts"].append(_with_program(record, spec))
            self.finishing.finish(job, _spawn_outcome(exc), {"spawn_error": str(exc)}, now)
            return
        job.run["attempts"].append(_with_program(record, spec))
        job.run["executor"] = self.state.executor.name
        ref_field = self.state.executor.job_ref_field
        if ref_field and record.get(ref_field):
            job.run[ref_field] = record[ref_field]
        job.unsaved_since = now  # written by watch_running once it has run a moment (finishing.py)
        job.health, job.last_activity, job.activity_sig, job.readers = "healthy", now, (), None
        gpus = ",".join(map(str, decision.gpus)) or "none"
        where = self.state.executor.describe(record)
        logger.info("job %s: pending -> running (attempt %d, %s, gpus %s)", job.id, attempt, where, gpus)
        self.state.report.touch()
        self.workflows.deps_changed(job.id, now)

    def _snapshot_request(self, job: Job, argv: tuple[str, ...], cwd: str, values: dict, decision) -> dict | None:
        """What the supervisor records in snapshot/ (records.py); None with ``snapshot: false``."""
        if not job.known_spec.snapshot:
            return None
        try:
            gpus = gpu_facts(self._machine, list(decision.gpus))
            return snapshot_request(
                job.known_spec,
                job.run,
                list(argv),
                cwd,
                job.known_spec.launch_env(values),
                gpus,
                self.state.root.path,
                sys.executable,
            ).to_dict()
        except (OSError, ValueError) as exc:  # a record must not keep the job from starting
            logger.warning("job %s: no snapshot for this attempt: %s", job.id, exc)
            return None

    def _flush_launches(self, now: float) -> None:
        """Submit the attempts the executor held back this pass (a sweep's jobs: one batch-job array)."""
        for job_id, ref, error in self.state.executor.flush():
            job = self.state.jobs.get(job_id)
            if job is None or job.state is not JobState.RUNNING:
                continue
            self.guard.guarded(job, "start", self._launched, job, ref, error, now)

    def _launched(self, job: Job, ref: str | None, error: Exception | None, now: float) -> None:
        """The held-back submission of ``job``'s attempt went out (or failed: the same paths as in ``_launch``)."""
        if isinstance(error, ExecutorUnavailable):
            job.run["attempts"].pop()
            self._unlaunch(job, str(error), getattr(error, "retry_after_s", None), now)
        elif error is not None:
            self.finishing.finish(job, _spawn_outcome(error), {"spawn_error": str(error)}, now)
        elif ref and self.state.executor.job_ref_field:
            job.run["attempts"][-1][self.state.executor.job_ref_field] = ref
            job.run[self.state.executor.job_ref_field] = ref
            if job.unsaved_since is None:
                job.unsaved_since = now  # run.json was written before the id came: write it again soon
            self.state.report.touch()

    def _checked_executable(self, job: Job, values: dict) -> str | None:
        """The real path allow_commands approved, so exactly that is exec'd (None: no list, or a train job)."""
        if self.state.config.allow_commands is None or job.known_spec.is_train:
            return None
        return executable_for(job.known_spec, values, job_path(self.state.env.get("PATH", "")))

    def _refuse(self, job: Job, problem, now: float) -> None:
        """allow_commands refuses the job at start (written into pending/ by hand, or the list changed)."""
        error = f"{job.id}/job.yaml: {problem.path}: {problem.message}"
        job.run.update(
            status="rejected", finished_at=iso_utc(now), waiting_for=None, error=error, errors=[problem.to_dict()]
        )
        job.save()
        job.dir = self.state.folders.finish(job.id, ok=False)
        self.state.jobs.move(job, JobState.FAILED)
        logger.warning("job %s: rejected at start: %s", job.id, error)
        logger.info("job %s: running -> failed, rejected", job.id)
        self.finishing.retire(job, now)

    def _unlaunch(self, job: Job, reason: str, retry_after_s: float | None = None, now: float = 0.0) -> None:
        """The executor could not take the attempt (its scheduler is down, or a submit limit is reached: then not
        before ``retry_after_s``): back to pending, nothing lost."""
        job.run.update(
            status="pending",
            attempt=job.attempt - 1,
            waiting_for=reason,
            gpus=[],
            not_before=iso_utc(now + retry_after_s) if retry_after_s else None,
        )
        job.save(durable=False)
        job.dir = self.state.folders.requeue(job.id, JobState.RUNNING)
        self.state.jobs.move(job, JobState.PENDING)
        logger.warning("job %s: running -> pending, executor unavailable: %s", job.id, reason)
        self.state.report.touch()

    def _job_env(self, job: Job, values: dict, decision, resume_from: str | None) -> dict[str, str]:
        env = {
            k: v
            for k, v in passed_through(self.state.env, self.state.config.env_passthrough).items()
            if not k.startswith("TRAINQ_") or k == "TRAINQ_TRAINER_FAULTS"
        }
        if "PATH" not in job.known_spec.env:  # the watcher's python first (interpreter.py); the job's own PATH wins
            env["PATH"] = job_path(env.get("PATH"))
        env.update(job.known_spec.launch_env(values))
        env.update(decision.env)
        paths = job.paths
        env.update(
            {
                ENV_JOB_ID: job.id,
                ENV_JOB_DIR: str(paths.dir),
                ENV_STOP_FLAG: str(paths.stop_flag),
                ENV_METRICS: str(paths.metrics),
                ENV_ATTEMPT: values["attempt"],
            }
        )
        if resume_from:
            env[ENV_RESUME_FROM] = resume_from
        elif job.known_spec.is_train and job.known_spec.from_checkpoint:
            # weights only: fresh optimizer and schedule; a relative path is the job folder's
            env[ENV_INIT_FROM] = os.path.join(str(paths.dir), os.path.expanduser(job.known_spec.from_checkpoint))
        if self.state.config.cost is not None:  # the trainer writes its attempt's cost into summary.json
            env[ENV_COST] = self.state.config.cost.to_env(len(decision.gpus))
        if job.known_spec.is_train:  # torchrun's ranks (python -u -m) and the trainer's helpers: no cwd on sys.path
            env["PYTHONSAFEPATH"] = "1"
        return env


def _with_program(record: dict, spec: LaunchSpec) -> dict:
    """The attempt record with what ``argv[0]`` runs as: for the record (and a "not found" diagnosis) only, so it is
    looked up on PATH once the launch is out and the job's start does not wait for that walk."""
    if record["program"] is None:
        record["program"] = resolved_program(spec.argv[0], spec.env.get("PATH", ""), spec.cwd)
    return record


def _banner(job_id: str, attempt: int, now: float, resume_from: str | None) -> str:
    """The one-line separator the supervisor writes to output.log before an attempt."""
    resume = f", resuming from {resume_from}" if resume_from else ""
    return f"{ATTEMPT_BANNER_PREFIX}job {job_id}, attempt {attempt}, started {iso_utc(now)}{resume} ====="


def _spawn_outcome(error: Exception) -> Outcome:
    """The attempt never started (fork failed, lock held): a failure whose evidence is the reason; ``rejected``
    when the executor says it will never take the job as it is (Slurm refused it), so it is never retried."""
    if getattr(error, "rejected", False):
        return Outcome(
            "rejected",
            Diagnosis(
                "unknown",
                getattr(error, "advice", None)
                or "Slurm refused the job as it is: fix the job file's slurm options (or watcher.yaml's), then "
                "submit it again.",
                str(error),
            ),
        )
    return Outcome(
        "failed", Diagnosis("unknown", "Check the job's command and cwd; the process could not be started.", str(error))
    )


def _later(job: Job, now: float) -> bool:
    """A retry still inside its backoff."""
    not_before = parse_iso(job.run.get("not_before"))
    return bool(not_before and not_before > now)
