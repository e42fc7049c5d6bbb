"""Names shared by the watcher, the job supervisor and the trainer: the file contract in code.

Dependency-free on purpose: the trainer imports it, and it must never pull in anything heavy.
Every filename inside a job folder is owned by ``JobPaths``; no other module spells them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

# -- exit codes (one place; the trainer exits with these and diagnosis reads them) --
#: finished normally, or stopped cooperatively after checkpointing (the watcher knows a stop was asked)
EXIT_OK = 0
#: generic failure
EXIT_FAILED = 1
#: bad command-line use / invalid config (argparse's convention)
EXIT_USAGE = 2
#: the data could not be read or had no usable row (sysexits EX_DATAERR)
EXIT_DATA = 65
#: training diverged: non-finite loss persisted through every rollback
EXIT_NAN = 66
#: out of memory (CUDA or host), after writing an ``event`` with the OOM ladder advice
EXIT_OOM = 67
#: stopped by SIGTERM from outside trainq (preemption), after checkpointing: 128 + SIGTERM
EXIT_PREEMPTED = 143
#: the vital signs' thresholds (train.health): clipped on most (> half) of the recent steps, updates > 0.1 of the weights
HEALTH_DEFAULTS = {"clip_fraction": 0.5, "update_ratio": 0.1}
#: the trainer stopped because the lr it applied left the configured schedule (diagnosis ``schedule``)
EXIT_SCHEDULE = 68
#: a rank of a several-rank train job gave up at start-up: the others did not all join the group within
#: TRAINQ_RENDEZVOUS_TIMEOUT_S (sysexits EX_UNAVAILABLE); the diagnosis (``startup``) names the ranks that never joined
EXIT_STARTUP = 69
#: "I saved a checkpoint, run me again" (HTCondor's checkpoint_exit_code): the built-in trainer's exit at
#: ``train.max_minutes_per_attempt``, and the usual value of a job's ``checkpoint_exit_code``
EXIT_CHECKPOINT = 85

# -- environment given to every job --
ENV_JOB_ID = "TRAINQ_JOB_ID"
ENV_JOB_DIR = "TRAINQ_JOB_DIR"
ENV_STOP_FLAG = "TRAINQ_STOP_FLAG"
ENV_METRICS = "TRAINQ_METRICS"
ENV_ATTEMPT = "TRAINQ_ATTEMPT"
ENV_RESUME_FROM = "TRAINQ_RESUME_FROM"
#: a train job forked with --from-checkpoint: initial weights for an attempt that does not resume
ENV_INIT_FROM = "TRAINQ_INIT_FROM"
#: given to on_finish hooks only (with TRAINQ_JOB_ID and TRAINQ_JOB_DIR)
ENV_STATUS = "TRAINQ_STATUS"
ENV_DIAGNOSIS = "TRAINQ_DIAGNOSIS"
#: test switch for the trainer (documented in trainer/README section of the main README)
ENV_TRAINER_FAULTS = "TRAINQ_TRAINER_FAULTS"
#: simulated GPUs file (docs/settings.md)
ENV_SIMULATE_GPUS = "TRAINQ_SIMULATE_GPUS"
#: queue root override
ENV_ROOT = "TRAINQ_ROOT"

# -- metrics.jsonl record types (docs/contract.md, metrics.jsonl) --
RECORD_STEP = "step"
RECORD_EVAL = "eval"
RECORD_CHECKPOINT = "checkpoint"
RECORD_EVENT = "event"
RECORD_DONE = "done"
RECORD_TYPES = (RECORD_STEP, RECORD_EVAL, RECORD_CHECKPOINT, RECORD_EVENT, RECORD_DONE)
#: the event each node's torchrun agent writes for the rank that failed there (trainer/launch.py)
EVENT_RANK_FAILED = "rank_failed"

# -- why an attempt stopped (docs/contract.md, why a job stopped): one word in run.json, status.json, history.jsonl and events --
REASON_USER = "user"  # stop.flag, `trainq stop`
REASON_DEADLINE = "deadline"  # the job's own deadline
REASON_WINDOW = "window"  # the window's final-checkpoint mark
REASON_STALLED = "stalled"  # the stall detector
REASON_TIMEOUT = "timeout"
REASON_REMOVED = "removed"  # its folder was removed while it ran
REASON_WATCHER = "watcher"  # a hook or runner limit: the watcher's own checks (lr schedule, an internal error)
#: each reason word and how every face says it: "stopped <phrase>", "stopping <phrase>", "stop requested <phrase>"
REASON_PHRASES = {
    REASON_USER: "on request",
    REASON_DEADLINE: "at its deadline",
    REASON_WINDOW: "at the window's final-checkpoint mark",
    REASON_STALLED: "by the stall detector",
    REASON_TIMEOUT: "at its timeout",
    REASON_REMOVED: "because its folder was removed",
    REASON_WATCHER: "by the watcher",
}
#: the reasons a stop.flag may carry as its content (the watcher writes its own; a user's flag is empty, or ``now``)
FLAG_REASONS = (REASON_DEADLINE, REASON_WINDOW, REASON_STALLED, REASON_WATCHER)


def stop_flag_reason(content: bytes | str | None) -> str:
    """The reason a stop.flag's content names: one of FLAG_REASONS, else ``user`` (empty, ``now``, anything else)."""
    if isinstance(content, bytes):
        content = content.decode("utf-8", "replace")
    word = (content or "").strip().lower()
    return word if word in FLAG_REASONS else REASON_USER


