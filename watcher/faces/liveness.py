"""Is the watcher alive? Judged from status.json's heartbeat without trusting two machines' clocks to agree.

``heartbeat_at`` is written with the watcher's clock. Its readers (``trainq status``, ``trainq why``,
the management commands, status.html in a browser) may run on another machine that reads the queue
over a shared filesystem, a login node reading a cluster's queue. Comparing the heartbeat with the
reader's clock there calls a live watcher dead when the reader's clock is ahead, and hides a dead one
when it is behind. So a reader decides, in this order:

1. Its clock agrees with the heartbeat (at most STALE_HEARTBEAT_S old, and not more than that in the
   future; 3 heartbeats for a watcher.yaml heartbeat_s above 5 s): the watcher is alive. This is the answer readers always gave; it costs nothing, and a live
   watcher that shares this machine's clock always gets it.
2. status.json says the watcher stopped: no heartbeat will come.
3. The watcher's host is this machine and its pid is not running here: it is dead, for certain.
4. Otherwise only watching tells a skewed clock from a dead watcher. A live watcher rewrites
   ``heartbeat_at`` every ``heartbeat_s`` (5 s by default), so the reader re-reads status.json and
   times with its own monotonic clock whether the value changes: changed, the watcher is alive (and
   this machine's clock is off by about the age the new value had by it); unchanged for CONFIRM_S,
   it is not responding. What a message then says is what was measured, from where.

Why not "same host, so trust the clock"? A host name says nothing about the clock a process sees
(libfaketime, a time namespace, a container with its own clock), and rule 1 already answers a live
same-clock watcher at once. The clock is trusted where it agrees with the heartbeat, whatever the
host; the host only shortens a death that is certain (rule 3: same host name, no such pid). Rule 3
would be wrong only for a watcher on another machine with the same host name, or in another pid
namespace, whose clock also disagrees with this one. What rule 4 costs is a wait of at most
CONFIRM_S for a hung (stopped, not exited) watcher, or one elsewhere that died; a reader process
pays it once per status.json, since its HeartbeatWatch remembers what it saw.

Nothing is added to status.json: the heartbeat itself, watched, is the evidence. status.html's
script (faces/html.py) follows the same rules with the browser's clock and sessionStorage.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import yaml

from trainq.watcher.spec.fsutil import read_json
from trainq.watcher.spec.units import parse_duration_s, parse_iso

#: a heartbeat older than this (by a clock that agrees with the watcher's) means the watcher is not
#: responding: 3 missed 5 s heartbeats (seconds). Also how long a heartbeat seen changing may then stand still.
STALE_HEARTBEAT_S = 15
#: a reader that has not seen the heartbeat change takes the watcher for dead after watching it this long
#: unchanged: two 5 s heartbeats and 2 s for a slow pass (seconds)
CONFIRM_S = 12.0
#: how often a one-shot reader re-reads status.json while it watches the heartbeat (seconds)
WATCH_POLL_S = 0.25
#: a watcher.yaml heartbeat_s above 5 s stretches both bounds: STALE_PERIODS heartbeats, CONFIRM_PERIODS + 2 s
STALE_PERIODS, CONFIRM_PERIODS = 3, 2
#: a measured clock offset below this is within the measurement's own error (a poll, a write): not said (seconds)
OFFSET_WORTH_SAYING_S = 2.0

#: verdicts: alive; dead; still watching (only a reader that reads again shows this); no heartbeat at all
ALIVE, DEAD, WATCHING, ABSENT = "alive", "dead", "watching", "absent"
#: what a verdict rests on: this machine's clock; the watcher's own "stopped"; its pid gone from this
#: host; this reader watching the heartbeat change or not
BY_CLOCK, BY_STOPPED, BY_PID, BY_WATCHING = "clock", "stopped", "pid", "watched"


@dataclass(frozen=True)
class Liveness:
    """One reader's verdict on a watcher, and the measurements it rests on (for truthful words)."""

    verdict: str
    how: str
    #: this machine's time minus heartbeat_at; negative when the heartbeat is in this clock's future
    clock_age_s: float | None = None
    #: since this reader saw heartbeat_at change (monotonic); None when it never saw a change
    changed_ago_s: float | None = None
    #: how long this reader has seen the present heartbeat_at unchanged (monotonic)
    unchanged_s: float = 0.0
    #: this machine's clock minus the watcher's, measured when a change was seen (positive: this one is ahead)
    offset_s: float | None = None
    host: str | None = None
    pid: object = None

    @property
    def is_alive(self) -> bool:
        return self.verdict == ALIVE


