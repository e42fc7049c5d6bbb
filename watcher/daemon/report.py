"""What the daemon tells the world: counts, bounded job lists, progress and resources for status.json.

The daemon feeds events in (a job finished, the inbox changed); ``write`` builds a
``StatusSnapshot`` only when something changed or the heartbeat is due, and hands it to the
``StatusWriter``, the only writer of status.json and status.html.
"""

from __future__ import annotations

import logging
import os
import socket
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from trainq.watcher import __version__
from trainq.watcher.daemon.admission import resources_dict
from trainq.watcher.daemon.diagnosis import read_metrics_tail
from trainq.watcher.faces.history import HISTORY_FILE, append_record, record_of
from trainq.watcher.faces.html import CurveStore
from trainq.watcher.faces.progress import PROGRESS_KEYS, MetricsTail, merge_progress, vitals_words
from trainq.watcher.faces.progress_log import LogProgress
from trainq.watcher.faces.status import StatusSnapshot, StatusWriter, job_entry
from trainq.watcher.faces.story import JobStory, derive
from trainq.watcher.faces.sweepview import workflow_entry
from trainq.watcher.spec.folders import JobState, QueueRoot
from trainq.watcher.spec.fsutil import exists
from trainq.watcher.spec.units import iso_utc, parse_iso

if TYPE_CHECKING:
    from trainq.watcher.daemon.executor import Executor
    from trainq.watcher.daemon.jobs import Job, JobIndex
    from trainq.watcher.daemon.resources import ResourceProbe
    from trainq.watcher.spec.config import LiveSettings, WatcherConfig


class ReportSource(Protocol):
    """What the report reads from the loop (the Watcher provides it; no import of it here)."""

    # read-only (properties): the report never sets them
    @property
    def jobs(self) -> JobIndex: ...
    @property
    def executor(self) -> Executor: ...
    @property
    def probe(self) -> ResourceProbe: ...
    @property
    def paused(self) -> bool: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def disk_full(self) -> object: ...  # None while the disk has room
    @property
    def settings(self) -> LiveSettings: ...  # watcher.yaml as applied (spec/config.py)

    def problems(self) -> list[str]: ...
    def window_now(self, now: float) -> dict | None: ...
    def cost_now(self, now: float) -> dict | None: ...
    def holding(self, job: Job): ...


class UsageSource(Protocol):
    """What measuring a running job's processes needs (the loop's shared state provides it)."""

    @property
    def executor(self) -> Executor: ...
    @property
    def probe(self) -> ResourceProbe: ...


logger = logging.getLogger(__name__)

#: most awaiting/pending entries listed in status.json (docs/contract.md, status.json)
MAX_LISTED = 50
#: how often a running job's process tree is measured (RSS, CPU, GPU memory), seconds
USAGE_EVERY_S = 2.0
#: how often done/ and failed/ are recounted from disk (users may delete folders), seconds
RECOUNT_EVERY_S = 30.0


@dataclass
class _Readers:
    """Incremental progress readers for one running job."""

    metrics: MetricsTail
    log: LogProgress
    usage_at: float = 0.0


