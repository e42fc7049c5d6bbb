"""Where one serial trivial job's cycle goes (issue 38): the critical path from one job's end to the next one's.

``bench_queue.py``'s throughput row runs N × ``true`` with max_concurrent 1. Each job's start waits for the last
one's end, so the rate is one over a cycle: the watcher hears of the exit, plans and hands the next job over; a
pooled supervisor takes it, starts it, watches it end, writes the exit record and says so. This probe times
each of those steps in the real processes (``_cycle_stamps.py``, loaded through a ``sitecustomize`` on
PYTHONPATH; trainq itself is unchanged) over the serial part alone: the jobs are all pending first (under
pause.flag), then the flag goes and the queue runs them one after another.

With ``perf`` at hand (``--sched``, root), it also records the scheduler during the run: how long the pooled
supervisors waited for a CPU while runnable, and how long each CPU sat idle, per job.

    .venv/bin/python bench/probe_cycle.py [--jobs 300] [--tmp /dev/shm] [--sched]

With ``--drops N`` it times the other critical path instead, ``bench_queue.py``'s latency row: N jobs dropped
one at a time into an idle queue (``--gap`` seconds of quiet before each), each split from the rename into inbox/
to the job's exec.

    .venv/bin/python bench/probe_cycle.py --drops 200 [--gap 0]

``--fine`` (either mode) also times the steps inside those: intake's read, validation and claim, planning, the
launch's parts, retiring's parts, and the supervisor's take, preparation and spawn, each in the step table.
"""

from __future__ import annotations

import argparse
import bisect
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: bench/ importable

from bench._common import PY, REPO, Queue, bench_env, job_yaml, read_status, wait_until
from bench._cycle_stamps import FINE_SUPERVISOR_STEPS, FINE_WATCHER_STEPS, SUPERVISOR_STEPS, WATCHER_STEPS

#: every stamped step's name in the order the path meets it (the step table's order)
STEP_ORDER = [step for _, _, step in WATCHER_STEPS + FINE_WATCHER_STEPS + SUPERVISOR_STEPS + FINE_SUPERVISOR_STEPS]

#: the critical path, one job's cycle, in order: (segment, what it is)
SEGMENTS = (
    ("pass → handed over", "the watcher's pass from its start to the request on the jobs socket"),
    ("handed over → taken", "until a pooled supervisor starts taking it (its wake-up)"),
    ("take", "the job's lock, the last attempt's records cleared, output.log, the answer"),
    ("taken → spawn", "stop handlers, environment, snapshot read, the cgroup made"),
    ("spawn", "enter the cgroup, vfork + exec, leave"),
    ("spawned → reaped", "the job runs; meanwhile the snapshot, start record and started event"),
    ("reaped → notified", "the exit record and exited event, the lock released, the watcher told"),
    ("notified → next pass", "until the watcher's next pass starts"),
)


#: the drop's path, from the rename into inbox/ to the job's exec, in order: (segment, what it is)
DROP_SEGMENTS = (
    ("drop → pass", "the loop's wake-up: inotify, the select, until its pass starts"),
    ("pass → admit", "the pass's work before intake (finished jobs reaped)"),
    ("admit", "intake: scan, read, validate, claim into pending/"),
    ("admit → launch", "planning: what may start, in what order"),
    ("launch → handed over", "the launch before the request on the jobs socket (the move into running/)"),
    ("handed over → taken", "until a pooled supervisor starts taking it (its wake-up)"),
    ("take", "the job's lock, the last attempt's records cleared, output.log, the answer"),
    ("taken → spawn", "stop handlers, environment, snapshot read, the cgroup made"),
    ("spawn", "enter the cgroup, vfork + exec, leave"),
)


def _stamps(folder: Path) -> dict[int, list[tuple[str, float, float, float]]]:
    """Every process's stamps: pid → [(step, start, end, cpu seconds)], in time order."""
    out: dict[int, list[tuple[str, float, float, float]]] = {}
    for path in folder.glob("*.stamps"):
        rows = []
        for line in path.read_text(encoding="ascii").splitlines():
            step, start, end, cpu = line.rsplit(maxsplit=3)  # a fine step's name has spaces
            rows.append((step, float(start), float(end), float(cpu)))
        out[int(path.stem)] = sorted(rows, key=lambda r: r[1])
    return out


def _first_after(rows: list[tuple[str, float, float, float]], starts: list[float], t: float):
    i = bisect.bisect_left(starts, t)
    return rows[i] if i < len(rows) else None


