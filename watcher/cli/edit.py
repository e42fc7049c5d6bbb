"""``trainq edit`` and ``trainq priority``: a job's job.yaml rewritten, validated first, put in place by rename.

The file way is the same: edit ``pending/<id>/job.yaml`` with anything; the watcher re-reads a
changed pending job file (daemon/intake.py). For a failed, cancelled or timed-out job, ``edit`` is
fix-and-re-run (pueue's ``restart -e``): the edited job.yaml replaces the old one (kept as
``job.attempt-N.yaml``) and ``retry.flag`` runs it again under the same id, in the same folder, so
its checkpoints are still there to resume from. A rejected job's fixed file is submitted again
under its id. These commands only make sure what lands there is valid.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from trainq.watcher.cli.manage import EXIT_INVALID, EXIT_OK, Found, UsageError, require_job, say
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.fsutil import atomic_write, remove_quietly


def priority(root: Path, job_id: str, value: int) -> int:
    """Set a pending job's priority by rewriting the ``priority:`` line of its job.yaml."""
    from trainq.watcher.cli.submit import set_top_level

    found = _pending(root, job_id, "its priority only orders jobs that have not started")
    spec = JobPaths(found.path).spec
    text = spec.read_text(encoding="utf-8")
    _replace_spec(found, set_top_level(text, "priority", str(value)))
    say(f"job {job_id}: priority {value} (pending/{job_id}/job.yaml); the watcher re-reads it within seconds")
    return EXIT_OK


def _pending(root: Path, job_id: str, why: str) -> Found:
    found = require_job(root, job_id)
    if found.state != "pending":
        raise UsageError(f"job {job_id} is in {found.state}/, not pending/: {why}")
    return found


def _replace_spec(found: Found, text: str) -> None:
    """Validate ``text`` as the job's file, then put it in place of job.yaml in one rename."""
    from trainq.watcher.spec.jobspec import parse_job_text

    display = f"pending/{found.id}/job.yaml"
    parse_job_text(text, display)  # InvalidJobSpec: the caller prints the problems, nothing changed
    spec = JobPaths(found.path).spec
    tmp = found.path / f".job.yaml.{os.getpid()}.tmp"
    try:
        atomic_write(tmp, text)
        os.replace(tmp, spec)
    except FileNotFoundError:  # the job started (or was removed) meanwhile
        remove_quietly(tmp)
        raise UsageError(f"job {found.id} left pending/ meanwhile; nothing changed") from None


#: where a bad edit is kept, inside the job's folder (hidden: nothing else reads it); the next edit opens it
DRAFT_NAME = ".edit-draft.yaml"


def edit(root: Path, job_id: str, editor: str | None = None) -> int:
    """Open $VISUAL/$EDITOR on a copy of a job's job.yaml; validate it; then use it.

    Pending: put in place (the watcher re-reads it). Failed, cancelled or timed out: the job runs again
    under the same id, as a new attempt that keeps its folder (and so resumes from its checkpoints where
    it declares resume semantics). Rejected: the fixed file is submitted again under the same id. A bad
    edit is kept in the job's folder and the next ``trainq edit ID`` opens it again.
    """
    import shlex
    import subprocess
    import tempfile

    from trainq.watcher.cli.submit import pools_now
    from trainq.watcher.spec.errors import InvalidJobSpec
    from trainq.watcher.spec.jobspec import parse_job_text
    from trainq.watcher.spec.refusals import check_knowable

    found = require_job(root, job_id)
    job_id = found.id
    mode = _edit_mode(found)
    spec = JobPaths(found.path).spec
    original = spec.read_text(encoding="utf-8")
    kept = found.path / DRAFT_NAME
    start = original
    if kept.is_file():
        start = kept.read_text(encoding="utf-8")
        print(
            f"trainq: opening your earlier edit of job {job_id} (kept in {kept}); delete it to start from job.yaml",
            file=sys.stderr,
        )
    editor = editor or os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    with tempfile.TemporaryDirectory(prefix="trainq-edit-") as tmp:
        draft = Path(tmp) / f"{job_id}.yaml"
        draft.write_text(start, encoding="utf-8")
        while True:
            rc = subprocess.call([*shlex.split(editor), str(draft)])
            if rc != 0:
                raise UsageError(f"{editor} exited with status {rc}; job {job_id} unchanged")
            text = draft.read_text(encoding="utf-8")
            if text == original and mode == "pending":
                remove_quietly(kept)
                say(f"job {job_id}: unchanged")
                return EXIT_OK
            try:
                display = f"{found.state}/{job_id}/job.yaml"
                edited = parse_job_text(text, display)
                base = Path(found.run.get("submitted_from") or root)  # a missing path is refused as at submit
                check_knowable(edited, display, base, pools_now(root), str(found.path.resolve()))
            except InvalidJobSpec as exc:
                for line in exc.lines():
                    print(line, file=sys.stderr)
                if sys.stdin.isatty() and input("Edit again? [Y/n] ").strip().lower() in ("", "y", "yes"):
                    continue
                atomic_write(kept, text, durable=False)
                print(
                    f"trainq: job {job_id} unchanged; your edit is kept in {kept} and `trainq edit {job_id}` "
                    "opens it again",
                    file=sys.stderr,
                )
                return EXIT_INVALID
            break
    if mode == "pending":
        _replace_spec(found, text)
        say(f"job {job_id}: job.yaml updated (pending/{job_id}/job.yaml); the watcher re-reads it within seconds")
    elif mode == "rejected":
        _resubmit_rejected(root, found, text)
    else:
        _rerun_edited(root, found, text)
    remove_quietly(kept)
    return EXIT_OK