#: how the one-line separator written to output.log before each attempt begins
ATTEMPT_BANNER_PREFIX = "===== trainq: "

#: prefix of the checkpoint folders the trainer writes (``step-000400``)
CHECKPOINT_PREFIX = "step-"
CKPT_LATEST = "ckpt_latest"
CKPT_BEST = "ckpt_best"


@dataclass(frozen=True)
class JobPaths:
    """Every path inside one job folder; each is joined once per JobPaths (a job's paths are asked for dozens of
    times per job, and a pathlib join costs microseconds)."""

    dir: Path

    @cached_property
    def spec(self) -> Path:
        return self.dir / "job.yaml"

    @cached_property
    def run(self) -> Path:
        return self.dir / "run.json"

    @cached_property
    def log(self) -> Path:
        return self.dir / "output.log"

    @cached_property
    def metrics(self) -> Path:
        return self.dir / "metrics.jsonl"

    @cached_property
    def stop_flag(self) -> Path:
        return self.dir / "stop.flag"

    @cached_property
    def retry_flag(self) -> Path:
        return self.dir / "retry.flag"

    @cached_property
    def checkpoints(self) -> Path:
        return self.dir / "checkpoints"

    @cached_property
    def ckpt_latest(self) -> Path:
        return self.checkpoints / CKPT_LATEST

    @cached_property
    def ckpt_best(self) -> Path:
        return self.checkpoints / CKPT_BEST

    @cached_property
    def hook_log(self) -> Path:
        """Output of the job's on_finish hook (docs/workflows.md)."""
        return self.dir / "hook.log"

    @cached_property
    def hook_record(self) -> Path:
        """The conclusion's hook: "due" (written before the final run.json), "running" (the one runner took it,
        under hook.lock), then "ended" with its outcome: runs the hook exactly once."""
        return self.dir / "hook.json"

    @cached_property
    def summary(self) -> Path:
        return self.dir / "summary.json"

    @cached_property
    def loss_png(self) -> Path:
        return self.dir / "loss.png"

    @cached_property
    def lock(self) -> Path:
        """Held (flock) by the job's supervisor for as long as the attempt lives."""
        return self.dir / "supervisor.lock"

    @cached_property
    def started(self) -> Path:
        """Start record the supervisor writes: pids, process start time, attempt."""
        return self.dir / "supervisor.json"

    @cached_property
    def exit_record(self) -> Path:
        """Exit record the supervisor writes atomically when the attempt's process tree is gone."""
        return self.dir / "exit.json"

    @cached_property
    def slurm_script(self) -> Path:
        return self.dir / "slurm.sh"

    @cached_property
    def launch_spec(self) -> Path:
        """The attempt's LaunchSpec as JSON, for a supervisor started outside the watcher (Slurm)."""
        return self.dir / "launch.json"

    @cached_property
    def heartbeat(self) -> Path:
        """Rewritten by the node-side supervisor every few seconds while a Slurm attempt lives (watcher/node.py)."""
        return self.dir / "heartbeat.json"

    def slurm_claim(self, attempt: int) -> Path:
        """Created (O_EXCL) by the first Slurm job that starts attempt ``attempt``; a duplicate submission finds it."""
        return self.dir / f"slurm-attempt-{attempt}.claim"

    @cached_property
    def rank_exits(self) -> Path:
        """Under srun, each task writes ``<attempt>.<rank>`` here when its command exits: its own exit code."""
        return self.dir / "ranks"

    @cached_property
    def events(self) -> Path:
        """The job's story, one JSON record a line, appended by the watcher and the supervisor (docs/records.md)."""
        return self.dir / "events.jsonl"

    @cached_property
    def events_rotated(self) -> Path:
        """The older part of ``events`` once it outgrew its bound (one generation is kept)."""
        return self.dir / "events.1.jsonl"

    @cached_property
    def snapshot(self) -> Path:
        """What the latest attempt ran: code, resolved config, sources, environment (docs/records.md)."""
        return self.dir / "snapshot"

    @cached_property
    def slurm_record(self) -> Path:
        """What the watcher submitted to Slurm for the current attempt (its Slurm job id, sbatch argv)."""
        return self.dir / "slurm.json"


@lru_cache(maxsize=8)
def paths_of(job_dir: str) -> JobPaths:
    """The JobPaths of ``job_dir`` (a folder's name as a string), shared by a process's steps: a supervisor's take,
    log, environment, watch and exit record each built their own, and joined every path again."""
    return JobPaths(Path(job_dir))
