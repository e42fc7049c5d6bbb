"""`trainq serve`'s ears: inotify (watchdog) events on the queue's folders, turned into asyncio wake-ups.

Events are hints, the files are the truth: a wake-up only tells a stream to read its file again
(or the job feed to list the state folders again). Kernel watches are non-recursive and few:
the queue root, the four state folders, and the folder of each job somebody is streaming. No
IN_MOVED_FROM is asked for, so watchdog never holds events back waiting for a move's other half
(every move between state folders also shows as IN_MOVED_TO in the folder the job lands in).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirModifiedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers.api import BaseObserver, ObservedWatch

from trainq.watcher.faces.stream import STATES

logger = logging.getLogger(__name__)

#: the file at the queue root whose replacement the job feed reports: the watcher renames status.html
#: into place right after status.json, so both are fresh then
STATUS_FILES = ("status.html",)
#: how often --polling looks at the watched folders (s)
POLL_S = 1.0
#: the events each kind of watch needs, and the inotify mask bit behind each
_FOLDER_EVENTS = (DirCreatedEvent, DirMovedEvent, DirDeletedEvent, FileCreatedEvent, FileMovedEvent, FileDeletedEvent)
_JOB_EVENTS = (FileModifiedEvent, FileClosedEvent, FileCreatedEvent, FileMovedEvent, DirModifiedEvent)
_MASKS = {
    FileModifiedEvent: "IN_MODIFY",
    DirModifiedEvent: "IN_MODIFY",
    FileClosedEvent: "IN_CLOSE_WRITE",
    FileCreatedEvent: "IN_CREATE",
    DirCreatedEvent: "IN_CREATE",
    FileMovedEvent: "IN_MOVED_TO",
    DirMovedEvent: "IN_MOVED_TO",
    FileDeletedEvent: "IN_DELETE",
    DirDeletedEvent: "IN_DELETE",
}


class Follower:
    """One stream's subscription to one job: ``wait`` returns once its folder saw a change or a keepalive is due."""

    def __init__(self, hub: QueueWatch, job_id: str) -> None:
        self.hub, self.job_id = hub, job_id
        self.changed = asyncio.Event()
        #: the job's folder itself moved or vanished (not just a file in it): look it up again
        self.moved = False
        #: set by the hub's keepalive tick (one timer for all streams, none per wait)
        self.keepalive_due = False

    def watch(self, folder: Path) -> None:
        """Make sure the kernel watches ``folder`` (where the job is now) for this job."""
        self.hub.watch_job(self.job_id, folder)

    async def wait(self) -> bool:
        """True when something changed, False when woken for a keepalive only."""
        await self.changed.wait()
        self.changed.clear()
        due, self.keepalive_due = self.keepalive_due, False
        return not due

    def close(self) -> None:
        self.hub.unfollow(self)


class _Handler(FileSystemEventHandler):
    """Runs on watchdog's thread: gathers changed paths (in order, once each) and wakes the loop once per batch."""

    def __init__(self, hub: QueueWatch) -> None:
        self.hub = hub
        self._lock = threading.Lock()
        self._paths: dict[tuple[str, bool], None] = {}

    def on_any_event(self, event: FileSystemEvent) -> None:
        arrived = event.event_type in ("created", "moved")
        found = [(_text(event.src_path), arrived and not getattr(event, "dest_path", ""))]
        if getattr(event, "dest_path", ""):
            found.append((_text(event.dest_path), True))
        with self._lock:
            first = not self._paths
            self._paths.update(dict.fromkeys(found))
        if first:
            try:
                self.hub.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:
                pass  # the loop closed: the server is shutting down

    def _deliver(self) -> None:
        with self._lock:
            paths, self._paths = self._paths, {}
        for path, arrived in paths:
            self.hub.dispatch(path, arrived)


def _text(path: str | bytes) -> str:
    return path.decode(errors="replace") if isinstance(path, bytes) else path


