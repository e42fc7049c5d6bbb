"""Dies of SIGKILL (as if killed from outside without an OOM trace)."""

import os
import signal

print("about to be killed", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
