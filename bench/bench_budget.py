"""Per-job budget of one trivial job (issue 38, item 1): syscalls, writes, fsyncs, renames, forks, opens, CPU.

``python bench/bench_budget.py [--jobs 50] [--detail]`` runs N × ``true`` serially through trainq (the watcher and
its whole helper tree: spawner, pooled supervisors), nq and task-spooler, each under ``strace -f`` with the queue
idle before and after, and prints one markdown row per tool, per job:

* trainq: strace attaches to every process of the running watcher's tree (``-f`` follows the supervisors it
  forks later); the jobs are renamed into inbox/ from this process (the user's side, not counted). The same tree
  is then traced for the same number of seconds with nothing to do, and that idle count is subtracted.
* nq: a bash loop of ``nq -q true`` then ``nq -w``, traced with ``-f``; the loop shell's own syscalls are left
  out (its forks included: each ``nq`` is the queue). nq has no daemon, so no idle baseline.
* task-spooler: the server (``tsp -S 1``) traced by attaching, plus the loop of ``tsp true`` clients and the final
  ``tsp -w`` as for nq; the idle server is traced for the same seconds and subtracted.

Counts do not depend on the load (except where a process coalesces by time: trainq's status.json); CPU does, and
strace inflates it, so CPU ms comes from a second, untraced run: the tree's user+system time (reaped children
included) over the run, less the idle tree's for the same seconds. The load average is printed with the table.
``--detail`` also prints, for trainq, fsyncs, writes, renames and created files grouped by file (job ids and temp
suffixes folded), the map of where its budget goes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from bench._common import Queue, bench_env, job_yaml, running_watcher, tree_cpu_split, wait_until

#: seconds of idle queue before the first drop and after the last job finishes
IDLE_S = 1.0
WRITES = {"write", "pwrite64", "writev", "pwritev", "pwritev2"}
FSYNCS = {"fsync", "fdatasync", "sync_file_range"}
RENAMES = {"rename", "renameat", "renameat2"}
FORKS = {"fork", "vfork", "clone", "clone3"}
EXECS = {"execve", "execveat"}
OPENS = {"open", "openat", "openat2", "creat"}
COLUMNS = (
    "syscalls",
    "writes",
    "to files",
    "files created",
    "fsyncs",
    "renames",
    "forks",
    "execs",
    "failed execs",
    "opens",
)

_LINE = re.compile(r"^(\d+)\s+([a-z_0-9]+)\((.*)$")
_RESUMED = re.compile(r"^(\d+)\s+<\.\.\. [a-z_0-9]+ resumed>(.*)$")


@dataclass
class Trace:
    """Counts from one ``strace -f -y -o`` log (per-pid logs merged); ``files`` groups by path for --detail."""

    counts: Counter = field(default_factory=Counter)
    by_call: Counter = field(default_factory=Counter)
    files: Counter = field(default_factory=Counter)

    def add(self, path: Path, skip_pids: set[int] = frozenset()) -> Trace:
        for pid, call, rest in _calls(path):
            if pid in skip_pids:
                continue  # the loop shell
            self.counts["syscalls"] += 1
            self.by_call[call] += 1
            failed = re.search(r"\)\s+=\s+-1 ", rest) is not None
            target = _first_path(rest)
            if call in WRITES:
                self.counts["writes"] += 1
                if target and target.startswith("/"):
                    self.counts["to files"] += 1
                    self.files[("write", _fold(target))] += 1
            elif call in FSYNCS:
                self.counts["fsyncs"] += 1
                self.files[("fsync", _fold(target or "?"))] += 1
            elif call in RENAMES:
                self.counts["renames"] += 1
                paths = re.findall(r'"([^"]*)"', rest)
                self.files[("rename", " -> ".join(_fold(p) for p in paths[:2]))] += 1
            elif call in FORKS:
                self.counts["forks"] += 1
            elif call in EXECS:
                self.counts["execs" if not failed else "failed execs"] += 1
            elif call in OPENS:
                self.counts["opens"] += 1
                if "O_CREAT" in rest and not failed:
                    self.counts["files created"] += 1
                    name = re.search(r'"([^"]*)"', rest)
                    self.files[("create", _fold(name.group(1) if name else "?"))] += 1
            elif call in {"mkdir", "mkdirat"} and not failed:
                self.files[("mkdir", _fold((re.findall(r'"([^"]*)"', rest) or ["?"])[0]))] += 1
        return self

    def minus(self, other: Trace, scale: float) -> Trace:
        out = Trace()
        for name in (*COLUMNS,):
            out.counts[name] = self.counts[name] - other.counts[name] * scale
        for key, n in self.by_call.items():
            out.by_call[key] = n - other.by_call[key] * scale
        for key, n in self.files.items():
            out.files[key] = n - other.files[key] * scale
        return out


def _calls(path: Path) -> Iterator[tuple[int, str, str]]:
    """(pid, syscall, arguments and result) per call, "<unfinished ...>" joined to its "<... resumed>" line."""
    pending: dict[int, tuple[str, str]] = {}
    for line in path.read_text(errors="replace").splitlines():
        m = _RESUMED.match(line)
        if m:
            pid = int(m.group(1))
            if pid in pending:
                call, head = pending.pop(pid)
                yield pid, call, head + m.group(2)
            continue
        m = _LINE.match(line)
        if not m:
            continue  # "+++ exited", "--- SIG..."
        pid, call, rest = int(m.group(1)), m.group(2), m.group(3)
        if rest.endswith("<unfinished ...>"):
            pending[pid] = (call, rest[: -len("<unfinished ...>")])
        else:
            yield pid, call, rest
    for pid, (call, head) in pending.items():  # never resumed (the process died in the call, or detach)
        yield pid, call, head


def _first_path(rest: str) -> str | None:
    """The path strace -y shows for the first fd argument (``5</a/b>``), or the first quoted path."""
    m = re.match(r"\d+<([^>]*)>", rest)
    return m.group(1) if m else None


def _fold(path: str) -> str:
    """A path with the queue root, job ids, pids and temp suffixes folded, so 50 jobs group into one line."""
    path = re.sub(r"^.*/queue/", "ROOT/", path)
    path = re.sub(r"/t-\d{4}(\.yaml)?", r"/JOB\1", path)
    path = re.sub(r"\d{3,}", "N", path)
    path = re.sub(r"\.tmp[.\w-]*$|\.[A-Za-z0-9_]{6,}\.tmp$", ".tmp*", path)
    return path


def _strace(out: Path, pids: list[int] | None = None, argv: list[str] | None = None, **kw) -> subprocess.Popen:
    """strace -f -y over pids (attach) or a command; every syscall logged to ``out``."""
    cmd = ["strace", "-f", "-y", "-qq", "-s", "120", "-o", str(out)]
    for pid in pids or ():
        cmd += ["-p", str(pid)]
    return subprocess.Popen(cmd + (argv or []), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)


def _detach(tracer: subprocess.Popen) -> None:
    tracer.send_signal(signal.SIGINT)  # strace detaches and flushes its log
    tracer.wait(timeout=60)


def _tree(pid: int) -> list[int]:
    proc = psutil.Process(pid)
    return [proc.pid, *(c.pid for c in proc.children(recursive=True))]


def _tree_cpu(pid: int) -> float:
    """User+system seconds of a process tree: every live process plus the children each has reaped."""
    total = 0.0
    for p in _tree(pid):
        try:
            t = psutil.Process(p).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _attached(tracer: subprocess.Popen, out: Path) -> None:
    """Give strace time to attach before the measured window starts (it logs nothing until then)."""
    time.sleep(0.5)
    if tracer.poll() is not None:
        raise SystemExit(f"strace exited with {tracer.returncode}; log {out}")


# -- trainq ---------------------------------------------------------------------------------------
def trainq(work: Path, jobs: int) -> tuple[Trace, float, dict[str, float]]:
    """(per-job counts, per-job CPU seconds, per-job CPU seconds by depth in the tree)."""
    q = Queue.create(work / "traced", {"max_concurrent": 1})
    names = [f"t-{i:04d}.yaml" for i in range(jobs)]
    for name in names:
        q.stage(name, job_yaml(["true"]))
    with running_watcher(q.root) as watcher:
        time.sleep(2.0)  # start-up done, pool warm
        log = work / "trainq-run.strace"
        tracer = _strace(log, _tree(watcher.pid))
        _attached(tracer, log)
        start = time.monotonic()
        _run_trainq(q, names)
        window = time.monotonic() - start
        _detach(tracer)
        idle_log = work / "trainq-idle.strace"
        tracer = _strace(idle_log, _tree(watcher.pid))
        _attached(tracer, idle_log)
        time.sleep(window)
        _detach(tracer)
    run, idle = Trace().add(log), Trace().add(idle_log)
    per_job = _per_job(run.minus(idle, 1.0), jobs)

    q = Queue.create(work / "untraced", {"max_concurrent": 1})
    for name in names:
        q.stage(name, job_yaml(["true"]))
    with running_watcher(q.root) as watcher:
        time.sleep(2.0)
        cpu0, split0 = _tree_cpu(watcher.pid), tree_cpu_split(watcher.pid)
        start = time.monotonic()
        _run_trainq(q, names)
        window = time.monotonic() - start
        cpu1, split1 = _tree_cpu(watcher.pid), tree_cpu_split(watcher.pid)
        time.sleep(window)
        cpu2, split2 = _tree_cpu(watcher.pid), tree_cpu_split(watcher.pid)
    cpu = ((cpu1 - cpu0) - (cpu2 - cpu1)) / jobs
    split = {k: ((split1[k] - split0[k]) - (split2[k] - split1[k])) / jobs for k in split1}
    return per_job, cpu, split


def _run_trainq(q: Queue, names: list[str]) -> None:
    time.sleep(IDLE_S)
    for name in names:
        q.drop_staged(name)
    wait_until(lambda: q.count("done") + q.count("failed") >= len(names), 600, interval_s=0.02, what="jobs to finish")
    if q.count("failed"):
        raise SystemExit(f"trainq: {q.count('failed')} trivial jobs failed; see {q.root}/failed")
    time.sleep(IDLE_S)


# -- nq -------------------------------------------------------------------------------------------
def nq(work: Path, jobs: int) -> tuple[Trace, float]:
    script = f"sleep {IDLE_S}; for i in $(seq {jobs}); do nq -q true; done; nq -w; sleep {IDLE_S}"
    traces = []
    for name in ("traced", "untraced"):
        d = work / f"nq-{name}"
        d.mkdir()
        env = bench_env(NQDIR=str(d))
        log = work / "nq.strace"
        argv = ["bash", "-c", script]
        if name == "traced":
            proc = _strace(log, argv=argv, env=env, cwd=d)
            proc.wait(timeout=600)
            traces.append(Trace().add(log, _loop_shell(log)))
        else:
            before = os.times()
            subprocess.run(argv, env=env, cwd=d, check=True, timeout=600, stdout=subprocess.DEVNULL)
            after = os.times()
            # bash's own CPU is in there too: small against N nq processes; said in the docs
            cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
        if sum(1 for n in os.listdir(d) if n.startswith(",")) != jobs:
            raise SystemExit(f"nq: expected {jobs} job logs in {d}")
    return _per_job(traces[0], jobs), cpu / jobs


def _loop_shell(log: Path) -> set[int]:
    """The pid of the traced ``bash -c`` loop: the first pid in the log."""
    first = log.read_text(errors="replace").split(None, 1)[0]
    return {int(first)}


# -- task-spooler ---------------------------------------------------------------------------------
def tsp(work: Path, jobs: int) -> tuple[Trace, float]:
    loop = f"for i in $(seq {jobs}); do tsp true; done; tsp -w"
    result: list[Trace] = []
    cpu = 0.0
    for name in ("traced", "untraced"):
        d = work / f"tsp-{name}"
        d.mkdir()
        env = bench_env(TS_SOCKET=str(d / "ts.sock"), TS_MAXFINISHED=str(jobs + 10), TMPDIR=str(d))
        quiet = {"env": env, "cwd": d, "timeout": 600, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        subprocess.run(["tsp", "-S", "1"], check=True, **quiet)
        server = _tsp_server(d / "ts.sock")
        try:
            if name == "traced":
                slog, clog = work / "tsp-server.strace", work / "tsp-clients.strace"
                tracer = _strace(slog, [server])
                _attached(tracer, slog)
                start = time.monotonic()
                time.sleep(IDLE_S)
                client = _strace(clog, argv=["bash", "-c", loop], env=env, cwd=d)
                client.wait(timeout=600)
                time.sleep(IDLE_S)
                window = time.monotonic() - start
                _detach(tracer)
                ilog = work / "tsp-idle.strace"
                tracer = _strace(ilog, [server])
                _attached(tracer, ilog)
                time.sleep(window)
                _detach(tracer)
                run = Trace().add(slog).add(clog, _loop_shell(clog))
                result.append(run.minus(Trace().add(ilog), 1.0))
            else:
                s0 = _tree_cpu(server)
                time.sleep(IDLE_S)
                before = os.times()
                start = time.monotonic()
                subprocess.run(["bash", "-c", loop], check=True, **quiet)
                after = os.times()
                time.sleep(IDLE_S)
                window = time.monotonic() - start
                s1 = _tree_cpu(server)
                time.sleep(window)
                s2 = _tree_cpu(server)
                clients = (after.children_user - before.children_user) + (
                    after.children_system - before.children_system
                )
                cpu = ((s1 - s0) - (s2 - s1) + clients) / jobs
            listing = subprocess.run(["tsp", "-l"], env=env, capture_output=True, text=True, timeout=60).stdout
            if sum(1 for line in listing.splitlines() if " finished " in line) != jobs:
                raise SystemExit(f"tsp: expected {jobs} finished jobs:\n{listing}")
        finally:
            subprocess.run(["tsp", "-K"], **quiet)
    return _per_job(result[0], jobs), cpu


def _tsp_server(sock: Path) -> int:
    """The pid of the task-spooler server listening on ``sock`` (the one process with it in its environment)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for p in psutil.process_iter(["name"]):
            try:
                if p.info["name"] in {"tsp", "ts"} and p.environ().get("TS_SOCKET") == str(sock) and p.ppid() == 1:
                    return p.pid
            except psutil.Error:
                continue
        for p in psutil.process_iter(["name"]):  # not reparented to 1 (a subreaper): any tsp with the socket
            try:
                if p.info["name"] in {"tsp", "ts"} and p.environ().get("TS_SOCKET") == str(sock):
                    return p.pid
            except psutil.Error:
                continue
        time.sleep(0.05)
    raise SystemExit("task-spooler server not found")


