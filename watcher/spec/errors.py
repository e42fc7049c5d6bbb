"""The exception tree: one class per thing the person who dropped the job must fix."""

from __future__ import annotations

from dataclasses import dataclass


class WatcherError(Exception):
    """Root of every error the watcher raises on purpose."""


@dataclass(frozen=True)
class Problem:
    """One problem in a file: ``path`` is the dotted field path ("" for the whole file)."""

    path: str
    message: str

    def to_dict(self) -> dict:
        return {"path": self.path, "message": self.message}


class InvalidJobSpec(WatcherError):
    """Raised when a job file (or watcher.yaml) fails validation; carries every problem found."""

    def __init__(self, file: str, problems: list[Problem]):
        self.file = file
        self.problems = list(problems)
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        """One line per problem: ``FILE: FIELD: MESSAGE``."""
        return [f"{self.file}: {p.path + ': ' if p.path else ''}{p.message}" for p in self.problems]


class InvalidWatcherConfig(InvalidJobSpec):
    """Raised when watcher.yaml is invalid; start-up stops with its lines."""


class ResourcesUnavailable(WatcherError):
    """Raised when a job can never run on this machine (more GPUs or RAM than exist)."""


class SpawnFailed(WatcherError):
    """Raised when a job's supervisor or command could not be started."""


class IllegalTransition(WatcherError):
    """Raised when a job folder is asked to move between states the state machine forbids."""


class QueueLayoutError(WatcherError):
    """Raised when the queue root is missing, unwritable, split across filesystems, or locked."""


class QueueLocked(QueueLayoutError):
    """Raised when another watcher already holds the queue root."""

    def __init__(self, root: str, pid: int | None):
        self.root = root
        self.pid = pid
        who = f"pid {pid}" if pid else "another process"
        super().__init__(
            f"{root}: another watcher ({who}) already runs on this queue root; "
            "stop it (touch stop.flag) or use --root for another queue"
        )


class JobFolderRemoved(WatcherError):
    """Raised when a job's folder vanished under the watcher (someone ran ``rm -rf`` on it)."""

    def __init__(self, job_id: str, where: str):
        self.job_id = job_id
        self.where = where
        super().__init__(f"job {job_id}: its folder {where} was removed")


class ExecutorUnavailable(WatcherError):
    """Raised when the executor cannot take jobs right now (its scheduler is down); the job waits, nothing is lost."""
