"""A plain PyTorch loop that trainq can stop, resume and follow, with no trainq import.

Job file: command: [python, plain_loop.py, --steps, 1000]  and  resume_args: []  (it reads
$TRAINQ_RESUME_FROM itself). Checkpoints are written as step-N.tmp then renamed to step-N, so a
kill mid-save never leaves a half checkpoint under a name trainq would pick.
"""

import argparse
import json
import os
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--save-every", type=int, default=100)
args = p.parse_args()
job_dir = os.environ.get("TRAINQ_JOB_DIR", ".")
stop_flag = os.environ.get("TRAINQ_STOP_FLAG", "")
metrics = open(os.environ.get("TRAINQ_METRICS", os.devnull), "a", buffering=1)

torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
if os.environ.get("TRAINQ_RESUME_FROM"):  # set only when this attempt resumes
    state = torch.load(os.path.join(os.environ["TRAINQ_RESUME_FROM"], "state.pt"))
    model.load_state_dict(state["model"]), opt.load_state_dict(state["opt"])
    step = state["step"]
    torch.set_rng_state(state["rng"])


def save(step):
    final = os.path.join(job_dir, "checkpoints", f"step-{step}")
    os.makedirs(final + ".tmp", exist_ok=True)
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "rng": torch.get_rng_state()},
        os.path.join(final + ".tmp", "state.pt"),
    )
    os.replace(final + ".tmp", final)  # complete, or not there at all
    metrics.write(json.dumps({"type": "checkpoint", "step": step, "path": final, "time": time.time()}) + "\n")


while step < args.steps:
    x = torch.randn(32, 16)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(), loss.backward(), opt.step()
    step += 1
    metrics.write(
        json.dumps({"type": "step", "step": step, "total_steps": args.steps, "loss": loss.item(), "time": time.time()})
        + "\n"
    )
    if step % args.save_every == 0:
        save(step)
    if stop_flag and os.path.exists(stop_flag):  # trainq stop: save, exit 0 (recorded cancelled)
        save(step)
        raise SystemExit(0)
print(f"done at step {step}, loss {loss.item():.4f}")
