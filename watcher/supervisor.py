"""Every job attempt runs under its own small supervisor process, so the watcher can die or restart freely.

A supervisor detaches (own session, no inherited fds, default signal dispositions), becomes a child
subreaper, takes the job's lock, starts the job with its output going straight to ``output.log``,
writes the start record, watches stop.flag / timeout / its own SIGTERM, escalates stop → SIGTERM →
SIGKILL over its whole process tree, and writes the exit record only once every process of the
attempt is gone; then it releases the lock. "Lock held" means "attempt alive".

``Supervisor.launch`` either forks one on the spot (taking the lock before the fork) or, with
``keep_warm`` (the spawner helper), hands the job to a ``SupervisorPool`` member forked and detached
ahead of time, which answers once it holds the lock. A pooled supervisor runs one attempt at a time
and then waits for the next instead of exiting: a trivial attempt then costs no fork, no detaching
and no process teardown.

This is the only watcher module that imports ``subprocess`` or ``signal``.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import fcntl
import gc
import json
import logging
import os
import select
import signal
import stat
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn

import psutil

from trainq.watcher.contract import (
    ENV_ATTEMPT,
    ENV_JOB_DIR,
    ENV_JOB_ID,
    ENV_METRICS,
    ENV_STOP_FLAG,
    EXIT_FAILED,
    EXIT_USAGE,
    JobPaths,
)
from trainq.watcher.errors import SpawnFailed
from trainq.watcher.fsutil import (
    atomic_write_json, open_no_follow, publish_then_sync, read_json, remove_quietly, touch,
)
from trainq.watcher.units import iso_utc

logger = logging.getLogger(__name__)

#: how long the supervisor sleeps between looks at stop.flag, the timeout and its process tree (ms)
POLL_INTERVAL_MS = 50
#: exit code recorded when the command does not exist (or its cwd does not), as a shell reports it
EXIT_NOT_FOUND = 127
#: exit code recorded when the command exists but cannot be executed
EXIT_NOT_EXECUTABLE = 126
#: exit status of a supervisor that hit an internal error (sysexits EX_SOFTWARE); no exit record then
EXIT_SUPERVISOR_ERROR = 70
#: Linux prctl option: orphaned descendants reparent to the nearest subreaper instead of init
PR_SET_CHILD_SUBREAPER = 36
#: signals that ask a supervisor to stop its job at once (preemption, Ctrl-C, hang-up); recorded as "sigterm"
SUPERVISOR_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: the signal that says a batch system's time limit is near: stop.flag now, SIGTERM after stop_grace ("timeout")
TIME_LIMIT_SIGNAL = signal.SIGUSR1
#: how long kill_leftovers keeps killing a job tree that forks while being killed (s)
LEFTOVER_KILL_DEADLINE_S = 5.0
#: pause between kill_leftovers passes (s)
LEFTOVER_RESCAN_S = 0.02
#: names the current boot; a new value after every reboot (Linux)
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
#: a process whose start time is this close to the recorded one is the recorded process (s)
START_TIME_TOLERANCE_S = 0.05
#: boot times (for records without a boot id) this close are the same boot (s)
BOOT_TIME_TOLERANCE_S = 2.0
#: attempts one pooled supervisor runs before it leaves (bounds anything it might accumulate)
POOLED_MAX_ATTEMPTS = 1000
#: pooled supervisors kept waiting; more than that leave when their attempt ends
POOL_IDLE_MAX = 4
#: how often a supervisor retries writing its exit record while the disk is full (s)
EXIT_RETRY_S = 0.5


@dataclass(frozen=True)
class LaunchSpec:
    """Everything one attempt's supervisor needs; JSON-able for the standalone entry point."""

    job_dir: str
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    attempt: int
    stop_grace_s: float = 120.0
    kill_after_s: float = 5.0
    timeout_s: float | None = None
    banner: str = ""
    #: the real path to exec (argv[0] stays as written); set when allow_commands checked it
    executable: str | None = None
    #: False: ``env`` is the job's whole environment (env_passthrough applied), not added to the supervisor's
    inherit_env: bool = True

    def __post_init__(self) -> None:
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(f"argv must be a non-empty list of strings (got {self.argv!r})")
        if not isinstance(self.attempt, int) or self.attempt < 1:
            raise ValueError(f"attempt must be an integer >= 1 (got {self.attempt!r})")
        if self.stop_grace_s < 0 or self.kill_after_s < 0 or (self.timeout_s is not None and self.timeout_s < 0):
            raise ValueError("stop_grace_s, kill_after_s and timeout_s cannot be negative")

    def to_dict(self) -> dict:
        """Plain JSON-able dict (argv as a list)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(argv=list(self.argv), env=dict(self.env))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LaunchSpec:
        """Build from ``to_dict`` output; ``env`` defaults to {}, ``cwd`` to the job folder, ``attempt`` to 1."""
        if not isinstance(d, dict) or not d.get("job_dir") or "argv" not in d:
            raise ValueError("a launch spec needs at least job_dir and argv")
        argv = d["argv"]
        if not isinstance(argv, (list, tuple)):
            raise ValueError(f"argv must be a list of strings (got {argv!r})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown launch spec keys: {', '.join(unknown)}")
        merged = {"env": {}, "cwd": d["job_dir"], "attempt": 1, **d, "argv": tuple(argv)}
        merged["env"] = {str(k): str(v) for k, v in (merged["env"] or {}).items()}
        return cls(**merged)


@dataclass
class _Attempt:
    """Mutable state of the running attempt; lives only inside the supervisor process."""

    spec: LaunchSpec
    paths: JobPaths
    log_fd: int
    job_pid: int
    started_at: float
    started_mono: float
    status: int | None = None  # raw waitpid status once the main child is reaped
    stop_reason: str | None = None
    stop_requested_at: float | None = None
    stop_mono: float | None = None
    term_sent_mono: float | None = None
    signals_sent: list[str] = field(default_factory=list)
    created_stop_flag: bool = False
    dir_ino: int | None = None  # the job folder's inode: a folder removed and made again is another job's
    grace_s: float | None = None  # the stop's grace: the spec's stop_grace_s, or 0 for a stop.flag saying "now"


class _StopSignal:
    """Set by the supervisor's own SIGTERM/SIGINT/SIGHUP handler and its SIGUSR1 handler (which do nothing else)."""

    received = False
    #: SIGUSR1: the batch system's time limit is near (Slurm's --signal=B:USR1@lead); stop like a timeout
    time_limit = False


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


