"""One attempt's supervision, inside the supervisor process: run a job's attempt to the end of its whole process tree.

``_supervise`` becomes a child subreaper, starts the job with its output going straight to ``output.log``,
writes the start record, watches stop.flag / timeout / its own SIGTERM, escalates stop → SIGTERM →
SIGKILL over its whole process tree, and writes the exit record only once every process of the attempt
is gone. It runs in a supervisor forked by pool.py, or in the calling process (foreground.py: a Slurm
node, ``python -m trainq.watcher.supervisor``). What an attempt is handed and leaves behind (``LaunchSpec``,
the job's lock, the notes in output.log, the exit record and how it is published) is attempt_io.py's.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import select
import signal
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from trainq.watcher.spec.contract import (
    ENV_ATTEMPT,
    ENV_JOB_DIR,
    ENV_JOB_ID,
    ENV_METRICS,
    ENV_STOP_FLAG,
    REASON_PHRASES,
    REASON_USER,
    JobPaths,
    paths_of,
    stop_flag_reason,
)
from trainq.watcher.spec.fsutil import atomic_write_json, exists, open_no_follow, remove_quietly, touch
from trainq.watcher.spec.units import iso_utc
from trainq.watcher.supervisor import cgroups, clone_into, story
from trainq.watcher.supervisor.attempt_io import (
    LaunchSpec,
    _exit_record,
    _note,
    _publish_exit,
    _record_spawn_error,
    _write_line,
    reason_word,
)
from trainq.watcher.supervisor.cgroups import Containment
from trainq.watcher.supervisor.leftovers import (
    _descendants,
    boot_id,
    boot_ticks,
    create_time_of,
    machine_boot_time,
    process_create_time,
)

#: how long the supervisor sleeps between looks at stop.flag, the timeout and its process tree (ms)
POLL_INTERVAL_MS = 50

#: Linux prctl option: orphaned descendants reparent to the nearest subreaper instead of init
PR_SET_CHILD_SUBREAPER = 36

#: signals that ask a supervisor to stop its job at once (preemption, Ctrl-C, hang-up); recorded as "sigterm"
SUPERVISOR_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

#: the signal that says a batch system's time limit is near: stop.flag now, SIGTERM after stop_grace ("timeout")
TIME_LIMIT_SIGNAL = signal.SIGUSR1

#: how long after the last move between cgroups (by any supervisor of the pool) a supervisor steps in and out again
#: to start a job (the vfork, 0.2 ms). A move takes the kernel's threadgroup lock for writing, which stays quick for
#: ~20 ms after the last one; after that, on some machines, it first waits for an RCU grace period (16 ms in a
#: supervisor on this project's VM one day, under 1 ms on another: docs/benchmarks.md, round four, tenth pass)
MOVES_WARM_S = 0.015
#: a move after a quiet spell that took longer than this makes the next quiet start clone the job into its group
#: instead (clone_into.py: a fork, 1-3 ms, that moves nobody); the moves made after a quiet spell keep measuring it
QUIET_MOVE_DEAR_S = 0.002


@dataclass
class _Attempt:
    """Mutable state of the running attempt; lives only inside the supervisor process."""

    spec: LaunchSpec
    paths: JobPaths
    log_fd: int
    job_pid: int
    started_at: float
    started_mono: float
    checkpoints: story.CheckpointWatch  # checkpoint records become events (story.py)
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
    flag_reason: str | None = (
        None  # the reason word (docs/contract.md, why a job stopped) its stop.flag carried (user, deadline, ...)
    )
    grace_s: float | None = None  # the stop's grace: the spec's stop_grace_s, or 0 for a stop.flag saying "now"
    warned_at: float | None = None  # when the batch system's time-limit warning came (epoch seconds), if it did
    amend: Callable[[dict], dict] | None = None  # what the caller adds to the exit record (a Slurm node's watches)
    born: float | None = None  # the job process's create time, when the clock around its start told it (_supervise)


class _StopSignal:
    """Set by the supervisor's own SIGTERM/SIGINT/SIGHUP handler and its SIGUSR1 handler (which do nothing else)."""

    received = False
    #: SIGUSR1: the batch system's time limit is near (Slurm's --signal=B:USR1@lead); stop like a timeout
    time_limit = False
    #: when that warning came (epoch seconds): the first one, even if it came before this process ran
    time_limit_at: float | None = None


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


# ---------------------------------------------------------------- inside the supervisor process


