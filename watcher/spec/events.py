"""events.jsonl: one job's story, one JSON record a line, appended and never rewritten (docs/records.md).

The watcher and the job's supervisor both append here (the trainer may too: this module is
dependency-free). Each record is ``{"time": ISO-8601 UTC, "event": NAME, ...fields}`` written with one
``write`` on an ``O_APPEND`` descriptor, so lines from different processes never interleave. The file is
bounded: past ``MAX_EVENTS_BYTES`` it is renamed to ``events.1.jsonl`` (the one older generation kept)
and a new one begins. Writing is best effort: a full disk or a folder removed by hand loses the line,
never the job.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from pathlib import Path

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.text import redact_strings
from trainq.watcher.spec.units import iso_utc

#: every event name a record may carry, in the order a job usually meets them
EVENTS = (
    "submitted",
    "accepted",
    "held",
    "released",
    "started",
    "checkpoint",
    "stopping",
    "preempted",
    "exited",
    "retrying",
    "finished",
    "hook",
    "delivered",
)
#: size past which events.jsonl is rotated to events.1.jsonl (bytes); two generations bound a job's story
MAX_EVENTS_BYTES = 1024 * 1024
#: longest string value kept in a record (characters); evidence lines and paths are cut there
MAX_VALUE_CHARS = 1000


def event(name: str, now: float | None = None, **fields: object) -> dict:
    """One record: ``time`` and ``event`` first, then the fields that are not None."""
    if name not in EVENTS:
        raise ValueError(f"unknown event {name!r}; one of {', '.join(EVENTS)}")
    record: dict = {"time": iso_utc(time.time() if now is None else now), "event": name}
    record.update({k: _bounded(redact_strings(v)) for k, v in fields.items() if v is not None})
    return record


def _bounded(value: object) -> object:
    if isinstance(value, str) and len(value) > MAX_VALUE_CHARS:
        return value[:MAX_VALUE_CHARS] + "..."
    return value


def append(paths: JobPaths, *records: dict) -> bool:
    """Append ``records`` to the job's events.jsonl in one write; False when it could not be written."""
    if not records:
        return True
    # ASCII JSON: a file name that is not UTF-8 (lone surrogates) is escaped, never an encoding error
    data = "".join(json.dumps(r, default=str) + "\n" for r in records).encode()
    try:
        fd = _open_for_append(paths, len(data))
    except OSError:
        return False
    try:
        os.write(fd, data)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def emit(paths: JobPaths, name: str, now: float | None = None, **fields: object) -> bool:
    """Append one event (``event`` then ``append``)."""
    return append(paths, event(name, now, **fields))


def _open_for_append(paths: JobPaths, incoming: int) -> int:
    """An O_APPEND fd on events.jsonl, rotated first when this write would take it past the bound."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    for _ in range(3):
        fd = os.open(paths.events, flags, 0o644)
        size = os.fstat(fd).st_size
        if size == 0 or size + incoming <= MAX_EVENTS_BYTES:
            return fd
        if not _rotate(paths, fd):
            return fd  # another writer rotated, or the lock failed: write where we are (bounded next time)
        os.close(fd)
    return os.open(paths.events, flags, 0o644)


def _rotate(paths: JobPaths, fd: int) -> bool:
    """Rename events.jsonl to events.1.jsonl, under the file's lock, if ``fd`` is still that file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        current = os.stat(paths.events)
        mine = os.fstat(fd)
        if (current.st_dev, current.st_ino) != (mine.st_dev, mine.st_ino):
            return True  # rotated by another writer meanwhile: open the new file
        os.replace(paths.events, paths.events_rotated)
        return True
    except OSError as exc:
        return exc.errno == errno.ENOENT


def read(paths: JobPaths) -> list[dict]:
    """Every record still kept, oldest first (events.1.jsonl, then events.jsonl); unreadable lines skipped."""
    records: list[dict] = []
    for path in (paths.events_rotated, paths.events):
        records += _read_file(path)
    return records


def _read_file(path: Path) -> list[dict]:
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("event"), str):
            out.append(record)
    return out
