"""Prints a line naming its job and attempt (and $GREETING when set), then exits 0."""

import os

print(f"hello from {os.environ['TRAINQ_JOB_ID']} attempt {os.environ['TRAINQ_ATTEMPT']}", flush=True)
if "GREETING" in os.environ:
    print(os.environ["GREETING"], flush=True)
