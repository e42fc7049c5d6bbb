"""``executor: slurm``: each attempt's supervisor runs as a Slurm batch job on one of the cluster's nodes.

``launch`` writes ``launch.json`` (the LaunchSpec) and ``slurm.sh`` into the job folder and submits
the script with ``sbatch --parsable``; on the node the script checks that the job folder is visible
and execs ``python -m trainq.watcher.supervisor JOB_DIR --spec JOB_DIR/launch.json``, so stop.flag, the
timeout, output.log, supervisor.json and exit.json work exactly as with the local executor. The
queue root must therefore be on a filesystem the watcher's machine and every node share.

The supervisor's exit record is the truth. Slurm's view comes from ONE background ``squeue`` per
``poll_s`` for every tracked job (never plain ``sacct``, which answers nothing when accounting is
off), so the watcher's loop never waits for a slow or dead controller. When Slurm ended a job
without the supervisor writing its record (NODE_FAIL, OUT_OF_MEMORY, a kill, a job folder the
node cannot see) ``read_exit`` writes one in its place, with a diagnosis.

This module imports ``subprocess`` (running Slurm's commands is its job); supervisor.py still owns
every process of an attempt.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from .contract import JobPaths
from .errors import SpawnFailed
from .executor import ExecutorUnavailable
from .fsutil import atomic_write, atomic_write_json, read_json
from .supervisor import LaunchSpec, is_alive as supervisor_holds_lock
from .units import iso_utc

if TYPE_CHECKING:
    from .config import WatcherConfig

logger = logging.getLogger(__name__)

#: Slurm states in which a batch job is queued or still has processes
LIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
    "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD",
})
#: states in which the job has not started yet (waiting_for shows Slurm's reason)
QUEUED_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
#: pseudo-state: squeue was asked about the id and no longer knows it (purged after MinJobAge)
GONE = "GONE"
#: exit status of slurm.sh when the job folder is not visible on the node (sysexits EX_CONFIG)
EXIT_NOT_SHARED = 78
#: exit statuses of slurm.sh when the watcher's Python cannot be run on the node (as a shell reports it)
EXIT_NO_PYTHON = (126, 127)
#: Slurm's own output file in the job folder (only the batch script's and slurmstepd's messages land here)
SLURM_OUTPUT = "slurm-%j.out"
#: seconds added to timeout + stop_grace + kill_after for --time, so trainq's own timeout path runs first
TIME_LIMIT_MARGIN_S = 60.0
#: seconds after stop_grace + kill_after before enforce_stop falls back to scancel (the supervisor goes first)
SCANCEL_MARGIN_S = 10.0
#: seconds a started job may be ended in Slurm before its exit record shows up (shared filesystems lag)
EXIT_RECORD_GRACE_S = 5.0
#: a squeue that has not answered after this long is killed and Slurm counted as unreachable (s)
QUERY_TIMEOUT_S = 60.0
#: sbatch, scancel and scontrol get this long (s); sbatch alone waits ~9 s for a dead controller
COMMAND_TIMEOUT_S = 60.0
#: stderr fragments meaning "the controller cannot be reached" (the job is fine, Slurm is not)
_UNREACHABLE = re.compile(
    r"Unable to contact slurm controller|Socket timed out|Connection refused|Zero Bytes were transmitted"
    r"|Communication connection failure|Could not establish a configuration source|Unable to establish|"
    r"Transport endpoint|Slurm backup controller in standby mode|slurm_persist_conn|Unable to resolve",
    re.IGNORECASE)
_EXIT_CODE = re.compile(r"\bExitCode=(\d+):(\d+)")
#: signal numbers on Linux (only supervisor.py imports ``signal``)
SIGKILL, SIGTERM = 9, 15
_SIGNAL_NAMES = MappingProxyType({SIGKILL: "SIGKILL", SIGTERM: "SIGTERM"})
#: environment the watcher must not hand to a batch job: Slurm's own allocation wins on the node
_DROPPED_ENV = ("CUDA_VISIBLE_DEVICES",)

_NOT_SHARED_ADVICE = ("Put the queue root on a filesystem that the watcher's machine and every Slurm node mount at "
                      "the same path (NFS, Lustre, BeeGFS...), then touch retry.flag.")


@dataclass(frozen=True)
class SlurmJob:
    """One batch job as squeue last showed it."""

    state: str
    reason: str = ""
    node: str = ""

    @property
    def is_live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def has_ended(self) -> bool:
        return self.state not in LIVE_STATES and self.state != GONE


@dataclass(frozen=True)
class SlurmOptions:
    """The sbatch options of one attempt, before they become argv."""

    job_name: str
    partition: str | None
    gpus: int
    mem_mb: int | None
    time_min: int | None
    chdir: str
    output: str
    extra: tuple[str, ...]

    def argv(self, script: Path) -> list[str]:
        """``sbatch --parsable ...`` for ``script``; extra args last, so watcher.yaml and job file win."""
        argv = ["sbatch", "--parsable", "--no-requeue", f"--job-name={self.job_name}", f"--output={self.output}",
                f"--chdir={self.chdir}"]
        if self.partition:
            argv.append(f"--partition={self.partition}")
        if self.gpus:
            argv.append(f"--gres=gpu:{self.gpus}")
        if self.mem_mb:
            argv.append(f"--mem={self.mem_mb}M")
        if self.time_min:
            argv.append(f"--time={self.time_min}")
        return argv + list(self.extra) + [str(script)]


class _Query:
    """One squeue running in the background; output goes to temporary files so it can never block on a pipe."""

    def __init__(self, argv: list[str], ids: tuple[str, ...]):
        self.ids = ids
        self.started = time.monotonic()
        self._out = tempfile.TemporaryFile()
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._out, stderr=self._err,
                                     close_fds=True)

    def result(self) -> tuple[int, str, str] | None:
        """(returncode, stdout, stderr) once squeue exited, else None; never blocks."""
        if self.proc.poll() is None:
            return None
        return self.proc.returncode, _read_all(self._out), _read_all(self._err)

    def close(self) -> None:
        """Kill (if still running), reap, and drop the temporary files."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self._err.close()


