"""``trainq history`` over 100,000 finished jobs: goal < 1 s for the whole command.

    .venv/bin/python bench/bench_history.py [--count 100000] [--runs 5]

Builds a queue root in a temp folder whose history.jsonl holds COUNT records written by the same
function the watcher uses (faces/history.py), a mix of done/failed/cancelled train and command jobs,
some in sweeps, then times the real command line (a fresh ``python -m trainq.watcher`` process, its
output to /dev/null) for: everything as a table, ``--state failed``, ``--since 1d --json`` and
``--csv``. Prints the median wall time of each, and the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: the goal the issue sets for the whole command (s)
GOAL_S = 1.0


def build(root: Path, count: int) -> None:
    """A queue root with ``count`` history records (no job folders: history needs none)."""
    from trainq.watcher.faces.history import history_path, record_of
    from trainq.watcher.spec.units import iso_utc

    for name in ("inbox", "pending", "running", "done", "failed"):
        (root / name).mkdir(parents=True)
    start = time.time() - count * 5.0
    import json

    with open(history_path(root), "w", encoding="utf-8") as f:
        for i in range(count):
            status = ("done", "failed", "cancelled", "done")[i % 4]
            run = {
                "name": f"lora-{i}",
                "status": status,
                "submitted_at": iso_utc(start + i * 5),
                "started_at": iso_utc(start + i * 5 + 1),
                "finished_at": iso_utc(start + i * 5 + 4),
                "attempts": [{"n": 1, "exit_code": 0 if status == "done" else 1}],
                "diagnosis": {"kind": "oom"} if status == "failed" else None,
                "sweep": {"id": f"grid{i // 100}", "index": i % 100 + 1} if i % 3 == 0 else None,
            }
            record = record_of(f"job-{i}", "done" if status == "done" else "failed", run, i % 2 == 0, "default")
            f.write(json.dumps(record, separators=(",", ":")) + "\n")


def time_command(root: Path, args: list[str], runs: int) -> tuple[float, float]:
    """Median wall time and median CPU time (user + sys) of ``trainq --root ROOT history ARGS``, a fresh
    process each run. On a shared, loaded machine the CPU time is the figure that does not depend on
    the neighbours: on an idle core the wall time comes close to it."""
    import resource

    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "trainq.watcher", "--root", str(root), "history", *args],
            stdout=subprocess.DEVNULL,
            check=True,
            cwd=REPO,
        )
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainq-bench-history-"))
    try:
        root = tmp / "queue"
        build(root, args.count)
        size_mb = (root / "history.jsonl").stat().st_size / 2**20
        print(
            f"trainq history over {args.count} finished jobs (history.jsonl {size_mb:.1f} MB), "
            f"median of {args.runs}, load average {os.getloadavg()[0]:.2f}"
        )
        print("| command | wall s | CPU s (user+sys) | goal |")
        print("|---|---|---|---|")
        worst = 0.0
        for label, extra in (
            ("history", []),
            ("history --state failed", ["--state", "failed"]),
            ("history --since 1d --json", ["--since", "1d", "--json"]),
            ("history --csv", ["--csv"]),
        ):
            wall, cpu = time_command(root, extra, args.runs)
            worst = max(worst, wall)
            print(f"| {label} | {wall:.3f} | {cpu:.3f} | < {GOAL_S:g} s |")
        return 0 if worst < GOAL_S else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