@dataclass
class Report:
    """Status bookkeeping for one watcher."""

    root: QueueRoot
    config: WatcherConfig
    started_at: float
    counts: dict = field(default_factory=lambda: {s.value: 0 for s in JobState})
    recent: OrderedDict[str, dict] = field(default_factory=OrderedDict)
    inbox_count: int = 0
    awaiting_entries: list = field(default_factory=list)
    ignored: list = field(default_factory=list)
    dirty: bool = True
    last_write: float = 0.0
    last_recount: float = 0.0
    writer: StatusWriter | None = None

    def __post_init__(self) -> None:
        self.curves = CurveStore()
        self.writer = StatusWriter(
            self.root.status_json,
            self.root.status_html,
            status_s=self.config.status_s,
            heartbeat_s=self.config.heartbeat_s,
            keep_finished=self.config.keep_finished,
            curves=self.curves,
        )

    def touch(self) -> None:
        """Something visible changed."""
        self.dirty = True

    def apply(self, config: WatcherConfig) -> None:
        """watcher.yaml changed (spec/config.py): its intervals and keep_finished count from now on."""
        self.config = config
        if self.writer is not None:
            self.writer.status_s, self.writer.heartbeat_s = config.status_s, config.heartbeat_s
            self.writer.keep_finished = config.keep_finished
        while len(self.recent) > config.keep_finished:
            self.recent.popitem(last=False)

    # -- what the daemon reports ---------------------------------------------------------------
    def inbox_seen(self, candidates: list, ignored: list | None = None) -> None:
        if len(candidates) != self.inbox_count:
            self.inbox_count = len(candidates)
            self.dirty = True
        if ignored is not None and ignored != self.ignored:
            self.ignored = list(ignored)
            self.dirty = True

    def awaiting(self, entries: dict) -> None:
        listed = [
            job_entry(
                name,
                "awaiting_approval",
                f"inbox/{name}",
                name=e["spec"].name or name,
                priority=e["spec"].priority,
                waiting_for="approval: set approved: true in the file",
                approval_hint=e["spec"].approval_hint,
            )
            if e.get("spec") is not None
            else job_entry(
                name,
                "awaiting_approval",
                f"inbox/{name}",
                name=name,
                waiting_for=e["waiting_for"],
                error=e["problems"][0] if e["problems"] else None,
                errors=e["errors"],
            )
            for name, (_sig, e) in list(entries.items())
        ]
        if listed != self.awaiting_entries:
            self.awaiting_entries = listed
            self.dirty = True

    def finished(self, job: Job, now: float, count: bool = True) -> None:
        """A job reached done/ or failed/ (``count``: it was not on disk at the last recount)."""
        _last_look(job)
        entry = _entry(job, self.root, final=True)
        if count:
            self.counts[job.state.value] += 1
            self._record_history(job, entry["progress"])
        self.recent[job.id] = entry
        self.recent.move_to_end(job.id)
        while len(self.recent) > self.config.keep_finished:
            self.recent.popitem(last=False)
        self.dirty = True

    def _record_history(self, job: Job, progress: dict | None) -> None:
        """One line in history.jsonl for ``trainq history``; a write that fails costs that line, not the job."""
        spec = job.spec
        record = record_of(
            job.id,
            job.state.value,
            job.run,
            None if spec is None else spec.is_train,
            spec.pool if spec is not None else None,
            progress,
        )
        try:
            append_record(self.root.path, record)
        except OSError as exc:
            logger.warning("job %s: could not add it to %s (%s)", job.id, HISTORY_FILE, exc.strerror)

    def removed_while_running(self, job: Job, now: float) -> None:
        """A running job's folder was removed: its history line says so (reason ``removed``)."""
        run = dict(job.run, status="cancelled", reason="removed", finished_at=iso_utc(now))
        spec = job.spec
        record = record_of(
            job.id, "removed", run, None if spec is None else spec.is_train, spec.pool if spec else None, None
        )
        try:
            append_record(self.root.path, record)
        except OSError as exc:
            logger.warning("job %s: could not add it to %s (%s)", job.id, HISTORY_FILE, exc.strerror)

    def unfinished(self, job_id: str, state: JobState) -> None:
        self.counts[state.value] = max(0, self.counts[state.value] - 1)
        self.recent.pop(job_id, None)
        self.dirty = True

    def forget_removed_recent(self) -> list[tuple[str, str]]:
        """Drop listed finished jobs whose folder was removed by hand; their (id, state)."""
        gone = [(job_id, e["state"]) for job_id, e in self.recent.items() if not (self.root.path / e["dir"]).is_dir()]
        for job_id, _state in gone:
            self.recent.pop(job_id, None)
        if gone:
            self.recount()
            self.dirty = True
        return gone

    def recount(self) -> None:
        """Count done/ and failed/ from disk (users may delete finished folders)."""
        for state in (JobState.DONE, JobState.FAILED):
            try:
                n = sum(1 for e in os.scandir(self.root.state_dir(state)) if not e.name.startswith("."))
            except FileNotFoundError:
                n = 0
            if n != self.counts[state.value]:
                self.counts[state.value] = n
                self.dirty = True

    # -- progress ------------------------------------------------------------------------------
    def update_progress(self, watcher: UsageSource, job: Job, now: float) -> None:
        """Read new metrics/log lines of a running job; measure its process tree now and then."""
        if job.unsaved_since is not None:
            return  # just launched: looked at once it has run a moment (most trivial jobs are over by then)
        readers = job.readers
        if readers is None or readers.metrics.path != job.paths.metrics:
            started = parse_iso((job.current_attempt() or {}).get("started_at"))
            readers = job.readers = _Readers(MetricsTail(job.paths.metrics, started), LogProgress(job.paths.log))
        new_metrics = readers.metrics.poll()
        new_log = readers.log.poll()
        if new_metrics:
            self.curves.feed(job.id, readers.metrics.new_records)
        if new_metrics or new_log:
            self.dirty = True
        if now - readers.usage_at >= USAGE_EVERY_S:
            readers.usage_at = now
            pids = watcher.executor.process_tree(job.paths)
            job.pids = tuple(pids)
            usage = watcher.probe.tree_usage(pids) if pids else None
            if usage != job.usage:
                job.usage = usage
                self.dirty = True

    # -- writing -------------------------------------------------------------------------------
    def write(
        self,
        watcher: ReportSource,
        now: float,
        force: bool = False,
        state: str | None = None,
        heartbeat_only: bool = False,
    ) -> None:
        """Write status.json (and status.html) when due: the heartbeat (heartbeat_s), or a change status_s after the
        last write (not with ``heartbeat_only``), or ``force``."""
        if now - self.last_recount >= RECOUNT_EVERY_S:
            self.last_recount = now
            self.recount()
        since = now - self.last_write
        due = since >= self.config.heartbeat_s or (self.dirty and not heartbeat_only and since >= self.config.status_s)
        if not (due or force):
            return  # building a snapshot costs ms: only when it may be written
        snapshot = self.snapshot(watcher, now, state)
        assert self.writer is not None  # made by __post_init__
        if force:
            self.writer.force_write(snapshot, now)
            wrote = True
        else:
            wrote = self.writer.maybe_write(snapshot, now)
        if wrote:
            self.last_write = now
            self.dirty = False

    def snapshot(self, watcher: ReportSource, now: float, state: str | None = None) -> StatusSnapshot:
        running = sorted(watcher.jobs.in_state(JobState.RUNNING), key=lambda j: j.order)
        # the next to start, without sorting a 10,000-job queue on every write
        pending = watcher.jobs.pending_head(MAX_LISTED)
        if len(pending) < MAX_LISTED:  # then those held on dependencies (workflows.py)
            pending += watcher.jobs.held(MAX_LISTED - len(pending))
        counts = dict(self.counts)
        counts.update(
            inbox=self.inbox_count,
            awaiting_approval=len(self.awaiting_entries),
            pending=watcher.jobs.count(JobState.PENDING),
            running=len(running),
        )
        listed = (
            [_entry(j, self.root) for j in running]
            + self.awaiting_entries[:MAX_LISTED]
            + [_entry(j, self.root) for j in pending]
            + list(reversed(self.recent.values()))
        )
        self.curves.retain([j.id for j in running] + list(self.recent))
        machine = watcher.probe.sample([self.root.path])
        holdings = [watcher.holding(j) for j in running]
        return StatusSnapshot(
            watcher={
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "version": __version__,
                "state": state or ("stopping" if watcher.stopping else "paused" if watcher.paused else "running"),
                "started_at": iso_utc(self.started_at),
                "heartbeat_at": iso_utc(now),
                "config_loaded_at": iso_utc(watcher.settings.loaded_at),
                "disk_full": watcher.disk_full is not None,
                "problems": watcher.problems(),
                **_containment(watcher.executor),
            },
            counts=counts,
            jobs=tuple(listed),
            resources=resources_dict(machine, holdings),
            ignored=tuple(self.ignored),
            window=watcher.window_now(now),
            cost=watcher.cost_now(now),
        )


