"""Several ranks on this machine's CPU: 2 ranks x 1 thread vs 1 rank x 2 threads, and the cost of the per-step vote.

Throughput: the same job (``python -m trainq.trainer.tiny --size small``, LoRA, the same global batch: 2 ranks x
batch B against 1 rank x batch 2B, packing off so both compute the same padded rows) run by the real trainer,
``processes: 2`` with OMP_NUM_THREADS=1 per rank, against ``processes: 1`` with OMP_NUM_THREADS=2. The figure is
summary.json's ``tokens_per_s``: real (non-pad) tokens of the whole world over the ``trainer.train()`` window.

Vote: trainq's one collective per optimizer step (``trainer/distributed.py`` StepVote: one all_reduce of 5 float64
values over gloo) timed alone on 2 ranks started by torchrun, then divided by the median step time of the 2-rank
run above. Goal: under 1 % of a step.

    .venv/bin/python bench/bench_ddp.py [--steps N] [--batch B] [--votes N] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
#: the vote's goal, as a share of one optimizer step
VOTE_GOAL = 0.01


def _env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINQ_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def lora_train(model_dir: Path, processes: int, batch: int, steps: int) -> dict:
    """The ``train:`` block every rank-layout bench runs (this one, bench_nodes.py): LoRA, no packing, no eval,
    one log line and no checkpoint inside the run."""
    return {
        "model": str(model_dir / "model"),
        "data": str(model_dir / "train.jsonl"),
        "method": "lora",
        "max_steps": steps,
        "batch_size": batch,
        "seq_len": 128,
        "lr": 1e-3,
        "packing": False,
        "log_every": steps,
        "eval_fraction": 0,
        "checkpoint": {"every_steps": steps * 10, "keep": 1},
        "processes": processes,
    }


def run_job(base: Path, name: str, model_dir: Path, processes: int, batch: int, steps: int, threads: int) -> dict:
    """One trainer run; its summary.json plus the wall time and the median step interval (s)."""
    job = base / name
    job.mkdir()
    train = lora_train(model_dir, processes, batch, steps)
    (job / "job.yaml").write_text(yaml.safe_dump({"approved": True, "train": train}))
    started = time.perf_counter()
    with open(job / "output.log", "wb") as log:
        code = subprocess.run(
            [PY, "-m", "trainq.trainer", str(job)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(threads),
            timeout=3600,
        ).returncode
    wall = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"{name}: trainer exited {code}:\n{(job / 'output.log').read_text()[-2000:]}")
    summary = json.loads((job / "summary.json").read_text())
    times = [
        json.loads(line)["time"]
        for line in (job / "metrics.jsonl").read_text().splitlines()
        if '"type": "step"' in line
    ]
    intervals = [b - a for a, b in itertools.pairwise(times)]  # the first step holds the warm-up
    return {"summary": summary, "wall_s": wall, "step_s": statistics.median(intervals)}


def vote_worker(votes: int, out: str) -> None:
    """Under torchrun: time ``votes`` StepVotes after a warm-up; rank 0 writes the per-vote seconds to ``out``."""
    import torch.distributed as dist

    from trainq.trainer.distributed import StepVote, World, init

    world = World.from_env()
    init(world, cpu=True)
    vote = StepVote(world)
    for _ in range(50):
        vote(1.0, 10, False, False, False)
    dist.barrier()
    started = time.perf_counter()
    for i in range(votes):
        vote(float(i), 10, False, False, False)
    elapsed = time.perf_counter() - started
    if world.is_main:
        Path(out).write_text(json.dumps({"votes": votes, "per_vote_s": elapsed / votes}))
    dist.destroy_process_group()


def time_votes(base: Path, votes: int) -> float:
    """Seconds per vote on 2 gloo ranks (1 thread each)."""
    out = base / "votes.json"
    argv = [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        str(Path(__file__).resolve()),
        "--vote-worker",
        str(votes),
        "--json",
        str(out),
    ]
    subprocess.run(argv, check=True, env=_env(1), timeout=600, capture_output=True)
    return json.loads(out.read_text())["per_vote_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch of the 2-rank run (1 rank: twice it)")
    parser.add_argument("--votes", type=int, default=2000)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--vote-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vote_worker is not None:
        vote_worker(args.vote_worker, args.json)
        return 0
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="trainq-bench-ddp-") as tmp:
        base = Path(tmp)
        subprocess.run(
            [PY, "-m", "trainq.trainer.tiny", str(base / "small"), "--size", "small"],
            check=True,
            env=_env(2),
            capture_output=True,
            timeout=600,
        )
        two = run_job(base, "two-ranks", base / "small", 2, args.batch, args.steps, threads=1)
        one = run_job(base, "one-rank", base / "small", 1, args.batch * 2, args.steps, threads=2)
        per_vote = time_votes(base, args.votes)
    share = per_vote / two["step_s"]
    figures = {
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "two_ranks_x_1_thread": {
            "tokens_per_s": two["summary"]["tokens_per_s"],
            "wall_s": round(two["wall_s"], 2),
            "step_s": two["step_s"],
        },
        "one_rank_x_2_threads": {
            "tokens_per_s": one["summary"]["tokens_per_s"],
            "wall_s": round(one["wall_s"], 2),
            "step_s": one["step_s"],
        },
        "vote": {"per_vote_us": per_vote * 1e6, "share_of_step": share, "goal": VOTE_GOAL},
    }
    print("| run | tokens/s (world) | median step | whole process |")
    print("|---|---|---|---|")
    for name, label in (
        ("two_ranks_x_1_thread", "2 ranks x 1 thread (gloo)"),
        ("one_rank_x_2_threads", "1 rank x 2 threads"),
    ):
        f = figures[name]
        print(f"| {label} | {f['tokens_per_s']:.0f} | {f['step_s'] * 1000:.1f} ms | {f['wall_s']:.1f} s |")
    print(
        f"\nper-step vote (all_reduce of 5 float64, 2 gloo ranks): {per_vote * 1e6:.0f} us = {share:.2%} of a "
        f"2-rank step (goal < {VOTE_GOAL:.0%}: {'met' if share < VOTE_GOAL else 'NOT met'})"
    )
    print(
        f"load average before {load_before[0]:.2f}, after {figures['load_average_after'][0]:.2f} "
        f"({os.cpu_count()} CPUs)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
