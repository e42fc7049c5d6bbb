"""Containment: how soon a pid hopper and an envless setsid grandchild are gone, cgroup vs tree walk.

    .venv/bin/python bench/bench_containment.py [--runs N] [--modes cgroup-v2,cgroup-v1,process-tree]

For each mode, N runs of tests/fake_trainers/escaper.sh (a pid hopper that re-forks every ms and
ignores SIGTERM, plus ``setsid env -i sleep`` in a session of its own) under a real supervisor:

- stop: ``stop.flag`` holding ``now`` (no grace) → the exit record; then whether anything of the job
  is still alive (a stop is only recorded once everything is gone, so anything left escaped);
- supervisor SIGKILL: the supervisor is SIGKILLed, then ``kill_leftovers`` (what the watcher runs on
  a dead supervisor) → its return; then what is still alive.

kill_after_s is 0.5 s (SIGTERM, then SIGKILL 0.5 s later), so a stop takes at least that. Prints a
markdown table with the load average. Needs root for the cgroup modes (skipped otherwise, with why).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import wait_until  # noqa: E402
from trainq.watcher.spec.contract import JobPaths  # noqa: E402
from trainq.watcher.supervisor import LaunchSpec, Supervisor, cgroups, kill_leftovers  # noqa: E402

FAKE = REPO / "tests" / "fake_trainers"
sys.path.insert(0, str(FAKE))
from pid_hopper import stamp_out, with_marker  # noqa: E402

KILL_AFTER_S = 0.5


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait(pred, timeout_s: float = 60.0):
    return wait_until(pred, timeout_s, interval_s=0.002)


def _launch(sup: Supervisor, base: Path, name: str) -> tuple[JobPaths, int, str, int]:
    paths = JobPaths(base / "running" / name)
    paths.dir.mkdir(parents=True)
    marker = f"bench-hopper-{os.getpid()}-{name}"
    argv = (str(FAKE / "escaper.sh"), sys.executable, str(FAKE / "pid_hopper.py"), marker, str(paths.dir))
    pid = sup.launch(
        LaunchSpec(
            job_dir=str(paths.dir),
            argv=argv,
            env={},
            cwd=str(paths.dir),
            attempt=1,
            stop_grace_s=0.0,
            kill_after_s=KILL_AFTER_S,
        )
    )
    _wait(lambda: (paths.dir / "hopper.ready").exists() and (paths.dir / "grandchild.pid").exists())
    return paths, pid, marker, int((paths.dir / "grandchild.pid").read_text())


def _escaped(marker: str, grandchild: int) -> tuple[int, int]:
    """(1 if any generation of the hopper is alive, 1 if the setsid grandchild is)."""
    return int(bool(with_marker(marker))), int(_alive(grandchild))


def _clean(marker: str, grandchild: int) -> None:
    stamp_out(marker)
    if _alive(grandchild):
        os.kill(grandchild, signal.SIGKILL)


def bench_mode(mode: str, runs: int, base: Path) -> dict:
    containment = cgroups.detect(mode)
    if containment.mode != mode:
        return {"mode": mode, "skipped": containment.why}
    sup = Supervisor(containment=containment)
    stop_s, stop_escaped, kill_s, kill_escaped = [], [0, 0], [], [0, 0]
    for i in range(runs):
        paths, _pid, marker, gc = _launch(sup, base / mode, f"stop{i}")
        t0 = time.perf_counter()
        paths.stop_flag.write_text("now")
        _wait(lambda: sup.read_exit(paths))
        stop_s.append(time.perf_counter() - t0)
        stop_escaped = [a + b for a, b in zip(stop_escaped, _escaped(marker, gc), strict=False)]
        _clean(marker, gc)
        paths, pid, marker, gc = _launch(sup, base / mode, f"kill{i}")
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: not _alive(pid) and sup.reap() is not None)
        t0 = time.perf_counter()
        kill_leftovers(paths)
        kill_s.append(time.perf_counter() - t0)
        kill_escaped = [a + b for a, b in zip(kill_escaped, _escaped(marker, gc), strict=False)]
        _clean(marker, gc)
    _wait(lambda: not sup.reap() and not sup.forked_pids, 30)
    return {
        "mode": mode,
        "runs": runs,
        "stop_median_s": statistics.median(stop_s),
        "stop_max_s": max(stop_s),
        "stop_escaped": stop_escaped,
        "kill_median_s": statistics.median(kill_s),
        "kill_max_s": max(kill_s),
        "kill_escaped": kill_escaped,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--modes", default=",".join(cgroups.MODES))
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="trainq-bench-contain-"))
    try:
        results = [bench_mode(mode, args.runs, base) for mode in args.modes.split(",")]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"Containment: pid hopper + envless setsid grandchild (load average {load}; kill_after_s {KILL_AFTER_S})\n")
    print("Escaped: runs in which the hopper / the envless setsid grandchild outlived it.\n")
    print(
        "| mode | runs | stop.flag now → exit record, median (max) | escaped the stop "
        "| supervisor SIGKILL: kill_leftovers, median (max) | escaped |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        if "skipped" in r:
            print(f"| {r['mode']} | skipped: {r['skipped']} | | | | |")
            continue
        print(
            f"| {r['mode']} | {r['runs']} | {r['stop_median_s']:.3f} s ({r['stop_max_s']:.3f} s) "
            f"| {r['stop_escaped'][0]} / {r['stop_escaped'][1]} of {r['runs']} | {r['kill_median_s']:.3f} s ({r['kill_max_s']:.3f} s) "
            f"| {r['kill_escaped'][0]} / {r['kill_escaped'][1]} of {r['runs']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