class QueueWatch:
    """The observer and who listens to what; every method but the handler's runs on the event loop."""

    def __init__(self, root: Path, loop: asyncio.AbstractEventLoop, polling: bool = False) -> None:
        self.root = Path(root)
        self.loop = loop
        #: a state folder gained or lost a job (the job feed lists them again)
        self.folders_changed = asyncio.Event()
        #: status.html (so status.json too) was replaced
        self.status_changed = asyncio.Event()
        #: (state folder, name) of each folder that arrived in a state folder since the job feed last looked:
        #: a job passing through pending/ in a millisecond is gone by the time the folders are listed
        self.arrivals: list[tuple[str, str]] = []
        self._followers: dict[str, set[Follower]] = {}
        #: changes seen in job folders so far: a read made since the last one is still the latest
        self.generation = 0
        self._watches: dict[str, tuple[Path, ObservedWatch]] = {}
        self._handler = _Handler(self)
        self._observer = _observer(polling)

    def start(self) -> None:
        """Watch the root and the state folders; start watchdog's threads."""
        self._observer.schedule(self._handler, str(self.root), recursive=False, event_filter=list(_FOLDER_EVENTS))
        for state in STATES:
            self._observer.schedule(
                self._handler, str(self.root / state), recursive=False, event_filter=list(_FOLDER_EVENTS)
            )
        self._observer.daemon = True
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=5)

    async def keep_alive(self, every_s: float) -> None:
        """Forever: every ``every_s``, wake each stream for a keepalive (and a look at where its job is)."""
        while True:
            await asyncio.sleep(every_s)
            for followers in self._followers.values():
                for follower in followers:
                    follower.keepalive_due = follower.moved = True
                    follower.changed.set()

    def follow(self, job_id: str) -> Follower:
        follower = Follower(self, job_id)
        self._followers.setdefault(job_id, set()).add(follower)
        return follower

    def unfollow(self, follower: Follower) -> None:
        followers = self._followers.get(follower.job_id, set())
        followers.discard(follower)
        if not followers:
            self._followers.pop(follower.job_id, None)
            self._drop_watch(follower.job_id)

    def watch_job(self, job_id: str, folder: Path) -> None:
        """One kernel watch per followed job, moved along when the job's folder moves."""
        current = self._watches.get(job_id)
        if current and current[0] == folder:
            return
        self._drop_watch(job_id)
        try:
            watch = self._observer.schedule(self._handler, str(folder), recursive=False, event_filter=list(_JOB_EVENTS))
        except OSError as exc:  # moved or removed meanwhile: the folder watches will say where it went
            logger.debug("job %s: cannot watch %s (%s)", job_id, folder, exc)
            return
        self._watches[job_id] = (folder, watch)

    def _drop_watch(self, job_id: str) -> None:
        current = self._watches.pop(job_id, None)
        if current:
            # joins watchdog's emitter thread (0.1-10 ms): done here, not in a thread, so that a
            # job moving back to the same folder cannot have its new watch removed by the old one's removal
            _unschedule(self._observer, current[1])

    def dispatch(self, path: str, arrived: bool = False) -> None:
        """Wake whoever a changed path concerns; ``arrived``: the path was created or moved there."""
        try:
            parts = Path(path).relative_to(self.root).parts
        except ValueError:
            return
        if len(parts) == 1 and parts[0] in STATUS_FILES:
            self.status_changed.set()
        if len(parts) < 2 or parts[0] not in STATES:
            return
        self.generation += 1
        if len(parts) == 2:
            if arrived:
                self.arrivals.append((parts[0], parts[1]))
            self.folders_changed.set()
        for follower in self._followers.get(parts[1], ()):
            follower.moved = follower.moved or len(parts) == 2
            follower.changed.set()


def _unschedule(observer: BaseObserver, watch: ObservedWatch) -> None:
    try:
        observer.unschedule(watch)
    except (KeyError, OSError):
        pass


def _observer(polling: bool = False) -> BaseObserver:
    """watchdog's inotify observer whose kernel watches ask only for the events each watch filters on.

    ``polling``: watchdog's polling observer (1 s), for network filesystems, where writes made on
    another machine (a Slurm node) raise no inotify event here.
    """
    if polling:
        from watchdog.observers.polling import PollingObserver

        return PollingObserver(timeout=POLL_S)
    try:
        from watchdog.observers.inotify import InotifyEmitter, InotifyObserver
        from watchdog.observers.inotify_c import InotifyConstants
    except (ImportError, OSError):
        from watchdog.observers import Observer

        return Observer()

    class Emitter(InotifyEmitter):
        def get_event_mask_from_filter(self):
            mask = InotifyConstants.IN_DELETE_SELF
            for cls in self._event_filter or _MASKS:
                mask |= getattr(InotifyConstants, _MASKS[cls])
            return mask

    observer = InotifyObserver(timeout=0.5)
    observer._emitter_class = Emitter  # watchdog offers no argument for the emitter class (as daemon/inbox.py)
    return observer
