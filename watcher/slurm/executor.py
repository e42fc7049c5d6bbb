"""``executor: slurm``: each attempt's supervisor runs as a Slurm batch job on one of the cluster's nodes.

``launch`` writes ``launch.json`` (the LaunchSpec, mode 0600) and ``slurm.sh`` into the job folder, records the
submission in ``slurm.json`` *before* running ``sbatch`` (its tag: ``--comment=trainq:<queue>:<job>:<attempt>:
<token>``), and submits. On the node, slurm.sh checks that the job folder is visible and execs
``python -m trainq.watcher.slurm.node`` (claim, heartbeat, the supervisor in the foreground).

Liveness: Slurm's job state is the authority (one background ``squeue`` per ``poll_s`` for every job, see
slurm_state.py); when Slurm says a job ended, its node's exit record, ``heartbeat.json`` and — where flock works
on the shared filesystem — the supervisor's lock decide. An sbatch that got no answer is never repeated blindly:
the submission stays *unconfirmed* until its tag shows up in squeue (adopted), the node's claim file names it,
or a full ``squeue -t all`` proves it does not exist (then it is submitted again under the same tag).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import SpawnFailed
from trainq.watcher.daemon.executor import ExecutorUnavailable
from trainq.watcher.spec.fsutil import atomic_write, atomic_write_json, read_json
from trainq.watcher.slurm.node import HEARTBEAT_S
from trainq.watcher.slurm.batch import (
    SlurmOptions, array_script, batch_env, batch_script, effective_time_min, signal_lead_s, srun_argv, time_limit_min,
)
from trainq.watcher.slurm.state import (
    CANCELLED_ADVICE, CANCELLED_OUTSIDE, EXIT_NOT_SHARED, GONE, LIMITED, NO_ANSWER, PER_JOB_LIMIT, QUEUED_CANCEL_REASON,
    QUEUED_STATES, REFUSED, RUNNING_STATES, SIGKILL, SIGNAL_NAMES, SIGTERM, SLURM_OUTPUT, SlurmJob, SqueueQuery,
    accounting_enabled, array_spec, array_task_id, cancelled_evidence, duplicate_key, ended_outcome, find_tagged,
    first_line, id_order, killed_for_memory, make_array_tag, make_tag, oom_evidence, parse_squeue, queue_key,
    query_ids, run,
    sacct_jobs,
)
from trainq.watcher.slurm.submit import Answer, Submitter
from trainq.watcher.slurm.ranks import real_rank_exit
from trainq.watcher.supervisor import LaunchSpec, lock_state
from trainq.watcher.spec.units import iso_utc

if TYPE_CHECKING:
    from trainq.watcher.spec.config import WatcherConfig

__all__ = ["EXIT_NOT_SHARED", "SlurmExecutor", "SlurmJob", "SlurmOptions", "array_script", "batch_env",
           "batch_script", "ended_outcome", "signal_lead_s", "time_limit_min"]

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
#: how long a job refused by a QOS/association submit limit waits before it is submitted again (s)
LIMIT_RETRY_S = 30.0
#: squeue answers that must miss an unconfirmed submission's tag before a full lookup may resubmit it
UNCONFIRMED_POLLS = 2
#: reads of running jobs' exit.json per second, all jobs together (the shared filesystem's budget)
EXIT_READS_PER_S = 50.0
#: at most this many ended jobs are asked about (scontrol) per poll; the rest wait for the next one
MAX_DEPARTED_PER_POLL = 50


@dataclass
class _Unconfirmed:
    """A submission whose sbatch got no answer: it may or may not exist in Slurm."""

    paths: JobPaths
    attempt: int
    tag: str
    argv: list[str]
    missed: int = 0
    index: int | None = None  # the job's task in a job array (its sweep index); None for a job of its own


@dataclass
class _Inflight:
    """A submission handed to the sbatch worker and not answered yet: one job, or a sweep's array (``members``)."""

    paths: JobPaths
    attempt: int
    tag: str
    argv: list[str]
    members: list["_Held"] | None = None


class SubmitLimited(ExecutorUnavailable):
    """Raised when a QOS or association limit refuses a submission for now: the job waits and is submitted again."""

    def __init__(self, message: str, retry_after_s: float = LIMIT_RETRY_S):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SlurmRejected(SpawnFailed):
    """Raised when sbatch refuses a job for a reason that will not change (a bad partition, account or option)."""

    rejected = True


@dataclass
class _Held:
    """A sweep job's attempt that ``launch`` prepared and ``flush`` submits with its sweep's others."""

    paths: JobPaths
    attempt: int
    sweep: str
    index: int
    options: SlurmOptions


