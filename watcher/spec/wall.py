"""Walls a run must end before, and what it cost (docs/wall.md): pure values and arithmetic, no I/O.

A job's ``deadline`` is an ISO-8601 time, or a duration counted from the job's first start. The
queue's ``window`` (watcher.yaml) is the box's end, with the runbook's ladder before it: at
``freeze_at`` no job starts that is not expected to end before the final-checkpoint mark; at
``final_checkpoint_at`` every running job is stopped the way a stop.flag stops it. ``cost`` turns
runtime into money: ``per_hour`` (the box's rate, charged to a job while it runs) or ``per_gpu_hour``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from datetime import datetime
from typing import TypeGuard

from trainq.watcher.spec.errors import Problem
from trainq.watcher.spec.units import iso_utc, parse_duration_s

#: the runbook's defaults: freeze 30 minutes before the wall, final checkpoint 15 minutes before it
DEFAULT_FREEZE_BEFORE_S = 1800.0
DEFAULT_FINAL_CHECKPOINT_BEFORE_S = 900.0
#: a currency is an ISO 4217 code: three capital letters
CURRENCY = re.compile(r"^[A-Z]{3}$")
#: what a job's ``deliver.what`` may name
DELIVERABLES = ("adapter", "ckpt_best", "ckpt_latest", "logs", "summary")
#: the environment variable that hands a job the queue's rate (the trainer writes its attempt's cost into summary.json)
ENV_COST = "TRAINQ_COST"


def parse_time(text: str) -> float | None:
    """An ISO-8601 time → Unix seconds (``Z`` or an offset; a time without one is this machine's local time)."""
    if not isinstance(text, str) or not re.match(r"^\s*\d{4}-\d{2}-\d{2}", text):
        return None
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    return when.timestamp()


@dataclass(frozen=True)
class Deadline:
    """``at`` (Unix seconds) for an absolute deadline, or ``after_start_s`` counted from the first start."""

    at: float | None = None
    after_start_s: float | None = None

    @classmethod
    def parse(cls, value: object) -> Deadline:
        """Raises ValueError with a sentence when ``value`` is neither an ISO-8601 time nor a duration."""
        if isinstance(value, str) and (at := parse_time(value)) is not None:
            return cls(at=at)
        try:
            seconds = parse_duration_s(value)
        except ValueError:
            raise ValueError(
                f"expected an ISO-8601 time like 2026-12-02T08:00:00Z or a duration like 6h (got {_shown(value)})"
            ) from None
        if seconds <= 0:
            raise ValueError("a duration must be more than 0")
        return cls(after_start_s=seconds)

    def resolve(self, first_started_at: float | None) -> float | None:
        """The deadline as Unix seconds; None for a duration before the job first started."""
        if self.at is not None:
            return self.at
        return None if first_started_at is None else first_started_at + float(self.after_start_s or 0)


@dataclass(frozen=True)
class Window:
    """The queue's wall and its ladder (watcher.yaml ``window:``)."""

    ends_at: float
    freeze_before_s: float = DEFAULT_FREEZE_BEFORE_S
    final_checkpoint_before_s: float = DEFAULT_FINAL_CHECKPOINT_BEFORE_S

    @classmethod
    def from_dict(cls, data: dict) -> Window:
        return cls(
            ends_at=float(parse_time(str(data["ends_at"])) or 0.0),
            freeze_before_s=parse_duration_s(data.get("freeze_before", DEFAULT_FREEZE_BEFORE_S)),
            final_checkpoint_before_s=parse_duration_s(
                data.get("final_checkpoint_before", DEFAULT_FINAL_CHECKPOINT_BEFORE_S)
            ),
        )

    @property
    def freeze_at(self) -> float:
        return self.ends_at - self.freeze_before_s

    @property
    def final_checkpoint_at(self) -> float:
        return self.ends_at - self.final_checkpoint_before_s

    def is_frozen(self, now: float) -> bool:
        return now >= self.freeze_at

    def is_final(self, now: float) -> bool:
        return now >= self.final_checkpoint_at

    def to_dict(self) -> dict:
        return {
            "ends_at": iso_utc(self.ends_at),
            "freeze_at": iso_utc(self.freeze_at),
            "final_checkpoint_at": iso_utc(self.final_checkpoint_at),
        }


@dataclass(frozen=True)
class Cost:
    """A rate: ``per_gpu`` prices each GPU-hour, else the box's hour is charged to a job while it runs."""

    rate: float
    currency: str
    per_gpu: bool = False

    @classmethod
    def from_dict(cls, data: dict) -> Cost:
        per_gpu = "per_gpu_hour" in data
        return cls(
            rate=float(data["per_gpu_hour" if per_gpu else "per_hour"]), currency=str(data["currency"]), per_gpu=per_gpu
        )

    def of(self, seconds: float, gpus: int) -> dict:
        """An attempt's ``{amount, currency, gpu_hours, hours}`` (a job given no GPU counts as one under per_gpu_hour)."""
        hours = max(0.0, seconds) / 3600.0
        gpu_hours = hours * max(0, gpus)
        billed = hours * max(1, gpus) if self.per_gpu else hours
        return {
            "amount": round(billed * self.rate, 6),
            "currency": self.currency,
            "gpu_hours": round(gpu_hours, 6),
            "hours": round(hours, 6),
        }

    def to_env(self, gpus: int) -> str:
        """The rate as a job sees it in TRAINQ_COST (JSON)."""
        key = "per_gpu_hour" if self.per_gpu else "per_hour"
        return json.dumps({key: self.rate, "currency": self.currency, "gpus": gpus})


def window_ended(window: Window | None, now: float) -> str | None:
    """The loud line for a window whose end has passed (nothing starts until watcher.yaml changes), or None."""
    if window is None or now < window.ends_at:
        return None
    return (
        f"the window ended at {iso_utc(window.ends_at)} ({minutes(now - window.ends_at)} ago): nothing starts "
        "until window.ends_at in watcher.yaml is moved later or the window is removed"
    )


def freeze_hold(window: Window | None, now: float, estimate_s: float | None, source: str) -> str | None:
    """Why the window holds a pending job now (in words), or None when it may start: inside the freeze a job
    starts only when ``estimate_s`` ends before the final-checkpoint mark; after that mark nothing starts."""
    if window is None or not window.is_frozen(now):
        return None
    ended = window_ended(window, now)
    if ended is not None:
        return ended
    mark = window.final_checkpoint_at
    if window.is_final(now):
        return f"window: past the final-checkpoint mark ({iso_utc(mark)}); nothing starts before the wall"
    if estimate_s is not None and now + estimate_s <= mark:
        return None
    left = minutes(mark - now)
    if estimate_s is None:
        return (
            f"window freeze since {iso_utc(window.freeze_at)}: no estimate of how long it runs "
            f"(set expected_duration), {left} left before the final checkpoint"
        )
    return (
        f"window freeze since {iso_utc(window.freeze_at)}: {source} {minutes(estimate_s)}, {left} left before "
        f"the final checkpoint at {iso_utc(mark)}"
    )


def attempt_cost_from_env(seconds: float, environ: dict | None = None) -> dict | None:
    """The cost of ``seconds`` of this process's attempt at the rate TRAINQ_COST hands it, or None without one."""
    text = (environ if environ is not None else os.environ).get(ENV_COST)
    try:
        data = json.loads(text) if text else None
        return Cost.from_dict(data).of(seconds, int(data.get("gpus") or 0)) if data else None
    except (ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Forecast:
    """When a running job is expected to end, from the step rate of its current attempt."""

    predicted_end: float | None
    steps_per_h: float | None
    steps_left: int | None

    @classmethod
    def from_progress(cls, progress: dict | None, now: float) -> Forecast:
        """``eta_s`` (throughput since this attempt started, faces/progress.py) gives the end; steps give the rate."""
        progress = progress or {}
        eta, step, total = progress.get("eta_s"), progress.get("step"), progress.get("total_steps")
        if not _finite(eta):
            return cls(None, None, None)
        left = int(total - step) if _finite(step) and _finite(total) and total >= step else None
        rate = left / eta * 3600.0 if left and eta > 0 else None
        return cls(now + float(eta), rate, left)

    def fits(self, wall: float | None) -> bool | None:
        """True/False when both an end and a wall are known, else None."""
        if wall is None or self.predicted_end is None:
            return None
        return self.predicted_end <= wall

    def words(self, wall: float | None, wall_name: str) -> str | None:
        """ "at 412 steps/h, 1,800 steps left: ends 03:40 UTC, 40 min after the wall"."""
        if self.predicted_end is None:
            return None
        rate = (
            f"at {self.steps_per_h:,.0f} steps/h, {self.steps_left:,} steps left: "
            if self.steps_per_h and self.steps_left
            else ""
        )
        ends = f"ends {_clock(self.predicted_end)}"
        if wall is None:
            return rate + ends
        gap = self.predicted_end - wall
        side = "after" if gap > 0 else "before"
        return f"{rate}{ends}, {minutes(abs(gap))} {side} the {wall_name}"


def minutes(seconds: float) -> str:
    """A span in words: "45 s", "12 min", "2 h 5 min"."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours} h {rest // 60} min" if rest >= 60 else f"{hours} h"


def _clock(ts: float) -> str:
    return (iso_utc(ts) or "")[11:16] + " UTC"


def _finite(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- validation (the schema checks shapes; these check meaning) --------------------------------------------------


def job_wall_problems(data: dict) -> list[Problem]:
    """``deadline`` is a time or a duration; ``expected_duration`` is more than 0 (whenever the file is read)."""
    problems = []
    if "deadline" in data:
        try:
            Deadline.parse(data["deadline"])
        except ValueError as exc:
            problems.append(Problem("deadline", str(exc)))
    if "expected_duration" in data:
        try:
            if parse_duration_s(data["expected_duration"]) <= 0:
                problems.append(Problem("expected_duration", "must be a duration greater than 0"))
        except ValueError as exc:
            problems.append(Problem("expected_duration", str(exc)))
    return problems


def submission_problems(raw: dict, now: float) -> list[Problem]:
    """Checked once, when a file is submitted (not when a running job's file is read again after a restart):
    a deadline already past, a local delivery target that cannot be written."""
    problems = []
    try:
        deadline = Deadline.parse(raw["deadline"]) if "deadline" in raw else None
    except ValueError:
        deadline = None  # reported by job_wall_problems
    if deadline is not None and deadline.at is not None and deadline.at <= now:
        problems.append(
            Problem(
                "deadline",
                f"{raw['deadline']} is in the past (now {iso_utc(now)}); give a later time or a duration like 6h",
            )
        )
    deliver = raw.get("deliver")
    if isinstance(deliver, dict) and isinstance(deliver.get("to"), str):
        problem = target_problem(deliver["to"])
        if problem:
            problems.append(Problem("deliver.to", problem))
    return problems


def is_remote_target(to: str) -> bool:
    """``host:path``, ``user@host:path`` or ``rsync://...``: rsync's remote forms (a local path has no colon before a slash)."""
    if to.startswith("rsync://"):
        return True
    head = to.split("/", 1)[0]
    return ":" in head and not to.startswith("/")


def target_problem(to: str) -> str | None:
    """Why a local delivery target cannot be written, or None (a remote target is checked when delivering)."""
    if not to.strip():
        return "must name a folder or an rsync target"
    if to.startswith("-"):
        return f"{to!r} starts with '-', which rsync would read as an option; name a folder or an rsync target"
    if is_remote_target(to):
        return None
    path = os.path.expanduser(to)
    if not os.path.isabs(path):
        return f"{to!r} must be an absolute path (or an rsync target such as host:/path)"
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe.rstrip("/")) or "/"
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe} is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} cannot be written by the watcher's user"
    return None


