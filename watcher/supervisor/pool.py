"""The watcher's handle on supervisors (``Supervisor``) and the warm pool (``SupervisorPool``).

``Supervisor.launch`` either forks a supervisor on the spot (taking the job's lock before the fork) or,
with ``keep_warm`` (the spawner helper), hands the job to a ``SupervisorPool`` member forked and detached
ahead of time, which answers once it holds the lock. Either way the supervisor detaches (own session, no
inherited fds, default signal dispositions), runs the attempt (attempt.py's ``_supervise``), and releases
the lock once the exit record can be read. A pooled supervisor then waits for the next attempt.

With a ``jobs`` socket (``SOCK_SEQPACKET``, its other end held by the watcher: spawner.py) the watcher
hands jobs to the pool itself: every waiting pooled supervisor reads that one socket, the kernel gives each
request to one of them, and the one that takes it answers on the same socket (``take_direct``). The
helper then only forks, and only hears of a take when it must fork: the pool's members mark themselves
waiting or busy on a board in shared memory (``_Board``), and a member that takes a job tells the helper
("taken") only when it finds no other one waiting. A member that finds enough others waiting after its
attempt leaves by itself; the helper frees a member's place on the board when it reaps it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import gc
import json
import logging
import mmap
import os
import select
import signal
import socket
import time
from collections.abc import Callable, Collection
from typing import NoReturn, cast

from trainq.watcher.spec.contract import JobPaths, paths_of
from trainq.watcher.spec.errors import SpawnFailed
from trainq.watcher.spec.fsutil import exists, read_json, remove_quietly
from trainq.watcher.supervisor.attempt import (
    SUPERVISOR_STOP_SIGNALS,
    _die_reporting,
    _load_prctl,
    _reset_signals,
    _supervise,
)
from trainq.watcher.supervisor.attempt_io import LaunchSpec, _take_lock, open_job_log
from trainq.watcher.supervisor.cgroups import Containment, detect
from trainq.watcher.supervisor.leftovers import is_alive, kill_leftovers, process_tree

logger = logging.getLogger(__name__)

#: exit status of a supervisor that hit an internal error (sysexits EX_SOFTWARE); no exit record then
EXIT_SUPERVISOR_ERROR = 70

#: attempts one pooled supervisor runs before it leaves (bounds anything it might accumulate)
POOLED_MAX_ATTEMPTS = 1000

#: pooled supervisors kept waiting; more than that leave when their attempt ends
POOL_IDLE_MAX = 4


class Supervisor:
    """The watcher's handle on supervisors: launch them, reap the ones it forked, and query any attempt.

    ``notify_fd`` (non-blocking, write end of a pipe) gets one byte from each supervisor the moment its
    exit record can be read, so whoever reads the other end learns of the exit without waiting for the
    process to end. With ``keep_warm`` launches go to a pool of supervisors forked and detached ahead
    of time (``SupervisorPool``); each supervises one attempt at a time and waits for the next after it.
    """

    def __init__(
        self,
        notify_fd: int | None = None,
        *,
        keep_warm: bool = False,
        containment: Containment | None = None,
        jobs_fd: int | None = None,
    ) -> None:
        self._children: set[int] = set()
        self._notify_fd = notify_fd
        # resolved before any fork: dlopen in a child forked from a threaded process could deadlock
        self._prctl = _load_prctl()
        #: how attempts are contained: a cgroup each where the kernel lets us, else the process tree
        self.containment = containment or detect()
        self.pool = SupervisorPool(self._prctl, notify_fd, self.containment, jobs_fd) if keep_warm else None

    def launch(self, spec: LaunchSpec) -> int:
        """Take the job's lock and fork its supervisor, or hand the job to a waiting one; its pid (a few ms)."""
        spec = dataclasses.replace(spec, job_dir=os.path.abspath(spec.job_dir))
        pid = self.pool.launch(spec) if self.pool is not None else None
        if pid is not None:
            return pid
        paths = paths_of(spec.job_dir)
        lock_fd, _ = _take_lock(paths, spec.attempt)
        try:
            _clear_records(paths)  # safe: we hold the lock, so no supervisor of this job runs to write them
            pid = os.fork()
        except OSError as exc:
            os.close(lock_fd)
            raise SpawnFailed(f"{paths.dir}: cannot fork a supervisor for attempt {spec.attempt}: {exc}") from exc
        if pid == 0:
            _child_main(spec, lock_fd, self._prctl, self._notify_fd, self.containment)
        os.close(lock_fd)  # the child keeps the lock; ours must not outlive this call
        self._children.add(pid)
        logger.debug("job %s: supervisor %d forked (attempt %d)", paths.dir.name, pid, spec.attempt)
        return pid

    def warm_up(self) -> None:
        """With ``keep_warm``: make sure a supervisor waits for the next launch."""
        if self.pool is not None:
            self.pool.warm_up()

    def wait_fds(self) -> list[int]:
        """Fds that become readable when a pooled supervisor is free again (select on them, then ``reap``)."""
        return self.pool.wait_fds() if self.pool is not None else []

    @property
    def forked_pids(self) -> frozenset[int]:
        """Supervisors this process forked and has not reaped yet."""
        return frozenset(self._children)

    def reap(self, readable: Collection[int] | None = None, *, exits: bool = True) -> list[int]:
        """Collect every supervisor this process forked that has exited; never blocks.

        A loop that selected on ``wait_fds`` and on a SIGCHLD wakeup fd passes what was ``readable`` (only those
        pooled supervisors' messages are read) and ``exits=False`` when no SIGCHLD came (no waitpid is tried).
        """
        reaped = self.pool.reap(readable, exits=exits) if self.pool is not None else []
        if not exits:
            return reaped
        for pid in sorted(self._children):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid  # someone else reaped it
            if done:
                reaped.append(pid)
        self._children.difference_update(reaped)
        return reaped

    @staticmethod
    def is_alive(paths: JobPaths) -> bool:
        """True iff a supervisor holds the job's lock (never trusts a bare pid)."""
        return is_alive(paths)

    @staticmethod
    def read_started(paths: JobPaths) -> dict | None:
        """The start record, or None when the attempt never started."""
        return read_json(paths.started)

    @staticmethod
    def read_exit(paths: JobPaths) -> dict | None:
        """The exit record, or None while the attempt runs (or if its supervisor died)."""
        return read_json(paths.exit_record)

    @staticmethod
    def kill_leftovers(paths: JobPaths) -> int:
        """SIGKILL every process of a job whose supervisor died; returns how many were killed."""
        return kill_leftovers(paths)

    @staticmethod
    def process_tree(paths: JobPaths) -> list[int]:
        """Pids of the live supervisor's descendants (the job and everything it started)."""
        return process_tree(paths)


