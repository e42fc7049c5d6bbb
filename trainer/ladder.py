"""The out-of-memory ladder: batch size -> gradient accumulation -> sequence length -> LoRA rank.

With ``oom_ladder: auto`` an attempt after an OOM attempt applies the next rung automatically: halve the
micro-batch and double accumulation (same effective batch); at batch 1, halve the sequence length.
Changing the LoRA rank would make the checkpoint unusable, so that rung is advice only.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainq.trainer.config import TrainConfig
from trainq.watcher.spec.contract import RECORD_EVENT

#: the ladder halves seq_len no further than this
MIN_SEQ_LEN = 32
OOM_EVENT = "oom"
LADDER_EVENT = "oom_ladder"


@dataclass(frozen=True)
class Rung:
    """Knobs after one rung, and what changed in words."""

    batch_size: int
    grad_accum: int
    seq_len: int
    change: str


def knobs_of(config: TrainConfig) -> dict:
    """The fields an OOM event records (what was in effect when memory ran out)."""
    return {
        "batch_size": config.batch_size,
        "grad_accum": config.grad_accum,
        "seq_len": config.seq_len,
        "lora_r": config.lora.r,
    }


def advice(config: TrainConfig) -> str:
    """The ladder in words, starting from the current knobs."""
    steps = []
    if config.batch_size > 1:
        steps.append(
            f"batch_size {config.batch_size} -> {config.batch_size // 2} with grad_accum "
            f"{config.grad_accum} -> {config.grad_accum * 2} (same effective batch)"
        )
    steps.append(f"seq_len {config.seq_len} -> {max(config.seq_len // 2, MIN_SEQ_LEN)}")
    if config.method != "full":
        steps.append(f"lora.r {config.lora.r} -> {max(config.lora.r // 2, 1)}")
    return "reduce in this order: " + "; then ".join(steps)


def next_rung(batch_size: int, grad_accum: int, seq_len: int) -> Rung | None:
    """The next automatic rung from these knobs, or None when none is left."""
    if batch_size > 1:
        half = batch_size // 2
        accum = grad_accum * batch_size // half
        return Rung(half, accum, seq_len, f"batch_size {batch_size} -> {half}, grad_accum {grad_accum} -> {accum}")
    if seq_len // 2 >= MIN_SEQ_LEN:
        return Rung(batch_size, grad_accum, seq_len // 2, f"seq_len {seq_len} -> {seq_len // 2}")
    return None


def _latest(records: list[dict], name: str, attempt: int) -> tuple[int, dict] | None:
    for index in range(len(records) - 1, -1, -1):
        record = records[index]
        if (
            record.get("type") == RECORD_EVENT
            and record.get("event") == name
            and int(record.get("attempt", 0)) < attempt
        ):
            return index, record
    return None


def plan(records: list[dict], attempt: int) -> tuple[dict, Rung | None] | None:
    """Knobs for this attempt from earlier attempts' events: (knobs, new rung or None), or None to keep the config.

    After an OOM attempt: the next rung from the knobs that ran out of memory. After a laddered attempt
    that did not run out of memory: the same laddered knobs again (no new rung).
    """
    oom, applied = _latest(records, OOM_EVENT, attempt), _latest(records, LADDER_EVENT, attempt)
    if applied is not None and (oom is None or applied[0] > oom[0]):
        return dict(applied[1]["to"]), None
    if oom is None:
        return None
    knobs = {k: oom[1][k] for k in ("batch_size", "grad_accum", "seq_len", "lora_r")}
    rung = next_rung(knobs["batch_size"], knobs["grad_accum"], knobs["seq_len"])
    if rung is None:
        return knobs, None
    return {**knobs, "batch_size": rung.batch_size, "grad_accum": rung.grad_accum, "seq_len": rung.seq_len}, rung
