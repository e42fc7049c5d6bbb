"""The daemon's in-memory view of one job, and the pure rules that decide how an attempt ended.

``Job`` is mutable and private to the daemon; what the outside sees is its ``run.json``
(``Job.run``), written through ``save()`` only.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from trainq.watcher.daemon.checkpoints import checkpoint_mtime, find_checkpoint, latest_checkpoint, note_skipped, rebase
from trainq.watcher.daemon.diagnosis import (
    SIGKILL,
    Diagnosis,
    advice_for,
    diagnose,
    fit_advice,
    read_kernel_log,
    read_metrics_tail,
    read_tail,
    stalled_diagnosis,
)
from trainq.watcher.faces.progress import MetricsTail
from trainq.watcher.faces.progress_log import LogProgress
from trainq.watcher.spec.contract import ATTEMPT_BANNER_PREFIX, JobPaths
from trainq.watcher.spec.errors import JobFolderRemoved
from trainq.watcher.spec.folders import JobState
from trainq.watcher.spec.fsutil import atomic_write_json, read_json
from trainq.watcher.spec.jobspec import JobSpec
from trainq.watcher.spec.units import iso_utc, parse_iso
from trainq.watcher.supervisor.hooks import HOOK_STATUSES, mark_due
from trainq.watcher.supervisor.stacks import evidence as stack_evidence

RUN_SCHEMA_VERSION = 1
#: statuses after which a job never runs again unless retried
FINAL_STATUSES = ("done", "failed", "cancelled", "timeout", "rejected")
#: statuses a run.json may hold while its folder is in running/
LIVE_STATUSES = ("running", "stopping")
#: an attempt's outcome (never a job's status) when it exited with the job's checkpoint_exit_code
CHECKPOINTED = "checkpointed"
#: attempts run.json keeps in full; older ones are folded into ``attempts_earlier`` (counts), so a job that
#: restarts thousands of times (checkpoint exits) keeps a run.json of bounded size (docs/contract.md)
MAX_ATTEMPTS_KEPT = 100


class ProgressReaders(Protocol):
    """A running job's incremental readers of metrics.jsonl and output.log (report.py keeps them)."""

    metrics: MetricsTail
    log: LogProgress
    usage_at: float


@dataclass
class Job:
    """One job the daemon knows: where it is, its run.json, its spec, and live readers."""

    id: str
    state: JobState
    dir: Path
    run: dict
    spec: JobSpec | None = None
    readers: ProgressReaders | None = None  # set by the report for running jobs
    health: str | None = None
    last_activity: float = 0.0
    activity_sig: tuple = field(default_factory=tuple)
    usage: dict | None = None
    pids: tuple[int, ...] = ()
    checked: bool = False  # admission has checked that this machine can ever run it
    unsaved_since: float | None = None  # launched at this time, run.json not yet written since
    held: bool = False  # pending on dependencies: out of the start order (workflows.py)
    contained: str | None = None  # the step whose internal error failed this job (containment.py)
    spec_sig: tuple | None = None  # (size, mtime_ns, inode) of the job.yaml the spec was read from
    spec_change: tuple | None = None  # (new sig, first seen at) of an edit not yet re-read (intake.py)
    _paths: JobPaths | None = field(default=None, repr=False, compare=False)
    #: (the spec, priority/order/executor key, the admission Request) it was made from: a pending job near the
    #: head of the queue is planned in every pass (starting.py's ``_request``)
    request: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def paths(self) -> JobPaths:
        """The paths in the job's folder where it is now (made again only when the folder moved)."""
        if self._paths is None or self._paths.dir is not self.dir:
            self._paths = JobPaths(self.dir)
        return self._paths

    @property
    def status(self) -> str:
        return self.run.get("status", "pending")

    @property
    def priority(self) -> int:
        return int(self.run.get("priority") or 0)

    @property
    def order(self) -> int:
        return int(self.run.get("order") or 0)

    @property
    def attempt(self) -> int:
        return int(self.run.get("attempt") or 0)

    @property
    def known_spec(self) -> JobSpec:
        """The spec of a job that has one: every job admitted to pending/ or running (a file without a valid
        spec is rejected at the inbox). Raises for one without, which the step's guard fails like any error."""
        if self.spec is None:
            raise ValueError(f"job {self.id} has no job spec")
        return self.spec

    def sort_key(self) -> tuple[int, int, str]:
        """Start order: higher priority first, then acceptance order."""
        return (-self.priority, self.order, self.id)

    def save(self, durable: bool = True) -> None:
        """Write run.json atomically; JobFolderRemoved when the folder was removed by hand."""
        fold_attempts(self.run)  # at most MAX_ATTEMPTS_KEPT attempts in full on disk, counts for the rest
        try:
            if self.run.get("status") in HOOK_STATUSES:
                mark_due(self.paths, self.spec, self.run)  # the hook is on disk before the conclusion is
            atomic_write_json(self.paths.run, self.run, durable=durable, redact=True)
        except FileNotFoundError:
            if self.dir.exists():
                raise
            raise JobFolderRemoved(self.id, f"{self.state.value}/{self.id}") from None
        self.unsaved_since = None

    def current_attempt(self) -> dict | None:
        attempts = self.run.get("attempts") or []
        return attempts[-1] if attempts else None