class Supervisor:
    """The watcher's handle on supervisors: launch them, reap the ones it forked, and query any attempt.

    ``notify_fd`` (non-blocking, write end of a pipe) gets one byte from each supervisor the moment its
    exit record can be read, so whoever reads the other end learns of the exit without waiting for the
    process to end. With ``keep_warm`` launches go to a pool of supervisors forked and detached ahead
    of time (``SupervisorPool``); each supervises one attempt at a time and waits for the next after it.
    """

    def __init__(self, notify_fd: int | None = None, *, keep_warm: bool = False) -> None:
        self._children: set[int] = set()
        self._notify_fd = notify_fd
        # resolved before any fork: dlopen in a child forked from a threaded process could deadlock
        self._prctl = _load_prctl()
        self.pool = SupervisorPool(self._prctl, notify_fd) if keep_warm else None

    def launch(self, spec: LaunchSpec) -> int:
        """Take the job's lock and fork its supervisor, or hand the job to a waiting one; its pid (a few ms)."""
        spec = dataclasses.replace(spec, job_dir=os.path.abspath(spec.job_dir))
        pid = self.pool.launch(spec) if self.pool is not None else None
        if pid is not None:
            return pid
        paths = JobPaths(Path(spec.job_dir))
        lock_fd, _ = _take_lock(paths, spec.attempt)
        try:
            _clear_records(paths)  # safe: we hold the lock, so no supervisor of this job runs to write them
            pid = os.fork()
        except OSError as exc:
            os.close(lock_fd)
            raise SpawnFailed(f"{paths.dir}: cannot fork a supervisor for attempt {spec.attempt}: {exc}") from exc
        if pid == 0:
            _child_main(spec, lock_fd, self._prctl, self._notify_fd)
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

    def reap(self) -> list[int]:
        """Collect every supervisor this process forked that has exited; never blocks."""
        reaped = self.pool.reap() if self.pool is not None else []
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


def is_alive(paths: JobPaths) -> bool:
    """True iff a supervisor holds ``paths.lock``; where flock does not work, iff the recorded supervisor runs here."""
    held = lock_state(paths)
    if held is None:
        return _recorded_supervisor_runs(paths)
    return held


def lock_state(paths: JobPaths) -> bool | None:
    """True: a supervisor holds ``paths.lock``; False: none does; None: flock does not work on this filesystem.

    Probes with a fresh open file and a shared lock (two probes at once must not see each other), released at once.
    """
    try:
        fd = os.open(paths.lock, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None  # ENOLCK (NFS without a lock manager), EOPNOTSUPP/ENOSYS (Lustre without -o flock), ...
    finally:
        os.close(fd)  # closing drops our probe lock too
    return False


def _recorded_supervisor_runs(paths: JobPaths) -> bool:
    """The start record's supervisor pid runs on this machine, started no later than the job (pid reuse guard)."""
    started = read_json(paths.started) or {}
    try:
        proc = psutil.Process(int(started["supervisor_pid"]))
        born = started.get("job_create_time")
        return proc.status() != psutil.STATUS_ZOMBIE and (born is None or proc.create_time() <= born + 0.01)
    except (KeyError, TypeError, ValueError, psutil.Error):
        return False


def process_tree(paths: JobPaths) -> list[int]:
    """Pids of the live supervisor's descendants; [] when no supervisor is alive."""
    started = read_json(paths.started)
    if not started or not is_alive(paths):
        return []
    return _descendants(int(started["supervisor_pid"]))


def kill_leftovers(paths: JobPaths) -> int:
    """SIGKILL every process whose TRAINQ_JOB_DIR is this job folder (or in the job's process group).

    For a supervisor that died while its job lives on; call it before moving the job folder. Repeats until
    nothing is left (a job may fork while being killed) or LEFTOVER_KILL_DEADLINE_S passes. Never signals
    a stranger: a start record from another boot means nothing of the job can be alive, and the process
    group counts only while its leader is the very process the record names (same start time).
    """
    killed: set[int] = set()
    deadline = time.monotonic() + LEFTOVER_KILL_DEADLINE_S
    while True:
        found = _leftover_pids(paths)
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            logger.warning("job %s: processes still alive after %.0f s of SIGKILL: %s",
                           paths.dir.name, LEFTOVER_KILL_DEADLINE_S, sorted(found))
            break
        time.sleep(LEFTOVER_RESCAN_S)
    if killed:
        logger.info("job %s: killed %d leftover processes %s", paths.dir.name, len(killed), sorted(killed))
    return len(killed)


def _leftover_pids(paths: JobPaths) -> set[int]:
    """Live (non-zombie) processes that belong to the job folder ``paths.dir``."""
    job_dirs = {os.path.normpath(str(paths.dir)), os.path.realpath(paths.dir)}
    started = read_json(paths.started) or {}
    if not is_this_boot(started):
        logger.info("job %s: its start record is from an earlier boot, so none of its processes can be alive; "
                    "signalling nothing", paths.dir.name)
        return set()
    pgid, born = _job_group(started), started.get("job_create_time")
    found = set()
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if _in_job_group(proc, pgid, born) or _has_job_dir(proc, job_dirs):
                found.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError, PermissionError):
            continue
    return found


