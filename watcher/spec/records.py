"""Reading what a job writes: the tail of ``output.log`` and the records of ``metrics.jsonl``.

The daemon's diagnosis, the faces' progress and sweep views, and the trainer all read these files the
same way: never following a link, never blocking on a FIFO, skipping torn or foreign lines.
"""

from __future__ import annotations

import json
import os
import re
import stat

from trainq.watcher.spec.fsutil import exists, read_regular

#: terminal colour, cursor and OSC sequences (stripped from log text shown to people)
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


def strip_ansi(text: str) -> str:
    """Remove terminal colour and cursor codes."""
    return _ANSI.sub("", text)


def read_tail(path: str | os.PathLike, max_bytes: int = 65536) -> str:
    """The last ``max_bytes`` of a log, decoded leniently, without ANSI codes or a cut first line (unless that
    line is all there is: the end of a log that never wrote a newline is still its end)."""
    if not exists(path):
        return ""  # most often metrics.jsonl of a job that writes none: no exception raised and caught
    try:
        data, size = read_regular(path, max_bytes, tail=True)  # b"" for a folder or a FIFO
    except OSError:  # gone, or a symlink (never followed)
        return ""
    if size > max_bytes and b"\n" in data:
        data = data.partition(b"\n")[2]  # the first line was cut in the middle
    return strip_ansi(data.decode("utf-8", errors="replace"))


def read_metrics_tail(path: str | os.PathLike, max_bytes: int = 65536) -> list[dict]:
    """The JSON objects in the last ``max_bytes`` of metrics.jsonl (broken lines skipped)."""
    return parse_records(read_tail(path, max_bytes).splitlines())


def parse_records(lines: list[str] | list[bytes]) -> list[dict]:
    """The JSON objects among ``lines`` (metrics.jsonl records); torn or foreign lines are skipped."""
    records = []
    for line in lines:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, (bytes) not UTF-8, or nested past Python's stack
            continue
        if isinstance(obj, dict):
            records.append(obj)
    return records


def append_record(path: str | os.PathLike, record: dict) -> bool:
    """Append one JSON line to a job's metrics.jsonl (the watcher's own ``event`` records): never through a link,
    never blocking on a FIFO, one write(2) so a concurrent writer's lines stay whole. False when it could not."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        os.write(fd, (json.dumps(record) + "\n").encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