def _supervisors_by_step(stamps: dict[int, list], watcher_pid: int) -> tuple[dict[str, list], dict[str, list[float]]]:
    """The pooled supervisors' stamps by step, each in time order, and their start times (for ``_first_after``)."""
    by_step: dict[str, list] = defaultdict(list)
    for pid, rows in stamps.items():
        if pid != watcher_pid:
            for r in rows:
                by_step[r[0]].append(r)
    for rows in by_step.values():
        rows.sort(key=lambda r: r[1])
    return by_step, {step: [r[1] for r in rows] for step, rows in by_step.items()}


def cycle(stamps: dict[int, list], watcher_pid: int) -> dict[str, list[float]]:
    """Each job's cycle split into SEGMENTS (seconds), matched by time across the processes' stamps."""
    watcher = stamps.get(watcher_pid, [])
    passes = [r for r in watcher if r[0] == "pass"]
    pass_starts = [r[1] for r in passes]
    by_step, starts = _supervisors_by_step(stamps, watcher_pid)
    out: dict[str, list[float]] = defaultdict(list)
    hand_overs = [r for r in watcher if r[0] == "hand_over"]
    for hand in hand_overs[5:-5]:  # the first and last few: the pool warming, the queue draining
        sent = hand[1]
        take = _first_after(by_step["take"], starts.get("take", []), sent)
        spawn = take and _first_after(by_step["spawn"], starts.get("spawn", []), take[2])
        watch = spawn and _first_after(by_step["watch"], starts.get("watch", []), spawn[2])
        note = watch and _first_after(by_step["notify"], starts.get("notify", []), watch[2])
        if not (take and spawn and watch and note):
            continue
        here = bisect.bisect_right(pass_starts, sent) - 1
        after = bisect.bisect_left(pass_starts, note[1])
        if here < 0 or after >= len(passes):
            continue
        points = (passes[here][1], sent, take[1], take[2], spawn[1], spawn[2], watch[2], note[2], passes[after][1])
        for (name, _what), a, b in zip(SEGMENTS, points, points[1:], strict=False):
            out[name].append(b - a)
        out["cycle"].append(points[-1] - points[0])
    return out


def drop_path(stamps: dict[int, list], watcher_pid: int, drops: list[float]) -> dict[str, list[float]]:
    """Each drop's path split into DROP_SEGMENTS (seconds); ``drops`` are the renames' ``perf_counter`` times."""
    watcher = stamps.get(watcher_pid, [])
    steps = {name: [r for r in watcher if r[0] == name] for name in ("pass", "admit", "launch", "hand_over")}
    starts = {name: [r[1] for r in rows] for name, rows in steps.items()}
    by_step, sup_starts = _supervisors_by_step(stamps, watcher_pid)
    out: dict[str, list[float]] = defaultdict(list)
    for dropped in drops[2:]:  # the first ones warm the pool
        launch = _first_after(steps["launch"], starts["launch"], dropped)
        if launch is None:
            continue
        admits = [r for r in steps["admit"] if dropped <= r[1] <= launch[1]]
        hand = _first_after(steps["hand_over"], starts["hand_over"], launch[1])
        take = hand and _first_after(by_step["take"], sup_starts.get("take", []), hand[1])
        spawn = take and _first_after(by_step["spawn"], sup_starts.get("spawn", []), take[2])
        if not (admits and hand and take and spawn):
            continue
        admit = admits[-1]  # the pass that took the file (an earlier one may have seen it incomplete)
        first = _first_after(steps["pass"], starts["pass"], dropped)
        if first is None:
            continue
        points = (dropped, first[1], admit[1], admit[2], launch[1], hand[1], take[1], take[2], spawn[1], spawn[2])
        for (name, _what), a, b in zip(DROP_SEGMENTS, points, points[1:], strict=False):
            out[name].append(b - a)
        out["drop → exec"].append(points[-1] - points[0])
        out["passes"].append(
            float(bisect.bisect_right(starts["pass"], launch[1]) - bisect.bisect_left(starts["pass"], dropped))
        )
    return out


def step_medians(stamps: dict[int, list], watcher_pid: int) -> list[tuple[str, str, float, float, int]]:
    """(process, step, median wall ms, median CPU ms, calls) of every stamped step (idle passes included), the
    watcher's first, each process's in the order the path meets them."""
    rows: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for pid, stamped in stamps.items():
        who = "watcher" if pid == watcher_pid else "supervisor"
        for step, start, end, cpu in stamped:
            rows[(who, step)].append((end - start, cpu))
    return [
        (who, step, statistics.median(w for w, _ in v) * 1000, statistics.median(c for _, c in v) * 1000, len(v))
        for (who, step), v in sorted(rows.items(), key=lambda kv: (kv[0][0] != "watcher", _order(kv[0][1])))
    ]


def _order(step: str) -> tuple[int, str]:
    return (STEP_ORDER.index(step) if step in STEP_ORDER else len(STEP_ORDER), step)


