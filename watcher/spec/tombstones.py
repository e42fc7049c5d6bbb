"""Tombstones: what the queue remembers of a job whose folder was removed (``trainq rm``, ``rm -rf``).

A dependent waits on a job id; once that job's folder is gone, nothing in the folders says the
id ever existed, so after a watcher restart its dependents would wait forever. A tombstone is one
small JSON file, ``ROOT/.removed/<id>.json``: ``{"id", "state", "status", "removed_at", "by",
"sweep"}``, written by ``trainq rm`` before it removes a folder and by the watcher when it finds a
folder of a job it knew vanished. A job removed before it ended counts as ended ``removed`` for its
dependents; one removed after it ended keeps its final status (a cleaned-up ``done`` stays done).
Claiming the id again for a new job clears its tombstone. At most MAX_TOMBSTONES are kept (the
oldest go first), so the folder stays small however many jobs are removed.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from trainq.watcher.spec.fsutil import atomic_write_json, exists, read_json
from trainq.watcher.spec.units import iso_utc

#: the folder of tombstones under the queue root (hidden: never a job folder, never listed)
TOMBSTONES_DIR = ".removed"
#: most tombstones kept; beyond it the oldest are deleted
MAX_TOMBSTONES = 5000
#: the status a dependency removed before it ended counts as
REMOVED = "removed"
#: final statuses a removed job keeps for its dependents
_FINAL = ("done", "failed", "cancelled", "timeout", "rejected")


def tombstone_path(root: Path, job_id: str) -> Path:
    return Path(_tombstone_file(root, job_id))


def _tombstone_file(root: str | os.PathLike, job_id: str) -> str:
    """The tombstone's path as a string (a claim asks for it every time, and needs no Path)."""
    return os.path.join(root, TOMBSTONES_DIR, f"{job_id}.json")


def record_removal(
    root: Path,
    job_id: str,
    state: str,
    status: str | None,
    by: str,
    sweep: dict | None = None,
    now: float | None = None,
) -> None:
    """Write ``job_id``'s tombstone (keeping one already there: the first word on a removal is the best)."""
    path = tombstone_path(root, job_id)
    if path.exists():
        return
    path.parent.mkdir(exist_ok=True)
    record: dict[str, object] = {
        "id": job_id,
        "state": state,
        "status": status,
        "removed_at": iso_utc(now or time.time()),
        "by": by,
    }
    if sweep:
        record["sweep"] = {k: sweep.get(k) for k in ("id", "index", "of")}
    atomic_write_json(path, record, durable=False)


def read_tombstone(root: Path, job_id: str) -> dict | None:
    """``job_id``'s tombstone, or None."""
    if not job_id or "/" in job_id or job_id.startswith("."):
        return None
    return read_json(tombstone_path(root, job_id))


def ended_status(tombstone: dict) -> str:
    """The status a removed job counts as for its dependents: its final one, or ``removed``."""
    status = tombstone.get("status")
    return status if status in _FINAL else REMOVED


def removal_words(tombstone: dict) -> str:
    """``"removed at 2026-12-01T20:00:00Z (trainq rm) while pending"``: the evidence a dependent names."""
    return (
        f"removed at {tombstone.get('removed_at')} ({tombstone.get('by')}) "
        f"while {tombstone.get('status') or tombstone.get('state')}"
    )


def clear_tombstone(root: Path, job_id: str) -> None:
    """A new job takes the id: the old removal no longer speaks for it."""
    path = _tombstone_file(root, job_id)
    if not exists(path):
        return  # the usual case, without a raised and caught FileNotFoundError
    try:
        os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):
        pass


def prune_tombstones(root: Path, keep: int = MAX_TOMBSTONES) -> int:
    """Delete the oldest tombstones beyond ``keep``; how many were deleted."""
    folder = Path(root) / TOMBSTONES_DIR
    try:
        entries = [e for e in os.scandir(folder) if e.name.endswith(".json")]
    except FileNotFoundError:
        return 0
    if len(entries) <= keep:
        return 0
    entries.sort(key=lambda e: e.stat(follow_symlinks=False).st_mtime_ns)
    for entry in entries[: len(entries) - keep]:
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            pass
    return len(entries) - keep


#: every id a watcher has handed out, a line each under TOMBSTONES_DIR (``ID`` when it is taken or queued again,
#: ``ID<TAB>done|failed`` when it ends), appended as it happens and rewritten at start-up to the ids that still
#: have a folder. It is how a restart tells a folder removed while no watcher ran (whose dependents, even ones
#: accepted later, must not wait forever) from an id never seen, and a cleaned-up ``done`` from a removal.
KNOWN_IDS = "known-ids"


def remember_ids(root: Path, ids: list[str], status: str | None = None) -> None:
    """Append ``ids`` (with their final ``status``, once ended) to the known-ids file. Best effort: a lost
    line only means the next start-up rewrite records that id (its folder exists until then)."""
    folder = os.path.join(root, TOMBSTONES_DIR)
    path = os.path.join(folder, KNOWN_IDS)
    tail = f"\t{status}\n" if status else "\n"
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:  # the folder first (two calls a job made it, each finding it there)
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder)  # not the root's parents: a removed root is not made again here
            fd = os.open(path, flags, 0o644)
    except OSError:
        return
    try:
        os.write(fd, "".join(job_id + tail for job_id in ids).encode("utf-8", "surrogateescape"))
    except OSError:
        pass
    finally:
        os.close(fd)


def settle_known_ids(root: Path, present: set[str], now: float | None = None) -> list[str]:
    """At start-up: each id handed out before that now has neither a folder nor a tombstone was removed
    while no watcher ran, and gets a tombstone with its last known status (one that ended keeps it; one
    that had not counts as ``removed``). The file is then rewritten to the ``present`` ids, so it stays as
    small as the queue. Returns the ids found removed."""
    path = Path(root) / TOMBSTONES_DIR / KNOWN_IDS
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", "surrogateescape").splitlines()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        lines = []
    except OSError:
        return []
    known: dict[str, str | None] = {}
    for line in lines:
        job_id, _, status = line.partition("\t")
        if job_id:
            known[job_id] = status or None
    gone = sorted(job_id for job_id in known.keys() - present if read_tombstone(root, job_id) is None)
    for job_id in gone:
        last_status = known[job_id]
        record_removal(
            root, job_id, last_status or "unknown", last_status, by="found gone when a watcher started", now=now
        )
    kept = "".join(job_id + (f"\t{known[job_id]}" if known.get(job_id) else "") + "\n" for job_id in sorted(present))
    try:
        tmp = path.with_name(f".{KNOWN_IDS}.tmp")
        tmp.write_text(kept, encoding="utf-8", errors="surrogateescape")
        os.replace(tmp, path)
    except OSError:
        pass
    return gone