def _containment(executor) -> dict:
    """``containment``: how this machine's attempts are held (cgroup-v2, cgroup-v1, process-tree); absent on
    executors that run attempts elsewhere (Slurm contains them with its own proctrack)."""
    mode = getattr(executor, "containment", None)
    return {"containment": mode} if mode else {}


def _entry(job: Job, root: QueueRoot, final: bool = False) -> dict:
    """One status.json job entry, from what the daemon knows (``final``: a finished job's, its progress and story
    with the records written after the last poll: N/N for a resumed job)."""
    run = job.run
    attempt = job.current_attempt() or {}
    readers = job.readers
    progress = merge_progress(readers.metrics.fields, readers.log.fields) if readers is not None else None
    vitals = readers.metrics.vitals if readers is not None else {}
    if vitals:
        progress = {
            **(progress or {}),
            "clip_fraction": vitals.get("clip_fraction"),
            "update_ratio": vitals.get("update_ratio"),
        }
    if final:
        progress = final_progress(progress, job)
    entry: dict[str, Any] = {
        "id": job.id,
        "state": job.state.value,
        "status": run.get("status"),
        "name": run.get("name") or job.id,
        "priority": job.priority,
        "attempt": job.attempt,
        "pid": attempt.get("pid") if job.state is JobState.RUNNING else None,
        "submitted_at": run.get("submitted_at"),
        "started_at": run.get("started_at"),
        "finished_at": run.get("finished_at"),
        # a pending job's gate, or why a launched attempt has not started (Slurm's reason while it queues it)
        "waiting_for": run.get("waiting_for") if job.state in (JobState.PENDING, JobState.RUNNING) else None,
        "health": job.health if job.state is JobState.RUNNING else None,
        "progress": progress,
        "dir": f"{job.state.value}/{job.id}",
        "error": run.get("error"),
        "diagnosis": run.get("diagnosis"),
        "gpus": list(run.get("gpus") or []),
        "pool": job.spec.pool if job.spec is not None else None,
    }
    if readers is not None and readers.metrics.bad_lines:
        entry["metrics_bad_lines"] = readers.metrics.bad_lines
    if job.usage is not None and job.state is JobState.RUNNING:
        entry["usage"] = job.usage
    if job.state in (JobState.DONE, JobState.FAILED):
        entry["outputs"] = _outputs(job, root)
    entry.update(workflow_entry(job))
    entry.update(_wall_entry(job))
    if vitals:
        thresholds = (job.spec.train or {}).get("health") if job.spec is not None and job.spec.train else None
        entry["vitals"] = vitals_words(vitals, thresholds)
    if job.run.get("lr_deviation"):
        entry["vitals"] = "; ".join(filter(None, [entry.get("vitals"), job.run["lr_deviation"].get("words")]))
    entry.update(story_of(job, progress).to_entry())
    return entry