class SupervisorPool:
    """Supervisors forked and detached ahead of time; each runs one attempt at a time, then waits again.

    Forking, detaching and tearing down a process for every attempt is most of what a trivial job
    costs (page-table copies and copy-on-write faults). A pooled supervisor is still one process per
    running attempt, holds that job's lock only while it runs, and outlives the watcher and the
    helper like any other; it just is not thrown away afterwards. At most POOL_IDLE_MAX wait: one that
    finds that many others waiting after its attempt leaves (``_Board.wait_again``).
    """

    def __init__(
        self,
        prctl: Callable[..., int] | None,
        notify_fd: int | None,
        containment: Containment | None = None,
        jobs_fd: int | None = None,
    ) -> None:
        self._prctl = prctl
        self._notify_fd = notify_fd
        self._containment = containment
        #: the watcher's direct requests (module docstring); None: jobs come only through ``launch``
        self._jobs_fd = jobs_fd
        self._board = _Board()
        #: the pooled supervisors forked and not reaped yet, by pid
        self._members: dict[int, _Warm] = {}

    def launch(self, spec: LaunchSpec) -> int | None:
        """Hand ``spec`` to a waiting supervisor: its pid once it holds the lock; None when none answered.

        With the watcher's jobs socket, always None: a waiting supervisor may be taking a direct request
        this very moment, so a launch through here (the watcher's fallback) gets a supervisor of its own.
        """
        if self._jobs_fd is not None:
            return None
        self.reap()
        self.warm_up()
        for warm in [w for w in self._members.values() if self._board.waits(w.slot)]:
            try:
                reply = warm.assign(spec)
            except _WarmGone:
                warm.discard()
                self._forget(warm)
                continue
            if "error" in reply:
                raise SpawnFailed(reply["error"])  # it did not take the job and waits for the next one
            return warm.pid
        return None

    def warm_up(self) -> None:
        """Make sure one supervisor waits for the next launch (none is forked while one waits already)."""
        if self._board.anyone_waits():
            return
        slot = self._board.claim()
        if slot is None:
            logger.warning("%d pooled supervisors already: launches fork on demand", _Board.SLOTS)
            return
        to_child_r, to_child_w = os.pipe2(os.O_CLOEXEC)
        from_child_r, from_child_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            self._board.free(slot)
            logger.warning("cannot fork a pooled supervisor (%s); launches fork on demand", exc)
            return
        if pid == 0:
            _warm_main(
                to_child_r,
                from_child_w,
                self._prctl,
                self._notify_fd,
                self._containment,
                self._jobs_fd,
                board=self._board,
                slot=slot,
            )
        os.close(to_child_r)
        os.close(from_child_w)
        self._members[pid] = _Warm(pid, to_child_w, from_child_r, slot)

    def wait_fds(self) -> list[int]:
        """Readable when a pooled supervisor took a direct request and found no other one waiting (then ``reap``)."""
        return [warm.replies for warm in self._members.values()] if self._jobs_fd is not None else []

    def reap(self, readable: Collection[int] | None = None, *, exits: bool = True) -> list[int]:
        """Read what pooled supervisors said; reap the ones that exited (their pids) and free their places.

        ``readable``: only these reply fds have news (a select said so), besides any line already buffered;
        ``exits=False``: no child exited since the last call (no SIGCHLD), so none is waited for.
        """
        for warm in self._members.values():
            if readable is not None and warm.replies not in readable and not warm.has_line():
                continue
            while warm.next_message() is not None:
                pass  # "taken": nobody else waits, and warm_up, next, forks one
        if not exits:
            return []
        exited = []
        for warm in list(self._members.values()):
            try:
                done, _ = os.waitpid(warm.pid, os.WNOHANG)
            except ChildProcessError:
                done = warm.pid
            if done:
                exited.append(warm.pid)
                warm.close()
                self._forget(warm)
        return exited

    def _forget(self, warm: _Warm) -> None:
        """``warm`` is gone (reaped, or discarded): its place on the board is free for the next one forked."""
        del self._members[warm.pid]
        self._board.free(warm.slot)


