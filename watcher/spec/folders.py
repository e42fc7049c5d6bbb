"""The folder state machine: the only code that moves files between inbox/ pending/ running/ done/ failed/.

A job is a folder, and where the folder is says its state. The same folder travels
pending → running → done|failed by ``rename`` inside one filesystem, so a job never exists in
two states and is never copied. Every verb here is one atomic step, and every crash between two
steps leaves something ``Watcher.recover()`` knows how to finish.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import IllegalTransition, JobFolderRemoved, QueueLayoutError
from trainq.watcher.spec.fsutil import (
    atomic_write,
    atomic_write_json,
    read_json,
    redacted_json_text,
    remove_quietly,
    same_filesystem,
    write_new,
)
from trainq.watcher.spec.tombstones import clear_tombstone, remember_ids

logger = logging.getLogger(__name__)

#: the folder in the queue root where a job folder is built before it is renamed into its state's folder
CLAIMING_DIR = ".claiming"
#: staging names inside CLAIMING_DIR: an inbox claim (its job.yaml is the inbox file's second name until the
#: folder is in place) and a job the watcher writes itself (a sweep's; rewritten from the sweep if lost)
CLAIM_PREFIX, WRITE_PREFIX = "claim-", "write-"
#: longest job id, suffix included (docs/contract.md, the inbox)
MAX_ID_LEN = 64
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_YAML_SUFFIX = re.compile(r"\.ya?ml$", re.IGNORECASE)
#: how many ids a claim tries when folders of its ids keep appearing under it
MAX_PLACE_TRIES = 100


class JobState(str, Enum):
    """Where a job folder is; the values are the folder names."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


#: the moves the state machine allows (anything else is a bug, raised as IllegalTransition)
_ALLOWED = {
    (JobState.PENDING, JobState.RUNNING),  # start
    (JobState.PENDING, JobState.FAILED),  # cancelled before start, unsatisfiable
    (JobState.RUNNING, JobState.DONE),  # finish
    (JobState.RUNNING, JobState.FAILED),  # finish with failure
    (JobState.RUNNING, JobState.PENDING),  # retry after backoff, or never actually started
    (JobState.FAILED, JobState.PENDING),  # retry.flag
}


@dataclass(frozen=True)
class QueueRoot:
    """Every path at the top of a queue root (each made once: the loop asks for them in every pass)."""

    path: Path

    @functools.cached_property
    def inbox(self) -> Path:
        return self.path / "inbox"

    @functools.cached_property
    def _state_dirs(self) -> dict[JobState, Path]:
        return {s: self.path / s.value for s in JobState}

    def state_dir(self, state: JobState) -> Path:
        return self._state_dirs[state]

    def is_group_shared(self) -> bool:
        """The root is shared with its group when it is group-writable or setgid (``chmod g+ws``).

        Then job folders keep group access (the umask decides, as for any folder); otherwise they
        are created 0700 and run.json 0600, since a job's env (in run.json's launch) may hold secrets.
        """
        try:
            return bool(os.stat(self.path).st_mode & (stat.S_ISGID | stat.S_IWGRP))
        except OSError:
            return False

    def job_dir_mode(self) -> int:
        """The mode new job folders are created with (before the umask)."""
        return 0o777 if self.is_group_shared() else 0o700

    def job_dir(self, state: JobState, job_id: str) -> Path:
        return self._state_dirs[state] / job_id

    @functools.cached_property
    def status_json(self) -> Path:
        return self.path / "status.json"

    @functools.cached_property
    def status_html(self) -> Path:
        return self.path / "status.html"

    @functools.cached_property
    def watcher_log(self) -> Path:
        return self.path / "watcher.log"

    @functools.cached_property
    def watcher_yaml(self) -> Path:
        return self.path / "watcher.yaml"

    @functools.cached_property
    def stop_flag(self) -> Path:
        return self.path / "stop.flag"

    @functools.cached_property
    def pause_flag(self) -> Path:
        return self.path / "pause.flag"

    @functools.cached_property
    def reserve_file(self) -> Path:
        """Space the watcher holds back, and gives up on a full disk so status.json can still say so."""
        return self.path / ".trainq-reserve"

    @functools.cached_property
    def claiming(self) -> Path:
        """Where job folders are built before they are renamed into place whole (hidden; same filesystem)."""
        return self.path / CLAIMING_DIR

    @functools.cached_property
    def lock_file(self) -> Path:
        """Held (flock) by the one watcher running on this root; holds its pid."""
        return self.path / ".watcher.lock"

    def folders(self) -> list[Path]:
        return [self.inbox, *self._state_dirs.values()]

    def top(self) -> dict[str, bool] | None:
        """What the root holds, name -> is a folder, from one listing (the loop's pass asks it once for its folder
        and flag checks: five stats, two exists and a listdir a pass before). None when the root cannot be listed."""
        try:
            with os.scandir(self.path) as entries:
                return {e.name: _is_dir(e) for e in entries}
        except OSError:
            return None

    def ensure_layout(self, create: bool = True, top: dict[str, bool] | None = None) -> list[Path]:
        """Create missing folders (returns those created); QueueLayoutError if that is impossible. ``top``: the
        root's listing (``top()``), read instead of a stat per folder."""
        created = []
        for folder in self.folders():
            if top.get(folder.name, False) if top is not None else folder.is_dir():
                continue
            if not create:
                raise QueueLayoutError(f"{folder}: missing; run `trainq init {self.path}` to create the queue")
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise QueueLayoutError(f"{folder}: cannot create the queue folder ({exc.strerror})") from None
            created.append(folder)
        return created

    def check_single_filesystem(self) -> None:
        """Refuse a root whose folders span filesystems: moving a job must be one atomic rename."""
        extra = [self.claiming] if self.claiming.is_dir() else []
        if not same_filesystem(self.path, *self.folders(), *extra):
            raise QueueLayoutError(
                f"{self.path}: the queue folders are on different filesystems, so moving a job would not be "
                "atomic; keep inbox/ pending/ running/ done/ failed/ on one filesystem (no mount points inside)"
            )


