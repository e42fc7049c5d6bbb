"""How fast one supervised attempt starts: the figure test_supervisor.py used to assert (moved here, so the suite
holds no timing and passes on a loaded machine).

``python bench/bench_launch.py [-n 30]`` forks a supervisor for ``true`` N times in a scratch folder and prints the
median time until ``launch()`` returns, until the start record exists, and until the exit record exists. Goals
(a quiet 2-core VM): launch < 50 ms, start record < 100 ms, exit record < 500 ms; the product's drop-to-start goal
is <= 15 ms (bench_queue.py's latency section measures the whole path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.supervisor import LaunchSpec, Supervisor

#: goals per figure, seconds (medians)
GOALS_S = {"launch returns": 0.05, "start record": 0.1, "exit record": 0.5}


def _wait(pred, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for a record")
        time.sleep(0.0005)


def measure(n: int, root: Path) -> dict[str, list[float]]:
    """Launch ``true`` n times; the seconds from launch to each milestone."""
    sup = Supervisor()
    out: dict[str, list[float]] = {k: [] for k in GOALS_S}
    try:
        for i in range(n):
            paths = JobPaths(root / "running" / f"fast{i}")
            paths.dir.mkdir(parents=True)
            spec = LaunchSpec(
                job_dir=str(paths.dir),
                argv=("true",),
                env={},
                cwd=str(paths.dir),
                attempt=1,
                stop_grace_s=0.5,
                kill_after_s=1.0,
            )
            t0 = time.perf_counter()
            sup.launch(spec)
            out["launch returns"].append(time.perf_counter() - t0)
            _wait(lambda: paths.started.exists() or paths.exit_record.exists())
            out["start record"].append(time.perf_counter() - t0)
            _wait(lambda: sup.read_exit(paths))
            out["exit record"].append(time.perf_counter() - t0)
            sup.reap()
    finally:
        _wait(lambda: (sup.reap(), not sup.forked_pids)[1])  # every supervisor reaped
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=30, help="attempts to launch (default 30)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trainq-bench-launch-") as tmp:
        figures = measure(args.n, Path(tmp))
    print(f"load average {os.getloadavg()[0]:.2f}; {args.n} launches of `true`")
    met = True
    for name, values in figures.items():
        median = statistics.median(values)
        ok = median < GOALS_S[name]
        met &= ok
        print(
            f"{name:15s} median {median * 1000:7.1f} ms  (goal < {GOALS_S[name] * 1000:.0f} ms) {'met' if ok else 'NOT met'}"
        )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
