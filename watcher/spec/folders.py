"""The folder state machine: the only code that moves files between inbox/ pending/ running/ done/ failed/.

A job is a folder, and where the folder is says its state. The same folder travels
pending → running → done|failed by ``rename`` inside one filesystem, so a job never exists in
two states and is never copied. Every verb here is one atomic step, and every crash between two
steps leaves something ``Watcher.recover()`` knows how to finish.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import IllegalTransition, JobFolderRemoved, QueueLayoutError
from trainq.watcher.spec.fsutil import atomic_write_json, read_json, same_filesystem
from trainq.watcher.spec.text import redact_strings
from trainq.watcher.spec.tombstones import clear_tombstone, remember_ids

logger = logging.getLogger(__name__)

#: longest job id, suffix included (docs/contract.md, the inbox)
MAX_ID_LEN = 64
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_YAML_SUFFIX = re.compile(r"\.ya?ml$", re.IGNORECASE)


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
    """Every path at the top of a queue root."""

    path: Path

    @property
    def inbox(self) -> Path:
        return self.path / "inbox"

    def state_dir(self, state: JobState) -> Path:
        return self.path / state.value

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
        return self.path / state.value / job_id

    @property
    def status_json(self) -> Path:
        return self.path / "status.json"

    @property
    def status_html(self) -> Path:
        return self.path / "status.html"

    @property
    def watcher_log(self) -> Path:
        return self.path / "watcher.log"

    @property
    def watcher_yaml(self) -> Path:
        return self.path / "watcher.yaml"

    @property
    def stop_flag(self) -> Path:
        return self.path / "stop.flag"

    @property
    def pause_flag(self) -> Path:
        return self.path / "pause.flag"

    @property
    def reserve_file(self) -> Path:
        """Space the watcher holds back, and gives up on a full disk so status.json can still say so."""
        return self.path / ".trainq-reserve"

    @property
    def lock_file(self) -> Path:
        """Held (flock) by the one watcher running on this root; holds its pid."""
        return self.path / ".watcher.lock"

    def folders(self) -> list[Path]:
        return [self.inbox] + [self.state_dir(s) for s in JobState]

    def ensure_layout(self, create: bool = True) -> list[Path]:
        """Create missing folders (returns those created); QueueLayoutError if that is impossible."""
        created = []
        for folder in self.folders():
            if folder.is_dir():
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
        if not same_filesystem(self.path, *self.folders()):
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

    def __init__(self, root: QueueRoot):
        self.root = root
        self._known_ids: set[str] = set()
        self._ids_lock = threading.Lock()

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

    def _reserve_dir(self, state: JobState, file_name: str) -> tuple[str, Path]:
        """Create an empty folder under a fresh id (mkdir is the atomic reservation).

        Ids in use are known from ``load_ids`` at start-up plus every id handed out since, so
        no folder of any state is looked up per claim (a 10,000-file burst must stay fast).
        Safe on several threads: an id is taken from the known set under a lock before its mkdir.
        """
        base = id_from_name(file_name)
        n = 1
        while True:
            with self._ids_lock:
                while True:
                    job_id = base if n == 1 else _with_suffix(base, n)
                    n += 1
                    if job_id not in self._known_ids and not self._is_sweep_id(job_id):
                        self._known_ids.add(job_id)
                        break
            path = self.root.job_dir(state, job_id)
            try:
                os.mkdir(path, self.root.job_dir_mode())
            except FileExistsError:
                continue  # a folder nobody told us about: it stays known, try the next suffix
            clear_tombstone(self.root.path, job_id)  # a removed job's id, taken again (tombstones.py)
            remember_ids(self.root.path, [job_id], "failed" if state is JobState.FAILED else None)
            return job_id, path

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

        run.json is written first, then the file is hard-linked in and unlinked from the inbox
        (not renamed: an unpaired rename out of a watched folder stalls watchdog's inotify queue
        for 0.5 s). A crash leaves either a folder with run.json and no job.yaml (removed by
        recover) or one file with two names (recover unlinks the inbox name).
        """
        if state not in (JobState.PENDING, JobState.FAILED):
            raise IllegalTransition(f"{inbox_file.name}: cannot claim an inbox file straight into {state.value}/")
        job_id, path = self._reserve_dir(state, inbox_file.name)
        paths = JobPaths(path)
        try:
            atomic_write_json(paths.run, redact_strings(dict(run, id=job_id)), durable=False)
            _link_or_rename(inbox_file, paths.spec)
        except FileNotFoundError:
            self._undo_reservation(paths)
            return None
        except BaseException:  # a full disk, most often: no folder may stay in pending/ without its job
            self._undo_reservation(paths)
            raise
        return job_id, path

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

    def _undo_reservation(self, paths: JobPaths) -> None:
        for leftover in (paths.run,):
            try:
                leftover.unlink()
            except FileNotFoundError:
                pass
        try:
            paths.dir.rmdir()
        except OSError:
            logger.warning("%s: could not remove an abandoned claim folder", paths.dir)
            return
        self.forget(paths.dir.name)

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


def _link_or_rename(src: Path, dst: Path) -> None:
    """Give ``src`` the name ``dst`` and drop the old name; a symlink moves as the link itself."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        os.rename(src, dst)  # filesystems without hard links
        return
    try:
        os.unlink(src)
    except FileNotFoundError:
        pass
