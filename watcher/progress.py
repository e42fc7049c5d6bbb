"""Progress of running jobs, read incrementally from metrics.jsonl or from Trainer log lines in output.log.

Files are never re-read from the start while they grow: each reader keeps a byte offset and the
unfinished last line. A file that shrinks or is replaced (new inode) is read again from 0.
"""
from __future__ import annotations

import ast
import json
import logging
import math
import os
import re
import stat
import time
from collections import deque
from pathlib import Path

from trainq.watcher.contract import RECORD_CHECKPOINT, RECORD_EVAL
from trainq.watcher.diagnosis import parse_records
from trainq.watcher.fsutil import open_no_follow

logger = logging.getLogger(__name__)

#: most bytes one poll reads, so a huge backlog (a watcher adopting a long run) is spread over ticks
MAX_READ_BYTES = 2 * 1024 * 1024
#: an unfinished line longer than this is garbage, not a record being written; it is dropped
MAX_LINE_BYTES = 1024 * 1024
#: records kept for diagnosis (records_tail)
TAIL_RECORDS = 20
#: keys of a progress dict, in status.json order
PROGRESS_KEYS = ("step", "total_steps", "epoch", "loss", "eval_loss", "tokens_per_s", "eta_s")
#: a Hugging Face Trainer log dict as printed on stdout: {'loss': 2.1, 'grad_norm': 0.5, ...}
_HF_DICT = re.compile(r"\{'(?:loss|eval_loss|train_loss|epoch|learning_rate|grad_norm)'[^{}\n\r]{0,2000}\}")


