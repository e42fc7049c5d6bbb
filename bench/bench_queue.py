"""The queue's own benchmarks (sections 1–7 of the README table), each driving a real watcher through files.

Every function takes the folder to make its temp workspace in, its counts, and an optional folder for
cProfile output of the watcher; it returns table rows. Peers (an inotifywait loop, nq, task-spooler)
run in the same call on the same jobs. ``bench/run_all.py`` calls these; run one alone with
``.venv/bin/python bench/run_all.py --only NAME``. Run as a script, this file prints issue 38's rows
(latency against the inotify floor, throughput and CPU per job beside nq and task-spooler, the
10,000-file burst, idle) in one run, with the load average at each section's start and at the end:

    .venv/bin/python bench/bench_queue.py            # run_all.py's options also apply (--quick, --profile, ...)
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: bench/ importable

from bench._common import (
    PY,
    REPO,
    BenchError,
    Queue,
    Row,
    WatcherProc,
    bench_env,
    fmt_ms,
    fmt_s,
    job_yaml,
    median,
    percentile,
    read_status,
    running_watcher,
    strays,
    tree_cpu_by_depth,
    wait_until,
    workspace,
)
from trainq.watcher.spec.units import parse_iso

logger = logging.getLogger(__name__)

#: drop→start goals (s)
LATENCY_MEDIAN_GOAL_S = 0.015
LATENCY_P95_GOAL_S = 0.050
#: drop→start median against the inotifywait floor (issue 38): at most this many times the floor
LATENCY_FLOOR_RATIO_GOAL = 2.0
#: drops after an idle spell (the latency row's drops come back to back; these are what a user dropping one job
#: after a pause sees: every process of the chain, and the floor's bash too, wakes cold), at most this many
IDLE_DROPS = 20
IDLE_GAP_S = 1.0
#: serial trivial jobs per second
THROUGHPUT_GOAL = 100.0
#: issue 38: trainq's serial throughput at least nq's and at least this share of task-spooler's
THROUGHPUT_TSP_SHARE_GOAL = 0.5
#: issue 38: CPU of the watcher and its helper tree (spawner, pooled supervisors) per trivial job (s)
CPU_PER_JOB_GOAL_S = 0.002
#: Linux prctl option: orphans reparent to us (nq's runners, task-spooler's server), so their CPU is ours to count
PR_SET_CHILD_SUBREAPER = 36
#: burst: all files in pending/ (s), watcher peak RSS (MB), status.json size (KB)
BURST_GOAL_S = 20.0
BURST_RSS_GOAL_MB = 150.0
STATUS_SIZE_GOAL_KB = 200.0
#: idle watcher CPU share (%), RSS (MB), `--help` wall time (s)
IDLE_CPU_GOAL_PCT = 1.0
IDLE_RSS_GOAL_MB = 60.0
HELP_GOAL_S = 0.300
#: cooperative stop: flag touched → folder in failed/ (s); a job ignoring SIGTERM gets stop_grace + this
STOP_GOAL_S = 1.5
STOP_IGNORING_GRACE_S = 2.0
STOP_IGNORING_EXTRA_GOAL_S = 6.0
#: re-adoption after SIGKILL of the watcher (s)
READOPT_GOAL_S = 2.0
#: stop_grace of the re-adopted sleepers, so stopping them all stays short
READOPT_STOP_GRACE_S = 1.0

#: the job command that stamps its own start time (bash's $EPOCHREALTIME: µs wall clock)
STAMP_SCRIPT = 'printf "%s\\n" "$EPOCHREALTIME" > "$0"'
#: a job that polls its stop.flag every 50 ms and exits when it appears
COOPERATIVE_SCRIPT = 'touch "$0"; while [ ! -e "$TRAINQ_STOP_FLAG" ]; do sleep 0.05; done'
#: a job whose whole tree ignores SIGTERM (an ignored disposition survives exec), so only SIGKILL ends it
IGNORING_SCRIPT = 'trap "" TERM; touch "$0"; while true; do sleep 0.05; done'
#: the 10 Hz dashboard stand-in: reads and parses status.json, prints its CPU seconds / wall seconds
POLLER_SCRIPT = r"""
import json, sys, time
path, seconds = sys.argv[1], float(sys.argv[2])
cpu0, wall0 = time.process_time(), time.monotonic()
next_at = wall0
while next_at < wall0 + seconds:
    with open(path, "rb") as f:
        json.loads(f.read())
    next_at += 0.1
    time.sleep(max(0.0, next_at - time.monotonic()))