class SlurmExecutor:
    """Attempts run as Slurm batch jobs; the Executor protocol of watcher/executor.py."""

    name = "slurm"
    #: Slurm places GPUs and memory on its nodes: admission must not gate on this machine's
    places_resources = True

    def __init__(self, config: "WatcherConfig", root: Path):
        slurm = dict(config.slurm or {})
        self.root = Path(root)
        self.partition: str | None = slurm.get("partition")
        self.sbatch_args = tuple(str(a) for a in slurm.get("sbatch_args") or ())
        self.poll_s = float(slurm.get("poll_s") or 2.0)
        self.kill_after_s = float(config.kill_after_s)
        self.scancel_margin_s = SCANCEL_MARGIN_S
        self.python = sys.executable
        self.package_parent = str(Path(__file__).resolve().parent.parent)
        self._jobs: dict[str, SlurmJob] = {}
        self._tracked: set[str] = set()
        self._ended_seen: dict[str, float] = {}
        self._cancelled: set[str] = set()
        self._query: _Query | None = None
        self._last_query_mono = -math.inf
        self._probe_wanted_mono = -math.inf
        self._stale = False
        self._down: str | None = None

    # -- the Executor protocol -----------------------------------------------------------------
    def unavailable(self, now: float) -> str | None:
        """"Slurm is not reachable: ..." after the last squeue or sbatch failed so; checked once per poll_s."""
        self._probe_wanted_mono = time.monotonic()
        self._poll(start=True)
        return self._down

    def launch(self, spec: LaunchSpec, job_name: str, slurm_options: dict | None) -> dict:
        """Write launch.json and slurm.sh into the job folder and sbatch the script; returns the Slurm job id."""
        if self._down is not None:
            raise ExecutorUnavailable(self._down)
        spec = dataclasses.replace(spec, job_dir=os.path.abspath(spec.job_dir), env=batch_env(spec.env))
        paths = JobPaths(Path(spec.job_dir))
        options = self.options_for(spec, job_name, slurm_options or {})
        argv = options.argv(paths.slurm_script)
        atomic_write_json(paths.launch_spec, spec.to_dict())
        atomic_write(paths.slurm_script, batch_script(paths, spec.attempt, argv, self.python, self.package_parent),
                     mode=0o755)
        slurm_id = self._submit(argv, paths)
        atomic_write_json(paths.slurm_record, {"attempt": spec.attempt, "slurm_job_id": slurm_id,
                                               "submitted_at": iso_utc(time.time()), "sbatch": argv})
        self._track(slurm_id, SlurmJob("PENDING", "None"))
        logger.debug("job %s: sbatch %s -> slurm job %s", paths.dir.name, shlex.join(argv[1:]), slurm_id)
        return {"slurm_job_id": slurm_id, "pid": None}

    def reap(self) -> None:
        """Collect a finished squeue and start the next one when due; never blocks."""
        self._poll(start=True)

    def is_alive(self, paths: JobPaths, attempt: dict) -> bool:
        """True while Slurm holds the job (queued or running), its supervisor holds the lock, or Slurm is unknown."""
        if supervisor_holds_lock(paths):
            return True
        slurm_id = self._slurm_id(paths, attempt)
        if slurm_id is None:
            return False
        job = self._state(slurm_id)
        if job is None or job.is_live:
            return True  # unknown (not asked yet, or Slurm unreachable) is never taken for dead
        if job.state == GONE:
            return False
        return self._within_grace(paths, slurm_id)

    def read_started(self, paths: JobPaths) -> dict | None:
        """The supervisor's start record; before it exists, what slurm.json says was submitted (if not finished)."""
        started = read_json(paths.started)
        if started is not None:
            return started
        submitted = read_json(paths.slurm_record) or {}
        if not submitted.get("slurm_job_id") or _attempt_ended(paths, submitted.get("attempt")):
            return None
        # recovery needs this when the watcher died between sbatch and run.json: the attempt exists in Slurm
        return {"attempt": submitted.get("attempt"), "supervisor_pid": None, "job_pid": None,
                "started_at": submitted.get("submitted_at"), "slurm_job_id": submitted["slurm_job_id"]}

    def read_exit(self, paths: JobPaths, attempt: dict) -> dict | None:
        """The supervisor's exit record; or, once Slurm ended the job without one, a record written in its place."""
        record = read_json(paths.exit_record)
        slurm_id = self._slurm_id(paths, attempt)
        if record is not None or slurm_id is None:
            if record is not None and slurm_id is not None:
                self._forget(slurm_id)
            return record
        job = self._state(slurm_id)
        if job is None or not job.has_ended or supervisor_holds_lock(paths) or self._within_grace(paths, slurm_id):
            return None
        if attempt.get("ended_at"):
            return None  # finished long ago; its exit.json was cleared for a next attempt that never reached sbatch
        _refresh_listing(paths.dir)  # an NFS client may cache "no exit.json"; listing the folder revalidates
        record = read_json(paths.exit_record) or self._synthesize(paths, attempt, slurm_id, job)
        self._forget(slurm_id)
        return record

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
        job = self._state(slurm_id) if slurm_id else None
        if job is None:
            return self._down if slurm_id and not paths.started.exists() else None
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
        if job is None or not job.is_live or slurm_id in self._cancelled:
            return
        queued = job.state in QUEUED_STATES and not paths.started.exists()
        if queued or now - stop_requested_at >= grace_s + self.kill_after_s + self.scancel_margin_s:
            why = "still queued in Slurm" if queued else "its supervisor did not end it in time"
            logger.info("job %s: scancel %s (stop requested, %s)", paths.dir.name, slurm_id, why)
            self._scancel(slurm_id, paths)

    def start(self) -> None:
        return None  # sbatch and squeue run on demand

    def wake_fds(self) -> list[int]:
        return []  # Slurm's news arrives by polling squeue

    def close(self) -> None:
        if self._query is not None:
            self._query.close()
            self._query = None

    # -- sbatch options ------------------------------------------------------------------------
    def options_for(self, spec: LaunchSpec, job_name: str, job_slurm: dict) -> SlurmOptions:
        """The attempt's sbatch options from its LaunchSpec, its resources, watcher.yaml and the job's slurm block."""
        resources = _resources(Path(spec.job_dir))
        gpus = int(resources.get("gpus") or 0)
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
        )

    # -- talking to Slurm ------------------------------------------------------------------------
    def _submit(self, argv: list[str], paths: JobPaths) -> str:
        """Run sbatch; ExecutorUnavailable when Slurm cannot be reached, SpawnFailed when it refuses the job."""
        try:
            done = _run(argv)
        except FileNotFoundError:
            raise self._went_down("sbatch is not on PATH; install the Slurm client or fix PATH") from None
        except subprocess.TimeoutExpired:
            raise self._went_down(f"sbatch did not answer in {COMMAND_TIMEOUT_S:g} s") from None
        first = _first_line(done.stderr)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[-1].split(";")[0]
        if _UNREACHABLE.search(done.stderr):
            raise self._went_down(first)
        raise SpawnFailed(f"{paths.dir}: Slurm refused the job: {first or f'sbatch exited {done.returncode}'}; "
                          "fix slurm.partition / slurm.sbatch_args in the job file or watcher.yaml")

    def _went_down(self, detail: str) -> ExecutorUnavailable:
        self._down = f"Slurm is not reachable: {detail}"
        self._stale = True
        logger.warning("slurm: %s", self._down)
        return ExecutorUnavailable(self._down)

    def _scancel(self, slurm_id: str, paths: JobPaths) -> None:
        try:
            done = _run(["scancel", slurm_id])
        except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
            logger.warning("job %s: scancel %s failed: %s", paths.dir.name, slurm_id, exc)
            return
        if done.returncode != 0:
            logger.warning("job %s: scancel %s failed: %s", paths.dir.name, slurm_id, _first_line(done.stderr))
            return
        self._cancelled.add(slurm_id)
        self._stale = True

    def _exit_status(self, slurm_id: str) -> tuple[int | None, int | None]:
        """(exit code, signal) of the batch script from ``scontrol show job`` (kept for MinJobAge), or Nones."""
        try:
            done = _run(["scontrol", "-o", "show", "job", slurm_id])
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return None, None
        match = _EXIT_CODE.search(done.stdout)
        return (int(match.group(1)), int(match.group(2))) if match else (None, None)

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
        else:
            self._stale = True  # recovery asks about ids we never saw: the next reap queries at once

    def _forget(self, slurm_id: str) -> None:
        for store in (self._jobs, self._ended_seen):
            store.pop(slurm_id, None)
        self._tracked.discard(slurm_id)
        self._cancelled.discard(slurm_id)

    def _poll(self, start: bool) -> None:
        """Take a finished squeue's answer; with ``start``, launch the next one when poll_s has passed."""
        now = time.monotonic()
        if self._query is not None:
            result = self._query.result()
            if result is None and now - self._query.started > QUERY_TIMEOUT_S:
                result = (-1, "", f"squeue did not answer in {QUERY_TIMEOUT_S:g} s")
            if result is None:
                return
            query, self._query = self._query, None
            query.close()
            self._absorb(query.ids, *result)
        wanted = self._tracked or now - self._probe_wanted_mono < 2 * self.poll_s
        if start and wanted and (self._stale or now - self._last_query_mono >= self.poll_s):
            self._start_query(now)

    def _start_query(self, now: float) -> None:
        ids = tuple(sorted(self._tracked, key=_id_order))
        argv = (["squeue", "-h", "-t", "all", "-o", "%i|%T|%r|%B", "-j", ",".join(ids)] if ids
                else ["squeue", "-h", "--me", "-o", "%i"])
        self._last_query_mono, self._stale = now, False
        try:
            self._query = _Query(argv, ids)
        except OSError as exc:
            self._absorb(ids, -1, "", f"cannot run squeue ({exc.strerror}); install the Slurm client or fix PATH")

    def _absorb(self, ids: tuple[str, ...], returncode: int, out: str, err: str) -> None:
        """Turn one squeue answer into job states (ids it did not list are GONE) and reachability."""
        if returncode != 0 and "Invalid job id" not in err:
            self._down = f"Slurm is not reachable: {_first_line(err) or f'squeue exited {returncode}'}"
            logger.debug("slurm: %s", self._down)
            return
        if self._down is not None:
            logger.info("slurm: reachable again")
        self._down = None
        seen = _parse_squeue(out) if returncode == 0 else {}
        now = time.monotonic()
        for slurm_id in ids:
            job = seen.get(slurm_id, SlurmJob(GONE))
            self._jobs[slurm_id] = job
            if job.has_ended:
                self._ended_seen.setdefault(slurm_id, now)

    def _within_grace(self, paths: JobPaths, slurm_id: str) -> bool:
        """A supervisor that started may have written exit.json that this machine cannot see yet."""
        first = self._ended_seen.get(slurm_id)
        if first is None or not paths.started.exists():
            return False
        return time.monotonic() - first < EXIT_RECORD_GRACE_S

    def _slurm_id(self, paths: JobPaths, attempt: dict) -> str | None:
        """The attempt's Slurm job id: from run.json, else from slurm.json (the watcher died right after sbatch)."""
        slurm_id = attempt.get("slurm_job_id")
        if slurm_id and not attempt.get("ended_at"):
            return str(slurm_id)  # the usual case: no file to read
        record = read_json(paths.slurm_record) or {}
        known, submitted = attempt.get("n"), int(record.get("attempt") or 0)
        if record.get("slurm_job_id") and (known is None or submitted > int(known)
                                           or (submitted == int(known) and not slurm_id)):
            return str(record["slurm_job_id"])
        return str(slurm_id) if slurm_id else None

    # -- when Slurm ended the job without an exit record ----------------------------------------
    def _synthesize(self, paths: JobPaths, attempt: dict, slurm_id: str, job: SlurmJob) -> dict:
        """Write exit.json in the supervisor's place, and say in output.log what Slurm did."""
        code, sig = self._exit_status(slurm_id) if job.state in ("FAILED", "COMPLETED") else (None, None)
        outcome = ended_outcome(job, code, sig, paths, slurm_id, self.python)
        started = read_json(paths.started) or {}
        now = time.time()
        record = {
            "attempt": attempt.get("n") or (read_json(paths.slurm_record) or {}).get("attempt"),
            "job_pid": started.get("job_pid"), "exit_code": outcome["exit_code"], "signal": outcome["signal"],
            "signal_name": _SIGNAL_NAMES.get(outcome["signal"]), "started_at": started.get("started_at"),
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


# -- pure helpers (tests call these directly) ------------------------------------------------------


def batch_env(env: dict[str, str]) -> dict[str, str]:
    """The job's env for the batch job: no GPU choice of the watcher's and no SLURM_* of the watcher's own shell."""
    return {k: v for k, v in env.items() if k not in _DROPPED_ENV and not k.startswith("SLURM_")}


def time_limit_min(timeout_s: float | None, stop_grace_s: float, kill_after_s: float) -> int | None:
    """sbatch --time in whole minutes (Slurm's minimum is 1), long enough for trainq's own timeout path to finish."""
    if timeout_s is None:
        return None
    return max(1, math.ceil((timeout_s + stop_grace_s + kill_after_s + TIME_LIMIT_MARGIN_S) / 60))


def batch_script(paths: JobPaths, attempt: int, argv: list[str], python: str, package_parent: str) -> str:
    """slurm.sh: check the job folder is visible on the node, then exec the attempt's supervisor (cd-independent)."""
    q = shlex.quote
    return f"""#!/bin/sh
# trainq job {paths.dir.name}, attempt {attempt}: written by the watcher and submitted with
#   {shlex.join(argv)}
# It runs the attempt's supervisor, which writes output.log, supervisor.json and exit.json in the job folder.
JOB_DIR={q(str(paths.dir))}
if [ ! -r "$JOB_DIR/{paths.launch_spec.name}" ]; then
  echo "trainq: job folder $JOB_DIR is not visible on Slurm node $(hostname): the queue root must be on a shared \
filesystem that the watcher's machine and every node mount at the same path (NFS, Lustre, ...)" >&2
  exit {EXIT_NOT_SHARED}
fi
PYTHONPATH={q(package_parent)}${{PYTHONPATH:+:$PYTHONPATH}}
export PYTHONPATH
exec {q(python)} -m trainq.watcher.supervisor "$JOB_DIR" --spec "$JOB_DIR/{paths.launch_spec.name}"
"""


def ended_outcome(job: SlurmJob, code: int | None, sig: int | None, paths: JobPaths, slurm_id: str,
                  python: str) -> dict:
    """How a batch job that left no exit record ended: exit_code, signal, stop_reason, evidence, diagnosis."""
    node = f" on node {job.node}" if job.node and job.node != "(null)" else ""
    stopped = "stop_flag" if paths.stop_flag.exists() else None
    by_state = {
        "CANCELLED": (None, SIGTERM, stopped, "preempted", f"Slurm cancelled the job{node} (scancel)"),
        "PREEMPTED": (None, SIGTERM, None, "preempted", f"Slurm preempted the job{node}"),
        "NODE_FAIL": (None, SIGKILL, None, "killed", f"Slurm node{node or ''} failed while running the job"),
        "BOOT_FAIL": (None, SIGKILL, None, "killed", f"Slurm could not boot the node{node} for the job"),
        "OUT_OF_MEMORY": (None, SIGKILL, None, "oom", f"Slurm killed the job{node}: out of memory (more than its "
                                                      "--mem, from resources.ram_gb)"),
        "TIMEOUT": (None, SIGKILL, "timeout", "timeout", f"Slurm's time limit ended the job{node}"),
        "DEADLINE": (None, SIGKILL, "timeout", "timeout", f"Slurm's deadline ended the job{node}"),
    }
    if job.state in by_state:
        exit_code, signal, stop_reason, kind, evidence = by_state[job.state]
        return _outcome(exit_code, signal, stop_reason, None if stop_reason else kind, evidence)
    if job.state == "COMPLETED":  # slurm.sh exits with the job's status, so 0 means the job succeeded
        return _outcome(0, None, stopped, None, f"Slurm reports COMPLETED{node}")
    return _failed_outcome(code, sig, paths, slurm_id, python, node)


def _failed_outcome(code: int | None, sig: int | None, paths: JobPaths, slurm_id: str, python: str,
                    node: str) -> dict:
    """FAILED (or an unknown state): the job folder not visible, no Python on the node, a kill, or the output's tail."""
    output = paths.dir / SLURM_OUTPUT.replace("%j", slurm_id)
    tail = _tail_lines(output)
    if code == EXIT_NOT_SHARED or (not output.exists() and not paths.started.exists()):
        evidence = tail or (f"Slurm could not start the job{node}: it cannot see or write the job folder "
                            f"{paths.dir} (no {output.name} was written); the queue root must be on a shared filesystem")
        return _outcome(None, None, None, "unknown", evidence, _NOT_SHARED_ADVICE)
    if code in EXIT_NO_PYTHON:
        return _outcome(code, None, None, "unknown", tail or f"cannot run {python}{node}",
                        f"Install trainq's Python at {python} on every Slurm node (or keep the watcher's virtualenv "
                        "on the shared filesystem), then touch retry.flag.")
    if sig:
        return _outcome(None, sig, None, "killed" if sig == SIGKILL else "unknown",
                        f"the supervisor was killed by signal {sig}{node}" + (f": {tail}" if tail else ""))
    return _outcome(code, None, None, "unknown", tail or f"Slurm reports FAILED{node} (exit code {code})")


def _outcome(exit_code: int | None, signal: int | None, stop_reason: str | None, kind: str | None,
             evidence: str, advice: str | None = None) -> dict:
    diagnosis = None
    if kind is not None:
        diagnosis = {"kind": kind, "evidence": evidence}
        if advice:
            diagnosis["advice"] = advice
    return {"exit_code": exit_code, "signal": signal, "stop_reason": stop_reason, "evidence": evidence,
            "diagnosis": diagnosis}


def _attempt_ended(paths: JobPaths, n: object) -> bool:
    """True when run.json records attempt ``n`` as finished."""
    attempts = (read_json(paths.run) or {}).get("attempts") or []
    return any(a.get("n") == n and a.get("ended_at") for a in attempts if isinstance(a, dict))


def _parse_squeue(out: str) -> dict[str, SlurmJob]:
    """``id|STATE|reason|node`` lines into SlurmJobs by id."""
    jobs = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2 and parts[0]:
            jobs[parts[0]] = SlurmJob(parts[1].split()[0] if parts[1] else "UNKNOWN",
                                      parts[2] if len(parts) > 2 else "", parts[3] if len(parts) > 3 else "")
    return jobs


def _resources(job_dir: Path) -> dict:
    """The job file's resources block (gpus, ram_gb) as the watcher validated it."""
    from .errors import WatcherError
    from .jobspec import load_job_file

    try:
        spec = load_job_file(JobPaths(job_dir).spec, f"{job_dir.name}/job.yaml")
    except (WatcherError, OSError) as exc:
        raise SpawnFailed(f"{job_dir}: cannot read job.yaml for Slurm's options ({exc}); submit the job again") from exc
    return spec.resources.to_dict()


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S, check=False)


def _read_all(f) -> str:
    f.seek(0)
    return f.read().decode("utf-8", errors="replace")


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _id_order(slurm_id: str) -> tuple[int, str]:
    return (int(slurm_id), "") if slurm_id.isdigit() else (0, slurm_id)


def _tail_lines(path: Path, max_chars: int = 300) -> str:
    """The last lines of Slurm's output file, joined, at most ``max_chars``."""
    try:
        text = path.read_bytes()[-4096:].decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines)[-max_chars:]


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
