"""Progress of running jobs, read incrementally from metrics.jsonl (``MetricsTail``) and from what a
training script prints into output.log (``progress_log.LogProgress``), merged field by field.

Files are never re-read from the start while they grow: each reader keeps a byte offset and the
unfinished last line. A file that shrinks or is replaced (new inode) is read again from 0.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import time
from collections import deque
from pathlib import Path
from typing import Any, cast

from trainq.watcher.spec.contract import HEALTH_DEFAULTS, RECORD_CHECKPOINT, RECORD_EVAL, RECORD_EVENT
from trainq.watcher.spec.fsutil import NO_FOLLOW_READ
from trainq.watcher.spec.records import parse_records

logger = logging.getLogger(__name__)

#: most bytes one poll reads, so a huge backlog (a watcher adopting a long run) is spread over ticks
MAX_READ_BYTES = 2 * 1024 * 1024
#: an unfinished line longer than this is garbage, not a record being written; it is dropped
MAX_LINE_BYTES = 1024 * 1024
#: records kept for diagnosis (records_tail)
TAIL_RECORDS = 20
#: keys of a progress dict, in status.json order
PROGRESS_KEYS = ("step", "total_steps", "epoch", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "eta_s")
#: the keys a reader sets (eta_s is derived)
FIELD_KEYS = PROGRESS_KEYS[:-1]
#: step records the clip fraction is taken over (the trainer's vitals: clip, update_ratio)
CLIP_WINDOW = 50


class LineReader:
    """Complete lines appended to a file since the last call; restarts at 0 on truncation or replacement."""

    def __init__(self, path: Path) -> None:
        self.path = path if isinstance(path, Path) else Path(path)  # Path(a Path) parses it again
        self._offset = 0
        self._inode: tuple[int, int] | None = None
        self._partial = b""
        self._mid_line = False  # started inside the file (start_near_end): the first fragment is no line
        self._keep: int | None = None  # start_near_end's bound, applied at the first read
        self.restarted = False

    def start_near_end(self, keep: int) -> None:
        """Read only the last ``keep`` bytes of the file the first read finds (a finished job's log never polled:
        its end is its progress); the line cut at that point is dropped."""
        if self._inode is None:
            self._keep = keep

    def read_lines(self, separators: bytes = b"\n") -> list[bytes]:
        """New complete lines (without separators); sets ``restarted`` when the file started over."""
        self.restarted = False
        if self._unchanged():
            return []
        try:
            fd = os.open(self.path, NO_FOLLOW_READ)
        except OSError:  # gone, or a symlink the job put there (never followed)
            return []
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return []
            self._check_identity((st.st_dev, st.st_ino), st.st_size)
            if st.st_size == self._offset:
                return []
            # what fstat saw, read where it starts: a read of MAX_READ_BYTES through a file object allocated
            # them all, every poll (11 us of a trivial job's last look at a 77-byte output.log)
            chunk = os.pread(fd, min(MAX_READ_BYTES, max(0, st.st_size - self._offset)), self._offset)
        except OSError:
            return []
        finally:
            os.close(fd)
        self._offset += len(chunk)
        return self._split(chunk, separators)

    @property
    def partial(self) -> bytes:
        """The unfinished last line (a progress bar redrawn with \\r lives here until the next redraw)."""
        return self._partial

    def _unchanged(self) -> bool:
        """Cheap path for the common tick: one stat, no open, when nothing was appended."""
        if self._inode is None:
            return False  # never read: nothing to compare with
        try:
            st = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return True
        return (st.st_dev, st.st_ino) == self._inode and st.st_size == self._offset

    def _check_identity(self, inode: tuple[int, int], size: int) -> None:
        if self._inode is None:
            self._inode = inode
            if self._keep is not None and size > self._keep:
                self._offset, self._mid_line = size - self._keep, True
        elif inode != self._inode or size < self._offset:
            logger.debug("%s: truncated or replaced, reading from the start", self.path)
            self._inode, self._offset, self._partial = inode, 0, b""
            self.restarted = True

    def _split(self, chunk: bytes, separators: bytes) -> list[bytes]:
        data = self._partial + chunk
        for sep in separators[1:]:
            data = data.replace(bytes([sep]), separators[:1])
        lines = data.split(separators[:1])
        if self._mid_line and len(lines) > 1:
            self._mid_line = False
            lines.pop(0)
        self._partial = lines.pop()
        if len(self._partial) > MAX_LINE_BYTES:
            self._partial = b""
        return [line for line in lines if line.strip()]


def finite(value: object) -> float | None:
    """A finite number as float; None for anything else (NaN, inf, strings, bools)."""
    # type() rather than isinstance: bool is an int subclass and must not count as a number
    if type(value) not in (int, float):
        return None
    number = float(cast(float, value))
    return number if math.isfinite(number) else None


def whole(value: object) -> int | None:
    """A non-negative integral number as int; None otherwise."""
    number = finite(value)
    return int(number) if number is not None and number >= 0 else None


def _parse_records(lines: list[bytes]) -> list[dict]:
    """JSON objects among ``lines``; malformed lines are skipped (the caller counts them)."""
    if not lines:
        return []
    if not all(line.lstrip()[:1] == b"{" and line.rstrip()[-1:] == b"}" for line in lines):
        return parse_records(lines)
    try:
        # one C-level parse for the whole batch (a backlog of 100k lines is common after a restart)
        records = json.loads(b"[" + b",".join(lines) + b"]")
    except (ValueError, UnicodeDecodeError, RecursionError):
        records = None
    if records is None or len(records) != len(lines):
        # a line holding two objects would merge into the batch: a count mismatch means parse line by line
        return parse_records(lines)
    return [r for r in records if type(r) is dict]


class Fields:
    """The latest value of each progress field, when it was read, and this attempt's step rate.

    ``read_at`` (when a value was read) decides which source wins a field in ``merge_progress``;
    the rate uses the time each step happened (a record's ``time``, else when it was read).
    """

    def __init__(self) -> None:
        self.values: dict[str, float | int | None] = dict.fromkeys(FIELD_KEYS)
        self.read_at: dict[str, float] = {}
        self.anchor: tuple[int, float] | None = None  # (step, time) of this attempt's first step seen
        self.newest: tuple[int, float] | None = None

    def set(self, key: str, value: float | int | None, read_at: float) -> None:
        self.values[key] = value
        self.read_at[key] = read_at

    def step(self, step: int, at: float, read_at: float, in_attempt: bool = True) -> None:
        """A step reached at time ``at``; a step going backwards is a resume: throughput starts over."""
        self.set("step", step, read_at)
        if not in_attempt:
            return
        if self.anchor is None or (self.newest is not None and step < self.newest[0]):
            self.anchor = (step, at)
        self.newest = (step, at)

    def restart_rate(self) -> None:
        self.anchor = self.newest = None

    def eta_s(self) -> int | None:
        """Seconds to total_steps at this attempt's step rate; None until two steps were seen."""
        total = self.values["total_steps"]
        if total is None or self.anchor is None or self.newest is None:
            return None
        (step0, t0), (step1, t1) = self.anchor, self.newest
        if step1 <= step0 or t1 <= t0:
            return None
        return max(0, round((total - step1) * (t1 - t0) / (step1 - step0)))

    @property
    def seen(self) -> bool:
        return bool(self.read_at)

    def progress(self, eta_s: int | None = None) -> dict | None:
        """The status.json progress dict, or None before anything was read."""
        if not self.seen:
            return None
        return {**self.values, "eta_s": self.eta_s() if eta_s is None else eta_s}


#: trainer events copied into progress (absent until one is seen): event -> (progress key, record field)
EVENT_FIELDS = {"plateau": ("warning", "message"), "eval_samples": ("samples", "samples")}
#: progress keys set from events: those above, and where the warning was raised (the story ends it: story.py)
EVENT_KEYS = (*(key for key, _ in EVENT_FIELDS.values()), "warning_at")
#: record fields copied into progress when present and valid
_PROGRESS_FIELDS = (
    ("total_steps", whole),
    ("epoch", finite),
    ("tokens_per_s", finite),
    ("eval_loss", finite),
    ("lr", finite),
    ("grad_norm", finite),
)


class MetricsTail:
    """Follows one job's metrics.jsonl; one instance per job, polled every tick."""

    def __init__(self, path: Path, attempt_started_at: float | None = None) -> None:
        self.path = path if isinstance(path, Path) else Path(path)
        self.attempt_started_at = attempt_started_at
        self._reader = LineReader(self.path)
        self._reset()

    def _reset(self) -> None:
        self.fields = Fields()
        self._last_record_at: float | None = None
        self._last_checkpoint: str | None = None
        self._tail: deque[dict] = deque(maxlen=TAIL_RECORDS)
        self.new_records: list[dict] = []
        self.bad_lines = 0
        self._clips: deque[bool] = deque(maxlen=CLIP_WINDOW)
        self._update_ratio: float | None = None

    def poll(self) -> bool:
        """Read the complete lines appended since the last call; True if any record was new."""
        lines = self._reader.read_lines()
        if self._reader.restarted:
            self._reset()
        read_at = time.time()
        self.new_records = _parse_records(lines)
        self.bad_lines += len(lines) - len(self.new_records)
        for record in self.new_records:
            self._apply(record, read_at)
        return bool(self.new_records)

    def _apply(self, record: dict, read_at: float) -> None:
        at = finite(record.get("time"))
        at = read_at if at is None else at
        self._last_record_at = at
        self._tail.append(record)
        if record.get("type") == RECORD_CHECKPOINT and isinstance(record.get("path"), str):
            self._last_checkpoint = record["path"]
        if isinstance(record.get("clip"), bool):
            self._clips.append(record["clip"])
        if finite(record.get("update_ratio")) is not None:
            self._update_ratio = finite(record["update_ratio"])
        self._apply_progress(record, at, read_at)

    def _apply_progress(self, record: dict, at: float, read_at: float) -> None:
        fields = self.fields
        if record.get("type") == RECORD_EVENT and record.get("event") in EVENT_FIELDS:
            key, source = EVENT_FIELDS[record["event"]]
            if record.get(source) is not None:
                fields.set(key, record[source], read_at)
            if key == "warning":  # the note holds for this step on, in this attempt, while the loss stays there
                this_attempt = self.attempt_started_at is None or at >= self.attempt_started_at
                level = finite(record.get("uniform_loss"))
                # an event's payload, as the warning text and the samples are (they come from a record: Any)
                raised: Any = {"step": whole(record.get("step")), "level": level, "this_attempt": this_attempt}
                fields.set("warning_at", raised, read_at)
        for key, convert in _PROGRESS_FIELDS:
            if key in record:
                value = convert(record[key])
                if value is not None:
                    fields.set(key, value, read_at)
        loss = record.get("loss")
        if type(loss) in (int, float) and record.get("type") != RECORD_EVAL:
            # a NaN loss is news: it replaces the last finite one with null rather than hiding it
            fields.set("loss", finite(loss), read_at)
        step = whole(record.get("step"))
        if step is not None:
            in_attempt = self.attempt_started_at is None or at >= self.attempt_started_at
            fields.step(step, at, read_at, in_attempt)

    @property
    def progress(self) -> dict | None:
        """{step, total_steps, epoch, loss, eval_loss, lr, grad_norm, tokens_per_s, eta_s}, or None before any."""
        return self.fields.progress()

    @property
    def vitals(self) -> dict:
        """``clip_fraction`` over the last CLIP_WINDOW step records that say ``clip``, and the latest
        ``update_ratio``; empty for a job that logs neither."""
        out: dict = {}
        if self._clips:
            out["clip_fraction"] = round(sum(self._clips) / len(self._clips), 4)
            out["clip_window"] = len(self._clips)
        if self._update_ratio is not None:
            out["update_ratio"] = self._update_ratio
        return out

    @property
    def last_record_at(self) -> float | None:
        """Unix time of the newest record (its ``time`` field, else when it was read)."""
        return self._last_record_at

    @property
    def last_checkpoint(self) -> str | None:
        """``path`` of the newest checkpoint record."""
        return self._last_checkpoint

    @property
    def records_tail(self) -> list[dict]:
        """The last records read, oldest first (for diagnosis)."""
        return list(self._tail)


def vitals_words(vitals: dict, thresholds: dict | None = None) -> str | None:
    """ "clip fraction 0.92 > 0.05 over 50 steps; update ratio 0.31 > 0.1" for the vitals past their thresholds."""
    limits = {**HEALTH_DEFAULTS, **(thresholds or {})}
    words = []
    fraction = vitals.get("clip_fraction")
    if fraction is not None and vitals.get("clip_window", 0) >= 10 and fraction > limits["clip_fraction"]:
        words.append(f"clip fraction {fraction:.2f} > {limits['clip_fraction']:g} over {vitals['clip_window']} steps")
    ratio = vitals.get("update_ratio")
    if ratio is not None and ratio > limits["update_ratio"]:
        words.append(f"update ratio {ratio:.3g} > {limits['update_ratio']:g}")
    return "; ".join(words) or None


def merge_progress(*sources: Fields) -> dict | None:
    """One progress dict from several readers: each field from the source that read it last.

    A source never hides a field it does not carry (a metrics record without ``loss`` leaves the
    loss the Trainer printed); on a tie the earlier source wins (metrics.jsonl before output.log).
    ``eta_s`` comes from the source that gave ``step``, else from any source that has one.
    """
    seen = [s for s in sources if s.seen]
    if not seen:
        return None
    merged: dict[str, float | int | None] = {}
    owner: dict[str, Fields] = {}
    for key in FIELD_KEYS:
        having = [s for s in seen if key in s.read_at]
        best = max(having, key=lambda s: s.read_at[key], default=None)  # max keeps the first of equals
        merged[key] = best.values[key] if best else None
        if best:
            owner[key] = best
    for key in EVENT_KEYS:
        having = [s for s in seen if key in s.read_at]
        if having:
            merged[key] = max(having, key=lambda s: s.read_at[key]).values[key]
    etas = [s.eta_s() for s in ([owner["step"]] if "step" in owner else []) + seen]
    merged["eta_s"] = next((eta for eta in etas if eta is not None), None)
    return merged
