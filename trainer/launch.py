"""Start a train job's ranks under torchrun and, when one fails, say which rank and why.

``python -m trainq.trainer JOB_DIR`` comes here first. With one process on one node it trains in this
process. Otherwise this process becomes the node's torchrun agent: ``torch.distributed.run`` runs in-process
(the same code as ``python -m torch.distributed.run``), starts ``processes`` ranks of ``python -m
trainq.trainer JOB_DIR`` with every line of their output prefixed ``[rank N]`` into output.log, watches them
every 0.1 s and stops the rest when one dies. What this module adds is the report: the failed rank, its
exit code or signal and its last line, as one log line and one metrics event the watcher's diagnosis reads.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from trainq.trainer.config import ConfigError, load_config
from trainq.trainer.distributed import (
    JOINED_MARK,
    NEVER_JOINED,
    World,
    check_strategy,
    processes_per_node,
    visible_gpus,
)
from trainq.watcher.spec.capacity import CpuMachine, cpu_rank_problems
from trainq.watcher.spec.contract import (
    ENV_METRICS,
    EVENT_RANK_FAILED,
    EXIT_DATA,
    EXIT_FAILED,
    EXIT_NAN,
    EXIT_OK,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_STARTUP,
    EXIT_USAGE,
    JobPaths,
)

#: torchrun's prefix for every line a rank prints (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE; ${rank} is the global rank)
RANK_PREFIX_TEMPLATE = "[rank ${rank}] "
#: torchrun keeps each rank's own stdout/stderr here while the job runs (removed at the end)
LOG_DIR_NAME = ".torchrun"
#: seconds torchrun polls its ranks (a dead rank is noticed this fast)
MONITOR_INTERVAL_S = 0.1
#: seconds torchrun waits after SIGTERM before it SIGKILLs a rank (torch's own default; TORCH_ELASTIC_SHUTDOWN_TIMEOUT)
SHUTDOWN_TIMEOUT_S = 30
#: exit codes the trainer chooses itself: the rank has already said why (a metrics event and a last line)
_TRAINER_CODES = {
    EXIT_OOM: "oom",
    EXIT_NAN: "nan",
    EXIT_DATA: "data",
    EXIT_USAGE: "unknown",
    EXIT_PREEMPTED: "preempted",
}


@dataclass(frozen=True)
class Plan:
    """How many ranks this node runs and how the nodes meet (Slurm's rendezvous variables)."""

    processes: int
    nodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: str | None = None
    oversubscribed: str | None = None  # the warning when CPU ranks outnumber the usable cores (oversubscribe: true)

    @property
    def world_size(self) -> int:
        return self.processes * self.nodes


def plan(job_dir: Path) -> Plan | None:
    """The ranks to start for this job, or None to train in this process (one rank, or already a rank)."""
    if World.from_env().is_distributed or os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    config = load_config(job_dir)
    spec = str(job_dir / "job.yaml")
    gpus = visible_gpus()
    check_strategy(config, spec, gpus)
    processes = processes_per_node(config, gpus, spec)
    nodes = int(os.environ.get("NNODES") or os.environ.get("SLURM_NNODES") or 1)
    if processes == 1 and nodes == 1:
        return None
    warning = None if gpus else check_cpu_ranks(config, processes, spec)
    if nodes == 1:
        return Plan(processes, oversubscribed=warning)
    return Plan(
        processes,
        nodes,
        int(os.environ.get("NODE_RANK") or os.environ.get("SLURM_NODEID") or 0),
        os.environ.get("MASTER_ADDR"),
        os.environ.get("MASTER_PORT"),
        oversubscribed=warning,
    )


def check_cpu_ranks(config, processes: int, spec: str) -> str | None:
    """CPU ranks within this machine's cores (unless train.oversubscribe) and RAM, as the watcher checks them at
    acceptance (a run by hand, or another machine, gets the same refusal); the warning line when oversubscribed."""
    block = {
        "processes": processes,
        "oversubscribe": config.oversubscribe,
        "method": config.method,
        "precision": config.precision,
    }
    machine = CpuMachine.probe()
    problems = cpu_rank_problems(block, machine, Path(config.model))
    if problems:
        raise ConfigError(f"{spec}: {problems[0].path}: {problems[0].message}")
    if processes <= machine.cores:
        return None
    return (
        f"{processes} CPU ranks on {machine.cores} usable core{'s' if machine.cores != 1 else ''} "
        f"({machine.cores_from}; train.oversubscribe: true): the ranks share cores, each step is slower than "
        f"with {machine.cores} rank{'s' if machine.cores != 1 else ''}"
    )


def torchrun_argv(plan: Plan, log_dir: Path, trainer_argv: list[str]) -> list[str]:
    """torchrun's command line (after ``torchrun``): one node standalone, or static rendezvous at rank 0's node."""
    if plan.nodes == 1:
        where = ["--standalone", "--nnodes", "1"]
    else:
        where = [
            "--nnodes",
            str(plan.nodes),
            "--node-rank",
            str(plan.node_rank),
            "--rdzv-backend",
            "static",
            "--master-addr",
            plan.master_addr or "127.0.0.1",
            "--master-port",
            plan.master_port or "29500",
        ]
    return [
        *where,
        "--nproc-per-node",
        str(plan.processes),
        "--max-restarts",
        "0",
        "--monitor-interval",
        str(MONITOR_INTERVAL_S),
        "--tee",
        "3",
        "--log-dir",
        str(log_dir),
        "--module",
        "trainq.trainer",
        *trainer_argv,
    ]


def _threads_per_rank(processes: int) -> str:
    """CPU ranks share the cores: OMP_NUM_THREADS = cores // ranks (at least 1)."""
    return str(max(1, (os.cpu_count() or 1) // processes))


def launch(plan: Plan, job_dir: Path, trainer_argv: list[str]) -> int:
    """Run the ranks under torchrun; the job's exit code (0, 143 after SIGTERM, the failed rank's otherwise)."""
    job_dir = job_dir.resolve()
    log_dir = job_dir / LOG_DIR_NAME / f"node-{plan.node_rank}"  # nodes share the job folder
    shutil.rmtree(log_dir, ignore_errors=True)
    os.environ.setdefault("OMP_NUM_THREADS", _threads_per_rank(plan.processes))
    os.environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = RANK_PREFIX_TEMPLATE
    os.environ["PYTHONSAFEPATH"] = (
        "1"  # the ranks run `python -u -m trainq.trainer` in the job's cwd: keep it off sys.path
    )
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    for stream in (sys.stdout, sys.stderr):
        cast(io.TextIOWrapper, stream).reconfigure(
            line_buffering=True
        )  # torchrun copies the ranks' lines into output.log as they come
    print(
        f"trainq: starting {plan.processes} ranks on node {plan.node_rank} of {plan.nodes} under torchrun "
        f"(world size {plan.world_size}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})",
        flush=True,
    )
    if plan.oversubscribed:
        warn_oversubscribed(plan.oversubscribed, job_dir)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _honour_shutdown_timeout()
    try:
        run(parse_args(torchrun_argv(plan, log_dir, [str(job_dir), *trainer_argv])))
    except ChildFailedError as exc:
        return report_failure(exc.failures, log_dir, job_dir)
    except SignalException as exc:
        print(f"trainq: torchrun got {exc.sigval.name}; the ranks checkpointed and stopped", flush=True)
        return EXIT_PREEMPTED if exc.sigval == signal.SIGTERM else 128 + int(exc.sigval)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
        _remove_if_empty(log_dir.parent)
    return EXIT_OK


def warn_oversubscribed(words: str, job_dir: Path) -> None:
    """The one warning of an oversubscribed start: a line in output.log and an ``oversubscribe`` event."""
    from trainq.trainer.metrics import MetricsWriter

    print(f"trainq: warning: {words}", flush=True)
    metrics = MetricsWriter(Path(os.environ.get(ENV_METRICS) or JobPaths(job_dir).metrics))
    metrics.event("oversubscribe", words)
    metrics.close()


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # another node's ranks still log there, or it is gone


def _honour_shutdown_timeout() -> None:
    """torch 2.13 stops the remaining ranks after a failure with a fixed 30 s grace (``SubprocessContext._poll`` and
    the agent's ``_stop_workers`` call ``close()`` without the configured ``shutdown_timeout``); a SIGSTOPped rank
    ignores SIGTERM, so those 30 s were added to every hung-rank failure. Cap every close at the configured
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, as torch's SIGTERM path already does."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    original = PContext.__dict__.get("close")
    if original is None or getattr(original, "trainq_capped", False):
        return
    limit_s = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or SHUTDOWN_TIMEOUT_S)

    def close(self, death_sig=None, timeout: int = SHUTDOWN_TIMEOUT_S) -> None:
        original(self, death_sig, min(timeout, limit_s))

    close.trainq_capped = True  # type: ignore[attr-defined]  # a mark on the function: capped once
    PContext.close = close


def _root_cause(failures: dict) -> tuple[int, Any]:
    """The failure that explains the others: a rank killed by a signal, then one with a trainer exit code,
    then the earliest; a rank that merely lost its peer (exit 1) is a consequence, and so is one ended by SIGTERM
    (torchrun stops the remaining ranks with SIGTERM once one has failed; a rank's own SIGTERM is exit 143)."""

    def weight(item: tuple[int, Any]) -> tuple:
        rank, failure = item
        code = failure.exitcode
        order = 3 if code == -signal.SIGTERM else 0 if code < 0 else 1 if code in _TRAINER_CODES else 2
        return (order, failure.timestamp, rank)

    return min(failures.items(), key=weight)


def never_joined(lines: dict[int, str | None]) -> tuple[list[int], str] | None:
    """The ranks that never joined the group, and the evidence, from the ranks' last lines (distributed.join)."""
    for rank in sorted(lines):
        found = NEVER_JOINED.search(lines[rank] or "")
        if not found:
            continue
        missing = [int(r) for r in found["ranks"].replace(",", " ").split()]
        names = ", ".join(map(str, missing))
        theirs = "; ".join(f"[rank {r}] {lines[r]}" for r in missing if lines.get(r))
        evidence = (
            f"rank{'s' if len(missing) != 1 else ''} {names} never joined the group within {found['seconds']} s "
            f"of start-up (TRAINQ_RENDEZVOUS_TIMEOUT_S); rank {rank} gave up waiting"
            + (f"; last line: {theirs}" if theirs else "")
        )
        return missing, evidence
    return None


def has_joined(log_dir: Path, local_rank: int) -> bool:
    """Whether this node's rank ``local_rank`` joined the group (distributed.mark_joined)."""
    return any(log_dir.glob(f"*/attempt_*/{local_rank}/{JOINED_MARK}"))


def last_line(log_dir: Path, local_rank: int) -> str | None:
    """The last non-empty line a rank printed (its stderr first: tracebacks end there), from torchrun's copy."""
    for name in ("stderr.log", "stdout.log"):
        files = sorted(log_dir.glob(f"*/attempt_*/{local_rank}/{name}"), key=lambda p: p.stat().st_mtime)
        for path in reversed(files):
            lines = [ln.strip() for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
            if lines:
                return lines[-1]
    return None


def describe(rank: int, failure: Any, line: str | None, timed_out: str | None = None) -> tuple[str, str]:
    """(diagnosis kind, evidence) of a failed rank; ``timed_out``: another rank's line saying it gave up waiting."""
    code = failure.exitcode
    said = f"; its last line: [rank {rank}] {line}" if line else ""
    who = f"rank {rank} (pid {failure.pid} on {socket.gethostname()})"  # the node: several share one job folder
    if code == -signal.SIGKILL and timed_out:  # the hung rank: the others timed out, then torchrun killed it
        return "stalled", f"{who} stopped answering: {timed_out}; torchrun then killed it"
    if code == -signal.SIGTERM:  # only when no other rank failed first: torchrun ends the rest with SIGTERM
        return "unknown", f"{who} was ended by SIGTERM before it could checkpoint{said}"
    if code < 0:
        name = failure.signal_name()
        kind = "killed" if -code == signal.SIGKILL else "unknown"
        return kind, f"{who} was killed by {name}{said}"
    if line and _is_timeout(line):
        return "stalled", f"{who} gave up waiting for the other ranks in a collective (a rank stopped answering){said}"
    return _TRAINER_CODES.get(code, "unknown"), f"{who} exited with code {code}{said}"


def _is_timeout(line: str) -> bool:
    """A collective gave up waiting (gloo: "Timed out waiting 5000ms for recv"; nccl: "Watchdog caught collective
    operation timeout")."""
    return "timed out" in line.lower() or "timeout" in line.lower()


def report_failure(failures: dict, log_dir: Path, job_dir: Path) -> int:
    """One stderr line and one metrics event naming the failed rank; returns the job's exit code."""
    lines = {r: last_line(log_dir, f.local_rank) for r, f in failures.items()}
    startup = never_joined(lines)
    if startup is not None:  # the group never formed: name the rank that did not join, not the one that gave up
        missing, evidence = startup
        rank = missing[0] if missing else min(failures)
        _rank_failed_event(job_dir, evidence, "startup", rank, EXIT_STARTUP, None, failures, stage="startup")
        print(f"trainq: {evidence}; torchrun stopped the other ranks", file=sys.stderr, flush=True)
        return EXIT_STARTUP
    rank, failure = _root_cause(failures)
    timed_out = next((f"[rank {r}] {ln}" for r, ln in sorted(lines.items()) if ln and _is_timeout(ln)), None)
    kind, evidence = describe(rank, failure, lines[rank], timed_out)
    stage = "training" if has_joined(log_dir, failure.local_rank) else "startup"
    if stage == "startup":
        evidence = evidence.replace(f"rank {rank} ", f"rank {rank} (before it joined the group) ", 1)
    code = failure.exitcode
    if code not in _TRAINER_CODES:  # the trainer's own codes already wrote their event (oom, nan, data)
        signal_name = failure.signal_name() if code < 0 else None
        _rank_failed_event(job_dir, evidence, kind, rank, code, signal_name, failures, stage=stage)
    print(f"trainq: {evidence}; torchrun stopped the other ranks", file=sys.stderr, flush=True)
    if code == -signal.SIGTERM:
        return EXIT_FAILED  # 143 is the preemption code: the agent's own SIGTERM (SignalException) alone exits 143
    if code < 0:
        return 128 - code
    return code if code else EXIT_FAILED


def _rank_failed_event(
    job_dir: Path, evidence: str, kind: str, rank: int, code: int, signal_name: str | None, failures: dict, stage: str
) -> None:
    """The ``rank_failed`` event the watcher's diagnosis reads (``kind``, ``evidence``), with the ``stage``:
    ``startup`` (the failed rank had not joined the group) or ``training`` (it had)."""
    from trainq.trainer.metrics import MetricsWriter

    metrics = MetricsWriter(Path(os.environ.get(ENV_METRICS) or JobPaths(job_dir).metrics))
    metrics.event(
        EVENT_RANK_FAILED,
        evidence,
        kind=kind,
        evidence=evidence,
        rank=rank,
        stage=stage,
        exit_code=code,
        signal=signal_name,
        other_failed_ranks=sorted(r for r in failures if r != rank),
    )
    metrics.close()
