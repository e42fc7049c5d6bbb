"""Resource probes: RAM, disk, battery and GPUs (NVML or a simulation file) as plain data.

Nothing here decides; ``admission.py`` turns these numbers into start/wait decisions.

Test switches for machines without a GPU or a battery (both files are re-read whenever their
inode, size or mtime changes; a malformed file logs one warning per change and never crashes):

- watcher setting ``simulate_gpus: FILE`` or env ``TRAINQ_SIMULATE_GPUS``: GPUs come from a JSON
  list instead of NVML, e.g. ``[{"index": 0, "name": "Sim 6GB", "memory_total_mb": 6144,
  "memory_used_mb": 0, "utilization_pct": 0, "processes": [{"pid": 4242, "used_mb": 900}]}]``;
  optional per GPU: ``temperature_c``, ``compute_capability`` ("8.6"); optional per process:
  ``name``. A listed pid counts only while that process exists (a dead or zombie pid is dropped).
  Without ``memory_used_mb`` the used memory is the sum of the live processes' ``used_mb``.
  A malformed or missing file means no GPUs and ``MachineState.gpu_error`` says why.
- env ``TRAINQ_SIMULATE_BATTERY``: a JSON file ``{"percent": 62, "power_plugged": false}``
  replaces ``psutil.sensors_battery()``; a malformed file means "no battery".
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, overload

import psutil

from trainq.watcher.spec.contract import ENV_SIMULATE_GPUS
from trainq.watcher.spec.fsutil import read_kernel_file

logger = logging.getLogger(__name__)

#: env var naming a JSON file that replaces the real battery reading (test switch)
ENV_SIMULATE_BATTERY = "TRAINQ_SIMULATE_BATTERY"
#: bytes per GB and MB as trainq reports them (binary units, like nvidia-smi)
GB = 1024**3
MB = 1024**2
#: seconds a real NVML, disk or battery reading is reused (the watcher samples about once a second)
DEFAULT_CACHE_S = 1.0
#: seconds between scans of the process table for jobs' descendants (a scan reads every /proc/PID/stat)
DEFAULT_TREE_RESCAN_S = 5.0
#: seconds a cached psutil.Process (or a disk reading) is kept after its last use
_FORGET_S = 60.0


#: where Linux says how much memory there is and how much a new process could have
MEMINFO = "/proc/meminfo"


def ram_bytes() -> tuple[int, int]:
    """(total, available) bytes of RAM: MemTotal and MemAvailable of /proc/meminfo, the numbers psutil.virtual_memory
    gives on Linux, read without parsing the other fifty lines (it runs at every plan: a tenth of a millisecond a
    trivial job paid). psutil answers elsewhere, and where MemAvailable is missing or odd (old kernels, containers)."""
    try:
        text = read_kernel_file(MEMINFO)
        total, available = _meminfo_kb(text, b"MemTotal:"), _meminfo_kb(text, b"MemAvailable:")
    except OSError:
        total = available = None
    if total is not None and available is not None and 0 < available <= total:
        return total * 1024, available * 1024
    vm = psutil.virtual_memory()
    return vm.total, vm.available


def _meminfo_kb(text: bytes, key: bytes) -> int | None:
    start = text.find(key)
    if start < 0:
        return None
    fields = text[start + len(key) : text.find(b"\n", start)].split()
    return int(fields[0]) if fields and fields[0].isdigit() else None


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU, as NVML (or the simulation file) lists it."""

    pid: int
    used_mb: float
    name: str | None = None


@dataclass(frozen=True)
class GpuInfo:
    """One GPU; ``index`` is NVML's (PCI bus order, as ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` numbers them)."""

    index: int
    name: str
    memory_total_mb: float
    memory_used_mb: float
    utilization_pct: float | None = None
    temperature_c: float | None = None
    compute_capability: str | None = None
    processes: tuple[GpuProcess, ...] = ()
    simulated: bool = False

    @property
    def memory_free_mb(self) -> float:
        """Measured free memory (for display; admission allocates from its own ledger)."""
        return max(0.0, self.memory_total_mb - self.memory_used_mb)


@dataclass(frozen=True)
class MachineState:
    """One sample of the machine: RAM, disks by path, battery, GPUs.

    ``disks`` maps each sampled path to ``(total_gb, free_gb)`` and ``disk_devices`` maps it to its
    filesystem's ``st_dev``, so two paths on one filesystem share one budget. ``gpu_error`` is set
    when GPUs should exist but could not be read (admission then waits instead of failing jobs).
    """

    ram_total_gb: float
    ram_available_gb: float
    disks: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    battery: Mapping[str, Any] | None = None
    gpus: tuple[GpuInfo, ...] = ()
    disk_devices: Mapping[str, int] = field(default_factory=dict)
    gpu_error: str | None = None


