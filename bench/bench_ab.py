"""Two checkouts of trainq side by side, interleaved: serial throughput and CPU per job by process, and drop→start.

On this VM a single benchmark run moves by 10–40 % with the machine (the peers of ``bench_queue.py`` move with it),
so a change is judged by pairs: the other checkout, then this one, again and again, each pair a minute apart or
less. Each round runs N × ``true`` one at a time (max_concurrent 1) through a real watcher, the method of
``bench_queue.py``'s throughput row, D single drops timed to the job's start (its latency row) and I more after 1 s of
quiet each (its idle row); with the serial run, the spawner helper's wake-ups and every trainq process's preemptions
a job (context switches, voluntary and involuntary, from /proc). The other
checkout is imported through PYTHONPATH (a folder holding ``trainq/`` linked to its watcher, trainer and schemas,
made here from ``--base``), so the watcher, its spawner and its supervisors all run that code.

    .venv/bin/python bench/bench_ab.py --base ../trainq-base [--rounds 5] [--jobs 300] [--drops 100] [--idle-drops 0]
                                       [--tmp /dev/shm]

``--base`` is a checkout (git worktree add ../trainq-base <commit>). Use tmpfs (the default) for comparisons: on
an ext4 without a journal, creates after many deletions slow down for minutes, whichever code runs
(docs/benchmarks.md, round four's fourth pass).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: bench/ importable

from bench._common import PY, REPO, Queue, job_yaml, median, percentile, running_watcher, tree_cpu_split, wait_until
from trainq.watcher.supervisor.pool import POOLED_MAX_ATTEMPTS

#: the per-round numbers printed and summarised
FIELDS = (
    "jobs_s",
    "watcher_ms",
    "spawner_ms",
    "supervisors_ms",
    "cpu_ms",
    "helper_woken",
    "preempted",
    "latency_ms",
    "latency_p95_ms",
    "idle_latency_ms",
)


def _serial(base: Path, jobs: int) -> dict:
    """N × ``true`` one at a time: jobs per second and CPU ms per job of the watcher, spawner and supervisors."""
    q = Queue.create(base, {"max_concurrent": 1})
    names = [f"t-{i:05d}.yaml" for i in range(jobs)]
    for name in names:
        q.stage(name, job_yaml(["true"]))
    with running_watcher(q.root) as watcher:
        wait_until(lambda: len(psutil.Process(watcher.pid).children(recursive=True)) >= 2, 30, what="a warm pool")
        time.sleep(0.3)
        before, switches, start = _cpu(watcher.pid), _switches(watcher.pid), time.monotonic()
        for name in names:
            q.drop_staged(name)
        wait_until(lambda: q.count("done") + q.count("failed") >= jobs, 600, interval_s=0.02, what=f"{jobs} jobs")
        elapsed, after = time.monotonic() - start, _cpu(watcher.pid)
        switches = [(b - a) / jobs for a, b in zip(switches, _switches(watcher.pid), strict=True)]
    if q.count("failed"):
        raise RuntimeError(f"{q.count('failed')} trivial jobs failed; see {q.root}/failed")
    per_job = [(b - a) / jobs * 1000 for a, b in zip(before, after, strict=True)]
    return {
        "jobs_s": jobs / elapsed,
        "watcher_ms": per_job[0],
        "spawner_ms": per_job[1],
        "supervisors_ms": per_job[2],
        "cpu_ms": sum(per_job),
        "helper_woken": switches[0],
        "preempted": switches[1],
    }


def _cpu(pid: int) -> list[float]:
    """User + system seconds of the watcher (depth 0), its spawner (1) and the pooled supervisors (2 and below)."""
    split = tree_cpu_split(pid)
    return [split["depth 0"], split["depth 1"], split["depth 2"]]


def _switches(pid: int) -> list[int]:
    """Context switches in the watcher's tree: the spawner helper's voluntary ones (each a wake-up from its wait), and
    the involuntary ones of every process (each a preemption: on 2 vCPUs, another process wanted the CPU)."""
    woken = preempted = 0
    watcher = psutil.Process(pid)
    for proc in [watcher, *watcher.children(recursive=True)]:
        try:
            counts, parent = proc.num_ctx_switches(), proc.ppid()
        except psutil.Error:
            continue
        woken += counts.voluntary if parent == pid else 0
        preempted += counts.involuntary
    return [woken, preempted]


def _latency(base: Path, drops: int) -> dict:
    """Median and p95 of drop → job started, one drop at a time (bench_queue's latency row, without the floor)."""
    from bench.bench_queue import _trainq_latencies

    work = base / "latency"
    work.mkdir()
    ours = _trainq_latencies(work, drops, None)
    return {"latency_ms": median(ours) * 1000, "latency_p95_ms": percentile(ours, 95) * 1000}


def _idle_latency(base: Path, drops: int) -> dict:
    """Median of drop → job started with 1 s of quiet before each drop (bench_queue's idle row, without the floor)."""
    from bench.bench_queue import IDLE_GAP_S, _trainq_latencies

    work = base / "idle-latency"
    work.mkdir()
    ours = _trainq_latencies(work, drops, None, gap_s=IDLE_GAP_S)
    return {"idle_latency_ms": median(ours) * 1000}


def _one_round(args: argparse.Namespace) -> dict:
    """One side's round, in this process (run under the side's PYTHONPATH by ``main``)."""
    with tempfile.TemporaryDirectory(prefix="trainq-ab-", dir=args.tmp) as tmp:
        serial = Path(tmp) / "serial"
        serial.mkdir()
        found = _serial(serial, args.jobs)
        if args.drops:
            found.update(_latency(Path(tmp), args.drops))
        if args.idle_drops:
            found.update(_idle_latency(Path(tmp), args.idle_drops))
    import trainq.watcher

    found["code"] = os.path.realpath(trainq.watcher.__path__[0])  # which checkout's watcher ran
    return found


def _link_folder(checkout: Path) -> Path:
    """A folder holding ``trainq/`` whose packages are ``checkout``'s (what its editable install maps)."""
    folder = Path(tempfile.mkdtemp(prefix="trainq-ab-path-"))
    (folder / "trainq").mkdir()
    for name in ("watcher", "trainer", "schemas"):
        (folder / "trainq" / name).symlink_to(checkout.resolve() / name)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="the other checkout (compared against this one)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=300, help="trivial jobs per serial run")
    parser.add_argument("--drops", type=int, default=100, help="single drops timed per round (0: none)")
    parser.add_argument("--idle-drops", type=int, default=0, help="single drops after 1 s of quiet each (0: none)")
    parser.add_argument("--tmp", default="/dev/shm", help="where the queues go (default tmpfs)")
    parser.add_argument("--one-round", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_round:
        print(json.dumps(_one_round(args)))
        return 0
    if args.base is None:
        parser.error("--base CHECKOUT is required")
    if args.jobs >= POOLED_MAX_ATTEMPTS:
        # a pooled supervisor leaves after that many attempts, and its CPU leaves the live tree with it: what its
        # reaper (the spawner) is charged includes the jobs it ran, so the supervisors' share cannot be told apart
        # (2,000 jobs read 0.45 ms a job without it, 1.1 ms with it, where 300 jobs read 0.9)
        parser.error(
            f"--jobs must stay under {POOLED_MAX_ATTEMPTS}: a pooled supervisor leaves after that many attempts, "
            "and its CPU can then no longer be told apart from its jobs'"
        )
    sides = {"base": str(_link_folder(args.base)), "this": str(REPO)}
    results: dict[str, list[dict]] = {name: [] for name in sides}
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}; `bench/bench_ab.py`")
    for round_no in range(args.rounds):
        # each side goes first in every other round: the VM's speed drifts within a round, and the side that always
        # ran first took the drift one way (paired differences lean with it)
        order = list(sides.items()) if round_no % 2 == 0 else list(sides.items())[::-1]
        for name, path in order:
            env = dict(os.environ, PYTHONPATH=path)
            command = [PY, __file__, "--one-round", "--jobs", str(args.jobs), "--drops", str(args.drops)]
            command += ["--idle-drops", str(args.idle_drops)]
            done = subprocess.run([*command, "--tmp", args.tmp], env=env, capture_output=True, text=True, check=True)
            found = json.loads(done.stdout.strip().splitlines()[-1])
            results[name].append(found)
            numbers = " ".join(f"{k}={found[k]:.2f}" for k in FIELDS if k in found)
            print(f"{name} ({found['code']}): {numbers}", flush=True)
    print(f"\nload {os.getloadavg()[0]:.2f} at the end; medians of {args.rounds} rounds:\n")
    print("| | " + " | ".join(FIELDS) + " |")
    print("|---" * (len(FIELDS) + 1) + "|")
    for name, rounds in results.items():
        cells = [f"{statistics.median(r[k] for r in rounds):.2f}" if k in rounds[0] else "—" for k in FIELDS]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| this − base, paired | " + " | ".join(_paired(results["base"], results["this"], k) for k in FIELDS) + " |")
    return 0


def _paired(base: list[dict], this: list[dict], key: str) -> str:
    """The median of each round's difference (this − base), and in how many rounds this side was lower: the two
    sides of one round ran a minute apart at most, so the pairs drift less with the VM than the two medians."""
    if key not in base[0]:
        return "—"
    differences = [t[key] - b[key] for b, t in zip(base, this, strict=True)]
    lower = sum(d < 0 for d in differences)
    return f"{statistics.median(differences):+.2f} ({lower}/{len(differences)} lower)"


if __name__ == "__main__":
    sys.exit(main())
