"""Containment by the kernel: each attempt (and each on_finish hook) in a cgroup of its own.

A process that keeps re-forking outruns any walk over pids, and one started with ``setsid`` and an
empty environment leaves no trace a walk could follow once its supervisor is gone. A cgroup holds
every process forked inside it, whatever it does, so a stop ends the whole group at once:
``cgroup.kill`` (cgroup v2, Linux 5.14+), or freeze, kill, thaw (v2's ``cgroup.freeze``, v1's
``freezer``). This is what systemd's scopes and Slurm's proctrack/cgroup do.

``detect()`` picks the mode once per process (``TRAINQ_CONTAINMENT`` may force one):

- ``cgroup-v2``: a writable cgroup2 hierarchy, found in /proc/self/mountinfo (``/sys/fs/cgroup`` on
  most machines, ``/sys/fs/cgroup/unified`` beside v1 controllers on others; never hard-coded);
- ``cgroup-v1``: a writable v1 ``freezer`` hierarchy;
- ``process-tree``: neither (not root, a container): today's walk over the supervisor's descendants.

Groups live under ``<hierarchy>/<the caller's own cgroup>/trainq/<queue>/``, one per attempt
(``<job id>@<attempt>@<supervisor pid>``) or hook (``<job id>@hook@<runner pid>``): never shared, not
even by a job removed and resubmitted under the same id while its old attempt still stops. The start
record names the group, so a restarted watcher finds a job's processes by it. A group is removed once
it is empty.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainq.watcher.spec.fsutil import read_kernel_file

#: env variable that forces a mode: auto (default), cgroup-v2, cgroup-v1 or process-tree
ENV_CONTAINMENT = "TRAINQ_CONTAINMENT"
#: the modes, strongest first (status.json's watcher.containment)
MODES = ("cgroup-v2", "cgroup-v1", "process-tree")
#: folder made under the caller's own cgroup to hold every trainq group
TRAINQ_DIR = "trainq"
#: separates the job id, the attempt (or "hook") and the pid in a group's name ("@" is never in a job id)
SEP = "@"
#: how long ``kill`` waits for a killed group to empty before giving up (s)
KILL_WAIT_S = 5.0
#: pause between looks while a group freezes or empties (s)
POLL_S = 0.005
MOUNTINFO = Path("/proc/self/mountinfo")
OWN_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class Containment:
    """The mode in use and where its groups go (``base`` is None in process-tree mode)."""

    mode: str
    base: Path | None = None
    why: str = ""
    #: the cgroup ``detect`` found its caller in: where a supervisor forked from it goes back after each start
    #: (read once, not from /proc at every attempt; ``enter`` reads it afresh when it is None)
    home: Path | None = field(default=None, compare=False)

    @property
    def is_cgroup(self) -> bool:
        return self.base is not None

    def group_for(self, job_dir: str | os.PathLike, kind: str) -> Path | None:
        """Make a fresh group ``<base>/<queue>/<job id>@<kind>@<pid>`` (kind: the attempt number, or "hook")."""
        if self.base is None:
            return None
        folder = self.base / _queue_key(Path(job_dir).parent.parent)
        name = f"{Path(job_dir).name}{SEP}{kind}{SEP}{os.getpid()}"
        for attempt in range(10):
            group = folder / (name + (f"-{attempt}" if attempt else ""))
            try:
                _make_group(group)
                return group
            except FileExistsError:
                if not is_populated(group, self.mode):  # left by a supervisor that died (same pid, reused)
                    return group
            except FileNotFoundError:
                continue  # the queue's folder was removed by hand between the two mkdirs
            except OSError:
                return None
        return None


def _make_group(group: Path) -> None:
    """mkdir ``group``; its queue's folder first when it is missing (it is kept between jobs, so one mkdir is the
    usual case)."""
    try:
        group.mkdir()
    except FileNotFoundError:
        group.parent.mkdir(parents=True, exist_ok=True)
        group.mkdir()


def detect(preference: str | None = None, probe: bool = True) -> Containment:
    """The strongest mode this process can use; ``preference`` (or TRAINQ_CONTAINMENT) forces one.

    ``probe`` moves a forked child into a fresh group once to prove that joining works (mkdir alone
    can succeed where moving a process in is refused).
    """
    wanted = (preference or os.environ.get(ENV_CONTAINMENT) or "auto").strip()
    if wanted not in (*MODES, "auto"):
        return Containment("process-tree", why=f"{ENV_CONTAINMENT}={wanted!r} is not one of auto, {', '.join(MODES)}")
    if wanted == "process-tree":
        return Containment("process-tree", why=f"{ENV_CONTAINMENT}=process-tree")
    reasons = []
    for mode in ("cgroup-v2", "cgroup-v1"):
        if wanted not in ("auto", mode):
            continue
        base, why = _usable_base(mode, probe)
        if base is not None:
            return Containment(mode, base, why, _own_dir(mode))
        reasons.append(why)
    return Containment("process-tree", why="; ".join(reasons))


def join(group: Path, mode: str) -> None:
    """Move the calling process into ``group`` (in a child between fork and exec)."""
    fd = os.open(group / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)


def enter(group: Path, mode: str, home: Path | None = None) -> Path:
    """Move the calling process into ``group``; returns the cgroup.procs file of the group to go back to: ``home``
    (the caller's group as ``detect`` found it), else the group it is in now.

    A supervisor enters the attempt's group, starts the job (which is born inside it: the fast
    vfork path, no window in which it could fork outside), then ``leave``s. Moving one's own
    process costs microseconds; a fork instead of a vfork to join from the child costs milliseconds.
    """
    home = home or _own_dir(mode)
    if home is None:
        raise OSError(errno.ENOENT, f"cannot tell which {mode} cgroup this process is in")
    _join_procs(group / "cgroup.procs")
    return home / "cgroup.procs"


def leave(home_procs: Path) -> None:
    """Move the calling process back to the group ``enter`` took it from."""
    _join_procs(home_procs)


def _join_procs(procs: Path) -> None:
    fd = os.open(procs, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)


def contains(group: Path, pid: int) -> bool:
    """Whether ``pid`` is in ``group`` (or a group below it)."""
    return pid in members(group)


def members(group: Path) -> list[int]:
    """Pids in ``group`` and every group below it (zombies are not members)."""
    found: list[int] = []
    for folder in _walk(group):
        try:
            found.extend(int(p) for p in (folder / "cgroup.procs").read_text().split())
        except (OSError, ValueError):
            continue
    return found


def is_populated(group: Path, mode: str) -> bool:
    """Whether any process is still in ``group`` (or below it)."""
    if mode == "cgroup-v2":
        try:
            for line in read_kernel_file(group / "cgroup.events").splitlines():
                if line.startswith(b"populated "):
                    return line.split()[1] != b"0"
        except OSError as exc:
            return exc.errno != errno.ENOENT and bool(members(group))
    return bool(members(group))


def signal_all(group: Path, sig: int) -> int:
    """Send ``sig`` to every member (a courtesy signal such as SIGTERM; ``kill`` is the sure one)."""
    hit = 0
    for pid in members(group):
        try:
            os.kill(pid, sig)
            hit += 1
        except (ProcessLookupError, PermissionError):
            continue
    return hit


def kill(group: Path, mode: str, wait_s: float = KILL_WAIT_S) -> bool:
    """SIGKILL everything in ``group`` at once, new forks included; True once it is empty."""
    if not group.is_dir():
        return True
    has_kill = mode == "cgroup-v2" and _write(group / "cgroup.kill", "1")  # the kernel kills new forks too
    if not has_kill:
        _freeze_kill_thaw(group, mode)
    deadline = time.monotonic() + wait_s
    while is_populated(group, mode):
        if time.monotonic() > deadline:
            return False
        if not has_kill:
            _freeze_kill_thaw(group, mode)  # a member that was mid-fork while we froze
        time.sleep(POLL_S)
    return True


def remove(group: Path) -> bool:
    """Remove an empty group (groups a job made below it first). The queue's folder above it stays: removing it
    with its last group and making it again for the next job cost a cgroup rmdir and mkdir per job of a serial
    queue; an empty group holds nothing. One rmdir when the job made none (the walk lists the group's control
    files too: twenty entries read every job)."""
    try:
        group.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError:
        pass  # groups below it (EBUSY), or one that is not empty yet: the walk says which
    for folder in reversed(list(_walk(group))):
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            return False
    return True


def is_owned(group: Path, job_dir: str | os.PathLike, kind: str) -> bool:
    """Whether ``group`` is a ``kind`` group (an attempt number, or "hook") of this job in its queue (a record
    in the job folder could name any path)."""
    parts = group.parts
    return (
        group.is_absolute()
        and ".." not in parts
        and len(parts) >= 4
        and parts[-1].split(SEP)[:2] == [Path(job_dir).name, str(kind)]
        and parts[-2] == _queue_key(Path(job_dir).parent.parent)
        and parts[-3] == TRAINQ_DIR
        and any(_under(group, point) for point, _root in _mounts("cgroup2") + _mounts("cgroup", "freezer"))
    )


def _under(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
    except ValueError:
        return False
    return True


#: an empty group younger than this is left alone: a supervisor or hook runner made it and is about to join it
EMPTY_GROUP_GRACE_S = 30.0


def remove_queue_folder(containment: Containment, root: str | os.PathLike) -> bool:
    """Remove the queue's folder of groups if no group is left in it (a watcher leaving: the folder is kept between
    jobs, not after the queue's last watcher). A running attempt's or hook's group keeps it; True if removed."""
    if containment.base is None:
        return False
    try:
        (containment.base / _queue_key(Path(root))).rmdir()
    except OSError:
        return False
    return True