class _WatchedJson:
    """A JSON file parsed again only when its inode, size or mtime changes; errors logged once per change."""

    def __init__(self, path: Path, parse: Callable[[object], Any], what: str):
        self.path = path
        self._parse = parse
        self._what = what
        self._stamp: tuple[int, int, int] | bool | None = False  # False: never looked
        self._value: Any = None
        self._error: str | None = None

    def get(self) -> tuple[Any, str | None]:
        """The parsed value (None on error) and the error in words (None when fine)."""
        stamp = _file_stamp(self.path)
        if stamp != self._stamp:
            self._stamp = stamp
            self._value, self._error = self._load()
            if self._error:
                logger.warning("%s", self._error)
            else:
                logger.info("%s: %s file read", self.path, self._what)
        return self._value, self._error

    def _load(self) -> tuple[Any, str | None]:
        try:
            return self._parse(json.loads(self.path.read_bytes())), None
        except FileNotFoundError:
            return None, f"{self.path}: {self._what} file not found; create it or remove the setting"
        except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return None, f"{self.path}: invalid {self._what} file: {exc}; fix it (it is re-read when saved)"


def _file_stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


@overload
def _number(obj: Mapping, key: str, where: str, *, required: Literal[True], minimum: float = 0.0) -> float: ...
@overload
def _number(obj: Mapping, key: str, where: str, *, required: bool = False, minimum: float = 0.0) -> float | None: ...
def _number(obj: Mapping, key: str, where: str, *, required: bool = False, minimum: float = 0.0) -> float | None:
    """``obj[key]`` as a number >= minimum (None when absent and optional); ValueError naming the field."""
    value = obj.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ValueError(f"{where}.{key}: expected a number >= {minimum:g} (got {value!r})")
    return float(value)


def _object(value: object, where: str) -> Mapping:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object (got {value!r})")
    return value


def _parse_sim_process(raw: object, where: str) -> GpuProcess:
    obj = _object(raw, where)
    pid = obj.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"{where}.pid: expected a positive integer (got {pid!r})")
    name = obj.get("name")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{where}.name: expected a string (got {name!r})")
    return GpuProcess(pid=pid, used_mb=_number(obj, "used_mb", where) or 0.0, name=name)


def _parse_sim_gpu(raw: object, where: str) -> tuple[GpuInfo, bool]:
    """One GPU entry, and whether it gave ``memory_used_mb`` itself."""
    obj = _object(raw, where)
    index = obj.get("index")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"{where}.index: expected an integer >= 0 (got {index!r})")
    name = obj.get("name", f"Simulated GPU {index}")
    cc = obj.get("compute_capability")
    if not isinstance(name, str) or (cc is not None and not isinstance(cc, str)):
        raise ValueError(f"{where}: name and compute_capability must be strings (got {name!r}, {cc!r})")
    procs = obj.get("processes", [])
    if not isinstance(procs, list):
        raise ValueError(f"{where}.processes: expected a list (got {procs!r})")
    gpu = GpuInfo(
        index=index,
        name=name,
        memory_total_mb=_number(obj, "memory_total_mb", where, required=True, minimum=1.0),
        memory_used_mb=_number(obj, "memory_used_mb", where) or 0.0,
        utilization_pct=_number(obj, "utilization_pct", where),
        temperature_c=_number(obj, "temperature_c", where, minimum=-273.0),
        compute_capability=cc,
        processes=tuple(_parse_sim_process(p, f"{where}.processes[{i}]") for i, p in enumerate(procs)),
        simulated=True,
    )
    return gpu, "memory_used_mb" in obj


def parse_simulated_gpus(raw: object) -> tuple[tuple[GpuInfo, bool], ...]:
    """Validate a simulation file's JSON (a list of GPU objects); ValueError naming the bad field."""
    if not isinstance(raw, list):
        raise ValueError(f"expected a JSON list of GPU objects (got {type(raw).__name__})")
    gpus = tuple(_parse_sim_gpu(entry, f"[{i}]") for i, entry in enumerate(raw))
    indexes = [gpu.index for gpu, _ in gpus]
    if len(set(indexes)) != len(indexes):
        raise ValueError(f"GPU indexes must be unique (got {indexes})")
    return tuple(sorted(gpus, key=lambda pair: pair[0].index))


