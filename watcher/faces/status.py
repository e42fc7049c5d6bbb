"""status.json: the snapshot the watcher publishes, and the only code that writes it (and status.html).

The daemon builds a ``StatusSnapshot`` every tick (with a fresh ``heartbeat_at``) and hands it to
``StatusWriter.maybe_write``, which decides cheaply whether anything is worth writing.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import overload

from trainq.watcher.faces.bounds import bounded_entry
from trainq.watcher.faces.html import CurveStore, render_html
from trainq.watcher.spec.fsutil import atomic_write, read_json

logger = logging.getLogger(__name__)

#: shape version written into status.json (and accepted by from_dict)
SCHEMA_VERSION = 1
#: bounds of the jobs list (docs/contract.md, status.json); keep_finished is a watcher setting
MAX_AWAITING = 50
MAX_PENDING = 50
DEFAULT_KEEP_FINISHED = 50
#: keys every job entry carries, in the order status.json shows them
JOB_KEYS = (
    "id",
    "state",
    "status",
    "name",
    "priority",
    "attempt",
    "pid",
    "submitted_at",
    "started_at",
    "finished_at",
    "waiting_for",
    "health",
    "progress",
    "dir",
    "error",
    "diagnosis",
)
_FINISHED = ("done", "failed")


@dataclass(frozen=True)
class StatusSnapshot:
    """One view of the whole queue, as status.json holds it."""

    watcher: dict
    counts: dict
    jobs: tuple[dict, ...]
    resources: dict = field(default_factory=dict)
    ignored: tuple[dict, ...] = ()  # inbox entries that are not job files, with why (docs/contract.md, the inbox)
    window: dict | None = None  # the queue's wall and who fits before it (docs/wall.md)
    cost: dict | None = None  # {total, currency}

    def to_dict(self) -> dict:
        """The status.json object (``ignored`` only when the inbox holds something that is not a job file)."""
        data = {
            "schema_version": SCHEMA_VERSION,
            "watcher": self.watcher,
            "counts": self.counts,
            "jobs": list(self.jobs),
            "resources": self.resources,
        }
        if self.ignored:
            data["ignored"] = list(self.ignored)
        if self.window is not None:
            data["window"] = self.window
        if self.cost is not None:
            data["cost"] = self.cost
        return data

    @classmethod
    def from_dict(cls, d: dict) -> StatusSnapshot:
        """Load a status.json object; ValueError when it is not one this version understands."""
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"status.json: schema_version {version!r} is not {SCHEMA_VERSION}; use the trainq version that wrote it"
            )
        return cls(
            watcher=dict(d.get("watcher") or {}),
            counts=dict(d.get("counts") or {}),
            jobs=tuple(d.get("jobs") or ()),
            resources=dict(d.get("resources") or {}),
            ignored=tuple(d.get("ignored") or ()),
            window=d.get("window"),
            cost=d.get("cost"),
        )


def job_entry(job_id: str, state: str, rel_dir: str, **fields: object) -> dict:
    """A status.json job entry with every required key (None where not given; status defaults to state)."""
    entry: dict = dict.fromkeys(JOB_KEYS)
    entry.update(id=job_id, state=state, status=state, dir=rel_dir, priority=0, attempt=0)
    entry.update(fields)
    return entry


def _pending_rank(job: dict) -> tuple:
    # next to start first: higher priority, then acceptance order (order if the daemon gives it)
    return (-(job.get("priority") or 0), job.get("order", math.inf), job.get("submitted_at") or "", job["id"])


def _finished_rank(job: dict) -> str:
    return job.get("finished_at") or ""


def select_jobs(
    jobs: Iterable[dict],
    keep_finished: int = DEFAULT_KEEP_FINISHED,
    max_awaiting: int = MAX_AWAITING,
    max_pending: int = MAX_PENDING,
) -> tuple[dict, ...]:
    """Bound the list: every running job, the first awaiting, the next pending, the latest finished."""
    by_state: dict[str, list[dict]] = {"running": [], "awaiting_approval": [], "pending": [], "finished": []}
    for job in jobs:
        by_state["finished" if job["state"] in _FINISHED else job["state"]].append(job)
    awaiting = heapq.nsmallest(max_awaiting, by_state["awaiting_approval"], key=lambda j: j["dir"])
    pending = heapq.nsmallest(max_pending, by_state["pending"], key=_pending_rank)
    finished = heapq.nlargest(keep_finished, by_state["finished"], key=_finished_rank)
    return (*by_state["running"], *pending, *awaiting, *finished)


@overload
def _plain_copy(value: tuple) -> tuple: ...
@overload
def _plain_copy(value: object) -> object: ...
def _plain_copy(value: object) -> object:
    """Deep copy of JSON-like data (dicts, lists, tuples), cheaper than copy.deepcopy."""
    if isinstance(value, dict):
        return {k: _plain_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain_copy(v) for v in value)
    return value


@overload
def _json_safe(value: dict) -> dict: ...
@overload
def _json_safe(value: object) -> object: ...
def _json_safe(value: object) -> object:
    """Non-finite floats become null (JSON has no NaN; browsers and jq reject it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def dumps_status(obj: dict) -> str:
    """status.json text: one top-level key, and one job, per line (readable with cat and grep).

    json.dumps with ``indent`` falls back to the pure-Python encoder (~5x slower); per-line compact
    dumps keep the C encoder. Non-finite floats become null: strict JSON for browsers and jq.
    """
    try:
        return _dumps_lines(obj, allow_nan=False)
    except ValueError:
        return _dumps_lines(_json_safe(obj), allow_nan=False)


def _dumps_lines(obj: dict, allow_nan: bool) -> str:
    def one(value: object) -> str:
        return json.dumps(value, ensure_ascii=False, allow_nan=allow_nan)

    lines = []
    for key, value in obj.items():
        if key == "jobs" and value:
            body = ",\n  ".join(one(job) for job in value)
            lines.append(f" {one(key)}: [\n  {body}\n ]")
        else:
            lines.append(f" {one(key)}: {one(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


#: what a running `trainq serve` writes at the queue root (its URL, without the token; its pid); gone when it stops
SERVE_RECORD = ".trainq-serve.json"


def live_page_url(root: Path) -> str | None:
    """The URL of the `trainq serve` page on this queue while one runs (status.html links it), else None."""
    record = read_json(Path(root) / SERVE_RECORD) or {}
    pid, url = record.get("pid"), record.get("url")
    if type(pid) is not int or not isinstance(url, str) or not url.startswith("http"):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # a serve that died without removing it
    except PermissionError:
        pass  # alive, another user's
    return url


class StatusWriter:
    """Writes status.json (and status.html) when the snapshot changed or the heartbeat is due."""

    def __init__(
        self,
        status_path: Path,
        html_path: Path | None,
        status_s: float = 1.0,
        heartbeat_s: float = 5.0,
        html_every_s: float = 1.0,
        *,
        keep_finished: int = DEFAULT_KEEP_FINISHED,
        curves: CurveStore | None = None,
    ) -> None:
        self.status_path = Path(status_path)
        self.html_path = Path(html_path) if html_path is not None else None
        self.status_s, self.heartbeat_s, self.html_every_s = status_s, heartbeat_s, html_every_s
        self.keep_finished = keep_finished
        self.curves = curves
        self._written_at: float | None = None
        self._written_content: tuple | None = None
        self._written_dict: dict | None = None
        self._html_at: float | None = None
        self._html_dirty = False
        #: id(entry) -> (entry, its bounded form) for the entries of the last write: a finished job's entry is the
        #: same dict from write to write (the report keeps it), so it is walked for its bounds once, not every second
        self._bounded_seen: dict[int, tuple[dict, dict]] = {}

    def maybe_write(self, snapshot: StatusSnapshot, now: float) -> bool:
        """Write status.json if it changed (at most every status_s) or the heartbeat is due; True if written."""
        written = self._is_due(snapshot, now)
        if written:
            self._write(snapshot, now)
        self._maybe_write_html(now)
        return written

    def force_write(self, snapshot: StatusSnapshot, now: float) -> None:
        """Write status.json and status.html now (start-up, shutdown)."""
        self._write(snapshot, now)
        self._write_html(now)

    def _is_due(self, snapshot: StatusSnapshot, now: float) -> bool:
        if self._written_at is None or now - self._written_at >= self.heartbeat_s:
            return True
        if now - self._written_at < self.status_s:
            return False
        # dict == runs in C and stops at the first difference: far cheaper than serialising
        return _content(snapshot) != self._written_content

    def _write(self, snapshot: StatusSnapshot, now: float) -> None:
        bounded = self._bounded(snapshot)
        data = bounded.to_dict()
        text = dumps_status(data)
        atomic_write(self.status_path, text)
        logger.debug("%s: written (%d jobs, %d bytes)", self.status_path, len(bounded.jobs), len(text))
        self._written_at = now
        self._written_content = _plain_copy(_content(snapshot))
        self._written_dict = data
        self._html_dirty = True

    def _bounded(self, snapshot: StatusSnapshot) -> StatusSnapshot:
        """The listed jobs bounded in number (docs/contract.md, status.json) and each entry in size (bounds.py)."""
        jobs = snapshot.jobs
        if _has_excess(jobs, self.keep_finished):
            jobs = select_jobs(jobs, keep_finished=self.keep_finished)
        seen, self._bounded_seen = self._bounded_seen, {}
        out = []
        for job in jobs:
            hit = seen.get(id(job))
            bounded = hit[1] if hit is not None and hit[0] is job else bounded_entry(job)
            self._bounded_seen[id(job)] = (job, bounded)  # holding the entry keeps its id from being reused
            out.append(bounded)
        return replace(snapshot, jobs=tuple(out))  # window and cost go through as they are

    def _maybe_write_html(self, now: float) -> None:
        if not self._html_dirty or self.html_path is None:
            return
        if self._html_at is not None and now - self._html_at < self.html_every_s:
            return
        self._write_html(now)

    def _write_html(self, now: float) -> None:
        if self.html_path is None or self._written_dict is None:
            return
        curves = self.curves.curves() if self.curves is not None else {}
        page = render_html(self._written_dict, curves, self.heartbeat_s, serve_url=live_page_url(self.html_path.parent))
        atomic_write(self.html_path, page, durable=False)  # a view, rebuilt every second: not worth an fsync
        self._html_at = now
        self._html_dirty = False


def _content(snapshot: StatusSnapshot) -> tuple:
    """Everything but heartbeat_at: what decides whether the file changed."""
    watcher = {k: v for k, v in snapshot.watcher.items() if k != "heartbeat_at"}
    return (
        watcher,
        snapshot.counts,
        snapshot.jobs,
        snapshot.resources,
        snapshot.ignored,
        snapshot.window,
        snapshot.cost,
    )


def _has_excess(jobs: tuple[dict, ...], keep_finished: int) -> bool:
    """True when some state has more entries than status.json may list."""
    counts = {"awaiting_approval": 0, "pending": 0, "finished": 0}
    for job in jobs:
        key = "finished" if job["state"] in _FINISHED else job["state"]
        if key in counts:
            counts[key] += 1
    return (
        counts["awaiting_approval"] > MAX_AWAITING
        or counts["pending"] > MAX_PENDING
        or counts["finished"] > keep_finished
    )


def load_status(path: Path) -> StatusSnapshot | None:
    """Read status.json; None when missing or unreadable (a writer replaces it atomically, so never partial)."""
    data = read_json(path)
    return StatusSnapshot.from_dict(data) if data is not None else None
