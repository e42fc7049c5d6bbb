"""Treats SIGTERM as preemption like the trainer: says so and exits 143 (EXIT_PREEMPTED)."""

import signal
import sys
import time


def on_term(_signum, _frame):
    print("SIGTERM: checkpoint saved, exiting for preemption", flush=True)
    sys.exit(143)


signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(3600)
