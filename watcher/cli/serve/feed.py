"""`GET /events`: state changes of every job, derived from the folders, fanned out to every listener.

One task lists the four state folders whenever inotify says one changed (one ``scandir`` each,
names only) and compares with the last listing: a job that appeared in ``pending/`` was
accepted (or requeued), in ``running/`` started, in ``done/``/``failed/`` finished (its status
from run.json), and one gone from all four was removed. Each change gets an id
``<boot>-<seq>``; the last ``RING`` changes are kept, so a client reconnecting with
Last-Event-ID gets exactly what it missed, or a fresh ``snapshot`` when that is too old or the
server restarted.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainq.watcher.faces.stream import ENDED_STATES, STATES, is_job_id
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.fsutil import read_json
from trainq.watcher.spec.units import iso_utc

#: changes kept for clients that reconnect
RING = 4096
#: changes a slow client may have queued before its stream is closed (it reconnects and catches up)
CLIENT_QUEUE = 2048
#: the order jobs pass through the state folders (a retry goes back to pending/)
_RANK: dict[str | None, int] = {"pending": 0, "running": 1, "done": 2, "failed": 2}
#: statuses run.json may hold while a job is in pending/ or running/ (else it lags behind the folder)
_LIVE_STATUSES = {"pending": ("pending",), "running": ("running", "stopping")}
#: the name of a change, by the folder a job arrived in
_CHANGE = {"pending": "accepted", "running": "started", "done": "finished", "failed": "finished"}


@dataclass(eq=False)
class Listener:
    """One /events client: its queue of (event type, id, data), and whether it fell too far behind."""

    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(CLIENT_QUEUE))
    overflowed: bool = False

    def put(self, item: tuple[str, str | None, str]) -> None:
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.overflowed = True  # its stream ends; the client reconnects and resumes from its Last-Event-ID


class JobFeed:
    """The last listing of the state folders, the recent changes, and the listeners."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.boot = str(int(time.time() * 1000))
        self.seq = 0
        self.jobs: dict[str, tuple[str, str | None]] = {}
        self.ring: deque[tuple[int, str]] = deque(maxlen=RING)
        self.listeners: set[Listener] = set()
        self._watcher_sent: str | None = None
        self.jobs = {job_id: (state, _status(self.root, state, job_id)) for job_id, state in self._listing().items()}

    # -- the folders -------------------------------------------------------------------------------

    def _listing(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for state in STATES:
            try:
                with os.scandir(self.root / state) as entries:
                    for entry in entries:
                        if (
                            is_job_id(entry.name)
                            and not entry.name.startswith(".")
                            and entry.is_dir(follow_symlinks=False)
                        ):
                            found[entry.name] = state
            except OSError:
                continue
        return found

    def rescan(self, arrivals: Sequence[tuple[str, str]] = ()) -> list[str]:
        """List the folders again; record, and send to every listener, one event per state each job went through.

        ``arrivals`` (state folder, id) are the folders inotify saw arrive since the last look: a state
        a job has already left (pending/ for a job that started at once) is reported too, in the
        order jobs pass through them, before the state the listing shows.

        inotify's thread may hand an arrival over after a listing has already seen the job move on. So a job
        first seen in running/ passed through pending/ (the only way in), and an arrival in a folder ranked
        below the one already reported is stale, unless it is a retry's return from an ended state to pending/
        (then what follows it in the same look is new too).
        """
        now, sent = iso_utc(time.time()), []
        listing = self._listing()
        passed: dict[str, set[str]] = {}
        for state, job_id in arrivals:
            if is_job_id(job_id) and not job_id.startswith("."):
                passed.setdefault(job_id, set()).add(state)
        for job_id in sorted(set(self.jobs) | set(listing) | set(passed)):
            before, after = self.jobs.get(job_id), listing.get(job_id)
            final_rank = _RANK.get(after, len(_RANK))
            seen = passed.get(job_id, set())
            if before is None and after == "running":
                seen = seen | {"pending"}
            retried = before is not None and before[0] in ENDED_STATES and "pending" in seen
            floor = _RANK.get(before[0], -1) if before is not None and not retried else -1
            steps = sorted(
                (s for s in seen if floor <= _RANK[s] < final_rank and s != (before or ("",))[0]),
                key=_RANK.__getitem__,  # every step kept is in _RANK (the filter looked it up)
            )
            for state in steps:
                sent.append(self._record(job_id, self.jobs.get(job_id), state, now, current=False))
            if (self.jobs.get(job_id) or (None,))[0] != after:
                sent.append(self._record(job_id, self.jobs.get(job_id), after, now))
        return sent

    def _record(
        self, job_id: str, before: tuple[str, str | None] | None, state: str | None, now: str, current: bool = True
    ) -> str:
        """One change; ``current``: the job is in ``state`` now (its status is read from run.json), else it passed."""
        status = (_status(self.root, state, job_id) if current else state) if state else None
        if state:
            self.jobs[job_id] = (state, status)
        else:
            self.jobs.pop(job_id, None)
        change = _CHANGE[state] if state else "removed"
        if state == "pending" and before and before[0] in ("running", "failed"):
            change = "requeued"
        data = json.dumps(
            {
                "id": job_id,
                "change": change,
                "state": state,
                "status": status,
                "previous": before[0] if before else None,
                "time": now,
            },
            ensure_ascii=False,
        )
        self.seq += 1
        self.ring.append((self.seq, data))
        self._send(("job", self.event_id(self.seq), data))
        return data

    # -- the listeners -----------------------------------------------------------------------------

    def event_id(self, seq: int) -> str:
        return f"{self.boot}-{seq}"

    def snapshot(self) -> str:
        """Every job's state and status now (what a client without a usable Last-Event-ID starts from)."""
        jobs = {job_id: {"state": state, "status": status} for job_id, (state, status) in sorted(self.jobs.items())}
        return json.dumps({"jobs": jobs, "time": iso_utc(time.time())}, ensure_ascii=False)

    def subscribe(self, last_event_id: str | None) -> tuple[Listener, list[tuple[str, str | None, str]]]:
        """A new listener and what it gets first: the changes it missed, or a snapshot."""
        listener = Listener()
        self.listeners.add(listener)
        missed = self._missed(last_event_id)
        if missed is None:
            return listener, [("snapshot", self.event_id(self.seq), self.snapshot())]
        return listener, [("job", self.event_id(seq), data) for seq, data in missed]

    def _missed(self, last_event_id: str | None) -> list[tuple[int, str]] | None:
        boot, _, seq = (last_event_id or "").partition("-")
        if boot != self.boot or not seq.isdigit() or int(seq) > self.seq:
            return None
        oldest = self.ring[0][0] if self.ring else self.seq + 1
        if int(seq) < oldest - 1:
            return None
        return [(s, d) for s, d in self.ring if s > int(seq)]

    def unsubscribe(self, listener: Listener) -> None:
        self.listeners.discard(listener)

    def _send(self, item: tuple[str, str | None, str]) -> None:
        for listener in list(self.listeners):
            listener.put(item)

    def status_replaced(self) -> None:
        """status.html was rewritten: tell listeners the watcher's state, heartbeat and counts."""
        try:
            status = read_json(self.root / "status.json")
        except OSError:
            return
        if not isinstance(status, dict):
            return
        data = json.dumps({"watcher": status.get("watcher"), "counts": status.get("counts")}, ensure_ascii=False)
        if data != self._watcher_sent:
            self._watcher_sent = data
            self._send(("watcher", None, data))

    async def run(self, watch) -> None:
        """Forever: rescan when a state folder changed, report the watcher when status.html was replaced."""

        def rescan() -> None:
            arrivals, watch.arrivals = watch.arrivals, []
            self.rescan(arrivals)

        await asyncio.gather(
            self._follow(watch.folders_changed, rescan), self._follow(watch.status_changed, self.status_replaced)
        )

    @staticmethod
    async def _follow(changed: asyncio.Event, react) -> None:
        while True:
            await changed.wait()
            changed.clear()
            react()


def _status(root: Path, state: str | None, job_id: str) -> str | None:
    """run.json's status of a job in ``state`` (None while it has none yet)."""
    if state is None:
        return None
    try:
        run = read_json(JobPaths(root / state / job_id).run)
    except OSError:  # unreadable (permissions): the folder still says where the job is
        run = None
    status = run.get("status") if isinstance(run, dict) else None
    if status is None and state in ENDED_STATES:
        return state
    if state in _LIVE_STATUSES and status not in _LIVE_STATUSES[state]:
        return state  # the folder moved first; run.json follows a moment later
    return status
