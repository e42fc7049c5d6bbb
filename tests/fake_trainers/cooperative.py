"""Polls $TRAINQ_STOP_FLAG (every argv[1] seconds, default 0.02); when it appears, writes a checkpoint, exits 0."""

import os
import sys
import time

flag = os.environ["TRAINQ_STOP_FLAG"]
interval_s = float(sys.argv[1]) if len(sys.argv) > 1 else 0.02
print("ready", flush=True)
while not os.path.exists(flag):
    time.sleep(interval_s)
ckpt = os.path.join(os.environ["TRAINQ_JOB_DIR"], "checkpoints", "step-1")
os.makedirs(ckpt, exist_ok=True)
with open(os.path.join(ckpt, "state.txt"), "w") as f:
    f.write("step 1\n")
print("stop flag seen; checkpoint written", flush=True)
