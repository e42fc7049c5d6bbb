"""How many CPU ranks of a train job a machine without GPUs can hold: its usable cores and its RAM (issue 37).

A train job's ``processes: N`` on a machine without GPUs runs N CPU ranks (gloo). N above the usable cores runs
slower than fewer ranks and, above what RAM holds, ends in the kernel's OOM killer after minutes (taking other
processes with it). So both are refused when the job is accepted (the watcher) and when the ranks start (the
trainer run by hand), each naming the field and the figure; ``train.oversubscribe: true`` allows more ranks than
cores (one warning line when they start), never more than RAM holds.

Also the rules for several ranks and nodes that JSON Schema cannot say (docs/distributed.md): ``rank_problems``
reads the job file alone (processes against the GPUs asked for, fsdp with qlora, srun tasks); ``nodes_problem``
needs the watcher's executor: only Slurm spreads a job over several nodes.

Read from the machine and the model folder only: the affinity mask, the cgroup CPU quota and memory limit,
/proc/meminfo, and the headers of the model's weight files. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainq.watcher.spec.errors import Problem

GIB = 1024**3
#: resident memory of one rank before its model: Python, torch, transformers, peft, tokenizer and data
#: (peak RSS of one rank training the tiny model, measured here 2026-12-03: 0.50 GiB; a floor, not a guess)
RANK_BASE_BYTES = int(0.5 * GIB)
#: bytes per stored value of each safetensors dtype
DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
#: bytes a rank holds per model parameter, by method, with the CPU's fp32 training precision: the weights (lora,
#: dpo), 4-bit NF4 weights (qlora), or fp32 weights + gradients + AdamW's two moments (full)
BYTES_PER_PARAM = {"lora": 4.0, "dpo": 4.0, "qlora": 4.127 / 8, "full": 16.0}
#: same for the 16-bit precisions a job may set on the CPU (full keeps fp32 masters: unchanged)
BYTES_PER_PARAM_16 = {"lora": 2.0, "dpo": 2.0, "qlora": 4.127 / 8, "full": 16.0}
#: the largest safetensors header read (the format's own limit is 100 MB)
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class CpuMachine:
    """The cores and RAM a job's CPU ranks can use on this machine, each with where the figure comes from."""

    cores: int
    cores_from: str
    ram_bytes: int
    ram_from: str

    @classmethod
    def probe(cls) -> CpuMachine:
        """This process's machine, now."""
        cores, cores_from = usable_cores()
        ram, ram_from = usable_ram()
        return cls(cores, cores_from, ram, ram_from)


# -- the machine ---------------------------------------------------------------------------------------------


def usable_cores(proc: Path = Path("/proc/self")) -> tuple[int, str]:
    """Cores this process may run on: its affinity mask, lowered by a cgroup CPU quota (rounded up)."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(proc)
    if quota is not None and math.ceil(quota) < affinity:
        return max(1, math.ceil(quota)), f"the cgroup CPU quota of {quota:g} cores"
    return affinity, "the CPU affinity mask"


def usable_ram(proc: Path = Path("/proc/self"), meminfo: Path = Path("/proc/meminfo")) -> tuple[int, str]:
    """RAM this process may use: MemTotal, lowered by a cgroup memory limit."""
    total = _meminfo_total(meminfo)
    limit = cgroup_memory_limit(proc)
    if limit is not None and limit < total:
        return limit, "the cgroup memory limit"
    return total, "MemTotal"


def _meminfo_total(meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{meminfo}: no MemTotal line")


def _cgroup_dirs(proc: Path, controller: str) -> list[Path]:
    """The folders of this process's cgroup and its ancestors for ``controller`` (v1) and the v2 hierarchy."""
    try:
        membership = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mounts").read_text().splitlines()
    except OSError:
        return []
    found = []
    for mount in mounts:
        fields = mount.split()
        if len(fields) < 4:
            continue
        point, fstype, options = fields[1], fields[2], fields[3].split(",")
        for entry in membership:
            hierarchy, _, rest = entry.partition(":")
            names, _, path = rest.partition(":")
            v2 = fstype == "cgroup2" and hierarchy == "0" and names == ""
            v1 = fstype == "cgroup" and controller in names.split(",") and controller in options
            if v1 or v2:
                found += _ancestors(Path(point), path)
    return found


