"""Shared plumbing for the queue benchmarks: result rows, statistics, polling, temp workspaces, real watchers.

Everything here drives the product the way a user does (files renamed into inbox/, flags touched,
status.json read) and cleans up after itself: every process a section starts is found again by the
section's unique temp folder and killed by pid.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
#: the five state folders of a queue root (docs/contract.md, the queue root)
STATE_FOLDERS = ("inbox", "pending", "running", "done", "failed")
#: how long a watcher may take to write its first status.json (s); generous for a loaded 2-core box
WATCHER_READY_S = 30.0

logger = logging.getLogger(__name__)


class BenchError(RuntimeError):
    """Raised when a benchmark cannot produce its figure (a deadline passed, a tool failed)."""


@dataclass(frozen=True)
class Row:
    """One line of the results table, with the raw numbers kept for the JSON file."""

    section: str
    metric: str
    trainq: str
    peer: str = "—"
    goal: str = "—"
    met: bool | None = None
    values: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The JSON form of the row."""
        return {
            "section": self.section,
            "metric": self.metric,
            "trainq": self.trainq,
            "peer": self.peer,
            "goal": self.goal,
            "met": self.met,
            "values": self.values,
        }

    def cells(self) -> list[str]:
        """The markdown cells: metric | trainq | peer / floor | goal | met?."""
        met = {True: "yes", False: "**no**", None: "—"}[self.met]
        return [self.metric, self.trainq, self.peer, self.goal, met]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: list[float]) -> float:
    """The median, NaN for no values."""
    return statistics.median(values) if values else math.nan


def wait_until(pred: Callable[[], object], timeout_s: float, interval_s: float = 0.005, what: str = "") -> object:
    """Poll ``pred`` until it returns something truthy; BenchError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout_s:g}s waiting for {what or pred}")
        time.sleep(interval_s)


def count_entries(folder: Path) -> int:
    """Entries in ``folder`` that are not dotfiles (job folders or job files)."""
    try:
        with os.scandir(folder) as entries:
            return sum(1 for e in entries if not e.name.startswith("."))
    except FileNotFoundError:
        return 0


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages."""
    return os.getloadavg()


def bench_env(**extra: str) -> dict[str, str]:
    """The environment for watchers and tools: ours without TRAINQ_* leftovers, the repo importable.

    A PYTHONPATH given to the bench comes first, so one bench measures another checkout's package (a
    folder holding ``trainq/`` linked to that checkout's watcher, trainer and schemas) beside this one.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINQ_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)
    env.update(extra)
    return env


# -- workspaces ------------------------------------------------------------------------------------
#: workspaces whose removal waits for ``remove_workspaces`` (the end of the run)
_FINISHED_WORKSPACES: list[Path] = []


@contextmanager
def workspace(base: Path, name: str) -> Iterator[Path]:
    """A fresh temp folder for one section; on exit every process naming it is killed.

    The folder itself is removed by ``remove_workspaces`` at the end of the run, not here: on a
    filesystem like this VM's (ext4 without a journal) every file created in the next minutes
    is slower for each file just deleted nearby, so deleting one section's thousands of files
    would slow the next section, trainq and its peers alike, by up to several times.
    """
    path = Path(tempfile.mkdtemp(prefix=f"trainq-bench-{name}-", dir=str(base)))
    try:
        yield path
    finally:
        killed = kill_strays(path)
        if killed:
            logger.warning("bench %s: killed %d leftover process(es)", name, killed)
        _FINISHED_WORKSPACES.append(path)


def spread_out(folder: Path) -> None:
    """Ask ext4 to place each new sub-folder of ``folder`` as it would a top-level folder (chattr +T).

    Its allocator then puts every section's workspace in a block group with room to spare instead of
    next to whatever was deleted nearby a moment ago (other runs, other work on the machine). Best
    effort: other filesystems have no such flag, and nothing changes there.
    """
    try:
        subprocess.run(
            ["chattr", "+T", str(folder)], check=False, timeout=10, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        pass


def remove_workspaces() -> None:
    """Remove every finished section's workspace (call once the timed work is over)."""
    while _FINISHED_WORKSPACES:
        shutil.rmtree(_FINISHED_WORKSPACES.pop(), ignore_errors=True)


def _mentions(proc: psutil.Process, marker: str) -> bool:
    """True when the process's command line or environment names ``marker`` (our unique temp folder)."""
    try:
        if any(marker in part for part in proc.cmdline()):
            return True
        return any(marker in value for value in proc.environ().values())
    except (psutil.Error, OSError):
        return False


def strays(path: Path) -> list[psutil.Process]:
    """Live processes (not this one) started for the workspace ``path``."""
    marker = str(path)
    me = os.getpid()
    return [p for p in psutil.process_iter() if p.pid != me and _mentions(p, marker)]


def kill_strays(path: Path, rounds: int = 20) -> int:
    """SIGKILL, by pid, every process that names ``path``; repeat while new ones appear (a supervisor respawns)."""
    killed = 0
    for _ in range(rounds):
        found = strays(path)
        if not found:
            return killed
        for proc in found:
            try:
                proc.send_signal(signal.SIGKILL)
                killed += 1
            except psutil.Error:
                pass
        psutil.wait_procs(found, timeout=2)
    return killed


