"""loss.png off the critical path: a helper process imports matplotlib while the model trains.

``LossPlotter.start()`` launches ``python -m trainq.trainer.plotter``, which imports matplotlib at once (about a
second, on another core) and then waits for one JSON line on stdin naming the metrics file, the output and the
title. ``LossPlotter.request()`` sends it (the trainer then saves the model meanwhile) and ``wait()`` waits for the
picture (tens of ms). The helper runs at nice 10, so on
a busy machine it takes mostly idle CPU; if it has not finished importing by the end of training (it says
``ready`` on stdout when it has), cannot be started or fails, it is ended and the plot is drawn in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from trainq.watcher.spec.interpreter import safe_module_argv

#: how long finish() waits for the helper's picture before drawing it itself (s)
PLOT_TIMEOUT_S = 60


class LossPlotter:
    """A warm matplotlib in a child process, used once."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.pending: tuple[Path, Path, str] | None = None  # what request() asked for
        self.sent = False  # whether the helper got it

    def start(self) -> LossPlotter:
        try:
            self.proc = subprocess.Popen(
                safe_module_argv(sys.executable, "trainq.trainer.plotter"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
        except OSError:
            self.proc = None
        return self

    def plot(self, metrics_path: Path, out: Path, title: str) -> None:
        """Draw ``out``; in this process when the helper is missing or fails."""
        self.request(metrics_path, out, title)
        self.wait()

    def request(self, metrics_path: Path, out: Path, title: str) -> None:
        """Ask a ready helper to draw ``out`` and return at once; ``wait()`` finishes the job."""
        self.pending = (metrics_path, out, title)
        self.sent = self.proc is not None and self.is_ready() and self._send(metrics_path, out, title)

    def wait(self) -> None:
        """Until the requested picture is there; drawn in this process when the helper was not ready or failed."""
        assert self.pending is not None, "wait() without a request()"
        metrics_path, out, title = self.pending
        if not self.sent and self.proc is not None and self.is_ready():  # it got ready meanwhile
            self.sent = self._send(metrics_path, out, title)
        if self.sent and self._wait():
            return
        self.close()
        from trainq.trainer.artifacts import plot_loss

        plot_loss(metrics_path, out, title)

    def is_ready(self) -> bool:
        """Whether the helper has finished importing (its ``ready`` line is waiting on the pipe)."""
        import select

        assert self.proc is not None and self.proc.stdout is not None
        if not self.ready and select.select([self.proc.stdout], [], [], 0)[0]:
            self.ready = self.proc.stdout.readline().strip() == b"ready"
        return self.ready

    def _send(self, metrics_path: Path, out: Path, title: str) -> bool:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(
                json.dumps({"metrics": str(metrics_path), "out": str(out), "title": title}).encode() + b"\n"
            )
            self.proc.stdin.close()
            return True
        except (OSError, ValueError):  # the helper died (a SIGTERM to the process group); ValueError: already closed
            return False

    def _wait(self) -> bool:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=PLOT_TIMEOUT_S) == 0
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return False

    def close(self) -> None:
        """End an unused helper (an error path that never plotted)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def main() -> int:
    import os

    os.nice(10)  # mostly idle CPU: on a busy machine the import must not slow the training next to it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot

    from trainq.trainer.artifacts import plot_loss

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the trainer ended without asking
    request = json.loads(line)
    plot_loss(Path(request["metrics"]), Path(request["out"]), request["title"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