print((time.process_time() - cpu0) / (time.monotonic() - wall0))
"""


def _profile(profile_dir: Path | None, name: str) -> Path | None:
    return profile_dir / f"watcher-{name}.prof" if profile_dir else None


def _stamp_time(path: Path) -> float | None:
    """The wall time a job stamped into ``path``; None until the line is complete."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return float(text) if text.endswith("\n") else None


# -- 1. drop → start latency -----------------------------------------------------------------------
def bench_latency(base: Path, drops: int, profile_dir: Path | None = None) -> list[Row]:
    """Median and p95 of file renamed into inbox → job process started, against an inotifywait loop."""
    with workspace(base, "latency") as work:
        ours = _trainq_latencies(work, drops, _profile(profile_dir, "latency"))
    with workspace(base, "floor") as work:
        floor = _inotify_latencies(work, drops)
    idle_drops = max(3, min(IDLE_DROPS, drops // 5))  # each costs IDLE_GAP_S twice (trainq, the floor)
    with workspace(base, "latency-idle") as work:
        ours_idle = _trainq_latencies(work, idle_drops, None, gap_s=IDLE_GAP_S)
    with workspace(base, "floor-idle") as work:
        floor_idle = _inotify_latencies(work, idle_drops, gap_s=IDLE_GAP_S)
    values = {
        "drops": drops,
        "trainq_s": ours,
        "floor_s": floor,
        "idle_gap_s": IDLE_GAP_S,
        "trainq_idle_s": ours_idle,
        "floor_idle_s": floor_idle,
    }
    med, p95 = median(ours), percentile(ours, 95)
    ratio = med / median(floor)
    idle_ratio = median(ours_idle) / median(floor_idle)
    return [
        Row(
            "latency",
            "1. drop→start latency, median",
            fmt_ms(med),
            f"inotifywait loop {fmt_ms(median(floor))}",
            f"≤ {LATENCY_MEDIAN_GOAL_S * 1000:g} ms",
            med <= LATENCY_MEDIAN_GOAL_S,
            values,
        ),
        Row(
            "latency",
            "1. drop→start latency, p95",
            fmt_ms(p95),
            f"inotifywait loop {fmt_ms(percentile(floor, 95))}",
            f"≤ {LATENCY_P95_GOAL_S * 1000:g} ms",
            p95 <= LATENCY_P95_GOAL_S,
        ),
        Row(
            "latency",
            "1. drop→start latency, median against the inotify floor",
            f"{ratio:.2f}× the floor",
            f"inotifywait loop {fmt_ms(median(floor))}",
            f"≤ {LATENCY_FLOOR_RATIO_GOAL:g}×",
            ratio <= LATENCY_FLOOR_RATIO_GOAL,
        ),
        Row(
            "latency",
            f"1. drop→start after {IDLE_GAP_S:g} s idle, median ({idle_drops} drops)",
            f"{fmt_ms(median(ours_idle))} ({idle_ratio:.2f}× the floor)",
            f"inotifywait loop {fmt_ms(median(floor_idle))}",
            f"≤ {LATENCY_FLOOR_RATIO_GOAL:g}×",
            idle_ratio <= LATENCY_FLOOR_RATIO_GOAL,
        ),
    ]


def _trainq_latencies(work: Path, drops: int, profile_to: Path | None, gap_s: float = 0.0) -> list[float]:
    """Drop→stamp of ``drops`` jobs, one at a time; ``gap_s`` of quiet before each drop (0: back to back)."""
    q = Queue.create(work)
    stamps = work / "stamps"
    stamps.mkdir()
    names = [f"lat-{i:04d}" for i in range(drops)]
    for name in names:
        q.stage(f"{name}.yaml", job_yaml(["bash", "-c", STAMP_SCRIPT, str(stamps / name)]))
    latencies = []
    with running_watcher(q.root, profile_to):
        for name in names:
            time.sleep(gap_s)
            dropped = time.time()
            q.drop_staged(f"{name}.yaml")
            started = wait_until(lambda: _stamp_time(stamps / name), 30, what=f"job {name} to start")
            wait_until(lambda: q.job_dir("done", name).is_dir(), 30, what=f"job {name} in done/")
            latencies.append(started - dropped)
    return latencies


def _inotify_latencies(work: Path, drops: int, gap_s: float = 0.0) -> list[float]:
    """The floor: an inotifywait loop that runs the same stamping command for each file landing (``gap_s`` as
    ``_trainq_latencies``)."""
    watched, staging, stamps = work / "watched", work / "staging", work / "stamps"
    for folder in (watched, staging, stamps):
        folder.mkdir()
    script = (
        f"inotifywait -m -e close_write,moved_to --format %f {watched} 2>{work}/inotify.err | "
        f"while read -r f; do bash -c '{STAMP_SCRIPT}' \"{stamps}/$f\"; done"
    )
    loop = subprocess.Popen(["bash", "-c", script], start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: "Watches established" in _read(work / "inotify.err"), 10, what="inotifywait watches")
        latencies = []
        for i in range(drops):
            name = f"lat-{i:04d}.yaml"
            (staging / name).write_text(job_yaml(["true"]))
            time.sleep(gap_s)
            dropped = time.time()
            os.rename(staging / name, watched / name)
            started = wait_until(lambda: _stamp_time(stamps / name), 30, what=f"inotify loop to stamp {name}")
            latencies.append(started - dropped)
        return latencies
    finally:
        os.killpg(loop.pid, signal.SIGKILL)  # the session this call created: bash, inotifywait, the loop
        loop.wait()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


# -- 2. throughput ---------------------------------------------------------------------------------
def bench_throughput(base: Path, jobs: int, runs: int, profile_dir: Path | None = None) -> list[Row]:
    """Serial trivial jobs per second, drop → all done, against nq and task-spooler; median of ``runs``.

    Each run also counts the CPU each queue spent per job (user + system seconds): trainq's watcher with its
    helper tree (spawner, pooled supervisors; the jobs' own ``true`` apart), every ``nq`` process (the clients and
    the runners they leave behind, which reparent to this process), task-spooler's server and clients.
    """
    rates: dict[str, list[float]] = {"trainq": [], "nq": [], "tsp": []}
    cpu: dict[str, list[float]] = {"trainq": [], "trainq_jobs": [], "nq": [], "tsp": []}
    with _subreaper(), workspace(base, "throughput") as work:
        for run in range(runs):  # interleaved, so a change in machine load hits every tool alike
            profile_to = _profile(profile_dir, "throughput") if run == 0 else None
            elapsed, helpers_s, jobs_s = _trainq_serial(work / f"trainq-{run}", jobs, profile_to)
            rates["trainq"].append(jobs / elapsed)
            cpu["trainq"].append(helpers_s / jobs)
            cpu["trainq_jobs"].append(jobs_s / jobs)
            for tool, serial in (("nq", _nq_serial), ("tsp", _tsp_serial)):
                elapsed, cpu_s = serial(work / f"{tool}-{run}", jobs)
                rates[tool].append(jobs / elapsed)
                cpu[tool].append(cpu_s / jobs)
    ours, nq_rate, tsp_rate = median(rates["trainq"]), median(rates["nq"]), median(rates["tsp"])
    peers = f"nq {nq_rate:.0f}/s, tsp {tsp_rate:.0f}/s"
    ours_cpu = median(cpu["trainq"])
    values = {"jobs": jobs, "runs": runs, "jobs_per_s": rates, "cpu_s_per_job": cpu}
    return [
        Row(
            "throughput",
            f"2. throughput, {jobs} × `true`, max_concurrent 1 (median of {runs})",
            f"{ours:.0f} jobs/s",
            peers,
            f"≥ {THROUGHPUT_GOAL:g} jobs/s",
            ours >= THROUGHPUT_GOAL,
            values,
        ),
        Row(
            "throughput",
            "2. throughput against nq and task-spooler, same run",
            f"{ours / nq_rate:.2f}× nq, {ours / tsp_rate:.2f}× tsp",
            peers,
            f"≥ 1× nq and ≥ {THROUGHPUT_TSP_SHARE_GOAL:g}× tsp",
            ours >= nq_rate and ours >= THROUGHPUT_TSP_SHARE_GOAL * tsp_rate,
        ),
        Row(
            "throughput",
            "2. CPU per trivial job: watcher + spawner + pooled supervisors (median of runs)",
            f"{fmt_ms(ours_cpu)} (+ {fmt_ms(median(cpu['trainq_jobs']))} the jobs' own `true`)",
            f"nq {fmt_ms(median(cpu['nq']))}, tsp {fmt_ms(median(cpu['tsp']))} (each with its jobs)",
            f"≤ {fmt_ms(CPU_PER_JOB_GOAL_S)}",
            ours_cpu <= CPU_PER_JOB_GOAL_S,
        ),
    ]


@contextmanager
def _subreaper() -> Iterator[None]:
    """While inside: orphans of the processes this one starts reparent to it (Linux), so reaping them counts their
    CPU; on the way out, the orphans left are reaped and the setting is undone."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
    if prctl is not None:
        prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        if prctl is not None:
            prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        _reap_orphans()


def _reap_orphans() -> None:
    """Reap every exited child, ours or reparented to us (their CPU then shows in RUSAGE_CHILDREN)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _children_cpu() -> float:
    """User + system seconds of every child reaped so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _tree_cpu(pid: int) -> tuple[float, float]:
    """(the helpers' own CPU, the jobs' CPU) of a watcher's live tree: every process's user + system seconds, and
    what each has reaped; what the supervisors (depth 2 and deeper) reaped is the jobs'."""
    helpers = jobs = 0.0
    for depth, t in tree_cpu_by_depth(pid):
        helpers += t.user + t.system
        if depth >= 2:
            jobs += t.children_user + t.children_system
        else:
            helpers += t.children_user + t.children_system  # helpers that exited (a surplus supervisor)
    return helpers, jobs


def _trainq_serial(work: Path, jobs: int, profile_to: Path | None) -> tuple[float, float, float]:
    """(seconds from the first drop to all done, the helper tree's CPU seconds, the jobs' CPU seconds)."""
    q = Queue.create(work, {"max_concurrent": 1})
    names = [f"t-{i:04d}.yaml" for i in range(jobs)]
    for name in names:
        q.stage(name, job_yaml(["true"]))
    with running_watcher(q.root, profile_to) as watcher:
        wait_until(lambda: len(psutil.Process(watcher.pid).children(recursive=True)) >= 2, 30, what="a warm pool")
        helpers0, jobs0 = _tree_cpu(watcher.pid)
        start = time.monotonic()
        for name in names:
            q.drop_staged(name)
        wait_until(
            lambda: q.count("done") + q.count("failed") >= jobs, 600, interval_s=0.02, what=f"{jobs} jobs to finish"
        )
        elapsed = time.monotonic() - start
        helpers1, jobs1 = _tree_cpu(watcher.pid)
        helpers = psutil.Process(watcher.pid).children(recursive=True)
    # the spawner and pooled supervisors leave after the watcher (reparented to us): gone before a peer's CPU counts
    wait_until(lambda: _reap_orphans() or not any(p.is_running() for p in helpers), 30, what="trainq's helpers to exit")
    if q.count("failed"):
        raise BenchError(f"throughput: {q.count('failed')} of {jobs} trivial jobs failed; see {q.root}/failed")
    return elapsed, helpers1 - helpers0, jobs1 - jobs0


def _nq_serial(work: Path, jobs: int) -> tuple[float, float]:
    """nq: enqueue ``jobs`` × ``nq true`` in a fresh NQDIR, then ``nq -w`` until all finished; (seconds, CPU s)."""
    work.mkdir(parents=True)
    env = bench_env(NQDIR=str(work))
    script = f"for i in $(seq {jobs}); do nq -q true; done; nq -w"
    _reap_orphans()
    cpu0 = _children_cpu()
    start = time.monotonic()
    subprocess.run(
        ["bash", "-c", script],
        env=env,
        cwd=work,
        check=True,
        timeout=600,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    elapsed = time.monotonic() - start
    wait_until(lambda: _reap_orphans() or not strays(work), 30, what="nq's runners to exit")
    cpu_s = _children_cpu() - cpu0
    logs = [n for n in os.listdir(work) if n.startswith(",")]
    if len(logs) != jobs:
        raise BenchError(f"nq: expected {jobs} job logs in {work}, found {len(logs)}")
    return elapsed, cpu_s


def _tsp_serial(work: Path, jobs: int) -> tuple[float, float]:
    """task-spooler on a private socket, one slot: enqueue ``jobs`` × ``tsp true``, wait for the last; (seconds,
    CPU s of the clients and the server with its jobs, the server's idle start-up and shutdown included)."""
    work.mkdir(parents=True)
    env = bench_env(TS_SOCKET=str(work / "ts.sock"), TS_MAXFINISHED=str(jobs + 10), TMPDIR=str(work))
    quiet = {"env": env, "cwd": work, "timeout": 600, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    _reap_orphans()
    cpu0 = _children_cpu()
    subprocess.run(["tsp", "-S", "1"], check=True, **quiet)  # starts the server with one slot
    try:
        start = time.monotonic()
        subprocess.run(["bash", "-c", f"for i in $(seq {jobs}); do tsp true; done; tsp -w"], check=True, **quiet)
        elapsed = time.monotonic() - start
        listing = subprocess.run(["tsp", "-l"], env=env, capture_output=True, text=True, timeout=60).stdout
        finished = sum(1 for line in listing.splitlines() if " finished " in line)
        if finished != jobs:
            raise BenchError(f"tsp: expected {jobs} finished jobs, `tsp -l` lists {finished}")
    finally:
        subprocess.run(["tsp", "-K"], **quiet)
    wait_until(lambda: _reap_orphans() or not strays(work), 30, what="task-spooler's server to exit")
    return elapsed, _children_cpu() - cpu0


# -- 3. burst --------------------------------------------------------------------------------------
class _PeakRss:
    """Samples a process's RSS every 20 ms in a thread; ``peak_mb`` is the largest seen."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_mb = max(self.peak_mb, self.proc.memory_info().rss / 2**20)
            except psutil.Error:
                return
            self._stop.wait(0.02)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def bench_burst(base: Path, files: int, profile_dir: Path | None = None) -> list[Row]:
    """``files`` valid job files renamed in at once while paused: time until all are in pending/."""
    with workspace(base, "burst") as work:
        q = Queue.create(work)
        (q.root / "pause.flag").touch()
        names = [f"b-{i:05d}.yaml" for i in range(files)]
        for name in names:
            q.stage(name, job_yaml(["true"]))
        with running_watcher(q.root, _profile(profile_dir, "burst")) as watcher, _PeakRss(watcher.pid) as rss:
            start = time.monotonic()
            for name in names:
                q.drop_staged(name)
            renamed_s = time.monotonic() - start
            # 10 Hz: listing a 10,000-entry folder costs ms, and the watcher needs the CPU
            wait_until(
                lambda: q.count("pending") + q.count("failed") >= files,
                600,
                interval_s=0.1,
                what=f"{files} files in pending/",
            )
            elapsed = time.monotonic() - start
            wait_until(
                lambda: _status_count(q.root, "pending") >= files,
                120,
                interval_s=0.1,
                what="status.json to count every pending job",
            )
            shown_s = time.monotonic() - start
        size_kb = (q.root / "status.json").stat().st_size / 1024
        rejected = q.count("failed")
    if rejected:
        raise BenchError(f"burst: {rejected} of {files} valid files were rejected")
    values = {
        "files": files,
        "renames_s": renamed_s,
        "all_pending_s": elapsed,
        "in_status_json_s": shown_s,
        "peak_rss_mb": rss.peak_mb,
        "status_json_kb": size_kb,
    }
    return [
        Row(
            "burst",
            f"3. burst of {files:,} files → all in pending/",
            fmt_s(elapsed),
            f"the renames alone {fmt_s(renamed_s)}",
            f"≤ {BURST_GOAL_S:g} s",
            elapsed <= BURST_GOAL_S,
            values,
        ),
        Row(
            "burst",
            "3. burst: watcher peak RSS",
            f"{rss.peak_mb:.0f} MB",
            "—",
            f"< {BURST_RSS_GOAL_MB:g} MB",
            rss.peak_mb < BURST_RSS_GOAL_MB,
        ),
        Row(
            "burst",
            f"3. burst: status.json size with {files:,} pending",
            f"{size_kb:.0f} KB",
            f"counted in status.json after {fmt_s(shown_s)}",
            f"< {STATUS_SIZE_GOAL_KB:g} KB",
            size_kb < STATUS_SIZE_GOAL_KB,
        ),
    ]


def _status_count(root: Path, key: str) -> int:
    status = read_status(root) or {}
    return int(status.get("counts", {}).get(key, 0))


# -- 4. idle and --help ----------------------------------------------------------------------------
def bench_idle(base: Path, seconds: float, profile_dir: Path | None = None) -> list[Row]:
    """CPU share and RSS of a watcher on an empty queue over ``seconds``."""
    with workspace(base, "idle") as work:
        q = Queue.create(work)
        with running_watcher(q.root, _profile(profile_dir, "idle")) as watcher:
            proc = psutil.Process(watcher.pid)
            time.sleep(2.0)  # let start-up work (imports, first status writes) finish before measuring
            cpu0, wall0 = sum(proc.cpu_times()[:2]), time.monotonic()
            time.sleep(seconds)
            cpu_pct = (sum(proc.cpu_times()[:2]) - cpu0) / (time.monotonic() - wall0) * 100
            rss_mb = proc.memory_info().rss / 2**20
    values = {"seconds": seconds, "cpu_pct": cpu_pct, "rss_mb": rss_mb}
    return [
        Row(
            "idle",
            f"4. idle watcher CPU over {seconds:g} s",
            f"{cpu_pct:.2f} %",
            "—",
            f"≤ {IDLE_CPU_GOAL_PCT:g} %",
            cpu_pct <= IDLE_CPU_GOAL_PCT,
            values,
        ),
        Row(
            "idle",
            "4. idle watcher RSS",
            f"{rss_mb:.0f} MB",
            "—",
            f"≤ {IDLE_RSS_GOAL_MB:g} MB",
            rss_mb <= IDLE_RSS_GOAL_MB,
        ),
    ]


def bench_help(base: Path, runs: int, profile_dir: Path | None = None) -> list[Row]:
    """Median wall time of ``python -m trainq.watcher --help`` and ``trainq --help``, next to a bare ``python -c pass``."""
    del base, profile_dir  # no workspace and no watcher needed
    floor = median(_wall_times([PY, "-c", "pass"], runs))
    rows = []
    commands = {"python -m trainq.watcher --help": [PY, "-m", "trainq.watcher", "--help"]}
    console = Path(PY).parent / "trainq"
    if console.exists():
        commands["trainq --help"] = [str(console), "--help"]
    for label, argv in commands.items():
        wall = median(_wall_times(argv, runs))
        rows.append(
            Row(
                "help",
                f"4. `{label}` wall time (median of {runs})",
                fmt_ms(wall),
                f"`python -c pass` {fmt_ms(floor)}",
                f"≤ {HELP_GOAL_S * 1000:g} ms",
                wall <= HELP_GOAL_S,
                {"runs": runs, "median_s": wall, "python_floor_s": floor},
            )
        )
    return rows


def _wall_times(argv: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, cwd=REPO, env=bench_env(), check=True, capture_output=True, timeout=60)
        times.append(time.perf_counter() - start)
    return times


# -- 5. stop latency -------------------------------------------------------------------------------
def bench_stop(base: Path, drops: int, ignoring: int, profile_dir: Path | None = None) -> list[Row]:
    """stop.flag touched → folder in failed/: a cooperative job (median), and one that ignores SIGTERM."""
    with workspace(base, "stop") as work:
        q = Queue.create(work)
        stamps = work / "stamps"
        stamps.mkdir()
        with running_watcher(q.root, _profile(profile_dir, "stop")):
            coop = [_stop_one(q, stamps, f"coop-{i:03d}", COOPERATIVE_SCRIPT, {}) for i in range(drops)]
            stubborn = [
                _stop_one(q, stamps, f"ignore-{i:02d}", IGNORING_SCRIPT, {"stop_grace": f"{STOP_IGNORING_GRACE_S:g}s"})
                for i in range(ignoring)
            ]
    coop_s = [s for s, _ in coop]
    stubborn_s = [s for s, _ in stubborn]
    statuses = sorted({status for _, status in coop + stubborn})
    goal_ignoring = STOP_IGNORING_GRACE_S + STOP_IGNORING_EXTRA_GOAL_S
    values = {"cooperative_s": coop_s, "ignoring_sigterm_s": stubborn_s, "statuses": statuses}
    rows = [
        Row(
            "stop",
            f"5. stop latency, cooperative job (median of {drops})",
            fmt_s(median(coop_s)),
            f"max {fmt_s(max(coop_s))}",
            f"≤ {STOP_GOAL_S:g} s",
            median(coop_s) <= STOP_GOAL_S,
            values,
        )
    ]
    if stubborn_s:
        rows.append(
            Row(
                "stop",
                f"5. stop latency, job ignoring SIGTERM, stop_grace {STOP_IGNORING_GRACE_S:g} s (median of {ignoring})",
                fmt_s(median(stubborn_s)),
                f"max {fmt_s(max(stubborn_s))}",
                f"≤ {goal_ignoring:g} s (grace + {STOP_IGNORING_EXTRA_GOAL_S:g})",
                median(stubborn_s) <= goal_ignoring,
            )
        )
    return rows


def _stop_one(q: Queue, stamps: Path, name: str, script: str, fields: dict) -> tuple[float, str]:
    """Drop one job, wait until its command runs, touch its stop.flag; seconds until failed/, final status."""
    q.stage(f"{name}.yaml", job_yaml(["bash", "-c", script, str(stamps / name)], **fields))
    q.drop_staged(f"{name}.yaml")
    wait_until(lambda: (stamps / name).exists(), 60, what=f"job {name} to start")
    start = time.monotonic()
    (q.job_dir("running", name) / "stop.flag").touch()
    wait_until(lambda: q.job_dir("failed", name).is_dir(), 60, interval_s=0.005, what=f"job {name} in failed/")
    elapsed = time.monotonic() - start
    run = json.loads((q.job_dir("failed", name) / "run.json").read_text())
    return elapsed, str(run.get("status"))


# -- 6 + 7. re-adoption and status.json read cost --------------------------------------------------
def bench_loaded(base: Path, jobs: int, reads: int, poll_s: float, profile_dir: Path | None = None) -> list[Row]:
    """A queue with ``jobs`` finished, running and pending: status.json read cost, then SIGKILL → re-adoption."""
    with workspace(base, "readopt") as work:
        q = Queue.create(work, {"max_concurrent": jobs})
        first = WatcherProc(q.root).start()
        try:
            first.wait_ready()
            _fill(q, jobs)
            status_rows = _status_cost(q.root, jobs, reads, poll_s)
        finally:
            first.kill(signal.SIGKILL)  # the crash section 6 measures recovery from
        with _readopting_watcher(q.root, _profile(profile_dir, "readopt")) as readopt_s:
            stop_s = _stop_everything(q, jobs)
    goal_stop = READOPT_STOP_GRACE_S + STOP_IGNORING_EXTRA_GOAL_S
    return [
        *status_rows,
        Row(
            "readopt",
            f"6. re-adoption of {jobs} running jobs after SIGKILL of the watcher",
            fmt_s(readopt_s),
            "—",
            f"≤ {READOPT_GOAL_S:g} s",
            readopt_s <= READOPT_GOAL_S,
            {"jobs": jobs, "readopt_s": readopt_s},
        ),
        Row(
            "readopt",
            f"6. stop {jobs} running (stop_grace {READOPT_STOP_GRACE_S:g} s) + cancel {jobs} pending",
            fmt_s(stop_s),
            "—",
            f"≤ {goal_stop:g} s (grace + {STOP_IGNORING_EXTRA_GOAL_S:g})",
            stop_s <= goal_stop,
            {"stop_all_s": stop_s},
        ),
    ]


def _fill(q: Queue, jobs: int) -> None:
    """``jobs`` finished (`true`), then ``jobs`` running (`sleep 600`), then ``jobs`` pending behind them."""
    sleeper = job_yaml(["sleep", "600"], stop_grace=f"{READOPT_STOP_GRACE_S:g}s")
    for prefix, text, state in (
        ("fin", job_yaml(["true"]), "done"),
        ("run", sleeper, "running"),
        ("wait", sleeper, "pending"),
    ):
        for i in range(jobs):
            q.stage(f"{prefix}-{i:03d}.yaml", text)
        for i in range(jobs):
            q.drop_staged(f"{prefix}-{i:03d}.yaml")
        wait_until(
            lambda: _status_count(q.root, state) >= jobs,
            120,
            interval_s=0.02,
            what=f"status.json to show {jobs} {state}",
        )
    wait_until(
        lambda: len((read_status(q.root) or {}).get("jobs", ())) >= 3 * jobs,
        60,
        interval_s=0.02,
        what="status.json to list every job",
    )


def _status_cost(root: Path, jobs: int, reads: int, poll_s: float) -> list[Row]:
    """µs per read+parse of the live status.json, and the CPU share of a 10 Hz poller."""
    path = root / "status.json"
    size_kb = path.stat().st_size / 1024
    start = time.perf_counter()
    for _ in range(reads):
        with open(path, "rb") as f:
            json.loads(f.read())
    read_us = (time.perf_counter() - start) / reads * 1e6
    out = subprocess.run(
        [PY, "-c", POLLER_SCRIPT, str(path), str(poll_s)],
        check=True,
        capture_output=True,
        text=True,
        timeout=poll_s + 60,
    ).stdout
    poller_pct = float(out.strip()) * 100
    values = {"jobs_each": jobs, "status_json_kb": size_kb, "read_parse_us": read_us, "poller_cpu_pct": poller_pct}
    return [
        Row(
            "status",
            f"7. status.json read+parse ({jobs} running, {jobs} pending, {jobs} finished; {size_kb:.0f} KB)",
            f"{read_us:.0f} µs",
            "—",
            "—",
            None,
            values,
        ),
        Row("status", f"7. CPU of a 10 Hz status.json poller over {poll_s:g} s", f"{poller_pct:.2f} %", "—", "—", None),
    ]


@contextmanager
def _readopting_watcher(root: Path, profile_to: Path | None) -> Iterator[float]:
    """Start a new watcher on a root whose watcher was SIGKILLed; yields the seconds it took to re-adopt all."""
    running = {p.name for p in (root / "running").iterdir() if not p.name.startswith(".")}
    watcher = WatcherProc(root, profile_to).start()
    try:
        restart = watcher.started_at
        wait_until(
            lambda: _readopted(root, watcher, running, restart),
            60,
            interval_s=0.005,
            what=f"{len(running)} running jobs re-adopted",
        )
        yield time.time() - restart
    finally:
        watcher.stop()


def _readopted(root: Path, watcher: WatcherProc, running: set[str], restart: float) -> bool:
    """status.json from the new watcher, heartbeat after the restart, every job still running as attempt 1."""
    watcher._check_alive()
    try:
        status = read_status(root)
    except json.JSONDecodeError:
        return False
    if not status or status.get("watcher", {}).get("pid") != watcher.pid:
        return False
    heartbeat = parse_iso(status["watcher"].get("heartbeat_at")) or 0.0
    live = {j["id"] for j in status.get("jobs", ()) if j.get("state") == "running" and j.get("attempt") == 1}
    return heartbeat >= restart - 0.001 and running <= live and status["counts"]["running"] == len(running)


def _stop_everything(q: Queue, jobs: int) -> float:
    """pause.flag, then every stop.flag at once; seconds until all 2 × ``jobs`` are in failed/."""
    (q.root / "pause.flag").touch()
    start = time.monotonic()
    for state in ("running", "pending"):
        for job in (q.root / state).iterdir():
            if not job.name.startswith("."):
                (job / "stop.flag").touch()
    wait_until(
        lambda: q.count("failed") >= 2 * jobs and q.count("running") == 0,
        120,
        interval_s=0.02,
        what=f"{2 * jobs} jobs in failed/",
    )
    return time.monotonic() - start


#: what ``python bench/bench_queue.py`` runs without ``--only``: issue 38's rows
QUEUE_SECTIONS = "latency,throughput,burst,idle"


def main(argv: list[str] | None = None) -> int:
    """run_all.py over QUEUE_SECTIONS (or ``--only``): one table, peers from the same run, the load beside it."""
    from bench import run_all  # here, not at the top: run_all imports this module

    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--only" or a.startswith("--only=") for a in args):
        args += ["--only", QUEUE_SECTIONS]
    return run_all.main(args)


if __name__ == "__main__":
    sys.exit(main())