class SlurmExecutor:
    """Attempts run as Slurm batch jobs; the Executor protocol of watcher/executor.py."""

    name = "slurm"
    #: Slurm places GPUs and memory on its nodes: admission must not gate on this machine's
    places_resources = True

    def __init__(self, config: "WatcherConfig", root: Path):
        slurm = dict(config.slurm or {})
        self.root = Path(root)
        self.key = queue_key(self.root)
        self.partition: str | None = slurm.get("partition")
        self.sbatch_args = tuple(str(a) for a in slurm.get("sbatch_args") or ())
        self.poll_s = float(slurm.get("poll_s") or 2.0)
        self.arrays = bool(slurm.get("arrays", True))
        self.exit_grace_s = float(slurm.get("exit_grace_s", 60.0))
        self.passthrough = frozenset(getattr(config, "env_passthrough", None) or ())
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
        self._unconfirmed: dict[str, _Unconfirmed] = {}
        self._beats: dict[str, tuple[object, float]] = {}
        self._exit_read_mono: dict[str, float] = {}
        self._folder_period: dict[str, int] = {}  # job folder -> the poll_s period it was last looked at in
        self._seeded: set[str] = set()
        self._query: SqueueQuery | None = None
        self._last_query_mono = -math.inf
        self._probe_wanted_mono = -math.inf
        self._down: str | None = None
        self._held: list[_Held] = []
        self._to_cancel: dict[str, str] = {}  # Slurm job id -> the job it belongs to, for one scancel per tick
        self._interval_s = self.poll_s  # the wait between polls: poll_s, doubled while nothing changes
        self._listed_all = False  # the first poll lists all of the user's jobs (duplicates of ours, found once)
        self._accounting: bool | None = None  # slurmdbd answers sacct (asked once, at the first poll)
        self._tracked_at: dict[str, float] = {}  # Slurm job id -> when it was first tracked (monotonic)
        self._running_at: dict[str, float] = {}  # Slurm job id -> when a poll first showed it running
        self._last_known: dict[str, str] = {}  # Slurm job id -> "RUNNING on node n1 at <time>", for a purged job
        self._node_lost: dict[str, str] = {}  # Slurm job id -> why trainq cancelled it as a lost node
        self._submitter = Submitter(self.command_timeout_s)
        self._inflight: dict[str, _Inflight] = {}  # the first job folder of a submission -> it
        self._inflight_dirs: dict[str, str] = {}  # every job folder in flight -> its submission's key
        self._answers: list[tuple[str, str | None, Exception | None]] = []  # for the next flush
        self._refused_dirs: dict[str, str] = {}  # job id -> folder of a refusal the next flush hands over

    # -- the Executor protocol -----------------------------------------------------------------
    def unavailable(self, now: float) -> str | None:
        """"Slurm is not reachable: ..." after the last squeue or sbatch failed so; checked once per poll_s."""
        self._probe_wanted_mono = time.monotonic()
        self._poll(start=True)
        return self._down

    def launch(self, spec: LaunchSpec, job_name: str, slurm_options: dict | None,
               group: tuple[str, int] | None = None) -> dict:
        """Record the submission in slurm.json, then hand sbatch to the worker; the Slurm job id comes from ``flush``.

        A sweep's job (``group`` = sweep id and index) is only prepared here: ``flush`` submits the attempts
        launched in one pass together, one ``sbatch --array`` per sweep and attempt.
        """
        if self._down is not None:
            raise ExecutorUnavailable(self._down)
        paths, spec, options = self._prepare(spec, job_name, slurm_options or {})
        # the array's script finds a task's folder from its index: <sweep>-$SLURM_ARRAY_TASK_ID
        if group is not None and self.arrays and paths.dir.name == f"{group[0]}-{group[1]}":
            self._held.append(_Held(paths, spec.attempt, group[0], group[1], options))
            return {"slurm_job_id": None, "pid": None}
        self._submit_one(paths, spec.attempt, options)
        return {"slurm_job_id": None, "pid": None}

    def flush(self) -> list[tuple[str, str | None, Exception | None]]:
        """Hand what ``launch`` held back to the sbatch worker (one ``sbatch --array`` per sweep, attempt and set
        of sbatch options), and return the submissions answered since the last call.

        Returns (job id, Slurm job id or None while unconfirmed, error) for each answered attempt. An array Slurm
        refuses (a cluster's MaxArraySize, say) is submitted again job by job, so only the jobs Slurm itself
        refuses fail.
        """
        held, self._held = self._held, []
        groups: dict[tuple, list[_Held]] = {}
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
        if not submitted.get("attempt") or _attempt_ended(paths, submitted.get("attempt")):
            return None
        # recovery needs this when the watcher died between sbatch and run.json: the attempt exists in Slurm
        return {"attempt": submitted.get("attempt"), "supervisor_pid": None, "job_pid": None,
                "started_at": submitted.get("submitted_at"), "slurm_job_id": submitted.get("slurm_job_id")}

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
        if job is not None and (job.state in RUNNING_STATES or slurm_id in self._seeded):
            if not self._exit_read_due(slurm_id, len(self._tracked) / EXIT_READS_PER_S):
                return None
        elif job is None or not (job.has_ended or job.state == GONE):  # COMPLETING, or Slurm unknown
            if not self._exit_read_due(slurm_id, self.poll_s):
                return None
        ended = job is not None and (job.has_ended or job.state == GONE)
        record = self._own_record(paths, attempt)
        if record is not None and not ended:
            self._wake_poll()  # the end is in: ask Slurm for its final word soon
            if self._requeues(paths):
                return None  # a requeueing job's record is final only once Slurm says the job ended
            if _signalled(record) and job is not None:
                return None  # Slurm's final state says who sent it: its OOM handling, scancel, a preemption
        if record is not None:
            return self._final(_with_slurm_view(record, slurm_id, job, paths, self._cancelled_by(paths, slurm_id)),
                               slurm_id)
        if job is None or not ended or attempt.get("ended_at"):
            return None
        if self._node_still_alive(paths, slurm_id) or self._within_grace(paths, slurm_id):
            return None
        _refresh_listing(paths.dir)  # an NFS client may cache "no exit.json"; listing the folder revalidates
        if job.state == GONE and slurm_id in self._cancelled:
            job = dataclasses.replace(job, state="CANCELLED")  # cancelled by us before Slurm showed it
        if not self._exit_read_due(f"{slurm_id}#synth", self.poll_s):
            return None
        record = self._own_record(paths, attempt) or self._synthesize(paths, attempt, slurm_id, job)
        if record is None:
            return None  # the folder cannot be written now: concluded once it can
        return self._final(_with_slurm_view(record, slurm_id, job, paths, self._cancelled_by(paths, slurm_id)),
                           slurm_id)

    def _final(self, record: dict, slurm_id: str) -> dict:
        self._exit_read_mono.pop(f"{slurm_id}#synth", None)
        self._forget(slurm_id)
        return record

    def _look_for_a_start(self, paths: JobPaths, attempt: dict, slurm_id: str) -> None:
        """While the polls are spaced out, a queued job whose supervisor started brings them back to poll_s."""
        if self._interval_s <= self.poll_s:
            return
        if not self._exit_read_due(slurm_id, max(self.poll_s, len(self._tracked) / EXIT_READS_PER_S)):
            return
        if (read_json(paths.started) or {}).get("attempt") == attempt.get("n"):
            self._wake_poll()

    def _cancelled_by(self, paths: JobPaths, slurm_id: str) -> str | None:
        """Why trainq itself scancelled ``slurm_id`` (a lost node, a stop), or None when it did not."""
        if slurm_id in self._node_lost:
            return self._node_lost[slurm_id]
        lost = (read_json(paths.slurm_record) or {}).get("node_lost")
        if isinstance(lost, str) and lost:
            return lost
        return "cancelled by trainq" if slurm_id in self._cancelled else None

    def kill_leftovers(self, paths: JobPaths, attempt: dict) -> int:
        """Nothing of the attempt runs on this machine; a batch job Slurm still holds is cancelled."""
        slurm_id = self._slurm_id(paths, attempt)
        job = self._jobs.get(slurm_id) if slurm_id else None
        if job is not None and job.is_live:
            self._scancel(slurm_id, paths)
        return 0

    def process_tree(self, paths: JobPaths) -> list[int]:
        return []  # the attempt runs on a Slurm node, not here

    def waiting_for(self, paths: JobPaths, attempt: dict) -> str | None:
        """"Slurm: Resources" (Slurm's pending reason) while the batch job is queued, else None."""
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

    def health(self, paths: JobPaths, attempt: dict, now: float) -> str | None:
        """Why a job Slurm says is RUNNING looks dead on its node, in words (its heartbeat stopped), else None.

        The heartbeat's counter is compared with itself over the watcher's own clock, never with the node's or
        this machine's wall clock. Unchanged for heartbeat_stale_s: the job is shown stalled; for
        heartbeat_dead_s: the node is taken for lost, the batch job is cancelled, and the attempt ends preempted
        (retried where ``retries`` allows).
        """
        slurm_id = None if self._submitting(paths) else self._slurm_id(paths, attempt)
        job = self._jobs.get(slurm_id) if slurm_id else None
        if job is None or job.state != "RUNNING" or slurm_id in self._node_lost or slurm_id in self._cancelled:
            return None
        quiet_s = self._heartbeat_quiet_s(paths, slurm_id)
        if quiet_s < self.heartbeat_stale_s:
            return None
        node = f" on node {job.node}" if job.node else ""
        said = (f"no heartbeat from the node side of Slurm job {slurm_id}{node} for {quiet_s:.0f} s while Slurm says "
                "RUNNING")
        if quiet_s >= self.heartbeat_dead_s:
            self._give_up_on_node(paths, slurm_id, said)
        return said

    def _heartbeat_quiet_s(self, paths: JobPaths, slurm_id: str) -> float:
        """Seconds (watcher's clock) since heartbeat.json last changed for this Slurm job, or since it was seen
        running when no heartbeat of it was ever seen. Read at most once per heartbeat period."""
        now = time.monotonic()
        seen = self._beats.get(slurm_id)
        if seen is None or self._exit_read_due(f"{slurm_id}#beat", min(self.heartbeat_s, self.heartbeat_stale_s / 3)):
            beat = read_json(paths.heartbeat) or {}
            beats = beat.get("beats") if str(beat.get("slurm_job_id")) == slurm_id else None
            if seen is None or seen[0] != beats:
                first = self._running_at.get(slurm_id, now) if beats is None else now
                self._beats[slurm_id] = seen = (beats, first)
        return now - seen[1]

    def _give_up_on_node(self, paths: JobPaths, slurm_id: str, said: str) -> None:
        """The node is lost: say so in slurm.json (a restarted watcher still knows) and output.log, and scancel."""
        evidence = f"{said}; trainq cancelled the job as a node failure"
        self._node_lost[slurm_id] = evidence
        logger.warning("job %s: %s", paths.dir.name, evidence)
        _append_note(paths.log, f"trainq: {evidence}")
        record = read_json(paths.slurm_record) or {}
        try:
            atomic_write_json(paths.slurm_record, {**record, "node_lost": evidence})
        except OSError as exc:
            logger.warning("job %s: cannot note the lost node in %s: %s", paths.dir.name, paths.slurm_record.name,
                           exc.strerror)
        self._scancel(slurm_id, paths)

    def enforce_stop(self, paths: JobPaths, attempt: dict, stop_requested_at: float, grace_s: float, now: float) -> None:
        """scancel a stopped job at once while Slurm still queues it, else after grace + kill_after + a margin."""
        slurm_id = self._slurm_id(paths, attempt)
        job = self._state(slurm_id) if slurm_id else None
        if job is None or not job.is_live or slurm_id in self._cancelled or slurm_id in self._to_cancel:
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

    # -- submitting ------------------------------------------------------------------------------
    def _prepare(self, spec: LaunchSpec, job_name: str, job_slurm: dict) -> tuple[JobPaths, LaunchSpec, SlurmOptions]:
        """The attempt's LaunchSpec as the node runs it (written to launch.json, 0600) and its sbatch options."""
        job_dir = os.path.abspath(spec.job_dir)
        resources, declared_env = _job_file(Path(job_dir))
        # the node's own environment (Slurm's variables, --export=NONE keeps the watcher's out) is the base
        spec = dataclasses.replace(spec, job_dir=job_dir, env=batch_env(spec.env, declared_env | self.passthrough),
                                   inherit_env=True)
        paths = JobPaths(Path(job_dir))
        options = self.options_for(spec, job_name, job_slurm, resources)
        if options.nodes > 1 or options.tasks_per_node > 1:
            spec = dataclasses.replace(spec, argv=srun_argv(spec.argv, options.nodes * options.tasks_per_node))
        atomic_write(paths.launch_spec, _json(spec.to_dict()), mode=0o600)  # it holds the job's environment
        return paths, spec, options

    def _submit_one(self, paths: JobPaths, attempt: int, options: SlurmOptions) -> None:
        """slurm.sh, slurm.json, then sbatch in the worker; its answer is taken in ``_collect_answers``."""
        argv = options.argv(paths.slurm_script)
        atomic_write(paths.slurm_script, batch_script(paths, attempt, argv, self.python, self.package_parent,
                                                        self._node_heartbeat_s()),
                     mode=0o755)
        record = {"attempt": attempt, "slurm_job_id": None, "tag": options.comment, "requeue": options.requeue,
                  "submitted_at": iso_utc(time.time()), "sbatch": argv}
        atomic_write_json(paths.slurm_record, record)  # before sbatch: a crash right after it can still find the job
        self._hand_over(_Inflight(paths, attempt, options.comment, argv))

    def _submit_array(self, members: list[_Held]) -> None:
        """One ``sbatch --array`` for a sweep's attempts: task ``i`` runs job ``<sweep>-i`` in its folder.

        Every member's slurm.sh is the array's script and its slurm.json names the array's tag and its index, so
        a crash or an unanswered sbatch is resolved for the whole array at once (``_resolve_unconfirmed``).
        """
        first = members[0]
        running = first.paths.dir.parent
        tag = make_array_tag(self.key, first.sweep, secrets.token_hex(4))
        spec = array_spec([m.index for m in members])
        options = dataclasses.replace(
            first.options, job_name=first.sweep, comment=tag, chdir=str(running),
            output=str(running / f"{first.sweep}-%a" / SLURM_OUTPUT.replace("%j", "%A_%a")),
            array=f"{spec}%{self.array_limit}" if self.array_limit else spec)
        argv = options.argv(first.paths.slurm_script)
        script = array_script(running, first.sweep, first.attempt, argv, self.python, self.package_parent,
                              self._node_heartbeat_s())
        submitted_at = iso_utc(time.time())
        for member in members:
            atomic_write(member.paths.slurm_script, script, mode=0o755)
            record = {"attempt": member.attempt, "slurm_job_id": None, "tag": tag, "array_index": member.index,
                      "requeue": options.requeue, "submitted_at": submitted_at, "sbatch": argv}
            atomic_write_json(member.paths.slurm_record, record)
        self._hand_over(_Inflight(first.paths, first.attempt, tag, argv, members))

    def _hand_over(self, sub: _Inflight) -> None:
        key = str(sub.paths.dir)
        self._inflight[key] = sub
        for member in sub.members or [sub]:
            self._inflight_dirs[str(member.paths.dir)] = key
        self._submitter.submit(key, sub.argv)

    def _node_heartbeat_s(self) -> float | None:
        return None if self.heartbeat_s == HEARTBEAT_S else self.heartbeat_s  # the node's default needs no option

    def _submitting(self, paths: JobPaths) -> bool:
        """The attempt's sbatch is queued in the worker or running there."""
        return str(paths.dir) in self._inflight_dirs

    def _collect_answers(self) -> None:
        """Take the sbatch worker's answers: confirm, leave unconfirmed, or pass the error on to ``flush``."""
        for key, answer in self._submitter.take():
            sub = self._inflight.pop(key, None)
            if sub is None:
                continue
            members = sub.members or []
            try:
                slurm_id = self._answer(answer, sub.paths)
            except _NoAnswer as exc:
                self._settle(sub)
                self._no_answer(sub, str(exc))
            except (SpawnFailed, ExecutorUnavailable) as exc:
                if len(members) > 1 and isinstance(exc, (SpawnFailed, SubmitLimited)):
                    # only the jobs Slurm itself refuses fail, and only those over a limit wait (an array's tail)
                    logger.warning("sweep %s: %s; submitting its %d jobs one by one", members[0].sweep, exc,
                                   len(members))
                    self._settle(sub)
                    for member in members:
                        self._submit_one(member.paths, member.attempt, member.options)
                else:
                    self._refused(sub, exc)
            else:
                self._settle(sub)
                self._answers += self._confirm_submission(sub, slurm_id)

    def _settle(self, sub: _Inflight) -> None:
        for member in sub.members or [sub]:
            self._inflight_dirs.pop(str(member.paths.dir), None)

    def _refused(self, sub: _Inflight, error: Exception) -> None:
        """sbatch said no (for now, or for good): slurm.json says so, so the tag is never looked for; the job
        stays "being submitted" until ``flush`` hands the error to the daemon."""
        for member in sub.members or [sub]:
            record = read_json(member.paths.slurm_record) or {}
            try:
                atomic_write_json(member.paths.slurm_record, {**record, "refused": str(error)})
            except OSError:
                pass  # the answer still reaches the daemon; a restart would look for the tag and find none
            self._answers.append((member.paths.dir.name, None, error))
            self._refused_dirs[member.paths.dir.name] = str(member.paths.dir)

    def _confirm_submission(self, sub: _Inflight, slurm_id: str) -> list[tuple[str, str, None]]:
        if not sub.members:
            self._confirm(sub.paths, read_json(sub.paths.slurm_record) or {}, slurm_id)
            logger.debug("job %s: sbatch %s -> slurm job %s", sub.paths.dir.name, shlex.join(sub.argv[1:]), slurm_id)
            return [(sub.paths.dir.name, slurm_id, None)]
        first = sub.members[0]
        logger.info("sweep %s: attempt %d of %d job(s) submitted as Slurm job array %s", first.sweep, first.attempt,
                    len(sub.members), slurm_id)
        confirmed = []
        for member in sub.members:
            task = array_task_id(slurm_id, member.index)
            self._confirm(member.paths, read_json(member.paths.slurm_record) or {}, task)
            confirmed.append((member.paths.dir.name, task, None))
        return confirmed

    def _no_answer(self, sub: _Inflight, why: str) -> None:
        """sbatch got no answer: the job may exist; it is looked for by its tag before anything is submitted again."""
        if sub.members:
            logger.warning("sweep %s: %s; looking for tag %s before submitting its array again",
                           sub.members[0].sweep, why, sub.tag)
        else:
            logger.warning("job %s: %s; looking for tag %s before submitting again", sub.paths.dir.name, why, sub.tag)
        for member in sub.members or [None]:
            paths = member.paths if member else sub.paths
            self._unconfirmed[str(paths.dir)] = _Unconfirmed(paths, sub.attempt, sub.tag, sub.argv,
                                                             index=member.index if member else None)
        self._wake_poll()

    # -- sbatch options ------------------------------------------------------------------------
    def options_for(self, spec: LaunchSpec, job_name: str, job_slurm: dict, resources: dict | None = None,
                    token: str | None = None) -> SlurmOptions:
        """The attempt's sbatch options from its LaunchSpec, its resources, watcher.yaml and the job's slurm block."""
        if resources is None:
            resources = _job_file(Path(spec.job_dir))[0]
        nodes = int(resources.get("nodes") or 1)
        gpus = int(resources.get("gpus_per_node") or resources.get("gpus") or 0)
        ram_gb = resources.get("ram_gb")
        time_min = time_limit_min(spec.timeout_s, spec.stop_grace_s, spec.kill_after_s)
        extra = self.sbatch_args + tuple(str(a) for a in job_slurm.get("sbatch_args") or ())
        return SlurmOptions(
            job_name=job_name,
            partition=job_slurm.get("partition") or self.partition,
            gpus=gpus,
            mem_mb=math.ceil(float(ram_gb) * 1024) if ram_gb else None,
            time_min=time_min,
            chdir=spec.cwd,
            output=str(Path(spec.job_dir) / SLURM_OUTPUT),
            extra=extra,
            comment=make_tag(self.key, Path(spec.job_dir).name, spec.attempt, token or secrets.token_hex(4)),
            signal_lead_s=signal_lead_s(spec.stop_grace_s, spec.kill_after_s, effective_time_min(time_min, extra)),
            requeue=bool(job_slurm.get("requeue")),
            nodes=nodes,
            tasks_per_node=int(resources.get("tasks_per_node") or 1),
        )

    # -- talking to Slurm ------------------------------------------------------------------------
    def _submit(self, argv: list[str], paths: JobPaths) -> str:
        """Run sbatch here (a resubmission after a tag lookup, rare): see ``_answer``."""
        try:
            done = run(argv, self.command_timeout_s)
        except FileNotFoundError:
            raise self._went_down("sbatch is not on PATH; install the Slurm client or fix PATH") from None
        except subprocess.TimeoutExpired:
            raise _NoAnswer(f"sbatch did not answer in {self.command_timeout_s:g} s") from None
        return self._answer(Answer(done.returncode, done.stdout, done.stderr), paths)

    def _answer(self, done: Answer, paths: JobPaths) -> str:
        """sbatch's answer: the id; ExecutorUnavailable when refused at the door, SubmitLimited for a QOS or
        association limit, _NoAnswer when the job may exist anyway, SlurmRejected for a refusal that will stay."""
        if done.returncode is None:
            raise _NoAnswer(done.stderr)
        if done.returncode == -1:
            raise self._went_down(done.stderr)
        first = first_line(done.stderr)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[-1].split(";")[0]
        if NO_ANSWER.search(done.stderr):
            raise _NoAnswer(first)
        if REFUSED.search(done.stderr):
            raise self._went_down(first)
        said = "; ".join(line.strip().removeprefix("sbatch: error: ") for line in done.stderr.splitlines()
                         if line.strip()) or f"sbatch exited {done.returncode}"
        if LIMITED.search(done.stderr) and not PER_JOB_LIMIT.search(done.stderr):
            raise SubmitLimited(f"Slurm: {said}; submitting again in {self.limit_retry_s:g} s", self.limit_retry_s)
        raise SlurmRejected(f"{paths.dir}: Slurm refused the job: {said}; fix slurm.partition / slurm.sbatch_args "
                            "in the job file or watcher.yaml, then submit it again")

    def _confirm(self, paths: JobPaths, record: dict, slurm_id: str) -> None:
        """The submission exists as ``slurm_id``: record it in slurm.json and track it."""
        atomic_write_json(paths.slurm_record, {**record, "slurm_job_id": slurm_id})
        self._unconfirmed.pop(str(paths.dir), None)
        self._track(slurm_id, SlurmJob("PENDING", "None"))
        self._seeded.add(slurm_id)  # "PENDING" until squeue says otherwise: it may run and end before the next poll

    def _went_down(self, detail: str) -> ExecutorUnavailable:
        self._down = f"Slurm is not reachable: {detail}"
        logger.warning("slurm: %s", self._down)
        return ExecutorUnavailable(self._down)

    def _scancel(self, slurm_id: str, paths: JobPaths | None) -> None:
        """Cancel ``slurm_id`` with the others asked for this tick: one scancel for a whole cancelled sweep."""
        self._to_cancel.setdefault(slurm_id, paths.dir.name if paths else "duplicate")

    def _flush_cancels(self) -> None:
        """One ``scancel ID...`` for every Slurm job asked to be cancelled since the last one."""
        if not self._to_cancel:
            return
        batch, self._to_cancel = self._to_cancel, {}
        ids = sorted(batch, key=id_order)
        what = ids[0] if len(ids) == 1 else f"{len(ids)} jobs"
        try:
            done = run(["scancel", *ids], self.command_timeout_s)
        except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
            logger.warning("scancel of %s (%s) failed: %s", what, ", ".join(sorted(set(batch.values()))[:5]), exc)
            return
        if done.returncode != 0:
            logger.warning("scancel %s: %s", " ".join(ids[:5]) + (" ..." if len(ids) > 5 else ""),
                           first_line(done.stderr))
            if REFUSED.search(done.stderr) or NO_ANSWER.search(done.stderr):
                return  # nothing was cancelled; a later stop check asks again
        self._cancelled.update(ids)  # scancel goes on past an id it cannot cancel (one that just ended)

    # -- the cached squeue -----------------------------------------------------------------------
    def _state(self, slurm_id: str) -> SlurmJob | None:
        """Slurm's last answer about ``slurm_id``; None while unknown (never asked, or Slurm unreachable)."""
        self._track(slurm_id)
        self._poll(start=False)
        if self._down is not None and self._jobs.get(slurm_id, SlurmJob(GONE)).is_live:
            return None
        return self._jobs.get(slurm_id)

    def _track(self, slurm_id: str, seed: SlurmJob | None = None) -> None:
        if slurm_id in self._tracked:
            return
        self._tracked.add(slurm_id)
        self._tracked_at[slurm_id] = time.monotonic()
        self._wake_poll()
        if seed is not None:
            self._jobs[slurm_id] = seed

    def _forget(self, slurm_id: str) -> None:
        for store in (self._jobs, self._ended_seen, self._beats, self._exit_read_mono, self._tracked_at,
                      self._running_at, self._last_known, self._node_lost):
            store.pop(slurm_id, None)
        self._wake_poll()
        self._seeded.discard(slurm_id)
        self._tracked.discard(slurm_id)
        self._cancelled.discard(slurm_id)

    def _poll(self, start: bool) -> None:
        """Take a finished squeue's answer; with ``start``, launch the next one when its interval has passed.

        At most one squeue per interval, whatever the number of jobs, and none while nothing is tracked and no
        launch asked whether Slurm is up. The interval is poll_s after anything changed, and doubles (up to
        poll_max_s) with each answer that brings nothing new.
        """
        now = time.monotonic()
        if self._query is not None:
            result = self._query.result()
            if result is None:
                return
            query, self._query = self._query, None
            query.close()
            self._absorb(*result, query)
        wanted = self._tracked or self._unconfirmed or now - self._probe_wanted_mono < 2 * self.poll_s
        if start and wanted and now - self._last_query_mono >= self._interval_s:
            self._last_query_mono = now
            if self._accounting is None:
                self._accounting = accounting_enabled(self.command_timeout_s)
            # by id: only the queue's own jobs; all of the user's while a submission is looked for by its tag
            ids = None if self._unconfirmed or not self._listed_all or not self._tracked else query_ids(self._tracked)
            try:
                self._query = SqueueQuery(ids)
            except OSError as exc:
                self._absorb(-1, "", f"cannot run squeue ({exc.strerror}); install the Slurm client or fix PATH")

    def _wake_poll(self) -> None:
        """Something happened (a submission, a cancel, an end seen in a job folder): poll at poll_s again."""
        if self._interval_s > self.poll_s:
            self._interval_s = self.poll_s

    def _absorb(self, returncode: int, out: str, err: str, query: SqueueQuery | None = None) -> None:
        """One squeue answer: states (final ones too) of the jobs asked about, those gone, duplicates, unconfirmed
        submissions (when it listed all of the user's jobs)."""
        if returncode != 0:
            self._down = f"Slurm is not reachable: {first_line(err) or f'squeue exited {returncode}'}"
            self._interval_s = self.poll_s
            logger.debug("slurm: %s", self._down)
            return
        if self._down is not None:
            logger.info("slurm: reachable again")
        self._down = None
        seen = parse_squeue(out)
        asked_at = query.started if query is not None else time.monotonic()
        listed_all = query is None or query.ids is None
        changed = self._take_states(seen, asked_at)
        if listed_all:
            self._listed_all = True
            self._cancel_duplicates(seen)
            self._resolve_unconfirmed(seen)
        self._interval_s = self.poll_s if changed else min(self.poll_max_s, 2 * self._interval_s)

    def _take_states(self, seen: dict[str, SlurmJob], asked_at: float) -> bool:
        """Record what the answer says of each tracked job; True when anything changed."""
        now = time.monotonic()
        changed, departed = False, []
        for slurm_id in sorted(self._tracked, key=id_order):
            if self._tracked_at.get(slurm_id, -math.inf) > asked_at:
                continue  # submitted after this squeue started: it cannot be in the answer
            job, old = seen.get(slurm_id), self._jobs.get(slurm_id)
            if job is None:
                if old is None or old.is_live:
                    departed.append(slurm_id)
                continue
            self._seeded.discard(slurm_id)
            changed |= old is None or (old.state, old.reason) != (job.state, job.reason)
            self._jobs[slurm_id] = job
            self._last_known[slurm_id] = f"{job.state}{f' on node {job.node}' if job.node else ''} at " \
                                         f"{iso_utc(time.time())}"
            if job.state in RUNNING_STATES:
                self._running_at.setdefault(slurm_id, now)
            if not job.is_live:
                self._ended_seen.setdefault(slurm_id, now)
        self._settle_departed(departed, seen, now)
        return changed or bool(departed)

    def _settle_departed(self, departed: list[str], seen: dict[str, SlurmJob], now: float) -> None:
        """Jobs the answer no longer lists: cancelled by us, a queued array task cancelled from outside (Slurm
        keeps no record of it), or purged (asked of slurmdbd where accounting exists)."""
        missing = []
        for slurm_id in departed:
            self._seeded.discard(slurm_id)
            if slurm_id in self._cancelled:  # nothing to ask: a stopped sweep of 1000 costs no query
                self._jobs[slurm_id] = SlurmJob("CANCELLED")
                self._ended_seen.setdefault(slurm_id, now)
            else:
                missing.append(slurm_id)
        if missing and self._accounting:
            for slurm_id, job in sacct_jobs(missing, self.command_timeout_s).items():
                if slurm_id in missing:
                    missing.remove(slurm_id)
                    self._jobs[slurm_id] = job
                    self._ended_seen.setdefault(slurm_id, now)
        arrays = {i.partition("_")[0] for i in seen}
        for slurm_id in missing:
            last = self._jobs.get(slurm_id)
            queued = last is not None and last.state in QUEUED_STATES and slurm_id not in self._running_at
            if "_" in slurm_id and queued and slurm_id.partition("_")[0] in arrays:
                self._jobs[slurm_id] = SlurmJob("CANCELLED", QUEUED_CANCEL_REASON)
            else:
                self._jobs[slurm_id] = SlurmJob(GONE, node=last.node if last else "")
            self._ended_seen.setdefault(slurm_id, now)

    def _cancel_duplicates(self, seen: dict[str, SlurmJob]) -> None:
        """Two live Slurm jobs for one attempt of this queue: keep the tracked one, scancel the other."""
        by_attempt: dict[str, list[str]] = {}
        for slurm_id, job in seen.items():
            attempt = duplicate_key(slurm_id, job.comment, self.key) if job.is_live else None
            if attempt is not None:
                by_attempt.setdefault(attempt, []).append(slurm_id)
        for ids in by_attempt.values():
            if len(ids) > 1 and any(i in self._tracked for i in ids):
                for extra in (i for i in ids if i not in self._tracked and i not in self._cancelled):
                    logger.warning("slurm: job %s duplicates an attempt already running as %s; scancel", extra,
                                   ",".join(i for i in ids if i in self._tracked))
                    self._scancel(extra, None)

    def _resolve_unconfirmed(self, seen: dict[str, SlurmJob]) -> None:
        """Adopt unconfirmed submissions seen by their tag or claim; look further for the others.

        The jobs of one job array share its tag and are resolved together: the array is adopted, or submitted
        again, once for all of them.
        """
        by_tag: dict[str, list[_Unconfirmed]] = {}
        for pending in self._unconfirmed.values():
            by_tag.setdefault(pending.tag, []).append(pending)
        for tag, group in by_tag.items():
            found = sorted((i for i, j in seen.items() if j.comment == tag), key=id_order)
            claimed = [c for c in map(_claimed_id, group) if c]
            if claimed or found:
                self._adopt(group, (claimed or found)[0])
            else:
                self._look_further(tag, group)

    def _look_further(self, tag: str, group: list[_Unconfirmed]) -> None:
        """After UNCONFIRMED_POLLS answers without the tag: ask Slurm about every job it knows, and only when
        none carries the tag, submit again (under the same tag)."""
        lead = group[0]
        lead.missed += 1
        if lead.missed < UNCONFIRMED_POLLS:
            return
        try:  # the live squeue does not list a job that already ended
            everything = find_tagged(tag, self.command_timeout_s)
        except (OSError, subprocess.SubprocessError) as exc:
            logger.info("job %s: tag lookup failed (%s); trying again next poll", lead.paths.dir.name, exc)
            return
        if everything:
            self._adopt(group, everything[0][0])
            return
        logger.warning("job %s: Slurm has no job tagged %s; submitting attempt %d again%s", lead.paths.dir.name,
                       tag, lead.attempt, f" (the job array of {len(group)} jobs)" if lead.index is not None else "")
        try:
            slurm_id = self._submit(lead.argv, lead.paths)
        except _NoAnswer:
            lead.missed = 0
            return
        except (ExecutorUnavailable, SpawnFailed) as exc:
            logger.warning("job %s: resubmission failed: %s", lead.paths.dir.name, exc)
            return
        self._adopt(group, slurm_id)

    def _adopt(self, group: list[_Unconfirmed], slurm_id: str) -> None:
        """The submission of ``group`` exists as ``slurm_id`` (for an array: any of its tasks)."""
        for pending in group:
            own = slurm_id if pending.index is None else array_task_id(slurm_id, pending.index)
            logger.info("job %s: attempt %d is Slurm job %s (tag %s)", pending.paths.dir.name, pending.attempt,
                        own, pending.tag)
            record = read_json(pending.paths.slurm_record) or {"attempt": pending.attempt, "tag": pending.tag}
            self._confirm(pending.paths, record, own)

    def _unconfirmed_for(self, paths: JobPaths, attempt: dict) -> _Unconfirmed | None:
        """The attempt's submission that got no answer; re-registered from slurm.json after a watcher restart."""
        pending = self._unconfirmed.get(str(paths.dir))
        if pending is not None or attempt.get("ended_at"):
            return pending
        record = read_json(paths.slurm_record) or {}
        if (record.get("tag") and not record.get("slurm_job_id") and not record.get("refused")
                and attempt.get("n") in (None, record.get("attempt"))
                and not _attempt_ended(paths, record.get("attempt"))):
            index = record.get("array_index")
            pending = _Unconfirmed(paths, int(record["attempt"]), str(record["tag"]), list(record.get("sbatch") or []),
                                   index=index if isinstance(index, int) else None)
            self._unconfirmed[str(paths.dir)] = pending
        return pending

    # -- the node's signs of life -------------------------------------------------------------------
    def _node_still_alive(self, paths: JobPaths, slurm_id: str) -> bool:
        """After Slurm said the job ended: a supervisor holding its lock, or a heartbeat still moving."""
        if lock_state(paths) is True:
            return True
        beat = read_json(paths.heartbeat) or {}
        if str(beat.get("slurm_job_id")) != slurm_id or beat.get("ended"):
            return False
        now = time.monotonic()
        seen = self._beats.get(slurm_id)
        if seen is None or seen[0] != beat.get("beats"):
            self._beats[slurm_id] = (beat.get("beats"), now)  # it moved (or we look for the first time)
            return True
        return now - seen[1] < self.heartbeat_stale_s

    def _within_grace(self, paths: JobPaths, slurm_id: str) -> bool:
        """A supervisor that started may have written exit.json that this machine cannot see yet (NFS caching)."""
        first = self._ended_seen.get(slurm_id)
        if first is None or not paths.started.exists():
            return False
        return time.monotonic() - first < self.exit_grace_s

    def _exit_read_due(self, slurm_id: str, interval_s: float) -> bool:
        """At most one look at this job's exit.json per ``interval_s``."""
        now = time.monotonic()
        if now - self._exit_read_mono.get(slurm_id, -math.inf) < interval_s:
            return False
        self._exit_read_mono[slurm_id] = now
        return True

    def _requeues(self, paths: JobPaths) -> bool:
        return bool((read_json(paths.slurm_record) or {}).get("requeue"))

    def _own_record(self, paths: JobPaths, attempt: dict) -> dict | None:
        """exit.json if it is this attempt's (a retried job's folder still holds the previous attempt's)."""
        record = read_json(paths.exit_record)
        if record is None or (attempt.get("n") is not None and record.get("attempt") != attempt.get("n")):
            return None
        return record

    def _slurm_id(self, paths: JobPaths, attempt: dict) -> str | None:
        """The attempt's Slurm job id: from run.json, else from slurm.json (the watcher died right after sbatch)."""
        slurm_id = attempt.get("slurm_job_id")
        if slurm_id and not attempt.get("ended_at"):
            return str(slurm_id)  # the usual case: no file to read
        record = read_json(paths.slurm_record) or {}
        known, submitted = attempt.get("n"), int(record.get("attempt") or 0)
        if record.get("slurm_job_id") and (known is None or submitted > int(known)
                                           or (submitted == int(known) and not slurm_id)):
            if known is not None and submitted == int(known) and not attempt.get("ended_at"):
                attempt["slurm_job_id"] = str(record["slurm_job_id"])  # adopted after an unanswered sbatch
            return str(record["slurm_job_id"])
        return str(slurm_id) if slurm_id else None

    # -- when Slurm ended the job without an exit record ----------------------------------------
    def _synthesize(self, paths: JobPaths, attempt: dict, slurm_id: str, job: SlurmJob) -> dict | None:
        """Write exit.json in the supervisor's place, and say in output.log what Slurm did; None while the job
        folder cannot be written (the watcher tries again at the next poll)."""
        outcome = ended_outcome(job, job.exit_code, job.exit_signal, paths, slurm_id, self.python,
                                self._cancelled_by(paths, slurm_id), self._what_was_known(paths, slurm_id))
        started = read_json(paths.started) or {}
        now = time.time()
        record = {
            "attempt": attempt.get("n") or (read_json(paths.slurm_record) or {}).get("attempt"),
            "job_pid": started.get("job_pid"), "exit_code": outcome["exit_code"], "signal": outcome["signal"],
            "signal_name": SIGNAL_NAMES.get(outcome["signal"]), "started_at": started.get("started_at"),
            "ended_at": iso_utc(now), "stop_reason": outcome["stop_reason"],
            "stop_requested_at": iso_utc(now) if outcome["stop_reason"] == "timeout" else None,
            "signals_sent": [], "spawn_error": None, "slurm_job_id": slurm_id, "slurm_state": job.state,
            "slurm_reason": job.reason, "executor_diagnosis": outcome["diagnosis"], "written_by": "watcher",
        }
        try:
            atomic_write_json(paths.exit_record, record)
        except OSError as exc:
            logger.warning("job %s: slurm job %s ended %s; cannot write its exit record yet (%s)", paths.dir.name,
                           slurm_id, job.state, exc.strerror)
            return None
        said = "is no longer known to Slurm" if job.state == GONE else f"ended {job.state}"
        _append_note(paths.log, f"trainq: Slurm job {slurm_id} {said} without an exit record from trainq's "
                                f"supervisor: {outcome['evidence']}")
        logger.info("job %s: slurm job %s ended %s without an exit record; wrote one", paths.dir.name, slurm_id,
                    job.state)
        return record


    def _what_was_known(self, paths: JobPaths, slurm_id: str) -> str:
        """What was last known of a job Slurm forgot: this watcher's last sight of it, else the job folder's
        records (submitted, started on a node, last heartbeat)."""
        known = []
        if slurm_id in self._last_known:
            known.append(f"Slurm showed it {self._last_known[slurm_id]}")
        submitted = (read_json(paths.slurm_record) or {}).get("submitted_at")
        if submitted:
            known.append(f"submitted at {submitted}")
        started = read_json(paths.started) or {}
        if started.get("started_at"):
            known.append(f"its supervisor started at {started['started_at']}")
        beat = read_json(paths.heartbeat) or {}
        if str(beat.get("slurm_job_id")) == slurm_id and beat.get("at"):
            known.append(f"last heartbeat from node {beat.get('node') or '?'} at {beat['at']}"
                         + (" (its supervisor had ended)" if beat.get("ended") else ""))
        return ", ".join(known) or "never seen running"