class _Board:
    """Which pooled supervisors wait for work: one byte each, in memory the helper and its pool share.

    The helper places a supervisor on the board as it forks it (waiting) and frees the place when it reaps it; in
    between only that supervisor writes its byte: busy when it takes a job, waiting again after the attempt. A
    supervisor that takes a job and finds nobody else waiting tells the helper on its pipe ("taken"), and only then:
    a trivial job costs the helper no wake-up (it was two a job, "taken" and "idle", a tenth of a millisecond of CPU
    and two context switches on a 2-vCPU machine). A supervisor marks itself and looks at the others under one lock,
    so of two taking jobs at once the second sees the first busy: a "nobody else waits" is never missed. The lock is
    a POSIX record lock on a memfd (``_lock_file``): per process, and released by the kernel when its holder dies. A
    supervisor killed while waiting still reads as waiting until the helper reaps it, which SIGCHLD makes at once.
    """

    #: places on the board: more than max_concurrent's bound (10,000) plus POOL_IDLE_MAX
    SLOTS = 16384
    FREE, WAITING, BUSY = 0, 1, 2
    _WAITING = bytes([WAITING])

    def __init__(self, lock_fd: int | None = None) -> None:
        # anonymous and MAP_SHARED: the same pages in every supervisor forked later; no fd for _detach to close
        self._table = mmap.mmap(-1, self.SLOTS)
        self.lock_fd = _lock_file() if lock_fd is None else lock_fd

    # ---- the helper's side

    def anyone_waits(self) -> bool:
        return self._table.find(self._WAITING) >= 0

    def waits(self, slot: int) -> bool:
        return self._table[slot] == self.WAITING

    def claim(self) -> int | None:
        """A free place, marked waiting for the supervisor about to be forked; None when the board is full."""
        slot = self._table.find(b"\0")
        if slot < 0:
            return None
        self._table[slot] = self.WAITING
        return slot

    def free(self, slot: int) -> None:
        self._table[slot] = self.FREE

    # ---- a pooled supervisor's side

    def take(self, slot: int) -> bool:
        """Mark ``slot`` busy; whether another supervisor still waits."""
        fcntl.lockf(self.lock_fd, fcntl.LOCK_EX)
        try:
            self._table[slot] = self.BUSY
            return self._table.find(self._WAITING) >= 0
        finally:
            fcntl.lockf(self.lock_fd, fcntl.LOCK_UN)

    def wait_again(self, slot: int) -> bool:
        """Mark ``slot`` waiting, unless POOL_IDLE_MAX others wait already: False then (the caller leaves)."""
        fcntl.lockf(self.lock_fd, fcntl.LOCK_EX)
        try:
            found, at = 0, self._table.find(self._WAITING)
            while at >= 0 and found < POOL_IDLE_MAX:
                found, at = found + 1, self._table.find(self._WAITING, at + 1)
            if found >= POOL_IDLE_MAX:
                return False
            self._table[slot] = self.WAITING
            return True
        finally:
            fcntl.lockf(self.lock_fd, fcntl.LOCK_UN)