# -- queues and watchers ---------------------------------------------------------------------------
@dataclass
class Queue:
    """A queue root inside a workspace, with a staging folder on the same filesystem for renames."""

    root: Path
    staging: Path

    @classmethod
    def create(cls, work: Path, settings: dict | None = None) -> Queue:
        """The five folders, an optional watcher.yaml, and ``work/staging``."""
        root = work / "queue"
        for name in STATE_FOLDERS:
            (root / name).mkdir(parents=True, exist_ok=True)
        if settings:
            lines = [f"{key}: {value}" for key, value in settings.items()]
            (root / "watcher.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
        staging = work / "staging"
        staging.mkdir(exist_ok=True)
        return cls(root, staging)

    def stage(self, name: str, text: str) -> Path:
        """Write a job file outside the inbox (not yet dropped)."""
        path = self.staging / name
        path.write_text(text, encoding="utf-8")
        return path

    def drop_staged(self, name: str) -> None:
        """Rename a staged job file into the inbox, as the README tells users to."""
        os.rename(self.staging / name, self.root / "inbox" / name)

    def count(self, state: str) -> int:
        """Entries in one state folder."""
        return count_entries(self.root / state)

    def job_dir(self, state: str, job_id: str) -> Path:
        return self.root / state / job_id


def job_yaml(argv: list[str], **fields: object) -> str:
    """An approved command job, argv quoted so YAML 1.2 keeps every item a string."""
    items = ", ".join(_quoted(a) for a in argv)
    lines = ["approved: true", f"command: [{items}]"]
    lines += [f"{key}: {value}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    """A YAML single-quoted scalar."""
    return "'" + text.replace("'", "''") + "'"


class WatcherProc:
    """A real ``python -m trainq.watcher --root ROOT watch -q`` (optionally under cProfile)."""

    def __init__(self, root: Path, profile_to: Path | None = None):
        self.root = root
        self.profile_to = profile_to
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    def start(self) -> WatcherProc:
        """Spawn the watcher; ``started_at`` is the wall time just before the spawn."""
        prefix = [PY, "-m", "cProfile", "-o", str(self.profile_to)] if self.profile_to else [PY]
        self.started_at = time.time()
        with open(self.root.parent / "watcher.stderr", "ab") as err:
            self.proc = subprocess.Popen(
                [*prefix, "-m", "trainq.watcher", "--root", str(self.root), "watch", "-q"],
                cwd=REPO,
                env=bench_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_ready(self, timeout_s: float = WATCHER_READY_S) -> float:
        """Wait until status.json names this watcher; the wall time it did."""

        def ready() -> bool:
            self._check_alive()
            status = read_status(self.root)
            return bool(status) and status.get("watcher", {}).get("pid") == self.pid

        wait_until(ready, timeout_s, interval_s=0.01, what=f"watcher {self.pid} to write status.json")
        return time.time()

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = (self.root.parent / "watcher.stderr").read_text(errors="replace")[-500:]
            raise BenchError(f"watcher exited with status {self.proc.returncode}: {tail}")

    def kill(self, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> None:
        """Send ``sig`` and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=timeout_s)

    def stop(self) -> None:
        """SIGTERM (the watcher exits cleanly, writing its profile if any); SIGKILL if it hangs."""
        try:
            self.kill(signal.SIGTERM)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)


@contextmanager
def running_watcher(root: Path, profile_to: Path | None = None) -> Iterator[WatcherProc]:
    """A started, ready watcher that is stopped on exit."""
    watcher = WatcherProc(root, profile_to).start()
    try:
        watcher.wait_ready()
        yield watcher
    finally:
        watcher.stop()


def read_status(root: Path) -> dict | None:
    """status.json as a dict; None while it does not exist (it is replaced atomically, never torn)."""
    import json

    try:
        return json.loads((root / "status.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def fmt_ms(seconds: float) -> str:
    """Seconds shown as milliseconds."""
    return f"{seconds * 1000:.1f} ms"


def fmt_s(seconds: float) -> str:
    """Seconds shown with two decimals."""
    return f"{seconds:.2f} s"


def tree_cpu_by_depth(pid: int) -> Iterator[tuple[int, Any]]:
    """(depth, psutil cpu_times) of ``pid`` (depth 0) and every live descendant; a process gone meanwhile is passed
    over. The queue benches split a watcher's CPU by depth: the watcher, its spawner, the pooled supervisors."""
    todo = [(psutil.Process(pid), 0)]
    while todo:
        proc, depth = todo.pop()
        try:
            times = proc.cpu_times()
            kids = proc.children()
        except psutil.Error:
            continue
        yield depth, times
        todo += [(kid, depth + 1) for kid in kids]


def tree_cpu_split(pid: int) -> Counter:
    """User+system seconds by depth in the tree: 0 the watcher (all threads), 1 its children (the spawner), 2 and
    deeper (pooled supervisors); "reaped" is what every process has reaped (the jobs, exited helpers)."""
    out: Counter = Counter()
    for depth, t in tree_cpu_by_depth(pid):
        out[f"depth {min(depth, 2)}"] += t.user + t.system
        out["reaped"] += t.children_user + t.children_system
    return out