def boot_id() -> str | None:
    """This boot's id (Linux), or None where there is none."""
    try:
        return BOOT_ID_PATH.read_text().strip() or None
    except OSError:
        return None


def is_this_boot(started: dict) -> bool:
    """False when a start record provably comes from another boot (boot id, or boot time for older records)."""
    recorded, current = started.get("boot_id"), boot_id()
    if recorded and current:
        return recorded == current
    boot_time = started.get("boot_time")
    if isinstance(boot_time, (int, float)):
        return abs(boot_time - psutil.boot_time()) <= BOOT_TIME_TOLERANCE_S
    return True


def _job_group(started: dict) -> int | None:
    """The recorded process group id, while its leader is still the recorded job process; else None.

    A pid is reused once its process is gone: a live leader with another start time is a stranger's
    group. With the leader gone, only TRAINQ_JOB_DIR identifies the job's processes.
    """
    pgid, born = started.get("pgid"), started.get("job_create_time")
    if not isinstance(pgid, int) or pgid <= 1 or not isinstance(born, (int, float)):
        return None
    try:
        leader_born = psutil.Process(pgid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return pgid if abs(leader_born - born) <= START_TIME_TOLERANCE_S else None


def _has_job_dir(proc: psutil.Process, job_dirs: set[str]) -> bool:
    """True when the process's environment names one of ``job_dirs`` as TRAINQ_JOB_DIR."""
    value = proc.environ().get(ENV_JOB_DIR)
    return bool(value) and (os.path.normpath(value) in job_dirs or os.path.realpath(value) in job_dirs)


def _in_job_group(proc: psutil.Process, pgid: int | None, born: float | None) -> bool:
    """True for a member of the job's process group created no earlier than the job (pid reuse guard)."""
    if not pgid or born is None:
        return False
    return os.getpgid(proc.pid) == pgid and proc.create_time() >= born - 0.01


def open_job_log(path: Path) -> int:
    """output.log opened for appending, never through a symlink or into a FIFO the job put in its place.

    Such a stand-in is removed and a fresh file made: the supervisor may run as a user the job's
    owner is not, and must not append to whatever file a symlink names (O_NOFOLLOW).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    for _ in range(3):
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO):  # a symlink; a FIFO nobody reads
                raise
        else:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
                return fd
            os.close(fd)
        remove_quietly(path)
    raise OSError(errno.ELOOP, f"{path}: keeps being replaced by something that is not a plain file")


def _take_lock(paths: JobPaths, attempt: int, *, required: bool = True) -> tuple[int, str | None]:
    """Open and exclusively flock ``paths.lock``: (fd, None); SpawnFailed when someone still runs this job.

    Where flock does not work on the job folder's filesystem (ENOLCK, EOPNOTSUPP...), SpawnFailed when the lock
    is ``required``, else (fd, why): a Slurm node then runs unlocked (Slurm's job state and the heartbeat say
    whether the attempt lives; see watcher/node.py).
    """
    try:
        fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise SpawnFailed(f"{paths.dir}: cannot open {paths.lock.name} for attempt {attempt} "
                          f"({exc.strerror}); check that the job folder exists and is writable") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise SpawnFailed(f"{paths.lock}: another supervisor still runs this job; "
                          f"wait for it to exit (or stop it) before starting attempt {attempt}") from exc
    except OSError as exc:
        why = f"flock on {paths.lock} failed ({exc.strerror})"
        if not required:
            return fd, why
        os.close(fd)
        raise SpawnFailed(f"{why}: the queue root's filesystem has no working flock; keep the queue root on a "
                          "local filesystem (or one mounted with flock), or use executor: slurm") from exc
    return fd, None


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


# ---------------------------------------------------------------- inside the supervisor process


def _child_main(spec: LaunchSpec, lock_fd: int, prctl: Callable[..., int] | None,
                notify_fd: int | None) -> NoReturn:
    """Body of the forked child: never returns into the watcher's code, never runs atexit handlers."""
    code = EXIT_SUPERVISOR_ERROR
    log_fd = 2
    try:
        lock_fd, notify_fd = _detach(lock_fd, notify_fd)
        log_fd = _open_log(spec)
        _supervise(spec, log_fd, prctl, lambda: _end_attempt(lock_fd, notify_fd))
        code = 0
    except BaseException:  # noqa: BLE001 - anything at all: report it and leave without the watcher's code
        _die_reporting(log_fd)
    finally:
        os._exit(code)


def _warm_main(requests: int, replies: int, prctl: Callable[..., int] | None, notify_fd: int | None) -> NoReturn:
    """Body of a pooled supervisor: detach now, then supervise one requested attempt after another.

    A request is one JSON line (``LaunchSpec.to_dict``). The answer is ``{"pid": ...}`` once the job's
    lock is held and output.log open, or ``{"error": ...}``. After an attempt's exit record is written
    (and the lock released) it says ``{"idle": ...}`` and waits again. It leaves at end of file on
    ``requests`` (the pool let it go, or the helper is gone), after POOLED_MAX_ATTEMPTS attempts, or
    after an attempt it was told to stop by a signal.
    """
    code = EXIT_SUPERVISOR_ERROR
    log_fd = 2
    try:
        requests, replies, notify_fd = _detach(requests, replies, notify_fd)
        gc.freeze()  # what we inherited is never collected (it may name fds we closed); our own garbage is
        gc.enable()
        for _ in range(POOLED_MAX_ATTEMPTS):
            taken = _await_job(requests, replies)
            if taken is None:
                break
            spec, lock_fd, log_fd = taken
            record = _supervise(spec, log_fd, prctl, lambda: _end_attempt(lock_fd, notify_fd))
            log_fd = _quiet_stdio()
            if record.get("stop_reason") == "sigterm" or not _reply_quietly(replies, {"idle": os.getpid()}):
                break  # we were told to stop, or nobody will send another job
        code = 0
    except BaseException:  # noqa: BLE001 - as in _child_main
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


def _await_job(requests: int, replies: int) -> tuple[LaunchSpec, int, int] | None:
    """Read requests until one can be taken: (spec, lock fd, log fd); None at end of file."""
    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = os.read(requests, 65536)
            if not chunk:
                return None
            pending += chunk
        line, _, pending = pending.partition(b"\n")
        try:
            spec = LaunchSpec.from_dict(json.loads(line))
            paths = JobPaths(Path(spec.job_dir))
            lock_fd, _ = _take_lock(paths, spec.attempt)
        except (SpawnFailed, ValueError, TypeError) as exc:
            _reply(replies, {"error": str(exc)})
            continue
        try:
            _clear_records(paths)
            log_fd = _open_log(spec)
        except OSError as exc:
            os.close(lock_fd)
            _reply(replies, {"error": f"{paths.log}: cannot open the job's log ({exc.strerror})"})
            continue
        _reply(replies, {"pid": os.getpid()})
        return spec, lock_fd, log_fd


def _reply_quietly(fd: int, message: dict) -> bool:
    """``_reply``; False when the reader is gone."""
    try:
        _reply(fd, message)
    except OSError:
        return False
    return True


def _reply(fd: int, message: dict) -> None:
    data = json.dumps(message).encode() + b"\n"
    while data:
        data = data[os.write(fd, data):]


class _WarmGone(Exception):
    """A pooled supervisor did not answer (it died, or hangs)."""


class _Warm:
    """The launching side's handle on one pooled supervisor: its request pipe and its reply pipe."""

    #: how long a pooled supervisor may take to lock the job and answer (seconds); under the watcher's
    #: wait for the helper (spawner.REPLY_TIMEOUT_S), so the fallback fork still fits in it
    REPLY_TIMEOUT_S = 2.0

    def __init__(self, pid: int, requests: int, replies: int) -> None:
        self.pid, self.requests, self.replies = pid, requests, replies
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

    def next_message(self) -> dict | None:
        """The next line it wrote, without blocking; None when there is none (``gone`` at end of file)."""
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
        """Close our ends: an idle supervisor reads end of file and leaves."""
        for fd in (self.requests, self.replies):
            try:
                os.close(fd)
            except OSError:
                pass
        self.requests = self.replies = -1


class SupervisorPool:
    """Supervisors forked and detached ahead of time; each runs one attempt at a time, then waits again.

    Forking, detaching and tearing down a process for every attempt is most of what a trivial job
    costs (page-table copies and copy-on-write faults). A pooled supervisor is still one process per
    running attempt, holds that job's lock only while it runs, and outlives the watcher and the
    helper like any other; it just is not thrown away afterwards. At most POOL_IDLE_MAX wait.
    """

    def __init__(self, prctl: Callable[..., int] | None, notify_fd: int | None) -> None:
        self._prctl = prctl
        self._notify_fd = notify_fd
        self._idle: list[_Warm] = []
        self._busy: dict[int, _Warm] = {}
        self._leaving: list[_Warm] = []  # let go (surplus); reaped once they have left

    def launch(self, spec: LaunchSpec) -> int | None:
        """Hand ``spec`` to a waiting supervisor: its pid once it holds the lock; None when none answered."""
        self.reap()
        if not self._idle:
            self.warm_up()
        while self._idle:
            warm = self._idle.pop()
            try:
                reply = warm.assign(spec)
            except _WarmGone:
                warm.discard()
                continue
            if "error" in reply:
                self._idle.append(warm)  # it did not take the job and waits for the next one
                raise SpawnFailed(reply["error"])
            self._busy[warm.pid] = warm
            return warm.pid
        return None

    def warm_up(self) -> None:
        """Make sure one supervisor waits for the next launch."""
        if self._idle:
            return
        to_child_r, to_child_w = os.pipe2(os.O_CLOEXEC)
        from_child_r, from_child_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            logger.warning("cannot fork a pooled supervisor (%s); launches fork on demand", exc)
            return
        if pid == 0:
            _warm_main(to_child_r, from_child_w, self._prctl, self._notify_fd)
        os.close(to_child_r)
        os.close(from_child_w)
        self._idle.append(_Warm(pid, to_child_w, from_child_r))

    def wait_fds(self) -> list[int]:
        return [warm.replies for warm in self._busy.values()]

    def reap(self) -> list[int]:
        """Take back supervisors whose attempt is over; reap pooled ones that exited (their pids)."""
        for pid, warm in list(self._busy.items()):
            message = warm.next_message()
            if message is not None and "idle" in message:
                del self._busy[pid]
                if len(self._idle) < POOL_IDLE_MAX:
                    self._idle.append(warm)
                else:
                    warm.close()  # it reads end of file and leaves
                    self._leaving.append(warm)
        exited = []
        for warm in self._idle + list(self._busy.values()) + self._leaving:
            try:
                done, _ = os.waitpid(warm.pid, os.WNOHANG)
            except ChildProcessError:
                done = warm.pid
            if done:
                exited.append(warm.pid)
        if exited:
            gone = set(exited)
            for warm in [w for w in self._idle + list(self._busy.values()) if w.pid in gone]:
                warm.close()
            self._idle = [w for w in self._idle if w.pid not in gone]
            self._busy = {p: w for p, w in self._busy.items() if p not in gone}
            self._leaving = [w for w in self._leaving if w.pid not in gone]
        return exited


def _clear_records(paths: JobPaths) -> None:
    """Remove the previous attempt's start and exit records (the caller holds the job's lock)."""
    remove_quietly(paths.exit_record)
    remove_quietly(paths.started)


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
    log = open_job_log(JobPaths(Path(spec.job_dir)).log)
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


def _reset_signals() -> None:
    """Default disposition for every signal, empty mask, SIGPIPE ignored (a dead reader must not kill us)."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP) or signal.getsignal(sig) is signal.SIG_DFL:
            continue  # getsignal is cheap; a sigaction for each of 64 signals is not free
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # signals reserved by libc
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # Popen restores the default for the job


def _die_reporting(log_fd: int) -> None:
    """Write the traceback where the user looks and kill the job tree, so nothing outlives us unrecorded."""
    try:
        os.write(log_fd, ("trainq: supervisor error:\n" + traceback.format_exc()).encode(errors="replace"))
    except OSError:
        pass
    for pid in _descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _supervise(spec: LaunchSpec, log_fd: int, prctl: Callable[..., int] | None,
               ended: Callable[[], None] = lambda: None) -> dict:
    """Run one attempt to the end of its whole process tree; returns the exit record it wrote.

    ``ended`` is called once the exit record can be read, before it is synced to disk.
    """
    stop_signal = _install_stop_handlers()
    _become_subreaper(prctl, log_fd)
    if spec.banner:
        _write_line(log_fd, spec.banner.splitlines()[0])
    started_at, started_mono = time.time(), time.monotonic()
    try:
        job = _spawn(spec, log_fd)
    except OSError as exc:
        return _record_spawn_error(spec, log_fd, exc, started_at, ended)
    attempt = _Attempt(spec, JobPaths(Path(spec.job_dir)), log_fd, job.pid, started_at, started_mono,
                       dir_ino=_inode(spec.job_dir))
    _write_started(attempt)
    _watch(attempt, stop_signal)
    job.returncode = os.waitstatus_to_exitcode(attempt.status)  # we reaped it: Popen must not wait or warn
    return _write_exit(attempt, ended)


def _install_stop_handlers() -> _StopSignal:
    """SIGTERM/SIGINT/SIGHUP only set a flag; the loop forwards SIGTERM to the job tree."""
    stop_signal = _StopSignal()

    def on_stop(_signum: int, _frame: object) -> None:
        stop_signal.received = True

    def on_time_limit(_signum: int, _frame: object) -> None:
        stop_signal.time_limit = True

    for sig in SUPERVISOR_STOP_SIGNALS:
        signal.signal(sig, on_stop)
    signal.signal(TIME_LIMIT_SIGNAL, on_time_limit)
    return stop_signal


def _become_subreaper(prctl: Callable[..., int] | None, log_fd: int) -> None:
    """Orphaned (double-forked) descendants reparent to us, so the whole tree stays ours to kill."""
    if prctl is None:
        return
    if prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        _note(log_fd, f"cannot become a child subreaper ({os.strerror(ctypes.get_errno())}); "
                      "double-forked processes may escape the stop")


def _job_env(spec: LaunchSpec) -> dict[str, str]:
    """The supervisor's environment, the TRAINQ_* defaults for this job, then the spec's own variables."""
    paths = JobPaths(Path(spec.job_dir))
    env = dict(os.environ) if spec.inherit_env else {}
    env.update({
        ENV_JOB_ID: paths.dir.name,
        ENV_JOB_DIR: spec.job_dir,
        ENV_STOP_FLAG: str(paths.stop_flag),
        ENV_METRICS: str(paths.metrics),
        ENV_ATTEMPT: str(spec.attempt),
    })
    env.update(spec.env)
    return env


def _spawn(spec: LaunchSpec, log_fd: int) -> subprocess.Popen:
    """Start the job in its own process group; it inherits only stdin=/dev/null and output.log."""
    return subprocess.Popen(
        list(spec.argv), executable=spec.executable, cwd=spec.cwd, env=_job_env(spec), stdin=subprocess.DEVNULL,
        stdout=log_fd,
        stderr=subprocess.STDOUT, close_fds=True, start_new_session=True, restore_signals=True,
    )


def _write_started(a: _Attempt) -> None:
    """The start record: enough to recognise the job's processes later without trusting a bare pid."""
    try:
        create_time = psutil.Process(a.job_pid).create_time()
    except psutil.Error:
        create_time = None
    try:
        atomic_write_json(a.paths.started, {
            "attempt": a.spec.attempt, "supervisor_pid": os.getpid(), "job_pid": a.job_pid, "pgid": a.job_pid,
            "started_at": iso_utc(a.started_at), "job_create_time": create_time, "boot_time": psutil.boot_time(),
            "boot_id": boot_id(),
        }, durable=False)  # a crash kills the job too, and then the record no longer matters
    except OSError as exc:  # a full disk or a removed folder must not kill the job; the lock still says it runs
        _note(a.log_fd, f"cannot write the start record ({exc.strerror})")


def _record_spawn_error(spec: LaunchSpec, log_fd: int, exc: OSError, started_at: float,
                        ended: Callable[[], None]) -> dict:
    """The command could not start: say why in output.log and the exit record (127 not found, 126 otherwise)."""
    reason = _spawn_error_text(spec, exc)
    _note(log_fd, f"cannot start the job: {reason}")
    code = EXIT_NOT_FOUND if exc.errno in (errno.ENOENT, errno.ENOTDIR) else EXIT_NOT_EXECUTABLE
    record = _exit_record(spec, None, started_at, status_code=code, spawn_error=reason)
    _publish_exit(JobPaths(Path(spec.job_dir)), record, ended, log_fd)
    return record


def _spawn_error_text(spec: LaunchSpec, exc: OSError) -> str:
    """One line naming what is wrong and what to fix."""
    if exc.filename == spec.cwd or not os.path.isdir(spec.cwd):
        return f"working directory {spec.cwd} does not exist or is not a folder ({exc.strerror}); fix cwd"
    if exc.errno == errno.ENOENT:
        return f"command not found: {spec.argv[0]} ({exc.strerror}); fix command (PATH is searched)"
    if exc.errno == errno.EACCES:
        return f"permission denied running {spec.argv[0]}; make it executable (chmod +x) or fix command"
    return f"cannot execute {spec.argv[0]}: {exc.strerror}"


def _watch(a: _Attempt, stop_signal: _StopSignal) -> None:
    """Loop until the main child is reaped and no descendant is left; never blocks longer than a poll."""
    pidfd = os.pidfd_open(a.job_pid) if hasattr(os, "pidfd_open") else None
    poller = select.poll()
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    try:
        while True:
            poller.poll(POLL_INTERVAL_MS)
            now = time.monotonic()
            # before reaping: a cooperative job exits right after it sees stop.flag, and that is still a stop
            _check_stop(a, stop_signal, now)
            if _reap_all(a) and pidfd is not None:
                # a reaped pidfd stays readable: unregister it or the poll would spin
                poller.unregister(pidfd)
                os.close(pidfd)
                pidfd = None
            if a.status is None and a.stop_mono is None:
                continue  # the usual case: the job runs and nobody asked anything
            tree = _descendants(os.getpid())
            if a.status is not None and not tree:
                return
            _escalate(a, tree, now, stop_signal.received)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _reap_all(a: _Attempt) -> bool:
    """Reap every exited child (orphans reparent to us); True when the main child was among them."""
    got_main = False
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return got_main
        if pid == 0:
            return got_main
        if pid == a.job_pid:
            a.status, got_main = status, True


def _check_stop(a: _Attempt, stop_signal: _StopSignal, now: float) -> None:
    """Notice a stop request: our own SIGTERM, the job's stop.flag, or the timeout (first one wins)."""
    if a.stop_reason is not None or a.status is not None:
        return
    if stop_signal.received:
        _request_stop(a, "sigterm", now, "the supervisor got a stop signal; forwarding SIGTERM to the job")
    elif _exists(a.paths.stop_flag):
        a.grace_s = 0.0 if _says_now(a.paths.stop_flag) else a.spec.stop_grace_s
        _request_stop(a, "stop_flag", now, f"stop requested ({a.paths.stop_flag.name}); SIGTERM in {a.grace_s:g} s")
    elif _inode(a.paths.dir) != a.dir_ino:  # rm -rf of the job folder: a stop, as stop.flag would do it
        _request_stop(a, "folder_removed", now,
                      f"the job folder {a.paths.dir} was removed; SIGTERM in {a.spec.stop_grace_s:g} s")
    elif stop_signal.time_limit or (a.spec.timeout_s is not None and now - a.started_mono >= a.spec.timeout_s):
        a.created_stop_flag = not _exists(a.paths.stop_flag)
        touch(a.paths.stop_flag)  # lets the job checkpoint before it is terminated
        why = ("the batch system's time limit is near (SIGUSR1)" if stop_signal.time_limit
               else f"timeout after {a.spec.timeout_s:g} s")
        _request_stop(a, "timeout", now, f"{why}; created {a.paths.stop_flag.name}; "
                                         f"SIGTERM in {a.spec.stop_grace_s:g} s")


def _request_stop(a: _Attempt, reason: str, now: float, message: str) -> None:
    """Record when and why the stop started."""
    a.stop_reason, a.stop_requested_at, a.stop_mono = reason, time.time(), now
    _note(a.log_fd, message)


def _escalate(a: _Attempt, tree: list[int], now: float, got_stop_signal: bool) -> None:
    """SIGTERM when due, then SIGKILL every kill_after_s-late survivor, again each pass until none is left."""
    if a.term_sent_mono is None:
        if _term_due(a, now, got_stop_signal):
            if a.status is not None:
                _note(a.log_fd, f"the job exited but left {len(tree)} processes running; terminating them")
            _signal_tree(a, tree, signal.SIGTERM)
            a.term_sent_mono = now
        return
    if now - a.term_sent_mono >= a.spec.kill_after_s:
        _signal_tree(a, tree, signal.SIGKILL)


def _term_due(a: _Attempt, now: float, got_stop_signal: bool) -> bool:
    """Leftovers of an exited job and our own SIGTERM go at once; a stop waits out stop_grace_s."""
    if a.status is not None or got_stop_signal:
        return True
    if a.stop_reason == "stop_flag" and a.grace_s and _says_now(a.paths.stop_flag):
        a.grace_s = 0.0  # `trainq stop --now` on a job already stopping: the rest of the grace is skipped
    grace_s = a.spec.stop_grace_s if a.grace_s is None else a.grace_s
    return a.stop_mono is not None and now - a.stop_mono >= grace_s


def _signal_tree(a: _Attempt, tree: list[int], sig: signal.Signals) -> None:
    """Send ``sig`` to the job's process group (while it is surely ours) and to every descendant."""
    hit = 0
    if a.status is None:  # unreaped, so the group id cannot have been reused
        try:
            os.killpg(a.job_pid, sig)
            hit += 1
        except (ProcessLookupError, PermissionError):
            pass
    for pid in tree:
        try:
            os.kill(pid, sig)
            hit += 1
        except ProcessLookupError:
            pass
    if hit and sig.name not in a.signals_sent:
        a.signals_sent.append(sig.name)
        _note(a.log_fd, f"sent {sig.name} to the job's process tree ({len(tree)} processes)")


def _write_exit(a: _Attempt, ended: Callable[[], None]) -> dict:
    """Write the exit record once the whole tree is gone, say so, then sync it (recovery trusts it)."""
    if a.created_stop_flag:
        remove_quietly(a.paths.stop_flag)  # ours, from the timeout: a retry must not start out stopped
    record = _exit_record(a.spec, a.job_pid, a.started_at, raw_status=a.status, attempt=a)
    if a.stop_reason == "folder_removed":
        ended()  # no record: the folder it would go to is gone (or is a new job's under the same id)
        return record
    _publish_exit(a.paths, record, ended, a.log_fd)
    return record


def _publish_exit(paths: JobPaths, record: dict, ended: Callable[[], None], log_fd: int = 2) -> None:
    """The watcher may go on as soon as the record can be read; the fsync follows.

    A full disk does not lose the record: the lock stays held (the attempt still counts as alive,
    so nobody guesses its end) and the write is retried every EXIT_RETRY_S until it gets through.
    A job folder removed by hand gets no record: the attempt just ends.
    """
    data = (json.dumps(record, indent=1) + "\n").encode()
    once = _Once(ended)
    noted = False
    while True:
        try:
            publish_then_sync(paths.exit_record, data, once)
            return
        except FileNotFoundError:
            if _exists(paths.dir):
                raise
            once()
            return
        except OSError as exc:
            if once.called:
                return  # published: only its fsync failed, and readers have it
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            if not noted:
                _note(log_fd, f"cannot write the exit record ({exc.strerror}); retrying every {EXIT_RETRY_S:g} s")
                noted = True
            time.sleep(EXIT_RETRY_S)


class _Once:
    """Calls ``fn`` the first time it is called, never again."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn, self.called = fn, False

    def __call__(self) -> None:
        if not self.called:
            self.called = True
            self.fn()


def _exit_record(spec: LaunchSpec, job_pid: int | None, started_at: float, *, raw_status: int | None = None,
                 status_code: int | None = None, spawn_error: str | None = None,
                 attempt: _Attempt | None = None) -> dict:
    """The exit record's fields; ``raw_status`` is a waitpid status, ``status_code`` a plain exit code."""
    code, sig = status_code, None
    if raw_status is not None and os.WIFSIGNALED(raw_status):
        sig = os.WTERMSIG(raw_status)
    elif raw_status is not None:
        code = os.WEXITSTATUS(raw_status)
    return {
        "attempt": spec.attempt, "job_pid": job_pid, "exit_code": code, "signal": sig,
        "signal_name": signal.Signals(sig).name if sig else None,
        "started_at": iso_utc(started_at), "ended_at": iso_utc(time.time()),
        "stop_reason": attempt.stop_reason if attempt else None,
        "stop_requested_at": iso_utc(attempt.stop_requested_at) if attempt else None,
        "signals_sent": list(attempt.signals_sent) if attempt else [],
        "spawn_error": spawn_error,
    }


def _descendants(root: int) -> list[int]:
    """Every descendant of ``root`` (zombies included), read from /proc's children lists."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        try:
            return [p.pid for p in psutil.Process(root).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
    found, todo = [], [root]
    while todo:
        kids = _children_of(todo.pop())
        found.extend(kids)
        todo.extend(kids)
    return found


def _children_of(pid: int) -> list[int]:
    """Direct children of ``pid``, from every one of its threads."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return []
    kids = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids.extend(int(k) for k in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return kids


def _inode(path: str | Path) -> int | None:
    """The inode of ``path``, or None when it is gone."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _says_now(stop_flag: Path) -> bool:
    """A stop.flag holding ``now`` (``trainq stop --now``) asks for no grace."""
    try:
        with open_no_follow(stop_flag) as f:  # the job can make it a FIFO: never block on it
            return (f.read(16) or b"").strip().lower() == b"now"
    except OSError:
        return False


def _exists(path: Path) -> bool:
    """One stat, no exceptions."""
    try:
        os.stat(path)
    except OSError:
        return False
    return True


def _note(log_fd: int, message: str) -> None:
    """A ``trainq:`` line in output.log, where the user reads the job's story."""
    _write_line(log_fd, f"trainq: {message}")


def _write_line(log_fd: int, line: str) -> None:
    """``line`` on a line of its own: after a newline when the log ends mid-line (a tqdm bar ends in ``\r``)."""
    _write(log_fd, ("\n" if _ends_mid_line(log_fd) else "") + line + "\n")


def _ends_mid_line(log_fd: int) -> bool:
    """Whether the log's last byte is anything but a newline (read through /proc: the fd is write-only)."""
    try:
        size = os.fstat(log_fd).st_size
        if size == 0:
            return False
        fd = os.open(f"/proc/self/fd/{log_fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False  # no /proc: the note may follow a bar on its line, as before
    try:
        return os.pread(fd, 1, size - 1) != b"\n"
    except OSError:
        return False
    finally:
        os.close(fd)


def _write(fd: int, text: str) -> None:
    """Best-effort write: a full disk must not kill the supervisor."""
    try:
        os.write(fd, text.encode("utf-8", errors="replace"))
    except OSError:
        pass


# ---------------------------------------------------------------- standalone entry point


def run_in_foreground(spec: LaunchSpec, *, lock_required: bool = True) -> dict:
    """Take the lock and supervise in this process (Slurm, by hand); returns the exit record.

    ``lock_required=False`` (a Slurm node) runs on, with a note in output.log, where flock does not work.
    """
    spec = dataclasses.replace(spec, job_dir=os.path.abspath(spec.job_dir))
    paths = JobPaths(Path(spec.job_dir))
    lock_fd, unlocked = _take_lock(paths, spec.attempt, required=lock_required)
    remove_quietly(paths.exit_record)
    remove_quietly(paths.started)
    _reset_signals()
    log_fd = open_job_log(paths.log)
    if unlocked:
        _note(log_fd, f"{unlocked}; running without the lock (Slurm's job state and "
                      f"{paths.heartbeat.name} tell the watcher this attempt is alive)")
    try:
        return _supervise(spec, log_fd, _load_prctl())
    except BaseException:
        _die_reporting(log_fd)
        raise
    finally:
        os.close(log_fd)
        os.close(lock_fd)


def shell_status(record: dict) -> int:
    """The exit record as a shell would report it: the exit code, or 128 + the signal number."""
    if record.get("exit_code") is not None:
        return int(record["exit_code"])
    return 128 + int(record.get("signal") or 0)


def main(argv: list[str] | None = None) -> int:
    """``python -m trainq.watcher.supervisor JOB_DIR --spec FILE.json``: exits with the job's status."""
    parser = argparse.ArgumentParser(
        prog="python -m trainq.watcher.supervisor",
        description="Run one attempt of a trainq job in the foreground under its supervisor.")
    parser.add_argument("job_dir", help="the job folder (its lock, output.log and records live there)")
    parser.add_argument("--spec", required=True, help="LaunchSpec as JSON (job_dir inside it is replaced)")
    args = parser.parse_args(argv)
    try:
        data = json.loads(Path(args.spec).read_text(encoding="utf-8"))
        spec = LaunchSpec.from_dict({**data, "job_dir": args.job_dir} if isinstance(data, dict) else data)
    except (OSError, ValueError, TypeError) as exc:
        print(f"{args.spec}: {exc}; fix the launch spec", file=sys.stderr)
        return EXIT_USAGE
    try:
        record = run_in_foreground(spec)
    except SpawnFailed as exc:
        print(exc, file=sys.stderr)
        return EXIT_FAILED
    return shell_status(record)


if __name__ == "__main__":
    sys.exit(main())
