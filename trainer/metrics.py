"""metrics.jsonl: one JSON object per line, appended and flushed as things happen (docs/contract.md, metrics.jsonl)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from trainq.watcher.spec.contract import RECORD_EVENT
from trainq.watcher.spec.records import parse_records


def finite_or_none(value: object) -> object:
    """Floats that JSON cannot hold (NaN, inf) become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends records to metrics.jsonl, one flushed line each (readers may tail it at any time)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8", buffering=1)

    def write(self, record_type: str, **fields: object) -> dict:
        """Write one record of ``record_type``; ``time`` (unix seconds) is added when absent."""
        record = {"type": record_type, **{k: finite_or_none(v) for k, v in fields.items()}}
        record.setdefault("time", time.time())
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        return record

    def event(self, name: str, message: str, **fields: object) -> dict:
        """Write an ``event`` record (``event`` name, human ``message``, extra fields)."""
        return self.write(RECORD_EVENT, event=name, message=message, **fields)

    def sync(self) -> None:
        """Flush to disk (at the end of a run)."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def read_records(path: Path) -> list[dict]:
    """Every parseable record in ``path`` (a torn last line is skipped)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    return parse_records(lines)
