"""Polls $TRAINQ_STOP_FLAG; when it appears, writes a checkpoint file and exits 0."""
import os
import time

flag = os.environ["TRAINQ_STOP_FLAG"]
print("ready", flush=True)
while not os.path.exists(flag):
    time.sleep(0.02)
ckpt = os.path.join(os.environ["TRAINQ_JOB_DIR"], "checkpoints", "step-1")
os.makedirs(ckpt, exist_ok=True)
with open(os.path.join(ckpt, "state.txt"), "w") as f:
    f.write("step 1\n")
print("stop flag seen; checkpoint written", flush=True)
