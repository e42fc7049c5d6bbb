"""Writes one step record to $TRAINQ_METRICS, then sleeps (a job that stalls)."""

import json
import os
import time

with open(os.environ["TRAINQ_METRICS"], "a") as f:
    f.write(json.dumps({"type": "step", "step": 1, "total_steps": 10, "loss": 2.5, "time": time.time()}) + "\n")
print("step 1: loss 2.5000", flush=True)
while True:
    time.sleep(3600)