class _LineReader:
    """Complete lines appended to a file since the last call; restarts at 0 on truncation or replacement."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._inode: tuple[int, int] | None = None
        self._partial = b""
        self.restarted = False

    def read_lines(self, separators: bytes = b"\n") -> list[bytes]:
        """New complete lines (without separators); sets ``restarted`` when the file started over."""
        self.restarted = False
        if self._unchanged():
            return []
        try:
            with open_no_follow(self.path) as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    return []
                self._check_identity((st.st_dev, st.st_ino), st.st_size)
                if st.st_size == self._offset:
                    return []
                f.seek(self._offset)
                chunk = f.read(MAX_READ_BYTES)
        except OSError:  # gone, or a symlink the job put there (never followed)
            return []
        self._offset += len(chunk)
        return self._split(chunk, separators)

    def _unchanged(self) -> bool:
        """Cheap path for the common tick: one stat, no open, when nothing was appended."""
        try:
            st = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return True
        return (st.st_dev, st.st_ino) == self._inode and st.st_size == self._offset

    def _check_identity(self, inode: tuple[int, int], size: int) -> None:
        if self._inode is None:
            self._inode = inode
        elif inode != self._inode or size < self._offset:
            logger.debug("%s: truncated or replaced, reading from the start", self.path)
            self._inode, self._offset, self._partial = inode, 0, b""
            self.restarted = True

    def _split(self, chunk: bytes, separators: bytes) -> list[bytes]:
        data = self._partial + chunk
        for sep in separators[1:]:
            data = data.replace(bytes([sep]), separators[:1])
        lines = data.split(separators[:1])
        self._partial = lines.pop()
        if len(self._partial) > MAX_LINE_BYTES:
            self._partial = b""
        return [line for line in lines if line.strip()]


def _finite(value: object) -> float | None:
    """A finite number as float; None for anything else (NaN, inf, strings, bools)."""
    # type() rather than isinstance: bool is an int subclass and must not count as a number
    if type(value) not in (int, float) or not math.isfinite(value):
        return None
    return float(value)


def _whole(value: object) -> int | None:
    """A non-negative integral number as int; None otherwise."""
    number = _finite(value)
    return int(number) if number is not None and number >= 0 else None


def _parse_records(lines: list[bytes]) -> list[dict]:
    """JSON objects among ``lines``; malformed lines are skipped."""
    if not lines:
        return []
    if not all(line.lstrip()[:1] == b"{" and line.rstrip()[-1:] == b"}" for line in lines):
        return parse_records(lines)
    try:
        # one C-level parse for the whole batch (a backlog of 100k lines is common after a restart)
        records = json.loads(b"[" + b",".join(lines) + b"]")
    except (ValueError, UnicodeDecodeError):
        records = None
    if records is None or len(records) != len(lines):
        # a line holding two objects would merge into the batch: a count mismatch means parse line by line
        return parse_records(lines)
    return [r for r in records if type(r) is dict]


#: record fields copied into progress when present and finite
_PROGRESS_FIELDS = (("total_steps", _whole), ("epoch", _finite), ("tokens_per_s", _finite), ("eval_loss", _finite))


class MetricsTail:
    """Follows one job's metrics.jsonl; one instance per job, polled every tick."""

    def __init__(self, path: Path, attempt_started_at: float | None = None) -> None:
        self.path = Path(path)
        self.attempt_started_at = attempt_started_at
        self._reader = _LineReader(self.path)
        self._reset()

    def _reset(self) -> None:
        self._latest: dict[str, float | int | None] = dict.fromkeys(PROGRESS_KEYS)
        self._seen_progress = False
        self._anchor: tuple[int, float] | None = None  # (step, time) of this attempt's first step record
        self._newest: tuple[int, float] | None = None
        self._last_record_at: float | None = None
        self._last_checkpoint: str | None = None
        self._tail: deque[dict] = deque(maxlen=TAIL_RECORDS)
        self.new_records: list[dict] = []

    def poll(self) -> bool:
        """Read the complete lines appended since the last call; True if any record was new."""
        lines = self._reader.read_lines()
        if self._reader.restarted:
            self._reset()
        read_at = time.time()
        self.new_records = _parse_records(lines)
        for record in self.new_records:
            self._apply(record, read_at)
        return bool(self.new_records)

    def _apply(self, record: dict, read_at: float) -> None:
        at = _finite(record.get("time"))
        at = read_at if at is None else at
        self._last_record_at = at
        self._tail.append(record)
        if record.get("type") == RECORD_CHECKPOINT and isinstance(record.get("path"), str):
            self._last_checkpoint = record["path"]
        self._apply_progress(record, at)

    def _apply_progress(self, record: dict, at: float) -> None:
        latest = self._latest
        for key, convert in _PROGRESS_FIELDS:
            if key in record:
                value = convert(record[key])
                if value is not None:
                    latest[key] = value
                    self._seen_progress = True
        loss = record.get("loss")
        if type(loss) in (int, float) and record.get("type") != RECORD_EVAL:
            # a NaN loss is news: it replaces the last finite one with null rather than hiding it
            latest["loss"] = _finite(loss)
            self._seen_progress = True
        step = _whole(record.get("step"))
        if step is not None:
            self._apply_step(step, at)

    def _apply_step(self, step: int, at: float) -> None:
        self._seen_progress = True
        self._latest["step"] = step
        in_attempt = self.attempt_started_at is None or at >= self.attempt_started_at
        if not in_attempt:
            return
        # a step going backwards is a resume from an earlier checkpoint: throughput starts over
        if self._anchor is None or (self._newest is not None and step < self._newest[0]):
            self._anchor = (step, at)
        self._newest = (step, at)

    def _eta_s(self) -> int | None:
        total = self._latest["total_steps"]
        if total is None or self._anchor is None or self._newest is None:
            return None
        (step0, t0), (step1, t1) = self._anchor, self._newest
        if step1 <= step0 or t1 <= t0:
            return None
        rate = (step1 - step0) / (t1 - t0)
        return max(0, round((total - step1) / rate))

    @property
    def progress(self) -> dict | None:
        """{step, total_steps, epoch, loss, eval_loss, tokens_per_s, eta_s}, or None before any progress."""
        if not self._seen_progress:
            return None
        return {**self._latest, "eta_s": self._eta_s()}

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


def _number(value: object) -> object:
    """transformers 5 prints floats as strings ('2.1', formatted with .4g); turn those back into numbers."""
    if not isinstance(value, str):
        return value
    try:
        return float(value)
    except ValueError:
        return None


def _parse_hf_dict(text: str) -> dict | None:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


class LogProgress:
    """Progress of a command job without metrics, from the Trainer's log dicts printed into output.log."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._reader = _LineReader(self.path)
        self._latest: dict[str, float | int | None] = dict.fromkeys(PROGRESS_KEYS)
        self._seen = False

    def poll(self) -> bool:
        """Read lines appended since the last call; True if a new log dict was found."""
        # tqdm redraws its bar with \r, so both end a line here
        lines = self._reader.read_lines(b"\n\r")
        if self._reader.restarted:
            self._latest, self._seen = dict.fromkeys(PROGRESS_KEYS), False
        found = False
        for line in lines:
            for match in _HF_DICT.finditer(line.decode("utf-8", "replace")):
                found = self._apply(_parse_hf_dict(match.group(0))) or found
        return found

    def _apply(self, logged: dict | None) -> bool:
        if not logged:
            return False
        for key in ("loss", "eval_loss", "epoch"):
            if key in logged:
                self._latest[key] = _finite(_number(logged[key]))
        self._seen = True
        return True

    @property
    def progress(self) -> dict | None:
        """Same keys as MetricsTail.progress; step, total_steps and eta_s stay None (the dicts lack them)."""
        return dict(self._latest) if self._seen else None