def _ancestors(mount: Path, path: str) -> list[Path]:
    """mount/path and every folder above it up to the mount (a container may mount its own cgroup as the root)."""
    parts = [p for p in path.split("/") if p]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_quota(proc: Path = Path("/proc/self")) -> float | None:
    """The tightest CPU quota (in cores) over this process's cgroup and its ancestors; None without one."""
    quotas = []
    for folder in _cgroup_dirs(proc, "cpu"):
        v2 = _read(folder / "cpu.max")
        if v2 and not v2.startswith("max"):
            quota, _, period = v2.partition(" ")
            quotas.append(int(quota) / int(period or 100000))
        v1 = _read(folder / "cpu.cfs_quota_us")
        v1_period = _read(folder / "cpu.cfs_period_us")
        if v1 and v1_period and int(v1) > 0:
            quotas.append(int(v1) / int(v1_period))
    return min(quotas) if quotas else None


def cgroup_memory_limit(proc: Path = Path("/proc/self")) -> int | None:
    """The tightest memory limit (bytes) over this process's cgroup and its ancestors; None without one."""
    limits = []
    for folder in _cgroup_dirs(proc, "memory"):
        for name in ("memory.max", "memory.limit_in_bytes"):
            text = _read(folder / name)
            if text and text.isdigit() and int(text) < 2**62:  # v1 writes "no limit" as ~2**63
                limits.append(int(text))
    return min(limits) if limits else None


# -- the model -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Weights:
    """A model folder's parameters, counted from its weight files."""

    params: int
    files: int
    how: str  # "safetensors headers" | "file sizes"


