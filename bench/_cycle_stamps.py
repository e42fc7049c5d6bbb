"""Timing stamps for ``probe_cycle.py``, loaded into the watcher and its spawner by a ``sitecustomize`` on
PYTHONPATH (nothing in trainq imports this). With ``CYCLE_STAMPS=<folder>`` set, it wraps a fixed list of the
loop's and the supervisor's steps; each call appends ``step start end cpu`` (``time.perf_counter``, a clock every
process on the machine shares, and the thread's CPU seconds) to ``<folder>/<pid>.stamps``. The watcher writes its
stamps when it exits, a supervisor after each attempt. A wrapper costs a few microseconds a call.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import os
import sys
import time
from collections.abc import Callable

#: (module, attribute path, step name) wrapped in the watcher process
WATCHER_STEPS = (
    ("trainq.watcher.daemon.daemon", "Watcher.tick", "pass"),
    ("trainq.watcher.daemon.daemon", "Watcher._wait", "wait"),
    ("trainq.watcher.daemon.finishing", "Finishing.reap_finished", "reap_finished"),
    ("trainq.watcher.daemon.intake", "Intake.admit_inbox", "admit"),
    ("trainq.watcher.daemon.starting", "Starting.start_pending", "start_pending"),
    ("trainq.watcher.daemon.starting", "Starting._launch", "launch"),
    ("trainq.watcher.supervisor.spawner", "Spawner._launch_direct", "hand_over"),
    ("trainq.watcher.daemon.finishing", "Finishing.retire_concluded", "retire"),
    ("trainq.watcher.daemon.daemon", "Watcher.write_status", "status"),
)

#: the same in the spawner helper and the pooled supervisors it forks
SUPERVISOR_STEPS = (
    ("trainq.watcher.supervisor.pool", "_await_job", "await"),
    ("trainq.watcher.supervisor.pool", "take_direct", "take"),
    ("trainq.watcher.supervisor.pool", "_supervise", "supervise"),
    ("trainq.watcher.supervisor.story", "read_snapshot", "snapshot_read"),
    ("trainq.watcher.supervisor.attempt", "_spawn_contained", "spawn"),
    ("trainq.watcher.supervisor.story", "write_snapshot", "snapshot_write"),
    ("trainq.watcher.supervisor.attempt", "_write_started", "start_record"),
    ("trainq.watcher.supervisor.story", "started", "started_event"),
    ("trainq.watcher.supervisor.attempt", "_watch", "watch"),
    ("trainq.watcher.supervisor.attempt", "_write_exit", "exit_record"),
    ("trainq.watcher.supervisor.pool", "_end_attempt", "notify"),
)

_lines: list[str] = []


def _flush(folder: str) -> None:
    if _lines:
        with open(os.path.join(folder, f"{os.getpid()}.stamps"), "a", encoding="ascii") as f:
            f.write("".join(_lines))
        _lines.clear()


def _wrap(module: str, path: str, step: str, after: Callable[[], None] | None = None) -> None:
    owner = importlib.import_module(module)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    original = getattr(owner, name)

    @functools.wraps(original)
    def stamped(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            _lines.append(f"{step} {start:.6f} {time.perf_counter():.6f} {time.thread_time() - cpu:.6f}\n")
            if after is not None:
                after()

    setattr(owner, name, stamped)


def install(folder: str, argv: list[str]) -> None:
    """Wrap the steps of the process ``argv`` names (the watcher's loop, or the spawner helper's tree)."""
    words = " ".join(argv)
    if "trainq.watcher.supervisor.spawner" in words:
        for module, path, step in SUPERVISOR_STEPS:
            _wrap(module, path, step, functools.partial(_flush, folder) if step == "supervise" else None)
    elif "trainq.watcher" in words and " watch" in words:
        for module, path, step in WATCHER_STEPS:
            _wrap(module, path, step)
        atexit.register(_flush, folder)


if os.environ.get("CYCLE_STAMPS"):
    install(os.environ["CYCLE_STAMPS"], list(getattr(sys, "orig_argv", sys.argv)))
