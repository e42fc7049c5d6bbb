"""What SlurmExecutor's three parts (Submitting, Polling, Liveness) share, declared once for the type checker.

The parts are mixins of ``SlurmExecutor`` (executor.py): its ``__init__`` sets the settings and the state below,
and each part calls a few of the others' methods. ``SlurmParts`` says so in one place, so mypy can check every
``self.x`` a part reads. Each part inherits it only while type checking (``if TYPE_CHECKING``); at run time the
parts' base is ``object`` and nothing here runs.
"""

from __future__ import annotations

from pathlib import Path

from trainq.watcher.slurm.records import Held, Inflight, Unconfirmed
from trainq.watcher.slurm.state import SlurmJob, SqueueQuery
from trainq.watcher.slurm.submit import Submitter
from trainq.watcher.spec.contract import JobPaths


class SlurmParts:
    """Declarations only: never instantiated, never a base at run time."""

    # -- settings (watcher.yaml's slurm: block, and constants), set once by SlurmExecutor.__init__ --
    root: Path
    key: str
    partition: str | None
    sbatch_args: tuple[str, ...]
    poll_s: float
    arrays: bool
    exit_grace_s: float
    passthrough: frozenset[str]
    node_env: str
    sbatch_env: dict[str, str]
    kill_after_s: float
    scancel_margin_s: float
    command_timeout_s: float
    heartbeat_s: float
    heartbeat_stale_s: float
    heartbeat_dead_s: float
    poll_max_s: float
    array_limit: int | None
    limit_retry_s: float
    python: str
    package_parent: str

    # -- state --
    _jobs: dict[str, SlurmJob]
    _tracked: set[str]
    _ended_seen: dict[str, float]
    _cancelled: set[str]
    _unconfirmed: dict[str, Unconfirmed]
    _beats: dict[str, tuple[object, float]]
    _exit_read_mono: dict[str, float]
    _folder_period: dict[str, int]
    _seeded: set[str]
    _query: SqueueQuery | None
    _last_query_mono: float
    _probe_wanted_mono: float
    _down: str | None
    _held: list[Held]
    _to_cancel: dict[str, str]
    _interval_s: float
    _listed_all: bool
    _accounting: bool | None
    _tracked_at: dict[str, float]
    _running_at: dict[str, float]
    _last_known: dict[str, str]
    _node_lost: dict[str, str]
    _submitter: Submitter
    _inflight: dict[str, Inflight]
    _inflight_dirs: dict[str, str]
    _answers: list[tuple[str, str | None, Exception | None]]
    _refused_dirs: dict[str, str]

    # -- what one part calls of another --
    def _track(self, slurm_id: str, seed: SlurmJob | None = None) -> None: ...  # Polling
    def _forget(self, slurm_id: str) -> None: ...  # Polling
    def _wake_poll(self) -> None: ...  # Polling
    def _submit(self, argv: list[str], paths: JobPaths) -> str: ...  # type: ignore[empty-body]  # Submitting

    def _confirm(self, paths: JobPaths, record: dict, slurm_id: str) -> None: ...  # Submitting
    def _scancel(self, slurm_id: str, paths: JobPaths | None) -> None: ...  # Submitting
    def _submitting(self, paths: JobPaths) -> bool: ...  # type: ignore[empty-body]  # Submitting
