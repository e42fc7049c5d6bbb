"""Where attempts run: an executor launches a supervised attempt and answers questions about it.

The daemon's admission, stop, retry and status code is the same for every executor. ``local``
forks a supervisor on this machine; ``slurm`` (watcher/slurm.py) hands the same supervisor to
``sbatch``. Either way the supervisor's lock, start record and exit record in the job folder
are the truth about an attempt.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import WatcherError
from trainq.watcher.supervisor.spawner import SpawningSupervisor
from trainq.watcher.supervisor import LaunchSpec

if TYPE_CHECKING:
    from trainq.watcher.spec.config import WatcherConfig


class ExecutorUnavailable(WatcherError):
    """Raised when the executor cannot take jobs right now (Slurm down); the job waits, nothing is lost."""


class Executor(Protocol):
    """What the daemon needs from a place that runs attempts."""

    name: str

    def start(self) -> None:
        """Get ready to launch (the watcher is starting); never blocks for long."""

    def unavailable(self, now: float) -> str | None:
        """Why no attempt can be launched now (in words), or None when ready."""

    def launch(self, spec: LaunchSpec, job_name: str, slurm_options: dict | None,
               group: tuple[str, int] | None = None) -> dict:
        """Start an attempt; return fields for its attempt record (``pid`` or ``slurm_job_id``). ``group``
        (sweep id, index) lets an executor hold a sweep's attempts back and start them together in ``flush``."""

    def flush(self) -> list[tuple[str, str | None, Exception | None]]:
        """Start the attempts ``launch`` held back: (job id, Slurm job id or None, error) for each."""

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
        """Why a launched attempt has not started yet (Slurm's pending reason), or None."""

    def enforce_stop(self, paths: JobPaths, attempt: dict, stop_requested_at: float, grace_s: float, now: float) -> None:
        """Escalate a stop the supervisor cannot carry out itself (scancel after the grace)."""

    def health(self, paths: JobPaths, attempt: dict, now: float) -> str | None:
        """Why a running attempt looks dead where it runs (Slurm: its node's heartbeat stopped), in words; else
        None. The job shows as stalled while this says so."""

    def folder_due(self, paths: JobPaths, attempt: dict, now: float) -> bool:
        """Whether the watcher should look into the job folder this tick (stop.flag, stall, progress)."""

    def wake_fds(self) -> list[int]:
        """Extra fds whose readability means an attempt may have ended (the loop selects on them)."""

    def close(self) -> None:
        """Release what the executor holds."""


class LocalExecutor:
    """Attempts run under a supervisor forked from this watcher, on this machine."""

    name = "local"

    def __init__(self) -> None:
        self.supervisor = SpawningSupervisor()

    def start(self) -> None:
        # now, not at the first launch: a launch then only writes one line to a running helper
        self.supervisor.start_spawner()

    def unavailable(self, now: float) -> str | None:
        return None

    def launch(self, spec: LaunchSpec, job_name: str, slurm_options: dict | None,
               group: tuple[str, int] | None = None) -> dict:
        return {"pid": self.supervisor.launch(spec)}

    def flush(self) -> list[tuple[str, str | None, Exception | None]]:
        return []  # every launch started at once

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

    def enforce_stop(self, paths: JobPaths, attempt: dict, stop_requested_at: float, grace_s: float, now: float) -> None:
        return None  # the supervisor escalates by itself

    def health(self, paths: JobPaths, attempt: dict, now: float) -> str | None:
        return None  # a local attempt's liveness is its supervisor's lock, seen every tick

    def folder_due(self, paths: JobPaths, attempt: dict, now: float) -> bool:
        return True  # a local folder is cheap to look at: every tick

    def wake_fds(self) -> list[int]:
        return self.supervisor.wake_fds()

    def close(self) -> None:
        self.supervisor.close()


def make_executor(config: "WatcherConfig", root: Path) -> Executor:
    """The executor watcher.yaml asks for."""
    if config.executor == "slurm":
        from trainq.watcher.slurm.executor import SlurmExecutor

        return SlurmExecutor(config, root)
    return LocalExecutor()
