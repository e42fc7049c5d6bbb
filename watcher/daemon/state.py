"""``LoopState``: what the loop's steps share, passed to each step explicitly instead of living on one class.

The Watcher builds one ``LoopState`` and hands it to each step (intake.py, starting.py, finishing.py,
workflows.py, containment.py, walls.py). Each step's class docstring says which of these fields it reads
and which it changes; a field no step docstring names as changed is set once, by the Watcher.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trainq.watcher.daemon.jobs import Job, JobIndex, Outcome
from trainq.watcher.spec.capacity import acceptance_problems, nodes_problem
from trainq.watcher.spec.config import check_command_allowed
from trainq.watcher.spec.errors import InvalidJobSpec
from trainq.watcher.spec.folders import Folders, JobState, QueueRoot, id_from_name
from trainq.watcher.spec.interpreter import job_path
from trainq.watcher.spec.refusals import check_knowable

if TYPE_CHECKING:
    from trainq.watcher.daemon.executor import Executor
    from trainq.watcher.daemon.report import Report
    from trainq.watcher.daemon.resources import ResourceProbe
    from trainq.watcher.spec.config import WatcherConfig
    from trainq.watcher.spec.jobspec import JobSpec


@dataclass
class DependencyBook:
    """Who waits on whom, sweep members, and the final status of jobs looked up on disk."""

    dependents: dict[str, set[str]] = field(default_factory=dict)  # dependency id -> held job ids
    unknown: set[str] = field(default_factory=set)  # held jobs with a dependency not in the queue yet
    sweeps: dict[str, list[str]] = field(default_factory=dict)  # sweep id -> member ids
    finished: dict[str, str] = field(default_factory=dict)  # job id -> final status (cache)

    def wait_on(self, job_id: str, dep_ids: tuple[str, ...]) -> None:
        for dep in dep_ids:
            self.dependents.setdefault(dep, set()).add(job_id)

    def forget(self, job_id: str, dep_ids: tuple[str, ...]) -> None:
        self.unknown.discard(job_id)
        for dep in dep_ids:
            waiting = self.dependents.get(dep)
            if waiting is not None:
                waiting.discard(job_id)
                if not waiting:
                    del self.dependents[dep]


@dataclass
class LoopState:
    """The queue as the loop sees it: set-once parts (root ... wake) and the few fields steps change."""

    root: QueueRoot
    config: WatcherConfig
    env: dict[str, str]
    folders: Folders
    executor: Executor
    probe: ResourceProbe
    report: Report
    wake: Callable[[], None]  # wakes the loop now (an edit re-read, a burst's rest)
    jobs: JobIndex = field(default_factory=JobIndex)  # the live jobs: pending and running
    concluded: list[tuple[Job, Outcome]] = field(default_factory=list)  # out of the index, final write pending
    plan_due: bool = True  # admission plans again on the next pass (a slot freed, a job released, a pause)
    paused: bool = False  # pause.flag at the root: start nothing new
    paused_pools: set[str] = field(default_factory=set)  # pause.POOL.flag at the root (docs/cli.md, pools)
    order_last: int = 0  # the last acceptance order handed out (nanoseconds, strictly increasing)
    deps: DependencyBook = field(default_factory=DependencyBook)  # who waits on whom (workflows.py)

    def next_order(self) -> int:
        """A new acceptance order: later than every one before, and than now."""
        self.order_last = max(self.order_last + 1, time.time_ns())
        return self.order_last

    def drop_concluded(self, job: Job) -> None:
        """Forget ``job``'s pending final write (it was written, failed otherwise, or its folder vanished)."""
        self.concluded = [(j, o) for j, o in self.concluded if j is not job]

    def check_allowed(self, spec: JobSpec, display: str, file_name: str) -> None:
        """allow_commands at acceptance, placeholders expanded as they will be (job_dir's depth is every state's);
        also what needs the executor or the machine: several nodes only with Slurm, CPU ranks within the cores and
        RAM of a machine without GPUs (spec/capacity.py)."""
        nodes = nodes_problem(spec.raw, self.config.executor)
        if nodes is not None:
            raise InvalidJobSpec(display, [nodes])
        job_id = id_from_name(file_name)
        job_dir = self.root.job_dir(JobState.PENDING, job_id)
        ranks = acceptance_problems(spec.raw, lambda: bool(self.probe.gpus()[0]), self.config.executor, job_dir)
        if ranks:
            raise InvalidJobSpec(display, ranks)
        if self.config.allow_commands is None and self.config.allow_env is None:
            return
        values = {"job_dir": str(job_dir), "job_id": job_id, "attempt": "1"}
        problem = check_command_allowed(spec, self.config, values, job_path(self.env.get("PATH", "")))
        if problem is not None:
            raise InvalidJobSpec(display, [problem])

    def check_pool(self, spec: JobSpec, display: str, job_dir: Path) -> None:
        """What acceptance refuses that a run would only find later (docs/contract.md): an unknown pool, a
        missing path (relative ones against submitted_from, else the queue root), shell syntax in a one-string
        command. ``job_dir``: the job's folder, or where it will be (its depth is every state's)."""
        check_knowable(spec, display, self.root.path, self.config.pool_limits(), str(job_dir))
