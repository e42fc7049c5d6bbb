"""Several ranks: which processes a train job runs, and what the ranks agree on at every step.

The engine is torch's: ``torch.distributed.run`` (torchrun) starts and watches the ranks (``launch.py``
calls it in-process), ``torch.distributed`` with gloo (CPU) or nccl (GPU) carries the collectives and
transformers' Trainer wraps the model in DDP or FSDP. This module only decides the numbers, holds one
rank's view of the world and does trainq's one small collective per optimizer step (``StepVote``).
"""

from __future__ import annotations

import datetime
import os
import re
import time
from dataclasses import dataclass

from trainq.trainer.config import ConfigError, TrainConfig
from trainq.watcher.spec.contract import EXIT_STARTUP

#: seconds a collective (and so a rank) may wait for a peer before the job fails; TRAINQ_COLLECTIVE_TIMEOUT_S overrides.
#: Long enough for rank 0 to write and hash a checkpoint of several GB while the others wait at the barrier.
COLLECTIVE_TIMEOUT_S = 600.0
ENV_COLLECTIVE_TIMEOUT = "TRAINQ_COLLECTIVE_TIMEOUT_S"
#: seconds the ranks wait for each other to join the group at start-up; TRAINQ_RENDEZVOUS_TIMEOUT_S overrides.
#: Long enough for every rank to import torch and transformers on a loaded machine (tens of seconds at load 10+).
RENDEZVOUS_TIMEOUT_S = 300.0
ENV_RENDEZVOUS_TIMEOUT = "TRAINQ_RENDEZVOUS_TIMEOUT_S"
#: the last line a rank prints when the group did not form: launch.py reads the ranks that never joined from it
#: the file a rank leaves in its torchrun log folder once it joined the group
JOINED_MARK = "joined"
NEVER_JOINED = re.compile(
    r"the group did not form: ranks? (?P<ranks>[0-9, ]+) never joined within (?P<seconds>[0-9.]+) s"
)
#: what torchrun sets in each rank it starts (and srun's task wrapper does not)
ENV_TORCHRUN_RUN_ID = "TORCHELASTIC_RUN_ID"


