"""DDP scaling on a GPU machine: the same LoRA job on 1, 2, 4 and 8 GPUs, tokens/s and scaling efficiency.

Each run is the real trainer (``python -m trainq.trainer``) with ``train.processes: N`` and
CUDA_VISIBLE_DEVICES=0..N-1, the per-rank batch fixed (weak scaling: the global batch grows with N), packing
off. Efficiency = tokens/s(N) / (N x tokens/s(1)); goal >= 0.9 for DDP LoRA. Counts above the GPUs present are
skipped. Without ``--model``, a ``small`` tiny model is built (too small to keep a GPU busy: give a real local
model folder, e.g. a 0.5-1B causal LM, and a JSONL file, for figures that mean something).

    .venv/bin/python bench/bench_ddp_gpu.py [--model DIR --data FILE] [--gpus 1,2,4,8] [--steps N] [--batch B]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

PY = sys.executable
#: DDP LoRA's goal: at least this share of linear scaling
EFFICIENCY_GOAL = 0.9


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run(base: Path, model: str, data: str, gpus: int, steps: int, batch: int, seq_len: int) -> dict:
    job = base / f"gpus-{gpus}"
    job.mkdir()
    train = {
        "model": model,
        "data": data,
        "method": "lora",
        "max_steps": steps,
        "batch_size": batch,
        "seq_len": seq_len,
        "packing": False,
        "eval_fraction": 0,
        "log_every": max(steps // 5, 1),
        "checkpoint": {"every_steps": steps * 10, "keep": 1},
        "processes": gpus,
    }
    (job / "job.yaml").write_text(yaml.safe_dump({"approved": True, "train": train}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINQ_", "TORCHELASTIC_"))}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    with open(job / "output.log", "wb") as log:
        code = subprocess.run(
            [PY, "-m", "trainq.trainer", str(job)], stdout=log, stderr=subprocess.STDOUT, env=env, timeout=7200
        ).returncode
    if code != 0:
        raise SystemExit(f"{gpus} GPUs: trainer exited {code}:\n{(job / 'output.log').read_text()[-3000:]}")
    return json.loads((job / "summary.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local model folder (default: build trainq.trainer.tiny small)")
    parser.add_argument("--data", default=None, help="JSONL rows (default: the tiny model's train.jsonl)")
    parser.add_argument("--gpus", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    present = gpu_count()
    if present == 0:
        print("no CUDA GPU here: run this on a GPU machine", file=sys.stderr)
        return 2
    counts = [n for n in (int(x) for x in args.gpus.split(",")) if n <= present]
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainq-bench-ddp-gpu-") as tmp:
        base = Path(tmp)
        model, data = args.model, args.data
        if model is None:
            subprocess.run(
                [PY, "-m", "trainq.trainer.tiny", str(base / "small"), "--size", "small"],
                check=True,
                capture_output=True,
            )
            model, data = str(base / "small" / "model"), str(base / "small" / "train.jsonl")
        for n in counts:
            summary = run(
                base, model, data or str(Path(model).parent / "train.jsonl"), n, args.steps, args.batch, args.seq_len
            )
            rows.append({"gpus": n, "tokens_per_s": summary["tokens_per_s"], "world_size": summary["world_size"]})
    single = rows[0]["tokens_per_s"] if rows and rows[0]["gpus"] == 1 else None
    print("| GPUs | tokens/s (world) | scaling efficiency | goal |")
    print("|---|---|---|---|")
    for row in rows:
        eff = row["tokens_per_s"] / (row["gpus"] * single) if single else None
        row["efficiency"] = eff
        met = "—" if eff is None or row["gpus"] == 1 else ("met" if eff >= EFFICIENCY_GOAL else "NOT met")
        print(
            f"| {row['gpus']} | {row['tokens_per_s']:.0f} | {'' if eff is None else f'{eff:.2f}'} | "
            f">= {EFFICIENCY_GOAL} ({met}) |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
