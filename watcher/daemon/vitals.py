"""A running job's vital signs, on the watcher's side (``Vitals``, a Watcher step; issue 30).

- A command job that declares ``expected_lr`` has each logged lr checked against that schedule
  (spec/lrschedule.py): the first deviation becomes an ``event`` record in its metrics.jsonl, a line in
  watcher.log and in ``trainq why``; with ``abort_on_lr_deviation: true`` the job is stopped the way a
  stop.flag stops it and ends ``failed`` with diagnosis ``schedule``.
- When the stall detector fires, the Python stacks of the job's processes are recorded with py-spy
  (supervisor/stacks.py, a detached runner: the loop never waits on it); the stalled diagnosis quotes
  the main thread's innermost frames.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from typing import TYPE_CHECKING, cast

from trainq.watcher.daemon.jobs import Job
from trainq.watcher.spec.fsutil import raise_flag
from trainq.watcher.spec.interpreter import safe_module_argv
from trainq.watcher.spec.lrschedule import lr_deviation
from trainq.watcher.spec.records import append_record
from trainq.watcher.spec.units import iso_utc

if TYPE_CHECKING:
    from trainq.watcher.daemon.executor import Executor
    from trainq.watcher.daemon.report import Report

logger = logging.getLogger(__name__)

#: run.json's ``stop_requested_by`` for a command job stopped off its declared lr schedule
STOPPED_BY_SCHEDULE = "schedule"
#: longest a stalled job's stop waits for its stacks to be recorded, seconds
STACKS_WAIT_S = 30.0


class Vitals:
    """Checks declared lr schedules and records the stacks of stalled jobs.

    Reads ``executor`` (a job's process tree); changes a running job's run.json (``lr_deviation``, a stop
    off schedule) and touches ``report``; owns the py-spy runners it starts.
    """

    def __init__(self, executor: Executor, report: Report) -> None:
        self.executor = executor
        self.report = report
        self._stack_runners: dict[str, tuple[subprocess.Popen, float]] = {}

    def check_vitals(self, job: Job, now: float) -> None:
        """Look at the metrics records this pass read for ``job``."""
        self._reap_stack_runners()
        readers = job.readers
        if readers is None or job.spec is None or job.spec.is_train:
            return  # the built-in trainer checks its own schedule (trainer/vitals.py)
        plan = job.spec.raw.get("expected_lr")
        if not plan or (job.run.get("lr_deviation") or {}).get("attempt") == job.attempt:
            return
        for record in readers.metrics.new_records:
            step, lr = record.get("step"), record.get("lr")
            if record.get("type", "step") != "step" or type(step) is not int or type(lr) not in (int, float):
                continue
            words = lr_deviation(plan, step, float(cast(float, lr)))  # an int or a float (checked above)
            if words:
                self._off_schedule(job, step, words, now)
                return

    def _off_schedule(self, job: Job, step: int, words: str, now: float) -> None:
        job.run["lr_deviation"] = {"attempt": job.attempt, "step": step, "words": words, "at": iso_utc(now)}
        logger.warning("job %s: off its declared lr schedule: %s", job.id, words)
        append_record(
            job.paths.metrics,
            {
                "type": "event",
                "event": "schedule",
                "message": words,
                "step": step,
                "written_by": "watcher",
                "time": now,
            },
        )
        if job.known_spec.raw.get("abort_on_lr_deviation") is True and job.run.get("status") == "running":
            job.run.update(stop_requested_by=STOPPED_BY_SCHEDULE, reason="watcher")
            raise_flag(job.paths.stop_flag, "watcher")
            logger.info("job %s: stopping it (abort_on_lr_deviation); it ends failed, diagnosis schedule", job.id)
        job.save(durable=False)
        self.report.touch()

    def capture_stacks(self, job: Job, why: str = "stalled") -> None:
        """Start the py-spy runner on the job's processes (detached; the loop never waits on it)."""
        pids = [int(p) for p in self.executor.process_tree(job.paths)]
        if not pids:
            return
        self._stack_runners[job.id] = (
            subprocess.Popen(
                [
                    *safe_module_argv(sys.executable, "trainq.watcher.supervisor.stacks"),
                    str(job.paths.dir),
                    *map(str, pids),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            ),
            time.monotonic(),
        )
        logger.info("job %s: %s; recording the stacks of %d process(es) in %s/stacks/", job.id, why, len(pids), job.id)

    def stacks_pending(self, job: Job) -> bool:
        """True while the job's stack runner still works (at most STACKS_WAIT_S): a stop waits for it, so the
        stacks are of the stalled processes, not of their teardown."""
        runner = self._stack_runners.get(job.id)
        return runner is not None and runner[0].poll() is None and time.monotonic() - runner[1] < STACKS_WAIT_S

    def _reap_stack_runners(self) -> None:
        for job_id, (proc, _started) in list(self._stack_runners.items()):
            if proc.poll() is not None:
                del self._stack_runners[job_id]
