"""A plain loop (no torch): STEPS steps of SLEEP seconds, a checkpoint every EVERY steps, stop.flag honoured.

Writes step records with total_steps (so trainq can forecast its end) and a checkpoint record per
checkpoint; on stop.flag it checkpoints and exits 0; it resumes from $TRAINQ_RESUME_FROM.
usage: slow_steps.py STEPS SLEEP EVERY
"""

import json
import os
import sys
import time

steps, sleep_s, every = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
job_dir = os.environ["TRAINQ_JOB_DIR"]
stop_flag = os.environ["TRAINQ_STOP_FLAG"]
metrics = open(os.environ["TRAINQ_METRICS"], "a", buffering=1)
step = 0
resume = os.environ.get("TRAINQ_RESUME_FROM")
if resume:
    step = json.load(open(os.path.join(resume, "state.json")))["step"]
    print(f"resumed from {resume} at step {step}", flush=True)


def save(step):
    final = os.path.join(job_dir, "checkpoints", f"step-{step}")
    os.makedirs(final + ".tmp", exist_ok=True)
    with open(os.path.join(final + ".tmp", "state.json"), "w") as f:
        json.dump({"step": step}, f)
    os.replace(final + ".tmp", final)
    metrics.write(json.dumps({"type": "checkpoint", "step": step, "path": final, "time": time.time()}) + "\n")


while step < steps:
    time.sleep(sleep_s)
    step += 1
    metrics.write(
        json.dumps({"type": "step", "step": step, "total_steps": steps, "loss": 1.0 / step, "time": time.time()}) + "\n"
    )
    if step % every == 0:
        save(step)
    if os.path.exists(stop_flag):
        save(step)
        print(f"stop.flag seen: checkpoint at step {step}, exiting", flush=True)
        sys.exit(0)
print("all steps done", flush=True)
