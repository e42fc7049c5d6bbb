"""sbatch off the watcher's loop: one worker thread runs the submissions, in order, while the loop goes on.

The loop writes each attempt's ``slurm.sh`` and ``slurm.json`` (with its tag) itself, *before* it hands the sbatch
command line to the worker, so a watcher that dies with submissions still queued here finds them again by their
tag exactly as it finds an sbatch that got no answer (nothing is submitted twice, nothing is lost). The worker
only runs sbatch and keeps the answer; the loop collects answers (``take``) and decides. A byte on a pipe
(``wake_fd``) wakes the loop when an answer is in. One worker, so a burst reaches the controller one sbatch at a
time, as a user's shell loop would.
"""

from __future__ import annotations

import collections
import os
import queue
import subprocess
import threading
from dataclasses import dataclass

from trainq.watcher.slurm.state import run


@dataclass(frozen=True)
class Answer:
    """What one sbatch said: its exit status (None: no answer in time, -1: could not be run), stdout, stderr."""

    returncode: int | None
    stdout: str = ""
    stderr: str = ""


class Submitter:
    """A worker thread that runs queued sbatch command lines one after the other."""

    def __init__(self, timeout_s: float, env: dict[str, str] | None = None) -> None:
        self.timeout_s, self.env = timeout_s, env
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: collections.deque[tuple[str, Answer]] = collections.deque()
        self._queued = 0
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, key: str, argv: list[str]) -> None:
        """Queue ``argv`` (an sbatch command line) under ``key``; its answer comes back from ``take``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trainq-sbatch", daemon=True)
            self._thread.start()
        with self._lock:
            self._queued += 1
        self._todo.put((key, list(argv)))

    @property
    def queued(self) -> int:
        """Submissions handed over and not yet taken back (queued, running, or answered)."""
        with self._lock:
            return self._queued

    def take(self, limit: int | None = None) -> list[tuple[str, Answer]]:
        """The answers in since the last call (at most ``limit``), in submission order. While answers remain, the
        wake fd stays readable, so the loop comes back for them at once."""
        answers: list[tuple[str, Answer]] = []
        while self._done and (limit is None or len(answers) < limit):
            answers.append(self._done.popleft())
        with self._lock:
            self._queued -= len(answers)
        if not self._done:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except (BlockingIOError, OSError):
                pass
            if self._done:  # one came in while draining: keep the loop awake for it
                self._poke()
        return answers

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the loop will look anyway) or closed (the watcher is going)

    def wake_fd(self) -> int:
        return self._wake_r

    def close(self) -> None:
        """Stop after the sbatch running now (if any); submissions still queued are found by their tags later."""
        if self._closed:
            return
        self._closed = True
        self._todo.put(None)
        if self._thread is not None:
            self._thread.join(timeout=0.2)
        if self._thread is None or not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            key, argv = item
            self._done.append((key, _sbatch(argv, self.timeout_s, self.env)))
            self._poke()


def _sbatch(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> Answer:
    """One sbatch run with ``env`` (None: the watcher's): with --export=ALL that is the batch job's starting
    environment (batch.sbatch_env)."""
    try:
        done = run(argv, timeout_s, env)
    except subprocess.TimeoutExpired:
        return Answer(None, "", f"sbatch did not answer in {timeout_s:g} s")
    except OSError as exc:
        return Answer(-1, "", f"cannot run {argv[0]} ({exc.strerror}); install the Slurm client or fix PATH")
    return Answer(done.returncode, done.stdout, done.stderr)
