"""Where attempts run: an executor launches a supervised attempt and answers questions about it.

The daemon's admission, stop, retry and status code is the same for every executor, and the daemon
knows executors only through the ``Executor`` protocol below. ``local`` (here) forks a supervisor on
this machine; others (watcher/slurm/ hands the same supervisor to a batch scheduler) are plug-ins:
each is registered under its watcher.yaml name in the ``trainq.executors`` entry-point group of
pyproject.toml and imported only when a queue chooses it. Whatever the executor, the supervisor's
lock, start record and exit record in the job folder are the truth about an attempt.

Adding an executor (say Kubernetes): write a class with the members of ``Executor``; register it as
``kubernetes = "yourpackage.module:KubernetesExecutor"`` under ``[project.entry-points."trainq.executors"]``;
add the name to ``executor``'s enum in schemas/watcher.schema.json. Its constructor takes
``(config: WatcherConfig, root: Path)``.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import ExecutorUnavailable, WatcherError  # noqa: F401 (re-exported)
from trainq.watcher.supervisor import LaunchSpec
from trainq.watcher.supervisor.spawner import SpawningSupervisor

if TYPE_CHECKING:
    from trainq.watcher.spec.config import WatcherConfig


#: the entry-point group where executors are registered by their watcher.yaml name
EXECUTOR_GROUP = "trainq.executors"


class UnknownExecutor(WatcherError):
    """Raised when watcher.yaml names an executor no installed package registers."""

    def __init__(self, name: str, known: list[str]):
        super().__init__(
            f"watcher.yaml: executor: no executor named {name!r} is installed "
            f"(installed: {', '.join(known) or 'none'}); reinstall trainq (pip install -e .)"
        )


class Executor(Protocol):
    """What the daemon needs from a place that runs attempts."""

    name: str
    #: True when the scheduler places GPUs and RAM itself (admission then checks only the queue's disk)
    places_resources: bool
    #: True when the attempt's environment is added to the executor's own (a batch job keeps its node's variables)
    inherits_environment: bool
    #: the attempt-record field naming the attempt in the executor's own queue, copied into run.json (or None)
    job_ref_field: str | None

    def start(self) -> None:
        """Get ready to launch (the watcher is starting); never blocks for long."""

    def unavailable(self, now: float) -> str | None:
        """Why no attempt can be launched now (in words), or None when ready."""

    def launch(
        self, spec: LaunchSpec, job_name: str, options: dict | None, group: tuple[str, int] | None = None
    ) -> dict:
        """Start an attempt; return fields for its attempt record (``pid``, or ``job_ref_field``). ``options``
        are the job file's section for this executor; ``group`` (sweep id, index) lets an executor hold a
        sweep's attempts back and start them together in ``flush``."""

    def flush(self) -> list[tuple[str, str | None, Exception | None]]:
        """Start the attempts ``launch`` held back: (job id, the executor's id for it or None, error) for each."""

    def describe(self, record: dict) -> str:
        """Where an attempt record's attempt runs, for the log ("pid 123", "slurm job 45")."""

    def reap(self) -> None:
        """Collect finished children; never blocks."""

    def is_alive(self, paths: JobPaths, attempt: dict) -> bool:
        """True while the attempt (or its queued batch job) lives."""

    def read_started(self, paths: JobPaths) -> dict | None:
        """The supervisor's start record."""

    def read_exit(self, paths: JobPaths, attempt: dict) -> dict | None:
        """The exit record, or one synthesised from the executor when no supervisor could write it."""

    def kill_leftovers(self, paths: JobPaths, attempt: dict) -> int:
        """Kill what is left of an attempt whose supervisor died."""

    def process_tree(self, paths: JobPaths) -> list[int]:
        """Pids of the attempt's processes on this machine (empty when elsewhere)."""

    def waiting_for(self, paths: JobPaths, attempt: dict) -> str | None:
        """Why a launched attempt has not started yet (the scheduler's pending reason), or None."""

    def enforce_stop(
        self, paths: JobPaths, attempt: dict, stop_requested_at: float, grace_s: float, now: float
    ) -> None:
        """Escalate a stop the supervisor cannot carry out itself (cancel the batch job after the grace)."""

    def health(self, paths: JobPaths, attempt: dict, now: float) -> str | None:
        """Why a running attempt looks dead where it runs (Slurm: its node's heartbeat stopped), in words; else
        None. The job shows as stalled while this says so."""

    def folder_due(self, paths: JobPaths, attempt: dict, now: float) -> bool:
        """Whether the watcher should look into the job folder this tick (stop.flag, stall, progress)."""

    def wake_fds(self) -> list[int]:
        """Extra fds whose readability means an attempt may have ended (the loop selects on them)."""

    def problems(self) -> list[str]:
        """What is degraded in how this executor starts attempts, one line each (status.json ``watcher.problems``)."""

    def close(self) -> None:
        """Release what the executor holds."""