def hold_time_limit_warning() -> None:
    """Block TIME_LIMIT_SIGNAL until the supervisor's handler exists (``_install_stop_handlers`` unblocks it): a
    warning that comes before then waits instead of killing the process (SIGUSR1's default action). Slurm's node
    side calls it first thing, because Slurm may send the warning the moment the batch job starts."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {TIME_LIMIT_SIGNAL})


def _reset_signals(hold: tuple[int, ...] = ()) -> None:
    """Default disposition for every signal, a mask of only ``hold``, SIGPIPE ignored (a dead reader must not kill
    us)."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP) or signal.getsignal(sig) is signal.SIG_DFL:
            continue  # getsignal is cheap; a sigaction for each of 64 signals is not free
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # signals reserved by libc
    signal.pthread_sigmask(signal.SIG_SETMASK, hold)
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
    warned_at: float | None = None,
    amend: Callable[[dict], dict] | None = None,
) -> dict:
    """Run one attempt to the end of its whole process tree; returns the exit record it wrote.

    ``ended`` is called once the exit record can be read, before it is synced to disk. With a cgroup
    ``containment`` the job starts inside a cgroup of its own, and "the tree" is that group. ``amend`` turns the
    exit record into the one written (a Slurm node's watch of srun adds what it knows).
    """
    stop_signal = _install_stop_handlers(warned_at)
    _become_subreaper(prctl, log_fd)
    if spec.banner:
        _write_line(log_fd, spec.banner.splitlines()[0])
    env = _job_env(spec)  # built once: the snapshot, the job and its ``started`` event read the same
    note = functools.partial(_note, log_fd)  # the snapshot's problems go to output.log
    snapshot = story.read_snapshot(spec.snapshot, spec.job_dir, spec.attempt, env, note)
    checkpoints = story.CheckpointWatch.from_now(paths_of(spec.job_dir), spec.attempt)
    started_at, started_mono = time.time(), time.monotonic()
    group = containment.group_for(spec.job_dir, str(spec.attempt)) if containment else None
    before = boot_ticks()
    try:
        job, group = _spawn_contained(spec, env, log_fd, group, containment)
    except OSError as exc:
        _drop_group(group)
        story.write_snapshot(snapshot, note)  # what would have run
        return _record_spawn_error(spec, log_fd, exc, started_at, ended)
    attempt = _Attempt(
        spec,
        paths_of(spec.job_dir),
        log_fd,
        job.pid,
        started_at,
        started_mono,
        dir_ino=_inode(spec.job_dir),
        group=group,
        mode=containment.mode if group is not None and containment is not None else "process-tree",
        checkpoints=checkpoints,
        amend=amend,
        # the kernel stamps a new process in boot-clock ticks: when the whole start fell inside one tick, that is
        # the job's, and /proc/PID/stat need not be read (25 us, and more while the job's exec holds it up)
        born=create_time_of(before) if before is not None and boot_ticks() == before else None,
    )
    code = story.write_snapshot(snapshot, note)  # read before the job started
    _write_started(attempt)
    story.started(attempt.paths, spec.attempt, started_at, job.pid, env, code)
    if isinstance(job, _Cloned) and containment is not None:
        _keep_moves_quick(containment)
    _watch(attempt, stop_signal)
    # we reaped it (_watch returns once the main child is): Popen must not wait or warn
    job.returncode = os.waitstatus_to_exitcode(cast(int, attempt.status))
    return _write_exit(attempt, ended)


def _install_stop_handlers(warned_at: float | None = None) -> _StopSignal:
    """SIGTERM/SIGINT/SIGHUP only set a flag; the loop forwards SIGTERM to the job tree. ``warned_at``: the time a
    time-limit warning came before this process could handle it (Slurm's batch script caught it)."""
    stop_signal = _StopSignal()
    if warned_at is not None:
        stop_signal.time_limit, stop_signal.time_limit_at = True, warned_at

    def on_stop(_signum: int, _frame: object) -> None:
        stop_signal.received = True

    def on_time_limit(_signum: int, _frame: object) -> None:
        stop_signal.time_limit = True
        stop_signal.time_limit_at = stop_signal.time_limit_at or time.time()

    for sig in SUPERVISOR_STOP_SIGNALS:
        signal.signal(sig, on_stop)
    signal.signal(TIME_LIMIT_SIGNAL, on_time_limit)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {TIME_LIMIT_SIGNAL})  # a warning held until now comes in here
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
    """The supervisor's environment, the TRAINQ_* defaults for this job, then the spec's own variables (the
    watcher's launch sets every default itself, and then none is made here)."""
    env = dict(os.environ) if spec.inherit_env else {}
    if not all(name in spec.env for name in _DEFAULTED):
        paths = paths_of(spec.job_dir)
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


