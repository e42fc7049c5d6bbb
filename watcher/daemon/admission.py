"""Admission: which pending jobs may start now, on which GPUs, and in words why the others wait.

``plan`` is pure (no I/O, no clock): the daemon feeds it a ``MachineState`` from
``ResourceProbe.sample`` and its own ledger of running jobs (``Holding``); tests do the same.

Requests are taken by priority (higher first), then acceptance order, and for each one:

1. A job this machine can never run is ``unsatisfiable`` at once: more GPUs than are scheduled
   here, ``gpu_memory_gb`` above the total of too many GPUs, more RAM than the machine has or more
   disk than its filesystem holds (each less the ``min_free_*`` setting).
2. ``pause.flag`` holds every job.
3. Gates: ``max_concurrent``, battery (unless ``allow_battery``), RAM, disk, GPUs.
4. GPUs come from our own ledger: a GPU is free when no job of ours holds it and the processes
   on it that are not ours use at most ``FOREIGN_SHARE`` of its memory or ``FOREIGN_MAX_MB``,
   whichever is smaller. Measured free memory never places a job (right after a launch it
   double-books the GPU); it only spots foreign processes.
5. RAM and disk are not double-booked either: free = measured − the unused part of what running
   jobs declared (declared − used so far, floored at 0); a job started earlier in the same plan
   subtracts its whole declaration.
6. No starvation (EASY backfilling): the highest-ordered job blocked *only* by GPUs reserves the
   GPUs it will take (free ones first, then ones our jobs hold, then foreign-held ones); later
   jobs may only backfill onto GPUs outside that reservation. Since plan runs every tick and that
   job comes first, it starts as soon as enough GPUs free. A job also blocked by RAM, disk,
   battery or max_concurrent reserves nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainq.watcher.daemon.resources import GpuInfo, GpuProcess, MachineState

logger = logging.getLogger(__name__)

#: a GPU is busy once foreign processes use more than this share of its memory ...
FOREIGN_SHARE = 0.05
#: ... or more than this many MB, whichever is smaller
FOREIGN_MAX_MB = 512.0
#: so the indices in CUDA_VISIBLE_DEVICES mean what NVML's mean
CUDA_ORDER = "PCI_BUS_ID"
#: job names listed in one message before "and N more"
_MAX_NAMES = 5


@dataclass(frozen=True)
class Request:
    """A pending job's needs; ``order`` is its acceptance order (smaller: accepted earlier).

    ``gpus`` None means 1 where the machine has schedulable GPUs, else 0. ``disk_path`` is where
    it writes (its cwd; default the job folder) and must be among the paths given to ``sample``.
    """

    job_id: str
    priority: int = 0
    order: int = 0
    gpus: int | None = None
    gpu_memory_gb: float | None = None
    ram_gb: float = 0.0
    disk_gb: float = 0.0
    allow_battery: bool = False
    disk_path: Path | None = None
    gpus_default: int = 1  # wanted without ``gpus`` where the machine has GPUs (a train job: one per rank)
    pool: str = "default"

    @classmethod
    def from_resources(
        cls, job_id: str, priority: int, order: int, resources: Any, disk_path: Path | None = None
    ) -> Request:
        """Build from a job's ``resources`` (the job file's mapping or an object with those fields)."""

        def get(name: str) -> Any:
            if isinstance(resources, Mapping):
                return resources.get(name)
            return getattr(resources, name, None)

        return cls(
            job_id=job_id,
            priority=priority,
            order=order,
            gpus=get("gpus"),
            gpu_memory_gb=get("gpu_memory_gb"),
            ram_gb=float(get("ram_gb") or 0.0),
            disk_gb=float(get("disk_gb") or 0.0),
            allow_battery=get("allow_battery") is True,
            disk_path=disk_path,
        )


@dataclass(frozen=True)
class Holding:
    """A running job of ours: what it was given and declared, and what it uses so far.

    ``rss_gb``: its tree's RSS (``ResourceProbe.tree_usage(pids)["rss_mb"] / 1024``). ``pids``: its
    process tree, so its own GPU processes are never taken for foreign ones. ``disk_used_gb``: what
    it wrote on ``disk_path`` so far when known (0 keeps all of ``disk_gb`` promised to it).
    """

    job_id: str
    gpus: tuple[int, ...] = ()
    ram_gb: float = 0.0
    disk_gb: float = 0.0
    rss_gb: float = 0.0
    pids: tuple[int, ...] = ()
    disk_path: Path | None = None
    disk_used_gb: float = 0.0
    pool: str = "default"


@dataclass(frozen=True)
class Limits:
    """The watcher settings admission obeys (watcher.yaml) and whether pause.flag is present."""

    max_concurrent: int = 1
    gpu_ids: tuple[int, ...] | None = None
    min_free_ram_gb: float = 0.0
    min_free_disk_gb: float = 0.0
    paused: bool = False
    #: each pool's max_concurrent (``default``: max_concurrent); None: one pool, limited by max_concurrent
    pools: Mapping[str, int] | None = None
    #: pools paused alone (``pause.POOL.flag``)
    paused_pools: frozenset[str] = frozenset()

    def pool_limit(self, pool: str) -> int:
        """How many jobs of ``pool`` may run at once."""
        if self.pools is None:
            return self.max_concurrent
        return self.pools.get(pool, self.max_concurrent if pool == "default" else 0)


@dataclass(frozen=True)
class Decision:
    """Start now on ``gpus`` with ``env`` added to the job's environment, or why not."""

    job_id: str
    start: bool
    gpus: tuple[int, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    waiting_for: str | None = None
    unsatisfiable: str | None = None


@dataclass(frozen=True)
class GpuView:
    """A GPU as admission sees it: which job of ours holds it, which other processes use it."""

    gpu: GpuInfo
    held_by: str | None
    foreign: tuple[GpuProcess, ...]

    @property
    def foreign_mb(self) -> float:
        return sum((p.used_mb for p in self.foreign), 0.0)

    @property
    def is_foreign_busy(self) -> bool:
        return self.foreign_mb > min(FOREIGN_SHARE * self.gpu.memory_total_mb, FOREIGN_MAX_MB)


def gpu_views(machine: MachineState, holdings: list[Holding]) -> dict[int, GpuView]:
    """Every GPU with its holder (our ledger, or one of our processes found on it) and foreign users."""
    holder = {index: h.job_id for h in holdings for index in h.gpus}
    owner = {pid: h.job_id for h in holdings for pid in h.pids}
    views = {}
    for gpu in machine.gpus:
        ours = [owner[p.pid] for p in gpu.processes if p.pid in owner]
        foreign = sorted((p for p in gpu.processes if p.pid not in owner), key=lambda p: (-p.used_mb, p.pid))
        views[gpu.index] = GpuView(gpu, holder.get(gpu.index) or (ours[0] if ours else None), tuple(foreign))
    return views


def plan(
    requests: list[Request],
    holdings: list[Holding],
    machine: MachineState,
    limits: Limits,
    *,
    until_full: bool = False,
    always: frozenset[str] = frozenset(),
) -> list[Decision]:
    """One decision per request, in start order; as many start as fit, never sharing a GPU.

    ``until_full``: once every concurrency slot is taken (nothing further back can start in this plan), only the
    requests named in ``always`` are still decided; the others get no decision, so their ``waiting_for`` stays as
    the last full plan said.
    """
    ledger = _Ledger(machine, holdings, limits)
    decisions = []
    for req in sorted(requests, key=lambda r: (-r.priority, r.order)):
        if until_full and req.job_id not in always and ledger.full():
            continue
        decisions.append(ledger.decide(req))
    return decisions


def gate_report(req: Request, holdings: list[Holding], machine: MachineState, limits: Limits) -> dict[str, str | None]:
    """Each admission gate for one request as if it were first in line: why it holds (None: it passes).

    Keys: ``never`` (this machine can never run it), ``pause``, ``max_concurrent``, ``battery``,
    ``ram``, ``disk``, ``gpus``. For ``trainq why``, which shows every gate, not only the first.
    """
    ledger = _Ledger(machine, holdings, limits)
    n = ledger._gpus_wanted(req)
    usable = [i for i in ledger.gpus if ledger._gpu_problem(i, req) is None]
    return {
        "never": ledger._never_gpus(req, n) or ledger._never_ram(req) or ledger._never_disk(req),
        "pause": "pause.flag is present: no job starts until it is removed" if limits.paused else None,
        "pool": ledger._pool_paused(req),
        "max_concurrent": ledger._concurrency(req),
        "battery": ledger._battery(req),
        "ram": ledger._ram(req),
        "disk": ledger._disk(req),
        "gpus": None if len(usable) >= n else ledger._gpu_words(req, n, len(usable)),
    }


class _Ledger:
    """What is left while plan() walks the queue; each job it starts is subtracted at once."""

    def __init__(self, machine: MachineState, holdings: list[Holding], limits: Limits):
        self.machine = machine
        self.limits = limits
        views = gpu_views(machine, holdings)
        self.gpus = {i: v for i, v in sorted(views.items()) if limits.gpu_ids is None or i in limits.gpu_ids}
        self.held = {i: v.held_by for i, v in self.gpus.items() if v.held_by}
        self.running = [h.job_id for h in holdings]
        self.running_by_pool: dict[str, list[str]] = {}
        for h in holdings:
            self.running_by_pool.setdefault(h.pool, []).append(h.job_id)
        self.ram_promised_gb = sum((max(0.0, h.ram_gb - h.rss_gb) for h in holdings), 0.0)
        self.disk_promised_gb: dict[object, float] = {}
        for h in holdings:
            if h.disk_path is not None and str(h.disk_path) in machine.disks:
                self._promise_disk(h.disk_path, max(0.0, h.disk_gb - h.disk_used_gb))
        self.reserved: tuple[int, ...] = ()
        self.reserver: tuple[Request, int] | None = None

    def full(self) -> bool:
        """Every concurrency slot is taken: no request can start, whatever it asks for."""
        if self.limits.pools is None:
            return len(self.running) >= self.limits.max_concurrent
        limits = {"default": self.limits.pool_limit("default"), **self.limits.pools}
        return all(len(self.running_by_pool.get(pool, ())) >= limit for pool, limit in limits.items())

    def decide(self, req: Request) -> Decision:
        """Start ``req`` if everything it needs is free now, else say why it waits."""
        n = self._gpus_wanted(req)
        never = self._never_gpus(req, n) or self._never_ram(req) or self._never_disk(req)
        if never:
            logger.debug("job %s: unsatisfiable: %s", req.job_id, never)
            return Decision(req.job_id, False, unsatisfiable=never)
        if self.limits.paused:
            return Decision(req.job_id, False, waiting_for="paused (pause.flag)")
        paused_pool = self._pool_paused(req)
        if paused_pool:
            return Decision(req.job_id, False, waiting_for=paused_pool)
        blockers = [b for b in (self._concurrency(req), self._battery(req), self._ram(req), self._disk(req)) if b]
        usable = [i for i in self.gpus if self._gpu_problem(i, req) is None]
        if not blockers and len(usable) >= n:
            return self._start(req, tuple(usable[:n]))
        if len(usable) < n:
            blockers.append(self._gpu_words(req, n, len(usable)))
            if len(blockers) == 1:
                self._reserve(req, n)
        return Decision(req.job_id, False, waiting_for="; ".join(blockers))

    def _start(self, req: Request, gpus: tuple[int, ...]) -> Decision:
        for index in gpus:
            self.held[index] = req.job_id
        self.running.append(req.job_id)
        self.running_by_pool.setdefault(req.pool, []).append(req.job_id)
        self.ram_promised_gb += req.ram_gb
        if req.disk_path is not None and str(req.disk_path) in self.machine.disks:
            self._promise_disk(req.disk_path, req.disk_gb)
        env = {}
        if self.machine.gpus or self.machine.gpu_error:  # with none given, hide every GPU from the job
            env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "CUDA_DEVICE_ORDER": CUDA_ORDER}
        return Decision(req.job_id, True, gpus=gpus, env=env)

    def _gpus_wanted(self, req: Request) -> int:
        if req.gpus is not None:
            return req.gpus
        # an unreadable GPU probe must not start a default job with every GPU visible
        return req.gpus_default if self.gpus or self.machine.gpu_error else 0

    # -- never: this machine cannot run the job at all --

    def _never_gpus(self, req: Request, n: int) -> str | None:
        if n == 0 or self.machine.gpu_error:
            return None
        if n > len(self.gpus):
            where = f"{len(self.gpus)} scheduled here" if self.gpus else "none are scheduled here"
            if len(self.machine.gpus) != len(self.gpus):
                where += f" (watcher.yaml gpus: {list(self.limits.gpu_ids or ())})"
            return f"needs {_count(n, 'GPU')}; {where}"
        need_mb = (req.gpu_memory_gb or 0.0) * 1024
        big = [v for v in self.gpus.values() if v.gpu.memory_total_mb >= need_mb]
        if len(big) >= n:
            return None
        largest = max(v.gpu.memory_total_mb for v in self.gpus.values()) / 1024
        return (
            f"needs {_count(n, 'GPU')} with {req.gpu_memory_gb:g} GB each; {len(big)} here "
            f"{'has' if len(big) == 1 else 'have'} that much (largest {largest:.1f} GB)"
        )

    def _never_ram(self, req: Request) -> str | None:
        usable = self.machine.ram_total_gb - self.limits.min_free_ram_gb
        if req.ram_gb <= usable:
            return None
        keep = _kept("min_free_ram_gb", self.limits.min_free_ram_gb)
        return f"needs {req.ram_gb:g} GB RAM; this machine has {self.machine.ram_total_gb:.1f} GB in all{keep}"

    def _never_disk(self, req: Request) -> str | None:
        measured = self.machine.disks.get(str(req.disk_path)) if req.disk_path is not None else None
        if measured is None or req.disk_gb <= measured[0] - self.limits.min_free_disk_gb:
            return None
        keep = _kept("min_free_disk_gb", self.limits.min_free_disk_gb)
        return (
            f"needs {req.disk_gb:g} GB disk on {req.disk_path}; that filesystem holds {measured[0]:.1f} GB in all{keep}"
        )

    # -- gates: each returns why the job waits, or None --

    def _concurrency(self, req: Request) -> str | None:
        if self.limits.pools is None:
            if len(self.running) < self.limits.max_concurrent:
                return None
            return f"max_concurrent {self.limits.max_concurrent} reached (running: {_names(self.running)})"
        limit = self.limits.pool_limit(req.pool)
        running = self.running_by_pool.get(req.pool, [])
        if len(running) < limit:
            return None
        if not limit:
            return f"pool {req.pool}: not in watcher.yaml pools ({', '.join(sorted(self.limits.pools))})"
        return f"pool {req.pool}: max_concurrent {limit} reached (running: {_names(running)})"

    def _pool_paused(self, req: Request) -> str | None:
        if req.pool not in self.limits.paused_pools:
            return None
        return f"pool {req.pool} paused (pause.{req.pool}.flag; trainq resume --pool {req.pool})"

    def _battery(self, req: Request) -> str | None:
        battery = self.machine.battery
        if req.allow_battery or not battery or battery.get("power_plugged") is not False:
            return None
        percent = battery.get("percent")
        level = f" ({percent:g}%)" if isinstance(percent, (int, float)) else ""
        return f"on battery{level}; set resources.allow_battery: true to allow"

    def _ram(self, req: Request) -> str | None:
        free = self.machine.ram_available_gb - self.ram_promised_gb
        keep = self.limits.min_free_ram_gb
        if req.ram_gb <= free - keep:
            return None
        promised = f" (after {self.ram_promised_gb:.1f} GB promised to running jobs)" if self.ram_promised_gb else ""
        extra = f" + min_free_ram_gb {keep:g}" if keep else ""
        return f"{max(free, 0.0):.1f} GB RAM free{promised}, job needs {req.ram_gb:g} GB{extra}"

    def _disk(self, req: Request) -> str | None:
        if req.disk_path is None:
            return None
        measured = self.machine.disks.get(str(req.disk_path))
        if measured is None:
            if req.disk_gb or self.limits.min_free_disk_gb:
                return f"disk space of {req.disk_path} not measured yet"
            return None
        promised = self.disk_promised_gb.get(self._fs(req.disk_path), 0.0)
        free = measured[1] - promised
        keep = self.limits.min_free_disk_gb
        if req.disk_gb <= free - keep:
            return None
        extra = f" + min_free_disk_gb {keep:g}" if keep else ""
        after = f" (after {promised:.1f} GB promised to running jobs)" if promised else ""
        return f"{max(free, 0.0):.1f} GB disk free on {req.disk_path}{after}, job needs {req.disk_gb:g} GB{extra}"

    def _fs(self, path: Path) -> object:
        """One key per filesystem, so a job's folder and the queue root share one disk budget."""
        return self.machine.disk_devices.get(str(path), str(path))

    def _promise_disk(self, path: Path, gb: float) -> None:
        key = self._fs(path)
        self.disk_promised_gb[key] = self.disk_promised_gb.get(key, 0.0) + gb

    # -- GPUs --

    def _gpu_problem(self, index: int, req: Request) -> str | None:
        """Why GPU ``index`` cannot go to ``req`` now (None: it can); "reserved" is a marker."""
        view = self.gpus[index]
        need_mb = (req.gpu_memory_gb or 0.0) * 1024
        if view.gpu.memory_total_mb < need_mb:
            size = view.gpu.memory_total_mb / 1024
            return f"GPU {index} too small ({size:.1f} GB, job needs {req.gpu_memory_gb:g} GB per GPU)"
        if index in self.held:
            return f"GPU {index} held by job {self.held[index]}"
        if view.is_foreign_busy:
            return f"GPU {index} used by {_foreign_words(view.foreign)}"
        if view.gpu.memory_total_mb - view.foreign_mb < need_mb:
            left = (view.gpu.memory_total_mb - view.foreign_mb) / 1024
            return (
                f"GPU {index} has {left:.1f} GB beside {_foreign_words(view.foreign)}, "
                f"job needs {req.gpu_memory_gb:g} GB per GPU"
            )
        if index in self.reserved and self.reserver is not None and self.reserver[0].job_id != req.job_id:
            return "reserved"
        return None

    def _gpu_words(self, req: Request, n: int, free: int) -> str:
        """Why too few GPUs are free, GPU by GPU, reservations grouped in one clause."""
        if not self.gpus:
            return f"GPUs unavailable: {self.machine.gpu_error}"
        problems = [(i, self._gpu_problem(i, req)) for i in self.gpus]
        words = [p for _, p in problems if p and p != "reserved"]
        reserved = [i for i, p in problems if p == "reserved"]
        if reserved and self.reserver is not None:
            holder, holder_n = self.reserver
            who = "higher-priority job" if holder.priority > req.priority else "earlier job"
            gpus = f"GPU{'s' if len(reserved) > 1 else ''} {', '.join(map(str, reserved))}"
            words.append(f"{gpus} reserved for {who} {holder.job_id} (needs {_count(holder_n, 'GPU')})")
        head = f"needs {n} GPUs, {free} free: " if n > 1 else ""
        return head + "; ".join(words)

    def _reserve(self, req: Request, n: int) -> None:
        """Reserve for the first job blocked only by GPUs the GPUs it will take (docstring rule 6)."""
        if self.reserver is not None:
            return
        need_mb = (req.gpu_memory_gb or 0.0) * 1024
        eligible = [i for i, v in self.gpus.items() if v.gpu.memory_total_mb >= need_mb]

        def rank(index: int) -> tuple[int, int]:
            if self._gpu_problem(index, req) is None:
                return (0, index)
            return (1 if index in self.held else 2, index)

        self.reserved = tuple(sorted(eligible, key=rank)[:n])
        self.reserver = (req, n)
        logger.debug("job %s: reserves GPUs %s", req.job_id, self.reserved)


