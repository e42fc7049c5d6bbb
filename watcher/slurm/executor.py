"""``executor: slurm``: each attempt's supervisor runs as a Slurm batch job on one of the cluster's nodes.

``launch`` writes ``launch.json`` (the LaunchSpec, mode 0600) and ``slurm.sh`` into the job folder, records the
submission in ``slurm.json`` *before* running ``sbatch`` (its tag: ``--comment=trainq:<queue>:<job>:<attempt>:
<token>``), and hands sbatch to a worker thread (submit.py), so the loop never waits for the controller. On the
node, slurm.sh checks that the job folder is visible and execs ``python -m trainq.watcher.slurm.node`` (claim,
heartbeat, the supervisor in the foreground).

Liveness: Slurm's job state is the authority (one background ``squeue -j <the queue's ids>`` per interval, backed
off while nothing changes: polling.py); while Slurm says RUNNING the node's heartbeat must move, and when Slurm
says a job ended, its node's exit record, ``heartbeat.json`` and — where flock works on the shared filesystem —
the supervisor's lock decide (liveness.py). An sbatch that got no answer is never repeated blindly: the
submission stays *unconfirmed* until its tag shows up in squeue (adopted), the node's claim file names it, or a
full ``squeue -t all`` proves it does not exist (then it is submitted again under the same tag).

This class holds the state and the Executor protocol; submitting.py, polling.py and liveness.py are its parts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trainq.watcher.slurm.batch import (
    SlurmOptions,
    array_script,
    batch_env,
    batch_script,
    sbatch_env,
    signal_lead_s,
    time_limit_min,
)
from trainq.watcher.slurm.node import HEARTBEAT_S
from trainq.watcher.slurm.records import (
    LIMIT_RETRY_S,
    Held,
    Inflight,
    Unconfirmed,
    attempt_ended,
    refresh_listing,
    signalled,
    with_slurm_view,
)
from trainq.watcher.slurm.state import (
    EXIT_NOT_SHARED,
    GONE,
    QUEUED_STATES,
    RUNNING_STATES,
    SlurmJob,
    SqueueQuery,
    ended_outcome,
    queue_key,
)
from trainq.watcher.slurm.submit import Submitter
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import ExecutorUnavailable
from trainq.watcher.spec.fsutil import read_json
from trainq.watcher.supervisor import LaunchSpec, lock_state

if TYPE_CHECKING:
    from trainq.watcher.spec.config import WatcherConfig

from trainq.watcher.slurm.liveness import EXIT_READS_PER_S, Liveness
from trainq.watcher.slurm.polling import Polling
from trainq.watcher.slurm.submitting import Submitting

__all__ = [
    "EXIT_NOT_SHARED",
    "SlurmExecutor",
    "SlurmJob",
    "SlurmOptions",
    "array_script",
    "batch_env",
    "batch_script",
    "ended_outcome",
    "signal_lead_s",
    "time_limit_min",
]

logger = logging.getLogger(__name__)

#: seconds after stop_grace + kill_after before enforce_stop falls back to scancel (the supervisor goes first)
SCANCEL_MARGIN_S = 10.0
#: sbatch, scancel, scontrol and the tag lookup get this long (s); sbatch gives up by itself after MessageTimeout
COMMAND_TIMEOUT_S = 60.0
#: a heartbeat unchanged for this many periods (by the watcher's own clock) while Slurm says RUNNING: health "stalled";
#: after Slurm said the job ended: the node-side supervisor is gone
HEARTBEAT_STALE_PERIODS = 3
#: a heartbeat unchanged for this many periods while Slurm says RUNNING: the node is lost; scancel, retried as preempted
HEARTBEAT_DEAD_PERIODS = 18
#: the longest wait between two polls while nothing changes (s; watcher.yaml slurm.poll_max_s)
DEFAULT_POLL_MAX_S = 30.0


class SlurmExecutor(Submitting, Polling, Liveness):
    """Attempts run as Slurm batch jobs; the Executor protocol of watcher/daemon/executor.py."""

    name = "slurm"
    #: Slurm places GPUs and memory on its nodes: admission must not gate on this machine's
    places_resources = True
    inherits_environment = True  # a batch job adds to its node's environment (SLURM_*, the rendezvous variables)
    job_ref_field = "slurm_job_id"

    def __init__(self, config: WatcherConfig, root: Path):
        slurm = dict(config.slurm or {})
        self.root = Path(root)
        self.key = queue_key(self.root)
        self.partition: str | None = slurm.get("partition")
        self.sbatch_args = tuple(str(a) for a in slurm.get("sbatch_args") or ())
        self.poll_s = float(slurm.get("poll_s") or 2.0)
        self.arrays = bool(slurm.get("arrays", True))
        self.exit_grace_s = float(slurm.get("exit_grace_s", 60.0))
        self.passthrough = frozenset(getattr(config, "env_passthrough", None) or ())
        self.node_env = str(slurm.get("node_env") or "clean")
        self.sbatch_env = sbatch_env(dict(os.environ), self.node_env)
        self.kill_after_s = float(config.kill_after_s)
        self.scancel_margin_s = SCANCEL_MARGIN_S
        self.command_timeout_s = COMMAND_TIMEOUT_S
        self.heartbeat_s = float(slurm.get("heartbeat_s") or HEARTBEAT_S)
        self.heartbeat_stale_s = HEARTBEAT_STALE_PERIODS * self.heartbeat_s
        self.heartbeat_dead_s = HEARTBEAT_DEAD_PERIODS * self.heartbeat_s
        self.poll_max_s = max(self.poll_s, float(slurm.get("poll_max_s") or DEFAULT_POLL_MAX_S))
        self.array_limit = int(slurm.get("array_limit") or 0) or None
        self.limit_retry_s = LIMIT_RETRY_S
        self.python = sys.executable
        self.package_parent = str(Path(__file__).resolve().parent.parent.parent)
        self._jobs: dict[str, SlurmJob] = {}
        self._tracked: set[str] = set()
        self._ended_seen: dict[str, float] = {}
        self._cancelled: set[str] = set()
        self._unconfirmed: dict[str, Unconfirmed] = {}
        self._beats: dict[str, tuple[object, float]] = {}
        self._exit_read_mono: dict[str, float] = {}
        self._folder_period: dict[str, int] = {}  # job folder -> the poll_s period it was last looked at in
        self._seeded: set[str] = set()
        self._query: SqueueQuery | None = None
        self._last_query_mono = -math.inf
        self._probe_wanted_mono = -math.inf
        self._down: str | None = None
        self._held: list[Held] = []
        self._to_cancel: dict[str, str] = {}  # Slurm job id -> the job it belongs to, for one scancel per tick
        self._interval_s = self.poll_s  # the wait between polls: poll_s, doubled while nothing changes
        self._listed_all = False  # the first poll lists all of the user's jobs (duplicates of ours, found once)
        self._accounting: bool | None = None  # slurmdbd answers sacct (asked once, at the first poll)
        self._tracked_at: dict[str, float] = {}  # Slurm job id -> when it was first tracked (monotonic)
        self._running_at: dict[str, float] = {}  # Slurm job id -> when a poll first showed it running
        self._last_known: dict[str, str] = {}  # Slurm job id -> "RUNNING on node n1 at <time>", for a purged job
        self._node_lost: dict[str, str] = {}  # Slurm job id -> why trainq cancelled it as a lost node
        self._submitter = Submitter(self.command_timeout_s, self.sbatch_env)
        self._inflight: dict[str, Inflight] = {}  # the first job folder of a submission -> it
        self._inflight_dirs: dict[str, str] = {}  # every job folder in flight -> its submission's key
        self._answers: list[tuple[str, str | None, Exception | None]] = []  # for the next flush
        self._refused_dirs: dict[str, str] = {}  # job id -> folder of a refusal the next flush hands over

    # -- the Executor protocol -----------------------------------------------------------------
    def unavailable(self, now: float) -> str | None:
        """ "Slurm is not reachable: ..." after the last squeue or sbatch failed so; checked once per poll_s."""
        self._probe_wanted_mono = time.monotonic()
        self._poll(start=True)
        return self._down

    def problems(self) -> list[str]:
        return []  # nothing starts here; an unreachable Slurm is each waiting job's waiting_for (unavailable)

    def launch(
        self, spec: LaunchSpec, job_name: str, slurm_options: dict | None, group: tuple[str, int] | None = None
    ) -> dict:
        """Record the submission in slurm.json, then hand sbatch to the worker; the Slurm job id comes from ``flush``.

        A sweep's job (``group`` = sweep id and index) is only prepared here: ``flush`` submits the attempts
        launched in one pass together, one ``sbatch --array`` per sweep and attempt.
        """
        if self._down is not None:
            raise ExecutorUnavailable(self._down)
        paths, spec, options = self._prepare(spec, job_name, slurm_options or {})
        # the array's script finds a task's folder from its index: <sweep>-$SLURM_ARRAY_TASK_ID
        if group is not None and self.arrays and paths.dir.name == f"{group[0]}-{group[1]}":
            self._held.append(Held(paths, spec.attempt, group[0], group[1], options))
            return {"slurm_job_id": None, "pid": None}
        self._submit_one(paths, spec.attempt, options)
        return {"slurm_job_id": None, "pid": None}

    def describe(self, record: dict) -> str:
        ref = record.get(self.job_ref_field)
        return f"slurm job {ref}" if ref else "Slurm job id not known yet"

    def flush(self) -> list[tuple[str, str | None, Exception | None]]:
        """Hand what ``launch`` held back to the sbatch worker (one ``sbatch --array`` per sweep, attempt and set
        of sbatch options), and return the submissions answered since the last call.

        Returns (job id, Slurm job id or None while unconfirmed, error) for each answered attempt. An array Slurm
        refuses (a cluster's MaxArraySize, say) is submitted again job by job, so only the jobs Slurm itself
        refuses fail.
        """
        held, self._held = self._held, []
        groups: dict[tuple, list[Held]] = {}
        for member in held:
            groups.setdefault((member.sweep, member.attempt, member.options.shared()), []).append(member)
        for members in groups.values():
            if self._down is not None:
                self._answers += [(m.paths.dir.name, None, ExecutorUnavailable(self._down)) for m in members]
            elif len(members) > 1:
                self._submit_array(members)
            else:
                self._submit_one(members[0].paths, members[0].attempt, members[0].options)
        self._collect_answers()
        answers, self._answers = self._answers, []
        for folder in self._refused_dirs.values():  # the daemon takes these from here: no longer being submitted
            self._inflight_dirs.pop(folder, None)
        self._refused_dirs.clear()
        return answers

    def reap(self) -> None:
        """Collect a finished squeue and start the next one when due, and run the scancel asked for; never blocks
        for long."""
        self._poll(start=True)
        self._flush_cancels()
        self._collect_answers()

    def is_alive(self, paths: JobPaths, attempt: dict) -> bool:
        """Slurm's state first; once Slurm says the job ended: the heartbeat, the lock (where flock works), a grace."""
        if self._submitting(paths):
            return True
        slurm_id = self._slurm_id(paths, attempt)
        if slurm_id is None:
            return self._unconfirmed_for(paths, attempt) is not None or lock_state(paths) is True
        job = self._state(slurm_id)
        if job is None or job.is_live:
            return True  # unknown (not asked yet, or Slurm unreachable) is never taken for dead
        if self._node_still_alive(paths, slurm_id):
            return True
        return job.state != GONE and self._within_grace(paths, slurm_id)

    def read_started(self, paths: JobPaths) -> dict | None:
        """The supervisor's start record; before it exists, what slurm.json says was submitted (if not finished)."""
        started = read_json(paths.started)
        if started is not None:
            return started
        submitted = read_json(paths.slurm_record) or {}
        if not submitted.get("attempt") or attempt_ended(paths, submitted.get("attempt")):
            return None
        # recovery needs this when the watcher died between sbatch and run.json: the attempt exists in Slurm
        return {
            "attempt": submitted.get("attempt"),
            "supervisor_pid": None,
            "job_pid": None,
            "started_at": submitted.get("submitted_at"),
            "slurm_job_id": submitted.get("slurm_job_id"),
        }

    def read_exit(self, paths: JobPaths, attempt: dict) -> dict | None:
        """The node's exit record once it can be final; or, once Slurm ended the job without one, one written here.

        While Slurm shows the batch job queued nothing is read. While it runs, exit.json is read within an overall
        budget of EXIT_READS_PER_S (each of N running jobs every max(tick, N / budget) s): a few jobs end as fast
        as locally, many cost the shared filesystem a bounded rate and end at the latest when squeue sees them go.
        While Slurm's answer is unknown the folder is looked at once per poll_s.
        """
        if self._submitting(paths):
            return None
        slurm_id = self._slurm_id(paths, attempt)
        if slurm_id is None:
            return None if self._unconfirmed_for(paths, attempt) else self._own_record(paths, attempt)
        job = self._state(slurm_id)
        if job is not None and job.state in QUEUED_STATES and slurm_id not in self._seeded:
            self._look_for_a_start(paths, attempt, slurm_id)
            return None
        running = job is not None and (job.state in RUNNING_STATES or slurm_id in self._seeded)
        unsettled = not running and (job is None or not (job.has_ended or job.state == GONE))  # COMPLETING, unknown
        if running and not self._exit_read_due(slurm_id, len(self._tracked) / EXIT_READS_PER_S):
            return None
        if unsettled and not self._exit_read_due(slurm_id, self.poll_s):
            return None
        ended = job is not None and (job.has_ended or job.state == GONE)
        record = self._own_record(paths, attempt)
        if record is not None and not ended:
            self._wake_poll()  # the end is in: ask Slurm for its final word soon
            if self._requeues(paths):
                return None  # a requeueing job's record is final only once Slurm says the job ended
            if signalled(record) and (job is not None or self._down is None):
                # Slurm's final state says who sent it: its OOM handling, scancel, a preemption. Not asked yet (a
                # watcher restarted after the end): wait for the first poll, unless Slurm cannot be reached
                return None
        if record is not None:
            return self._final(
                with_slurm_view(record, slurm_id, job, paths, self._cancelled_by(paths, slurm_id)), slurm_id
            )
        if job is None or not ended or attempt.get("ended_at"):
            return None
        if self._node_still_alive(paths, slurm_id) or self._within_grace(paths, slurm_id):
            return None
        refresh_listing(paths.dir)  # an NFS client may cache "no exit.json"; listing the folder revalidates
        if job.state == GONE and slurm_id in self._cancelled:
            job = dataclasses.replace(job, state="CANCELLED")  # cancelled by us before Slurm showed it
        if not self._exit_read_due(f"{slurm_id}#synth", self.poll_s):
            return None
        record = self._own_record(paths, attempt) or self._synthesize(paths, attempt, slurm_id, job)
        if record is None:
            return None  # the folder cannot be written now: concluded once it can
        return self._final(with_slurm_view(record, slurm_id, job, paths, self._cancelled_by(paths, slurm_id)), slurm_id)

    def kill_leftovers(self, paths: JobPaths, attempt: dict) -> int:
        """Nothing of the attempt runs on this machine; a batch job Slurm still holds is cancelled."""
        slurm_id = self._slurm_id(paths, attempt)
        job = self._jobs.get(slurm_id) if slurm_id else None
        if job is not None and slurm_id is not None and job.is_live:
            self._scancel(slurm_id, paths)
        return 0

    def process_tree(self, paths: JobPaths) -> list[int]:
        return []  # the attempt runs on a Slurm node, not here

    def waiting_for(self, paths: JobPaths, attempt: dict) -> str | None:
        """ "Slurm: Resources" (Slurm's pending reason) while the batch job is queued, else None."""
        slurm_id = None if self._submitting(paths) else self._slurm_id(paths, attempt)
        if self._submitting(paths):
            return "Slurm: being submitted (sbatch)"
        if slurm_id is None and attempt and self._unconfirmed_for(paths, attempt):
            return "Slurm: submission not confirmed (sbatch got no answer); looking for it by its tag"
        job = self._state(slurm_id) if slurm_id else None
        if job is None:
            return self._down if slurm_id and self._down and not paths.started.exists() else None
        if job.state in QUEUED_STATES:
            reason = job.reason if job.reason and job.reason != "None" else "queued"
            return f"Slurm: {reason}"
        if job.state == "SUSPENDED":
            return "Slurm: suspended"
        return None

    def enforce_stop(
        self, paths: JobPaths, attempt: dict, stop_requested_at: float, grace_s: float, now: float
    ) -> None:
        """scancel a stopped job at once while Slurm still queues it, else after grace + kill_after + a margin."""
        slurm_id = self._slurm_id(paths, attempt)
        job = self._state(slurm_id) if slurm_id else None
        if (
            job is None
            or slurm_id is None
            or not job.is_live
            or slurm_id in self._cancelled
            or slurm_id in self._to_cancel
        ):
            return
        # the last poll may be older than the job's start (polls space out while nothing changes)
        queued = job.state in QUEUED_STATES and (read_json(paths.started) or {}).get("attempt") != attempt.get("n")
        if queued or now - stop_requested_at >= grace_s + self.kill_after_s + self.scancel_margin_s:
            why = "still queued in Slurm" if queued else "its supervisor did not end it in time"
            logger.info("job %s: scancel %s (stop requested, %s)", paths.dir.name, slurm_id, why)
            self._scancel(slurm_id, paths)

    def folder_due(self, paths: JobPaths, attempt: dict, now: float) -> bool:
        """Each job's folder (stop.flag, progress) is looked at once per poll_s, not every tick: a shared
        filesystem then sees a rate set by the job count over poll_s, and stop.flag is noticed within poll_s.
        Every job falls due in the same tick (poll_s periods counted from one clock), so stopping a whole sweep
        is one scancel."""
        key = str(paths.dir)
        period = math.floor(time.monotonic() / self.poll_s)
        if self._folder_period.get(key) == period:
            return False
        if len(self._folder_period) > 4 * len(self._tracked) + 1000:
            self._folder_period.clear()  # finished jobs' entries; at worst one early look each
        self._folder_period[key] = period
        return True

    def start(self) -> None:
        return None  # sbatch and squeue run on demand

    def wake_fds(self) -> list[int]:
        return [self._submitter.wake_fd()]  # an sbatch answered; Slurm's other news arrives by polling squeue

    def close(self) -> None:
        if self._query is not None:
            self._query.close()
            self._query = None
        self._submitter.close()
