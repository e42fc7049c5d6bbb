"""The same LoRA run on 1 Slurm node x 2 ranks and on 2 nodes x 1 rank (gloo over the test cluster's bridge).

Both runs go through the product: a watcher with ``executor: slurm`` on the namespaced test cluster
(``TRAINQ_SLURM_NODES=3 tests/slurm/start.sh``, root), one job file each, the same model, data, steps and global
batch (world size 2, ``batch_size`` per rank), ``OMP_NUM_THREADS=1`` per rank. ``nodes: 1`` x ``processes: 2`` runs
one torchrun with 2 ranks on one node (gloo over loopback); ``nodes: 2`` x ``processes: 1`` runs one torchrun per
node under srun, the ranks talking over the bridge (10.213.0.K, veth pairs).

Figures per run, from the job's own records:

* tokens per CPU-second: summary.json's ``tokens`` over the world's CPU-seconds inside ``trainer.train()``
  (rank 0's ``durations_s.train_cpu`` x world size: the ranks do the same work);
* tokens per second (summary.json's ``tokens_per_s``, the world's) and the median step (metrics.jsonl);
* the vote's cost per step: trainq's one collective per optimizer step (``trainer/distributed.py`` StepVote, one
  all_reduce of 6 float64) timed alone ``--votes`` times on the same layout (srun on the same nodes, torchrun per
  node), over that layout's median step.

Prints a markdown table with the command, the date and the load average.

    .venv/bin/python bench/bench_nodes.py [--size tiny|small] [--steps N] [--batch B] [--votes N]
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_ddp import lora_train
from bench.bench_slurm import cancel_queue_jobs, launch_watcher

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "tests" / "slurm"
PY = sys.executable
#: the test cluster's nodes for this bench (the multi-node tests use 3 too, so no restart between them)
NODES = 3
#: the two layouts: (label, resources.nodes, train.processes)
LAYOUTS = (("1 node x 2 ranks (loopback)", 1, 2), ("2 nodes x 1 rank (bridge)", 2, 1))


def load() -> str:
    return open("/proc/loadavg").read().split()[0]


def start_cluster() -> None:
    started = subprocess.run(
        ["bash", str(SLURM_DIR / "start.sh")],
        check=True,
        capture_output=True,
        text=True,
        env=dict(os.environ, TRAINQ_SLURM_NODES=str(NODES), TRAINQ_SLURM_ACCOUNTING="0"),
        timeout=600,
    )
    os.environ["SLURM_CONF"] = started.stdout.strip().splitlines()[-1].partition("=")[2]


def train_job(model_dir: Path, nodes: int, processes: int, steps: int, batch: int) -> str:
    """bench_ddp.py's run, on ``nodes`` Slurm nodes."""
    train = lora_train(model_dir, processes, batch, steps)
    return yaml.safe_dump(
        {"approved": True, "train": train, "resources": {"nodes": nodes}, "env": {"OMP_NUM_THREADS": "1"}}
    )


def run_layout(root: Path, name: str, text: str) -> dict:
    """Drop one job into ``root``'s inbox and wait for it in done/; its figures."""
    staging = root / f".{name}.tmp"
    staging.write_text(text)
    os.rename(staging, root / "inbox" / f"{name}.yaml")
    done, failed = root / "done" / name, root / "failed" / name
    deadline = time.monotonic() + 3600
    while not (done / "run.json").exists():
        if (failed / "run.json").exists() or time.monotonic() > deadline:
            log = (failed / "output.log").read_text(errors="replace")[-3000:] if failed.exists() else ""
            raise SystemExit(f"{name} did not finish: {log}")
        time.sleep(0.5)
    summary = json.loads((done / "summary.json").read_text())
    times = [
        json.loads(line)["time"]
        for line in (done / "metrics.jsonl").read_text().splitlines()
        if '"type": "step"' in line
    ]
    world = summary["world_size"]
    cpu_s = summary["durations_s"]["train_cpu"] * world
    return {
        "hosts": summary["hosts"],
        "world_size": world,
        "tokens": summary["tokens"],
        "tokens_per_s": summary["tokens_per_s"],
        "tokens_per_cpu_s": summary["tokens"] / cpu_s if cpu_s else float("nan"),
        "step_s": statistics.median(b - a for a, b in itertools.pairwise(times)),  # the first holds the warm-up
    }