class _NoAnswer(Exception):
    """sbatch reached the controller but got no answer: the job may exist."""


# -- helpers ------------------------------------------------------------------------------------------


def _claimed_id(pending: _Unconfirmed) -> str:
    """The Slurm job id the node's claim of this attempt names ("" while none has started it)."""
    return str((read_json(pending.paths.slurm_claim(pending.attempt)) or {}).get("slurm_job_id") or "")


def _with_slurm_view(record: dict, slurm_id: str, job: SlurmJob | None, paths: JobPaths,
                     cancelled_by: str | None = None) -> dict:
    """The node's record plus what Slurm says: its id and final state; OUT_OF_MEMORY (cgroups), or a SIGKILL that
    Slurm's output says was for memory (OverMemoryKill, no cgroups), makes the kill an oom; a signal Slurm sent
    says who sent it (scancel from outside: cancelled; preemption, a node failure or a node trainq gave up on:
    preempted); and under srun the rank that failed first gives its own exit code, not srun's."""
    record = dict(record, slurm_job_id=record.get("slurm_job_id") or slurm_id)
    if job is not None and job.has_ended:
        record.setdefault("slurm_state", job.state)
    record = real_rank_exit(record, paths)
    if job is None or record.get("executor_diagnosis"):
        return record
    node = f" on node {job.node}" if job.node else ""
    signalled = _signalled(record) or record.get("stop_reason") == "sigterm"
    if job.state == "OUT_OF_MEMORY":
        record["executor_diagnosis"] = {"kind": "oom", "evidence": oom_evidence(node)}
    elif _was_sigkilled(record) and job.has_ended and (said := killed_for_memory(paths, slurm_id)):
        record["executor_diagnosis"] = {"kind": "oom", "evidence": f"{oom_evidence(node)}: {said}"}
    elif signalled and cancelled_by and cancelled_by != "cancelled by trainq":
        record["executor_diagnosis"] = {"kind": "preempted", "evidence": cancelled_by}
    elif signalled and job.state == "CANCELLED" and not cancelled_by and record.get("stop_reason") != "stop_flag":
        record.update(stop_reason=CANCELLED_OUTSIDE, executor_diagnosis={
            "kind": "killed", "evidence": cancelled_evidence(slurm_id, job), "advice": CANCELLED_ADVICE})
    elif signalled and job.state in ("PREEMPTED", "NODE_FAIL", "BOOT_FAIL"):
        record["executor_diagnosis"] = {"kind": "preempted", "evidence": f"Slurm ended the job {job.state}{node}"}
    return record


