"""A full disk degrades the watcher, never kills it (a mixin of Watcher).

When a write fails with ENOSPC/EDQUOT (status.json, run.json, a claim, a folder move) the watcher
notes it and, until space frees: accepts and starts nothing, concludes nothing (a job's final
state is never guessed from a failed write), keeps watching running jobs, and says so in
status.json (``watcher.disk_full``, ``watcher.problems``) whenever that write gets through.
Every DISK_FULL_RETRY_S it tries again: once status.json can be written, it rebuilds its view of
the queue from the folders (exactly as after a restart, so no half-done step is trusted) and
carries on. Supervisors keep their job's lock until its exit record is written, retrying, so
the record survives and the job ends where its exit code says.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from .containment import is_disk_full
from .units import iso_utc

logger = logging.getLogger(__name__)

#: how often a watcher with a full disk tries to write again, seconds
DISK_FULL_RETRY_S = 1.0


@dataclass
class DiskFull:
    """Since when writes fail for lack of space, and the first one that did."""

    since: float
    where: str
    reason: str
    last_try: float

    def problem(self) -> str:
        """The line status.json's ``watcher.problems`` carries."""
        return (f"disk full since {iso_utc(self.since)} ({self.where}: {self.reason}); no job is accepted or "
                "started until space frees, running jobs go on")


class DiskFullHandling:
    """Noting a full disk and getting out of it (a mixin of Watcher)."""

    def note_disk_full(self, exc: OSError, where: str) -> None:
        """A write failed for lack of space: stop accepting and starting work until it succeeds again."""
        if self.disk_full is not None:
            return
        now = time.time()
        self.disk_full = DiskFull(now, where, exc.strerror or str(exc), now)
        logger.warning("queue: disk full (%s: %s); accepting and starting no work, retrying every %gs",
                       where, exc.strerror or exc, DISK_FULL_RETRY_S)
        self.report.touch()

    def problems(self) -> list[str]:
        """What is wrong with the watcher itself, one line each (status.json ``watcher.problems``)."""
        return [self.disk_full.problem()] if self.disk_full is not None else []

    def retry_after_disk_full(self, now: float) -> None:
        """Try status.json again; once it is written, rebuild from the folders and resume."""
        full = self.disk_full
        if full is None or now - full.last_try < DISK_FULL_RETRY_S:
            return
        full.last_try = now
        try:
            self.report.write(self, now, force=True)  # says "disk full" if it can, and probes for space
            self.disk_full = None
            self.rebuild_from_disk()
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
