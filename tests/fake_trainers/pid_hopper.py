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


def stamp_out(marker: str, deadline_s: float = 30.0) -> None:
    """End every generation: SIGSTOP each one seen until a scan finds none running (a stopped process
    cannot fork), then SIGKILL them all. A pid-by-pid SIGKILL loop lets one escape now and then."""
    stopped: set[int] = set()
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        running = [pid for pid in with_marker(marker) if pid not in stopped or _running(pid)]
        if not running:
            break
        for pid in running:
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.add(pid)
            except ProcessLookupError:
                pass
    for pid in stopped | set(with_marker(marker)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_STOPPED
    except psutil.Error:
        return False


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