def time_votes(base: Path, nodes: list[str], ranks_per_node: int, votes: int) -> float:
    """Seconds per StepVote on ``nodes`` with ``ranks_per_node`` each: srun starts one torchrun per node, which runs
    bench_ddp.py's vote worker."""
    out = base / f"votes-{len(nodes)}x{ranks_per_node}.json"
    worker = shlex.join([str(REPO / "bench" / "bench_ddp.py"), "--vote-worker", str(votes), "--json", str(out)])
    agent = (
        f"exec {shlex.quote(PY)} -m torch.distributed.run --nnodes {len(nodes)} --nproc-per-node {ranks_per_node} "
        f"--node-rank $SLURM_NODEID --master-addr {nodes[0]} --master-port {29500 + len(nodes)} "
        f"--max-restarts 0 {worker}"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINQ_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = "1"
    subprocess.run(
        ["srun", f"--nodes={len(nodes)}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}", "sh", "-c", agent],
        check=True,
        env=env,
        timeout=900,
        capture_output=True,
        cwd=base,
    )
    return json.loads(out.read_text())["per_vote_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=("tiny", "small"), help="trainq.trainer.tiny's model size")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4, help="per rank (the world's batch is twice it)")
    parser.add_argument("--votes", type=int, default=1000)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the namespaced test cluster (tests/slurm/start.sh) needs root")
    start_cluster()
    users = open(Path(os.environ["SLURM_CONF"]).parent / "users.lock", "a")
    fcntl.flock(users, fcntl.LOCK_SH)  # like the tests: no other run stops the cluster under us
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    loads = [load()]
    figures: dict = {"command": shlex.join([".venv/bin/python", "bench/bench_nodes.py", *sys.argv[1:]]), "at": when}
    with tempfile.TemporaryDirectory(prefix="trainq-bench-nodes-", dir="/tmp") as tmp:
        base = Path(tmp)
        subprocess.run(
            [PY, "-m", "trainq.trainer.tiny", str(base / "model"), "--size", args.size],
            check=True,
            capture_output=True,
            timeout=600,
            env=dict(os.environ, OMP_NUM_THREADS="2"),
        )
        root = base / "q"
        watcher = launch_watcher(root, "executor: slurm\nmax_concurrent: 1\n")
        try:
            for i, (label, nodes, processes) in enumerate(LAYOUTS):
                text = train_job(base / "model", nodes, processes, args.steps, args.batch)
                figures[label] = run_layout(root, f"layout{i}", text)
                loads.append(load())
        finally:
            watcher.terminate()
            watcher.wait(timeout=60)
            cancel_queue_jobs(root)
        for label, nodes, processes in LAYOUTS:
            per_vote = time_votes(base, [f"node{k + 1}" for k in range(nodes)], processes, args.votes)
            figures[label]["per_vote_s"] = per_vote
            figures[label]["vote_share"] = per_vote / figures[label]["step_s"]
            loads.append(load())
    figures["load"] = loads
    print(f"`{figures['command']}`, {when}, load average {' → '.join(loads)} ({os.cpu_count()} CPUs)\n")
    print(
        f"| {args.size} model, LoRA, {args.steps} steps, world 2 x batch {args.batch} | tokens per CPU-second "
        "| tokens/s (world) | median step | vote per step | vote / step |"
    )
    print("|---|---|---|---|---|---|")
    for label, _, _ in LAYOUTS:
        f = figures[label]
        print(
            f"| {label}, on {', '.join(f['hosts'])} | {f['tokens_per_cpu_s']:.0f} | {f['tokens_per_s']:.0f} "
            f"| {f['step_s'] * 1000:.1f} ms | {f['per_vote_s'] * 1e6:.0f} µs | {f['vote_share']:.2%} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