@dataclass(frozen=True)
class World:
    """This process's place among the job's ranks (rank 0 of 1 when not under torchrun)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    hosts: tuple[str, ...] = ()  # each rank's host name, by rank (``with_hosts``; empty until then)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes metrics.jsonl, summary.json, env.json and seals checkpoints."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> World:
        """Read torchrun's variables; a process torchrun did not start is the whole world."""
        if not os.environ.get(ENV_TORCHRUN_RUN_ID):
            return cls()
        env = os.environ
        return cls(
            rank=int(env["RANK"]),
            local_rank=int(env["LOCAL_RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        )


def _seconds(name: str, default: float) -> float:
    """A timeout from the environment variable ``name`` (seconds, > 0), else ``default``."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r}: expected a number of seconds") from None
    if not value > 0:
        raise ConfigError(f"{name}={text!r}: must be more than 0 seconds")
    return value


def collective_timeout_s() -> float:
    """How long a collective of the training steps waits for a peer: TRAINQ_COLLECTIVE_TIMEOUT_S, default 600 s."""
    return _seconds(ENV_COLLECTIVE_TIMEOUT, COLLECTIVE_TIMEOUT_S)


def rendezvous_timeout_s() -> float:
    """How long the ranks wait for each other to join at start-up: TRAINQ_RENDEZVOUS_TIMEOUT_S, default 300 s."""
    return _seconds(ENV_RENDEZVOUS_TIMEOUT, RENDEZVOUS_TIMEOUT_S)


class RanksDidNotJoin(Exception):
    """Raised on a rank when the group did not form within the rendezvous timeout; names the ranks missing."""

    exit_code = EXIT_STARTUP


def visible_gpus() -> int:
    """GPUs this job was given: CUDA_VISIBLE_DEVICES when set (the watcher sets it), else what CUDA counts."""
    ids = os.environ.get("CUDA_VISIBLE_DEVICES")
    if ids is not None:
        return len([i for i in ids.split(",") if i.strip() and i.strip() != "-1"])
    driver = "/proc/driver/nvidia/gpus"  # read without importing torch (seconds) before a single-rank run starts
    if not os.path.isdir(driver):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def processes_per_node(config: TrainConfig, gpus: int, spec: str) -> int:
    """``train.processes``, or one per GPU given (1 without GPUs); refused when it asks for more GPUs than given."""
    if config.processes is None:
        return max(gpus, 1)
    if gpus and config.processes > gpus:
        raise ConfigError(
            f"{spec}: train.processes: {config.processes} ranks but this job was given {gpus} GPU"
            f"{'s' if gpus != 1 else ''} (CUDA_VISIBLE_DEVICES); ask for resources.gpus: "
            f"{config.processes} or lower train.processes"
        )
    return config.processes


def check_strategy(config: TrainConfig, spec: str, gpus: int) -> None:
    """fsdp shards full fine-tuning on GPUs; a 4-bit base cannot be sharded by the Trainer's FSDP here, and
    accelerate (1.15) enables FSDP only for GPU ranks: on the CPU it would silently train as DDP."""
    if config.strategy != "fsdp":
        return
    if config.method == "qlora":
        raise ConfigError(
            f"{spec}: train.strategy: fsdp does not support method: qlora (4-bit weights are not "
            "sharded); use strategy: ddp with qlora, or method: full with fsdp"
        )
    if not gpus:
        raise ConfigError(
            f"{spec}: train.strategy: fsdp needs GPU ranks (accelerate shards only CUDA ranks; CPU "
            "ranks would silently train unsharded); use strategy: ddp on the CPU"
        )


def training_kwargs(config: TrainConfig, world: World, cpu: bool) -> dict:
    """TrainingArguments for several ranks: backend, timeout and (fsdp) sharding; nothing for one process."""
    if not world.is_distributed:
        return {}
    kwargs: dict = {"ddp_timeout": int(collective_timeout_s()), "ddp_backend": "gloo" if cpu else "nccl"}
    kwargs["ddp_find_unused_parameters"] = False  # every trainable weight takes part in each forward pass
    if config.strategy == "fsdp":
        kwargs["fsdp"] = "full_shard auto_wrap"
        kwargs["fsdp_config"] = {"use_orig_params": True, "state_dict_type": "SHARDED_STATE_DICT"}
    return kwargs


def init(world: World, cpu: bool, late_join_s: float = 0.0) -> None:
    """Join the process group early (the Trainer then reuses it): every rank must join within the rendezvous
    timeout (else RanksDidNotJoin names who did not), then the steps' collectives get the collective timeout.

    ``late_join_s``: the test switch's delay before this rank joins (faults ``late_rank``/``late_join_s``)."""
    if not world.is_distributed:
        return
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if not cpu:
        torch.cuda.set_device(world.local_rank)
    if late_join_s:
        print(f"trainq: rank {world.rank}: joining {late_join_s:g} s late (TRAINQ_TRAINER_FAULTS)", flush=True)
        time.sleep(late_join_s)
    joining = rendezvous_timeout_s()
    store = join(world, joining)
    mark_joined()
    collective = datetime.timedelta(seconds=collective_timeout_s())
    store.set_timeout(collective)
    dist.init_process_group(
        "gloo" if cpu else "nccl",
        store=dist.PrefixStore("default_pg", store),  # what init_process_group's own env:// path does
        rank=world.rank,
        world_size=world.world_size,
        timeout=collective,
    )


def join(world: World, timeout_s: float):
    """torchrun's store (env://), then every rank's mark in it within ``timeout_s``; returns the store."""
    import torch.distributed as dist

    started = time.monotonic()
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    except (RuntimeError, OSError) as exc:  # the store's host (rank 0, or torchrun) never answered
        missing = [0] if world.rank != 0 else []
        raise RanksDidNotJoin(_never_joined_line(world, missing, timeout_s, exc)) from None
    marks = dist.PrefixStore("trainq_join", store)
    marks.set(str(world.rank), str(os.getpid()))
    keys = [str(r) for r in range(world.world_size)]
    left = max(timeout_s - (time.monotonic() - started), 0.001)
    try:
        marks.wait(keys, datetime.timedelta(seconds=left))
    except RuntimeError as exc:  # torch raises DistStoreError (a RuntimeError) on a timeout
        missing = [r for r in range(world.world_size) if not marks.check([str(r)])]
        raise RanksDidNotJoin(_never_joined_line(world, missing, timeout_s, exc)) from None
    return store


def mark_joined() -> None:
    """Leave JOINED_MARK beside torchrun's error file of this rank: launch.py then tells a rank that failed while
    starting (stage ``startup``) from one that failed while training."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            open(os.path.join(os.path.dirname(error_file), JOINED_MARK), "w").close()
        except OSError:
            pass  # the stage then reads startup: a report detail, never a reason to fail the run


def _never_joined_line(world: World, missing: list[int], timeout_s: float, exc: BaseException) -> str:
    """The line launch.py reads (NEVER_JOINED) and the diagnosis quotes."""
    which = ", ".join(map(str, missing)) if missing else "unknown"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"rank {world.rank}: the group did not form: rank{'s' if len(missing) != 1 else ''} {which} never joined "
        f"within {timeout_s:g} s ({ENV_RENDEZVOUS_TIMEOUT}) ({first})"
    )


def with_hosts(world: World) -> World:
    """The world with every rank's host name, by rank (one collective at start-up; this host alone for one
    process): summary.json and env.json name them, so a run across Slurm nodes says where its ranks ran."""
    import dataclasses
    import socket

    here = socket.gethostname()
    if not world.is_distributed:
        return dataclasses.replace(world, hosts=(here,))
    import torch.distributed as dist

    names: list[object] = [None] * world.world_size
    dist.all_gather_object(names, here)
    return dataclasses.replace(world, hosts=tuple(str(name) for name in names))


def barrier(world: World) -> None:
    """Wait for every rank (a no-op for one process)."""
    if world.is_distributed:
        import torch.distributed as dist

        dist.barrier()


def broadcast_object(world: World, value: object) -> object:
    """Rank 0's ``value`` on every rank."""
    if not world.is_distributed:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass(frozen=True)
class Vote:
    """What every rank agreed on for one optimizer step (identical on every rank)."""

    loss: float  # mean of the ranks' raw step losses (NaN when any rank's was)
    tokens: int  # tokens of the whole world in this step
    stop: bool  # some rank saw stop.flag
    preempt: bool  # some rank got SIGTERM
    due: bool  # checkpoint.every_minutes has passed on some rank's clock
    sliced: bool = False  # train.max_minutes_per_attempt has passed on some rank's clock


class StepVote:
    """trainq's one collective per optimizer step: loss, tokens, stop, preemption and the time cadence, summed
    over the ranks.

    Every guard (NaN streak, spike, rollback) and the stop decision then read the same numbers on every
    rank, so all ranks take the same branch after the same step. One all_reduce of 6 float64 values.
    """

    def __init__(self, world: World):
        self.world = world

    def __call__(self, loss: float, tokens: int, stop: bool, preempt: bool, due: bool, sliced: bool = False) -> Vote:
        if not self.world.is_distributed:
            return Vote(loss, tokens, stop, preempt, due, sliced)
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", self.world.local_rank) if dist.get_backend() == "nccl" else torch.device("cpu")
        sums = torch.tensor(
            [loss, float(tokens), float(stop), float(preempt), float(due), float(sliced)],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(sums)
        total = sums.tolist()
        return Vote(
            total[0] / self.world.world_size, int(total[1]), total[2] > 0, total[3] > 0, total[4] > 0, total[5] > 0
        )


class WorldSizeChanged(Exception):
    """Raised when a resume would run with a different number of ranks than the checkpoint, without
    allow_changed_schedule (or when the global batch cannot be kept with the new number)."""

    exit_code = 2  # EXIT_USAGE, as every refused resume


def keep_global_batch(config: TrainConfig, saved: dict, world_size: int, folder: object) -> TrainConfig:
    """Resume with ``world_size`` ranks from a checkpoint trained with ``saved["world_size"]``.

    Refused unless allow_changed_schedule; then the global batch (batch_size x grad_accum x world size) is kept:
    grad_accum is scaled by old/new world size where that is a whole number, else batch_size is.
    """
    old = int(saved.get("world_size") or 1)
    if old == world_size:
        return config
    if not config.allow_changed_schedule:
        raise WorldSizeChanged(
            f"{folder}: resume refused: the checkpoint was trained with world size {old} and this "
            f"attempt has world size {world_size} (train.processes x nodes); run it with {old} "
            "ranks, or set train.allow_changed_schedule: true to keep the global batch and go on"
        )
    batch, accum = config.batch_size, config.grad_accum
    if (accum * old) % world_size == 0:
        return config.with_changes(grad_accum=accum * old // world_size)
    if (batch * old) % world_size == 0:
        return config.with_changes(batch_size=batch * old // world_size)
    raise WorldSizeChanged(
        f"{folder}: resume refused: the global batch {batch * accum * old} (batch_size {batch} x "
        f"grad_accum {accum} x world size {old}) cannot be split over world size {world_size}; "
        "choose processes that divide it"
    )


def save_full_weights(trainer, tokenizer, out_dir, world: World) -> None:
    """FSDP: gather the sharded weights (every rank takes part) and let rank 0 write them, with the tokenizer."""
    state_dict = trainer.accelerator.get_state_dict(trainer.model)
    if world.is_main:
        from trainq.trainer.artifacts import make_readable

        trainer._save(str(out_dir), state_dict=state_dict)
        tokenizer.save_pretrained(str(out_dir))
        make_readable(out_dir)
    barrier(world)
