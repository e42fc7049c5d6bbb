"""The inbox: which names are candidates, and when a candidate is complete enough to take.

Events are hints and the scan is the truth. watchdog's inotify events say when a file was
renamed in (ready at once), closed after writing, or is being written (not ready, however long
the writer pauses). A file written in place (closed after writing, or seen without events:
present at start-up, events dropped, other platforms) is ready once it has been unchanged for
``inbox_settle_s`` (docs/contract.md: a shell appending line by line with ``>>`` closes the file
after every line, so a close alone says nothing about the next line) and no process holds it open
for writing (looked up in ``/proc/*/fd``); files seen without events must also have kept the same
size and mtime across scans for ``settle_s``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers.api import BaseObserver

from trainq.watcher.spec.errors import Problem
from trainq.watcher.spec.text import printable

logger = logging.getLogger(__name__)

#: suffixes editors and downloaders use for files still being written (docs/contract.md, the inbox)
_TEMP_SUFFIXES = ("~", ".swp", ".swx", ".tmp", ".part", ".crdownload")
#: vim writes a probe file of this name to test whether it may write in a folder
_VIM_PROBE = "4913"
#: how often a file marked "being written" is re-checked against /proc for a lost close event (seconds)
_WRITER_RECHECK_S = 2.0

#: most non-job entries of the inbox listed in status.json's ``ignored``
MAX_IGNORED_LISTED = 50

WRITING = "writing"
READY = "ready"
MOVED_IN = "moved_in"  # ready, and complete by the README's rule (written elsewhere, renamed in)


def is_quiet_name(name: str) -> bool:
    """Hidden files and editor/downloader temporaries: skipped without a word (they come and go)."""
    return name.startswith((".", "#")) or name == _VIM_PROBE or name.lower().endswith(_TEMP_SUFFIXES)


def ignored_reason(entry: os.DirEntry) -> str | None:
    """Why an inbox entry that is not a job file is left alone; None for one that is skipped silently."""
    if is_quiet_name(entry.name):
        return None
    try:
        if entry.is_dir(follow_symlinks=False):
            return "a folder: the inbox takes only job files"
        if not entry.is_file(follow_symlinks=False) and not entry.is_symlink():
            return "not a regular file"
    except OSError:
        return None
    if not entry.name.lower().endswith((".yaml", ".yml")):
        return "not a job file: only *.yaml and *.yml are taken"
    return None


def is_candidate_name(name: str) -> bool:
    """True for names the inbox takes: ``*.yaml``/``*.yml`` (any case), not hidden, not editor junk."""
    if name.startswith((".", "#")) or name == _VIM_PROBE:
        return False
    lower = name.lower()
    if lower.endswith(_TEMP_SUFFIXES):
        return False
    return lower.endswith((".yaml", ".yml"))


def printable_name(name: str) -> str:
    """A file name as logs, errors, status.json and the terminal show it.

    Bytes that are not UTF-8 (kept by Python as surrogates) become U+FFFD, and control characters
    are escaped (``\\n``, ``\\x1b``), so a name can never forge a log line or drive a terminal.
    """
    return printable(name)


def name_problem(name: str) -> Problem | None:
    """Why an inbox file's name is refused (not UTF-8), or None."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = name.encode("utf-8", "surrogateescape")
        bad = name[exc.start].encode("utf-8", "surrogateescape").hex()
        offset = len(name[: exc.start].encode("utf-8", "surrogateescape"))
        return Problem(
            "",
            f"the file name is not valid UTF-8 (byte 0x{bad} at byte {offset} of {len(raw)}); "
            "rename the file to UTF-8 and drop it again",
        )
    return None


@dataclass
class _Seen:
    """What the scan knows about one candidate it has no event for."""

    size: int
    mtime_ns: int
    ino: int
    since: float  # when this size/mtime was first seen
    writer_checked_at: float = 0.0


@dataclass(frozen=True)
class Candidate:
    """A candidate inbox entry as the scan saw it."""

    name: str
    path: Path
    size: int
    mtime_ns: int
    ino: int
    is_symlink: bool


