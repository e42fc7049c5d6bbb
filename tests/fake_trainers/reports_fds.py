"""Prints the fds it holds (a job must inherit only stdin, stdout and stderr); --sleep waits 0.3 s first."""

import os
import sys
import time

if "--sleep" in sys.argv:
    time.sleep(0.3)  # keeps its supervisor alive long enough for the test to list the supervisor's fds
print("fds:", " ".join(sorted(os.listdir("/proc/self/fd"), key=int)), flush=True)