# -- output ---------------------------------------------------------------------------------------
def _per_job(trace: Trace, jobs: int) -> Trace:
    out = Trace()
    for name in COLUMNS:
        out.counts[name] = trace.counts[name] / jobs
    for key, n in trace.by_call.items():
        out.by_call[key] = n / jobs
    for key, n in trace.files.items():
        out.files[key] = n / jobs
    return out


def _row(name: str, t: Trace, cpu_s: float) -> str:
    c = t.counts
    cells = [
        f"{c['syscalls']:.0f}",
        f"{c['writes']:.1f} ({c['to files']:.1f} to files)",
        f"{c['files created']:.1f}",
        f"{c['fsyncs']:.1f}",
        f"{c['renames']:.1f}",
        f"{c['forks']:.1f} + {c['execs']:.1f}"
        + (f" (+{c['failed execs']:.1f} failed)" if c["failed execs"] >= 0.05 else ""),
        f"{c['opens']:.1f}",
        f"{cpu_s * 1000:.2f}",
    ]
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=50, help="trivial jobs per tool (default 50)")
    parser.add_argument("--detail", action="store_true", help="also print trainq's budget grouped by file")
    parser.add_argument("--keep", action="store_true", help="keep the strace logs (path printed)")
    args = parser.parse_args()
    for tool in ("strace", "nq", "tsp"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} not found (apt-get install -y strace nq task-spooler)")
    load0 = os.getloadavg()
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    work = Path(tempfile.mkdtemp(prefix="trainq-bench-budget-"))
    try:
        tq, tq_cpu, tq_split = trainq(work, args.jobs)
        n, n_cpu = nq(work, args.jobs)
        s, s_cpu = tsp(work, args.jobs)
        load1 = os.getloadavg()
        print(f"{started}: `{' '.join(['bench/bench_budget.py', *sys.argv[1:]])}`, {args.jobs} × `true` per tool")
        print(f"load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end", end="")
        print(" (CPU ms is NOT a quiet-machine figure)" if max(load0[0], load1[0]) > 1 else "")
        print()
        print("| per job | syscalls | writes | files created | fsyncs | renames | forks + execs | opens | CPU ms |")
        print("|---|---|---|---|---|---|---|---|---|")
        print(_row("trainq (watcher + spawner + supervisors)", tq, tq_cpu))
        print(_row("nq (each `nq` + `nq -w`)", n, n_cpu))
        print(_row("task-spooler (server + `tsp` clients)", s, s_cpu))
        if args.detail:
            print("\ntrainq, per job, by file (net of idle; job ids, pids and temp suffixes folded):\n")
            for (kind, path), v in sorted(tq.files.items(), key=lambda kv: (kv[0][0], -kv[1])):
                if abs(v) >= 0.05:
                    print(f"  {kind:7s} {v:6.2f}  {path}")
            names = {"depth 0": "watcher (all threads)", "depth 1": "spawner", "depth 2": "pooled supervisors"}
            names["reaped"] = "reaped children (the jobs' `true`, any helper that exited)"
            print("\ntrainq, CPU ms per job by process (untraced run, net of idle):\n")
            for key, label in names.items():
                print(f"  {tq_split.get(key, 0.0) * 1000:6.2f}  {label}")
            print("\ntrainq, per job, by syscall (top 30):\n")
            for call, v in sorted(tq.by_call.items(), key=lambda kv: -kv[1])[:30]:
                print(f"  {call:20s} {v:7.1f}")
    finally:
        if args.keep:
            print(f"\nlogs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
