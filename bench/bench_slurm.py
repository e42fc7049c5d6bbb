"""What trainq adds on top of Slurm: drop→done through ``executor: slurm`` vs a bare ``sbatch --wrap``.

Same cluster, same run, same trivial command (``true``), ``--jobs`` of each (default 20), two ways:

* serial: one job at a time; latency from the drop into inbox/ until the folder is in done/, vs
  from calling ``sbatch`` until ``squeue -t all`` shows COMPLETED (polled every 20 ms);
* burst: all jobs at once (max_concurrent = jobs); time until the last one is done / COMPLETED.

Needs the one-node Slurm of ``tests/slurm/start.sh`` (root); the bench starts it and points SLURM_CONF at it.
Run: ``.venv/bin/python bench/bench_slurm.py [--jobs 20]``. Prints a markdown table.

``--scale 10,100,1000`` measures instead what the watcher costs the controller and the shared filesystem
while it tracks N jobs queued in Slurm (``--hold``): ``squeue`` runs per minute (a counting wrapper first on
the watcher's PATH) and filesystem calls per second (``strace -f -c -e trace=%file`` attached to the watcher:
open, stat, rename, unlink, ...), each over ``--window`` seconds (default 20) once all N are submitted.

``--sweep 1000`` drops one sweep file of N variants (held in Slurm's queue with ``--hold``), then stops the
whole sweep with ``trainq stop SWEEP``: ``sbatch`` and ``scancel`` runs (counting wrappers on the watcher's PATH),
seconds until every variant is in Slurm and until every one is cancelled, with ``slurm.arrays`` on (one job
array per sweep, the default) and off (one sbatch per job), in the same run.

``--rpc 1000`` measures what the watcher costs slurmctld: it submits N jobs held in Slurm's queue, records the
worst age of status.json while they are submitted (the loop must not wait on sbatch), waits ``--settle`` s, then
counts slurmctld's RPCs by message type over ``--window`` s with ``sdiag -r``/``sdiag``, next to the same window
without the watcher (other users of the cluster). Run it with another checkout's Python (``/other/.venv/bin/python
bench/bench_slurm.py --rpc 1000``) to measure that checkout's watcher: the watcher is ``sys.executable -m trainq``.

``--status-burst 300`` drops 300 trivial jobs at once into a queue with ``executor: slurm`` and ``max_concurrent``
``--slots`` (default 8) and reads status.json every 20 ms for ``--first`` s (default 20): the longest gap between
two successive ``heartbeat_at`` values (the contract promises a rewrite every ``status_s``, 1 s, while anything
changes, and ``heartbeat_at`` at least every 5 s), with the load, ``--runs`` times.
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import os
import re
import shutil
import signal
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
#: the watcher's slurm.poll_s in the overhead runs (--poll); a job's end is seen at the next squeue
POLL = {"s": 2.0}


def squeue_ok() -> bool:
    return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, timeout=60).returncode == 0


def completed(ids: list[str]) -> set[str]:
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%i|%T", "-j", ",".join(ids)], capture_output=True, text=True, timeout=60
    ).stdout
    return {line.split("|")[0] for line in out.split() if line.endswith("|COMPLETED")}


def sbatch(out_dir: Path) -> str:
    done = subprocess.run(
        ["sbatch", "--parsable", f"--output={out_dir}/bare-%j.out", "--wrap", "true"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
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


def launch_watcher(root: Path, settings: str, bin_dir: Path | None = None) -> subprocess.Popen:
    """``trainq init`` root, write ``settings`` as its watcher.yaml, start a quiet watcher on it (with
    ``bin_dir`` first on its PATH, for counting wrappers)."""
    subprocess.run(
        [sys.executable, "-m", "trainq.watcher", "init", str(root)], cwd=REPO, check=True, capture_output=True
    )
    (root / "watcher.yaml").write_text(settings)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if bin_dir is not None:
        env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    return subprocess.Popen(
        [sys.executable, "-m", "trainq.watcher", "--root", str(root), "watch", "-q"],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )


def counting_wrappers(bin_dir: Path, commands: tuple[str, ...], calls_dir: Path, suffix: str) -> dict[str, Path]:
    """A wrapper in ``bin_dir`` for each Slurm command, appending a line per call to the file returned for it."""
    bin_dir.mkdir(parents=True)
    calls = {}
    for command in commands:
        calls[command] = calls_dir / f"{command}-calls-{suffix}"
        calls[command].touch()
        (bin_dir / command).write_text(f'#!/bin/sh\necho x >> {calls[command]}\nexec {shutil.which(command)} "$@"\n')
        (bin_dir / command).chmod(0o755)
    return calls


def start_watcher(root: Path, max_concurrent: int) -> subprocess.Popen:
    proc = launch_watcher(root, f"executor: slurm\nmax_concurrent: {max_concurrent}\nslurm: {{poll_s: {POLL['s']}}}\n")
    deadline = time.monotonic() + 30
    while not (root / "status.json").exists():
        if time.monotonic() > deadline:
            raise SystemExit("the watcher did not start")
        time.sleep(POLL_S)
    return proc


def drop(root: Path, name: str) -> None:
    staging = root / f".{name}.tmp"
    staging.write_text('approved: true\ncommand: ["true"]\n')
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


def scale_point(n: int, root: Path, window_s: float) -> tuple[float, float, float]:
    """(squeue runs per minute, filesystem calls per second, seconds to submit all) with ``n`` held jobs tracked."""
    bin_dir = root.parent / f"bin-{n}"
    calls = counting_wrappers(bin_dir, ("squeue",), root.parent, str(n))["squeue"]
    proc = launch_watcher(root, f"executor: slurm\nmax_concurrent: {n}\n", bin_dir)
    try:
        t0 = time.monotonic()
        for i in range(n):
            staging = root / f".h{i}.tmp"
            staging.write_text('approved: true\ncommand: ["true"]\nslurm: {sbatch_args: [--hold]}\n')
            os.rename(staging, root / "inbox" / f"h{i}.yaml")
        while sum(1 for _ in (root / "running").glob("*/slurm.json")) < n or not all_submitted(root, n):
            if time.monotonic() - t0 > 60 + n:
                raise SystemExit(f"only part of the {n} jobs reached Slurm")
            time.sleep(0.5)
        submit_s = time.monotonic() - t0
        time.sleep(3)  # let the last launches' writes settle
        calls.write_text("")
        trace = subprocess.Popen(
            ["strace", "-f", "-c", "-e", "trace=%file", "-p", str(proc.pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(window_s)
        trace.send_signal(signal.SIGINT)
        summary = trace.communicate(timeout=60)[1]
        squeue_per_min = len(calls.read_text().splitlines()) * 60 / window_s
        total = re.search(r"^\s*100\.00\s+\S+\s+\S+\s+(\d+)", summary, re.MULTILINE)
        fs_per_s = int(total.group(1)) / window_s if total else float("nan")
        return squeue_per_min, fs_per_s, submit_s
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        cancel_queue_jobs(root)


def cancel_queue_jobs(root: Path) -> None:
    """scancel the Slurm jobs of this queue only (their tag names its key); other users of the cluster keep theirs."""
    from trainq.watcher.slurm.state import queue_key

    out = subprocess.run(["squeue", "--me", "-h", "-o", "%i|%k"], capture_output=True, text=True, timeout=120).stdout
    prefix = f"trainq:{queue_key(root)}:"
    ids = [line.split("|")[0] for line in out.splitlines() if line.partition("|")[2].startswith(prefix)]
    for i in range(0, len(ids), 200):
        subprocess.run(["scancel", *ids[i : i + 200]], capture_output=True, timeout=120)


def all_submitted(root: Path, n: int) -> bool:
    done = 0
    for path in (root / "running").glob("*/slurm.json"):
        try:
            done += bool(json.loads(path.read_text()).get("slurm_job_id"))
        except (OSError, ValueError):
            pass
    return done >= n


def sweep_point(n: int, root: Path, arrays: bool) -> tuple[int, int, float, float]:
    """(sbatch runs, scancel runs, seconds until all n are in Slurm, seconds until all n are cancelled)."""
    bin_dir = root.parent / f"bin-sweep-{n}-{arrays}"
    counts = counting_wrappers(bin_dir, ("sbatch", "scancel"), root.parent, f"{n}-{arrays}")
    settings = f"executor: slurm\nmax_concurrent: {n}\nslurm: {{arrays: {str(arrays).lower()}}}\n"
    proc = launch_watcher(root, settings, bin_dir)
    try:
        t0 = time.monotonic()
        staging = root / ".grid.tmp"
        staging.write_text(
            f'approved: true\ncommand: [echo, "{{x}}"]\nsweep: {{x: {list(range(n))}}}\n'
            "slurm: {sbatch_args: [--hold]}\n"
        )
        os.rename(staging, root / "inbox" / "grid.yaml")
        while not all_submitted(root, n):
            if time.monotonic() - t0 > 120 + n:
                raise SystemExit(f"only part of the sweep's {n} jobs reached Slurm")
            time.sleep(0.2)
        submit_s = time.monotonic() - t0
        t1 = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "trainq.watcher", "--root", str(root), "stop", "grid"],
            cwd=REPO,
            check=True,
            capture_output=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        while sum(1 for _ in (root / "failed").glob("grid-*/run.json")) < n:
            if time.monotonic() - t1 > 120 + n:
                raise SystemExit(f"only part of the sweep's {n} jobs were cancelled")
            time.sleep(0.2)
        cancel_s = time.monotonic() - t1
        return (
            len(counts["sbatch"].read_text().splitlines()),
            len(counts["scancel"].read_text().splitlines()),
            submit_s,
            cancel_s,
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        cancel_queue_jobs(root)


def sweep(n: int) -> None:
    print(
        f"| one sweep of {n} jobs (held), then `trainq stop` of the sweep | sbatch runs | scancel runs "
        "| all in Slurm (s) | all cancelled (s) |"
    )
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-slurm-sweep-") as tmp:
        for arrays in (True, False):
            sbatch_runs, scancel_runs, submit_s, cancel_s = sweep_point(n, Path(tmp) / f"q{arrays}", arrays)
            label = "slurm.arrays: true (default): one job array" if arrays else "slurm.arrays: false: one sbatch a job"
            print(f"| {label} | {sbatch_runs} | {scancel_runs} | {submit_s:.1f} | {cancel_s:.1f} |", flush=True)


def scale(counts: list[int], window_s: float) -> None:
    if shutil.which("strace") is None:
        raise SystemExit("--scale needs strace (apt-get install strace)")
    print("| jobs queued in Slurm (held) | squeue runs / min | filesystem calls / s | time to submit all (s) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-slurm-scale-") as tmp:
        for n in counts:
            per_min, fs_per_s, submit_s = scale_point(n, Path(tmp) / f"q{n}", window_s)
            print(f"| {n} | {per_min:.0f} | {fs_per_s:.1f} | {submit_s:.1f} |", flush=True)


def sdiag_rpcs() -> dict[str, int]:
    """slurmctld's RPC counts by message type since the last ``sdiag -r``."""
    out = subprocess.run(["sdiag"], capture_output=True, text=True, timeout=60).stdout
    block = out.partition("by message type")[2].partition("by user")[0]
    return {
        m.group(1): int(m.group(2)) for m in re.finditer(r"^\s*(\w+)\s+\(\s*\d+\)\s+count:(\d+)", block, re.MULTILINE)
    }