def _was_sigkilled(record: dict) -> bool:
    return record.get("signal") == SIGKILL or record.get("exit_code") == 128 + SIGKILL


def _signalled(record: dict) -> bool:
    """Killed or terminated by a signal (SIGKILL, SIGTERM: Slurm's ways of ending a job), or stopped on SIGTERM."""
    return (record.get("signal") in (SIGKILL, SIGTERM) or record.get("exit_code") in (128 + SIGKILL, 128 + SIGTERM)
            or record.get("stop_reason") == "sigterm")


def _json(obj: object) -> str:
    return json.dumps(obj, indent=1, ensure_ascii=False) + "\n"


def _attempt_ended(paths: JobPaths, n: object) -> bool:
    """True when run.json records attempt ``n`` as finished."""
    attempts = (read_json(paths.run) or {}).get("attempts") or []
    return any(a.get("n") == n and a.get("ended_at") for a in attempts if isinstance(a, dict))


def _job_file(job_dir: Path) -> tuple[dict, set[str]]:
    """The job file's resources block and the names of its own ``env`` entries, as the watcher validated them."""
    from trainq.watcher.spec.errors import WatcherError
    from trainq.watcher.spec.jobspec import load_job_file

    try:
        spec = load_job_file(JobPaths(job_dir).spec, f"{job_dir.name}/job.yaml")
    except (WatcherError, OSError) as exc:
        raise SpawnFailed(f"{job_dir}: cannot read job.yaml for Slurm's options ({exc}); submit the job again") from exc
    resources = spec.resources.to_dict()
    return resources, set(spec.env)


def _refresh_listing(folder: Path) -> None:
    try:
        os.listdir(folder)
    except OSError:
        pass


def _append_note(log: Path, line: str) -> None:
    """A ``trainq:`` line in output.log, where the user reads the job's story (nobody else writes it now)."""
    try:
        with open(log, "a", encoding="utf-8") as f:
            f.write(line.rstrip("\n") + "\n")
    except OSError:
        pass