class InboxEvents(FileSystemEventHandler):
    """watchdog handler: records per-name hints and wakes the loop; never touches files."""

    def __init__(self, inbox: Path, wake: Callable[[], None], flags: Iterable[Path] = ()):
        self.inbox = str(inbox)
        self._wake = wake
        self._flags = {str(p) for p in flags}  # the root's stop.flag / pause.flag: act on them at once
        self._flag_names = {p.name for p in flags}
        self._lock = threading.Lock()
        self._hints: dict[str, str] = {}
        self._set_at: dict[str, int] = {}  # name -> generation of its latest hint
        self._generation = 0

    def _name(self, path: str | bytes) -> str | None:
        path = os.fsdecode(path)
        if not path or os.path.dirname(path) != self.inbox:
            return None
        name = os.path.basename(path)
        return name if is_candidate_name(name) else None

    def _set(self, name: str | None, hint: str | None, wake: bool = True) -> None:
        if name is None:
            return
        with self._lock:
            self._generation += 1
            if hint is None:
                self._hints.pop(name, None)
                self._set_at.pop(name, None)
            else:
                self._hints[name] = hint
                self._set_at[name] = self._generation
        if hint is not None and wake:  # a file that left the inbox (often our own claim) gives the loop nothing to do
            self._wake()

    def hint(self, name: str, hint: str | None) -> bool:
        """A hint from the loop's own inotify read (``LoopWatch``), set without a wake-up (the loop is awake). True
        when the loop has something to do: ``name`` is a candidate that arrived or is being written."""
        if not is_candidate_name(name):
            return False
        self._set(name, hint, wake=False)
        return hint is not None

    def is_flag(self, name: str) -> bool:
        """Whether a name in the root is one of its flags (stop.flag, pause.flag, ``pause.POOL.flag``), not one of
        our own status.json and watcher.log writes."""
        return name in self._flag_names or name.endswith(_POOL_FLAG_SUFFIX)

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory:
            return
        if os.fsdecode(event.src_path) in self._flags or os.fsdecode(getattr(event, "dest_path", "")) in self._flags:
            self._wake()
            return
        if isinstance(event, FileMovedEvent):
            self._set(self._name(event.src_path), None)
            self._set(self._name(event.dest_path), MOVED_IN)
        elif isinstance(event, FileClosedEvent):
            self._set(self._name(event.src_path), READY)
        elif isinstance(event, (FileCreatedEvent, FileModifiedEvent)):
            self._set(self._name(event.src_path), WRITING)
        elif isinstance(event, FileDeletedEvent):
            self._set(self._name(event.src_path), None)

    def hints(self) -> dict[str, str]:
        with self._lock:
            return dict(self._hints)

    def forget(self, name: str) -> None:
        with self._lock:
            self._hints.pop(name, None)
            self._set_at.pop(name, None)

    def generation(self) -> int:
        """A counter of hints set so far (see ``prune``)."""
        with self._lock:
            return self._generation

    def prune(self, live: set[str], before: int) -> None:
        """Drop hints, set before generation ``before``, for names not in ``live`` (deletions are not watched)."""
        with self._lock:
            for name in [n for n in self._hints if n not in live and self._set_at.get(n, 0) <= before]:
                del self._hints[name]
                self._set_at.pop(name, None)