class LocalExecutor:
    """Attempts run under a supervisor forked from this watcher, on this machine."""

    name = "local"
    places_resources = False
    inherits_environment = False
    job_ref_field: str | None = None

    def __init__(self, config: WatcherConfig | None = None, root: Path | None = None) -> None:
        self.supervisor = SpawningSupervisor()
        #: status.json's watcher.containment: a cgroup per attempt where the kernel lets us, else the tree walk
        self.containment = self.supervisor.containment.mode

    def start(self) -> None:
        # now, not at the first launch: a launch then only writes one line to a running helper
        self.supervisor.start_spawner()

    def unavailable(self, now: float) -> str | None:
        return None

    def launch(
        self, spec: LaunchSpec, job_name: str, options: dict | None, group: tuple[str, int] | None = None
    ) -> dict:
        return {"pid": self.supervisor.launch(spec)}

    def flush(self) -> list[tuple[str, str | None, Exception | None]]:
        return []  # every launch started at once

    def describe(self, record: dict) -> str:
        return f"pid {record.get('pid')}"

    def reap(self) -> None:
        self.supervisor.reap()

    def is_alive(self, paths: JobPaths, attempt: dict) -> bool:
        return self.supervisor.is_alive(paths)

    def read_started(self, paths: JobPaths) -> dict | None:
        return self.supervisor.read_started(paths)

    def read_exit(self, paths: JobPaths, attempt: dict) -> dict | None:
        return self.supervisor.read_exit(paths)

    def kill_leftovers(self, paths: JobPaths, attempt: dict) -> int:
        return self.supervisor.kill_leftovers(paths)

    def process_tree(self, paths: JobPaths) -> list[int]:
        return self.supervisor.process_tree(paths)

    def waiting_for(self, paths: JobPaths, attempt: dict) -> str | None:
        return None

    def enforce_stop(
        self, paths: JobPaths, attempt: dict, stop_requested_at: float, grace_s: float, now: float
    ) -> None:
        return None  # the supervisor escalates by itself

    def health(self, paths: JobPaths, attempt: dict, now: float) -> str | None:
        return None  # a local attempt's liveness is its supervisor's lock, seen every tick

    def folder_due(self, paths: JobPaths, attempt: dict, now: float) -> bool:
        return True  # a local folder is cheap to look at: every tick

    def wake_fds(self) -> list[int]:
        return self.supervisor.wake_fds()

    def problems(self) -> list[str]:
        return self.supervisor.problems()

    def close(self) -> None:
        self.supervisor.close()


def make_executor(config: WatcherConfig, root: Path) -> Executor:
    """The executor watcher.yaml asks for: ``local`` is built in, any other comes from its entry point."""
    if config.executor == LocalExecutor.name:
        return LocalExecutor(config, root)
    found = {ep.name: ep for ep in entry_points(group=EXECUTOR_GROUP)}
    if config.executor not in found:
        raise UnknownExecutor(config.executor, sorted(found))
    return found[config.executor].load()(config, root)
