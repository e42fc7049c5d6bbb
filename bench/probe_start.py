"""Two pieces of a job's start, measured alone (issue 38): how a rename into the inbox reaches a waiting loop, and
how a supervisor starts a job inside its cgroup.

1. *inotify*: a file renamed into a watched folder until the waiting thread runs, three ways: watchdog's
   observer with trainq's inbox handler (four threads between the kernel and the handler, which wakes the loop
   through a pipe), a callback on watchdog's ``InotifyFD`` (two threads), and the inotify fd read by the waiting
   thread itself (what the watcher's loop does now: ``daemon/inbox.py``'s ``LoopWatch``).
2. *cgroup start* (cgroup v2, root): the supervisor's two ways (``supervisor/attempt.py``): entering the
   attempt's group, ``subprocess.Popen`` (vfork + exec), leaving; and ``clone_into.spawn``
   (``clone3(CLONE_INTO_CGROUP)``, a fork born in the group, then exec). Each after an idle pause (``--idle``; a
   move after idling waits for an RCU grace period) and back to back. Wall time until the job has exec'd (both
   wait for it), and the parent's CPU per start.

    .venv/bin/python bench/probe_start.py [--runs 100] [--idle 0.3] [--only inotify|cgroup]
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: bench/ importable


def probe_inotify(runs: int) -> None:
    from watchdog.observers.inotify_c import InotifyConstants, InotifyFD, inotify_add_watch, inotify_init

    from trainq.watcher.daemon.inbox import InboxEvents, start_observer

    with tempfile.TemporaryDirectory(prefix="trainq-probe-", dir="/dev/shm") as tmp:
        inbox, staging = Path(tmp) / "inbox", Path(tmp) / "staging"
        inbox.mkdir()
        staging.mkdir()
        wake_r, wake_w = os.pipe()

        def renames(tag: str, wait: Callable[[], None]) -> float:
            took = []
            for i in range(runs):
                staged = staging / f"{tag}-{i}.yaml"
                staged.write_text("x")
                time.sleep(0.02)
                start = time.perf_counter()
                os.rename(staged, inbox / staged.name)
                wait()
                took.append(time.perf_counter() - start)
                time.sleep(0.01)
            return statistics.median(took) * 1e3

        handler = InboxEvents(inbox, lambda: os.write(wake_w, b"x"))
        observer = start_observer(inbox, Path(tmp), handler, polling=False)
        time.sleep(0.3)
        observed = renames("observer", lambda: os.read(wake_r, 1))
        observer.stop()
        observer.join()

        class Callback:
            def on_event(self, event) -> None:
                if event.is_moved_to:
                    os.write(wake_w, b"x")

            def on_watch_deleted(self, wd) -> None: ...

            def on_queue_overflow(self) -> None: ...

            def on_events_lost(self) -> None: ...

        mask = InotifyConstants.IN_MOVED_TO | InotifyConstants.IN_CLOSE_WRITE | InotifyConstants.IN_CREATE
        InotifyFD.get_instance().add_callback(os.fsencode(inbox), mask, Callback(), 1)  # type: ignore[arg-type]
        time.sleep(0.3)
        called = renames("callback", lambda: os.read(wake_r, 1))

        fd = inotify_init()
        inotify_add_watch(fd, os.fsencode(inbox), mask)

        def read_in_loop() -> None:
            select.select([fd], [], [], 5)
            os.read(fd, 65536)

        in_loop = renames("loop", read_in_loop)
        print(f"inotify, rename into a watched folder → the waiting thread runs, median of {runs}:")
        print(f"  watchdog observer + trainq's handler: {observed:.3f} ms")
        print(f"  watchdog InotifyFD callback:          {called:.3f} ms")
        print(f"  the fd read in the waiting loop:      {in_loop:.3f} ms")


def probe_cgroup(runs: int, idle_s: float) -> None:
    from trainq.watcher.supervisor import cgroups

    containment = cgroups.detect()
    if containment.mode != "cgroup-v2" or containment.base is None:
        print(f"cgroup start: skipped, containment is {containment.mode} ({containment.why})")
        return
    from trainq.watcher.supervisor import clone_into as product

    folder = containment.base / f"probe-{os.getpid()}"
    folder.mkdir()
    kept: list[subprocess.Popen] = []

    def enter_vfork_leave(group: Path) -> int:
        home = cgroups.enter(group, containment.mode, containment.home)
        try:
            child = subprocess.Popen(["true"], close_fds=True, start_new_session=True)
        finally:
            cgroups.leave(home)
        kept.append(child)
        return child.pid

    def clone_into(group: Path) -> int:
        return product.spawn(["true"], None, "/", dict(os.environ), 1, group)

    try:
        print(f"cgroup start, wall until the exec / the parent's CPU per start, median of {runs}:")
        for pause in (idle_s, 0.0):
            for name, start in (
                ("enter, vfork+exec, leave", enter_vfork_leave),
                ("clone3 CLONE_INTO_CGROUP", clone_into),
            ):
                walls = []
                cpu0 = resource.getrusage(resource.RUSAGE_SELF)
                for i in range(runs):
                    group = folder / f"g{i}"
                    group.mkdir()
                    time.sleep(pause)
                    t0 = time.perf_counter()
                    pid = start(group)
                    walls.append(time.perf_counter() - t0)
                    if kept:
                        kept.pop().wait()
                    else:
                        os.waitpid(pid, 0)
                    group.rmdir()
                cpu1 = resource.getrusage(resource.RUSAGE_SELF)
                cpu = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / runs * 1e3
                when = f"after {pause:g} s idle" if pause else "back to back"
                print(f"  {name:26s} {when:18s} {statistics.median(walls) * 1e3:6.2f} ms / {cpu:5.2f} ms CPU")
    finally:
        for group in folder.iterdir():
            if group.is_dir():  # the others are the folder's own cgroup files
                group.rmdir()
        folder.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--idle", type=float, default=0.3, help="pause before each start of the idle rows (s)")
    parser.add_argument("--only", choices=("inotify", "cgroup"))
    args = parser.parse_args(argv)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}")
    if args.only in (None, "inotify"):
        probe_inotify(args.runs)
    if args.only in (None, "cgroup"):
        probe_cgroup(args.runs, args.idle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
