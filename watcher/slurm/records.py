"""The small shared parts of the Slurm executor: submissions in their states, the refusals, and what is added to
an exit record from Slurm's side (its final state, who sent a signal, a rank's own exit code)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trainq.watcher.slurm.batch import SlurmOptions
from trainq.watcher.slurm.ranks import real_rank_exit
from trainq.watcher.slurm.state import (
    CANCELLED_ADVICE,
    CANCELLED_OUTSIDE,
    SIGKILL,
    SIGTERM,
    TIME_LIMIT_ADVICE,
    SlurmJob,
    cancelled_evidence,
    failed_node,
    killed_for_memory,
    oom_evidence,
    taken_by_slurm,
    time_limit_evidence,
)
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import ExecutorUnavailable, SpawnFailed
from trainq.watcher.spec.fsutil import append_line, read_json
from trainq.watcher.spec.units import parse_iso

#: how long a job refused by a QOS/association submit limit waits before it is submitted again (s)
LIMIT_RETRY_S = 30.0


@dataclass
class Unconfirmed:
    """A submission whose sbatch got no answer: it may or may not exist in Slurm."""

    paths: JobPaths
    attempt: int
    tag: str
    argv: list[str]
    missed: int = 0
    index: int | None = None  # the job's task in a job array (its sweep index); None for a job of its own


@dataclass
class Inflight:
    """A submission handed to the sbatch worker and not answered yet: one job, or a sweep's array (``members``)."""

    paths: JobPaths
    attempt: int
    tag: str
    argv: list[str]
    members: list[Held] | None = None


class SubmitLimited(ExecutorUnavailable):
    """Raised when a QOS or association limit refuses a submission for now: the job waits and is submitted again."""

    def __init__(self, message: str, retry_after_s: float = LIMIT_RETRY_S):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SlurmRejected(SpawnFailed):
    """Raised when sbatch refuses a job for a reason that will not change (a bad partition, account or option)."""

    rejected = True

    def __init__(self, message: str, advice: str | None = None):
        super().__init__(message)
        self.advice = advice  # what to change, when Slurm's words point at the job's own resources


@dataclass
class Held:
    """A sweep job's attempt that ``launch`` prepared and ``flush`` submits with its sweep's others."""

    paths: JobPaths
    attempt: int
    sweep: str
    index: int
    options: SlurmOptions


class NoAnswer(Exception):
    """sbatch reached the controller but got no answer: the job may exist."""


def claimed_id(pending: Unconfirmed) -> str:
    """The Slurm job id the node's claim of this attempt names ("" while none has started it)."""
    return str((read_json(pending.paths.slurm_claim(pending.attempt)) or {}).get("slurm_job_id") or "")


def with_slurm_view(
    record: dict, slurm_id: str, job: SlurmJob | None, paths: JobPaths, cancelled_by: str | None = None
) -> dict:
    """The node's record plus what Slurm says: its id and final state; OUT_OF_MEMORY (cgroups), or a SIGKILL that
    Slurm's output says was for memory (OverMemoryKill, no cgroups), makes the kill an oom; a signal Slurm sent
    says who sent it (scancel from outside: cancelled; preemption, a node failure or a node trainq gave up on:
    preempted); and under srun the rank that failed first gives its own exit code, not srun's."""
    record = dict(record, slurm_job_id=record.get("slurm_job_id") or slurm_id)
    if job is not None and job.has_ended:
        record.setdefault("slurm_state", job.state)
    record = real_rank_exit(record, paths)
    if record.get("stop_reason") == "timeout" and record.get("time_limit_warned_at"):
        record.setdefault("executor_diagnosis", warned_diagnosis(record, paths))
    if job is None or record.get("executor_diagnosis"):
        return record
    node = f" on node {job.node}" if job.node else ""
    by_signal = signalled(record)
    if job.state == "OUT_OF_MEMORY":
        record["executor_diagnosis"] = {"kind": "oom", "evidence": oom_evidence(node)}
    elif was_sigkilled(record) and job.has_ended and (said := killed_for_memory(paths, slurm_id)):
        record["executor_diagnosis"] = {"kind": "oom", "evidence": f"{oom_evidence(node)}: {said}"}
    elif by_signal and cancelled_by and cancelled_by != "cancelled by trainq":
        record["executor_diagnosis"] = {"kind": "preempted", "evidence": cancelled_by}
    elif by_signal and job.state == "CANCELLED" and not cancelled_by and record.get("stop_reason") != "stop_flag":
        record.update(
            stop_reason=CANCELLED_OUTSIDE,
            executor_diagnosis={
                "kind": "killed",
                "evidence": cancelled_evidence(slurm_id, job),
                "advice": CANCELLED_ADVICE,
            },
        )
    elif by_signal and job.state in ("PREEMPTED", "NODE_FAIL", "BOOT_FAIL"):
        node = failed_node(slurm_id, job) if job.state == "NODE_FAIL" else job.node
        record["executor_diagnosis"] = {"kind": "preempted", "evidence": taken_by_slurm(job.state, node)}
    return record


