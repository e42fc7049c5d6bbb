"""Progress of a job with no trainq code in it, from what its trainer prints into output.log.

Read: the Hugging Face Trainer's log dicts (``{'loss': '2.1', 'grad_norm': ..., 'learning_rate': ...,
'epoch': ...}``, ``{'eval_loss': ...}``), its tqdm bar (`` 30%|███  | 36/120 [00:18<00:43, 1.95it/s]``:
step and total) and Lightning's default bar (``Epoch 2:  45%|████▌ | 45/100 [... , loss=2.3]``:
fractional epoch and the losses on it). tqdm redraws with ``\\r``, so the newest bar is the last
``\\r``-separated segment, often still unterminated: it is read from the reader's unfinished line.
"""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

from trainq.watcher.faces.progress import Fields, LineReader, finite, whole
from trainq.watcher.spec.contract import ATTEMPT_BANNER_PREFIX

#: a Hugging Face Trainer log dict as printed on stdout: {'loss': 2.1, 'grad_norm': 0.5, ...}
_HF_DICT = re.compile(r"\{'(?:loss|eval_loss|train_loss|epoch|learning_rate|grad_norm)'[^{}\n\r]{0,2000}\}")
#: a tqdm bar: optional description, percentage, N/M, [elapsed<remaining, rate, postfix]
#: (searched, the description being what comes before: a leading ``(.*?)\s*`` made a line of spaces
#: quadratic, and a job's one 60 KB line held the watcher for a minute)
_BAR = re.compile(
    r"\d{1,3}%\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+)\s*"
    r"\[(?P<elapsed>[\d:]+)<(?P<remaining>[\d:]+|\?)(?P<rest>[^\]]*)\]\s*$"
)
#: longest line taken for a progress bar (a terminal line; longer ones are not bars and cost no search)
MAX_BAR_CHARS = 2000
#: Lightning's training bar description
_LIGHTNING_EPOCH = re.compile(r"^Epoch (\d+)\s*:?$")
#: key=value pairs of a tqdm postfix (Lightning puts its logged metrics there)
_POSTFIX = re.compile(r"\b(\w+)=([-+0-9.eE]+|nan|inf)")  # \b: a long word is scanned once, not from each letter
#: Trainer dict key -> progress field
_DICT_FIELDS = {
    "loss": "loss",
    "eval_loss": "eval_loss",
    "epoch": "epoch",
    "learning_rate": "lr",
    "grad_norm": "grad_norm",
}
#: Lightning postfix key -> progress field
_POSTFIX_FIELDS = {"loss": "loss", "train_loss": "loss", "val_loss": "eval_loss", "eval_loss": "eval_loss"}


class _BarFields(Fields):
    """Fields whose ETA falls back on tqdm's own remaining-time estimate."""

    remaining_s: int | None = None

    def eta_s(self) -> int | None:
        computed = super().eta_s()
        return computed if computed is not None else self.remaining_s


def _seconds(clock: str) -> int | None:
    """tqdm's ``[H:]MM:SS`` as seconds."""
    try:
        parts = [int(p) for p in clock.split(":")]
    except ValueError:
        return None
    total = 0
    for part in parts:
        total = total * 60 + part
    return total


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


def hf_dicts(text: str) -> list[dict]:
    """Every Hugging Face Trainer log dict printed in ``text`` (best eval loss of a command job's sweep)."""
    found = []
    for match in _HF_DICT.finditer(text):
        parsed = _parse_hf_dict(match.group(0))
        if parsed is not None:
            found.append(parsed)
    return found


class LogProgress:
    """Follows one job's output.log for the log dicts and progress bars its trainer prints."""

    def __init__(self, path: Path, tail_bytes: int | None = None) -> None:
        """``tail_bytes``: read only the file's last bytes (a finished job looked at once)."""
        self.path = path if isinstance(path, Path) else Path(path)  # Path(a Path) parses it again
        self._reader = LineReader(self.path)
        if tail_bytes is not None:
            self._reader.start_near_end(tail_bytes)
        self._reset()

    def _reset(self) -> None:
        self.fields = _BarFields()
        self._bar_total: int | None = None  # the training bar's total, from the attempt's first bar
        self._last_partial = b""

    def follow(self, path: Path) -> None:
        """The job's folder moved (running/ -> done/): the same file under its new name, read on from where it was."""
        self.path = self._reader.path = Path(path)

    def poll(self, now: float | None = None) -> bool:
        """Read what was appended since the last call (at ``now``, default the clock); True if progress changed."""
        lines = self._reader.read_lines(b"\n\r")
        if self._reader.restarted:
            self._reset()
        read_at = time.time() if now is None else now
        found = False
        for line in lines:
            found = self._apply_line(line.decode("utf-8", "replace"), read_at) or found
        partial = self._reader.partial
        if partial and partial != self._last_partial:
            self._last_partial = partial
            found = self._apply_bar(partial.decode("utf-8", "replace"), read_at) or found
        return found

    def _apply_line(self, line: str, read_at: float) -> bool:
        if line.startswith(ATTEMPT_BANNER_PREFIX):
            # a new attempt: its bar may have another total, and only its own steps make its rate
            self._bar_total = None
            self.fields.restart_rate()
            return False
        found = False
        for match in _HF_DICT.finditer(line):
            found = self._apply_dict(_parse_hf_dict(match.group(0)), read_at) or found
        return self._apply_bar(line, read_at) or found

    def _apply_dict(self, logged: dict | None, read_at: float) -> bool:
        if not logged:
            return False
        for key, field in _DICT_FIELDS.items():
            if key in logged:
                self.fields.set(field, finite(_number(logged[key])), read_at)
        return True

    def _apply_bar(self, text: str, read_at: float) -> bool:
        text = text.strip()
        match = _BAR.search(text) if len(text) <= MAX_BAR_CHARS and text.count("%|") <= 2 else None
        if match is None:
            return False
        n, total = int(match["n"]), int(match["total"])
        desc = text[: match.start()].strip()
        epoch = _LIGHTNING_EPOCH.match(desc)
        if epoch:
            return self._apply_lightning(int(epoch.group(1)), n, total, match["rest"], read_at)
        if desc or total <= 0:
            return False  # another bar: loading weights, writing shards, a validation loop
        if self._bar_total is None:
            self._bar_total = total  # the Trainer's bar comes first; its eval bars have other totals
        if total != self._bar_total:
            return False
        fields = self.fields
        fields.set("total_steps", whole(total), read_at)
        if n == 0 and (fields.values.get("step") or 0) > 0:
            return True  # the bar starts at 0 on every attempt, a resumed one too: 0 says nothing of the step
        fields.step(n, read_at, read_at)
        fields.remaining_s = _seconds(match["remaining"]) if match["remaining"] != "?" else None
        return True

    def _apply_lightning(self, epoch: int, n: int, total: int, rest: str, read_at: float) -> bool:
        """Lightning's bar counts batches of one epoch: it gives the fractional epoch and the postfix losses."""
        if total > 0:
            self.fields.set("epoch", epoch + n / total, read_at)
        for key, value in _POSTFIX.findall(rest):
            if key in _POSTFIX_FIELDS:
                self.fields.set(_POSTFIX_FIELDS[key], finite(_number(value)), read_at)
        return True

    @property
    def progress(self) -> dict | None:
        """Same keys as MetricsTail.progress; None before anything was read."""
        return self.fields.progress()
