"""Start a job already inside its cgroup v2 group: ``clone3(CLONE_INTO_CGROUP)``, then exec.

The other way to start a contained job is to step in and out: the supervisor moves itself into the attempt's
group, starts the job there with Popen (vfork + exec) and moves back. Each move writes cgroup.procs, and the
kernel takes its threadgroup lock for writing for it. Right after another move that is quick (0.02 ms). After a
quiet spell it may first wait for an RCU grace period: 16 ms in a supervisor on this project's VM after 1 s idle,
which made a job dropped into an idle queue start 21 ms after the drop instead of 5 (docs/benchmarks.md, round
four, tenth pass). A child cloned into the group (Linux 5.7) is born there and nobody moves.

What the child does between the clone and the exec is what Popen's child does for the supervisor
(``stdin=DEVNULL, stdout=log, stderr=STDOUT, close_fds=True, start_new_session=True,
restore_signals=True``, ``cwd``, ``env``, the executable looked up on the job's own PATH), so a job cannot tell
which way it was started; a failure to start raises the same ``OSError`` (with the same ``filename``), and what
Popen refuses before it forks the same ``ValueError``. The clone is a fork, not a vfork: Python cannot run in a
child that shares its memory. So it costs 1.1-1.6 ms back to back against Popen's 0.2 ms (the supervisor's page
tables copied, then torn down by the exec), and the supervisor clones only after a quiet spell, on a machine where
a move then is dear (attempt.py, ``_spawn_contained``).

Where clone3 is missing or refused (an old kernel, a seccomp filter that answers ENOSYS, cgroup v1), ``spawn``
raises ``Unsupported`` and the caller takes the old way; a refusal of the call itself is remembered for the
process, so it is tried once.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence

#: the syscall number of clone3 (the same on x86_64 and aarch64, the architectures with the unified table)
SYS_CLONE3 = 435
#: clone3's flag: the child starts in the cgroup v2 group whose directory fd is ``cgroup``
CLONE_INTO_CGROUP = 0x200000000
#: what the child's exit tells the parent: SIGCHLD, as for fork()
_EXIT_SIGNAL = signal.SIGCHLD
#: the errors that say clone3 into a group is not available in this process, whatever the group: no clone3
#: (ENOSYS: Linux < 5.3, or a seccomp filter such as Docker's default), refused (EPERM), or clone3 without
#: CLONE_INTO_CGROUP (Linux 5.3-5.6: E2BIG for the longer struct, EINVAL for the flag)
_UNAVAILABLE = (errno.ENOSYS, errno.EPERM, errno.E2BIG, errno.EINVAL)
#: the child's exit code when it could not exec (the parent reports the reason from the pipe, not this)
_CHILD_FAILED = 255


class Unsupported(Exception):
    """clone3 into a group is not possible here or now; start the job the old way."""


class _CloneArgs(ctypes.Structure):
    """struct clone_args (linux/sched.h), the version with ``cgroup`` (CLONE_ARGS_SIZE_VER2, 88 bytes)."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "flags",
            "pidfd",
            "child_tid",
            "parent_tid",
            "exit_signal",
            "stack",
            "stack_size",
            "tls",
            "set_tid",
            "set_tid_size",
            "cgroup",
        )
    ]


class _State:
    syscall: Callable[..., int] | None = None  # libc's syscall(), found once
    refused: str | None = None  # why clone3 cannot be used in this process, once it said so


def available() -> bool:
    """Whether a clone into a group may be tried in this process (Linux, and not refused before)."""
    return sys.platform.startswith("linux") and _State.refused is None


