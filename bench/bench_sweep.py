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
