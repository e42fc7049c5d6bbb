"""``trainq edit`` and ``trainq priority``: a pending job's job.yaml rewritten, validated first, put in place by rename.

The file way is the same: edit ``pending/<id>/job.yaml`` with anything; the watcher re-reads a
changed pending job file (pending_edits.py). These commands only make sure what lands there is valid.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.fsutil import atomic_write, remove_quietly
from trainq.watcher.cli.manage import EXIT_INVALID, EXIT_OK, Found, UsageError, require_job, say


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


def edit(root: Path, job_id: str, editor: str | None = None) -> int:
    """Open $VISUAL/$EDITOR on a copy of a pending job's job.yaml; validate it; put it in place if valid."""
    import shlex
    import subprocess
    import tempfile

    from trainq.watcher.spec.errors import InvalidJobSpec
    from trainq.watcher.spec.jobspec import parse_job_text

    found = _pending(root, job_id, "only a job that has not started can be edited (`trainq fork` copies one)")
    spec = JobPaths(found.path).spec
    original = spec.read_text(encoding="utf-8")
    editor = editor or os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    with tempfile.TemporaryDirectory(prefix="trainq-edit-") as tmp:
        draft = Path(tmp) / f"{job_id}.yaml"
        draft.write_text(original, encoding="utf-8")
        while True:
            rc = subprocess.call([*shlex.split(editor), str(draft)])
            if rc != 0:
                raise UsageError(f"{editor} exited with status {rc}; job {job_id} unchanged")
            text = draft.read_text(encoding="utf-8")
            if text == original:
                say(f"job {job_id}: unchanged")
                return EXIT_OK
            try:
                parse_job_text(text, f"pending/{job_id}/job.yaml")
            except InvalidJobSpec as exc:
                for line in exc.lines():
                    print(line, file=sys.stderr)
                if sys.stdin.isatty() and input("Edit again? [Y/n] ").strip().lower() in ("", "y", "yes"):
                    continue
                kept = Path.cwd() / f"{job_id}.edited.yaml"
                shutil.copyfile(draft, kept)
                print(f"trainq: job {job_id} unchanged; your edit is kept in {kept}", file=sys.stderr)
                return EXIT_INVALID
            _replace_spec(found, text)
            say(f"job {job_id}: job.yaml updated (pending/{job_id}/job.yaml); the watcher re-reads it within seconds")
            return EXIT_OK
