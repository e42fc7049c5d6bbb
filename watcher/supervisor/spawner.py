"""A small helper process that forks job supervisors, so launching never forks the big watcher.

Forking the loaded watcher (60–90 MB, watchdog threads) costs ~3 ms in the watcher plus
copy-on-write faults in the child; forking this ~20 MB helper costs ~0.3 ms. Measured on a
trivial job: 10.8 ms from launch to the supervisor's exit when forked from the watcher, 7.0 ms
from here. The helper runs the same ``Supervisor.launch`` (lock first, then fork), so "lock
held" still means "attempt alive" and a helper that dies mid-launch leaves either a supervisor
holding the lock or no attempt at all — the states ``recover()`` already handles.

The helper keeps one supervisor forked and detached ahead of time (``Supervisor.warm_up``), so a
launch only hands it the job: it takes the lock, opens output.log and answers. The watcher hands it the
job itself, on a ``SOCK_SEQPACKET`` socket whose other end every waiting pooled supervisor reads
(pool.py's ``take_direct``): one message there, one answer back, and the helper is not on the launch's
path; it hears from a supervisor that took a job only when no other one waits, and forks the next one to wait
(pool.py's ``_Board``: a trivial job in a row of them does not wake the helper at all). Each supervisor
also writes a byte to a notice pipe whose read end the watcher holds, the moment its exit record is
written, so the watcher moves on without waiting for that process to be torn down and reaped.

When no pooled supervisor answers in time (none could be forked, or the machine is swamped) the watcher
asks the helper, which forks a supervisor for that launch alone. A request that a pooled supervisor
picks up after its deadline is refused by it once it holds the job's lock (``pool._take``), so a job is
never launched twice. Protocol over the helper's stdin/stdout, one JSON object per line:
  watcher → helper: ``{"spec": LaunchSpec.to_dict()}``
  helper → watcher: ``{"pid": N}`` or ``{"error": "..."}`` (one reply per request, in order),
                    and ``{"exited": N}`` whenever a supervisor it forked has been reaped.
The helper exits when its stdin closes or its parent (the watcher) is gone.

Like the supervisor package, this module starts processes, so it imports ``subprocess`` and ``signal``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import IO, cast

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import SpawnFailed
from trainq.watcher.spec.fsutil import drain
from trainq.watcher.spec.interpreter import safe_module_argv
from trainq.watcher.spec.units import iso_utc
from trainq.watcher.supervisor import LaunchSpec, Supervisor, is_alive
from trainq.watcher.supervisor.pool import DIRECT_MAX_BYTES

#: how long the watcher waits for the helper's answer to one launch before forking itself (seconds)
REPLY_TIMEOUT_S = 5.0
#: after the helper died mid-launch: how long to wait for a start record from a supervisor it may have forked
ORPHAN_START_WAIT_S = 2.0
#: how long a direct request waits for a pooled supervisor to take it before the helper forks one instead
DIRECT_TIMEOUT_S = 2.0
#: a lost helper is started again after this long, each further loss in a row twice as long, up to the max (s)
HELPER_RESTART_S = 1.0
HELPER_RESTART_MAX_S = 300.0
#: a helper that lived this long was not failing as it started: the next loss waits HELPER_RESTART_S again
HELPER_STEADY_S = 60.0

logger = logging.getLogger(__name__)


class SpawnerGone(Exception):
    """The helper process is not there (never started, exited, or stopped answering)."""


class Spawner:
    """The watcher's end: start the helper, ask it to launch, collect its exit notices."""

    #: the helper's stdin and stdout, set by ``start`` (pipes, so never None as Popen's Optional types allow)
    _to_helper: IO[bytes]
    _from_helper: IO[bytes]

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._exited: list[int] = []
        self._replies: list[dict] = []
        self._notices: int | None = None
        #: our end of the pooled supervisors' jobs socket (module docstring); None: launches go through the helper
        self._jobs: socket.socket | None = None

    def start(self) -> None:
        """Start the helper (a fresh interpreter importing only the supervisor's modules)."""
        notices, notify = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # supervisors must never block on it
        jobs, pool_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [*safe_module_argv(sys.executable, "trainq.watcher.supervisor.spawner"), "--notify-fd", str(notify)]
        try:
            self._proc = subprocess.Popen(
                [*argv, "--jobs-fd", str(pool_end.fileno())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
                bufsize=0,
                pass_fds=(notify, pool_end.fileno()),
            )
        except OSError:
            os.close(notices)
            jobs.close()
            raise
        finally:
            os.close(notify)
            pool_end.close()
        self._notices, self._jobs = notices, jobs
        self._to_helper, self._from_helper = cast(IO[bytes], self._proc.stdin), cast(IO[bytes], self._proc.stdout)
        os.set_blocking(self._from_helper.fileno(), False)

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """The helper's exit status once it exited (a signal as its negative number)."""
        return self._proc.returncode if self._proc is not None else None

    def filenos(self) -> list[int]:
        """The fds to select on: readable when the helper has news or a supervisor wrote its exit record."""
        fds = [self._from_helper.fileno()] if self.is_running else []
        return fds + ([self._notices] if self._notices is not None else [])

    def launch(self, spec: LaunchSpec) -> int:
        """Hand ``spec`` to a waiting pooled supervisor, or ask the helper to fork one; the supervisor's pid.

        SpawnFailed / SpawnerGone.
        """
        if not self.is_running:
            raise SpawnerGone("the spawner helper is not running")
        spec = dataclasses.replace(spec, job_dir=os.path.abspath(spec.job_dir))  # the answer names it so
        pid = self._launch_direct(spec)
        if pid is not None:
            return pid
        reply = self._ask_helper(spec)
        if "error" in reply and not is_alive(JobPaths(Path(spec.job_dir))):
            # a stale taker of the direct request (it refuses, pool._take) can hold the lock for a moment just as
            # the helper's supervisor tries it; with the lock free now, once more
            reply = self._ask_helper(spec)
        if "error" in reply:
            raise SpawnFailed(reply["error"])
        return int(reply["pid"])

    def _ask_helper(self, spec: LaunchSpec) -> dict:
        """The helper's answer to one launch: ``{"pid": N}`` or ``{"error": ...}``. SpawnerGone."""
        try:
            self._to_helper.write(json.dumps({"spec": spec.to_dict()}).encode() + b"\n")
        except (BrokenPipeError, OSError) as exc:
            raise SpawnerGone(f"cannot write to the spawner helper: {exc}") from None
        return self._next_reply(time.monotonic() + REPLY_TIMEOUT_S)

    def _launch_direct(self, spec: LaunchSpec) -> int | None:
        """The pid of the pooled supervisor that took ``spec`` from the jobs socket; None when none took it in
        DIRECT_TIMEOUT_S. SpawnFailed when one refused it in time (the job's lock held elsewhere, output.log).

        Past the deadline a supervisor that takes the request refuses it once it holds the lock (pool._take),
        so the request is dead once the deadline has passed and the lock is free. One that took the lock in
        time answers before it can release the lock, so "free lock, then no answer" means nobody took it.
        """
        if self._jobs is None:
            return None
        deadline = time.monotonic() + DIRECT_TIMEOUT_S
        request = json.dumps({"spec": spec.to_dict(), "deadline": deadline}).encode()
        if len(request) > DIRECT_MAX_BYTES:
            return None  # a huge environment: the helper's pipe takes any size
        try:
            self._jobs.send(request, socket.MSG_DONTWAIT)
        except OSError:  # ENOBUFS, EAGAIN (requests nobody reads pile up): the loop never blocks on a full socket
            return None
        while True:
            late = time.monotonic() > deadline
            held = late and is_alive(JobPaths(Path(spec.job_dir)))  # only past the deadline: not on every launch
            answer = self._direct_answer(spec)
            if answer is not None and "pid" in answer:
                return int(answer["pid"])
            if answer is not None and not answer.get("late") and not late:
                # a refusal read past the deadline is not trusted (our own lock probe above may have caused it):
                # the helper's launch below meets the same cause again and says so
                raise SpawnFailed(answer.get("error") or "a pooled supervisor refused the launch")
            if late and (not held or time.monotonic() > deadline + ORPHAN_START_WAIT_S):
                # whoever picks the request up from now on refuses it: the helper forks one (which says so
                # if the lock is still held: by an earlier attempt's supervisor, never by a taker of this one)
                return None
            select.select([self._jobs], [], [], max(0.0, deadline - time.monotonic()) if not late else 0.01)

    def _direct_answer(self, spec: LaunchSpec) -> dict | None:
        """The answer to ``spec``'s request on the jobs socket, if it came; answers to other requests are dropped."""
        assert self._jobs is not None
        while True:
            try:
                message = self._jobs.recv(65536, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                raise SpawnerGone(f"the pooled supervisors' socket failed: {exc}") from None
            if not message:  # every other holder closed it: the helper and each supervisor it forked are gone
                raise SpawnerGone("the spawner helper and its pooled supervisors are gone")
            try:
                answer = json.loads(message)
            except ValueError:
                continue
            if isinstance(answer, dict) and (answer.get("job_dir"), answer.get("attempt")) == (
                spec.job_dir,
                spec.attempt,
            ):
                return answer

    def _next_reply(self, deadline: float) -> dict:
        while True:
            if self._replies:
                return self._replies.pop(0)
            self._read_messages()
            if self._replies:
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.is_running:
                raise SpawnerGone("the spawner helper did not answer")
            select.select([self._from_helper], [], [], min(remaining, 0.5))

    def _read_messages(self) -> None:
        """Read what the helper wrote: exit notices to ``_exited``, launch answers to ``_replies``."""
        try:
            chunk = self._from_helper.read(65536)
        except (BlockingIOError, ValueError):
            chunk = None
        if chunk:
            self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for message in (json.loads(line) for line in lines if line.strip()):
            if "exited" in message:
                self._exited.append(int(message["exited"]))
            else:
                self._replies.append(message)

    def reaped(self) -> list[int]:
        """Pids of supervisors the helper has reaped since the last call (exit notices are drained too)."""
        self._drain_notices()
        if self.is_running:
            self._read_messages()
        exited, self._exited = self._exited, []
        return exited

    def _drain_notices(self) -> None:
        if self._notices is not None and drain(self._notices):
            os.close(self._notices)  # end of file: the helper and every supervisor it forked are gone
            self._notices = None

    def close(self) -> None:
        """Stop the helper; supervisors it forked keep running (they never depended on it)."""
        if self._notices is not None:
            os.close(self._notices)
            self._notices = None
        if self._jobs is not None:
            self._jobs.close()
            self._jobs = None
        if self._proc is None:
            return
        try:
            self._to_helper.close()
            self._proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()
        self._from_helper.close()
        self._proc = None


class SpawningSupervisor(Supervisor):
    """A Supervisor whose launches go through the helper, falling back to forking itself.

    A helper that is lost (it exited, was killed, stopped answering, or could not be started) is started again
    from the loop's ``reap`` after ``HELPER_RESTART_S``, each further loss in a row waiting twice as long (up to
    ``HELPER_RESTART_MAX_S``); launches in between fork in this process. A helper that lived
    ``HELPER_STEADY_S`` resets the wait, so only one that dies as it starts backs off far.
    """

    def __init__(self) -> None:
        super().__init__()
        self._spawner: Spawner | None = None
        #: when (monotonic) a lost helper may be started again; None: never lost
        self._restart_at: float | None = None
        self._restart_wait_s = HELPER_RESTART_S
        self._started_at = 0.0
        #: helpers started again after a loss, over this object's life
        self.restarts = 0
        self._lost_line = ""  # the last loss, in words, with its time

    def start_spawner(self) -> None:
        """Start the helper now (it imports and forks its first supervisor while the watcher goes on)."""
        self._ensure_spawner()

    def _ensure_spawner(self) -> None:
        """Start the helper unless it runs, or was lost and its restart is not due yet."""
        if self._spawner is not None or (self._restart_at is not None and time.monotonic() < self._restart_at):
            return
        spawner = Spawner()
        try:
            spawner.start()
        except OSError as exc:
            self._lost(None, f"it could not be started: {exc}")
            return
        if self._restart_at is not None:
            self.restarts += 1
            logger.info("spawner helper started again (pid %d)", spawner.pid)
        self._spawner, self._started_at = spawner, time.monotonic()

    def _lost(self, spawner: Spawner | None, why: str) -> None:
        """The helper is gone: launches fork here until the restart is due."""
        if spawner is not None:
            spawner.close()
        self._spawner = None
        now = time.monotonic()
        if spawner is not None and now - self._started_at >= HELPER_STEADY_S:
            self._restart_wait_s = HELPER_RESTART_S
        self._restart_at = now + self._restart_wait_s
        self._lost_line = f"spawner helper lost at {iso_utc(time.time())} ({why})"
        logger.warning(
            "spawner helper lost (%s); supervisors are forked by the watcher itself until it starts again in %g s",
            why,
            self._restart_wait_s,
        )
        self._restart_wait_s = min(self._restart_wait_s * 2, HELPER_RESTART_MAX_S)

    def problems(self) -> list[str]:
        """One line while a lost helper is not running again (status.json ``watcher.problems``), else none."""
        if self._spawner is not None or self._restart_at is None:
            return []
        retry = iso_utc(time.time() + max(0.0, self._restart_at - time.monotonic()))
        return [
            f"{self._lost_line}; supervisors are forked by the watcher itself, each launch a few ms slower, "
            f"until it is started again (next try {retry})"
        ]

    def launch(self, spec: LaunchSpec) -> int:
        if self._restart_at is None:
            self._ensure_spawner()  # the first launch without start_spawner; a restart is the loop's (reap)
        if self._spawner is not None:
            try:
                return self._spawner.launch(spec)
            except SpawnerGone as exc:
                self._lost(self._spawner, _how_it_ended(self._spawner) or str(exc))
                pid = _supervisor_it_may_have_forked(spec)
                if pid is not None:
                    return pid
        return super().launch(spec)

    def reap(self, readable: Collection[int] | None = None, *, exits: bool = True) -> list[int]:
        reaped = super().reap(readable, exits=exits)
        if self._spawner is not None:
            reaped += self._spawner.reaped()
            if not self._spawner.is_running:
                self._lost(self._spawner, _how_it_ended(self._spawner) or "it exited")
        if self._spawner is None and self._restart_at is not None:
            self._ensure_spawner()  # when due
        return reaped

    def wake_fds(self) -> list[int]:
        return self._spawner.filenos() if self._spawner is not None else []

    def close(self) -> None:
        if self._spawner is not None:
            self._spawner.close()
            self._spawner = None


def _how_it_ended(spawner: Spawner) -> str | None:
    """ "killed by SIGKILL", "exited with code 1"; None while the helper runs."""
    if spawner.is_running or spawner.returncode is None:
        return None
    code = spawner.returncode
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _supervisor_it_may_have_forked(spec: LaunchSpec) -> int | None:
    """The helper died mid-launch: if a supervisor holds the lock, it is this attempt's; its pid."""
    paths = JobPaths(Path(os.path.abspath(spec.job_dir)))
    deadline = time.monotonic() + ORPHAN_START_WAIT_S
    while is_alive(paths):
        started = Supervisor.read_started(paths)
        if started and started.get("attempt") == spec.attempt:
            return int(started["supervisor_pid"])
        if time.monotonic() > deadline:
            raise SpawnFailed(f"{paths.dir}: the spawner helper died while launching attempt {spec.attempt}")
        time.sleep(0.01)
    return None


def main(argv: list[str] | None = None) -> int:
    """The helper's loop: launch what the watcher asks, report what it reaps, leave with the watcher."""
    parser = argparse.ArgumentParser(prog="python -m trainq.watcher.supervisor.spawner")
    parser.add_argument("--notify-fd", type=int, help="write end of the watcher's exit-notice pipe")
    parser.add_argument("--jobs-fd", type=int, help="the pooled supervisors' end of the watcher's jobs socket")
    args = parser.parse_args(argv)
    for fd in (args.notify_fd, args.jobs_fd):
        if fd is not None:
            os.set_inheritable(fd, False)  # supervisors keep them explicitly; jobs never see them
    watcher_pid = os.getppid()
    supervisor = Supervisor(args.notify_fd, keep_warm=True, jobs_fd=args.jobs_fd)
    supervisor.warm_up()
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears SIGCHLD
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the watcher; it closes our stdin
    stdin, out = sys.stdin.fileno(), sys.stdout.buffer  # stdin read unbuffered, straight from its fd
    pending = b""
    while True:
        readable, _, _ = select.select([stdin, wake_r, *supervisor.wait_fds()], [], [], 1.0)
        if wake_r in readable:
            drain(wake_r)
        # a child's exit wakes us through SIGCHLD (wake_r): only then is waitpid worth a try; a quiet second
        # (nothing readable) reaps everything anyway, for an exit that came before the wakeup fd was set
        for pid in supervisor.reap(readable, exits=wake_r in readable or not readable):
            _send(out, {"exited": pid})
        if stdin in readable:
            chunk = os.read(stdin, 65536)
            if not chunk:
                return 0
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:  # the watcher moved these jobs to running/ before asking: launch them
                _send(out, _launch(supervisor, line))
        if os.getppid() != watcher_pid:
            return 0  # the watcher is gone: it asks for nothing more
        supervisor.warm_up()  # the next launch finds a supervisor waiting


def _send(out, message: dict) -> None:
    try:
        out.write(json.dumps(message).encode() + b"\n")
        out.flush()
    except BrokenPipeError:
        sys.exit(0)  # the watcher is gone


def _launch(supervisor: Supervisor, line: bytes) -> dict:
    try:
        spec = LaunchSpec.from_dict(json.loads(line)["spec"])
        return {"pid": supervisor.launch(spec)}
    except SpawnFailed as exc:
        return {"error": str(exc)}
    except (ValueError, KeyError, TypeError) as exc:
        return {"error": f"bad launch request: {exc}"}


if __name__ == "__main__":
    sys.exit(main())