#: the variables ``_job_env`` gives a job whose spec does not
_DEFAULTED = (ENV_JOB_ID, ENV_JOB_DIR, ENV_STOP_FLAG, ENV_METRICS, ENV_ATTEMPT)


class _Moves:
    """What the pool's supervisors know of moves between cgroups: when the last one was (monotonic seconds, the same
    clock in every process; 0: never), and how long the last one made after a quiet spell took (seconds; 0: none
    yet). The lock is the kernel's, one for the machine, so this is shared: a page mapped before the spawner helper
    forks its supervisors is the same page in all of them (each would otherwise see only its own moves, and the
    pool takes turns)."""

    _page = mmap.mmap(-1, 16)  # anonymous and MAP_SHARED: inherited as shared memory by every process forked later

    @classmethod
    def quiet_for(cls) -> float:
        return time.monotonic() - struct.unpack_from("d", cls._page, 0)[0]

    @classmethod
    def quiet_move_is_dear(cls) -> bool:
        """Whether a move now, after a quiet spell, would likely cost more than a clone (or nobody knows yet)."""
        took = struct.unpack_from("d", cls._page, 8)[0]
        return took == 0.0 or took > QUIET_MOVE_DEAR_S

    @classmethod
    def moved(cls, quiet_move_took: float | None = None) -> None:
        struct.pack_into("d", cls._page, 0, time.monotonic())
        if quiet_move_took is not None:
            struct.pack_into("d", cls._page, 8, max(quiet_move_took, 1e-9))


@dataclass
class _Cloned:
    """A job started by ``clone_into``: what the attempt reads of a Popen (its pid; its returncode is set at the end)."""

    pid: int
    returncode: int | None = None


def _spawn_contained(
    spec: LaunchSpec, env: dict[str, str], log_fd: int, group: Path | None, containment: Containment | None
) -> tuple[subprocess.Popen | _Cloned, Path | None]:
    """Start the job inside ``group``; where joining it is refused, without it (a note says so).

    The job is born inside the group, so nothing it runs is ever outside. The supervisor steps into the group,
    starts the job there, and steps out again before anything else happens; or, with cgroup v2 after a quiet spell
    on a machine where a move after a quiet spell is dear, it clones the job straight into the group (clone_into.py:
    no process moves). The moves made after a quiet spell are timed, so the choice follows the machine.
    """
    if group is None or containment is None:
        return _spawn(spec, env, log_fd), None
    quiet = _Moves.quiet_for() > MOVES_WARM_S
    if quiet and containment.mode == "cgroup-v2" and _Moves.quiet_move_is_dear():
        try:
            return _Cloned(_clone_into_group(spec, env, log_fd, group)), group
        except clone_into.Unsupported:
            pass  # an old kernel, a filter, a group it cannot be cloned into: the old way says what goes wrong
    entering = time.perf_counter()
    try:
        home = cgroups.enter(group, containment.mode, containment.home)
        took = time.perf_counter() - entering
    except OSError as exc:
        _note(log_fd, f"cannot enter {group} ({exc.strerror}); contained by its process tree instead")
        _drop_group(group)
        return _spawn(spec, env, log_fd), None
    try:
        return _spawn(spec, env, log_fd), group
    finally:
        _leave(home, group, containment)
        _Moves.moved(took if quiet else None)


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


def _keep_moves_quick(containment: Containment) -> None:
    """After a clone into a group: one move that moves nothing (this process into the group it is in), so that the
    kernel's lock is quick again for the next start. Its wait for a grace period is paid here, once the job runs
    and its records are written, instead of in the next job's start."""
    if containment.home is None:
        return
    moving = time.perf_counter()
    try:
        cgroups.leave(containment.home / "cgroup.procs")
    except OSError:
        return  # the next start clones again
    _Moves.moved(time.perf_counter() - moving)


def _clone_into_group(spec: LaunchSpec, env: dict[str, str], log_fd: int, group: Path) -> int:
    """``_spawn``'s start, cloned into ``group``: the job's pid (clone_into.Unsupported: use ``_spawn``)."""
    return clone_into.spawn(spec.argv, spec.executable, spec.cwd, env, log_fd, group)


def _spawn(spec: LaunchSpec, env: dict[str, str], log_fd: int) -> subprocess.Popen:
    """Start the job in its own process group; it inherits only stdin=/dev/null and output.log."""
    return subprocess.Popen(
        list(spec.argv),
        executable=spec.executable,
        cwd=spec.cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log_fd,
        stderr=subprocess.STDOUT,
        close_fds=True,
        start_new_session=True,
        restore_signals=True,
    )