class Inbox:
    """Lists inbox candidates in drop order and decides which are complete."""

    def __init__(self, inbox: Path, settle_s: float, events: InboxEvents | None = None, written_settle_s: float = 1.0):
        self.path = inbox
        self.settle_s = settle_s
        #: watcher.yaml ``inbox_settle_s``: how long a file written in place must stand unchanged
        self.written_settle_s = written_settle_s
        self.events = events
        self._seen: dict[str, _Seen] = {}
        self._due_at: float | None = None  # when the next file written in place will have stood long enough
        #: name -> inode of a file found unfinished just after a write (invalid, or valid but unapproved):
        #: a writer that appends in pieces. It is taken again only once it has stood still for settle_s.
        self._appending: dict[str, int] = {}
        #: names whose latest event was a rename into the inbox (complete: never held back as appending)
        self.moved_in: frozenset[str] = frozenset()
        #: entries the last scan left alone, with why (status.json ``ignored``), at most MAX_IGNORED_LISTED
        self.ignored: list[dict] = []

    def scan(self) -> list[Candidate]:
        """Every candidate (regular file or symlink) in drop order: mtime, then name."""
        found = []
        ignored: list[dict] = []
        generation = self.events.generation() if self.events else 0
        try:
            entries = list(os.scandir(self.path))
        except FileNotFoundError:
            return []
        for entry in entries:
            if not is_candidate_name(entry.name):
                if len(ignored) < MAX_IGNORED_LISTED:
                    reason = ignored_reason(entry)
                    if reason:
                        ignored.append({"name": printable(entry.name), "reason": reason})
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                if len(ignored) < MAX_IGNORED_LISTED:  # FIFOs, sockets, folders named x.yaml: never touched
                    what = "a folder named like a job file" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                    ignored.append({"name": printable(entry.name), "reason": what})
                continue
            found.append(
                Candidate(entry.name, Path(entry.path), st.st_size, st.st_mtime_ns, st.st_ino, stat.S_ISLNK(st.st_mode))
            )
        found.sort(key=lambda c: (c.mtime_ns, c.name))
        self.ignored = sorted(ignored, key=lambda e: e["name"])
        live = {c.name for c in found}
        for name in list(self._seen):
            if name not in live:
                del self._seen[name]
        for name in [n for n in self._appending if n not in live]:
            del self._appending[name]
        if self.events:
            self.events.prune(live, generation)
        return found

    def ready(self, candidates: Iterable[Candidate], now: float) -> list[Candidate]:
        """The candidates that are complete: renamed in, or written in place and unchanged for inbox_settle_s
        with no writer left."""
        hints = self.events.hints() if self.events else {}
        self.moved_in = frozenset(name for name, hint in hints.items() if hint == MOVED_IN)
        self._due_at = None
        ready, unsure = [], []
        for cand in candidates:
            hint = hints.get(cand.name)
            if self._appending.get(cand.name) == cand.ino and not self.is_still(cand, now):
                continue  # an appending writer may not be done: wait until the file stands still
            if hint == MOVED_IN or cand.is_symlink:
                ready.append(cand)
            elif hint == READY:  # closed after a write in place: more lines may come (``>>`` closes each time)
                if self._unchanged_for(cand, now, self.written_settle_s) and self._writer_check_due(cand, now):
                    unsure.append(cand)
            elif self._settled(cand, now, recheck_s=_WRITER_RECHECK_S if hint == WRITING else 0.0) and (
                self._unchanged_for(cand, now, self.written_settle_s)
            ):
                unsure.append(cand)
        if unsure:
            busy = open_for_writing([c.path for c in unsure])
            for cand in unsure:
                self._seen[cand.name].writer_checked_at = now
                if cand.path not in busy:
                    ready.append(cand)
        ready.sort(key=lambda c: (c.mtime_ns, c.name))
        return ready

    def _settled(self, cand: Candidate, now: float, recheck_s: float) -> bool:
        seen = self._seen.get(cand.name)
        if seen is None or (seen.size, seen.mtime_ns, seen.ino) != (cand.size, cand.mtime_ns, cand.ino):
            self._seen[cand.name] = _Seen(cand.size, cand.mtime_ns, cand.ino, since=now)
            return self.settle_s <= 0 and recheck_s <= 0
        if now - seen.since < max(self.settle_s, recheck_s):
            return False
        return now - seen.writer_checked_at >= max(recheck_s, self.settle_s)

    def _unchanged_for(self, cand: Candidate, now: float, seconds: float) -> bool:
        """True once ``cand`` was last written ``seconds`` ago by its mtime, or (a clock that disagrees with
        ours: a network share) has kept its size, mtime and inode that long by ours; else note when it will."""
        seen = self._seen.get(cand.name)
        if seen is None or (seen.size, seen.mtime_ns, seen.ino) != (cand.size, cand.mtime_ns, cand.ino):
            seen = self._seen[cand.name] = _Seen(cand.size, cand.mtime_ns, cand.ino, since=now)
        still_s = max(now - cand.mtime_ns / 1e9, now - seen.since)
        if still_s >= seconds:
            return True
        due = now + (seconds - still_s)
        self._due_at = due if self._due_at is None else min(self._due_at, due)
        return False

    def _writer_check_due(self, cand: Candidate, now: float) -> bool:
        """A closed file another process still holds open for writing is looked up in /proc again only
        every _WRITER_RECHECK_S (a content change starts over at once)."""
        return now - self._seen[cand.name].writer_checked_at >= _WRITER_RECHECK_S

    def is_still(self, cand: Candidate, now: float) -> bool:
        """True once the file was last written at least settle_s ago (an mtime in the future counts as still)."""
        age_s = now - cand.mtime_ns / 1e9
        return age_s >= self.settle_s or age_s < -1.0

    def hold_back(self, cand: Candidate) -> None:
        """``cand`` was found unfinished right after a write: take it again only once it stands still."""
        self._appending[cand.name] = cand.ino

    def next_due_s(self, now: float | None = None) -> float | None:
        """How soon the loop should look again for held-back files and files settling (None when none waits)."""
        waits = [self.settle_s] if self._appending else []
        if self._due_at is not None:
            waits.append(max(0.0, self._due_at - (time.time() if now is None else now)))
        return min(waits) if waits else None

    def taken(self, name: str) -> None:
        """Forget what was known about a name that left the inbox."""
        self._seen.pop(name, None)
        self._appending.pop(name, None)
        if self.events:
            self.events.forget(name)


