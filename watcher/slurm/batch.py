"""What a Slurm batch job is made of: its sbatch options, its environment and its script (pure functions).

``SlurmOptions`` turns an attempt's settings into ``sbatch`` argv; ``batch_env`` decides which of the
watcher's variables reach the node (Slurm's own always win there); ``batch_script`` and ``array_script``
write ``slurm.sh`` for one job or for a sweep's job array; ``srun_argv`` wraps a multi-node command.
executor.py (with submitting.py and polling.py) submits and follows the jobs; nothing here runs a command or touches the disk.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from trainq.watcher.slurm.ranks import RANK_EXIT_SH
from trainq.watcher.slurm.state import EXIT_NOT_SHARED
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.interpreter import safe_module_argv

#: seconds added to timeout + stop_grace + kill_after for --time, so trainq's own timeout path runs first
TIME_LIMIT_MARGIN_S = 60.0
#: the least warning --signal gives before the time limit (s): slurmctld checks time limits every 30 s
SIGNAL_MIN_LEAD_S = 60
#: the largest share of the time limit the warning may take: --time=2 with a 125 s lead would stop every attempt at
#: once; capped at half, the job runs at least half its limit (1 minute of --time=2) before it is warned
SIGNAL_MAX_LEAD_FRACTION = 0.5
#: how much earlier than --signal's lead Slurm may send the warning (s): measured 7.5-23.8 s into a 60 s job
SIGNAL_EARLY_S = 60
#: the signal Slurm sends the batch job's supervisor before the time limit (it stops the job like a timeout)
TIME_LIMIT_SIGNAL = "USR1"
#: set by slurm.sh's first line when the time-limit warning came while the shell still ran (before the supervisor
#: existed): the time it came (epoch seconds); the node side hands it on to the supervisor's handler
EARLY_WARNING_ENV = "TRAINQ_SLURM_WARNED_AT"
#: slurm.sh's first line: Slurm may send the warning (--signal=B:USR1@lead) up to 60 s early, so at once; USR1's
#: default action would kill the batch job before the supervisor's handler exists (Slurm: FAILED/JobLaunchFailure)
EARLY_WARNING_TRAP = f"unset {EARLY_WARNING_ENV}; trap 'export {EARLY_WARNING_ENV}=$(date +%s.%N)' {TIME_LIMIT_SIGNAL}"
#: variables trainq itself sets for every job (GPU numbering that matches NVML's)
TRAINQ_OWNED_ENV = ("CUDA_DEVICE_ORDER",)
#: variables Slurm sets on the node for the job's allocation: the watcher's values never replace them
NODE_OWNED_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "TMPDIR",
    "HOSTNAME",
    "HOME",
    "USER",
    "LOGNAME",
    "PWD",
    "SHELL",
)
#: the watcher variables a batch job starts from (with every LC_*) under slurm.node_env "clean" (the default), besides
#: what Slurm sets itself; "login" asks Slurm for the node's login environment with ``--export=NONE`` instead, which
#: makes slurmd run a login shell (``su - USER``) before every batch job: measured on the test cluster, a burst of 100
#: trivial jobs took 40 s that way against 24 s for bare ``sbatch --wrap`` (docs/slurm.md, "Environment")
CLEAN_BASE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ")
#: the variables sbatch itself reads (its configuration, its option defaults); they reach the node with the base
SBATCH_OWN_ENV = ("SLURM_CONF", "SLURM_CLUSTERS")
#: per-task rendezvous variables for multi-node jobs, from Slurm's own (torchrun reads MASTER_ADDR/PORT, NODE_RANK)
RENDEZVOUS_SH = (
    'MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}; '
    "export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))} "
    "WORLD_SIZE=$SLURM_NTASKS RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID NODE_RANK=$SLURM_NODEID "
    "NNODES=$SLURM_NNODES LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE; " + RANK_EXIT_SH
)


@dataclass(frozen=True)
class SlurmOptions:
    """The sbatch options of one attempt, before they become argv."""

    job_name: str
    partition: str | None
    gpus: int
    mem_mb: int | None
    time_min: int | None
    chdir: str
    output: str
    extra: tuple[str, ...]
    comment: str = ""
    signal_lead_s: int = SIGNAL_MIN_LEAD_S
    requeue: bool = False
    nodes: int = 1
    tasks_per_node: int = 1
    array: str | None = None
    node_env: str = "clean"
    time_from: str = ""  # where the time limit comes from, in words (time_limit_source), for a timeout's evidence

    def argv(self, script: Path) -> list[str]:
        """``sbatch --parsable ...`` for ``script``; extra args last, so watcher.yaml and job file win."""
        argv = [
            "sbatch",
            "--parsable",
            "--requeue" if self.requeue else "--no-requeue",
            "--export=NONE" if self.node_env == "login" else "--export=ALL",
            f"--job-name={self.job_name}",
            f"--comment={self.comment}",
            f"--output={self.output}",
            f"--chdir={self.chdir}",
            f"--signal=B:{TIME_LIMIT_SIGNAL}@{self.signal_lead_s}",
        ]
        if self.array:
            argv.append(f"--array={self.array}")
        if self.partition:
            argv.append(f"--partition={self.partition}")
        if self.nodes > 1 or self.tasks_per_node > 1:
            argv += [f"--nodes={self.nodes}", f"--ntasks-per-node={self.tasks_per_node}"]
        if self.gpus:
            argv.append(f"--gres=gpu:{self.gpus}")
        if self.mem_mb:
            argv.append(f"--mem={self.mem_mb}M")
        if self.time_min:
            argv.append(f"--time={self.time_min}")
        return argv + list(self.extra) + [str(script)]

    def shared(self) -> SlurmOptions:
        """What jobs must have in common to be one job array: everything but their names, tags and folders."""
        return dataclasses.replace(self, job_name="", comment="", output="", chdir="", array=None)


def batch_env(
    env: dict[str, str], keep: frozenset[str] | set[str] = frozenset(), node_env: str = "clean"
) -> dict[str, str]:
    """What the node's supervisor adds to the batch job's environment (launch.json): TRAINQ_* and the ``keep`` names
    (the job's own ``env`` and watcher.yaml's ``env_passthrough``), and with ``node_env`` "clean" the base names
    too (PATH with the watcher's interpreter first, LANG, LC_*, TZ: as a local job gets them); never SLURM_* nor
    what Slurm sets for the allocation on the node (HOME, USER, TMPDIR, the GPUs... unless the job names them)."""
    out = {}
    for key, value in env.items():
        if key.startswith("SLURM_") or (key in NODE_OWNED_ENV and key not in keep) or key == "CUDA_VISIBLE_DEVICES":
            continue
        base = node_env == "clean" and _in_base(key)
        if key.startswith("TRAINQ_") or key in keep or key in TRAINQ_OWNED_ENV or base:
            out[key] = value
    return out


def _in_base(key: str) -> bool:
    return key in CLEAN_BASE_ENV or key.startswith("LC_")


def sbatch_env(env: dict[str, str], node_env: str = "clean") -> dict[str, str]:
    """The environment sbatch runs with. With ``--export=ALL`` ("clean") it is the batch job's starting environment
    on the node, so it holds only the base (PATH, HOME, USER, LOGNAME, SHELL, LANG, LANGUAGE, LC_*, TZ) and what
    sbatch reads itself (SLURM_CONF, SLURM_CLUSTERS, SBATCH_*): never the watcher's secrets, its TMPDIR, its GPU
    choice or the SLURM_* of an allocation the watcher may run in. With ``--export=NONE`` ("login") nothing of it
    reaches the node, and sbatch gets the watcher's environment as it is."""
    if node_env == "login":
        return dict(env)
    return {k: v for k, v in env.items() if _in_base(k) or k in SBATCH_OWN_ENV or k.startswith("SBATCH_")}


def time_limit_min(timeout_s: float | None, stop_grace_s: float, kill_after_s: float) -> int | None:
    """sbatch --time in whole minutes (Slurm's minimum is 1), long enough for trainq's own timeout path to finish."""
    if timeout_s is None:
        return None
    return max(1, math.ceil((timeout_s + stop_grace_s + kill_after_s + TIME_LIMIT_MARGIN_S) / 60))


def signal_lead_s(stop_grace_s: float, kill_after_s: float, time_min: float | None = None) -> int:
    """--signal's lead before the time limit: the stop grace plus the kill delay, at least SIGNAL_MIN_LEAD_S, and
    at most SIGNAL_MAX_LEAD_FRACTION of the time limit (``time_min``), so a short limit still lets the job run."""
    lead = min(65535, max(SIGNAL_MIN_LEAD_S, math.ceil(stop_grace_s + kill_after_s)))
    if time_min:
        lead = min(lead, max(1, math.floor(time_min * 60 * SIGNAL_MAX_LEAD_FRACTION)))
    return lead


def short_limit_warning(time_from: str, limit_min: float | None, lead_s: int) -> str | None:
    """A line for output.log when Slurm's time limit is so short that its warning may come at once (the limit is at
    most the lead plus SIGNAL_EARLY_S); None otherwise."""
    if not limit_min or limit_min * 60 > lead_s + SIGNAL_EARLY_S:
        return None
    enough = math.floor((lead_s + SIGNAL_EARLY_S) / 60) + 1
    return (
        f"trainq: Slurm's time limit ({time_from}) is {limit_min * 60:g} s, and Slurm may send its warning "
        f"(--signal=B:{TIME_LIMIT_SIGNAL}@{lead_s}) up to {SIGNAL_EARLY_S} s early: from the job's first second on, "
        f"so it may be stopped as a timeout at once; ask for at least --time={enough} for a run of any length"
    )


def effective_time_min(time_min: int | None, extra: tuple[str, ...]) -> float | None:
    """The time limit sbatch will apply, in minutes: the last ``--time``/``-t`` in ``extra`` (watcher.yaml's and
    the job's sbatch_args come after trainq's own), else ``time_min``."""
    value = last_time_arg(extra)
    return time_min if value is None else slurm_minutes(value)


def last_time_arg(args: tuple[str, ...]) -> str | None:
    """The value of the last ``--time``/``-t`` in ``args`` (what sbatch applies), or None."""
    found = None
    for i, arg in enumerate(args):
        if arg.startswith("--time="):
            found = arg.partition("=")[2]
        elif arg in ("--time", "-t") and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith("-t") and len(arg) > 2:
            found = arg[2:]
    return found


def time_limit_source(
    time_min: int | None, timeout_s: float | None, watcher_args: tuple[str, ...], job_args: tuple[str, ...]
) -> str:
    """Where the Slurm time limit of a submission comes from, in words a timeout's evidence can quote."""
    for args, where in (
        (job_args, "the job file's slurm.sbatch_args"),
        (watcher_args, "watcher.yaml's slurm.sbatch_args"),
    ):
        value = last_time_arg(args)
        if value is not None:
            return f"--time={value} from {where}"
    if time_min:
        return f"--time={time_min} that trainq derived from the job's timeout ({timeout_s:g} s, plus stop_grace and a margin)"
    return "the partition's default time limit (no --time in sbatch's options; scontrol show partition says it)"


def slurm_minutes(value: str) -> float | None:
    """Slurm's time formats in minutes: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; None for UNLIMITED or what is not one."""
    days, _, rest = value.strip().rpartition("-") if "-" in value else ("", "", value.strip())
    try:
        parts = [float(x) for x in rest.split(":")] if rest else []
        d = float(days) if days else 0.0
    except ValueError:
        return None
    if not parts or len(parts) > 3:
        return None
    if days:
        h, m, sec = ([*parts, 0.0, 0.0])[:3]
    elif len(parts) == 3:
        h, m, sec = parts
    else:
        h, m, sec = 0.0, parts[0], (parts[1] if len(parts) == 2 else 0.0)
    return d * 1440 + h * 60 + m + sec / 60


def srun_argv(argv: tuple[str, ...], tasks: int) -> tuple[str, ...]:
    """The command under srun: ``tasks`` tasks over the allocation, each with its rendezvous variables."""
    return (
        "srun",
        "--export=ALL",
        f"--ntasks={tasks}",
        "--kill-on-bad-exit=1",
        "sh",
        "-c",
        RENDEZVOUS_SH,
        "trainq-task",
        *argv,
    )


def batch_script(
    paths: JobPaths, attempt: int, argv: list[str], python: str, package_parent: str, heartbeat_s: float | None = None
) -> str:
    """slurm.sh: check the job folder is visible on the node, then exec the node side of the attempt."""
    return f"""#!/bin/sh
{EARLY_WARNING_TRAP}
# trainq job {paths.dir.name}, attempt {attempt}: written by the watcher and submitted with
#   {shlex.join(argv)}
# It runs the attempt's supervisor, which writes output.log, supervisor.json, heartbeat.json and exit.json in the
# job folder.
JOB_DIR={shlex.quote(str(paths.dir))}
{_node_side(attempt, python, package_parent, heartbeat_s)}"""


def array_script(
    running: Path,
    sweep_id: str,
    attempt: int,
    argv: list[str],
    python: str,
    package_parent: str,
    heartbeat_s: float | None = None,
) -> str:
    """The script of a sweep's job array: task ``i`` runs attempt ``attempt`` of job ``<sweep>-i``."""
    return f"""#!/bin/sh
{EARLY_WARNING_TRAP}
# trainq sweep {sweep_id}, attempt {attempt} of its jobs as one Slurm job array: written by the watcher and
# submitted with
#   {shlex.join(argv)}
# Task i runs job {sweep_id}-i's supervisor, which writes output.log, supervisor.json, heartbeat.json and
# exit.json in that job's folder.
JOB_DIR={shlex.quote(str(running / sweep_id) + "-")}"$SLURM_ARRAY_TASK_ID"
{_node_side(attempt, python, package_parent, heartbeat_s)}"""


def _node_side(attempt: int, python: str, package_parent: str, heartbeat_s: float | None = None) -> str:
    """The part of slurm.sh after JOB_DIR: the shared-filesystem check, then the node side of the attempt."""
    q = shlex.quote
    beat = f" --heartbeat-s {heartbeat_s:g}" if heartbeat_s else ""
    node_side = shlex.join(safe_module_argv(python, "trainq.watcher.slurm.node"))
    return f"""if [ ! -r "$JOB_DIR/{JobPaths(Path()).launch_spec.name}" ]; then
  echo "trainq: job folder $JOB_DIR is not visible on Slurm node $(hostname): the queue root must be on a shared \\
filesystem that the watcher's machine and every node mount at the same path (NFS, Lustre, ...)" >&2
  exit {EXIT_NOT_SHARED}
fi
PYTHONPATH={q(package_parent)}${{PYTHONPATH:+:$PYTHONPATH}}
export PYTHONPATH
# the trap holds the warning up to exec; env (coreutils 8.31+) then blocks it for Python, so one that comes before
# the supervisor's handler exists waits for it (only in env's first instructions would it still end the job, as
# in slurmstepd's launch: the watcher then records the warning as what it is)
if env --block-signal={TIME_LIMIT_SIGNAL} true 2>/dev/null; then
  exec env --block-signal={TIME_LIMIT_SIGNAL} {node_side} "$JOB_DIR" --attempt {attempt}{beat}
fi
# an older env: ignored instead (an ignored signal stays ignored across exec), so one during Python's start-up is
# lost rather than fatal, and Slurm's own limit ends the job later
trap '' {TIME_LIMIT_SIGNAL}
exec {node_side} "$JOB_DIR" --attempt {attempt}{beat}
"""