def new_run(spec: JobSpec | None, order: int, now: float, name: str) -> dict:
    """The run.json of a freshly accepted (or rejected) job."""
    return {
        "schema_version": RUN_SCHEMA_VERSION,
        "name": (spec.name if spec and spec.name else name),
        "status": "pending",
        "priority": spec.priority if spec else 0,
        "order": order,
        "submitted_at": iso_utc(now),
        "started_at": None,
        "finished_at": None,
        "attempt": 0,
        "attempts": [],
        "diagnosis": None,
        "error": None,
        "errors": [],
        "resume_from": None,
        "not_before": None,
        "waiting_for": None,
        "gpus": [],
        "stop_requested_at": None,
        "executor": "local",
    }


def load_run(paths: JobPaths) -> dict | None:
    """run.json as a dict, or None when missing or unreadable."""
    return read_json(paths.run)


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, as run.json will say it."""

    status: str
    diagnosis: Diagnosis | None


def judge_exit(run: dict, exit_record: dict, paths: JobPaths, spec: JobSpec | None = None) -> Outcome:
    """Turn an exit record plus what the watcher knew (stop requested, stall) into a status and diagnosis.

    ``spec`` says whether the job was the built-in trainer or a command: the advice differs.
    """
    reason = exit_record.get("stop_reason")
    if run.get("stop_requested_by") == "internal_error" and run.get("diagnosis"):
        return Outcome("failed", Diagnosis.from_dict(run["diagnosis"]))  # containment.py stopped it
    if run.get("stop_requested_by") == "stalled" and reason != "timeout":
        started = parse_iso(((run.get("attempts") or [{}])[-1] or {}).get("started_at"))
        return Outcome(
            "failed", stalled_diagnosis(float(run.get("stall_after_s") or 0), stack_evidence(paths.dir, started))
        )
    if run.get("stop_requested_by") == "schedule" and reason != "timeout":
        return Outcome(
            "failed",
            Diagnosis(
                "schedule",
                advice_for("schedule"),
                str((run.get("lr_deviation") or {}).get("words") or "off the declared lr schedule"),
            ),
        )
    if reason != "timeout" and (reason == "stop_flag" or run.get("status") == "stopping"):
        return Outcome("cancelled", None)
    if reason == "cancelled":  # ended from outside trainq (Slurm: scancel by a user or an admin): never retried
        return Outcome("cancelled", diagnose(exit_record, attempt_log_tail(paths), []))
    if reason is None and exit_record.get("exit_code") == 0 and not exit_record.get("signal"):
        return Outcome("done", None)
    if reason is None and is_checkpoint_exit(exit_record, spec):
        stale = stale_checkpoint_exit(run, exit_record, paths)
        if stale is None:
            return Outcome(CHECKPOINTED, None)
        return Outcome("failed", Diagnosis("no_checkpoint", advice_for("no_checkpoint"), stale))
    log_tail = attempt_log_tail(paths)
    diagnosis = diagnose(
        exit_record,
        log_tail,
        attempt_metrics(paths, run),
        kernel_log=read_kernel_log() if _was_sigkilled(exit_record) and _ran_here(exit_record) else None,
        train=spec is None or spec.is_train,
    )
    program = ((run.get("attempts") or [{}])[-1] or {}).get("program")
    diagnosis = fit_advice(diagnosis, log_tail, spec is None or spec.has_resume, program)
    return Outcome("timeout" if reason == "timeout" else "failed", diagnosis)


def is_checkpoint_exit(exit_record: dict, spec: JobSpec | None) -> bool:
    """The job exited with its ``checkpoint_exit_code``: "saved, run me again" (docs/records.md)."""
    code = spec.checkpoint_exit_code if spec is not None else None
    return code is not None and exit_record.get("exit_code") == code and not exit_record.get("signal")


def checkpoint_mark(paths: JobPaths) -> dict | None:
    """The job's latest checkpoint as a checkpoint exit leaves it: ``{path (relative to the job), mtime}``."""
    found = latest_checkpoint(paths)
    if found is None:
        return None
    return {"path": relative_to_job(found, paths), "mtime": checkpoint_mtime(found)}