def parse_simulated_battery(raw: object) -> dict:
    """Validate a battery simulation file: ``{"percent": 0-100, "power_plugged": true|false|null}``."""
    obj = _object(raw, "battery")
    percent = _number(obj, "percent", "battery", required=True)
    plugged = obj.get("power_plugged")
    if percent is not None and percent > 100:
        raise ValueError(f"battery.percent: expected 0 to 100 (got {percent:g})")
    if plugged is not None and not isinstance(plugged, bool):
        raise ValueError(f"battery.power_plugged: expected true, false or null (got {plugged!r})")
    return {"percent": percent, "power_plugged": plugged}


def process_name(pid: int) -> str | None:
    """The process's name, or None when it is gone or not ours to read."""
    return _process_state(pid)[1]


def _process_state(pid: int) -> tuple[bool, str | None]:
    """(alive, name) from one read of /proc/PID/stat on Linux; a zombie has already exited."""
    try:
        stat = read_kernel_file(f"/proc/{pid}/stat")
    except FileNotFoundError:
        return False, None
    except OSError:  # no /proc (not Linux) or not readable: ask psutil
        return _psutil_state(pid)
    # "pid (comm) state ...": comm may hold spaces and parentheses, so cut at the last ")"
    close = stat.rfind(b")")
    name = stat[stat.find(b"(") + 1 : close].decode("utf-8", "replace")
    return stat[close + 2 : close + 3] != b"Z", name


def _psutil_state(pid: int) -> tuple[bool, str | None]:
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return proc.status() != psutil.STATUS_ZOMBIE, proc.name()
    except psutil.Error:
        return False, None


def _live_simulated(gpu: GpuInfo, has_used: bool) -> GpuInfo:
    """The GPU with only the processes that exist now, names filled in from the OS."""
    procs = []
    for proc in gpu.processes:
        alive, name = _process_state(proc.pid)
        if alive:
            procs.append(proc if proc.name else replace(proc, name=name))
    used = gpu.memory_used_mb if has_used else sum((p.used_mb for p in procs), 0.0)
    return replace(gpu, processes=tuple(procs), memory_used_mb=used)


class _Nvml:
    """NVML, initialised at most once; a failure to load is remembered so it is not retried every tick."""

    def __init__(self) -> None:
        self._lib: Any = None
        self._tried = False

    def read(self) -> tuple[tuple[GpuInfo, ...], str | None]:
        """Every GPU NVML sees, or no GPUs (with an error only when NVML worked and then failed)."""
        if not self._start():
            return (), None
        nv = self._lib
        try:
            return tuple(self._device(nv, i) for i in range(nv.nvmlDeviceGetCount())), None
        except nv.NVMLError as exc:
            logger.warning("NVML: reading GPUs failed: %s", exc)
            return (), f"NVML failed: {exc}"

    def close(self) -> None:
        """Shut NVML down if it was started; safe to call again."""
        if self._lib is not None:
            try:
                self._lib.nvmlShutdown()
            except self._lib.NVMLError as exc:
                logger.debug("NVML: shutdown failed: %s", exc)
            self._lib = None

    def _start(self) -> bool:
        if self._lib is not None or self._tried:
            return self._lib is not None
        self._tried = True
        try:
            import pynvml  # imported here: only a GPU machine pays for it
        except ImportError:
            logger.info("NVML: pynvml (nvidia-ml-py) not installed: no GPUs")
            return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            logger.info("NVML: no NVIDIA driver library found: no GPUs")
            return False
        except pynvml.NVMLError as exc:
            logger.warning("NVML: initialisation failed (%s): no GPUs until the watcher restarts", exc)
            return False
        self._lib = pynvml
        return True

    @staticmethod
    def _device(nv: Any, index: int) -> GpuInfo:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        mem = nv.nvmlDeviceGetMemoryInfo(handle)
        util = _optional(nv, lambda: float(nv.nvmlDeviceGetUtilizationRates(handle).gpu))
        temp = _optional(nv, lambda: float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)))
        cc = _optional(nv, lambda: "{}.{}".format(*nv.nvmlDeviceGetCudaComputeCapability(handle)))
        procs = _optional(nv, lambda: nv.nvmlDeviceGetComputeRunningProcesses(handle)) or []
        return GpuInfo(
            index=index,
            name=str(nv.nvmlDeviceGetName(handle)),
            memory_total_mb=mem.total / MB,
            memory_used_mb=mem.used / MB,
            utilization_pct=util,
            temperature_c=temp,
            compute_capability=cc,
            # usedGpuMemory is None where the driver cannot tell (WDDM, some containers)
            processes=tuple(GpuProcess(p.pid, (p.usedGpuMemory or 0) / MB, process_name(p.pid)) for p in procs),
        )