def _lock_file() -> int:
    """A file for the board's lock that no other process can open: a memfd, or where there is none (Linux before
    3.17, a seccomp filter that refuses it) an unnamed temporary file; close-on-exec either way."""
    try:
        return os.memfd_create("trainq-pool-board", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return _temporary_lock_file()


def _temporary_lock_file() -> int:
    import tempfile  # only here: the helper starts without it (a few ms of imports)

    with tempfile.TemporaryFile() as spare:  # unnamed (O_TMPFILE), or unlinked at once
        return os.dup(spare.fileno())  # not inheritable; the file lives on while this fd is open


class _WarmGone(Exception):
    """A pooled supervisor did not answer (it died, or hangs)."""


class _Warm:
    """The launching side's handle on one pooled supervisor: its request pipe, its reply pipe, its place on the
    board."""

    #: how long a pooled supervisor may take to lock the job and answer (seconds); under the watcher's
    #: wait for the helper (spawner.REPLY_TIMEOUT_S), so the fallback fork still fits in it
    REPLY_TIMEOUT_S = 2.0

    def __init__(self, pid: int, requests: int, replies: int, slot: int) -> None:
        self.pid, self.requests, self.replies, self.slot = pid, requests, replies, slot
        os.set_blocking(replies, False)
        self._buffer = b""
        self.gone = False

    def assign(self, spec: LaunchSpec) -> dict:
        """Send the launch request; its one-line answer. _WarmGone when none comes."""
        try:
            _reply(self.requests, spec.to_dict())
        except OSError:
            raise _WarmGone() from None
        deadline = time.monotonic() + self.REPLY_TIMEOUT_S
        while True:
            message = self.next_message()
            if message is not None:
                return message
            remaining = deadline - time.monotonic()
            if self.gone or remaining <= 0:
                raise _WarmGone()
            select.select([self.replies], [], [], remaining)

    def has_line(self) -> bool:
        """A whole message is already read in (``assign`` read past its answer): its fd may not say so again."""
        return b"\n" in self._buffer

    def next_message(self) -> dict | None:
        """The next line it wrote, without blocking; None when there is none (``gone`` at end of file) and once
        ``close``d."""
        if self.replies < 0:
            return None
        while b"\n" not in self._buffer:
            try:
                chunk = os.read(self.replies, 4096)
            except BlockingIOError:
                return None
            if not chunk:
                self.gone = True
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def discard(self) -> None:
        """Kill and reap a supervisor that failed to answer; a lock it took dies with it."""
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        self.close()

    def close(self) -> None:
        """Close our ends: a waiting supervisor reads end of file and leaves."""
        for fd in (self.requests, self.replies):
            try:
                os.close(fd)
            except OSError:
                pass
        self.requests = self.replies = -1


def _reply(fd: int, message: dict) -> None:
    data = json.dumps(message).encode() + b"\n"
    while data:
        data = data[os.write(fd, data) :]


def _reply_quietly(fd: int, message: dict) -> bool:
    """``_reply``; False when the reader is gone."""
    try:
        _reply(fd, message)
    except OSError:
        return False
    return True


def _clear_records(paths: JobPaths) -> None:
    """Remove the previous attempt's start and exit records (the caller holds the job's lock); a first attempt has
    none, and an access says so without an unlink's raised and caught FileNotFoundError."""
    for record in (paths.exit_record, paths.started):
        if exists(record):
            remove_quietly(record)


# ---------------------------------------------------------------- inside a forked supervisor


def _child_main(
    spec: LaunchSpec,
    lock_fd: int,
    prctl: Callable[..., int] | None,
    notify_fd: int | None,
    containment: Containment | None = None,
) -> NoReturn:
    """Body of the forked child: never returns into the watcher's code, never runs atexit handlers."""
    code = EXIT_SUPERVISOR_ERROR
    log_fd = 2
    try:
        lock_fd, notify_fd = _detach(lock_fd, notify_fd)  # type: ignore[assignment]  # an int stays an int
        log_fd = _open_log(spec)
        _supervise(spec, log_fd, prctl, lambda: _end_attempt(lock_fd, notify_fd), containment)
        code = 0
    except BaseException:
        _die_reporting(log_fd)
    finally:
        os._exit(code)


def _warm_main(
    requests: int,
    replies: int,
    prctl: Callable[..., int] | None,
    notify_fd: int | None,
    containment: Containment | None,
    jobs_fd: int | None,
    *,
    board: _Board,
    slot: int,
) -> NoReturn:
    """Body of a pooled supervisor: detach now, then supervise one requested attempt after another.

    A request is one JSON line (``LaunchSpec.to_dict``) on ``requests``, or one message on the watcher's
    ``jobs`` socket (``take_direct``). The answer is ``{"pid": ...}`` once the job's lock is held and
    output.log open, or ``{"error": ...}``. It marks ``slot`` on the ``board`` busy as it takes a job and waiting
    again once the attempt's exit record is written (and the lock released). It leaves at end of file on
    ``requests`` (the helper is gone), when POOL_IDLE_MAX others wait already after its attempt, after
    POOLED_MAX_ATTEMPTS attempts, or after an attempt it was told to stop by a signal.
    """
    code = EXIT_SUPERVISOR_ERROR
    log_fd = 2
    try:
        requests, replies, notify_fd, jobs_fd, board.lock_fd = _detach(  # type: ignore[assignment]  # ints stay ints
            requests, replies, notify_fd, jobs_fd, board.lock_fd
        )
        gc.freeze()  # what we inherited is never collected (it may name fds we closed); our own garbage is
        gc.enable()
        jobs = socket.socket(fileno=jobs_fd) if jobs_fd is not None else None
        waiter = _Waiter(requests, jobs)
        for left in range(POOLED_MAX_ATTEMPTS - 1, -1, -1):
            taken = _await_job(requests, replies, waiter, board, slot)
            if taken is None:
                break
            spec, lock_fd, log_fd = taken
            record = _supervise(spec, log_fd, prctl, functools.partial(_end_attempt, lock_fd, notify_fd), containment)
            log_fd = _quiet_stdio()
            if not left or record.get("stop_reason") == "sigterm" or not board.wait_again(slot):
                break  # done enough, told to stop, or enough others wait: the helper reaps us and frees our place
        code = 0
    except BaseException:
        _die_reporting(log_fd)
    finally:
        os._exit(code)


def _quiet_stdio() -> int:
    """Between attempts: stdout and stderr back on /dev/null, the stop signals back to default."""
    devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    for sig in SUPERVISOR_STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    return 2


class _Waiter:
    """A pooled supervisor's wait for its next request: on the helper's pipe, or on the watcher's jobs socket.

    Every waiting supervisor reads the one jobs socket. Watched with select, a request woke them all, and all but
    one found nothing to take (a wake-up, a recv and a context switch for nothing at every job, while the one that
    takes it wants the CPU). The socket is in an epoll set with EPOLLEXCLUSIVE instead: a request wakes one
    supervisor blocked in its wait; one busy with an attempt is passed over (the kernel counts only a waiter it
    woke), and a request nobody was waiting for stays readable for the next one to wait.
    """

    def __init__(self, requests: int, jobs: socket.socket | None) -> None:
        self.jobs = jobs
        self._poller = select.epoll()  # close-on-exec, as the jobs the supervisor starts must not inherit it
        self._poller.register(requests, select.EPOLLIN)
        if jobs is not None:
            self._poller.register(jobs, select.EPOLLIN | select.EPOLLEXCLUSIVE)

    def direct_request(self) -> bool:
        """Wait; True when the jobs socket has a request to try, else the helper's pipe is readable.

        The socket comes first when both are: the kernel woke this supervisor alone for its request, and one that
        read its pipe first (the pool letting it go) would leave the request unread, the others still asleep.
        """
        if self.jobs is None:
            return False
        jobs = self.jobs.fileno()
        return any(fd == jobs for fd, _ in self._poller.poll())

    def hung_up(self) -> None:
        """The watcher closed its end of the jobs socket: only the helper's pipe is left to read."""
        if self.jobs is not None:
            self._poller.unregister(self.jobs)
            self.jobs = None


def _await_job(
    requests: int, replies: int, waiter: _Waiter, board: _Board, slot: int
) -> tuple[LaunchSpec, int, int] | None:
    """Read requests until one can be taken: (spec, lock fd, log fd), ``slot`` marked busy; None at end of file on
    ``requests``."""
    pending = b""
    while True:
        while b"\n" not in pending:
            if waiter.direct_request():
                try:
                    taken = take_direct(cast(socket.socket, waiter.jobs))
                except EOFError:
                    waiter.hung_up()
                    continue
                if taken is not None:
                    if not board.take(slot):
                        _reply_quietly(replies, {"taken": os.getpid()})  # nobody else waits: the helper forks one
                    return taken
                continue
            chunk = os.read(requests, 65536)
            if not chunk:
                return None
            pending += chunk
        line, _, pending = pending.partition(b"\n")
        try:
            taken = _take(LaunchSpec.from_dict(json.loads(line)))
        except (SpawnFailed, ValueError, TypeError) as exc:
            _reply(replies, {"error": str(exc)})
            continue
        board.take(slot)  # the helper asked, and keeps one waiting itself
        _reply(replies, {"pid": os.getpid()})
        return taken


class _TooLate(SpawnFailed):
    """A stale direct request (``_take``): the watcher that sent it launches the job elsewhere, or is gone."""


def _take(
    spec: LaunchSpec, deadline: float | None = None, sender: socket.socket | None = None
) -> tuple[LaunchSpec, int, int]:
    """Lock the job, clear the last attempt's records, open output.log: (spec, lock fd, log fd); SpawnFailed.

    A direct request (a ``deadline``, ``time.monotonic``, and the ``sender``'s socket) is refused, once the lock
    is held and before anything in the folder changes, when it is stale: its deadline has passed (the watcher
    stopped waiting and launches elsewhere) or the watcher that sent it has closed its end (it died, and the
    next watcher's recovery decides what the job's folder means: a request taken now would race it). Checked
    under the lock, either answer holds: a later watcher sees the lock held from here to the attempt's end.
    """
    paths = paths_of(spec.job_dir)
    lock_fd, _ = _take_lock(paths, spec.attempt)
    if deadline is not None and (time.monotonic() > deadline or (sender is not None and _hung_up(sender))):
        os.close(lock_fd)
        raise _TooLate(f"{paths.dir}: attempt {spec.attempt}'s launch request is stale (its watcher left or gave up)")
    try:
        _clear_records(paths)
        log_fd = _open_log(spec)
    except OSError as exc:
        os.close(lock_fd)
        raise SpawnFailed(f"{paths.log}: cannot open the job's log ({exc.strerror})") from exc
    return spec, lock_fd, log_fd


def _hung_up(sock: socket.socket) -> bool:
    """The other end of a connected socket is closed (its requests may still be queued here)."""
    poller = select.poll()
    poller.register(sock, select.POLLHUP | select.POLLRDHUP)
    return any(events & (select.POLLHUP | select.POLLRDHUP) for _, events in poller.poll(0))


#: the largest direct request a pooled supervisor reads (a LaunchSpec with its environment is a few kB; the watcher
#: sends a larger one through the helper's pipe). Small on purpose: recv allocates this much each time, and a
#: buffer above malloc's mmap threshold cost 11.7 against 1.2 µs a recv
DIRECT_MAX_BYTES = 65536


def take_direct(jobs: socket.socket) -> tuple[LaunchSpec, int, int] | None:
    """One request from the watcher's jobs socket, taken: (spec, lock fd, log fd); None when there was none
    to take, EOFError when the watcher closed its end.

    A request is ``{"spec": LaunchSpec.to_dict(), "deadline": monotonic seconds}``; the answer, on the same
    socket, is ``{"job_dir", "attempt", "pid"}`` or ``{"job_dir", "attempt", "error", "late"}`` (the watcher
    matches answers to its request: an answer to an abandoned one is dropped; ``late``: taken after the
    deadline, which is no refusal of the launch). Every waiting supervisor reads
    the socket, so another one may have taken the request first: then there is nothing to read here.
    """
    try:
        message = jobs.recv(DIRECT_MAX_BYTES, socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    if not message:
        raise EOFError("the watcher closed its end of the jobs socket")
    who: dict = {}
    try:
        request = json.loads(message)
        who = {"job_dir": request["spec"]["job_dir"], "attempt": request["spec"]["attempt"]}
        taken = _take(LaunchSpec.from_dict(request["spec"]), float(request["deadline"]), jobs)
    except (SpawnFailed, ValueError, TypeError, KeyError) as exc:
        why = str(exc) if isinstance(exc, SpawnFailed) else f"bad request: {exc}"
        _send_quietly(jobs, {**who, "error": why, "late": isinstance(exc, _TooLate)})
        return None
    _send_quietly(jobs, {**who, "pid": os.getpid()})
    return taken


def _send_quietly(jobs: socket.socket, message: dict) -> None:
    try:
        jobs.send(json.dumps(message).encode())
    except OSError:
        pass  # the watcher is gone; it learns of the attempt from its lock and records when it starts again


def _detach(*keep: int | None) -> tuple[int | None, ...]:
    """Own session, default signals, stdio on /dev/null, every inherited fd closed but ``keep``.

    Returns the kept fds' numbers, each moved above 2 where needed (None stays None).
    """
    signal.set_wakeup_fd(-1)  # first: the watcher's wakeup pipe must never hear about our signals
    _reset_signals()
    gc.disable()  # collecting the watcher's objects here could close fds that the numbers now name
    os.setsid()
    kept = tuple(fd if fd is None or fd > 2 else fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3) for fd in keep)
    devnull = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(devnull, std)
    # the watcher's other job locks, root lock, inotify and pipes must not live on in this process
    low = 3
    for fd in sorted(fd for fd in kept if fd is not None):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, max(os.sysconf("SC_OPEN_MAX"), low + 1))
    return kept


def _open_log(spec: LaunchSpec) -> int:
    """output.log (appended to) on stdout and stderr; returns 1, the fd supervisor notes go to."""
    log = open_job_log(paths_of(spec.job_dir).log)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    return 1


def _end_attempt(lock_fd: int, notify_fd: int | None) -> None:
    """The exit record can be read: release the lock (the attempt is over) and say so on ``notify_fd``."""
    os.close(lock_fd)
    if notify_fd is not None:
        try:
            os.write(notify_fd, b"e")
        except OSError:
            pass  # full (a wake-up is pending anyway) or nobody reads any more