def stale_checkpoint_exit(run: dict, exit_record: dict, paths: JobPaths) -> str | None:
    """Why a checkpoint exit made no new checkpoint (the evidence), or None when it made one.

    New means: not the checkpoint the previous checkpoint exit left (run.json ``checkpoint_mark``: its
    path and when it was written), or, for a job's first checkpoint exit, not the checkpoint the attempt
    resumed from unless written again since the attempt started (a ``ckpt_latest`` saved in place).
    """
    code = exit_record.get("exit_code")
    mark = checkpoint_mark(paths)
    if mark is None:
        return f"exit code {code} (its checkpoint_exit_code), but the job has no checkpoint to resume from"
    before = run.get("checkpoint_mark")
    if isinstance(before, dict):
        if (before.get("path"), before.get("mtime")) != (mark["path"], mark["mtime"]):
            return None
    else:
        attempt = ((run.get("attempts") or [{}])[-1]) or {}
        resumed = attempt.get("resumed_from")
        if not resumed or relative_to_job(str(rebase(Path(resumed), paths)), paths) != mark["path"]:
            return None
        started = parse_iso(attempt.get("started_at"))
        if started is None or (mark["mtime"] or 0.0) >= started:
            return None
    return (
        f"exit code {code} (its checkpoint_exit_code), but no new checkpoint since the previous one: "
        f"the latest is still {mark['path']}"
    )


def fold_attempts(run: dict, keep: int = MAX_ATTEMPTS_KEPT) -> None:
    """Keep the last ``keep`` attempts in run.json in full; fold older ones into ``attempts_earlier`` (counts)."""
    attempts = run.get("attempts") or []
    if len(attempts) <= keep:
        return
    found = run.get("attempts_earlier")
    earlier: dict = found if isinstance(found, dict) else {}
    for attempt in attempts[:-keep]:
        _fold_one(earlier, attempt if isinstance(attempt, dict) else {})
    run["attempts"] = attempts[-keep:]
    run["attempts_earlier"] = earlier


def _fold_one(earlier: dict, attempt: dict) -> None:
    """Count one attempt into ``attempts_earlier`` (the shape run.schema.json documents)."""
    earlier["count"] = int(earlier.get("count") or 0) + 1
    n = attempt.get("n")
    if isinstance(n, int):
        earlier["first_n"] = min(n, earlier.get("first_n") or n)
        earlier["last_n"] = max(n, earlier.get("last_n") or n)
    earlier["first_started_at"] = earlier.get("first_started_at") or attempt.get("started_at")
    earlier["last_ended_at"] = attempt.get("ended_at") or earlier.get("last_ended_at")
    if attempt.get("checkpoint_exit"):
        earlier["checkpoint_exits"] = int(earlier.get("checkpoint_exits") or 0) + 1
    _count(earlier, "exit_codes", None if attempt.get("exit_code") is None else str(attempt["exit_code"]))
    _count(earlier, "signals", attempt.get("signal_name") or (attempt.get("signal") and str(attempt["signal"])))
    _count(earlier, "diagnoses", (attempt.get("diagnosis") or {}).get("kind"))
    start, end = parse_iso(attempt.get("started_at")), parse_iso(attempt.get("ended_at"))
    if start is not None and end is not None:
        earlier["runtime_s"] = round(float(earlier.get("runtime_s") or 0.0) + max(0.0, end - start), 3)
    cost = attempt.get("cost")
    if isinstance(cost, dict) and isinstance(cost.get("amount"), (int, float)):
        total = earlier.setdefault("cost", {"amount": 0.0, "currency": cost.get("currency"), "gpu_hours": 0.0})
        total["amount"] = round(total["amount"] + cost["amount"], 6)
        total["gpu_hours"] = round(total["gpu_hours"] + float(cost.get("gpu_hours") or 0.0), 6)


