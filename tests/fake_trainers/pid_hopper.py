"""A "pid hopper": forks its next generation and exits, over and over, so no pid of it stays put.

It ignores SIGTERM (only SIGKILL ends it) and touches READY_FILE after a few hundred hops. MARKER
only makes its command line easy to find. Usage: pid_hopper.py MARKER READY_FILE
"""
import os
import signal
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
marker, ready = sys.argv[1], sys.argv[2]
hops = 0
while True:
    if os.fork():
        os._exit(0)  # the parent leaves at once; the child carries on under a new pid
    hops += 1
    if hops == 200:
        open(ready, "w").close()
    time.sleep(0.001)  # a real forker would not wait; this keeps a 2-core test machine usable