def cpu_by_step(
    stamps: dict[int, list], watcher_pid: int, jobs: int, window: tuple[float, float]
) -> list[tuple[str, str, float]]:
    """(process, step, CPU ms per job) for every step stamped inside ``window``; nested steps are counted inside
    their parents too."""
    totals: dict[tuple[str, str], float] = defaultdict(float)
    for pid, rows in stamps.items():
        who = "watcher" if pid == watcher_pid else "supervisor"
        for step, start, _end, cpu in rows:
            if window[0] <= start <= window[1]:
                totals[(who, step)] += cpu
    return [(who, step, s / jobs * 1000) for (who, step), s in sorted(totals.items(), key=lambda kv: -kv[1])]


def _segment_table(
    title: str, named: tuple[tuple[str, str], ...], segments: dict[str, list[float]], whole: tuple[str, str, str]
) -> None:
    """The segments' medians in ms, then the whole's: ``whole`` is (row name, key in ``segments``, what it counts)."""
    print(f"| {title} | median ms | what |\n|---|---|---|")
    for name, what in named:
        values = segments.get(name) or [0.0]
        print(f"| {name} | {statistics.median(values) * 1000:.3f} | {what} |")
    row, key, counted = whole
    values = segments.get(key) or [0.0]
    print(f"| {row} | {statistics.median(values) * 1000:.3f} | median over {len(values)} {counted} |")