def remove_empty_queue_folders(containment: Containment) -> int:
    """Remove every queue's folder of groups that holds no group and was not touched for EMPTY_GROUP_GRACE_S: a
    watcher killed with SIGKILL cannot remove its own (``remove_queue_folder``), and a queue root that is gone
    leaves it for good (the test suite left dozens). A live queue's empty folder may go too: its next attempt makes
    it again (``_make_group``), and rmdir never removes a folder holding a group. How many were removed."""
    if containment.base is None:
        return 0
    try:
        folders = [Path(e.path) for e in os.scandir(containment.base) if _QUEUE_FOLDER.fullmatch(e.name)]
    except OSError:
        return 0
    removed, now = 0, time.time()
    for folder in folders:
        try:
            if now - folder.stat().st_mtime >= EMPTY_GROUP_GRACE_S:
                folder.rmdir()  # EBUSY / ENOTEMPTY while a group is in it
                removed += 1
        except OSError:
            continue
    return removed


def remove_empty_groups(containment: Containment, root: str | os.PathLike) -> int:
    """Remove the queue's groups that are empty (a supervisor killed between its job's end and its rmdir), but
    none made in the last EMPTY_GROUP_GRACE_S (a starting watcher removed a hook runner's group before the
    hook joined it, and the hook was lost; the soak found it)."""
    if containment.base is None:
        return 0
    folder = containment.base / _queue_key(Path(root))
    try:
        groups = [Path(e.path) for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return 0
    removed, now = 0, time.time()
    for group in groups:
        try:
            young = now - group.stat().st_mtime < EMPTY_GROUP_GRACE_S
        except OSError:
            continue
        if not young and not is_populated(group, containment.mode) and remove(group):
            removed += 1
    return removed


def mode_of(record: dict) -> tuple[Path | None, str]:
    """The group and mode a start record (or hook.json) names; (None, "process-tree") when none."""
    group, mode = record.get("cgroup"), record.get("containment")
    if isinstance(group, str) and group and mode in ("cgroup-v2", "cgroup-v1"):
        return Path(group), mode
    return None, "process-tree"


# ---------------------------------------------------------------- helpers


def _freeze_kill_thaw(group: Path, mode: str) -> None:
    """Freeze the group (no member can fork while frozen), SIGKILL every member, thaw so they die."""
    frozen = _freeze(group, mode, True)
    for pid in members(group):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
    if frozen:
        _freeze(group, mode, False)


def _freeze(group: Path, mode: str, on: bool) -> bool:
    """Freeze (or thaw) ``group``; True once frozen (or thawed), False where it cannot be."""
    if mode == "cgroup-v2":
        if not _write(group / "cgroup.freeze", "1" if on else "0"):
            return False
        want = f"frozen {1 if on else 0}"
        return _wait_for(lambda: want in _read(group / "cgroup.events"))
    if not _write(group / "freezer.state", "FROZEN" if on else "THAWED"):
        return False
    want = "FROZEN" if on else "THAWED"
    return _wait_for(lambda: _read(group / "freezer.state").strip() == want)


def _wait_for(done, wait_s: float = 1.0) -> bool:
    deadline = time.monotonic() + wait_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def _walk(group: Path) -> list[Path]:
    """``group`` and the groups below it, parents first."""
    found, todo = [], [group]
    while todo:
        folder = todo.pop()
        found.append(folder)
        try:
            todo.extend(Path(e.path) for e in os.scandir(folder) if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, text: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        os.write(fd, text.encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _queue_key(root: Path) -> str:
    """A short name for a queue root, so two queues' job ids never share a group.

    It names the root's real path, which costs an lstat per path component: a process asks at every job's start
    (the supervisor) or end (the watcher) for the same root, so the answer is kept for QUEUE_KEY_CACHE_S.
    """
    given = os.fspath(root)
    now = time.monotonic()
    kept = _queue_keys.get(given)
    if kept is not None and now < kept[1]:
        return kept[0]
    real = os.path.realpath(given)
    key = "q" + hashlib.sha256(real.encode(errors="surrogateescape")).hexdigest()[:12]
    if len(_queue_keys) >= 64:
        _queue_keys.clear()
    _queue_keys[given] = (key, now + QUEUE_KEY_CACHE_S)
    return key


#: how long a queue root's key is trusted (seconds): a root whose real path changes (a symlink turned) is named
#: anew within this
QUEUE_KEY_CACHE_S = 5.0
_queue_keys: dict[str, tuple[str, float]] = {}


#: a queue's folder of groups, as ``_queue_key`` names it
_QUEUE_FOLDER = re.compile(r"q[0-9a-f]{12}")


#: how long this process trusts the mount table it read (seconds): cgroup hierarchies are mounted at boot, and the
#: watcher asked at every job's end (``is_owned``), parsing all of /proc/self/mountinfo twice each time
MOUNTS_CACHE_S = 5.0
_mount_table: tuple[float, list[str]] | None = None


def _mount_lines() -> list[str]:
    """The lines of /proc/self/mountinfo, read again once MOUNTS_CACHE_S old (empty when unreadable)."""
    global _mount_table
    now = time.monotonic()
    if _mount_table is None or now - _mount_table[0] >= MOUNTS_CACHE_S:
        try:
            lines = MOUNTINFO.read_text().splitlines()
        except OSError:
            lines = []
        _mount_table = (now, lines)
    return _mount_table[1]


def _mounts(fstype: str, option: str | None = None) -> list[tuple[Path, str]]:
    """(mount point, mount root) of each mount of ``fstype`` (v1: with ``option`` among its super options)."""
    found = []
    for line in _mount_lines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] != fstype:
            continue
        if option is not None and option not in tail[2].split(","):
            continue
        found.append((Path(_unescape(fields[4])), _unescape(fields[3])))
    return found


def _unescape(text: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    return text.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _own_path(mode: str) -> str | None:
    """This process's cgroup path in the v2 hierarchy ("0::/x") or the v1 freezer's ("N:freezer:/x")."""
    try:
        lines = OWN_CGROUP.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if mode == "cgroup-v2" and hier == "0" and controllers == "":
            return path
        if mode == "cgroup-v1" and "freezer" in controllers.split(","):
            return path
    return None


def _own_dir(mode: str) -> Path | None:
    """The folder of the cgroup this process is in, in ``mode``'s hierarchy."""
    own = _own_path(mode)
    mounts = _mounts("cgroup2") if mode == "cgroup-v2" else _mounts("cgroup", "freezer")
    for point, mount_root in mounts:
        if own is not None and own.startswith(mount_root):
            rel = own[len(mount_root) :].strip("/")
            return point / rel if rel else point
    return None


def _usable_base(mode: str, probe: bool) -> tuple[Path | None, str]:
    """The folder where this process can make groups in ``mode``, or (None, why not)."""
    mounts = _mounts("cgroup2") if mode == "cgroup-v2" else _mounts("cgroup", "freezer")
    own = _own_path(mode)
    if not mounts or own is None:
        return None, f"{mode}: no {'cgroup2' if mode == 'cgroup-v2' else 'freezer'} hierarchy is mounted"
    why = ""
    for point, mount_root in mounts:
        rel = own[len(mount_root) :] if own.startswith(mount_root) else None
        if rel is None:
            why = f"{mode}: this process's cgroup {own} is outside the mount at {point}"
            continue
        base = point / rel.strip("/") / TRAINQ_DIR if rel.strip("/") else point / TRAINQ_DIR
        try:
            base.mkdir(exist_ok=True)
        except OSError as exc:
            why = f"{mode}: cannot make {base} ({exc.strerror})"
            continue
        needed = "cgroup.kill" if mode == "cgroup-v2" else "freezer.state"
        if mode == "cgroup-v2" and not (base / "cgroup.kill").exists() and not (base / "cgroup.freeze").exists():
            why = f"{mode}: {base} has neither cgroup.kill nor cgroup.freeze (Linux older than 5.2)"
            continue
        if mode == "cgroup-v1" and not (base / needed).exists():
            why = f"{mode}: {base} has no {needed}"
            continue
        problem = _probe(base, mode) if probe else None
        if problem:
            why = f"{mode}: {problem}"
            continue
        return base, f"{mode} at {base}"
    return None, why


def _probe(base: Path, mode: str) -> str | None:
    """Fork a child that joins a fresh group and exits at once: None when it could, else why not."""
    group = base / f"probe-{os.getpid()}"
    procs = str(group / "cgroup.procs")
    try:
        group.mkdir(exist_ok=True)
    except OSError as exc:
        return f"cannot make {group} ({exc.strerror})"
    try:
        pid = os.fork()
        if pid == 0:  # plain syscalls only: the parent may have threads holding locks
            code = 1
            try:
                fd = os.open(procs, os.O_WRONLY)
                os.write(fd, b"0")
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        ok = os.waitstatus_to_exitcode(status) == 0
    except OSError as exc:
        return f"cannot fork the probe ({exc.strerror})"
    finally:
        _wait_for(lambda: not is_populated(group, mode), 1.0)
        try:
            group.rmdir()
        except OSError:
            pass
    return None if ok else f"a process cannot be moved into {group} (permission denied)"
