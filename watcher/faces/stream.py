"""Lines and records of a job's files at exact byte offsets: what `trainq serve` streams, as plain data.

A line is the text up to a ``\\n`` (``\\r\\n`` counts as one end); a lone ``\\r`` ends a "progress"
segment (how progress bars redraw themselves). Each piece carries the byte offset just past its
end, so a client that saw a piece can resume right after it, across reconnects, server and watcher
restarts: the job's files are only ever appended to. A piece not yet ended stays held (it is read
again once more bytes arrive) unless the job has ended, or it grew past ``MAX_LINE_BYTES``.
No asyncio, no web framework: the server wraps these in server-sent events.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainq.watcher.spec.contract import ATTEMPT_BANNER_PREFIX, JobPaths

#: the longest piece sent as one event; a longer unended piece goes out in cuts of this size (bytes)
MAX_LINE_BYTES = 64 * 1024
#: the most bytes one read takes from a file; a client further behind catches up over several reads
READ_BYTES = 1024 * 1024
#: job folders, in the order a job passes through them; the last two mean the job has ended
STATES = ("pending", "running", "done", "failed")
ENDED_STATES = frozenset({"done", "failed"})
#: what a job id may look like (docs/contract.md, the inbox: the file's stem with other characters replaced, ≤ 64)
_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: ANSI escapes: CSI (colours, cursor moves), OSC (titles, links) ended by BEL or ST, and two-byte escapes
_ANSI = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")
#: other control bytes a terminal would not print (tab stays)
_CONTROL = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]")

#: kinds of log pieces (the SSE event type; "message" is what EventSource.onmessage receives)
LINE, ATTEMPT, PROGRESS = "message", "attempt", "progress"


@dataclass(frozen=True)
class Piece:
    """One line (or progress segment, or attempt banner) and the offset just past its end in the file."""

    end: int
    kind: str
    text: str


def clean(raw: bytes) -> str:
    """The text of a raw line as a terminal would show it: ANSI escapes and control bytes removed."""
    return _CONTROL.sub(b"", _ANSI.sub(b"", raw)).decode("utf-8", errors="replace")


def split_log(data: bytes, base: int, final: bool = False) -> tuple[list[Piece], int]:
    """Pieces of ``data`` read at offset ``base``, and how many bytes they consumed (the rest is held).

    ``final``: the job has ended, so an unended last piece is complete too.
    """
    pieces: list[Piece] = []
    start, size = 0, len(data)
    for match in re.finditer(rb"\r\n|\n|\r", data):
        if match.group() == b"\r" and match.end() == size and not final:
            break  # maybe the first half of \r\n: wait for the next byte
        pieces.append(_piece(data[start : match.start()], base + match.end(), match.group() == b"\r"))
        start = match.end()
    while size - start > MAX_LINE_BYTES or (final and start < size):
        cut = _cut(data, start, min(size, start + MAX_LINE_BYTES))
        pieces.append(_piece(data[start:cut], base + cut, False))
        start = cut
    return pieces, start


def _piece(raw: bytes, end: int, carriage_return: bool) -> Piece:
    text = clean(raw)
    if carriage_return:
        return Piece(end, PROGRESS, text)
    return Piece(end, ATTEMPT if text.startswith(ATTEMPT_BANNER_PREFIX) else LINE, text)


def _cut(data: bytes, start: int, stop: int) -> int:
    """A cut point at or before ``stop`` that does not split a UTF-8 character."""
    cut = stop
    while cut > start + 1 and cut < len(data) and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return cut


def split_records(data: bytes, base: int, final: bool = False) -> tuple[list[tuple[int, str]], int]:
    """metrics.jsonl records in ``data`` (read at ``base``) as (offset past the line, one-line JSON).

    Lines that are not a JSON object are skipped (consumed, never sent). Non-finite numbers,
    which JSON cannot carry, become the strings "NaN", "Infinity", "-Infinity".
    """
    records: list[tuple[int, str]] = []
    start = 0
    while (newline := data.find(b"\n", start)) >= 0 or (final and start < len(data)):
        stop = newline if newline >= 0 else len(data)
        record = _record(data[start:stop])
        start = stop + 1 if newline >= 0 else stop
        if record is not None:
            records.append((base + start, record))
    if len(data) - start > READ_BYTES // 2:
        start = len(data)  # a half-megabyte line without an end is no record: skip it
    return records, start


def _record(raw: bytes) -> str | None:
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict):
        return None
    return json.dumps(_finite(record), separators=(",", ":"), ensure_ascii=False)


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def read_from(path: Path, offset: int, limit: int = READ_BYTES) -> bytes:
    """Up to ``limit`` bytes of ``path`` from ``offset``; b"" when it does not exist (yet).

    A symlink is not followed: a job cannot make the server read a file outside its folder.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        return os.pread(fd, limit, offset)
    finally:
        os.close(fd)


def file_size(path: Path) -> int:
    """Bytes in ``path``; 0 when it does not exist."""
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def tail_offset(path: Path, lines: int) -> int:
    """The offset where the last ``lines`` complete lines of ``path`` begin (0 when it has fewer)."""
    size = file_size(path)
    window = min(size, READ_BYTES)
    data = read_from(path, size - window, window)
    end = data.rfind(b"\n") + 1  # past the last complete line
    cut = end
    for _ in range(max(0, lines)):
        cut = data.rfind(b"\n", 0, max(0, cut - 1)) + 1
        if cut == 0:
            break
    if cut == 0 and size > window:
        cut = data.find(b"\n") + 1  # the window began inside a line: start at the next one
    return size - window + cut


def resume_offset(header: str | None, query: str | None, path: Path, tail: str | None = None) -> int:
    """Where a stream starts: Last-Event-ID (a reconnect), else ``?from=N|end``, else ``?tail=N``, else 0.

    An offset past the end of the file (a removed job's id used again) starts over at 0.
    """
    for given in (header, query):
        if given is None or given == "":
            continue
        if given == "end":
            return file_size(path)
        offset = int(given) if given.isdigit() else 0
        return offset if offset <= file_size(path) else 0
    if tail is not None and tail.isdigit():
        return tail_offset(path, int(tail))
    return 0


@dataclass(frozen=True)
class JobPlace:
    """Where a job's folder is now."""

    job_id: str
    state: str
    paths: JobPaths

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES


def is_job_id(job_id: str) -> bool:
    """True for a string that can name a job folder (no separators, not "." or "..")."""
    return bool(_ID.fullmatch(job_id)) and job_id not in (".", "..")


def find_job(root: Path, job_id: str) -> JobPlace | None:
    """The folder holding ``job_id`` under one of the state folders, or None; never looks outside them."""
    if not is_job_id(job_id):
        return None
    for _ in range(2):  # a job moving between two looks is found on the second
        for state in STATES:
            folder = root / state / job_id
            if folder.is_dir() and not folder.is_symlink():
                return JobPlace(job_id, state, JobPaths(folder))
    return None


def sse(data: str, event: str | None = None, event_id: str | int | None = None) -> str:
    """One server-sent event (data is one line: the callers never pass a newline)."""
    head = (f"event: {event}\n" if event and event != LINE else "") + (
        f"id: {event_id}\n" if event_id is not None else ""
    )
    return f"{head}data: {data}\n\n"