def _stamped_watcher(work: Path, q: Queue, fine: bool = False) -> tuple[Path, subprocess.Popen]:
    """A real watcher on ``q`` whose tree loads the stamps (a ``sitecustomize`` on PYTHONPATH): (stamps folder,
    watcher process). ``fine``: the steps inside the steps too (``CYCLE_STAMPS_FINE``)."""
    stamps = work / "stamps"
    stamps.mkdir()
    site = work / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import bench._cycle_stamps  # noqa: F401\n", encoding="utf-8")
    env = bench_env(CYCLE_STAMPS=str(stamps), CYCLE_STAMPS_FINE="1" if fine else "")
    env["PYTHONPATH"] = os.pathsep.join((str(site), env["PYTHONPATH"]))  # bench_env's: a given one, then REPO
    watcher = subprocess.Popen(
        [PY, "-m", "trainq.watcher", "--root", str(q.root), "watch", "-q"],
        env=env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    return stamps, watcher


def run(jobs: int, tmp: Path, sched: bool, fine: bool = False) -> None:
    work = Path(tempfile.mkdtemp(prefix="trainq-cycle-", dir=tmp))
    q = Queue.create(work / "q", {"max_concurrent": 1})
    names = [f"t-{i:05d}.yaml" for i in range(jobs)]
    for name in names:
        q.stage(name, job_yaml(["true"]))
    stamps, watcher = _stamped_watcher(work, q, fine)
    perf = None
    try:
        wait_until(lambda: (read_status(q.root) or {}).get("watcher", {}).get("pid") == watcher.pid, 60, what="ready")
        (q.root / "pause.flag").write_text("")
        wait_until(lambda: (read_status(q.root) or {}).get("watcher", {}).get("state") == "paused", 30, what="paused")
        for name in names:
            q.drop_staged(name)
        wait_until(lambda: q.count("pending") >= jobs, 120, what=f"{jobs} pending jobs")
        if sched:
            perf = subprocess.Popen(
                ["perf", "sched", "record", "-k", "CLOCK_MONOTONIC", "-a", "-o", str(work / "sched.data")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)
        start = time.perf_counter()  # CLOCK_MONOTONIC: the stamps' clock, and perf's with -k
        (q.root / "pause.flag").unlink()
        wait_until(lambda: q.count("done") + q.count("failed") >= jobs, 600, interval_s=0.02, what="all done")
        end = time.perf_counter()
        elapsed = end - start
    finally:
        if perf is not None:
            perf.send_signal(signal.SIGINT)
            perf.wait(60)
        watcher.send_signal(signal.SIGTERM)
        watcher.wait(60)
    time.sleep(0.5)  # the pooled supervisors flush after each attempt; the last ones leave after the watcher
    found = _stamps(stamps)
    segments = cycle(found, watcher.pid)
    print(f"{jobs} serial trivial jobs: {jobs / elapsed:.0f} jobs/s (the pause lifted to the last one done)")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}\n")
    _segment_table("segment of the cycle", SEGMENTS, segments, ("whole cycle", "cycle", "jobs"))
    print()
    print("| process | step | CPU ms a job |\n|---|---|---|")
    for who, step, ms in cpu_by_step(found, watcher.pid, jobs, (start, end)):
        print(f"| {who} | {step} | {ms:.3f} |")
    if perf is not None:
        print()
        _sched_report(work / "sched.data", found, watcher.pid, jobs, (start, end))
    shutil.rmtree(work, ignore_errors=True)


def run_drops(drops: int, gap_s: float, tmp: Path, fine: bool = False) -> None:
    work = Path(tempfile.mkdtemp(prefix="trainq-drops-", dir=tmp))
    q = Queue.create(work / "q")
    names = [f"d-{i:05d}" for i in range(drops)]
    for name in names:
        q.stage(f"{name}.yaml", job_yaml(["true"]))
    stamps, watcher = _stamped_watcher(work, q, fine)
    dropped_at = []
    try:
        wait_until(lambda: (read_status(q.root) or {}).get("watcher", {}).get("pid") == watcher.pid, 60, what="ready")
        for name in names:
            time.sleep(gap_s)
            dropped_at.append(time.perf_counter())
            q.drop_staged(f"{name}.yaml")
            wait_until(lambda: q.job_dir("done", name).is_dir(), 30, interval_s=0.002, what=f"{name} done")
    finally:
        watcher.send_signal(signal.SIGTERM)
        watcher.wait(60)
    time.sleep(0.5)
    found = _stamps(stamps)
    segments = drop_path(found, watcher.pid, dropped_at)
    print(
        f"{drops} drops one at a time, {gap_s:g} s of quiet before each; load average at the end: "
        f"{os.getloadavg()[0]:.2f}\n"
    )
    _segment_table("segment of the drop's path", DROP_SEGMENTS, segments, ("drop → exec", "drop → exec", "drops"))
    passes = segments.get("passes") or [0.0]
    print(f"\npasses from the drop to the launch, median: {statistics.median(passes):g}\n")
    print("| process | step | median ms, wall | median ms, CPU | calls |\n|---|---|---|---|---|")
    for who, step, wall, cpu, calls in step_medians(found, watcher.pid):
        print(f"| {who} | {step} | {wall:.3f} | {cpu:.3f} | {calls} |")
    shutil.rmtree(work, ignore_errors=True)


def _sched_report(
    data: Path, stamps: dict[int, list], watcher_pid: int, jobs: int, window: tuple[float, float]
) -> None:
    """From ``perf sched timehist`` inside ``window``: CPU each kind of process ran, its waits for a CPU while
    runnable, and each CPU's idle time, per job."""
    out = subprocess.run(["perf", "sched", "timehist", "-i", str(data)], capture_output=True, text=True).stdout
    supervisors = {pid for pid in stamps if pid != watcher_pid}
    line = re.compile(r"^\s*([\d.]+)\s+\[(\d+)\]\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")
    ran: dict[str, float] = defaultdict(float)
    waited: dict[str, float] = defaultdict(float)
    idle: dict[str, float] = defaultdict(float)
    for text in out.splitlines():
        m = line.match(text)
        if not m:
            continue
        at, cpu, task, _wait, delay, run_ms = m.groups()
        if not window[0] <= float(at) <= window[1]:
            continue
        pid_match = re.search(r"\[(\d+)(?:/(\d+))?\]$", task)
        pid = int(pid_match.group(2) or pid_match.group(1)) if pid_match else -1
        if task.startswith("<idle>"):
            idle[f"CPU {int(cpu)}"] += float(run_ms)
            continue
        kind = (
            "watcher"
            if pid == watcher_pid
            else "pooled supervisors"
            if pid in supervisors
            else "jobs (true)"
            if task.startswith("true[")
            else None
        )
        if kind is not None:
            ran[kind] += float(run_ms)
            waited[kind] += float(delay)
    print("| from the scheduler (perf sched), per job | ms |\n|---|---|")
    for kind in ("watcher", "pooled supervisors", "jobs (true)"):
        print(f"| {kind}: ran | {ran[kind] / jobs:.3f} |")
        print(f"| {kind}: runnable, waiting for a CPU | {waited[kind] / jobs:.3f} |")
    for name in sorted(idle):
        print(f"| {name} idle | {idle[name] / jobs:.3f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--tmp", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp"))
    parser.add_argument("--sched", action="store_true", help="also record the scheduler with perf (root)")
    parser.add_argument("--drops", type=int, help="time N single drops (the latency row) instead of the cycle")
    parser.add_argument("--gap", type=float, default=0.0, help="seconds of quiet before each drop (--drops)")
    parser.add_argument("--fine", action="store_true", help="also time the steps inside the steps (intake, take...)")
    args = parser.parse_args(argv)
    if args.drops:
        run_drops(args.drops, args.gap, args.tmp, args.fine)
        return 0
    if args.sched and shutil.which("perf") is None:
        parser.error("--sched needs perf")
    run(args.jobs, args.tmp, args.sched, args.fine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
