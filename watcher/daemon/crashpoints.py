"""Crash points: a documented test switch that ends the watcher process at a named step, as a SIGKILL would.

``TRAINQ_WATCHER_CRASH=POINT:GLOB[,POINT:GLOB…]`` in the watcher's environment makes it call
``os._exit(CRASH_EXIT_CODE)`` right after step POINT for job ids matching GLOB: no cleanup, no final
status.json, nothing flushed that was not already on disk. Tests use it to check that every crash
between two writes of a multi-step change (a retry, a start) is finished by the next watcher.
Never set it outside tests.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from fnmatch import fnmatchcase

from trainq.watcher.spec.errors import WatcherError

logger = logging.getLogger(__name__)

#: env variable of the crash-point test switch: ``POINT:GLOB[,POINT:GLOB…]``
ENV_WATCHER_CRASH = "TRAINQ_WATCHER_CRASH"
#: the exit status of a watcher ended by a crash point (tests tell it from a real failure)
CRASH_EXIT_CODE = 86
#: the named points, in the order a retry.flag is honoured (finishing.py) and a job starts (starting.py)
POINTS = (
    "retry-saved",  # run.json says pending, the folder is still in failed/ with its retry.flag
    "retry-moved",  # the folder is in pending/, its retry.flag not yet removed
    "retry-done",  # retry.flag removed; only in-memory bookkeeping remained
    "start-moved",  # the folder is in running/, no supervisor forked yet
    "concluded",  # an attempt's end is known in memory; run.json and the folder move not yet written
)


class BadCrashSpec(WatcherError):
    """Raised when TRAINQ_WATCHER_CRASH cannot be parsed."""


@dataclass(frozen=True)
class CrashPoints:
    """Parsed TRAINQ_WATCHER_CRASH: (point, job id glob) pairs."""

    rules: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, value: str | None) -> CrashPoints:
        """``"retry-saved:job-*"`` → CrashPoints; BadCrashSpec naming the bad part."""
        rules = []
        for part in (value or "").split(","):
            if not part.strip():
                continue
            point, sep, glob = part.strip().partition(":")
            if not sep or point not in POINTS or not glob:
                raise BadCrashSpec(
                    f"{ENV_WATCHER_CRASH}: {part!r} is not POINT:GLOB with POINT one of {', '.join(POINTS)}"
                )
            rules.append((point, glob))
        return cls(tuple(rules))

    def reached(self, point: str, job_id: str) -> None:
        """End the process at once when a rule names this point and job (a test switch)."""
        for rule_point, glob in self.rules:
            if rule_point == point and fnmatchcase(job_id, glob):
                logger.warning("job %s: crash point %s reached (%s); exiting now", job_id, point, ENV_WATCHER_CRASH)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os._exit(CRASH_EXIT_CODE)
