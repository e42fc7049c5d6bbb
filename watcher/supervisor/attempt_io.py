"""One attempt's inputs and outputs: what the watcher hands its supervisor, and what the supervisor leaves behind.

``LaunchSpec`` is the request (JSON-able, so a Slurm node can read it from a file). ``_take_lock`` takes the
job's lock ("lock held" means "attempt alive"). ``open_job_log`` opens output.log, never through a symlink or
into a FIFO, and ``_note`` writes the ``trainq:`` lines the user reads there. The exit record's fields
(``_exit_record``, also for a command that could not start) are published with ``_publish_exit``: the
watcher may go on as soon as it can be read, and a full disk only delays it, the lock held meanwhile.
attempt.py runs the attempt between the two ends.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainq.watcher.spec.contract import JobPaths, paths_of
from trainq.watcher.spec.errors import SpawnFailed
from trainq.watcher.spec.fsutil import exists, json_text, publish_then_sync, remove_quietly
from trainq.watcher.spec.units import iso_utc
from trainq.watcher.supervisor import story

#: exit code recorded when the command does not exist (or its cwd does not), as a shell reports it
EXIT_NOT_FOUND = 127
#: exit code recorded when the command exists but cannot be executed
EXIT_NOT_EXECUTABLE = 126
#: how often a supervisor retries writing its exit record while the disk is full (s)
EXIT_RETRY_S = 0.5
#: errors on writing the exit record that may go away (space freed, the folder writable again): retried
_EXIT_RETRIED_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.ESTALE}
)


class StopFacts(Protocol):
    """What the exit record reads from a running attempt (attempt.py's ``_Attempt``)."""

    stop_reason: str | None
    stop_requested_at: float | None
    signals_sent: list[str]
    warned_at: float | None  # when a batch system's time-limit warning came (epoch seconds), if it did
    flag_reason: str | None  # the reason word (docs/contract.md, why a job stopped) its stop.flag carried


def reason_word(attempt: StopFacts) -> str | None:
    """Why the attempt stopped, in the words of docs/contract.md, why a job stopped; None when the job ended by itself."""
    if attempt.stop_reason == "stop_flag":
        return attempt.flag_reason or "user"
    return {"timeout": "timeout", "folder_removed": "removed"}.get(attempt.stop_reason or "")


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


def _record_spawn_error(
    spec: LaunchSpec, log_fd: int, exc: OSError, started_at: float, ended: Callable[[], None]
) -> dict:
    """The command could not start: say why in output.log and the exit record (127 not found, 126 otherwise)."""
    reason = _spawn_error_text(spec, exc)
    _note(log_fd, f"cannot start the job: {reason}")
    code = EXIT_NOT_FOUND if exc.errno in (errno.ENOENT, errno.ENOTDIR) else EXIT_NOT_EXECUTABLE
    record = _exit_record(spec, None, started_at, status_code=code, spawn_error=reason)
    story.exited(paths_of(spec.job_dir), record)
    _publish_exit(paths_of(spec.job_dir), record, ended, log_fd)
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


def _publish_exit(paths: JobPaths, record: dict, ended: Callable[[], None], log_fd: int = 2) -> None:
    """The watcher may go on as soon as the record can be read; the fsync follows.

    A full disk, or a folder that cannot be written for now (permissions, a read-only or unreachable shared
    filesystem), does not lose the record: the lock stays held (the attempt still counts as alive,
    so nobody guesses its end) and the write is retried every EXIT_RETRY_S until it gets through.
    A job folder removed by hand gets no record: the attempt just ends.
    """
    data = json_text(record, ensure_ascii=True).encode()
    once = _Once(ended)
    noted = False
    while True:
        try:
            publish_then_sync(paths.exit_record, data, once)
            return
        except FileNotFoundError:
            if exists(paths.dir):
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
    attempt: StopFacts | None = None,
) -> dict:
    """The exit record's fields; ``raw_status`` is a waitpid status, ``status_code`` a plain exit code."""
    code, sig = status_code, None
    if raw_status is not None and os.WIFSIGNALED(raw_status):
        sig = os.WTERMSIG(raw_status)
    elif raw_status is not None:
        code = os.WEXITSTATUS(raw_status)
    record = {
        "attempt": spec.attempt,
        "job_pid": job_pid,
        "exit_code": code,
        "signal": sig,
        "signal_name": signal.Signals(sig).name if sig else None,
        "started_at": iso_utc(started_at),
        "ended_at": iso_utc(time.time()),
        "stop_reason": attempt.stop_reason if attempt else None,
        "reason": reason_word(attempt) if attempt else None,
        "stop_requested_at": iso_utc(attempt.stop_requested_at) if attempt else None,
        "signals_sent": list(attempt.signals_sent) if attempt else [],
        "spawn_error": spawn_error,
    }
    if attempt is not None and attempt.warned_at is not None:
        record["time_limit_warned_at"] = iso_utc(attempt.warned_at)
    return record


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