def _kept(setting: str, gb: float) -> str:
    return f", {setting} keeps {gb:g} GB free" if gb else ""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _names(ids: list[str]) -> str:
    shown = ", ".join(ids[:_MAX_NAMES])
    return shown + (f" and {len(ids) - _MAX_NAMES} more" if len(ids) > _MAX_NAMES else "")


def _foreign_words(procs: tuple[GpuProcess, ...]) -> str:
    """``foreign process 4242 (python, 900 MB)``; several are listed biggest first."""
    if not procs:
        return "no foreign process"
    parts = [f"{p.pid} ({p.name + ', ' if p.name else ''}{p.used_mb:.0f} MB)" for p in procs[:_MAX_NAMES]]
    more = f" and {len(procs) - _MAX_NAMES} more" if len(procs) > _MAX_NAMES else ""
    return f"foreign process{'es' if len(procs) > 1 else ''} {', '.join(parts)}{more}"


def resources_dict(machine: MachineState, holdings: list[Holding]) -> dict:
    """status.json's ``resources``: RAM, disks by path, GPUs (holder and foreign users), battery."""
    views = gpu_views(machine, holdings)
    return {
        "ram": {"total_gb": round(machine.ram_total_gb, 2), "available_gb": round(machine.ram_available_gb, 2)},
        "disk": {
            path: {"total_gb": round(total, 2), "free_gb": round(free, 2)}
            for path, (total, free) in machine.disks.items()
        },
        "gpus": [_gpu_dict(view) for view in views.values()],
        "battery": dict(machine.battery) if machine.battery is not None else None,
    }


def _gpu_dict(view: GpuView) -> dict:
    gpu = view.gpu
    return {
        "index": gpu.index,
        "name": gpu.name,
        "memory_total_mb": round(gpu.memory_total_mb, 1),
        "memory_used_mb": round(gpu.memory_used_mb, 1),
        "memory_free_mb": round(gpu.memory_free_mb, 1),
        "utilization_pct": gpu.utilization_pct,
        "temperature_c": gpu.temperature_c,
        "compute_capability": gpu.compute_capability,
        "held_by": view.held_by,
        "foreign": [{"pid": p.pid, "name": p.name, "used_mb": round(p.used_mb, 1)} for p in view.foreign],
        "simulated": gpu.simulated,
    }