def _edit_mode(found: Found) -> str:
    """``pending``, ``rerun`` (failed, cancelled, timeout) or ``rejected``; UsageError for the rest."""
    from trainq.watcher.cli.again import RERUNNABLE

    if found.state == "pending":
        return "pending"
    status = found.run.get("status")
    if found.state == "failed" and status == "rejected":
        return "rejected"
    if found.state == "failed" and status in RERUNNABLE:
        return "rerun"
    if found.state == "done":
        raise UsageError(f"job {found.id} is done: `trainq fork {found.id}` copies it into a new job to change")
    raise UsageError(
        f"job {found.id} is {status or found.state} in {found.state}/: a running job's file is not "
        f"re-read; stop it first (`trainq stop {found.id}`), then edit it"
    )


def _rerun_edited(root: Path, found: Found, text: str) -> None:
    """A failed job runs again with the edited file: the old one kept as job.attempt-N.yaml, then retry.flag."""
    from trainq.watcher.cli.again import blocking_dependency, resume_words
    from trainq.watcher.spec.fsutil import touch
    from trainq.watcher.spec.jobspec import parse_job_text

    spec = parse_job_text(text, found.id)
    blocked = blocking_dependency(root, spec)
    if blocked:
        atomic_write(found.path / DRAFT_NAME, text, durable=False)
        raise UsageError(
            f"job {found.id} runs after {blocked[0]}, which ended {blocked[1]}: retry that first "
            f"(`trainq retry {blocked[0]}`); your edit is kept and `trainq edit {found.id}` opens it"
        )
    paths = JobPaths(found.path)
    attempts = int(found.run.get("attempt") or 0)
    previous = found.path / f"job.attempt-{attempts}.yaml"
    if not previous.exists():
        os.link(paths.spec, previous)  # the file that attempt ran, kept beside the new one
    tmp = found.path / f".job.yaml.{os.getpid()}.tmp"
    atomic_write(tmp, text)
    os.replace(tmp, paths.spec)
    words = resume_words(found.path, spec)  # before the flag: a watcher may move the folder at once
    touch(paths.retry_flag)
    say(
        f"job {found.id}: job.yaml updated (the old one is {previous.name}); it runs again as attempt "
        f"{attempts + 1} under the same id, {words} (retry.flag)"
    )


def _resubmit_rejected(root: Path, found: Found, text: str) -> None:
    """A rejected job's fixed file replaces its job.yaml; retry.flag then runs it under the same id."""
    from trainq.watcher.spec.fsutil import touch

    paths = JobPaths(found.path)
    tmp = found.path / f".job.yaml.{os.getpid()}.tmp"
    atomic_write(tmp, text)
    os.replace(tmp, paths.spec)
    touch(paths.retry_flag)
    say(f"job {found.id}: job.yaml fixed; the watcher checks it again and runs it under the same id (retry.flag)")