def story_of(job: Job, progress: dict | None) -> JobStory:
    """The job's story (faces/story.py) from its run.json and what the watcher knows live."""
    waiting = job.run.get("waiting_for") if job.state in (JobState.PENDING, JobState.RUNNING) else None
    return derive(
        job.id,
        job.state.value,
        job.run,
        progress=progress,
        health=job.health if job.state is JobState.RUNNING else None,
        waiting_for=waiting,
    )


def _wall_entry(job: Job) -> dict:
    """``deadline``, ``predicted_end`` and ``fits`` of a job planned against a wall (docs/wall.md)."""
    forecast = job.run.get("forecast")
    if job.state is JobState.RUNNING and forecast:
        out = {k: forecast.get(k) for k in ("deadline", "predicted_end", "fits")}
        if forecast.get("words"):
            out["forecast"] = forecast["words"]
        return out
    if job.spec is not None and job.spec.deadline is not None:
        at = job.spec.deadline.resolve(parse_iso(job.run.get("started_at")))
        return {"deadline": iso_utc(at) if at else None, "predicted_end": None, "fits": None}
    return {}


#: how much of a finished job's metrics.jsonl is read for its final progress (bytes)
FINAL_METRICS_BYTES = 16384


#: how much of the end of a never-polled finished job's output.log is read for its bars (bytes)
FINAL_LOG_BYTES = 65536


def _last_look(job: Job) -> None:
    """Read a finished job's output.log to its end: an attempt shorter than the first poll (a resumed one that found
    its work done, a trivial script) printed its progress bar where only this read sees it."""
    readers = job.readers
    if readers is None:
        started = parse_iso((job.current_attempt() or {}).get("started_at"))
        log = LogProgress(job.paths.log, tail_bytes=FINAL_LOG_BYTES)
        readers = job.readers = _Readers(MetricsTail(job.paths.metrics, started), log)
    elif readers.log.path != job.paths.log:
        readers.log.follow(job.paths.log)
    readers.log.poll()


def final_progress(progress: dict | None, job: Job) -> dict | None:
    """A finished job's progress with the records written after the last poll (a short job was never polled)."""
    merged = dict(progress or {})
    for record in read_metrics_tail(job.paths.metrics, FINAL_METRICS_BYTES):
        if record.get("type", "step") in ("step", "eval", "done"):
            merged.update({k: record[k] for k in PROGRESS_KEYS if isinstance(record.get(k), (int, float))})
    if not merged:
        return None
    if job.state is JobState.DONE:
        merged["eta_s"] = 0
    return {k: merged.get(k) for k in PROGRESS_KEYS}


def _outputs(job: Job, root: QueueRoot) -> dict | None:
    """Paths of a finished train job's artifacts that exist (adapter, summary, loss.png)."""
    paths = job.paths
    found = {}
    for key, path in (
        ("adapter", paths.dir / "adapter"),
        ("model", paths.dir / "model"),
        ("summary", paths.summary),
        ("loss_png", paths.loss_png),
    ):
        if exists(path):
            found[key] = str(path.relative_to(root.path))
    return found or None
