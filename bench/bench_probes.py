"""What resource probing costs the watcher: CPU share at one sample a second, and µs per sample.

Each tick does what the daemon does every second with one running job: ``ResourceProbe.sample``
(queue root and a job cwd), ``tree_usage`` of the job's tree, ``plan`` for a few pending jobs and
``resources_dict``. The share is process CPU time over wall time for ``--seconds`` of ticks, next
to a loop that only sleeps. Run: ``.venv/bin/python bench/bench_probes.py [--seconds 30]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainq.watcher.daemon.admission import Holding, Limits, Request, plan, resources_dict
from trainq.watcher.daemon.resources import ResourceProbe


def tick(probe: ResourceProbe, root: Path, job_pid: int) -> None:
    """One second's worth of admission work for one running job and three pending ones."""
    machine = probe.sample([root, root / "job"])
    usage = probe.tree_usage([job_pid])
    running = [Holding("run-1", gpus=(0,), ram_gb=2, rss_gb=usage["rss_mb"] / 1024, pids=(job_pid,), disk_path=root)]
    pending = [Request(f"p{n}", order=n, gpus=1, ram_gb=1, disk_gb=1, disk_path=root) for n in range(3)]
    plan(pending, running, machine, Limits(max_concurrent=2))
    resources_dict(machine, running)


def cpu_share(seconds: float, work) -> float:
    """Process CPU time / wall time of a loop that calls ``work`` once a second (None: only sleeps)."""
    wall0, cpu0 = time.monotonic(), time.process_time()
    next_tick = wall0
    while next_tick < wall0 + seconds:
        if work is not None:
            work()
        next_tick += 1.0
        time.sleep(max(0.0, next_tick - time.monotonic()))
    return (time.process_time() - cpu0) / (time.monotonic() - wall0)


def per_call_us(work, n: int) -> float:
    """Mean wall µs of ``work`` over ``n`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(n):
        work()
    return (time.perf_counter() - start) / n * 1e6


def run(seconds: float, n: int) -> dict:
    job = subprocess.Popen(["sleep", "3600"])
    foreign = subprocess.Popen(["sleep", "3600"])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            sim = root / "gpus.json"
            sim.write_text(
                json.dumps(
                    [
                        {
                            "index": 0,
                            "name": "Sim 6GB",
                            "memory_total_mb": 6144,
                            "memory_used_mb": 1000,
                            "processes": [{"pid": job.pid, "used_mb": 1000}],
                        },
                        {
                            "index": 1,
                            "name": "Sim 6GB",
                            "memory_total_mb": 6144,
                            "memory_used_mb": 900,
                            "processes": [{"pid": foreign.pid, "used_mb": 900}],
                        },
                    ]
                )
            )
            probes = {
                "real (no NVML here)": ResourceProbe(env={}),
                "simulated 2 GPUs": ResourceProbe(sim, env={}),
                "real, no cache": ResourceProbe(env={}, cache_s=0.0),
            }
            out: dict = {"seconds": seconds, "baseline_cpu_pct": round(cpu_share(seconds, None) * 100, 3)}
            for name, probe in probes.items():
                out[name] = {
                    "sample_us": round(per_call_us(lambda: probe.sample([root, root / "job"]), n), 1),
                    "tree_usage_us": round(per_call_us(lambda: probe.tree_usage([job.pid]), n), 1),
                    "tick_us": round(per_call_us(lambda: tick(probe, root, job.pid), n), 1),
                }
            for name in ("real (no NVML here)", "simulated 2 GPUs"):
                share = cpu_share(seconds, lambda: tick(probes[name], root, job.pid))
                out[name]["cpu_pct_at_1hz"] = round(share * 100, 3)
            for probe in probes.values():
                probe.close()
            return out
    finally:
        for proc in (job, foreign):
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each 1 Hz loop (default 30)")
    parser.add_argument("--calls", type=int, default=2000, help="back-to-back calls per µs figure (default 2000)")
    args = parser.parse_args()
    print(json.dumps(run(args.seconds, args.calls), indent=1))


if __name__ == "__main__":
    main()
