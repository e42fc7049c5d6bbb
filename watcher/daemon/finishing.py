"""Finishing attempts, retries and job flags: how a running job leaves running/, and how stop/retry flags act."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from trainq.watcher.daemon import records
from trainq.watcher.daemon.jobs import (
    CHECKPOINTED,
    Job,
    checkpoint_mark,
    judge_exit,
    load_job,
    resume_point,
    retries_used,
    should_retry,
    supervisor_lost,
)
from trainq.watcher.faces.story import flag_reason, reason_for
from trainq.watcher.spec import events
from trainq.watcher.spec.contract import REASON_PHRASES, REASON_STALLED, REASON_USER, JobPaths
from trainq.watcher.spec.folders import JobState
from trainq.watcher.spec.fsutil import exists, raise_flag, remove_quietly
from trainq.watcher.spec.units import iso_utc, parse_iso

if TYPE_CHECKING:
    from trainq.watcher.daemon.containment import Containment, CrashPoints
    from trainq.watcher.daemon.diskfull import DiskFullHandling
    from trainq.watcher.daemon.state import LoopState
    from trainq.watcher.daemon.vitals import Vitals
    from trainq.watcher.daemon.walls import Walls
    from trainq.watcher.daemon.workflows import Workflows

logger = logging.getLogger(__name__)

#: how often running jobs are polled for exit records when no SIGCHLD can tell us (re-adopted jobs), seconds
RUNNING_POLL_S = 0.2
#: a launched job's run.json is written once it has run this long (a job that ends sooner gets one final write)
STARTED_SAVE_AFTER_S = 0.05


class Finishing:
    """Finishes, retries, stops and watches running jobs; honours stop.flag in pending/ and retry.flag in failed/.

    Reads the state's root, config and executor, and ``disk`` (nothing is concluded while the disk is full).
    Changes the state's ``jobs``, ``concluded`` and ``plan_due``, jobs' run.json and folders, and touches
    the report. Each job's step runs inside ``guard``; an attempt's end is told to ``walls`` (cost,
    delivery) and ``workflows`` (dependents, hooks); a running job's records go to ``vitals``.
    """

    def __init__(
        self,
        state: LoopState,
        guard: Containment,
        disk: DiskFullHandling,
        workflows: Workflows,
        walls: Walls,
        vitals: Vitals,
        crashes: CrashPoints,
    ) -> None:
        self.state = state
        self.guard = guard
        self.disk = disk
        self.workflows = workflows
        self.walls = walls
        self.vitals = vitals
        self.crashes = crashes
        self._last_running_poll = 0.0
        self._retry_waits: set[str] = set()  # ids whose retry.flag waits for a hook (logged once each)

    # -- finishing ---------------------------------------------------------------------------
    def reap_finished(self, now: float) -> None:
        """Conclude every running job whose attempt ended (exit record, or a supervisor that vanished).

        A concluded job leaves the live index at once, so its slot is free for ``start_pending``
        in this same tick; its run.json and folder move follow in ``retire_concluded``. A crash
        in between loses nothing: the folder is still in running/ with its exit record, and
        ``recover()`` finishes it from that.
        """
        forced = now - self._last_running_poll >= RUNNING_POLL_S
        for job in self.state.jobs.in_state(JobState.RUNNING):
            self.guard.guarded(job, "finish", self._reap_one, job, forced, now)
            if self.disk.disk_full is not None:
                return
        if forced:
            self._last_running_poll = now

    def _reap_one(self, job: Job, forced: bool, now: float) -> None:
        attempt = job.current_attempt() or {}
        if self._conclude_from_record(job, attempt, now):
            return
        if forced and not self.state.executor.is_alive(job.paths, attempt):
            if not job.dir.exists():
                self.guard.forget_removed(job)  # rm -rf: its supervisor (if any) stops the attempt by itself
                return
            # the record may have landed between the two looks; only without one is the supervisor lost
            if not self._conclude_from_record(job, attempt, now):
                self.finish_lost(job, now)

    def _conclude_from_record(self, job: Job, attempt: dict, now: float) -> bool:
        """Conclude ``job`` from its current attempt's exit record; False while there is none."""
        record = self.state.executor.read_exit(job.paths, attempt)
        if record is None or record.get("attempt") != job.attempt:
            return False
        self._conclude(job, judge_exit(job.run, record, job.paths, job.spec), record, now)
        self.crashes.reached("concluded", job.id)
        return True

    def finish_lost(self, job: Job, now: float) -> None:
        killed = self.state.executor.kill_leftovers(job.paths, job.current_attempt() or {})
        if killed:
            logger.warning("job %s: killed %d leftover process(es) of a dead supervisor", job.id, killed)
        started = self.state.executor.read_started(job.paths) or {}
        record = {"job_pid": started.get("job_pid")} if started.get("attempt") == job.attempt else {}
        outcome = supervisor_lost(started)
        events.emit(
            job.paths,
            "exited",
            now,
            attempt=job.attempt,
            code=None,
            lost=True,
            evidence=outcome.diagnosis and outcome.diagnosis.evidence,
        )
        self.finish(job, outcome, record, now)

    def finish(self, job: Job, outcome, record: dict, now: float) -> None:
        """Conclude the attempt and, unless it is retried, write the job's final state and move its folder now."""
        self._conclude(job, outcome, record, now)
        self.retire_concluded(now)

    def _conclude(self, job: Job, outcome, record: dict, now: float) -> None:
        """Record how the attempt ended; retry it, or take the job out of the live index for retiring."""
        attempt = job.current_attempt()
        reason = reason_for(
            job.run, record
        )  # The reason (docs/contract.md, why a job stopped): one word, the same in every face
        if reason:
            job.run["reason"] = reason
        else:
            job.run.pop("reason", None)  # absent when the attempt ended by itself
        if attempt is not None:
            attempt.update(
                job_pid=record.get("job_pid", attempt.get("job_pid")),
                ended_at=record.get("ended_at") or iso_utc(now),
                exit_code=record.get("exit_code"),
                signal=record.get("signal"),
                signal_name=record.get("signal_name"),
                stop_reason=record.get("stop_reason"),
                reason=reason,
                diagnosis=outcome.diagnosis.to_dict() if outcome.diagnosis else None,
            )
            # which srun rank failed first (watcher/slurm/ranks.py), and the nodes that went silent (silent.py)
            for key in ("failed_rank", "srun_exit_code", "silent_nodes"):
                if record.get(key) is not None:
                    attempt[key] = record[key]
            if outcome.status == CHECKPOINTED:
                attempt["checkpoint_exit"] = True
        if outcome.diagnosis and outcome.diagnosis.kind == "preempted" and record.get("stop_reason") != "sigterm":
            # SIGTERM reached the job itself (the supervisor's own SIGTERM is recorded by the supervisor)
            events.emit(job.paths, "preempted", now, attempt=job.attempt, evidence=outcome.diagnosis.evidence)
        self.walls.account_attempt(job, attempt)
        job.run["diagnosis"] = outcome.diagnosis.to_dict() if outcome.diagnosis else None
        job.run["error"] = record.get("spawn_error") or (outcome.diagnosis.evidence if outcome.diagnosis else None)
        if outcome.status == CHECKPOINTED:
            self.guard.guarded(job, "retry", self._requeue_after_checkpoint, job, record, now)
            return
        if should_retry(job, outcome):
            self.guard.guarded(job, "retry", self._requeue_for_retry, job, outcome, now)
            return
        # the attempt's real end (its exit record), not when this watcher got to it (after a SIGSTOP, a crash)
        job.run.update(
            status=outcome.status, finished_at=record.get("ended_at") or iso_utc(now), waiting_for=None, gpus=[]
        )
        self.state.jobs.remove(job.id)
        self.state.concluded.append((job, outcome))
        self.state.plan_due = True

    def retire_concluded(self, now: float) -> None:
        """Write each concluded job's final run.json (durably) and move its folder to done/ or failed/."""
        while self.state.concluded and self.disk.disk_full is None:
            job, outcome = self.state.concluded[0]
            self.guard.guarded(job, "finish", self._retire_one, job, outcome, now)
            self.state.drop_concluded(job)

    def _retire_one(self, job: Job, outcome, now: float) -> None:
        job.save()
        ok = outcome.status == "done"
        job.dir = self.state.folders.finish(job.id, ok)
        job.state = JobState.DONE if ok else JobState.FAILED
        kind = f" ({outcome.diagnosis.kind})" if outcome.diagnosis else ""
        logger.info("job %s: running -> %s, %s%s", job.id, job.state.value, outcome.status, kind)
        self.retire(job, now)

    def _requeue_for_retry(self, job: Job, outcome, now: float) -> None:
        backoff_s = job.spec.retries.backoff_s if job.spec else 0.0
        resume = resume_point(job)
        total = 1 + (job.spec.retries.max if job.spec else 0)
        used = retries_used(job) + 1
        job.run.update(
            status="pending",
            not_before=iso_utc(now + backoff_s),
            resume_from=resume,
            stop_requested_at=None,
            gpus=[],
            retries_used=used,
            waiting_for=f"retry {used + 1} of {total} after {outcome.diagnosis.kind}, backoff {backoff_s:g}s",
        )
        for key in ("stop_requested_by", "reason"):
            job.run.pop(key, None)
        remove_quietly(job.paths.stop_flag)
        self._back_to_pending(job)
        logger.info(
            "job %s: running -> pending, retry after %s in %gs%s",
            job.id,
            outcome.diagnosis.kind,
            backoff_s,
            f" (resume from {resume})" if resume else "",
        )
        events.emit(
            job.paths,
            "retrying",
            now,
            attempt=job.attempt + 1,
            after=outcome.diagnosis.kind,
            resume_from=resume,
            backoff_s=backoff_s,
            retry=used,
            of=job.spec.retries.max if job.spec else 0,
        )
        self.state.report.touch()

    def _requeue_after_checkpoint(self, job: Job, record: dict, now: float) -> None:
        """The job exited with its checkpoint_exit_code: the next attempt starts at once, resuming; no retry counted."""
        resume = resume_point(job)
        restarts = int(job.run.get("checkpoint_restarts") or 0) + 1
        job.run["checkpoint_mark"] = checkpoint_mark(job.paths)  # the next checkpoint exit must leave a newer one
        job.run.update(
            status="pending",
            not_before=None,
            resume_from=resume,
            stop_requested_at=None,
            gpus=[],
            checkpoint_restarts=restarts,
            waiting_for=None,
            diagnosis=None,
            error=None,
        )
        job.run.pop("reason", None)
        self._back_to_pending(job)
        logger.info(
            "job %s: running -> pending, checkpoint exit %s: next attempt at once%s",
            job.id,
            record.get("exit_code"),
            f" (resume from {resume})" if resume else "",
        )
        events.emit(
            job.paths,
            "retrying",
            now,
            attempt=job.attempt + 1,
            after="checkpoint_exit",
            exit_code=record.get("exit_code"),
            resume_from=resume,
            counted=False,
        )
        self.state.report.touch()

    def _back_to_pending(self, job: Job) -> None:
        """Save a running job's run.json and move its folder back to pending/, for the next plan to start it."""
        job.save()
        job.dir = self.state.folders.requeue(job.id, JobState.RUNNING)
        self.state.jobs.move(job, JobState.PENDING)
        job.readers = None  # the report makes new readers when the job runs again
        self.state.plan_due = True

    def retire(self, job: Job, now: float) -> None:
        """A job reached done/ or failed/: it leaves the live index, the report keeps it as recent."""
        records.finished(job.paths, job.run, now)
        self.state.plan_due = True
        self.state.jobs.remove(job.id)
        self.state.report.finished(job, now)
        self.workflows.workflow_concluded(job, now)
        self.walls.deliver_if_due(job)

    def drop(self, job: Job) -> None:
        self.state.jobs.remove(job.id)
        self.state.folders.forget(job.id)
        self.state.report.touch()

    # -- flags -------------------------------------------------------------------------------
    def honor_job_flags(self, now: float) -> None:
        """stop.flag in pending/ cancels; retry.flag in failed/ requeues with resume."""
        self.guard.forget_removed_folders()
        for job in self.state.jobs.in_state(JobState.PENDING):
            if exists(job.paths.stop_flag):
                self.guard.guarded(job, "finish", self.cancel_pending, job, now)
        for job_id in _ids_with_retry_flag(self.state.root.state_dir(JobState.FAILED)):
            self.guard.guarded_id(job_id, JobState.FAILED, "retry", self.retry_finished, job_id, JobState.FAILED, now)

    def cancel_pending(self, job: Job, now: float) -> None:
        job.run.update(
            status="cancelled",
            finished_at=iso_utc(now),
            waiting_for=None,
            stop_requested_at=iso_utc(now),
            reason=REASON_USER,
        )
        job.save()
        job.dir = self.state.folders.fail(job.id, JobState.PENDING)
        self.state.jobs.move(job, JobState.FAILED)
        logger.info("job %s: pending -> failed, cancelled (stop.flag)", job.id)
        self.retire(job, now)

    def retry_finished(self, job_id: str, state: JobState, now: float) -> None:
        """retry.flag: back to pending as a new attempt that resumes from the latest checkpoint.

        The flag is the durable request, so it goes last: run.json (pending) is written in failed/,
        the folder moves to pending/, then the flag is removed. A crash before the move leaves the
        flag in failed/ (the next watcher honours it again); after it, a pending job whose stray
        flag recovery removes. The old stop.flag goes first: left behind, it would cancel the retry.

        The failure's on_finish hook comes first (docs/workflows.md: once per conclusion): while it is
        due or running the flag waits (a due one is started now), since the move and hook.json's removal
        would drop it.
        """
        paths = JobPaths(self.state.root.job_dir(state, job_id))
        remove_quietly(paths.stop_flag)
        job = load_job(paths.dir, state)
        if job is None:
            remove_quietly(paths.retry_flag)
            logger.warning("job %s: retry.flag ignored (unreadable run.json)", job_id)
            return
        if job.run.get("status") == "rejected" and not self._fixed(job):
            remove_quietly(paths.retry_flag)
            return
        if self.workflows.hook_unfinished(job):
            self._note_retry_waits(job_id)  # the flag stays: honoured on a later pass, once the hook has ended
            return
        self._retry_waits.discard(job_id)
        resume = resume_point(job)
        job.run.update(
            status="pending",
            finished_at=None,
            not_before=None,
            resume_from=resume,
            waiting_for=None,
            diagnosis=None,
            error=None,
            stop_requested_at=None,
        )
        for key in ("stop_requested_by", "reason", "delivered"):
            job.run.pop(key, None)
        job.save()
        self.crashes.reached("retry-saved", job_id)
        job.dir = self.state.folders.requeue(job_id, state)
        self.crashes.reached("retry-moved", job_id)
        remove_quietly(job.paths.retry_flag)
        self.crashes.reached("retry-done", job_id)
        self.state.jobs.move(job, JobState.PENDING)
        self.state.jobs.add(job)
        self.state.report.unfinished(job_id, state)
        events.emit(job.paths, "retrying", now, attempt=job.attempt + 1, after="retry.flag", resume_from=resume)
        self.workflows.workflow_requeued(job, now)
        logger.info(
            "job %s: %s -> pending, retry requested%s",
            job_id,
            state.value,
            f" (resume from {resume})" if resume else "",
        )

    def _note_retry_waits(self, job_id: str) -> None:
        if job_id not in self._retry_waits:
            self._retry_waits.add(job_id)
            logger.info("job %s: retry.flag waits for the on_finish hook of its failure to end", job_id)

    def _fixed(self, job: Job) -> bool:
        """A rejected job whose job.yaml was fixed in place (``trainq edit ID``) may run under its id."""
        from trainq.watcher.spec.errors import InvalidJobSpec

        display = f"failed/{job.id}/job.yaml"
        try:
            if job.spec is None or job.spec.sweep:
                raise InvalidJobSpec(display, [])
            self.state.check_allowed(job.spec, display, f"{job.id}.yaml")
            self.state.check_pool(job.spec, display, job.dir)
        except InvalidJobSpec:
            logger.warning(
                "job %s: retry.flag ignored: its job.yaml is still invalid (or a sweep); fix it "
                "(trainq edit %s) and try again",
                job.id,
                job.id,
            )
            return False
        job.run.update(errors=[], name=job.spec.name or job.run.get("name"), priority=job.spec.priority)
        logger.info("job %s: its fixed job.yaml validates; it runs as a new submission under the same id", job.id)
        return True

    # -- running jobs ------------------------------------------------------------------------
    def watch_running(self, now: float) -> None:
        """Mark stop requests, track health (stalls) and progress of running jobs."""
        self.save_started(now)
        for job in self.state.jobs.in_state(JobState.RUNNING):
            self.guard.guarded(job, "watch", self._watch_one, job, now)

    def _watch_one(self, job: Job, now: float) -> None:
        if not self.state.executor.folder_due(job.paths, job.current_attempt() or {}, now):
            self._note_executor_wait(job)  # from memory (Slurm: once per poll for each job, spread over the polls)
            return
        if job.run.get("status") == "running" and exists(job.paths.stop_flag):
            reason = job.run.get("reason") or flag_reason(job.paths)  # the watcher's own stops set it first
            job.run.update(status="stopping", stop_requested_at=iso_utc(now), reason=reason)
            job.health = "stopping"
            job.save(durable=False)
            logger.info(
                "job %s: stop requested %s (stop.flag); grace %gs",
                job.id,
                REASON_PHRASES.get(reason, reason),
                job.spec.stop_grace_s if job.spec else 0,
            )
            self.state.report.touch()
        if job.run.get("status") == "stopping":
            requested = parse_iso(job.run.get("stop_requested_at")) or now
            grace = job.spec.stop_grace_s if job.spec else 0.0
            self.state.executor.enforce_stop(job.paths, job.current_attempt() or {}, requested, grace, now)
        self._note_executor_wait(job)
        if job.run.get("waiting_for"):  # still in Slurm's queue: nothing written yet, and not stalled
            job.last_activity = now
            return
        if not self._check_node(job, now):
            self._check_stall(job, now)
        self.state.report.update_progress(self.state, job, now)
        self.vitals.check_vitals(job, now)

    def save_started(self, now: float, *, all_now: bool = False) -> None:
        """Write run.json of jobs launched at least STARTED_SAVE_AFTER_S ago (every one with ``all_now``).

        A trivial job is over before that: its one write then carries its final state, which halves
        the run.json writes of a queue of short jobs. ``recover()`` already accepts a run.json that
        lags the supervisor's start record, so a crash in this window loses nothing.
        """
        for job in self.state.jobs.in_state(JobState.RUNNING):
            if job.unsaved_since is not None and (all_now or now - job.unsaved_since >= STARTED_SAVE_AFTER_S):
                self.guard.guarded(job, "start", job.save, durable=False)  # clears unsaved_since

    def next_started_save_s(self, now: float) -> float | None:
        """Seconds until the next deferred run.json write is due; None when none waits."""
        due = [j.unsaved_since for j in self.state.jobs.in_state(JobState.RUNNING) if j.unsaved_since is not None]
        return max(0.0, min(due) + STARTED_SAVE_AFTER_S - now) if due else None

    def _note_executor_wait(self, job: Job) -> None:
        reason = self.state.executor.waiting_for(job.paths, job.current_attempt() or {})
        if job.run.get("waiting_for") != reason:
            job.run["waiting_for"] = reason
            self.state.report.touch()

    def _check_node(self, job: Job, now: float) -> bool:
        """The executor's word on the node (Slurm: its heartbeat stopped): health "stalled" while it says so."""
        said = self.state.executor.health(job.paths, job.current_attempt() or {}, now)
        if said is None:
            if job.health == "stalled" and job.run.get("health_reason"):
                job.health = "healthy"
                job.run.pop("health_reason", None)
                self.state.report.touch()
            return False
        if job.health != "stalled" or job.run.get("health_reason") != said.split(" for ")[0]:
            logger.warning("job %s: stalled: %s", job.id, said)
            job.health = "stalled"
            job.run["health_reason"] = said.split(" for ")[0]
            self.state.report.touch()
        return True

    def _check_stall(self, job: Job, now: float) -> None:
        stall_after = job.spec.stall_after_s if job.spec else None
        if not stall_after:
            return
        if job.run.get("stop_after_stacks") and not self.vitals.stacks_pending(job):
            job.run.pop("stop_after_stacks")
            raise_flag(job.paths.stop_flag, REASON_STALLED)
        sig = tuple(_mtime(p) for p in (job.paths.log, job.paths.metrics))
        if sig != job.activity_sig:
            job.activity_sig, job.last_activity = sig, now
            if job.health == "stalled":
                job.health = "healthy"
                self.state.report.touch()
            return
        if job.health != "healthy" or now - job.last_activity < stall_after:
            return
        job.health = "stalled"
        logger.warning("job %s: stalled: no new output for %gs", job.id, now - job.last_activity)
        self.vitals.capture_stacks(job, f"stalled for {now - job.last_activity:.0f}s")
        self.state.report.touch()
        if "stalled" in job.known_spec.retries.on and not exists(job.paths.stop_flag):  # opted in, not stopped already
            job.run.update(stop_requested_by=REASON_STALLED, reason=REASON_STALLED, stall_after_s=stall_after)
            job.save(durable=False)
            if self.vitals.stacks_pending(job):
                job.run["stop_after_stacks"] = True  # stopped once its stacks are recorded (vitals.py)
            else:
                raise_flag(job.paths.stop_flag, REASON_STALLED)


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