def _optional(nv: Any, read: Callable[[], Any]) -> Any:
    """A reading some GPUs do not support (utilisation, temperature, ...): None instead of an error."""
    try:
        return read()
    except nv.NVMLError:
        return None


def _nearest_existing(path: Path) -> Path:
    """The path itself or its closest existing parent (a job's cwd may not exist yet)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path("/")


class ResourceProbe:
    """Samples the machine; cheap enough to call every tick (NVML, disks, battery cached ``cache_s``).

    ``simulate_gpus`` (the watcher setting) wins over env ``TRAINQ_SIMULATE_GPUS``; env
    ``TRAINQ_SIMULATE_BATTERY`` replaces the battery (module docstring). Call ``close()`` at exit.
    """

    def __init__(
        self,
        simulate_gpus: Path | None = None,
        env: Mapping[str, str] = os.environ,
        *,
        cache_s: float = DEFAULT_CACHE_S,
        tree_rescan_s: float = DEFAULT_TREE_RESCAN_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        sim = simulate_gpus or env.get(ENV_SIMULATE_GPUS) or None
        battery = env.get(ENV_SIMULATE_BATTERY) or None
        self._sim_gpus = _WatchedJson(Path(sim), parse_simulated_gpus, "simulate_gpus") if sim else None
        self._sim_battery = (
            _WatchedJson(Path(battery), parse_simulated_battery, "battery simulation") if battery else None
        )
        self._nvml = _Nvml()
        self._cache_s = cache_s
        self._clock = clock
        self._gpu_cache: tuple[float, tuple[GpuInfo, ...], str | None] | None = None
        self._last_gpus: tuple[GpuInfo, ...] | None = None  # what tree_usage attributes GPU memory from
        self._battery_cache: tuple[float, dict | None] | None = None
        self._disk_cache: dict[str, tuple[float, float, float, int]] = {}
        self._procs: dict[int, tuple[psutil.Process, float, float]] = {}  # pid -> (process, used, checked)
        self._children: tuple[float, dict[int, list[int]]] | None = None
        self._tree_rescan_s = tree_rescan_s

    def sample(self, disk_paths: Iterable[Path] = ()) -> MachineState:
        """RAM, the disks holding ``disk_paths`` (queue root, jobs' cwd), battery and GPUs, now."""
        ram_total, ram_available = ram_bytes()
        gpus, gpu_error = self.gpus()
        disks, devices = self._disks(disk_paths)
        return MachineState(
            ram_total_gb=ram_total / GB,
            ram_available_gb=ram_available / GB,
            disks=disks,
            battery=self._battery(),
            gpus=gpus,
            disk_devices=devices,
            gpu_error=gpu_error,
        )

    def gpus(self) -> tuple[tuple[GpuInfo, ...], str | None]:
        """The GPUs and, when they could not be read, why (the simulation file is checked every call)."""
        if self._sim_gpus is not None:
            parsed, error = self._sim_gpus.get()
            gpus = tuple(_live_simulated(gpu, has_used) for gpu, has_used in parsed or ())
        else:
            now = self._clock()
            if self._gpu_cache is None or now - self._gpu_cache[0] >= self._cache_s:
                self._gpu_cache = (now, *self._nvml.read())
            gpus, error = self._gpu_cache[1], self._gpu_cache[2]
        self._last_gpus = gpus
        return gpus, error

    def tree_usage(self, pids: Iterable[int]) -> dict:
        """``{"rss_mb", "cpu_pct", "gpu_memory_mb"}`` of ``pids`` and all their descendants.

        psutil.Process objects are kept per pid, so ``cpu_pct`` is measured since the previous
        call (0.0 the first time a process is seen). GPU memory comes from the latest GPU reading
        (``sample`` first for a fresh one). Descendants come from a process-table scan
        redone every ``tree_rescan_s`` (a new child may be missed until then: a full scan on this
        VM costs ~10 ms).
        """
        now = self._clock()
        tree = self._descendants(pids, now)
        rss = cpu = 0.0
        for pid in tree:
            usage = self._usage(pid, now)
            if usage is not None:
                rss, cpu = rss + usage[0], cpu + usage[1]
        self._procs = {pid: entry for pid, entry in self._procs.items() if now - entry[1] < _FORGET_S}
        gpus = self._last_gpus if self._last_gpus is not None else self.gpus()[0]
        gpu_mb = sum((p.used_mb for gpu in gpus for p in gpu.processes if p.pid in tree), 0.0)
        return {"rss_mb": round(rss / MB, 1), "cpu_pct": round(cpu, 1), "gpu_memory_mb": round(gpu_mb, 1)}

    def close(self) -> None:
        """Release NVML; safe to call more than once."""
        self._nvml.close()
        self._procs.clear()
        self._children = None

    def __enter__(self) -> ResourceProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _descendants(self, roots: Iterable[int], now: float) -> set[int]:
        """``roots`` and every descendant, from a parent map rebuilt every ``tree_rescan_s``."""
        if self._children is None or now - self._children[0] >= self._tree_rescan_s:
            self._children = (now, _children_map())
        children = self._children[1]
        found: set[int] = set()
        todo = list(roots)
        while todo:
            pid = todo.pop()
            if pid not in found:
                found.add(pid)
                todo.extend(children.get(pid, ()))
        return found

    def _usage(self, pid: int, now: float) -> tuple[float, float] | None:
        """(RSS bytes, CPU %) of one process through a Process kept per pid, so CPU % has an interval."""
        entry = self._procs.get(pid)
        try:
            # checking for pid reuse costs a /proc read, so only every tree_rescan_s
            if entry is None or (now - entry[2] >= self._tree_rescan_s and not entry[0].is_running()):
                entry = (psutil.Process(pid), now, now)
            proc = entry[0]
            with proc.oneshot():
                usage = (float(proc.memory_info().rss), proc.cpu_percent(None))
        except psutil.Error:  # gone, a zombie, or not ours to read
            self._procs.pop(pid, None)
            return None
        self._procs[pid] = (proc, now, entry[2])
        return usage

    def _disks(self, paths: Iterable[Path]) -> tuple[dict[str, tuple[float, float]], dict[str, int]]:
        now = self._clock()
        found: dict[str, tuple[float, float, float, int]] = {}
        for path in paths:
            key = str(path)
            entry = self._disk_cache.get(key)
            if entry is None or now - entry[0] >= self._cache_s:
                entry = self._measure_disk(Path(path), now)
            if entry is not None:
                found[key] = entry
        # callers ask for different path sets each tick; forget only paths nobody asked about for a while
        self._disk_cache = {k: e for k, e in self._disk_cache.items() if now - e[0] < _FORGET_S} | found
        return ({k: (e[1], e[2]) for k, e in found.items()}, {k: e[3] for k, e in found.items()})

    @staticmethod
    def _measure_disk(path: Path, now: float) -> tuple[float, float, float, int] | None:
        target = _nearest_existing(path)
        try:
            usage = shutil.disk_usage(target)
            device = os.stat(target).st_dev
        except OSError as exc:
            logger.debug("disk %s: not measurable: %s", path, exc)
            return None
        return (now, usage.total / GB, usage.free / GB, device)

    def _battery(self) -> dict | None:
        if self._sim_battery is not None:
            return self._sim_battery.get()[0]
        now = self._clock()
        if self._battery_cache is None or now - self._battery_cache[0] >= self._cache_s:
            self._battery_cache = (now, _real_battery())
        return self._battery_cache[1]


def _children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids for every process (one /proc/PID/stat read each on Linux)."""
    children: dict[int, list[int]] = {}
    if not os.path.isdir("/proc/self"):
        for proc in psutil.process_iter(["ppid"]):
            children.setdefault(proc.info["ppid"], []).append(proc.pid)
        return children
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = read_kernel_file(f"/proc/{name}/stat")
        except OSError:  # exited while we listed
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        fields = stat[stat.rfind(b")") + 2 :].split(b" ", 2)
        children.setdefault(int(fields[1]), []).append(int(name))
    return children


def _real_battery() -> dict | None:
    try:
        battery = psutil.sensors_battery()
    except (OSError, RuntimeError) as exc:
        logger.debug("battery: not readable: %s", exc)
        return None
    if battery is None:
        return None
    return {"percent": round(float(battery.percent), 1), "power_plugged": battery.power_plugged}