def _count(earlier: dict, key: str, value: str | None) -> None:
    if value:
        counts = earlier.setdefault(key, {})
        counts[value] = int(counts.get(value) or 0) + 1


def retries_used(job: Job) -> int:
    """Attempts after the first that count as retries: checkpoint exits' restarts do not."""
    return max(0, job.attempt - 1 - int(job.run.get("checkpoint_restarts") or 0))


def _ran_here(exit_record: dict) -> bool:
    """False for an attempt a batch scheduler ran (its exit record names its batch job): this machine's kernel
    log says nothing about a node's OOM kills."""
    return not exit_record.get("slurm_job_id")


def _was_sigkilled(exit_record: dict) -> bool:
    return exit_record.get("signal") == SIGKILL or exit_record.get("exit_code") == 128 + SIGKILL


def attempt_log_tail(paths: JobPaths) -> str:
    """The end of output.log from the current attempt's banner on (earlier attempts are not evidence)."""
    tail = read_tail(paths.log)
    cut = tail.rfind(ATTEMPT_BANNER_PREFIX)
    if cut < 0:
        return tail
    return tail[cut:].partition("\n")[2]


def attempt_metrics(paths: JobPaths, run: dict) -> list[dict]:
    """metrics.jsonl records written since the current attempt started."""
    started = parse_iso(((run.get("attempts") or [{}])[-1] or {}).get("started_at"))
    records = read_metrics_tail(paths.metrics)
    if started is None:
        return records
    return [r for r in records if not isinstance(r.get("time"), (int, float)) or r["time"] >= started - 1]


def supervisor_lost(started: dict | None) -> Outcome:
    """The attempt's supervisor vanished without an exit record (SIGKILL, OOM killer, reboot)."""
    pid = (started or {}).get("supervisor_pid")
    who = f"supervisor (pid {pid})" if pid else "supervisor"
    return Outcome(
        "failed",
        Diagnosis(
            kind="killed",
            advice="The job's supervisor was killed (kill -9, the OOM killer or a reboot); "
            "check `dmesg` and retry with `trainq retry ID`.",
            evidence=f"the job's {who} died without writing an exit record",
        ),
    )


def resume_checkpoint(job: Job) -> str | None:
    """The absolute path an attempt starting now resumes from; checkpoints passed over are noted in output.log."""
    if job.spec is None or not job.spec.has_resume:
        return None
    found = find_checkpoint(job.paths)
    note_skipped(job.paths.log, found)
    return found.path


def resume_point(job: Job) -> str | None:
    """Where the job's next attempt would resume, relative to its folder; None without resume semantics."""
    if job.spec is None or not job.spec.has_resume:
        return None
    return relative_to_job(latest_checkpoint(job.paths), job.paths)


def relative_to_job(path: str | None, paths: JobPaths) -> str | None:
    """A checkpoint path as run.json records it: relative to the job folder when inside it."""
    if path is None:
        return None
    try:
        return str(Path(path).relative_to(paths.dir.resolve()))
    except ValueError:
        return path


def should_retry(job: Job, outcome: Outcome) -> bool:
    """A failure whose kind the job's ``retries.on`` lists, while attempts remain."""
    if job.spec is None or outcome.diagnosis is None or outcome.status not in ("failed", "timeout"):
        return False
    retries = job.spec.retries
    return outcome.diagnosis.kind in retries.on and retries_used(job) < retries.max


