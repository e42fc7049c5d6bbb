"""What trainq adds on top of Slurm: drop→done through ``executor: slurm`` vs a bare ``sbatch --wrap``.

Same cluster, same run, same trivial command (``true``), ``--jobs`` of each (default 20), two ways:

* serial: one job at a time; latency from the drop into inbox/ until the folder is in done/, vs
  from calling ``sbatch`` until ``squeue -t all`` shows COMPLETED (polled every 20 ms);
* burst: all jobs at once (max_concurrent = jobs); time until the last one is done / COMPLETED.

Needs the one-node Slurm of ``tests/slurm/start.sh`` (root); the bench starts it and points SLURM_CONF at it.
Run: ``.venv/bin/python bench/bench_slurm.py [--jobs 20]``. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "tests" / "slurm"
#: how often both sides look for the end of a job (s)
POLL_S = 0.02


def squeue_ok() -> bool:
    return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, timeout=60).returncode == 0


def completed(ids: list[str]) -> set[str]:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i|%T", "-j", ",".join(ids)], capture_output=True,
                         text=True, timeout=60).stdout
    return {line.split("|")[0] for line in out.split() if line.endswith("|COMPLETED")}


def sbatch(out_dir: Path) -> str:
    done = subprocess.run(["sbatch", "--parsable", f"--output={out_dir}/bare-%j.out", "--wrap", "true"],
                          capture_output=True, text=True, check=True, timeout=60)
    return done.stdout.strip().split(";")[0]


def bare_serial(n: int, out_dir: Path) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        job = sbatch(out_dir)
        while job not in completed([job]):
            time.sleep(POLL_S)
        times.append(time.monotonic() - t0)
    return times


def bare_burst(n: int, out_dir: Path) -> float:
    t0 = time.monotonic()
    ids = [sbatch(out_dir) for _ in range(n)]
    while len(completed(ids)) < n:
        time.sleep(POLL_S)
    return time.monotonic() - t0


def start_watcher(root: Path, max_concurrent: int) -> subprocess.Popen:
    subprocess.run([sys.executable, "-m", "trainq.watcher", "init", str(root)], cwd=REPO, check=True, capture_output=True)
    (root / "watcher.yaml").write_text(f"executor: slurm\nmax_concurrent: {max_concurrent}\n")
    proc = subprocess.Popen([sys.executable, "-m", "trainq.watcher", "--root", str(root), "watch", "-q"], cwd=REPO,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    deadline = time.monotonic() + 30
    while not (root / "status.json").exists():
        if time.monotonic() > deadline:
            raise SystemExit("the watcher did not start")
        time.sleep(POLL_S)
    return proc


def drop(root: Path, name: str) -> None:
    staging = root / f".{name}.tmp"
    staging.write_text("approved: true\ncommand: [\"true\"]\n")
    os.rename(staging, root / "inbox" / f"{name}.yaml")


def wait_done(root: Path, names: list[str]) -> None:
    while not all((root / "done" / n / "run.json").exists() for n in names):
        if any((root / "failed" / n).exists() for n in names):
            raise SystemExit(f"a job failed; see {root}/failed")
        time.sleep(POLL_S)


def trainq_serial(n: int, root: Path) -> list[float]:
    proc = start_watcher(root, 1)
    try:
        times = []
        for i in range(n):
            t0 = time.monotonic()
            drop(root, f"s{i}")
            wait_done(root, [f"s{i}"])
            times.append(time.monotonic() - t0)
        return times
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def trainq_burst(n: int, root: Path) -> float:
    proc = start_watcher(root, n)
    try:
        names = [f"b{i}" for i in range(n)]
        t0 = time.monotonic()
        for name in names:
            drop(root, name)
        wait_done(root, names)
        return time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    args = parser.parse_args()
    started = subprocess.run(["bash", str(SLURM_DIR / "start.sh")], check=True, capture_output=True, text=True)
    os.environ["SLURM_CONF"] = started.stdout.strip().splitlines()[-1].partition("=")[2]
    if not squeue_ok():
        raise SystemExit("squeue does not answer; see tests/slurm/start.sh")
    with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp:
        tmp_path = Path(tmp)
        bare_s = bare_serial(args.jobs, tmp_path)
        ours_s = trainq_serial(args.jobs, tmp_path / "serial")
        bare_b = bare_burst(args.jobs, tmp_path)
        ours_b = trainq_burst(args.jobs, tmp_path / "burst")
    med_bare, med_ours = statistics.median(bare_s), statistics.median(ours_s)
    print(f"| {args.jobs} × `true` on one-node Slurm | bare sbatch | trainq (executor: slurm) | ratio |")
    print("|---|---|---|---|")
    print(f"| serial: median latency per job (s) | {med_bare:.3f} | {med_ours:.3f} | {med_ours / med_bare:.2f}× |")
    print(f"| serial: max latency per job (s) | {max(bare_s):.3f} | {max(ours_s):.3f} | "
          f"{max(ours_s) / max(bare_s):.2f}× |")
    print(f"| serial: total (s) | {sum(bare_s):.2f} | {sum(ours_s):.2f} | {sum(ours_s) / sum(bare_s):.2f}× |")
    print(f"| burst: all {args.jobs} at once, until the last is done (s) | {bare_b:.2f} | {ours_b:.2f} | "
          f"{ours_b / bare_b:.2f}× |")


if __name__ == "__main__":
    main()