def open_for_writing(paths: list[Path]) -> set[Path]:
    """The subset of ``paths`` that some process holds open for writing (Linux /proc; else none)."""
    wanted = {os.path.realpath(p): p for p in paths}
    busy: set[Path] = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except FileNotFoundError:
        return busy
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if target in wanted and _fd_writable(pid, fd):
                busy.add(wanted[target])
    return busy


def _fd_writable(pid: str, fd: str) -> bool:
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("flags:"):
                    return int(line.split()[1], 8) & (os.O_WRONLY | os.O_RDWR) != 0
    except OSError:
        return False
    return False


#: what the inbox watch needs: files arriving (created, moved in), written, closed after writing.
#: Not opens and closes without writing (our own validation reads), not attribute changes and
#: deletions (our own claims link and unlink): each event crosses three watchdog threads.
INBOX_EVENTS = (FileCreatedEvent, FileModifiedEvent, FileClosedEvent, FileMovedEvent)
#: what the queue root's watch needs: stop.flag and pause.flag appearing and going (not every
#: watcher.log or status.json write)
ROOT_EVENTS = (FileCreatedEvent, FileDeletedEvent, FileMovedEvent)

_INOTIFY_MASKS = {
    FileCreatedEvent: "IN_CREATE",
    FileModifiedEvent: "IN_MODIFY",
    FileClosedEvent: "IN_CLOSE_WRITE",
    FileMovedEvent: "IN_MOVE",
    FileDeletedEvent: "IN_DELETE",
}


#: inotify(7)'s event header: wd, mask, cookie, length of the name that follows
_EVENT_HEADER = struct.Struct("iIII")
#: bytes one read of the inotify fd asks for, and the most one event takes (its header and a NAME_MAX name)
_READ_BYTES = 65536
_EVENT_MAX_BYTES = _EVENT_HEADER.size + 256
#: a pool's pause flag is ``pause.POOL.flag`` (config.pool_pause_flag)
_POOL_FLAG_SUFFIX = ".flag"