def watcher_wall_problems(data: dict) -> list[Problem]:
    """``window.ends_at`` is an ISO-8601 time and the ladder's marks are in order; ``cost`` has one rate and a currency."""
    problems = []
    window = data.get("window")
    if isinstance(window, dict):
        if parse_time(str(window.get("ends_at", ""))) is None:
            problems.append(
                Problem(
                    "window.ends_at",
                    f"expected an ISO-8601 time like 2026-12-02T08:00:00Z (got {_shown(window.get('ends_at'))})",
                )
            )
        try:
            freeze = parse_duration_s(window.get("freeze_before", DEFAULT_FREEZE_BEFORE_S))
            final = parse_duration_s(window.get("final_checkpoint_before", DEFAULT_FINAL_CHECKPOINT_BEFORE_S))
        except ValueError:
            pass  # reported by the duration checks
        else:
            if final > freeze:
                problems.append(
                    Problem(
                        "window.final_checkpoint_before",
                        f"must not be longer than freeze_before ({window.get('freeze_before', '30m')}): "
                        "the freeze comes first, then the final checkpoint",
                    )
                )
    cost = data.get("cost")
    if isinstance(cost, dict):
        rates = [k for k in ("per_hour", "per_gpu_hour") if k in cost]
        if len(rates) != 1:
            problems.append(Problem("cost", "give exactly one of per_hour or per_gpu_hour"))
        currency = cost.get("currency")
        if not isinstance(currency, str) or not CURRENCY.match(currency):
            problems.append(
                Problem(
                    "cost.currency",
                    f"expected a three-letter ISO 4217 code such as USD or EUR (got {_shown(currency)})",
                )
            )
    return problems