def model_weights(model_dir: Path) -> Weights | None:
    """Parameters of the model in ``model_dir``: the safetensors headers (shapes), else .bin file sizes over the
    config's dtype; None when the folder holds no weight file (the trainer's start-up check names that)."""
    tensors = sorted(model_dir.glob("*.safetensors"))
    if tensors:
        return Weights(sum(_safetensors_params(f) for f in tensors), len(tensors), "safetensors headers")
    pickles = sorted(model_dir.glob("pytorch_model*.bin"))
    if not pickles:
        return None
    stored = _config_dtype_bytes(model_dir)
    return Weights(sum(f.stat().st_size for f in pickles) // stored, len(pickles), "file sizes")


def _safetensors_params(path: Path) -> int:
    """Values in one safetensors file, from its JSON header alone (8-byte length, then the header)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {length} bytes")
        header = json.loads(f.read(length))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def _config_dtype_bytes(model_dir: Path) -> int:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return 4
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return 2 if dtype in ("float16", "bfloat16") else 4


def rank_bytes(method: str, params: int, precision: str = "auto") -> int:
    """What one CPU rank holds at least: the base process and the model as the method trains it (activations,
    which grow with batch_size x seq_len, come on top)."""
    table = BYTES_PER_PARAM_16 if precision in ("bf16", "fp16") else BYTES_PER_PARAM
    return RANK_BASE_BYTES + int(params * table.get(method, BYTES_PER_PARAM["lora"]))


# -- the rule ------------------------------------------------------------------------------------------------


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _gb(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def cores_problem(processes: int, oversubscribe: bool, machine: CpuMachine) -> Problem | None:
    """More ranks than usable cores, without ``train.oversubscribe: true``."""
    if processes <= machine.cores or oversubscribe:
        return None
    return Problem(
        "train.processes",
        f"{processes} CPU ranks but this machine has {machine.cores} usable core"
        f"{'s' if machine.cores != 1 else ''} ({machine.cores_from}) and no GPU; set train.processes: "
        f"{machine.cores} or lower, or train.oversubscribe: true to run more ranks than cores (slower per rank)",
    )


def ram_problem(processes: int, train: dict, model_dir: Path | None, machine: CpuMachine) -> Problem | None:
    """More ranks than RAM holds: processes x (the base process + the model as the method trains it)."""
    if model_dir is None or not model_dir.is_dir():
        return None  # a missing model folder is the trainer's start-up error, named there
    try:
        weights = model_weights(model_dir)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None  # unreadable weights: the trainer's load names the file
    if weights is None:
        return None
    method = str(train.get("method") or "lora")
    per_rank = rank_bytes(method, weights.params, str(train.get("precision") or "auto"))
    need = processes * per_rank
    if need <= machine.ram_bytes:
        return None
    fits = machine.ram_bytes // per_rank
    advice = f"set train.processes: {fits} or lower" if fits > 1 else "set train.processes: 1"
    if fits == 0:
        advice = "not even one rank fits"
    return Problem(
        "train.processes",
        f"{processes} CPU ranks need at least {_gb(need)} of RAM ({processes} x {_gb(per_rank)}: "
        f"{weights.params / 1e6:,.1f} M parameters of {model_dir} ({weights.how}) as method {method} holds them, "
        f"plus ~{_gb(RANK_BASE_BYTES)} per process; activations come on top) but this machine has "
        f"{_gb(machine.ram_bytes)} ({machine.ram_from}); {advice}"
        + (", or use method: lora" if method == "full" else ""),
    )


def cpu_rank_problems(train: object, machine: CpuMachine, model_dir: Path | None) -> list[Problem]:
    """A train block's ``processes`` against a machine without GPUs: cores (unless oversubscribe) and RAM."""
    if not isinstance(train, dict):
        return []
    processes = _int(train.get("processes"))
    if processes is None or processes <= 1:
        return []
    found = [
        cores_problem(processes, train.get("oversubscribe") is True, machine),
        ram_problem(processes, train, model_dir, machine),
    ]
    return [p for p in found if p is not None]


def model_dir_of(train: object, base_dirs: tuple[Path, ...]) -> Path | None:
    """``train.model`` as the trainer resolves it: absolute, else the first base folder where it exists."""
    model = train.get("model") if isinstance(train, dict) else None
    if not isinstance(model, str) or not model:
        return None
    path = Path(os.path.expanduser(model))
    if path.is_absolute():
        return path
    return next((base / path for base in base_dirs if (base / path).exists()), None)


def acceptance_problems(raw: dict, machine_has_gpus: Callable[[], bool], executor: str, job_dir: Path) -> list[Problem]:
    """What the watcher refuses at acceptance: CPU ranks beyond this machine's cores or RAM. Not on a machine with
    GPUs (there ranks are bounded by the GPUs asked for), for a job asking for GPUs, or under Slurm (the job
    runs on another node: its own trainer checks there). ``machine_has_gpus`` is asked only for such a job."""
    train = raw.get("train")
    if not isinstance(train, dict) or (_int(train.get("processes")) or 1) <= 1 or executor == "slurm":
        return []
    found = raw.get("resources")
    resources: dict = found if isinstance(found, dict) else {}
    if (_int(resources.get("gpus")) or 0) > 0 or machine_has_gpus():
        return []
    cwd = raw.get("cwd")
    bases = []
    if isinstance(cwd, str) and cwd:
        cwd = cwd.replace("{job_dir}", str(job_dir)).replace("{job_id}", job_dir.name)
        bases.append((job_dir / os.path.expanduser(cwd)).resolve())
    return cpu_rank_problems(train, CpuMachine.probe(), model_dir_of(train, (*bases, job_dir)))


# -- several ranks and nodes: what the job file alone says ------------------------------------
def rank_problems(data: dict) -> list[Problem]:
    """Problems of a schema-valid job mapping's ``train.processes``/``strategy`` with its ``resources``."""
    train, resources = data.get("train"), data.get("resources")
    if not isinstance(train, dict):
        return []
    resources = resources if isinstance(resources, dict) else {}
    problems = []
    processes = _int(train.get("processes"))
    per_node = _int(resources.get("gpus_per_node"))
    gpus = per_node if per_node is not None else _int(resources.get("gpus"))
    if processes is not None and gpus and processes > gpus:
        field = "resources.gpus_per_node" if per_node is not None else "resources.gpus"
        problems.append(
            Problem(
                "train.processes",
                f"asks for {processes} ranks but {field} is {gpus}: each rank "
                f"trains on its own GPU; ask for {field}: {processes} or lower "
                "train.processes",
            )
        )
    if train.get("strategy") == "fsdp" and train.get("method") == "qlora":
        problems.append(
            Problem(
                "train.strategy",
                "fsdp does not support method: qlora (4-bit weights are not "
                "sharded); use strategy: ddp with qlora, or method: full with fsdp",
            )
        )
    tasks = _int(resources.get("tasks_per_node"))
    if tasks is not None and tasks > 1:
        problems.append(
            Problem(
                "resources.tasks_per_node",
                f"is {tasks}, but a train job runs one torchrun per node "
                "that starts the ranks itself; set train.processes "
                "for the ranks on each node and leave tasks_per_node out",
            )
        )
    return problems


def nodes_problem(data: dict, executor: str) -> Problem | None:
    """``resources.nodes`` above 1 on an executor that runs every job on this one machine."""
    resources = data.get("resources")
    nodes = _int(resources.get("nodes")) if isinstance(resources, dict) else None
    if nodes is None or nodes <= 1 or executor == "slurm":
        return None
    return Problem(
        "resources.nodes",
        f"is {nodes}, but this watcher's executor is {executor}: it runs a job on this "
        "one machine; set executor: slurm in watcher.yaml or ask for nodes: 1",
    )


def default_gpus(data: dict) -> int:
    """GPUs a job gets without ``resources.gpus`` on a machine that has GPUs: one per rank of a train job with
    ``train.processes`` (each rank trains on its own GPU), else 1."""
    train = data.get("train")
    processes = _int(train.get("processes")) if isinstance(train, dict) else None
    return processes if processes is not None and processes > 0 else 1
