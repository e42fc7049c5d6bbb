"""Section 9 (sweep): a 1000-job sweep pending, held on a dependency and then runnable behind a running job.

Measures: drop → every job of the sweep in pending/ (expansion), status.json's size, and the watcher
loop's CPU share while the jobs wait (over ``seconds``), first with the sweep held by ``after:``
(its jobs outside the start order), then with a second sweep of the same size waiting in line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil

from bench._common import Queue, Row, fmt_s, read_status, running_watcher, wait_until, workspace

#: status.json stays within the size goal of the burst section whatever is pending
STATUS_SIZE_GOAL_KB = 200.0
#: a watcher with nothing to start should stay near idle, however many jobs wait
WAITING_CPU_GOAL_PCT = 5.0
#: seconds a 1000-job sweep file may take from drop to every job in pending/
EXPAND_GOAL_S = 10.0
#: issue 36: a sweep file never holds the loop longer than this (seconds)...
LOOP_HOLD_GOAL_S = 1.0
#: ...so status.json's heartbeat is never older than this while it is admitted (seconds)
HEARTBEAT_AGE_GOAL_S = 2.0
#: the heartbeat period the wide-sweep section runs the watcher with: a live loop beats at least this often
WIDE_HEARTBEAT_S = 0.25


def _sweep_text(n: int, after: list[str] | None) -> str:
    job = {"approved": True, "command": ["true", "{i}"], "sweep": {"i": list(range(n))}}
    if after:
        job["after"] = after
    return json.dumps(job)


def _pending(root: Path) -> int:
    return int(((read_status(root) or {}).get("counts") or {}).get("pending", 0))


def _cpu_pct(pid: int, seconds: float) -> float:
    proc = psutil.Process(pid)
    cpu0, wall0 = sum(proc.cpu_times()[:2]), time.monotonic()
    time.sleep(seconds)
    return (sum(proc.cpu_times()[:2]) - cpu0) / (time.monotonic() - wall0) * 100


def _measure(q: Queue, watcher, name: str, n: int, after: list[str] | None, seconds: float) -> dict:
    before = _pending(q.root)
    q.stage(f"{name}.yaml", _sweep_text(n, after))
    start = time.monotonic()
    q.drop_staged(f"{name}.yaml")
    wait_until(lambda: _pending(q.root) >= before + n, 120, interval_s=0.01, what=f"{n} jobs of {name} pending")
    expand_s = time.monotonic() - start
    time.sleep(1.0)  # the first full plan and status write after the burst
    cpu_pct = _cpu_pct(watcher.pid, seconds)
    return {
        "expand_s": expand_s,
        "cpu_pct": cpu_pct,
        "status_json_kb": (q.root / "status.json").stat().st_size / 1024,
        "rss_mb": psutil.Process(watcher.pid).memory_info().rss / 2**20,
        "pending": _pending(q.root),
    }


def bench_sweep(base: Path, variants: int, seconds: float, profile_dir: Path | None = None) -> list[Row]:
    """A ``variants``-job sweep held on a running job, then a second one runnable behind it."""
    del profile_dir
    with workspace(base, "sweep") as work:
        q = Queue.create(work, {"max_concurrent": 1})
        with running_watcher(q.root) as watcher:
            q.stage("gate.yaml", json.dumps({"approved": True, "command": ["sleep", "600"], "stop_grace": "1s"}))
            q.drop_staged("gate.yaml")
            wait_until(lambda: (q.root / "running" / "gate").is_dir(), 30, what="the gate job to run")
            held = _measure(q, watcher, "held", variants, ["gate"], seconds)
            line = _measure(q, watcher, "line", variants, None, seconds)
    values = {"variants": variants, "seconds": seconds, "held": held, "in_line": line}
    rows = []
    for label, m in ((f"{variants} held by after:", held), (f"+ {variants} more waiting in line", line)):
        rows += [
            Row(
                "sweep",
                f"9. sweep: drop → {variants} jobs pending ({label})",
                fmt_s(m["expand_s"]),
                "—",
                f"≤ {EXPAND_GOAL_S:g} s",
                m["expand_s"] <= EXPAND_GOAL_S,
                values if m is held else {},
            ),
            Row(
                "sweep",
                f"9. sweep: status.json size, {m['pending']} pending ({label})",
                f"{m['status_json_kb']:.0f} KB",
                "—",
                f"< {STATUS_SIZE_GOAL_KB:g} KB",
                m["status_json_kb"] < STATUS_SIZE_GOAL_KB,
            ),
            Row(
                "sweep",
                f"9. sweep: watcher CPU over {seconds:g} s, {m['pending']} pending ({label})",
                f"{m['cpu_pct']:.2f} %",
                f"RSS {m['rss_mb']:.0f} MB",
                f"≤ {WAITING_CPU_GOAL_PCT:g} %",
                m["cpu_pct"] <= WAITING_CPU_GOAL_PCT,
            ),
        ]
    return rows


def _heartbeat_watch(root: Path, until) -> tuple[float, float]:
    """Poll status.json until ``until()`` holds: (the oldest heartbeat seen, by its age when read; the longest
    gap between two successive heartbeats). With heartbeat_s = WIDE_HEARTBEAT_S the gap less that period is
    how long the loop was held."""
    from trainq.watcher.spec.units import parse_iso

    oldest = gap = 0.0
    last = None
    done_at = None
    while done_at is None or (time.time() - done_at < 30 and (last or 0) <= done_at):  # one beat after the end
        if done_at is None and until():
            done_at = time.time()
        beat = parse_iso(((read_status(root) or {}).get("watcher") or {}).get("heartbeat_at"))
        if beat is not None:
            oldest = max(oldest, time.time() - beat)
            if last is not None and beat > last:
                gap = max(gap, beat - last)
            last = beat if last is None else max(last, beat)
        time.sleep(0.01)
    return oldest, gap


def bench_wide_sweep(base: Path, keys: int, profile_dir: Path | None = None) -> list[Row]:
    """Issue 36: a sweep file with ``keys`` one-value keys (one job, ``keys`` arguments) dropped into a live
    queue: the heartbeat's age and the longest gap between heartbeats while it is validated and expanded."""
    del profile_dir
    names = [f"k{i:05d}" for i in range(keys)]
    text = json.dumps(
        {"approved": True, "command": ["true", *(f"{{{k}}}" for k in names)], "sweep": {k: [k.upper()] for k in names}}
    )
    with workspace(base, "widesweep") as work:
        q = Queue.create(work, {"status_s": 0.1, "heartbeat_s": WIDE_HEARTBEAT_S, "max_concurrent": 1})
        (q.root / "pause.flag").touch()  # the job stays pending: only admission is measured
        with running_watcher(q.root):
            q.stage("wide.yaml", text)
            time.sleep(1.0)
            start = time.monotonic()
            q.drop_staged("wide.yaml")
            oldest, gap = _heartbeat_watch(q.root, lambda: (q.root / "pending" / "wide-1" / "run.json").exists())
            taken_s = time.monotonic() - start
    hold = max(0.0, gap - WIDE_HEARTBEAT_S)
    values = {"keys": keys, "bytes": len(text), "taken_s": taken_s, "heartbeat_max_age_s": oldest, "gap_s": gap}
    return [
        Row(
            "widesweep",
            f"9b. a {keys}-key sweep file ({len(text) // 1024} KB): longest loop hold (heartbeat gap - {WIDE_HEARTBEAT_S} s)",
            fmt_s(hold),
            f"drop → pending {fmt_s(taken_s)}",
            f"≤ {LOOP_HOLD_GOAL_S:g} s",
            hold <= LOOP_HOLD_GOAL_S,
            values,
        ),
        Row(
            "widesweep",
            f"9b. a {keys}-key sweep file: oldest heartbeat seen while it was admitted",
            fmt_s(oldest),
            "—",
            f"< {HEARTBEAT_AGE_GOAL_S:g} s",
            oldest < HEARTBEAT_AGE_GOAL_S,
        ),
    ]