def bounds(heartbeat_s: float = 5.0) -> tuple[float, float]:
    """(stale, confirm) seconds for a watcher that rewrites its heartbeat every ``heartbeat_s``: 15 s and 12 s
    for the default 5 s, STALE_PERIODS and CONFIRM_PERIODS (+ 2 s) heartbeats for a longer one."""
    return (
        max(float(STALE_HEARTBEAT_S), STALE_PERIODS * heartbeat_s),
        max(CONFIRM_S, CONFIRM_PERIODS * heartbeat_s + 2.0),
    )


def heartbeat_period(root: Path) -> float:
    """The watcher's heartbeat_s from the queue root's watcher.yaml (5 s when unset or unreadable): a reader
    must not call a watcher dead that beats every 30 s because 15 s passed. Read here, not through
    spec.config.load_watcher_config: that imports jsonschema (0.15 s), which `trainq status` never needs."""
    try:
        text = (Path(root) / "watcher.yaml").read_text(encoding="utf-8")[:65536]
        period = parse_duration_s((yaml.safe_load(text) or {}).get("heartbeat_s", 5.0))
    except Exception:
        return 5.0
    return period if isinstance(period, (int, float)) and 0 < period < 86400 else 5.0


def by_clock(watcher: dict, now: float, stale_s: float = STALE_HEARTBEAT_S) -> Liveness:
    """The verdict by this machine's clock alone, as readers always judged: for a snapshot with no reader
    behind it (a rendered picture, a test)."""
    beat = parse_iso(watcher.get("heartbeat_at"))
    if beat is None:
        return Liveness(ABSENT, BY_CLOCK, host=watcher.get("host"), pid=watcher.get("pid"))
    verdict = DEAD if now - beat > stale_s else ALIVE
    return Liveness(verdict, BY_CLOCK, now - beat, host=watcher.get("host"), pid=watcher.get("pid"))


class HeartbeatWatch:
    """One reader's record of one status.json's heartbeat: the value it last saw, when it first saw it
    (monotonic, and by this machine's clock) and whether it saw that value replace another one."""

    def __init__(self, heartbeat_s: float = 5.0) -> None:
        self.stale_s, self.confirm_s = bounds(heartbeat_s)
        self.value: str | None = None
        self.seen_at = 0.0
        self.seen_at_wall = 0.0
        self.changed = False

    def observe(self, watcher: dict, now: float, mono: float) -> Liveness:
        """Note the heartbeat in ``watcher`` (status.json's object) and judge (the module's rules 1-4)."""
        value = watcher.get("heartbeat_at")
        if value and value != self.value:
            self.changed = self.value is not None
            self.value, self.seen_at, self.seen_at_wall = value, mono, now
        clock = by_clock(watcher, now, self.stale_s)
        if clock.verdict == ABSENT or clock.clock_age_s is None or abs(clock.clock_age_s) <= self.stale_s:
            return clock
        if watcher.get("state") == "stopped":
            return Liveness(DEAD, BY_STOPPED, clock.clock_age_s, host=clock.host, pid=clock.pid)
        if _gone_from_this_host(watcher):
            return Liveness(DEAD, BY_PID, clock.clock_age_s, host=clock.host, pid=clock.pid)
        return self._by_watching(clock, mono)

    def _by_watching(self, clock: Liveness, mono: float) -> Liveness:
        unchanged = mono - self.seen_at
        if self.changed:
            verdict = ALIVE if unchanged <= self.stale_s else DEAD
            offset = self.seen_at_wall - (parse_iso(self.value) or self.seen_at_wall)
            return Liveness(
                verdict, BY_WATCHING, clock.clock_age_s, unchanged, unchanged, offset, clock.host, clock.pid
            )
        verdict = DEAD if unchanged >= self.confirm_s else WATCHING
        return Liveness(verdict, BY_WATCHING, clock.clock_age_s, None, unchanged, None, clock.host, clock.pid)