def rpc_window(window_s: float) -> dict[str, float]:
    """RPCs per minute by type over ``window_s`` (sdiag -r first; sdiag's own STATS_INFO left out)."""
    subprocess.run(["sdiag", "-r"], capture_output=True, timeout=60, check=True)
    time.sleep(window_s)
    return {k: v * 60 / window_s for k, v in sdiag_rpcs().items() if k != "REQUEST_STATS_INFO"}


def status_age_while(root: Path, done, limit_s: float) -> float:
    """The largest age of status.json (now - its mtime) seen every 50 ms until ``done()``."""
    worst, t0 = 0.0, time.monotonic()
    while not done():
        if time.monotonic() - t0 > limit_s:
            raise SystemExit("the submission did not finish in time")
        try:
            worst = max(worst, time.time() - (root / "status.json").stat().st_mtime)
        except OSError:
            pass
        time.sleep(0.05)
    return worst


def rpc_point(n: int, root: Path, window_s: float, settle_s: float) -> tuple[dict[str, float], float, float, int]:
    """(RPCs/min by type while the watcher tracks ``n`` held jobs, worst status.json age during their submission,
    seconds to submit all, squeue runs in the window)."""
    bin_dir = root.parent / f"bin-rpc-{n}-{time.time_ns()}"
    calls = counting_wrappers(bin_dir, ("squeue", "scontrol", "sacct"), root.parent, f"rpc-{n}-{time.time_ns()}")
    proc = launch_watcher(root, f"executor: slurm\nmax_concurrent: {n}\n", bin_dir)
    try:
        deadline = time.monotonic() + 30
        while not (root / "status.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        for i in range(n):
            staging = root / f".h{i}.tmp"
            staging.write_text('approved: true\ncommand: ["true"]\nslurm: {sbatch_args: [--hold]}\n')
            os.rename(staging, root / "inbox" / f"h{i}.yaml")
        worst = status_age_while(root, lambda: all_submitted(root, n), 120 + 2 * n)
        submit_s = time.monotonic() - t0
        time.sleep(settle_s)  # the polls reach their longest interval (no change: 2, 4, 8, 16, 30 s)
        for c in calls.values():
            c.write_text("")
        rates = rpc_window(window_s)
        return rates, worst, submit_s, len(calls["squeue"].read_text().splitlines())
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        cancel_queue_jobs(root)


def rpc(n: int, window_s: float, settle_s: float) -> None:
    """Controller RPCs per minute (sdiag) with ``n`` held jobs tracked, minus the cluster's background rate."""
    background = rpc_window(window_s)
    with tempfile.TemporaryDirectory(prefix="bench-slurm-rpc-") as tmp:
        rates, worst, submit_s, squeues = rpc_point(n, Path(tmp) / "q", window_s, settle_s)
    kinds = sorted(set(rates) | set(background))
    print(
        f"| {n} held jobs tracked, {window_s:g} s window after {settle_s:g} s | RPCs/min (watcher window) "
        f"| RPCs/min (background, no watcher) |"
    )
    print("|---|---|---|")
    for kind in kinds:
        print(f"| {kind} | {rates.get(kind, 0):.1f} | {background.get(kind, 0):.1f} |")
    print(f"| squeue runs by the watcher in the window | {squeues} | |")
    print(f"| worst status.json age while submitting (s) | {worst:.2f} | |")
    print(f"| time to submit all {n} (s) | {submit_s:.1f} | |", flush=True)


def heartbeat_gaps(root: Path, first_s: float, until) -> tuple[float, float, int]:
    """(the longest gap between two successive ``heartbeat_at`` values of status.json, the longest time status.json
    went unrewritten by its mtime, writes seen), status.json read every 20 ms for ``first_s`` s or until ``until()``."""
    from trainq.watcher.spec.units import parse_iso

    beats: list[float] = []
    worst_age, t0 = 0.0, time.monotonic()
    while time.monotonic() - t0 < first_s and not until():
        path = root / "status.json"
        try:
            worst_age = max(worst_age, time.time() - path.stat().st_mtime)
            beat = parse_iso(json.loads(path.read_text()).get("watcher", {}).get("heartbeat_at"))
        except (OSError, ValueError, AttributeError):
            beat = None
        if beat is not None and (not beats or beat != beats[-1]):
            beats.append(beat)
        time.sleep(0.02)
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    return max(gaps, default=float("nan")), worst_age, len(beats) - 1


def status_burst(n: int, slots: int, first_s: float, runs: int) -> None:
    """``n`` trivial jobs dropped at once into a queue with ``executor: slurm`` and ``max_concurrent: slots``:
    the longest gap between status.json's ``heartbeat_at`` values in the first ``first_s`` s (the contract: a
    rewrite at least every ``status_s``, 1 s, while anything changes, and ``heartbeat_at`` at least every 5 s)."""
    print(
        f"| {n} × `true` dropped at once, executor: slurm, max_concurrent {slots}: first {first_s:g} s "
        "| longest heartbeat_at gap (s) | longest status.json age (s) | writes seen | load |"
    )
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-slurm-status-") as tmp:
        for run in range(runs):
            root = Path(tmp) / f"q{run}"
            proc = launch_watcher(root, f"executor: slurm\nmax_concurrent: {slots}\n")
            try:
                deadline = time.monotonic() + 30
                while not (root / "status.json").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(2)  # the watcher's first passes are behind it
                staging = root / "staging"
                staging.mkdir()
                for i in range(n):
                    (staging / f"t{i}.yaml").write_text('approved: true\ncommand: ["true"]\n')
                load = open("/proc/loadavg").read().split()[0]
                for i in range(n):  # one rename each: as close to "at once" as a user's mv gets
                    os.rename(staging / f"t{i}.yaml", root / "inbox" / f"t{i}.yaml")
                gap, age, writes = heartbeat_gaps(root, first_s, lambda: False)
                load += "–" + open("/proc/loadavg").read().split()[0]
                print(f"| run {run + 1} | {gap:.2f} | {age:.2f} | {writes} | {load} |", flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
                cancel_queue_jobs(root)


def bursts(n: int, runs: int) -> None:
    """A burst of ``n`` trivial jobs, bare ``sbatch --wrap`` then trainq, ``runs`` times: seconds until the last
    one is done, and the ratio of the medians."""
    bare, ours = [], []
    with tempfile.TemporaryDirectory(prefix="bench-slurm-burst-") as tmp:
        for i in range(runs):
            bare.append(bare_burst(n, Path(tmp)))
            ours.append(trainq_burst(n, Path(tmp) / f"burst{i}"))
            print(
                f"run {i + 1}: bare {bare[-1]:.2f} s, trainq {ours[-1]:.2f} s (load "
                f"{open('/proc/loadavg').read().split()[0]})",
                flush=True,
            )
    print(f"| burst of {n} × `true` until the last is done | bare sbatch --wrap | trainq | ratio of medians |")
    print("|---|---|---|---|")
    print(
        f"| median of {runs} runs (s) | {statistics.median(bare):.2f} | {statistics.median(ours):.2f} | "
        f"{statistics.median(ours) / statistics.median(bare):.2f}× |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--scale", help="comma-separated job counts, e.g. 10,100,1000: controller and filesystem load")
    parser.add_argument("--window", type=float, default=20.0, help="seconds measured per --scale point")
    parser.add_argument("--poll", type=float, default=2.0, help="the watcher's slurm.poll_s for the overhead runs")
    parser.add_argument("--sweep", type=int, help="jobs in one sweep: sbatch/scancel runs with and without job arrays")
    parser.add_argument(
        "--rpc",
        type=int,
        help="held jobs tracked: slurmctld RPCs per minute by type (sdiag), and "
        "the worst status.json age while they are submitted",
    )
    parser.add_argument("--settle", type=float, default=40.0, help="seconds after the submission before --rpc's window")
    parser.add_argument(
        "--burst-only",
        type=int,
        metavar="RUNS",
        help="only the burst of --jobs, bare and trainq alternately, RUNS times each",
    )
    parser.add_argument(
        "--status-burst",
        type=int,
        metavar="N",
        help="N trivial jobs dropped at once (max_concurrent --slots): the longest gap between status.json's "
        "heartbeat_at values in the first --first seconds",
    )
    parser.add_argument("--slots", type=int, default=8, help="max_concurrent for --status-burst (default 8)")
    parser.add_argument("--first", type=float, default=20.0, help="seconds --status-burst watches (default 20)")
    parser.add_argument("--runs", type=int, default=3, help="runs of --status-burst (default 3)")
    args = parser.parse_args()
    POLL["s"] = args.poll
    started = subprocess.run(["bash", str(SLURM_DIR / "start.sh")], check=True, capture_output=True, text=True)
    os.environ["SLURM_CONF"] = started.stdout.strip().splitlines()[-1].partition("=")[2]
    # like tests/test_slurm.py: a shared flock on users.lock says "in use", so no test run stops the cluster now
    users = open(Path(os.environ["SLURM_CONF"]).parent / "users.lock", "a")
    fcntl.flock(users, fcntl.LOCK_SH)
    if not squeue_ok():
        raise SystemExit("squeue does not answer; see tests/slurm/start.sh")
    if args.scale:
        scale([int(n) for n in args.scale.split(",")], args.window)
        return
    if args.sweep:
        sweep(args.sweep)
        return
    if args.rpc:
        rpc(args.rpc, args.window, args.settle)
        return
    if args.status_burst:
        status_burst(args.status_burst, args.slots, args.first, args.runs)
        return
    if args.burst_only:
        bursts(args.jobs, args.burst_only)
        return
    with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp:
        tmp_path = Path(tmp)
        bare_s = bare_serial(args.jobs, tmp_path)
        ours_s = trainq_serial(args.jobs, tmp_path / "serial")
        bare_b = bare_burst(args.jobs, tmp_path)
        ours_b = trainq_burst(args.jobs, tmp_path / "burst")
    med_bare, med_ours = statistics.median(bare_s), statistics.median(ours_s)
    print(
        f"| {args.jobs} × `true` on one-node Slurm | bare sbatch | trainq (executor: slurm, poll_s {args.poll:g}) "
        "| ratio |"
    )
    print("|---|---|---|---|")
    print(f"| serial: median latency per job (s) | {med_bare:.3f} | {med_ours:.3f} | {med_ours / med_bare:.2f}× |")
    print(
        f"| serial: max latency per job (s) | {max(bare_s):.3f} | {max(ours_s):.3f} | "
        f"{max(ours_s) / max(bare_s):.2f}× |"
    )
    print(f"| serial: total (s) | {sum(bare_s):.2f} | {sum(ours_s):.2f} | {sum(ours_s) / sum(bare_s):.2f}× |")
    print(
        f"| burst: all {args.jobs} at once, until the last is done (s) | {bare_b:.2f} | {ours_b:.2f} | "
        f"{ours_b / bare_b:.2f}× |"
    )


if __name__ == "__main__":
    main()
