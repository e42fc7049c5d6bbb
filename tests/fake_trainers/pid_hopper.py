"""A "pid hopper": forks its next generation and exits, over and over, so no pid of it stays put.

It ignores SIGTERM (only SIGKILL ends it) and touches READY_FILE after a few hundred hops. MARKER
only makes its command line easy to find. It ends itself after LIFETIME_S, so a hopper that a test
failed to end burns a core for minutes, not for the rest of a CI run.
Usage: pid_hopper.py MARKER READY_FILE

Imported (tests, bench/bench_containment.py), it gives ``with_marker`` and ``stamp_out``, the way to end
every generation for sure.
"""

import os
import signal
import sys
import time

import psutil

#: a hopper ends itself this long after its first generation started (s)
LIFETIME_S = 300.0


def with_marker(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker`` (the hopper's generations)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and marker in " ".join(proc.cmdline()):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def stamp_out(marker: str, deadline_s: float = 30.0) -> int:
    """End every generation; how many process groups were killed. A generation lives a few ms, so a pid
    read from /proc names the dead more often than not, and pid-by-pid kills let one escape now and then
    (an escaped hopper burns a core, and its zombies the kernel's time, for the rest of a run). The hopper
    keeps its process group, so one killpg ends all its generations at once; three scans in a row that
    find nothing say it is gone (a generation that is exiting shows no command line)."""
    own, groups = os.getpgrp(), set()
    empty_scans, deadline = 0, time.monotonic() + deadline_s
    while empty_scans < 3 and time.monotonic() < deadline:
        pids = with_marker(marker)
        empty_scans = 0 if pids else empty_scans + 1
        for pid in pids:
            try:
                group = os.getpgid(pid)
                if group > 1 and group != own:
                    os.killpg(group, signal.SIGKILL)
                    groups.add(group)
                else:
                    os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return len(groups)


def hop(ready: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    born = time.monotonic()
    hops = 0
    while time.monotonic() - born < LIFETIME_S:
        if os.fork():
            os._exit(0)  # the parent leaves at once; the child carries on under a new pid
        hops += 1
        if hops == 200:
            open(ready, "w").close()
        time.sleep(0.005)  # still far faster than a scan of /proc; a real forker would not wait, but this
        # keeps a 2-core test machine usable (each generation is a zombie until init reaps it)


if __name__ == "__main__":
    hop(sys.argv[2])
