"""Liveness and leftovers: whether an attempt's supervisor lives, its process tree, and what a dead one left running.

"Lock held" means "attempt alive" (``is_alive``, ``lock_state``; the start record where flock does not
work). ``kill_leftovers`` SIGKILLs the processes of a job whose supervisor died, and never a stranger's:
a start record from another boot signals nothing, and the job's process group counts only while its
leader is the very process the record names. The process-tree helpers (``_descendants``) serve the
supervisor too (attempt.py). Where the start record names the attempt's cgroup (cgroups.py), that
group is the job: its members are the process tree, and ``kill_leftovers`` ends it with one write.
This module imports nothing else of the supervisor package but cgroups.py.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import signal
import time
from pathlib import Path

import psutil

from trainq.watcher.spec.contract import ENV_JOB_DIR, JobPaths
from trainq.watcher.spec.fsutil import process_start_ticks, read_json, read_kernel_file
from trainq.watcher.supervisor import cgroups

logger = logging.getLogger(__name__)

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
    tree = _descendants(int(started["supervisor_pid"]))
    group, _mode = recorded_group(paths, started)
    if group is not None:
        tree += [pid for pid in cgroups.members(group) if pid not in tree]
    return tree


def recorded_group(paths: JobPaths, started: dict) -> tuple[Path | None, str]:
    """The attempt's cgroup named by its start record, if it is this job's own (the record is the job's to
    edit: a group named for another job, queue or boot is ignored)."""
    group, mode = cgroups.mode_of(started)
    if group is None or not is_this_boot(started):
        return None, "process-tree"
    if not cgroups.is_owned(group, paths.dir, str(started.get("attempt"))):
        logger.warning(
            "job %s: its start record names the cgroup %s, which is not this job's; ignoring it", paths.dir.name, group
        )
        return None, "process-tree"
    return group, mode


def _kill_group(paths: JobPaths) -> int:
    """End the attempt's cgroup at once and remove it; how many processes were in it."""
    started = read_json(paths.started) or {}
    group, mode = recorded_group(paths, started)
    if group is None or not group.is_dir():
        return 0
    count = len(cgroups.members(group))
    if not cgroups.kill(group, mode):
        logger.warning(
            "job %s: its cgroup %s is not empty %.0f s after cgroup.kill", paths.dir.name, group, cgroups.KILL_WAIT_S
        )
        return count
    cgroups.remove(group)
    return count


def kill_leftovers(paths: JobPaths) -> int:
    """SIGKILL every process whose TRAINQ_JOB_DIR is this job folder (or in the job's process group).

    For a supervisor that died while its job lives on; call it before moving the job folder. Repeats until
    nothing is left (a job may fork while being killed) or LEFTOVER_KILL_DEADLINE_S passes. Never signals
    a stranger: a start record from another boot means nothing of the job can be alive, and the process
    group counts only while its leader is the very process the record names (same start time).
    """
    in_group = _kill_group(paths)
    killed: set[int] = set()
    deadline = time.monotonic() + LEFTOVER_KILL_DEADLINE_S
    while True:
        found, whole_groups = _leftovers(paths)
        if not found:
            break
        for pgid in whole_groups:  # one signal to a whole group: a process forking as fast as it can escapes
            try:  # pid-by-pid kills (each scan is stale by then), never a group-wide one
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            logger.warning(
                "job %s: processes still alive after %.0f s of SIGKILL: %s",
                paths.dir.name,
                LEFTOVER_KILL_DEADLINE_S,
                sorted(found),
            )
            break
        time.sleep(LEFTOVER_RESCAN_S)
    if killed or in_group:
        logger.info(
            "job %s: killed %d leftover processes (%d in its cgroup) %s",
            paths.dir.name,
            len(killed) + in_group,
            in_group,
            sorted(killed),
        )
    return len(killed) + in_group


def _leftovers(paths: JobPaths) -> tuple[set[int], set[int]]:
    """The job's live processes, and the process groups made of nothing else (never this process's own).

    A pid hopper (fork, parent exits, over and over) keeps its process group; killing the group ends
    every generation at once, where a pid list read a moment ago names only the dead."""
    job_dirs = {os.path.normpath(str(paths.dir)), os.path.realpath(paths.dir)}
    started = read_json(paths.started) or {}
    if not is_this_boot(started):
        logger.info(
            "job %s: its start record is from an earlier boot, so none of its processes can be alive; "
            "signalling nothing",
            paths.dir.name,
        )
        return set(), set()
    pgid, born = _job_group(started), started.get("job_create_time")
    found: set[int] = set()
    members: dict[int, int] = {}  # process group -> live members, the job's or not
    ours: dict[int, int] = {}  # process group -> the job's members
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            group = os.getpgid(proc.pid)
            members[group] = members.get(group, 0) + 1
            if _in_job_group(proc, group, pgid, born) or _has_job_dir(proc, job_dirs):
                found.add(proc.pid)
                ours[group] = ours.get(group, 0) + 1
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError, PermissionError):
            continue
    whole = {group for group, count in ours.items() if group > 1 and count == members[group]}
    return found, whole - {os.getpgrp()}


@functools.cache
def boot_id() -> str | None:
    """This boot's id (Linux), or None where there is none; read once per process (it cannot change under one)."""
    try:
        return BOOT_ID_PATH.read_text().strip() or None
    except OSError:
        return None


@functools.cache
def machine_boot_time() -> float:
    """When this machine booted (epoch seconds), read once per process: psutil reads /proc/stat at every call,
    and a pooled supervisor asked twice per attempt."""
    return psutil.boot_time()


def boot_ticks() -> int | None:
    """Now, in the clock ticks after boot that /proc/PID/stat gives a process's start in (CLOCK_BOOTTIME, which the
    kernel stamps each new process with); None where there is no such clock (not Linux)."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return None if clock is None else time.clock_gettime_ns(clock) * _CLOCK_TICKS // 1_000_000_000


def create_time_of(ticks: int) -> float:
    """``process_create_time`` of a process that started at ``ticks`` (``boot_ticks``), the same number."""
    return ticks / _CLOCK_TICKS + machine_boot_time()


def process_create_time(pid: int) -> float | None:
    """``psutil.Process(pid).create_time()``, the same number (start ticks over the clock rate, plus the boot time),
    from one read of /proc/PID/stat where psutil read it twice and built a Process; None once the process is gone."""
    try:
        ticks = process_start_ticks(pid)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):  # no /proc (not Linux), or a layout we do not know
        try:
            return psutil.Process(pid).create_time()
        except psutil.Error:
            return None
    return create_time_of(ticks)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def is_this_boot(started: dict) -> bool:
    """False when a start record provably comes from another boot (boot id, or boot time for older records)."""
    recorded, current = started.get("boot_id"), boot_id()
    if recorded and current:
        return recorded == current
    boot_time = started.get("boot_time")
    if isinstance(boot_time, (int, float)):
        return abs(boot_time - machine_boot_time()) <= BOOT_TIME_TOLERANCE_S
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
    if not value:
        return False
    return os.path.normpath(value) in job_dirs or os.path.realpath(value) in job_dirs


def _in_job_group(proc: psutil.Process, group: int, pgid: int | None, born: float | None) -> bool:
    """True for a member of the job's process group (``group`` is ``proc``'s) created no earlier than the job
    (pid reuse guard)."""
    if not pgid or born is None:
        return False
    return group == pgid and proc.create_time() >= born - 0.01


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
    kids: list[int] = []
    for tid in tids:
        try:
            kids.extend(int(k) for k in read_kernel_file(f"/proc/{pid}/task/{tid}/children").split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return kids
