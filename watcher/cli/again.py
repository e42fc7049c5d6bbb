"""How a finished job runs again (retry, edit, resubmit), in words that fit that job: what ``why``, ``show`` and ``retry`` say.

A job resumes only when it can (train jobs, command jobs with resume_args, and a checkpoint to
resume from); a dependent whose dependency ended badly must wait for that one to be retried first;
a rejected job is fixed with ``trainq edit ID`` (same id). Nothing here advises an action that does
not apply to the job at hand.
"""

from __future__ import annotations

from pathlib import Path

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.fsutil import read_json
from trainq.watcher.spec.jobspec import JobSpec

#: the statuses a retry (or an edit that resubmits) applies to
RERUNNABLE = ("failed", "cancelled", "timeout")


def blocking_dependency(root: Path, spec: JobSpec | None) -> tuple[str, str] | None:
    """(dependency id, its status) of the first ``after:`` job that ended other than done (policy ok), else None."""
    if spec is None or spec.after_policy != "ok":
        return None
    for dep in spec.after:
        path = root / "failed" / dep
        if path.is_dir():
            return dep, (read_json(JobPaths(path).run) or {}).get("status") or "failed"
    return None


def resume_words(path: Path, spec: JobSpec | None) -> str:
    """``resuming from checkpoint-20``, ``from the start: no checkpoint yet`` or ``from the start (no resume_args)``."""
    from trainq.watcher.daemon.jobs import load_job, resume_point
    from trainq.watcher.spec.folders import JobState

    if spec is None or not spec.has_resume:
        return "from the start (the job declares no resume_args)"
    job = load_job(path, JobState.FAILED)
    checkpoint = resume_point(job) if job is not None else None
    return f"resuming from {checkpoint}" if checkpoint else "from the start: no checkpoint yet"


def rerun_line(root: Path, job_id: str, path: Path, run: dict, spec: JobSpec | None) -> str | None:
    """The one line saying how to run a finished job again, or None (done, or nothing applies)."""
    status = run.get("status")
    if status == "rejected":
        return f"  to run it: fix the file with `trainq edit {job_id}` (it is checked, then runs under the same id)"
    if status not in RERUNNABLE:
        return None
    blocked = blocking_dependency(root, spec)
    if blocked:
        dep, dep_status = blocked
        return (
            f"  to run it again: first `trainq retry {dep}` (its dependency, which ended {dep_status}); "
            f"then `trainq retry {job_id}`"
        )
    if ((run.get("diagnosis") or {}).get("kind")) == "config":
        return (
            f"  to run it: fix the job file with `trainq edit {job_id}` (it is checked, then runs under the same "
            "id); a retry without an edit would fail the same way"
        )
    if ((run.get("diagnosis") or {}).get("kind")) == "unsatisfiable":
        return (
            f"  to run it: lower its resources to what this machine has with `trainq edit {job_id}` "
            "(it then runs under the same id)"
        )
    if not run.get("attempts"):
        return f"  to run it (it never started): trainq retry {job_id}; to change it first: trainq edit {job_id}"
    return (
        f"  to run it again ({resume_words(path, spec)}): trainq retry {job_id}; "
        f"to change it first: trainq edit {job_id}"
    )