def _gone_from_this_host(watcher: dict) -> bool:
    """True when status.json names this host and a pid that no process here has: certainly dead."""
    pid = watcher.get("pid")
    if watcher.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: asks whether the pid exists, sends nothing
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: it exists, someone else's
        return False
    return False


#: one HeartbeatWatch per status.json this process reads: a second question costs no second wait
_WATCHES: dict[Path, HeartbeatWatch] = {}


def watch_for(status_path: Path) -> HeartbeatWatch:
    """This process's HeartbeatWatch of ``status_path``, with the bounds of its watcher.yaml's heartbeat_s."""
    path = Path(status_path).absolute()
    if path not in _WATCHES:
        _WATCHES[path] = HeartbeatWatch(heartbeat_period(path.parent))
    return _WATCHES[path]


@overload
def check(status_path: Path, snapshot: dict) -> tuple[dict, Liveness]: ...
@overload
def check(status_path: Path, snapshot: dict | None = None) -> tuple[dict | None, Liveness]: ...
def check(status_path: Path, snapshot: dict | None = None) -> tuple[dict | None, Liveness]:
    """status.json (the latest read) and its watcher's liveness; while undecided, re-read it for up to
    CONFIRM_S (rule 4). ``snapshot``: status.json as the caller already read it."""
    watch = watch_for(status_path)
    snapshot = read_json(status_path) if snapshot is None else snapshot
    while True:
        verdict = watch.observe(_watcher(snapshot), time.time(), time.monotonic())
        if verdict.verdict != WATCHING:
            return snapshot, verdict
        time.sleep(WATCH_POLL_S)
        snapshot = read_json(status_path) or snapshot


def _watcher(snapshot: dict | None) -> dict:
    watcher = (snapshot or {}).get("watcher")
    return watcher if isinstance(watcher, dict) else {}


# -- words ---------------------------------------------------------------------------------------------------
def clock_words(age_s: float, fmt: Callable[[float], str]) -> str:
    """``10m 00s ago``, or ``10m 00s in the future`` for a heartbeat ahead of this machine's clock."""
    return f"{fmt(age_s)} ago" if age_s >= 0 else f"{fmt(-age_s)} in the future"


def dead_words(live: Liveness, fmt: Callable[[float], str]) -> str:
    """What makes the watcher look dead, as measured: ``last heartbeat 10m 00s ago`` by a clock that agrees,
    else what this reader watched."""
    age = live.clock_age_s
    if age is None:
        return "no heartbeat"
    if live.how == BY_CLOCK or live.how == BY_STOPPED:
        return f"last heartbeat {fmt(max(0.0, age))} ago"
    if live.how == BY_PID:
        return f"pid {live.pid} is gone from this host; last heartbeat {clock_words(age, fmt)}"
    return (
        f"heartbeat unchanged for {fmt(live.unchanged_s)} watched from this machine; last one "
        f"{clock_words(age, fmt)} by this machine's clock"
    )


def offset_words(live: Liveness, fmt: Callable[[float], str]) -> str | None:
    """``this machine's clock is 10m 00s ahead of the watcher's (host h)`` once watching measured it, else None."""
    if live.offset_s is None or abs(live.offset_s) < OFFSET_WORTH_SAYING_S:
        return None
    side = "ahead of" if live.offset_s >= 0 else "behind"
    return f"this machine's clock is {fmt(round(abs(live.offset_s)))} {side} the watcher's (host {live.host})"
