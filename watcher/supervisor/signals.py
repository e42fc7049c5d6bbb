"""The watcher's own signal handlers: SIGINT/SIGTERM ask the daemon to stop; every signal wakes its loop.

They live beside the daemon, which installs them (daemon.py). A supervisor the watcher forks drops them
at once (``_detach`` in watcher/supervisor/pool.py) and handles its own (watcher/supervisor/attempt.py).
"""

from __future__ import annotations

import signal
from typing import Any


class WatcherSignals:
    """What the watcher's signal handlers saw; the handlers only set these attributes."""

    def __init__(self) -> None:
        self.stop_requested = False
        self.last_signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._previous_wakeup_fd = -1

    def restore(self) -> None:
        """Put back the handlers and wakeup fd that were there before ``install_watcher_signal_handlers``."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_wakeup_fd)


def install_watcher_signal_handlers(wake_fd: int) -> WatcherSignals:
    """SIGINT/SIGTERM set ``.stop_requested``; every signal (SIGCHLD too) writes a byte to ``wake_fd``.

    ``wake_fd`` must be non-blocking (e.g. the write end of ``os.pipe()`` after ``os.set_blocking(w, False)``);
    the watcher polls its read end to wake when asked to stop or when a supervisor it forked exits.
    Call from the main thread.
    """
    state = WatcherSignals()

    def on_stop(signum: int, _frame: object) -> None:
        state.stop_requested = True
        state.last_signal = signum

    def on_child(_signum: int, _frame: object) -> None:
        """A Python-level handler is needed for the wakeup fd to see SIGCHLD; the byte is the point."""

    for sig in (signal.SIGINT, signal.SIGTERM):
        state._previous[sig] = signal.signal(sig, on_stop)
    state._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, on_child)
    state._previous_wakeup_fd = signal.set_wakeup_fd(wake_fd, warn_on_full_buffer=False)
    return state