def spawn(
    argv: Sequence[str],
    executable: str | None,
    cwd: str,
    env: Mapping[str, str],
    log_fd: int,
    group: str | os.PathLike,
) -> int:
    """Start ``argv`` inside ``group`` (a cgroup v2 directory) as Popen would; the child's pid.

    OSError: the job cannot start (its cwd, or its executable), as Popen raises it. Unsupported: take the
    old way (the caller steps into the group and uses Popen).
    """
    if not available():
        raise Unsupported(_State.refused)
    candidates = _candidates(argv, executable, env)
    argv_b, env_b = _encoded(argv, env, cwd)  # checked here, as Popen checks them: the child could only die
    try:
        group_fd = os.open(group, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise Unsupported(f"cannot open {group}: {exc.strerror}") from exc
    # a caller with closed stdio fds gets them here: the child's dup2s onto 0, 1 and 2 come after it read them,
    # and the pipe's write end, opened last, is 3 or more
    devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    reader, writer = os.pipe2(os.O_CLOEXEC)
    gc_was_on = gc.isenabled()
    gc.disable()  # no collection (and no finaliser) may run in the child: it shares nothing, but it could write
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = _clone(group_fd)
        if pid == 0:
            _child(argv_b, candidates, cwd, env_b, log_fd, devnull, writer, old_mask)  # never returns
    except BaseException:
        os.close(reader)  # no child: nobody will write (a refused clone would leak one fd at every start)
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if gc_was_on:
            gc.enable()
        for fd in (group_fd, devnull, writer):
            os.close(fd)
    try:
        said = _read_all(reader)
    finally:
        os.close(reader)
    if said:
        os.waitpid(pid, 0)
        raise _failure(said, cwd, executable if executable is not None else argv[0])
    return pid


def _encoded(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> tuple[list[bytes], dict[bytes, bytes]]:
    """argv and env as the exec takes them; ValueError (as Popen's) for a NUL byte or a name with "=" in it."""
    argv_b = [os.fsencode(arg) for arg in argv]
    env_b = {os.fsencode(key): os.fsencode(value) for key, value in env.items()}
    if any(b"\0" in part for part in (*argv_b, *env_b, *env_b.values(), os.fsencode(cwd))):
        raise ValueError("embedded null byte")
    if any(not key or b"=" in key for key in env_b):
        raise ValueError("illegal environment variable name")
    return argv_b, env_b


def _candidates(argv: Sequence[str], executable: str | None, env: Mapping[str, str]) -> list[bytes]:
    """The paths to try, in order: the executable itself where it names a folder, else each of the job's PATH
    entries (Popen's lookup: the job's own PATH, not the supervisor's)."""
    program = os.fsencode(executable if executable is not None else argv[0])
    if os.path.dirname(program):
        return [program]
    return [os.path.join(os.fsencode(folder), program) for folder in os.get_exec_path(env)]


def _clone(group_fd: int) -> int:
    """clone3 with CLONE_INTO_CGROUP and fork's semantics: 0 in the child, its pid in the parent."""
    if _State.syscall is None:
        libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held, so the child holds it too
        libc.syscall.restype = ctypes.c_long
        _State.syscall = libc.syscall
    args = _CloneArgs(flags=CLONE_INTO_CGROUP, exit_signal=int(_EXIT_SIGNAL), cgroup=group_fd)
    pid = _State.syscall(ctypes.c_long(SYS_CLONE3), ctypes.byref(args), ctypes.c_size_t(ctypes.sizeof(args)))
    if pid < 0:
        err = ctypes.get_errno()
        if err in _UNAVAILABLE:
            _State.refused = f"clone3 refused: {os.strerror(err)}"
        raise Unsupported(f"clone3 into the group failed: {os.strerror(err)}")
    return int(pid)


def _child(
    argv: list[bytes],
    candidates: list[bytes],
    cwd: str,
    env: dict[bytes, bytes],
    log_fd: int,
    devnull: int,
    report: int,
    mask: set[int | signal.Signals],
) -> None:
    """In the cloned child: set up as Popen's child does, exec; on failure say why on ``report`` and exit."""
    try:
        # Every signal stays blocked until just before the exec, which resets the handlers. (A signal in that
        # moment, with an exec that fails, runs a supervisor handler here: it sets a flag in this copy, and this
        # copy exits.) Each Python step here costs copy-on-write faults, so there are few of them.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # restore_signals: Python ignores them, a job expects them
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        if log_fd == 0:
            log_fd = os.dup(log_fd)  # stdin is about to become /dev/null
        os.dup2(devnull, 0)
        if log_fd != 1:
            os.dup2(log_fd, 1)
        else:
            os.set_inheritable(1, True)
        os.dup2(1, 2)
        os.closerange(3, report)
        os.closerange(report + 1, os.sysconf("SC_OPEN_MAX"))
        try:
            os.chdir(cwd)
        except OSError as exc:
            _say(report, b"cwd", exc.errno)
            return
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        first: int | None = None
        last = errno.ENOENT
        for path in candidates:
            try:
                os.execve(path, argv, env)
            except OSError as exc:
                last = exc.errno or errno.ENOEXEC
                if first is None and last not in (errno.ENOENT, errno.ENOTDIR):
                    first = last  # Popen reports the first error that is not "not here", else the last
        _say(report, b"exec", first if first is not None else last)
    except BaseException:  # nothing else is expected here; whatever it is, the job did not start
        _say(report, b"exec", errno.EINVAL)
    finally:
        os._exit(_CHILD_FAILED)


def _say(report: int, where: bytes, err: int | None) -> None:
    try:
        os.write(report, where + b":" + str(err or 0).encode())
    except OSError:
        pass


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 256):
        chunks.append(chunk)
    return b"".join(chunks)


def _failure(said: bytes, cwd: str, program: str) -> OSError:
    """The child's report as the OSError Popen raises (a FileNotFoundError, a PermissionError, ...): ``filename``
    the cwd where that failed, else the program as the job named it."""
    where, _, number = said.partition(b":")
    err = int(number) if number.isdigit() else errno.EINVAL
    return OSError(err, os.strerror(err), cwd if where == b"cwd" else program)
