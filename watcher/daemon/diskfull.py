"""A full disk degrades the watcher, never kills it (``DiskFullHandling``, one of the Watcher's steps).

When a write fails with ENOSPC/EDQUOT (status.json, run.json, a claim, a folder move) the watcher
notes it and, until space frees: accepts and starts nothing, concludes nothing (a job's final
state is never guessed from a failed write), keeps watching running jobs, and says so in
status.json (``watcher.disk_full``, ``watcher.problems``). So that this write gets through, the
watcher holds RESERVE_BYTES in ``.trainq-reserve`` while all is well and deletes it when the disk
fills. Every DISK_FULL_RETRY_S it looks again: once the reserve can be taken back with room to
spare and status.json written, it rebuilds its view of the queue from the folders (exactly as
after a restart, so no half-done step is trusted) and carries on. Supervisors keep their job's lock until its exit record is written, retrying, so
the record survives and the job ends where its exit code says.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainq.watcher.spec.units import iso_utc

if TYPE_CHECKING:
    from collections.abc import Callable

    from trainq.watcher.daemon.report import Report, ReportSource
    from trainq.watcher.spec.folders import QueueRoot

logger = logging.getLogger(__name__)

#: how often a watcher with a full disk tries to write again, seconds
DISK_FULL_RETRY_S = 1.0
#: space held back in the queue root's .trainq-reserve and released on a full disk (bytes)
RESERVE_BYTES = 256 * 1024
#: free space needed, beyond the reserve, before a watcher with a full disk resumes (bytes)
RESUME_MARGIN_BYTES = 256 * 1024
#: errno values that mean "no space left" (a full disk, or a full quota)
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """True for an OSError that says the disk (or quota) is full."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


@dataclass
class DiskFull:
    """Since when writes fail for lack of space, and the first one that did."""

    since: float
    where: str
    reason: str
    last_try: float

    def problem(self) -> str:
        """The line status.json's ``watcher.problems`` carries."""
        return (
            f"disk full since {iso_utc(self.since)} ({self.where}: {self.reason}); no job is accepted or "
            "started until space frees, running jobs go on"
        )


class DiskFullHandling:
    """Noting a full disk and getting out of it.

    Reads the root's reserve file and free space; changes only ``disk_full`` (every other step reads it
    and holds back while it is set); touches and writes the report.
    """

    def __init__(self, root: QueueRoot, report: Report) -> None:
        self.root = root
        self.report = report
        self.disk_full: DiskFull | None = None  # set while writes fail for lack of space

    def note_disk_full(self, exc: OSError, where: str) -> None:
        """A write failed for lack of space: stop accepting and starting work until it succeeds again."""
        if self.disk_full is not None:
            return
        now = time.time()
        self.disk_full = DiskFull(now, where, exc.strerror or str(exc), now)
        released = release_reserve(self.root.reserve_file)
        logger.warning(
            "queue: disk full (%s: %s); accepting and starting no work, retrying every %gs%s",
            where,
            exc.strerror or exc,
            DISK_FULL_RETRY_S,
            f"; released {released // 1024} KiB reserve for status.json" if released else "",
        )
        self.report.touch()

    def problems(self) -> list[str]:
        """What is wrong with the watcher itself, one line each (status.json ``watcher.problems``)."""
        return [self.disk_full.problem()] if self.disk_full is not None else []

    def retry_after_disk_full(self, now: float, source: ReportSource, rebuild: Callable[[], None]) -> None:
        """Try status.json again (``source`` says what it holds); once it is written, ``rebuild`` the queue's
        view from the folders and resume."""
        full = self.disk_full
        if full is None or now - full.last_try < DISK_FULL_RETRY_S:
            return
        full.last_try = now
        try:
            self.report.write(source, now, force=True)  # says "disk full" while it lasts
            if free_bytes(self.root.path) < RESERVE_BYTES + RESUME_MARGIN_BYTES:
                return
            take_reserve(self.root.reserve_file)
            self.disk_full = None
            rebuild()
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self.disk_full = full
            return
        if self.disk_full is not None:  # a step of the rebuild ran out of space again
            self.disk_full = dataclasses.replace(self.disk_full, since=full.since)
            return
        logger.info("queue: disk has space again (full for %.0fs); accepting and starting work again", now - full.since)
        self.report.touch()


def free_bytes(path: Path) -> int:
    """Bytes free to unprivileged writers on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def take_reserve(path: Path, size: int = RESERVE_BYTES) -> None:
    """Make sure ``path`` holds ``size`` allocated bytes (real blocks, not a sparse file); OSError if no room."""
    try:
        if os.stat(path).st_blocks * 512 >= size:
            return
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        _allocate(fd, size)
    except OSError:
        os.close(fd)
        release_reserve(path)
        raise
    os.close(fd)


def _allocate(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    os.ftruncate(fd, 0)
    block = b"\0" * 65536
    for _ in range(0, size, len(block)):
        os.write(fd, block)


def release_reserve(path: Path) -> int:
    """Delete the reserve; the bytes it held (0 when there was none)."""
    try:
        held = os.stat(path).st_blocks * 512
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return held
