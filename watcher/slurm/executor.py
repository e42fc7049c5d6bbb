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
from trainq.watcher.spec.errors import ExecutorUnavailable, SpawnFailed
from trainq.watcher.spec.fsutil import atomic_write, atomic_write_json, read_json
from trainq.watcher.slurm.node import HEARTBEAT_S
from trainq.watcher.slurm.batch import SlurmOptions, array_script, batch_env, batch_script, signal_lead_s, srun_argv, time_limit_min
from trainq.watcher.slurm.state import (
    EXIT_NOT_SHARED, GONE, NO_ANSWER, QUEUED_STATES, REFUSED, RUNNING_STATES, SIGKILL, SIGNAL_NAMES, SLURM_OUTPUT,
    SlurmJob, SqueueQuery, array_spec, array_task_id, duplicate_key, ended_outcome, find_tagged, first_line, id_order,
    killed_for_memory, make_array_tag, make_tag, oom_evidence, parse_squeue, queue_key, run, show_job,
)
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
#: a heartbeat unchanged for this many periods means the node-side supervisor is gone
HEARTBEAT_STALE_PERIODS = 3
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
class _Held:
    """A sweep job's attempt that ``launch`` prepared and ``flush`` submits with its sweep's others."""

    paths: JobPaths
    attempt: int
    sweep: str
    index: int
    options: SlurmOptions


