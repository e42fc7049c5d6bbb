"""The soak (issue 23, Done-when): mixed jobs under random watcher SIGKILLs; nothing lost, doubled or orphaned.

About 2,000 jobs of every kind (plain, with on_finish hooks, sweeps, dependency chains, jobs stopped
while running, jobs that fail once and get a retry.flag, pending jobs whose job.yaml is edited,
pending jobs removed with ``trainq rm`` or ``rm -rf`` and their dependents) go through a real
watcher that a killer thread SIGKILLs at random moments (and restarts) at least ``--kills`` times.
Every job appends ``ID ATTEMPT WORD`` to a ledger and every hook ``ID STATUS`` to a hook ledger
(O_APPEND lines). At the end:

- lost: an expected job not in done/ or failed/ (or anything left in inbox/ pending/ running/);
- doubled: a job whose ledger lines exceed its expected attempts, or an attempt number seen twice;
- orphans: any process left that names the soak's folder, once the last watcher has stopped;
- hooks: each job's hook lines equal its conclusions (retried jobs conclude twice);
- retries: every retried job ended done on attempt 2; every edit ran the edited command; every
  removed job never ran, and its dependents ended as their after_policy says;
- tracebacks: no uncaught exception in any watcher, helper or supervisor (their stderr).

    nice .venv/bin/python bench/soak.py [--jobs 2000] [--kills 100] [--seed 23] [--tmp DIR]

Prints one JSON line; exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import PY, REPO, BenchError, Queue, WatcherProc, bench_env, kill_strays, load_average, strays

#: how long the whole soak may take before it gives up waiting (s)
DEADLINE_S = 3600.0


class Plan:
    """The jobs of one soak: their ids by kind and what each must end as."""

    def __init__(self, total: int, rng: random.Random, work: Path):
        self.rng, self.work = rng, work
        self.ledger, self.hooks, self.gates = work / "ledger", work / "hooks", work / "gates"
        self.gates.mkdir(exist_ok=True)
        n = max(1, total // 20)  # 5% each of stops, retries, edits, removals; 10% sweeps, 10% chains
        self.stops = [f"stop-{i:04d}" for i in range(n)]
        self.retries = [f"retry-{i:04d}" for i in range(n)]
        self.edits = [f"edit-{i:04d}" for i in range(n)]
        self.removed = [f"gone-{i:04d}" for i in range(n)]
        self.rm_ok = [f"needgone-{i:04d}" for i in range(n // 2)]
        self.rm_any = [f"anygone-{i:04d}" for i in range(n // 2)]
        self.sweeps = [f"sw-{i:03d}" for i in range(max(1, total // 40))]  # 4 jobs each
        self.chains = [[f"ch-{c:03d}-{j}" for j in range(5)] for c in range(max(1, total // 50))]
        used = 4 * n + 2 * (n // 2) + 4 * len(self.sweeps) + 5 * len(self.chains) + 2
        self.plain = [f"plain-{i:04d}" for i in range(max(0, total - used))]
        self.hooked = set(rng.sample(self.plain, len(self.plain) // 4)) | set(self.retries) | set(self.stops)

    def ids(self) -> list[str]:
        """Every job id expected in done/ or failed/ at the end (removed ones excluded)."""
        sweep_jobs = [f"{s}-{i}" for s in self.sweeps for i in range(1, 5)]
        chain_jobs = [j for chain in self.chains for j in chain]
        return (
            self.plain
            + self.stops
            + self.retries
            + self.edits
            + self.rm_ok
            + self.rm_any
            + sweep_jobs
            + chain_jobs
            + ["gate-edit", "gate-rm"]
        )

    def _cmd(self, word: str, extra: str = "", sleep_s: float | None = None) -> list[str]:
        nap = self.rng.choice([0, 0, 0.05, 0.2]) if sleep_s is None else sleep_s
        line = f'echo "$TRAINQ_JOB_ID $TRAINQ_ATTEMPT {word}" >> {self.ledger}'
        return ["sh", "-c", f"{line}; {extra}sleep {nap}"]

    def _hook(self) -> list[str]:
        return ["sh", "-c", f'echo "{{job_id}} {{status}}" >> {self.hooks}']

    def _gate(self, name: str) -> list[str]:
        return ["sh", "-c", f"while [ ! -e {self.gates / name} ]; do sleep 0.1; done"]

    def files(self) -> list[tuple[str, dict]]:
        """(file name, job mapping) in drop order: the gates and what waits on them first."""
        out = [("gate-edit.yaml", {"command": self._gate("edit")}), ("gate-rm.yaml", {"command": self._gate("rm")})]
        out += [(f"{j}.yaml", {"command": self._cmd("orig"), "after": ["gate-edit"]}) for j in self.edits]
        out += [(f"{j}.yaml", {"command": self._cmd("gone"), "after": ["gate-rm"]}) for j in self.removed]
        out += [
            (f"{j}.yaml", {"command": self._cmd("ok"), "after": [g]})
            for j, g in zip(self.rm_ok, self.removed, strict=False)
        ]
        out += [
            (f"{j}.yaml", {"command": self._cmd("any"), "after": [g], "after_policy": "any"})
            for j, g in zip(self.rm_any, self.removed[len(self.rm_ok) :], strict=False)
        ]
        rest = [(f"{j}.yaml", {"command": self._cmd("stop", sleep_s=60), "stop_grace": "1s"}) for j in self.stops]
        rest += [
            (f"{j}.yaml", {"command": self._cmd("retry", 'test "$TRAINQ_ATTEMPT" -ge 2 || exit 3; ')})
            for j in self.retries
        ]
        rest += [(f"{s}.yaml", {"command": self._cmd("sweep {i}"), "sweep": {"i": [1, 2, 3, 4]}}) for s in self.sweeps]
        for chain in self.chains:
            rest += [
                (f"{j}.yaml", {"command": self._cmd("chain"), **({"after": [chain[k - 1]]} if k else {})})
                for k, j in enumerate(chain)
            ]
        rest += [(f"{j}.yaml", {"command": self._cmd("plain")}) for j in self.plain]
        self.rng.shuffle(rest)
        for _name, job in out + rest:
            job["approved"] = True
        for name, job in out + rest:
            if name[:-5] in self.hooked:
                job["on_finish"] = self._hook()
        return out + rest


class Killer(threading.Thread):
    """SIGKILLs the watcher at random moments and starts a new one, until told to stop."""

    def __init__(self, root: Path, rng: random.Random):
        super().__init__(daemon=True)
        self.root, self.rng = root, rng
        self.kills = 0
        self.halt = threading.Event()
        self.lock = threading.Lock()
        self.watcher = WatcherProc(root).start()

    def run(self) -> None:
        self._ready()
        while not self.halt.wait(self.rng.uniform(0.2, 5.0)):  # a random moment of a working watcher's life
            with self.lock:
                self.watcher.kill()
                self.kills += 1
                self.watcher = WatcherProc(self.root).start()
            self._ready()

    def _ready(self) -> None:
        """Wait until the watcher has written status.json (recover() done), restarting one that exited."""
        while not self.halt.is_set():
            try:
                self.watcher.wait_ready(timeout_s=120)
                return
            except BenchError:
                self.watcher.kill()
                self.watcher = WatcherProc(self.root).start()

    def stop(self) -> WatcherProc:
        self.halt.set()
        self.join()
        return self.watcher


def _run(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _lines(path: Path) -> list[list[str]]:
    try:
        return [line.split() for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _drive(queue: Queue, plan: Plan, killer: Killer, kills: int, files: list) -> dict:
    """Drop the files in waves, stop, retry, edit and remove as the jobs get there, until the kills are done."""
    root, acted = queue.root, {"stopped": set(), "retried": set(), "edited": False, "removed": False}
    waves = [files[i : i + 100] for i in range(0, len(files), 100)]
    deadline = time.monotonic() + DEADLINE_S
    hooks_seen: Counter = Counter()
    failed_seen: dict[str, float] = {}
    while time.monotonic() < deadline:
        if waves:
            for name, job in waves.pop(0):
                queue.stage(name, json.dumps(job))
                queue.drop_staged(name)
        for job_id in plan.stops:
            if job_id not in acted["stopped"] and (root / "running" / job_id).is_dir():
                (root / "running" / job_id / "stop.flag").touch()
                acted["stopped"].add(job_id)
        hooks_seen = Counter(words[0] for words in _lines(plan.hooks))
        for job_id in plan.retries:  # after its first conclusion's hook ran (or 30 s), as a user would
            run = _run(root / "failed" / job_id / "run.json")
            if job_id in acted["retried"] or run.get("status") != "failed":
                continue
            failed_seen.setdefault(job_id, time.monotonic())
            if hooks_seen[job_id] >= 1 or time.monotonic() - failed_seen[job_id] > 30:
                (root / "failed" / job_id / "retry.flag").touch()
                acted["retried"].add(job_id)
        if not acted["edited"] and all((root / "pending" / j / "job.yaml").exists() for j in plan.edits):
            for job_id in plan.edits:
                spec = root / "pending" / job_id / "job.yaml"
                tmp = spec.with_name(".job.yaml.edit")
                tmp.write_text(json.dumps({"approved": True, "command": plan._cmd("edited"), "after": ["gate-edit"]}))
                os.rename(tmp, spec)
            (plan.gates / "edit").touch()
            acted["edited"] = True
        if not acted["removed"] and all((root / "pending" / j / "job.yaml").exists() for j in plan.removed):
            half = len(plan.removed) // 2
            subprocess.run(
                [PY, "-m", "trainq.watcher", "--root", str(root), "rm", *plan.removed[:half]],
                cwd=REPO,
                env=bench_env(),
                capture_output=True,
                timeout=300,
            )
            for job_id in plan.removed[half:]:
                shutil.rmtree(root / "pending" / job_id, ignore_errors=True)
            (plan.gates / "rm").touch()
            acted["removed"] = True
        done = not waves and acted["edited"] and acted["removed"] and len(acted["retried"]) == len(plan.retries)
        if done and killer.kills >= kills:
            break
        time.sleep(0.2)
    return acted


def _settle(queue: Queue, plan: Plan, timeout_s: float) -> None:
    """Wait until nothing is left to do: inbox, pending and running empty, every expected job ended."""
    expected = plan.ids()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if queue.count("inbox") == queue.count("pending") == queue.count("running") == 0:
            ended = {p.name for s in ("done", "failed") for p in (queue.root / s).iterdir()}
            if all(j in ended for j in expected):
                deadline = min(deadline, time.monotonic() + 60)  # then at most a minute for the last hooks
                hooks = Counter(w[0] for w in _lines(plan.hooks))
                if sum(hooks.values()) >= len(plan.hooked) + len(plan.retries):
                    return
        time.sleep(0.5)


def _verify(queue: Queue, plan: Plan) -> dict:
    root = queue.root
    where = {p.name: s for s in ("done", "failed") for p in (root / s).iterdir()}
    expected = plan.ids()
    runs = _lines(plan.ledger)
    ran = Counter(words[0] for words in runs)
    attempts = Counter((words[0], words[1]) for words in runs)
    hooks = Counter(words[0] for words in _lines(plan.hooks))
    wanted_runs = {j: 1 for j in expected}
    wanted_runs.update({j: 2 for j in plan.retries})
    wanted_runs.update({j: 0 for j in ("gate-edit", "gate-rm", *plan.rm_ok)})  # gates write no line; rm_ok fail
    conclusions = {j: (2 if j in plan.retries else 1) for j in plan.hooked}
    lost = [j for j in expected if j not in where] + [
        p.name for s in ("inbox", "pending", "running") for p in (root / s).iterdir() if not p.name.startswith(".")
    ]
    status = {j: _run(root / where[j] / j / "run.json").get("status") for j in where}
    problems = {
        "lost": lost,
        "doubled": sorted(
            {j for (j, _a), n in attempts.items() if n > 1} | {j for j, n in ran.items() if n > wanted_runs.get(j, 0)}
        ),
        "never_ran": [j for j in expected if wanted_runs[j] and j not in plan.stops and ran[j] < wanted_runs[j]],
        "hooks_wrong": {j: hooks[j] for j in plan.hooked if hooks[j] != conclusions[j]},
        "retries_not_honoured": [j for j in plan.retries if status.get(j) != "done"],
        "edits_lost": [j for j in plan.edits if not any(w[0] == j and w[2:] == ["edited"] for w in runs)],
        "removed_ran": [j for j in plan.removed if ran[j]],
        "removed_wrong": [j for j in plan.rm_ok if status.get(j) != "failed"]
        + [j for j in plan.rm_any if status.get(j) != "done"],
        "stops_wrong": [j for j in plan.stops if status.get(j) != "cancelled"],
        "rejected": [j for j, s in status.items() if s == "rejected"],
        "tracebacks": _tracebacks(root.parent / "watcher.stderr"),
    }
    return {k: v for k, v in problems.items() if v}


def _tracebacks(stderr: Path) -> dict[str, int]:
    """Uncaught exceptions the watchers, helpers and supervisors printed (their stderr goes to one file): the
    exception's line, how often. A SIGKILL prints nothing; a helper dying of an exception (the soak of 2026-12-07
    found one, 29 times, that no job-level check saw: the watcher fell back to forking supervisors itself) does."""
    try:
        lines = stderr.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return {}
    found: Counter = Counter()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            end = next((t for t in lines[i + 1 :] if t and not t.startswith((" ", "\t"))), "(cut off)")
            found[end[:200]] += 1
    return dict(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--tmp", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="trainq-soak-", dir=args.tmp))
    queue = Queue.create(work, {"max_concurrent": 8, "rescan_s": 0.5, "settle_s": 0.1})
    plan = Plan(args.jobs, rng, work)
    files = plan.files()
    started = time.monotonic()
    killer = Killer(queue.root, rng)
    killer.start()
    try:
        acted = _drive(queue, plan, killer, args.kills, files)
        last = killer.stop()
        _settle(queue, plan, DEADLINE_S)
        last.stop()
        time.sleep(1.0)
        orphans = [p.pid for p in strays(work)]
        problems = _verify(queue, plan)
    finally:
        killer.halt.set()
        kill_strays(work)
    result = {
        "jobs": len(plan.ids()) + len(plan.removed),
        "files": len(files),
        "kills": killer.kills,
        "stopped": len(acted["stopped"]),
        "retried": len(acted["retried"]),
        "edits": len(plan.edits),
        "removed": len(plan.removed),
        "hooked": len(plan.hooked),
        "orphans": orphans,
        "problems": {k: (v[:10] if isinstance(v, list) else dict(list(v.items())[:10])) for k, v in problems.items()},
        "problem_counts": {k: len(v) for k, v in problems.items()},
        "wall_s": round(time.monotonic() - started, 1),
        "load_average": [round(x, 2) for x in load_average()],
    }
    print(json.dumps(result))
    if not problems and not orphans:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept {work} for a look", file=sys.stderr)
    return 0 if not problems and not orphans else 1


if __name__ == "__main__":
    raise SystemExit(main())
