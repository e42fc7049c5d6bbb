"""The trainer's one test switch: env ``TRAINQ_TRAINER_FAULTS`` injects faults at given optimizer steps.

Comma-separated ``key=value`` items; steps are 1-based optimizer steps, ``;`` or ``,`` separates a list:
  nan_at=5,6,7        the loss of each listed step becomes NaN, once per process (a rollback replays it cleanly)
  nan_after=5         every step from 5 on is NaN (also after rollbacks: drives the run to EXIT_NAN)
  nan_grad_at=5       the gradients of step 5 become NaN while its loss stays finite (once per process)
  nan_rank=1          the NaN faults above fire on this rank only (several ranks: one rank's bad step)
  spike_at=12         add 50 to the loss of step 12 (gradients unchanged)
  oom_at=3            raise torch.OutOfMemoryError in step 3
  oom_if_batch_over=2 raise torch.OutOfMemoryError in every step while batch_size > 2 (tests the OOM ladder)
  sleep_per_step=0.2  sleep this many seconds after every step
  stop_at=4           create the stop flag after step 4 (a deterministic stop.flag)
  sigterm_at=4        send SIGTERM to this process after step 4 (a deterministic preemption)
  kill_in_save=4      SIGKILL this process halfway through writing the checkpoint of step 4
  lr_bug_at=5         multiply the optimizer's lr by 10 just before step 5 (a schedule bug for the lr check)
  late_rank=1         with late_join_s: this rank joins the group late at start-up (several ranks)
  late_join_s=10      seconds late_rank sleeps before joining (past TRAINQ_RENDEZVOUS_TIMEOUT_S: a rank that never joins)
Nothing else in the trainer is simulated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from trainq.watcher.spec.contract import ENV_TRAINER_FAULTS, EXIT_USAGE

_INT_LIST_KEYS = ("nan_at", "nan_grad_at", "spike_at", "oom_at")
_INT_KEYS = (
    "nan_after",
    "nan_rank",
    "oom_if_batch_over",
    "stop_at",
    "sigterm_at",
    "kill_in_save",
    "lr_bug_at",
    "late_rank",
)
_FLOAT_KEYS = ("sleep_per_step", "late_join_s")


class FaultSpecError(ValueError):
    """Raised when TRAINQ_TRAINER_FAULTS cannot be parsed."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class Faults:
    """Parsed fault switch; empty means a normal run."""

    nan_at: frozenset[int] = frozenset()
    nan_after: int | None = None
    nan_grad_at: frozenset[int] = frozenset()
    nan_rank: int | None = None
    spike_at: frozenset[int] = frozenset()
    oom_at: frozenset[int] = frozenset()
    oom_if_batch_over: int | None = None
    sleep_per_step: float = 0.0
    stop_at: int | None = None
    sigterm_at: int | None = None
    kill_in_save: int | None = None
    lr_bug_at: int | None = None
    late_rank: int | None = None
    late_join_s: float = 0.0
    raw: str = field(default="", compare=False)

    def is_nan(self, step: int) -> bool:
        """Whether step ``step`` is listed as non-finite (before consumption)."""
        return step in self.nan_at or (self.nan_after is not None and step >= self.nan_after)

    def join_delay_s(self, rank: int) -> float:
        """Seconds this rank waits before joining the group (late_rank/late_join_s; 0 for every other rank)."""
        return self.late_join_s if self.late_rank == rank else 0.0


def _split_items(text: str) -> list[tuple[str, str]]:
    """``a=1,2,3,b=4`` → [(a, "1,2,3"), (b, "4")]: a bare number continues the previous key's list."""
    items: list[tuple[str, str]] = []
    for part in re.split(r"[,\s]+", text.strip()):
        if not part:
            continue
        if "=" in part:
            key, _, value = part.partition("=")
            items.append((key.strip(), value.strip()))
        elif items:
            items[-1] = (items[-1][0], f"{items[-1][1]};{part}")
        else:
            raise FaultSpecError(f"{ENV_TRAINER_FAULTS}: {part!r} is not key=value")
    return items


def parse_faults(text: str | None) -> Faults:
    """Parse the switch; FaultSpecError on unknown keys or bad numbers."""
    if not text or not text.strip():
        return Faults()
    values: dict[str, object] = {"raw": text}
    for key, value in _split_items(text):
        try:
            if key in _INT_LIST_KEYS:
                values[key] = frozenset(int(v) for v in value.split(";") if v)
            elif key in _INT_KEYS:
                values[key] = int(value)
            elif key in _FLOAT_KEYS:
                values[key] = float(value)
            else:
                raise FaultSpecError(
                    f"{ENV_TRAINER_FAULTS}: unknown fault {key!r} (see python -m trainq.trainer --help)"
                )
        except ValueError as exc:
            if isinstance(exc, FaultSpecError):
                raise
            raise FaultSpecError(f"{ENV_TRAINER_FAULTS}: {key}={value!r} is not a number") from None
    return Faults(**values)  # type: ignore[arg-type]