class LoopWatch:
    """The inbox's and the root's inotify watches, read by the watcher's loop itself (its ``select`` waits on
    ``fileno()``), through watchdog's inotify bindings.

    watchdog's observer hands each event across four threads (its reader, its dispatcher, the emitter and the
    observer's own dispatcher) before the loop hears of it: 0.7 ms from a rename into the inbox to the loop's
    wake-up on this VM, against 0.2 ms for a read in the loop (issue 38; docs/benchmarks.md). Events stay hints
    and the scan the truth (a lost or overflowed event only means the scan's settle rule decides). watchdog's
    observer remains for platforms without inotify and for ``polling`` (network filesystems).
    """

    def __init__(self, inbox: Path, root: Path, handler: InboxEvents):
        from watchdog.observers.inotify_c import InotifyConstants, inotify_init

        self.inbox, self.root, self.handler = inbox, root, handler
        self._in = c = InotifyConstants  # imported here: watchdog's inotify module refuses to import off Linux
        #: the inbox: files arriving (created, moved in or out), written, closed after writing; not opens, reads and
        #: deletions (our own claims read, link and unlink); its own removal or move (the loop makes it again)
        self._inbox_mask = c.IN_CREATE | c.IN_MODIFY | c.IN_CLOSE_WRITE | c.IN_MOVE | c.IN_DELETE_SELF | c.IN_MOVE_SELF
        #: the root: stop.flag and the pause flags appearing and going
        self._root_mask = c.IN_CREATE | c.IN_DELETE | c.IN_MOVE
        fd = inotify_init()
        if fd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_init: {os.strerror(ctypes.get_errno())}")
        os.set_blocking(fd, False)
        os.set_inheritable(fd, False)
        self._fd = fd
        self._inbox_wd: int | None = None
        self._root_wd: int | None = None
        try:
            self.rewatch()
        except OSError:
            self.close()
            raise

    def fileno(self) -> int:
        return self._fd

    def rewatch(self) -> None:
        """(Re)add both watches: at start, and after the inbox was removed and made again."""
        from watchdog.observers.inotify_c import WatchDescriptor, inotify_add_watch, inotify_rm_watch

        for wd in (self._inbox_wd, self._root_wd):
            if wd is not None:
                inotify_rm_watch(self._fd, WatchDescriptor(wd))  # gone already when its folder was removed: harmless
        self._inbox_wd = self._root_wd = None
        for path, mask in ((self.inbox, self._inbox_mask), (self.root, self._root_mask)):
            wd = inotify_add_watch(self._fd, os.fsencode(path), mask)
            if wd < 0:
                errno_ = ctypes.get_errno()
                raise OSError(errno_, f"inotify_add_watch {path}: {os.strerror(errno_)}")
            if path == self.inbox:
                self._inbox_wd = wd
            else:
                self._root_wd = wd

    def read(self) -> bool:
        """Take every event waiting (never blocks); True when one gives the loop something to do."""
        relevant = False
        while True:
            try:
                data = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                return relevant
            except OSError:
                return True  # the fd is broken: a pass (its scan) is the safe answer
            relevant = self._take(data) or relevant
            if len(data) <= _READ_BYTES - _EVENT_MAX_BYTES:
                return relevant  # room for one more event was left, so none was waiting: no read to EAGAIN

    def _take(self, data: bytes) -> bool:
        """The events in one read; True when one gives the loop something to do."""
        c, relevant, offset = self._in, False, 0
        while offset + _EVENT_HEADER.size <= len(data):
            wd, mask, _cookie, length = _EVENT_HEADER.unpack_from(data, offset)
            start = offset + _EVENT_HEADER.size
            name = os.fsdecode(data[start : start + length].rstrip(b"\0"))
            offset = start + length
            if mask & c.IN_Q_OVERFLOW:
                relevant = True  # hints were lost: the scan decides
            elif mask & (c.IN_IGNORED | c.IN_DELETE_SELF | c.IN_MOVE_SELF):
                relevant = True  # the inbox (or the root) went: check_layout makes it again and rewatches
            elif mask & c.IN_ISDIR:
                continue
            elif wd == self._inbox_wd:
                relevant = self.handler.hint(name, self._hint(mask)) or relevant
            elif wd == self._root_wd:
                relevant = self.handler.is_flag(name) or relevant
        return relevant

    def _hint(self, mask: int) -> str | None:
        """The hint an inbox event gives (``InboxEvents.on_any_event`` gives the same for watchdog's events)."""
        c = self._in
        if mask & c.IN_MOVED_FROM:
            return None  # gone from the inbox
        return MOVED_IN if mask & c.IN_MOVED_TO else READY if mask & c.IN_CLOSE_WRITE else WRITING

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def start_observer(inbox: Path, root: Path, handler: FileSystemEventHandler, polling: bool) -> BaseObserver:
    """Start a watchdog observer on the inbox and the queue root (non-recursive); ``polling`` for network filesystems."""
    if polling:
        from watchdog.observers.polling import PollingObserver

        observer: BaseObserver = PollingObserver(timeout=0.5)
    else:
        try:
            observer = _inotify_observer()
        except (ImportError, OSError):
            from watchdog.observers import Observer

            observer = Observer()
    schedule(observer, inbox, root, handler)
    observer.daemon = True
    observer.start()
    return observer


def schedule(observer: BaseObserver, inbox: Path, root: Path, handler: FileSystemEventHandler) -> None:
    """Watch ``inbox`` and ``root`` for the events each needs."""
    observer.schedule(handler, str(inbox), recursive=False, event_filter=list(INBOX_EVENTS))
    observer.schedule(handler, str(root), recursive=False, event_filter=list(ROOT_EVENTS))


def _inotify_observer() -> BaseObserver:
    """An inotify observer with full move events whose kernel watch asks only for the filtered events."""
    from watchdog.observers.inotify import InotifyFullEmitter, InotifyObserver
    from watchdog.observers.inotify_c import InotifyConstants

    class Emitter(InotifyFullEmitter):
        def get_event_mask_from_filter(self):
            mask = InotifyConstants.IN_DELETE_SELF
            for cls in self._event_filter or _INOTIFY_MASKS:
                mask |= getattr(InotifyConstants, _INOTIFY_MASKS[cls])
            return mask

    # full events: a file renamed into the inbox must read as "moved in" (ready), not "created"
    observer = InotifyObserver(generate_full_events=True, timeout=0.5)
    observer._emitter_class = Emitter  # watchdog offers no argument for the emitter class
    return observer