def id_from_name(file_name: str) -> str:
    """``My Job (v2).yaml`` → ``My-Job--v2-``: the stem, unsafe characters replaced, capped at 64."""
    stem = _YAML_SUFFIX.sub("", file_name) or "job"
    return _UNSAFE_ID_CHARS.sub("-", stem)[:MAX_ID_LEN]


def _with_suffix(base: str, n: int) -> str:
    suffix = f"-{n}"
    return base[: MAX_ID_LEN - len(suffix)] + suffix


class Folders:
    """The state machine's verbs: ``claim``, ``start``, ``finish``, ``fail``, ``requeue``."""

    def __init__(self, root: QueueRoot, reached: Callable[[str, str], None] | None = None):
        self.root = root
        self._known_ids: set[str] = set()
        self._ids_lock = threading.Lock()
        #: called with (step, job id) after each step of a claim: the daemon's crash points (a test switch)
        self.reached = reached or (lambda _point, _job_id: None)

    def load_ids(self) -> dict[JobState, list[str]]:
        """List every job folder by state (hidden and temporary names skipped) and remember the ids."""
        found: dict[JobState, list[str]] = {}
        for state in JobState:
            found[state] = self.ids_in(state)
            self._known_ids.update(found[state])
        return found

    def ids_in(self, state: JobState) -> list[str]:
        """The job folders in ``state`` now (hidden and temporary names skipped)."""
        try:
            return [
                e.name
                for e in os.scandir(self.root.state_dir(state))
                if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")
            ]
        except FileNotFoundError:
            return []

    def forget(self, job_id: str) -> None:
        """Drop an id whose folder the user deleted, so it may be used again."""
        self._known_ids.discard(job_id)

    def _reserve_dir(self, state: JobState, file_name: str) -> tuple[str, Path, int]:
        """Pick a fresh id and create its empty staging folder in ``.claiming/``; (id, staging folder, the mode its
        files take: 0600 in a private queue, else 0644, as ``mode_beside`` would say).

        Ids in use are known from ``load_ids`` at start-up plus every id handed out since, so
        no folder of any state is looked up per claim (a 10,000-file burst must stay fast).
        Safe on several threads: an id is taken from the known set under a lock before its mkdir.
        """
        base = id_from_name(file_name)
        n = 1
        staging_root = self.staging_root()
        dir_mode = self.root.job_dir_mode()
        while True:
            with self._ids_lock:
                while True:
                    job_id = base if n == 1 else _with_suffix(base, n)
                    n += 1
                    if job_id not in self._known_ids and not self._is_sweep_id(job_id):
                        self._known_ids.add(job_id)
                        break
            if os.path.lexists(self.root.job_dir(state, job_id)):
                continue  # a folder nobody told us about: it stays known, try the next suffix
            staging = staging_root / f"{CLAIM_PREFIX}{job_id}"
            try:
                os.mkdir(staging, dir_mode)
            except FileExistsError:
                continue  # a leftover recover() has not seen: leave it, take the next suffix
            return job_id, staging, 0o644 if dir_mode & 0o077 else 0o600

    def staging_root(self) -> Path:
        """``ROOT/.claiming``, created when missing."""
        try:
            os.mkdir(self.root.claiming, 0o700)
        except FileExistsError:
            pass
        return self.root.claiming

    def place(self, staging: Path, state: JobState, job_id: str) -> Path:
        """Rename a whole staging folder into ``state/job_id`` (one atomic step); IllegalTransition if taken."""
        target = self.root.job_dir(state, job_id)
        if os.path.lexists(target):  # rename(2) would replace an empty folder someone made meanwhile
            raise IllegalTransition(f"job {job_id}: {state.value}/{job_id} already exists")
        try:
            os.rename(staging, target)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise IllegalTransition(f"job {job_id}: {state.value}/{job_id} already exists") from None
            raise
        clear_tombstone(self.root.path, job_id)  # a removed job's id, taken again (tombstones.py)
        remember_ids(self.root.path, [job_id], "failed" if state is JobState.FAILED else None)
        return target

    def _is_sweep_id(self, job_id: str) -> bool:
        """Whether ``job_id`` names a sweep of an earlier watcher (its jobs ``ID-1`` … exist; it has no folder)."""
        if f"{job_id}-1" not in self._known_ids:
            return False  # one set lookup per claim: only a sweep's first job makes the folders worth reading
        for state in JobState:
            run = read_json(JobPaths(self.root.job_dir(state, f"{job_id}-1")).run)
            if run is not None:
                if ((run.get("sweep") or {}).get("id")) == job_id:
                    self._known_ids.add(job_id)
                    return True
                return False
        return False

    def claim(self, inbox_file: Path, state: JobState, run: dict) -> tuple[str, Path] | None:
        """Take ``inbox_file`` into a new ``state`` folder as ``job.yaml``; None if it vanished meanwhile.

        The folder is built whole in ``.claiming/claim-<id>`` (run.json written, the file hard-linked in as
        job.yaml), renamed into ``state/<id>`` in one step, and only then is the inbox name unlinked (not a
        rename: an unpaired rename out of a watched folder stalls watchdog's inotify queue for 0.5 s). So no
        reader ever finds a job folder without its run.json, and a crash leaves either a staging folder
        while the inbox still holds the file (recover removes it; the file is claimed again) or one file
        with two names (recover unlinks the inbox name). Nobody reads a staging folder's run.json, so it is
        written in place (``write_new``), not through a temp file and a rename.
        """
        if state not in (JobState.PENDING, JobState.FAILED):
            raise IllegalTransition(f"{inbox_file.name}: cannot claim an inbox file straight into {state.value}/")
        for _ in range(MAX_PLACE_TRIES):
            job_id, staging, file_mode = self._reserve_dir(state, inbox_file.name)
            paths = JobPaths(staging)
            try:
                write_new(paths.run, redacted_json_text(dict(run, id=job_id)), file_mode)
                moved = _link_in(inbox_file, paths.spec)
                self.reached("claim-staged", job_id)
                path = self.place(staging, state, job_id)
            except FileNotFoundError:
                self._undo_reservation(paths, job_id)
                return None
            except IllegalTransition:  # a folder of that id appeared meanwhile: build under the next id
                self._undo_reservation(paths, job_id, keep_id=True)
                if not inbox_file.exists() and not os.path.lexists(paths.spec):
                    return None
                continue
            except BaseException:  # a full disk, most often: nothing may stay half-made
                self._undo_reservation(paths, job_id)
                raise
            self.reached("claim-placed", job_id)
            if not moved:
                remove_quietly(inbox_file)
            return job_id, path
        raise IllegalTransition(f"{inbox_file.name}: no free job id after {MAX_PLACE_TRIES} tries")

    def write_job(self, job_id: str, files: dict[str, bytes | str | dict]) -> Path:
        """Create ``pending/<job_id>`` holding ``files`` (run.json as a mapping), built whole in ``.claiming/``."""
        staging = self.staging_root() / f"{WRITE_PREFIX}{job_id}"
        if staging.exists():
            remove_tree(staging)  # a leftover of a crash: this write starts over
        os.mkdir(staging, self.root.job_dir_mode())
        try:
            for name, data in files.items():
                if isinstance(data, dict):
                    atomic_write_json(staging / name, data, durable=False)
                else:
                    atomic_write(staging / name, data, durable=False)
            return self.place(staging, JobState.PENDING, job_id)
        except BaseException:
            remove_tree(staging)
            raise

    def claim_sweep(self, inbox_file: Path, total: int, staging_prefix: str) -> tuple[str, Path] | None:
        """Take a sweep file into ``pending/<staging_prefix><id>/job.yaml``; None if it vanished meanwhile.

        The sweep id is the first of ``stem``, ``stem-2``, … such that neither it nor any of its
        jobs' ids ``<id>-1`` … ``<id>-<total>`` is in use; all of them are reserved at once. The
        staging folder is hidden, so no job is ever read from it; workflows.py writes the jobs.
        """
        base = id_from_name(inbox_file.name)[: MAX_ID_LEN - len(f"-{total}")]
        n = 1
        with self._ids_lock:
            while True:
                sweep_id = base if n == 1 else _with_suffix(base, n)[: MAX_ID_LEN - len(f"-{total}")]
                n += 1
                ids = [sweep_id] + [f"{sweep_id}-{i}" for i in range(1, total + 1)]
                staging = self.root.state_dir(JobState.PENDING) / f"{staging_prefix}{sweep_id}"
                if any(i in self._known_ids for i in ids) or staging.exists():
                    continue
                if any(self.root.job_dir(s, i).exists() for s in JobState for i in ids[:2]):
                    continue  # folders nobody told us about
                self._known_ids.update(ids)
                break
        for job_id in ids:
            clear_tombstone(self.root.path, job_id)
        remember_ids(self.root.path, ids[1:])  # its jobs: the sweep's own id never has a folder
        os.mkdir(staging, self.root.job_dir_mode())
        try:
            _link_or_rename(inbox_file, staging / JobPaths(staging).spec.name)
        except FileNotFoundError:
            staging.rmdir()
            return None
        return sweep_id, staging

    def _undo_reservation(self, paths: JobPaths, job_id: str, keep_id: bool = False) -> None:
        """Remove a staging folder whose claim failed; a job.yaml that is the file's only name goes back first."""
        try:
            if os.stat(paths.spec, follow_symlinks=False).st_nlink == 1:
                return_to_inbox(paths.spec, self.root.inbox, job_id)
        except FileNotFoundError:
            pass
        remove_tree(paths.dir)
        if not keep_id:
            self.forget(job_id)

    def move(self, job_id: str, src: JobState, dst: JobState) -> Path:
        """Rename the job folder from ``src`` to ``dst`` (one atomic step)."""
        if (src, dst) not in _ALLOWED:
            raise IllegalTransition(f"job {job_id}: {src.value} -> {dst.value} is not a legal move")
        target = self.root.job_dir(dst, job_id)
        source = self.root.job_dir(src, job_id)
        try:
            os.rename(source, target)
        except OSError as exc:
            if exc.errno == errno.ENOENT and not source.exists():
                raise JobFolderRemoved(job_id, f"{src.value}/{job_id}") from None
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise IllegalTransition(f"job {job_id}: {dst.value}/{job_id} already exists") from None
            raise
        logger.debug("job %s: folder %s -> %s", job_id, src.value, dst.value)
        if dst in (JobState.DONE, JobState.FAILED, JobState.PENDING):  # what a restart needs if it is removed
            remember_ids(self.root.path, [job_id], dst.value if dst is not JobState.PENDING else None)
        return target

    def start(self, job_id: str) -> Path:
        return self.move(job_id, JobState.PENDING, JobState.RUNNING)

    def finish(self, job_id: str, ok: bool) -> Path:
        return self.move(job_id, JobState.RUNNING, JobState.DONE if ok else JobState.FAILED)

    def fail(self, job_id: str, src: JobState = JobState.PENDING) -> Path:
        return self.move(job_id, src, JobState.FAILED)

    def requeue(self, job_id: str, src: JobState) -> Path:
        return self.move(job_id, src, JobState.PENDING)


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows a symlink, as Path.is_dir does
    except OSError:
        return False


def _link_in(src: Path, dst: Path) -> bool:
    """Give ``src`` the second name ``dst`` (the caller drops ``src`` later); True when it had to move instead."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        os.rename(src, dst)  # filesystems without hard links
        return True
    return False


def return_to_inbox(spec: Path, inbox: Path, job_id: str) -> Path:
    """Put a half-claimed job file (its only name in a staging folder) back into the inbox as a new file."""
    target = inbox / f"{job_id}.yaml"
    n = 2
    while os.path.lexists(target):
        target = inbox / f"{job_id}-returned-{n}.yaml"
        n += 1
    os.rename(spec, target)
    logger.warning("queue: %s was half claimed; it is back in the inbox as %s", spec.parent.name, target.name)
    return target


def remove_tree(path: Path) -> None:
    """Remove a staging folder and what it holds (never a symlink's target); quiet when it is gone."""
    shutil.rmtree(path, ignore_errors=True)


def _link_or_rename(src: Path, dst: Path) -> None:
    """Give ``src`` the name ``dst`` and drop the old name; a symlink moves as the link itself."""
    if _link_in(src, dst):
        return
    try:
        os.unlink(src)
    except FileNotFoundError:
        pass