def warned_diagnosis(record: dict, paths: JobPaths) -> dict:
    """A job stopped by Slurm's time-limit warning (USR1): the limit, where it came from and when the warning came,
    which on Slurm may be up to 60 s before the lead asked for (--signal=B:USR1@lead)."""
    when = ""
    warned, started = parse_iso(record.get("time_limit_warned_at")), parse_iso(record.get("started_at"))
    if warned is not None and started is not None:
        after = warned - started
        when = f" {after:.1f} s after the job started" if after >= 0 else " before the job started"
    lead = next(
        (
            a.rpartition("@")[2]
            for a in (read_json(paths.slurm_record) or {}).get("sbatch") or []
            if str(a).startswith("--signal=")
        ),
        "",
    )
    asked = (
        f"; --signal asked for it {lead} s before the limit, and Slurm may send it up to 60 s earlier" if lead else ""
    )
    evidence = time_limit_evidence(paths, f"is near: Slurm's warning (USR1) came{when}{asked}")
    return {"kind": "timeout", "evidence": evidence, "advice": TIME_LIMIT_ADVICE}


def was_sigkilled(record: dict) -> bool:
    return record.get("signal") == SIGKILL or record.get("exit_code") == 128 + SIGKILL


def signalled(record: dict) -> bool:
    """Killed or terminated by a signal (SIGKILL, SIGTERM: Slurm's ways of ending a job), or stopped on SIGTERM."""
    return (
        record.get("signal") in (SIGKILL, SIGTERM)
        or record.get("exit_code") in (128 + SIGKILL, 128 + SIGTERM)
        or record.get("stop_reason") == "sigterm"
    )


def attempt_ended(paths: JobPaths, n: object) -> bool:
    """True when run.json records attempt ``n`` as finished."""
    attempts = (read_json(paths.run) or {}).get("attempts") or []
    return any(a.get("n") == n and a.get("ended_at") for a in attempts if isinstance(a, dict))


def job_file(job_dir: Path) -> tuple[dict, set[str]]:
    """The job file's resources block and the names of its own ``env`` entries, as the watcher validated them."""
    from trainq.watcher.spec.errors import WatcherError
    from trainq.watcher.spec.jobspec import load_job_file

    try:
        spec = load_job_file(JobPaths(job_dir).spec, f"{job_dir.name}/job.yaml")
    except (WatcherError, OSError) as exc:
        raise SpawnFailed(f"{job_dir}: cannot read job.yaml for Slurm's options ({exc}); submit the job again") from exc
    resources = spec.resources.to_dict()
    return resources, set(spec.env)


def refresh_listing(folder: Path) -> None:
    try:
        os.listdir(folder)
    except OSError:
        pass


def append_note(log: Path, line: str) -> None:
    """A ``trainq:`` line in output.log, where the user reads the job's story (nobody else writes it now)."""
    append_line(log, line)
