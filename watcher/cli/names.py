"""Ids and names: one rule for every command that takes an id.

An id (the job's folder name) always wins. A word that is no job's id is taken as a job's
``name:`` when exactly one job carries that name; when several do, the command is refused and
the error lists their ids. Job files are stricter: ``after:`` takes ids only (a name can be
shared or changed), and a dependent whose ``after:`` names a job by its name says so in its
``waiting_for`` instead of waiting silently.

Names are looked up in run.json of pending and running jobs, and for finished jobs in
history.jsonl (or their run.json when the queue has no history yet): only on the path where
the word is no id, so a lookup by id costs what it always did.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.fsutil import read_json

#: ids listed in an "ambiguous name" error before "and N more"
_MAX_LISTED = 5


class AmbiguousName(Exception):
    """Raised when a word is no job's id and several jobs carry it as their name."""

    def __init__(self, name: str, ids: list[str]):
        shown = ", ".join(ids[:_MAX_LISTED]) + (f" and {len(ids) - _MAX_LISTED} more" if len(ids) > _MAX_LISTED else "")
        super().__init__(f"no job has id {name!r}, and {len(ids)} jobs are named {name!r} ({shown}): give the id")


def ids_named(root: Path, name: str) -> list[str]:
    """Ids of the jobs (any state) whose name is ``name``, sorted."""
    from trainq.watcher.faces.history import read_records

    found = set()
    for state in ("pending", "running"):
        found.update(_named_in(root / state, name))
    records = read_records(root)
    if records is None:
        for state in ("done", "failed"):
            found.update(_named_in(root / state, name))
    else:
        found.update(
            r["id"]
            for r in records.values()
            if r.get("name") == name and any((root / s / r["id"]).is_dir() for s in ("done", "failed"))
        )
    return sorted(found)


def id_for_name(root: Path, name: str) -> str | None:
    """The id of the one job named ``name``; None when none is; AmbiguousName when several are."""
    if not name or "/" in name or name.startswith("."):
        return None
    ids = ids_named(root, name)
    if len(ids) > 1:
        raise AmbiguousName(name, ids)
    return ids[0] if ids else None


def _named_in(folder: Path, name: str) -> list[str]:
    try:
        entries = [e.name for e in os.scandir(folder) if not e.name.startswith(".")]
    except FileNotFoundError:
        return []
    return [job_id for job_id in entries if (read_json(JobPaths(folder / job_id).run) or {}).get("name") == name]
