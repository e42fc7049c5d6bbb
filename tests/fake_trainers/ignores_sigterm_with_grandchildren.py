"""Ignores SIGTERM, starts a child and a double-forked grandchild that ignore it too, writes their pids, sleeps."""

import os
import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
pids_file = os.path.join(os.environ["TRAINQ_JOB_DIR"], "pids.txt")


def sleep_forever() -> None:
    while True:
        time.sleep(3600)


child = os.fork()
if child == 0:
    sleep_forever()
middle = os.fork()
if middle == 0:
    os.setsid()  # a daemon's usual escape: new session, then orphan itself
    grandchild = os.fork()
    if grandchild == 0:
        sleep_forever()
    with open(pids_file + ".tmp", "w") as f:
        f.write(f"{os.getppid()} {child} {grandchild}\n")
    os.rename(pids_file + ".tmp", pids_file)
    os._exit(0)
os.waitpid(middle, 0)
print("ready", flush=True)
sleep_forever()