class SlurmExecutor:
    """Attempts run as Slurm batch jobs; the Executor protocol of watcher/daemon/executor.py."""

    name = "slurm"
    #: Slurm places GPUs and memory on its nodes: admission must not gate on this machine's
    places_resources = True
    inherits_environment = True  # a batch job adds to its node's environment (SLURM_*, the rendezvous variables)
    job_ref_field = "slurm_job_id"

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
        self.heartbeat_stale_s = HEARTBEAT_STALE_PERIODS * HEARTBEAT_S
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

    # -- the Executor protocol -----------------------------------------------------------------
    def unavailable(self, now: float) -> str | None:
        """"Slurm is not reachable: ..." after the last squeue or sbatch failed so; checked once per poll_s."""
        self._probe_wanted_mono = time.monotonic()
        self._poll(start=True)
        return self._down

    def launch(self, spec: LaunchSpec, job_name: str, slurm_options: dict | None,
               group: tuple[str, int] | None = None) -> dict:
        """Record the submission in slurm.json, then sbatch it; returns the Slurm job id (None while unconfirmed).

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
        return {"slurm_job_id": self._submit_one(paths, spec.attempt, options), "pid": None}

    def describe(self, record: dict) -> str:
        ref = record.get(self.job_ref_field)
        return f"slurm job {ref}" if ref else "Slurm job id not known yet"

    def flush(self) -> list[tuple[str, str | None, Exception | None]]:
        """Submit what ``launch`` held back: one ``sbatch --array`` per sweep, attempt and set of sbatch options.

        Returns (job id, Slurm job id or None while unconfirmed, error) for each held attempt. An array Slurm
        refuses (a cluster's MaxArraySize, say) is submitted again job by job, so only the jobs Slurm itself
        refuses fail.
        """
        held, self._held = self._held, []
        groups: dict[tuple, list[_Held]] = {}
        for member in held:
            groups.setdefault((member.sweep, member.attempt, member.options.shared()), []).append(member)
        results = []
        for members in groups.values():
            if len(members) > 1 and self._down is None:
                try:
                    results += self._submit_array(members)
                    continue
                except SpawnFailed as exc:
                    logger.warning("sweep %s: %s; submitting its %d jobs one by one", members[0].sweep, exc,
                                   len(members))
                except ExecutorUnavailable as exc:
                    results += [(m.paths.dir.name, None, exc) for m in members]
                    continue
            for member in members:
                try:
                    slurm_id = self._submit_one(member.paths, member.attempt, member.options)
                    results.append((member.paths.dir.name, slurm_id, None))
                except (ExecutorUnavailable, SpawnFailed) as exc:
                    results.append((member.paths.dir.name, None, exc))
        return results

    def reap(self) -> None:
        """Collect a finished squeue and start the next one when due, and run the scancel asked for; never blocks
        for long."""
        self._poll(start=True)
        self._flush_cancels()

    def is_alive(self, paths: JobPaths, attempt: dict) -> bool:
        """Slurm's state first; once Slurm says the job ended: the heartbeat, the lock (where flock works), a grace."""
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
        slurm_id = self._slurm_id(paths, attempt)
        if slurm_id is None:
            return None if self._unconfirmed_for(paths, attempt) else self._own_record(paths, attempt)
        job = self._state(slurm_id)
        if job is not None and job.state in QUEUED_STATES and slurm_id not in self._seeded:
            return None
        if job is not None and (job.state in RUNNING_STATES or slurm_id in self._seeded):
            if not self._exit_read_due(slurm_id, len(self._tracked) / EXIT_READS_PER_S):
                return None
        elif job is None or not (job.has_ended or job.state == GONE):  # COMPLETING, or Slurm unknown
            if not self._exit_read_due(slurm_id, self.poll_s):
                return None
        record = self._own_record(paths, attempt)
        if record is not None and not (job is not None and (job.has_ended or job.state == GONE)):
            if self._requeues(paths):
                return None  # a requeueing job's record is final only once Slurm says the job ended
        if record is not None:
            if _was_sigkilled(record) and job is not None and not (job.has_ended or job.state == GONE):
                return None  # Slurm's final state says whether its OOM handling killed it
            self._forget(slurm_id)
            return _with_slurm_view(record, slurm_id, job, paths)
        if job is None or not (job.has_ended or job.state == GONE) or attempt.get("ended_at"):
            return None
        if self._node_still_alive(paths, slurm_id) or self._within_grace(paths, slurm_id):
            return None
        _refresh_listing(paths.dir)  # an NFS client may cache "no exit.json"; listing the folder revalidates
        if job.state == GONE and slurm_id in self._cancelled:
            job = dataclasses.replace(job, state="CANCELLED")  # a job array's task cancelled before it started
        record = self._own_record(paths, attempt) or self._synthesize(paths, attempt, slurm_id, job)
        self._forget(slurm_id)
        return _with_slurm_view(record, slurm_id, job, paths)

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
        slurm_id = self._slurm_id(paths, attempt)
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

    def enforce_stop(self, paths: JobPaths, attempt: dict, stop_requested_at: float, grace_s: float, now: float) -> None:
        """scancel a stopped job at once while Slurm still queues it, else after grace + kill_after + a margin."""
        slurm_id = self._slurm_id(paths, attempt)
        job = self._state(slurm_id) if slurm_id else None
        if job is None or not job.is_live or slurm_id in self._cancelled or slurm_id in self._to_cancel:
            return
        queued = job.state in QUEUED_STATES
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
        return []  # Slurm's news arrives by polling squeue

    def close(self) -> None:
        if self._query is not None:
            self._query.close()
            self._query = None

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

    def _submit_one(self, paths: JobPaths, attempt: int, options: SlurmOptions) -> str | None:
        """slurm.sh, slurm.json, then sbatch: the Slurm job id, or None while the submission is unconfirmed."""
        argv = options.argv(paths.slurm_script)
        atomic_write(paths.slurm_script, batch_script(paths, attempt, argv, self.python, self.package_parent),
                     mode=0o755)
        record = {"attempt": attempt, "slurm_job_id": None, "tag": options.comment, "requeue": options.requeue,
                  "submitted_at": iso_utc(time.time()), "sbatch": argv}
        atomic_write_json(paths.slurm_record, record)  # before sbatch: a crash right after it can still find the job
        try:
            slurm_id = self._submit(argv, paths)
        except _NoAnswer as exc:
            logger.warning("job %s: %s; looking for tag %s before submitting again", paths.dir.name, exc,
                           options.comment)
            self._unconfirmed[str(paths.dir)] = _Unconfirmed(paths, attempt, options.comment, argv)
            return None
        self._confirm(paths, record, slurm_id)
        logger.debug("job %s: sbatch %s -> slurm job %s", paths.dir.name, shlex.join(argv[1:]), slurm_id)
        return slurm_id

    def _submit_array(self, members: list[_Held]) -> list[tuple[str, str | None, None]]:
        """One ``sbatch --array`` for a sweep's attempts: task ``i`` runs job ``<sweep>-i`` in its folder.

        Every member's slurm.sh is the array's script and its slurm.json names the array's tag and its index, so
        a crash or an unanswered sbatch is resolved for the whole array at once (``_resolve_unconfirmed``).
        """
        first = members[0]
        running = first.paths.dir.parent
        tag = make_array_tag(self.key, first.sweep, secrets.token_hex(4))
        options = dataclasses.replace(
            first.options, job_name=first.sweep, comment=tag, chdir=str(running),
            output=str(running / f"{first.sweep}-%a" / SLURM_OUTPUT.replace("%j", "%A_%a")),
            array=array_spec([m.index for m in members]))
        argv = options.argv(first.paths.slurm_script)
        script = array_script(running, first.sweep, first.attempt, argv, self.python, self.package_parent)
        submitted_at = iso_utc(time.time())
        records = []
        for member in members:
            atomic_write(member.paths.slurm_script, script, mode=0o755)
            record = {"attempt": member.attempt, "slurm_job_id": None, "tag": tag, "array_index": member.index,
                      "requeue": options.requeue, "submitted_at": submitted_at, "sbatch": argv}
            atomic_write_json(member.paths.slurm_record, record)
            records.append(record)
        try:
            array_id = self._submit(argv, first.paths)
        except _NoAnswer as exc:
            logger.warning("sweep %s: %s; looking for tag %s before submitting its array again", first.sweep, exc, tag)
            for member in members:
                self._unconfirmed[str(member.paths.dir)] = _Unconfirmed(member.paths, member.attempt, tag, argv,
                                                                        index=member.index)
            return [(m.paths.dir.name, None, None) for m in members]
        logger.info("sweep %s: attempt %d of %d job(s) submitted as Slurm job array %s (--array=%s)", first.sweep,
                    first.attempt, len(members), array_id, options.array)
        submitted = []
        for member, record in zip(members, records):
            slurm_id = array_task_id(array_id, member.index)
            self._confirm(member.paths, record, slurm_id)
            submitted.append((member.paths.dir.name, slurm_id, None))
        return submitted

    # -- sbatch options ------------------------------------------------------------------------
    def options_for(self, spec: LaunchSpec, job_name: str, job_slurm: dict, resources: dict | None = None,
                    token: str | None = None) -> SlurmOptions:
        """The attempt's sbatch options from its LaunchSpec, its resources, watcher.yaml and the job's slurm block."""
        if resources is None:
            resources = _job_file(Path(spec.job_dir))[0]
        nodes = int(resources.get("nodes") or 1)
        gpus = int(resources.get("gpus_per_node") or resources.get("gpus") or 0)
        ram_gb = resources.get("ram_gb")
        return SlurmOptions(
            job_name=job_name,
            partition=job_slurm.get("partition") or self.partition,
            gpus=gpus,
            mem_mb=math.ceil(float(ram_gb) * 1024) if ram_gb else None,
            time_min=time_limit_min(spec.timeout_s, spec.stop_grace_s, spec.kill_after_s),
            chdir=spec.cwd,
            output=str(Path(spec.job_dir) / SLURM_OUTPUT),
            extra=self.sbatch_args + tuple(str(a) for a in job_slurm.get("sbatch_args") or ()),
            comment=make_tag(self.key, Path(spec.job_dir).name, spec.attempt, token or secrets.token_hex(4)),
            signal_lead_s=signal_lead_s(spec.stop_grace_s, spec.kill_after_s),
            requeue=bool(job_slurm.get("requeue")),
            nodes=nodes,
            tasks_per_node=int(resources.get("tasks_per_node") or 1),
        )

    # -- talking to Slurm ------------------------------------------------------------------------
    def _submit(self, argv: list[str], paths: JobPaths) -> str:
        """Run sbatch: the id; ExecutorUnavailable when refused at the door, _NoAnswer when it may exist anyway."""
        try:
            done = run(argv, self.command_timeout_s)
        except FileNotFoundError:
            raise self._went_down("sbatch is not on PATH; install the Slurm client or fix PATH") from None
        except subprocess.TimeoutExpired:
            raise _NoAnswer(f"sbatch did not answer in {self.command_timeout_s:g} s") from None
        first = first_line(done.stderr)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[-1].split(";")[0]
        if NO_ANSWER.search(done.stderr):
            raise _NoAnswer(first)
        if REFUSED.search(done.stderr):
            raise self._went_down(first)
        raise SpawnFailed(f"{paths.dir}: Slurm refused the job: {first or f'sbatch exited {done.returncode}'}; "
                          "fix slurm.partition / slurm.sbatch_args in the job file or watcher.yaml")

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
        if seed is not None:
            self._jobs[slurm_id] = seed

    def _forget(self, slurm_id: str) -> None:
        for store in (self._jobs, self._ended_seen, self._beats, self._exit_read_mono):
            store.pop(slurm_id, None)
        self._seeded.discard(slurm_id)
        self._tracked.discard(slurm_id)
        self._cancelled.discard(slurm_id)

    def _poll(self, start: bool) -> None:
        """Take a finished squeue's answer; with ``start``, launch the next one when poll_s has passed.

        At most one squeue per poll_s, whatever the number of jobs, and none while nothing is tracked and no
        launch asked whether Slurm is up.
        """
        now = time.monotonic()
        if self._query is not None:
            result = self._query.result()
            if result is None:
                return
            query, self._query = self._query, None
            query.close()
            self._absorb(*result)
        wanted = self._tracked or self._unconfirmed or now - self._probe_wanted_mono < 2 * self.poll_s
        if start and wanted and now - self._last_query_mono >= self.poll_s:
            self._last_query_mono = now
            try:
                self._query = SqueueQuery()
            except OSError as exc:
                self._absorb(-1, "", f"cannot run squeue ({exc.strerror}); install the Slurm client or fix PATH")

    def _absorb(self, returncode: int, out: str, err: str) -> None:
        """One squeue answer: live jobs' states, departed jobs' final states, duplicates, unconfirmed submissions."""
        if returncode != 0:
            self._down = f"Slurm is not reachable: {first_line(err) or f'squeue exited {returncode}'}"
            logger.debug("slurm: %s", self._down)
            return
        if self._down is not None:
            logger.info("slurm: reachable again")
        self._down = None
        seen = parse_squeue(out)
        now = time.monotonic()
        departed = []
        self._seeded.difference_update(seen)
        for slurm_id in sorted(self._tracked, key=id_order):
            if slurm_id in seen:
                self._jobs[slurm_id] = seen[slurm_id]
            elif self._jobs.get(slurm_id) is None or self._jobs[slurm_id].is_live:
                departed.append(slurm_id)
        for slurm_id in (i for i in departed if i in self._cancelled):
            # it left because we cancelled it: nothing to ask (a stopped sweep of 1000 costs no scontrol)
            self._seeded.discard(slurm_id)
            self._jobs[slurm_id] = SlurmJob("CANCELLED")
            self._ended_seen.setdefault(slurm_id, now)
        asked = [i for i in departed if i not in self._cancelled]
        for slurm_id in asked[:MAX_DEPARTED_PER_POLL]:  # left the live states: ask once how it ended
            job = show_job(slurm_id, self.command_timeout_s)
            if job is not None:
                self._seeded.discard(slurm_id)
                self._jobs[slurm_id] = job
                if not job.is_live:
                    self._ended_seen.setdefault(slurm_id, now)
        self._cancel_duplicates(seen)
        self._resolve_unconfirmed(seen)

    def _cancel_duplicates(self, seen: dict[str, SlurmJob]) -> None:
        """Two live Slurm jobs for one attempt of this queue: keep the tracked one, scancel the other."""
        by_attempt: dict[str, list[str]] = {}
        for slurm_id, job in seen.items():
            attempt = duplicate_key(slurm_id, job.comment, self.key)
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
        if (record.get("tag") and not record.get("slurm_job_id") and attempt.get("n") in (None, record.get("attempt"))
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
    def _synthesize(self, paths: JobPaths, attempt: dict, slurm_id: str, job: SlurmJob) -> dict:
        """Write exit.json in the supervisor's place, and say in output.log what Slurm did."""
        outcome = ended_outcome(job, job.exit_code, job.exit_signal, paths, slurm_id, self.python)
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
        _append_note(paths.log, f"trainq: Slurm job {slurm_id} ended {job.state} without an exit record from "
                                f"trainq's supervisor: {outcome['evidence']}")
        atomic_write_json(paths.exit_record, record)
        logger.info("job %s: slurm job %s ended %s without an exit record; wrote one", paths.dir.name, slurm_id,
                    job.state)
        return record


class _NoAnswer(Exception):
    """sbatch reached the controller but got no answer: the job may exist."""


# -- helpers ------------------------------------------------------------------------------------------


def _claimed_id(pending: _Unconfirmed) -> str:
    """The Slurm job id the node's claim of this attempt names ("" while none has started it)."""
    return str((read_json(pending.paths.slurm_claim(pending.attempt)) or {}).get("slurm_job_id") or "")


def _with_slurm_view(record: dict, slurm_id: str, job: SlurmJob | None, paths: JobPaths) -> dict:
    """The node's record plus what Slurm says: its id and final state; OUT_OF_MEMORY (cgroups), or a SIGKILL that
    Slurm's output says was for memory (OverMemoryKill, no cgroups), makes the kill an oom."""
    record = dict(record, slurm_job_id=record.get("slurm_job_id") or slurm_id)
    if job is not None and job.has_ended:
        record.setdefault("slurm_state", job.state)
    if job is None or record.get("executor_diagnosis"):
        return record
    node = f" on node {job.node}" if job.node else ""
    if job.state == "OUT_OF_MEMORY":
        record["executor_diagnosis"] = {"kind": "oom", "evidence": oom_evidence(node)}
    elif _was_sigkilled(record) and job.has_ended and (said := killed_for_memory(paths, slurm_id)):
        record["executor_diagnosis"] = {"kind": "oom", "evidence": f"{oom_evidence(node)}: {said}"}
    return record


def _was_sigkilled(record: dict) -> bool:
    return record.get("signal") == SIGKILL or record.get("exit_code") == 128 + SIGKILL


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