def _write_started(a: _Attempt) -> None:
    """The start record: enough to recognise the job's processes later without trusting a bare pid."""
    create_time = a.born if a.born is not None else process_create_time(a.job_pid)
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
                "boot_time": machine_boot_time(),
                "boot_id": boot_id(),
                "containment": a.mode,
                "cgroup": str(a.group) if a.group else None,
            },
            durable=False,
        )  # a crash kills the job too, and then the record no longer matters
    except OSError as exc:  # a full disk or a removed folder must not kill the job; the lock still says it runs
        _note(a.log_fd, f"cannot write the start record ({exc.strerror})")


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
            if a.status is not None and _all_gone(a):
                _drop_group(a.group)
                return
            _escalate(a, _tree(a), now, stop_signal.received)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _all_gone(a: _Attempt) -> bool:
    """No descendant of ours is left and the attempt's group is empty: ``_tree`` would be empty, found with one read
    of cgroup.events where a v2 group is (the members' walk is for when something is left to signal)."""
    return not _descendants(os.getpid()) and not (a.group and cgroups.is_populated(a.group, a.mode))


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
    elif exists(a.paths.stop_flag):
        content = _flag_content(a.paths.stop_flag)
        a.grace_s = 0.0 if content.strip().lower() == b"now" else a.spec.stop_grace_s
        a.flag_reason = stop_flag_reason(content)
        _request_stop(
            a,
            "stop_flag",
            now,
            f"stop requested {_requested_by(a.flag_reason)} ({a.paths.stop_flag.name}); SIGTERM in {a.grace_s:g} s",
        )
    elif _inode(a.paths.dir) != a.dir_ino:  # rm -rf of the job folder: a stop, as stop.flag would do it
        _request_stop(
            a, "folder_removed", now, f"the job folder {a.paths.dir} was removed; SIGTERM in {a.spec.stop_grace_s:g} s"
        )
    elif stop_signal.time_limit or (a.spec.timeout_s is not None and now - a.started_mono >= a.spec.timeout_s):
        a.created_stop_flag = not exists(a.paths.stop_flag)
        touch(a.paths.stop_flag)  # lets the job checkpoint before it is terminated
        a.warned_at = stop_signal.time_limit_at if stop_signal.time_limit else None
        why = _time_limit_words(a) if stop_signal.time_limit else f"timeout after {a.spec.timeout_s:g} s"
        _request_stop(
            a, "timeout", now, f"{why}; created {a.paths.stop_flag.name}; SIGTERM in {a.spec.stop_grace_s:g} s"
        )


def _time_limit_words(a: _Attempt) -> str:
    """The time-limit warning as what it is, with when it came: Slurm may send it up to 60 s before its lead."""
    if a.warned_at is None:
        return "the batch system's time limit is near (SIGUSR1)"
    after = a.warned_at - a.started_at
    when = f"{after:.1f} s after the job started" if after >= 0 else f"{-after:.1f} s before the job started"
    return f"the batch system's time limit is near: its warning (SIGUSR1) came {when}"


def _requested_by(reason: str) -> str:
    """How the log's "stop requested ..." line names who asked ("on request" would read twice)."""
    return "by the user" if reason == REASON_USER else REASON_PHRASES[reason]


def _request_stop(a: _Attempt, reason: str, now: float, message: str) -> None:
    """Record when and why the stop started."""
    a.stop_reason, a.stop_requested_at, a.stop_mono = reason, time.time(), now
    _note(a.log_fd, message)
    a.checkpoints.look()  # what the job saved before the stop comes first in its story
    story.stop_requested(
        a.paths,
        a.spec.attempt,
        reason,
        reason_word(a),
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
    if a.amend is not None:
        record = a.amend(record)
    if a.stop_reason == "folder_removed":
        ended()  # no record: the folder it would go to is gone (or is a new job's under the same id)
        return record
    a.checkpoints.look()
    story.exited(a.paths, record)
    _publish_exit(a.paths, record, ended, a.log_fd)
    return record


def _inode(path: str | Path) -> int | None:
    """The inode of ``path``, or None when it is gone."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _says_now(stop_flag: Path) -> bool:
    """A stop.flag holding ``now`` (``trainq stop --now``) asks for no grace."""
    return _flag_content(stop_flag).strip().lower() == b"now"


def _flag_content(stop_flag: Path) -> bytes:
    """The first bytes of a stop.flag: ``now``, a reason word the watcher wrote, or nothing."""
    try:
        with open_no_follow(stop_flag) as f:  # the job can make it a FIFO: never block on it
            return f.read(16) or b""
    except OSError:
        return b""
