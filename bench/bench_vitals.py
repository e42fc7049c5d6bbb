"""What the vital signs cost per optimizer step (issue 30's goal: under 1 % of a step on the tiny model).

``python bench/bench_vitals.py [--steps 200] [--method lora|full]`` builds the tiny model (trainq.trainer.tiny),
runs real optimizer steps (forward, backward, clip, AdamW) and, separately, the vitals' own work per step
(the update ratio's snapshot and norms, the clip flag, the schedule check), and prints both medians and
their ratio, with the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--method", choices=("lora", "full"), default="lora")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, get_scheduler

    from trainq.trainer.tiny import build
    from trainq.trainer.vitals import ReferenceSchedule, UpdateRatio

    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "model")
    if args.method == "lora":
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules="all-linear"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4)
    sched = get_scheduler("cosine", optimizer=opt, num_warmup_steps=10, num_training_steps=args.steps)
    ratio = UpdateRatio(params)
    reference = ReferenceSchedule("cosine", 10, args.steps)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    step_s, vitals_s = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        t1 = time.perf_counter()
        expected = reference.expected(2e-4, step)  # the schedule check
        _ = abs(opt.param_groups[0]["lr"] - (expected or 0.0))
        ratio.snapshot()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        _ = ratio.ratio(), norm > 1.0
        t4 = time.perf_counter()
        sched.step()
        opt.zero_grad()
        t5 = time.perf_counter()
        vitals_s.append((t2 - t1) + (t4 - t3))
        step_s.append((t5 - t0) - vitals_s[-1])
    warm = args.steps // 10
    step_med, vit_med = statistics.median(step_s[warm:]), statistics.median(vitals_s[warm:])
    print(
        f"load average {os.getloadavg()[0]:.2f}; tiny model, {args.method}, {sum(p.numel() for p in params):,} trained "
        f"values, batch {args.batch} x {args.seq}, {args.steps} steps, 1 thread"
    )
    print(
        f"optimizer step (median): {step_med * 1000:.2f} ms; vitals per step (median): {vit_med * 1000:.3f} ms "
        f"= {100 * vit_med / step_med:.2f} % of a step (goal < 1 %)"
    )
    return 0 if vit_med / step_med < 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