def load_job(job_dir: Path, state: JobState) -> Job | None:
    """Rebuild a Job from its folder (run.json plus job.yaml); None when run.json is unreadable."""
    from trainq.watcher.spec.errors import InvalidJobSpec
    from trainq.watcher.spec.jobspec import load_job_file

    paths = JobPaths(job_dir)
    run = load_run(paths)
    if run is None:
        return None
    try:
        st = os.stat(paths.spec)  # before the read: a change in between shows as a change later, never hides
        spec = load_job_file(paths.spec, f"{state.value}/{job_dir.name}/job.yaml")
    except (InvalidJobSpec, OSError):
        st, spec = None, None
    run.setdefault("id", job_dir.name)
    sig = (st.st_size, st.st_mtime_ns, st.st_ino) if st is not None and spec is not None else None
    return Job(job_dir.name, state, job_dir, run, spec, spec_sig=sig)


class JobIndex:
    """The live jobs (pending and running) by id and by state, so a tick never scans 10,000 jobs to find 3.

    Pending jobs are also kept in start order (``pending_head``) and those admission has not yet
    checked are listed apart (``unchecked``), so starting the next of 10,000 queued jobs costs the
    same as starting the next of 3.
    """

    def __init__(self) -> None:
        self._all: dict[str, Job] = {}
        self._by_state: dict[JobState, dict[str, Job]] = {state: {} for state in JobState}
        self._order: list[tuple[tuple[int, int, str], str]] = []  # (sort key, id) of pending jobs, sorted
        self._keys: dict[str, tuple[int, int, str]] = {}  # id -> its key in _order
        self._unchecked: dict[str, Job] = {}
        self._held: dict[str, Job] = {}  # pending jobs waiting on dependencies, outside _order

    def add(self, job: Job) -> None:
        self.remove(job.id)
        self._all[job.id] = job
        self._enter(job, job.state)

    def remove(self, job_id: str) -> Job | None:
        job = self._all.pop(job_id, None)
        if job is not None:
            self._leave(job)
        return job

    def move(self, job: Job, state: JobState) -> None:
        """Record that ``job``'s folder moved to ``state``."""
        self._leave(job)
        job.state = state
        if job.id in self._all:
            self._enter(job, state)

    def _enter(self, job: Job, state: JobState) -> None:
        self._by_state[state][job.id] = job
        if state is JobState.PENDING and not job.held:
            key = job.sort_key()
            self._keys[job.id] = key
            bisect.insort(self._order, (key, job.id))
        if state is JobState.PENDING and not job.checked:
            self._unchecked[job.id] = job
        if state is JobState.PENDING and job.held:
            self._held[job.id] = job

    def _leave(self, job: Job) -> None:
        self._by_state[job.state].pop(job.id, None)
        key = self._keys.pop(job.id, None)
        if key is not None:
            i = bisect.bisect_left(self._order, (key, job.id))
            if i < len(self._order) and self._order[i] == (key, job.id):
                del self._order[i]
        self._unchecked.pop(job.id, None)
        self._held.pop(job.id, None)

    def hold(self, job: Job) -> None:
        """Take a pending job out of the start order while it waits on dependencies."""
        self._leave(job)
        job.held = True
        if job.id in self._all:
            self._enter(job, job.state)

    def release(self, job: Job) -> None:
        """Put a held job back into the start order."""
        self._leave(job)
        job.held = False
        if job.id in self._all:
            self._enter(job, job.state)

    def held(self, n: int) -> list[Job]:
        """Up to ``n`` pending jobs held on dependencies, in start order."""
        return sorted(self._held.values(), key=Job.sort_key)[:n] if self._held else []

    def pending_head(self, n: int) -> list[Job]:
        """The first ``n`` pending jobs in start order (priority, then acceptance order)."""
        pending = self._by_state[JobState.PENDING]
        return [pending[job_id] for _key, job_id in self._order[:n]]

    def take_unchecked(self) -> list[Job]:
        """Pending jobs admission has not checked yet (each is returned once)."""
        jobs = list(self._unchecked.values())
        self._unchecked.clear()
        return jobs

    def in_state(self, state: JobState) -> list[Job]:
        return list(self._by_state[state].values())

    def count(self, state: JobState) -> int:
        return len(self._by_state[state])

    def get(self, job_id: str) -> Job | None:
        return self._all.get(job_id)

    def values(self):
        return self._all.values()

    def __getitem__(self, job_id: str) -> Job:
        return self._all[job_id]

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._all

    def __len__(self) -> int:
        return len(self._all)
