"""One attempt's supervision: run a job's attempt to the end of its whole process tree.

``_supervise`` becomes a child subreaper, starts the job with its output going straight to ``output.log``,
writes the start record, watches stop.flag / timeout / its own SIGTERM, escalates stop → SIGTERM →
SIGKILL over its whole process tree, and writes the exit record only once every process of the attempt
is gone. It runs in a supervisor forked by pool.py, or in the calling process through
``run_in_foreground`` (a Slurm node; ``python -m trainq.watcher.supervisor``, whose ``main`` is here).
Taking the job's lock (``_take_lock``) and the notes written to output.log live here too.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import fcntl
import json
import os
import select
import signal
import stat
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from trainq.watcher.spec.contract import (
    ENV_ATTEMPT,
    ENV_JOB_DIR,
    ENV_JOB_ID,
    ENV_METRICS,
    ENV_STOP_FLAG,
    EXIT_FAILED,
    EXIT_USAGE,
    JobPaths,
)
from trainq.watcher.spec.errors import SpawnFailed
from trainq.watcher.spec.fsutil import (
    atomic_write_json,
    open_no_follow,
    publish_then_sync,
    remove_quietly,
    touch,
)
from trainq.watcher.spec.units import iso_utc
from trainq.watcher.supervisor import cgroups, story
from trainq.watcher.supervisor.cgroups import Containment
from trainq.watcher.supervisor.leftovers import _descendants, boot_id

#: how long the supervisor sleeps between looks at stop.flag, the timeout and its process tree (ms)
POLL_INTERVAL_MS = 50

#: exit code recorded when the command does not exist (or its cwd does not), as a shell reports it
EXIT_NOT_FOUND = 127

#: exit code recorded when the command exists but cannot be executed
EXIT_NOT_EXECUTABLE = 126

#: Linux prctl option: orphaned descendants reparent to the nearest subreaper instead of init
PR_SET_CHILD_SUBREAPER = 36

#: signals that ask a supervisor to stop its job at once (preemption, Ctrl-C, hang-up); recorded as "sigterm"
SUPERVISOR_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

#: the signal that says a batch system's time limit is near: stop.flag now, SIGTERM after stop_grace ("timeout")
TIME_LIMIT_SIGNAL = signal.SIGUSR1

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
    #: what to record in snapshot/ before the job starts (snapshot.SnapshotRequest.to_dict); None: nothing
    snapshot: dict | None = None

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
    group: Path | None = None  # the attempt's cgroup (None: process-tree mode)
    mode: str = "process-tree"  # how the attempt is contained (cgroups.MODES)
    grace_s: float | None = None  # the stop's grace: the spec's stop_grace_s, or 0 for a stop.flag saying "now"
    checkpoints: story.CheckpointWatch | None = None  # checkpoint records become events (story.py)


class _StopSignal:
    """Set by the supervisor's own SIGTERM/SIGINT/SIGHUP handler and its SIGUSR1 handler (which do nothing else)."""

    received = False
    #: SIGUSR1: the batch system's time limit is near (Slurm's --signal=B:USR1@lead); stop like a timeout
    time_limit = False


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
        raise SpawnFailed(
            f"{paths.dir}: cannot open {paths.lock.name} for attempt {attempt} "
            f"({exc.strerror}); check that the job folder exists and is writable"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise SpawnFailed(
            f"{paths.lock}: another supervisor still runs this job; "
            f"wait for it to exit (or stop it) before starting attempt {attempt}"
        ) from exc
    except OSError as exc:
        why = f"flock on {paths.lock} failed ({exc.strerror})"
        if not required:
            return fd, why
        os.close(fd)
        raise SpawnFailed(
            f"{why}: the queue root's filesystem has no working flock; keep the queue root on a "
            "local filesystem (or one mounted with flock), or use executor: slurm"
        ) from exc
    return fd, None


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


# ---------------------------------------------------------------- inside the supervisor process


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


def _supervise(
    spec: LaunchSpec,
    log_fd: int,
    prctl: Callable[..., int] | None,
    ended: Callable[[], None] = lambda: None,
    containment: Containment | None = None,
) -> dict:
    """Run one attempt to the end of its whole process tree; returns the exit record it wrote.

    ``ended`` is called once the exit record can be read, before it is synced to disk. With a cgroup
    ``containment`` the job starts inside a cgroup of its own, and "the tree" is that group.
    """
    stop_signal = _install_stop_handlers()
    _become_subreaper(prctl, log_fd)
    if spec.banner:
        _write_line(log_fd, spec.banner.splitlines()[0])
    code = story.take_snapshot(
        spec.snapshot, spec.job_dir, spec.attempt, _job_env(spec), lambda message: _note(log_fd, message)
    )
    checkpoints = story.CheckpointWatch.from_now(JobPaths(Path(spec.job_dir)), spec.attempt)
    started_at, started_mono = time.time(), time.monotonic()
    group = containment.group_for(spec.job_dir, str(spec.attempt)) if containment else None
    try:
        job, group = _spawn_contained(spec, log_fd, group, containment)
    except OSError as exc:
        _drop_group(group)
        return _record_spawn_error(spec, log_fd, exc, started_at, ended)
    attempt = _Attempt(
        spec,
        JobPaths(Path(spec.job_dir)),
        log_fd,
        job.pid,
        started_at,
        started_mono,
        dir_ino=_inode(spec.job_dir),
        group=group,
        mode=containment.mode if group is not None else "process-tree",
        checkpoints=checkpoints,
    )
    _write_started(attempt)
    story.started(attempt.paths, spec.attempt, started_at, job.pid, _job_env(spec), code)
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
        _note(
            log_fd,
            f"cannot become a child subreaper ({os.strerror(ctypes.get_errno())}); "
            "double-forked processes may escape the stop",
        )


def _job_env(spec: LaunchSpec) -> dict[str, str]:
    """The supervisor's environment, the TRAINQ_* defaults for this job, then the spec's own variables."""
    paths = JobPaths(Path(spec.job_dir))
    env = dict(os.environ) if spec.inherit_env else {}
    env.update(
        {
            ENV_JOB_ID: paths.dir.name,
            ENV_JOB_DIR: spec.job_dir,
            ENV_STOP_FLAG: str(paths.stop_flag),
            ENV_METRICS: str(paths.metrics),
            ENV_ATTEMPT: str(spec.attempt),
        }
    )
    env.update(spec.env)
    return env


def _spawn_contained(
    spec: LaunchSpec, log_fd: int, group: Path | None, containment: Containment | None
) -> tuple[subprocess.Popen, Path | None]:
    """Start the job inside ``group``; where joining it is refused, without it (a note says so).

    The supervisor steps into the group, starts the job there (so the job is born inside it and
    nothing it runs is ever outside), and steps out again before anything else happens.
    """
    if group is None or containment is None:
        return _spawn(spec, log_fd), None
    try:
        home = cgroups.enter(group, containment.mode)
    except OSError as exc:
        _note(log_fd, f"cannot enter {group} ({exc.strerror}); contained by its process tree instead")
        _drop_group(group)
        return _spawn(spec, log_fd), None
    try:
        return _spawn(spec, log_fd), group
    finally:
        _leave(home, group, containment)


def _leave(home: Path, group: Path, containment: Containment) -> None:
    """Step out of the attempt's group: back home, else into trainq's own folder; never stay (a stop would kill us)."""
    for procs in (home, containment.base / "cgroup.procs" if containment.base else None):
        if procs is None:
            continue
        try:
            cgroups.leave(procs)
            return
        except OSError:
            continue
    raise RuntimeError(f"the supervisor cannot leave the attempt's cgroup {group}")


def _drop_group(group: Path | None) -> None:
    if group is not None:
        cgroups.remove(group)


def _spawn(spec: LaunchSpec, log_fd: int) -> subprocess.Popen:
    """Start the job in its own process group; it inherits only stdin=/dev/null and output.log."""
    return subprocess.Popen(
        list(spec.argv),
        executable=spec.executable,
        cwd=spec.cwd,
        env=_job_env(spec),
        stdin=subprocess.DEVNULL,
        stdout=log_fd,
        stderr=subprocess.STDOUT,
        close_fds=True,
        start_new_session=True,
        restore_signals=True,
    )


def _write_started(a: _Attempt) -> None:
    """The start record: enough to recognise the job's processes later without trusting a bare pid."""
    try:
        create_time = psutil.Process(a.job_pid).create_time()
    except psutil.Error:
        create_time = None
    try:
        atomic_write_json(
            a.paths.started,
            {
                "attempt": a.spec.attempt,
                "supervisor_pid": os.getpid(),
                "job_pid": a.job_pid,
                "pgid": a.job_pid,
                "started_at": iso_utc(a.started_at),
                "job_create_time": create_time,
                "boot_time": psutil.boot_time(),
                "boot_id": boot_id(),
                "containment": a.mode,
                "cgroup": str(a.group) if a.group else None,
            },
            durable=False,
        )  # a crash kills the job too, and then the record no longer matters
    except OSError as exc:  # a full disk or a removed folder must not kill the job; the lock still says it runs
        _note(a.log_fd, f"cannot write the start record ({exc.strerror})")


def _record_spawn_error(
    spec: LaunchSpec, log_fd: int, exc: OSError, started_at: float, ended: Callable[[], None]
) -> dict:
    """The command could not start: say why in output.log and the exit record (127 not found, 126 otherwise)."""
    reason = _spawn_error_text(spec, exc)
    _note(log_fd, f"cannot start the job: {reason}")
    code = EXIT_NOT_FOUND if exc.errno in (errno.ENOENT, errno.ENOTDIR) else EXIT_NOT_EXECUTABLE
    record = _exit_record(spec, None, started_at, status_code=code, spawn_error=reason)
    story.exited(JobPaths(Path(spec.job_dir)), record)
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
            if a.checkpoints.due(now):
                a.checkpoints.look()
            if _reap_all(a) and pidfd is not None:
                # a reaped pidfd stays readable: unregister it or the poll would spin
                poller.unregister(pidfd)
                os.close(pidfd)
                pidfd = None
            if a.status is None and a.stop_mono is None:
                continue  # the usual case: the job runs and nobody asked anything
            tree = _tree(a)
            if a.status is not None and not tree and not (a.group and cgroups.is_populated(a.group, a.mode)):
                _drop_group(a.group)
                return
            _escalate(a, tree, now, stop_signal.received)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _tree(a: _Attempt) -> list[int]:
    """The attempt's live processes: its cgroup's members and the supervisor's descendants."""
    tree = _descendants(os.getpid())
    if a.group is not None:
        tree += [pid for pid in cgroups.members(a.group) if pid not in tree]
    return tree


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
        _request_stop(
            a, "folder_removed", now, f"the job folder {a.paths.dir} was removed; SIGTERM in {a.spec.stop_grace_s:g} s"
        )
    elif stop_signal.time_limit or (a.spec.timeout_s is not None and now - a.started_mono >= a.spec.timeout_s):
        a.created_stop_flag = not _exists(a.paths.stop_flag)
        touch(a.paths.stop_flag)  # lets the job checkpoint before it is terminated
        why = (
            "the batch system's time limit is near (SIGUSR1)"
            if stop_signal.time_limit
            else f"timeout after {a.spec.timeout_s:g} s"
        )
        _request_stop(
            a, "timeout", now, f"{why}; created {a.paths.stop_flag.name}; SIGTERM in {a.spec.stop_grace_s:g} s"
        )


def _request_stop(a: _Attempt, reason: str, now: float, message: str) -> None:
    """Record when and why the stop started."""
    a.stop_reason, a.stop_requested_at, a.stop_mono = reason, time.time(), now
    _note(a.log_fd, message)
    a.checkpoints.look()  # what the job saved before the stop comes first in its story
    story.stop_requested(
        a.paths,
        a.spec.attempt,
        reason,
        a.stop_requested_at,
        a.grace_s if a.grace_s is not None else a.spec.stop_grace_s,
    )


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
    if a.group is not None and sig == signal.SIGKILL:
        cgroups.kill(a.group, a.mode, wait_s=0.0)  # every member at once, forks in flight too
        hit += 1
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
    a.checkpoints.look()
    story.exited(a.paths, record)
    _publish_exit(a.paths, record, ended, a.log_fd)
    return record


def _publish_exit(paths: JobPaths, record: dict, ended: Callable[[], None], log_fd: int = 2) -> None:
    """The watcher may go on as soon as the record can be read; the fsync follows.

    A full disk, or a folder that cannot be written for now (permissions, a read-only or unreachable shared
    filesystem), does not lose the record: the lock stays held (the attempt still counts as alive,
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
            if exc.errno not in _EXIT_RETRIED_ERRNOS:
                raise
            if not noted:
                _note(log_fd, f"cannot write the exit record ({exc.strerror}); retrying every {EXIT_RETRY_S:g} s")
                noted = True
            time.sleep(EXIT_RETRY_S)


#: errors on writing the exit record that may go away (space freed, the folder writable again): retried
_EXIT_RETRIED_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.ESTALE}
)


class _Once:
    """Calls ``fn`` the first time it is called, never again."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn, self.called = fn, False

    def __call__(self) -> None:
        if not self.called:
            self.called = True
            self.fn()


def _exit_record(
    spec: LaunchSpec,
    job_pid: int | None,
    started_at: float,
    *,
    raw_status: int | None = None,
    status_code: int | None = None,
    spawn_error: str | None = None,
    attempt: _Attempt | None = None,
) -> dict:
    """The exit record's fields; ``raw_status`` is a waitpid status, ``status_code`` a plain exit code."""
    code, sig = status_code, None
    if raw_status is not None and os.WIFSIGNALED(raw_status):
        sig = os.WTERMSIG(raw_status)
    elif raw_status is not None:
        code = os.WEXITSTATUS(raw_status)
    return {
        "attempt": spec.attempt,
        "job_pid": job_pid,
        "exit_code": code,
        "signal": sig,
        "signal_name": signal.Signals(sig).name if sig else None,
        "started_at": iso_utc(started_at),
        "ended_at": iso_utc(time.time()),
        "stop_reason": attempt.stop_reason if attempt else None,
        "stop_requested_at": iso_utc(attempt.stop_requested_at) if attempt else None,
        "signals_sent": list(attempt.signals_sent) if attempt else [],
        "spawn_error": spawn_error,
    }


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
        _note(
            log_fd,
            f"{unlocked}; running without the lock (Slurm's job state and "
            f"{paths.heartbeat.name} tell the watcher this attempt is alive)",
        )
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
        description="Run one attempt of a trainq job in the foreground under its supervisor.",
    )
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
