"""Run every trainq benchmark in one go, peers in the same run, and print the README's table.

    .venv/bin/python bench/run_all.py [--quick] [--only NAME[,NAME]] [--count N] [--out DIR] [--profile]

Writes ``OUT/latest.md`` (the table) and ``OUT/latest.json`` (every raw figure); OUT defaults to
bench/results/. ``--quick`` shrinks every count; ``--count`` overrides the main count of each chosen
section (drops, jobs, files, runs or seconds); ``--profile`` runs the queue sections' watchers under
cProfile and writes ``OUT/profile-*.txt``. Sections: latency, throughput, burst, idle, help, stop,
readopt, status, trainer, probes, sweep, widesweep. Exit status 0 when every section ran (goals met or not), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_queue, bench_sweep
from bench._common import PY, REPO, Row, bench_env, load_average, remove_workspaces, spread_out
from trainq.watcher.spec.fsutil import atomic_write

logger = logging.getLogger("bench")

RESULTS = REPO / "bench" / "results"
HEADER = ["metric", "trainq", "peer / floor", "goal", "met?"]


@dataclass(frozen=True)
class Section:
    """A named benchmark: the function to call and its counts, full and quick (the first count is the main one)."""

    name: str
    run: Callable[..., list[Row]]
    full: dict
    quick: dict


def _bench_trainer(base: Path, quick: bool, profile_dir: Path | None = None) -> list[Row]:
    """Section 8: bench/bench_trainer.py as a subprocess, its markdown folded into rows."""
    del base, profile_dir
    argv = [PY, str(REPO / "bench" / "bench_trainer.py")] + (["--quick"] if quick else [])
    done = subprocess.run(argv, cwd=REPO, env=bench_env(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"bench_trainer.py exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return trainer_rows(done.stdout)


#: bench_trainer.py's overhead runners: trainq with its defaults (packing on) first
TRAINER_RUNNERS = (
    "trainq (defaults: packing on)",
    "plain Trainer + DataCollatorWithFlattening",
    "plain Trainer, padded",
    "trainq, packing off",
    "bare loop, padded",
)
#: its packing runners
PACKING_RUNNERS = ("trainq, packed", "plain Trainer + DataCollatorWithFlattening", "plain Trainer, padded")


def _tables(text: str) -> list[dict[str, dict]]:
    """Each 8-column runner table of bench_trainer.py: runner -> {tokens, train_s, cpu_s, whole_s} (in order)."""
    tables: list[dict[str, dict]] = []
    current: dict[str, dict] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] in TRAINER_RUNNERS + PACKING_RUNNERS:
            current[cells[0]] = {
                "tokens": float(cells[1]),
                "train_s": float(cells[2]),
                "cpu_s": float(cells[3]),
                "whole_s": float(cells[7]),
            }
        elif current and not line.startswith("|"):
            tables.append(current)
            current = {}
    return tables + ([current] if current else [])


def _per_cpu(r: dict) -> float:
    return r["tokens"] / r["cpu_s"]


def trainer_rows(text: str) -> list[Row]:
    """Rows from bench_trainer.py's output: the overhead table (defaults, packing on), the packing table (against a
    plain Trainer with DataCollatorWithFlattening and with padding; real tokens per CPU-second) and the stop line."""
    tables = _tables(text)
    over = next((t for t in tables if all(r in t for r in TRAINER_RUNNERS)), None)
    if over is None:
        raise RuntimeError(f"bench_trainer.py output has no runner table: {text.strip()[-300:]}")
    title = next((line.strip() for line in text.splitlines() if "LoRA steps" in line), "LoRA steps")
    load = re.search(r"load average ([\d. ]+) before", title)
    steps = title.split()[0]
    ours, flat, padded, off, bare = (over[r] for r in TRAINER_RUNNERS)
    rows = [
        Row(
            "trainer",
            f"8. trainer: {steps} LoRA steps with the defaults (packing on), training wall time",
            f"{ours['train_s']:.2f} s",
            f"plain Trainer + flattening {flat['train_s']:.2f} s, padded "
            f"{padded['train_s']:.2f} s, bare loop {bare['train_s']:.2f} s",
            "—",
            None,
            {"title": title, "load_average": load.group(1).strip() if load else None, "runners": over},
        ),
        Row(
            "trainer",
            "8. trainer: real tokens per CPU-second vs plain Trainer + flattening / padded",
            f"{_per_cpu(ours) / _per_cpu(flat):.2f}× / {_per_cpu(ours) / _per_cpu(padded):.2f}×",
            f"trainq packing off vs plain padded {_per_cpu(off) / _per_cpu(padded):.2f}×",
            "—",
            None,
        ),
        Row(
            "trainer",
            "8. trainer: whole process (imports, load, train, save) vs plain Trainer + flattening",
            f"{ours['whole_s']:.2f} s ({ours['whole_s'] / flat['whole_s']:.2f}×)",
            f"plain Trainer + flattening {flat['whole_s']:.2f} s, bare loop {bare['whole_s']:.2f} s",
            "—",
            None,
        ),
    ]
    pack = next((t for t in tables if all(r in t for r in PACKING_RUNNERS) and "trainq, packed" in t), None)
    if pack:
        packed = pack["trainq, packed"]
        rows.append(
            Row(
                "trainer",
                "8. trainer: packing, real tokens per CPU-second vs plain Trainer + "
                "DataCollatorWithFlattening / padded",
                f"{_per_cpu(packed) / _per_cpu(pack['plain Trainer + DataCollatorWithFlattening']):.2f}× / "
                f"{_per_cpu(packed) / _per_cpu(pack['plain Trainer, padded']):.2f}×",
                f"wall: {packed['train_s']:.2f} s vs {pack['plain Trainer + DataCollatorWithFlattening']['train_s']:.2f} s"
                f" / {pack['plain Trainer, padded']['train_s']:.2f} s",
                "—",
                None,
                {"runners": pack},
            )
        )
    stop = re.search(r"\|\s*stop latency[^|]*\|\s*([\d.]+) s\s*\|\s*checkpoint complete: (\w+)", text)
    if stop:
        complete = stop.group(2) == "True"
        rows.append(
            Row(
                "trainer",
                "8. trainer: stop.flag touched → process exited",
                f"{float(stop.group(1)):.2f} s",
                f"checkpoint complete: {'yes' if complete else 'no'}",
                "complete checkpoint",
                complete,
                {"stop_s": float(stop.group(1))},
            )
        )
    return rows


def _bench_probes(base: Path, seconds: float, calls: int, profile_dir: Path | None = None) -> list[Row]:
    """Section 9: bench/bench_probes.py as a subprocess (short loops), its JSON folded into rows."""
    del base, profile_dir
    argv = [PY, str(REPO / "bench" / "bench_probes.py"), "--seconds", f"{seconds:g}", "--calls", str(calls)]
    done = subprocess.run(argv, cwd=REPO, env=bench_env(), capture_output=True, text=True, timeout=seconds * 3 + 600)
    if done.returncode != 0:
        raise RuntimeError(f"bench_probes.py exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return probe_rows(json.loads(done.stdout))


def probe_rows(data: dict) -> list[Row]:
    """Rows from bench_probes.py's JSON: CPU share at one sample a second, µs per tick."""
    baseline = data["baseline_cpu_pct"]
    rows = []
    for name, figures in data.items():
        if not isinstance(figures, dict) or "cpu_pct_at_1hz" not in figures:
            continue
        rows.append(
            Row(
                "probes",
                f"9. resource probes at 1 Hz, {name}: CPU share ({data['seconds']:g} s)",
                f"{figures['cpu_pct_at_1hz']:.2f} % ({figures['tick_us']:.0f} µs/tick)",
                f"sleep-only loop {baseline:.2f} %",
                "—",
                None,
                {name: figures, "baseline_cpu_pct": baseline},
            )
        )
    return rows


SECTIONS = [
    Section("latency", bench_queue.bench_latency, {"drops": 200}, {"drops": 20}),
    Section("throughput", bench_queue.bench_throughput, {"jobs": 500, "runs": 3}, {"jobs": 100, "runs": 1}),
    Section("burst", bench_queue.bench_burst, {"files": 10_000}, {"files": 1_000}),
    Section("idle", bench_queue.bench_idle, {"seconds": 60.0}, {"seconds": 20.0}),
    Section("help", bench_queue.bench_help, {"runs": 10}, {"runs": 3}),
    Section("stop", bench_queue.bench_stop, {"drops": 20, "ignoring": 3}, {"drops": 5, "ignoring": 1}),
    Section(
        "readopt",
        bench_queue.bench_loaded,
        {"jobs": 50, "reads": 2000, "poll_s": 10.0},
        {"jobs": 10, "reads": 200, "poll_s": 3.0},
    ),
    Section(
        "status",
        bench_queue.bench_loaded,
        {"jobs": 50, "reads": 2000, "poll_s": 10.0},
        {"jobs": 10, "reads": 200, "poll_s": 3.0},
    ),
    Section("trainer", _bench_trainer, {"quick": False}, {"quick": True}),
    Section("probes", _bench_probes, {"seconds": 10.0, "calls": 1000}, {"seconds": 2.0, "calls": 200}),
    Section("sweep", bench_sweep.bench_sweep, {"variants": 1000, "seconds": 20.0}, {"variants": 200, "seconds": 3.0}),
    Section("widesweep", bench_sweep.bench_wide_sweep, {"keys": 9000}, {"keys": 1000}),
]
BY_NAME = {s.name: s for s in SECTIONS}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts (smoke test, CI sanity)")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME[,NAME]",
        help=f"run only these sections (repeatable): {', '.join(BY_NAME)}",
    )
    parser.add_argument("--count", type=int, help="override the main count of every chosen section")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="where latest.md/latest.json go (default bench/results)"
    )
    parser.add_argument("--tmp", type=Path, default=Path("/tmp"), help="where temp workspaces go (default /tmp)")
    parser.add_argument(
        "--no-spread",
        action="store_true",
        help="do not chattr +T the run's folder: workspaces then land next to recently deleted "
        "files, which on a journal-less ext4 slows every file creation (trainq's and peers')",
    )
    parser.add_argument("--profile", action="store_true", help="run the queue sections' watchers under cProfile")
    args = parser.parse_args(argv)
    names = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    args.sections = [s for s in SECTIONS if not names or s.name in names]
    return args


def section_kwargs(section: Section, quick: bool, count: int | None) -> dict:
    """The section's counts for this run; ``count`` replaces the first (main) one."""
    kwargs = dict(section.quick if quick else section.full)
    first = next(iter(kwargs))
    if count is not None and not isinstance(kwargs[first], bool):
        kwargs[first] = type(kwargs[first])(count)
    return kwargs


def run_sections(args: argparse.Namespace) -> tuple[list[Row], dict]:
    """Run each chosen section once (readopt and status share a run); rows in section order, and per-section facts."""
    rows: list[Row] = []
    facts: dict = {}
    outcomes: dict[Callable, list[Row] | Exception] = {}
    profile_dir = args.out if args.profile else None
    for section in args.sections:
        load = load_average()
        started = time.monotonic()
        if section.run not in outcomes:
            print(f"bench: {section.name} (load {load[0]:.2f}) ...", file=sys.stderr, flush=True)
            outcomes[section.run] = _run_one(section, args, profile_dir)
        outcome = outcomes[section.run]
        error = str(outcome) if isinstance(outcome, Exception) else None
        facts[section.name] = {"load_at_start": load, "seconds": time.monotonic() - started, "error": error}
        if error is not None:
            rows.append(Row(section.name, f"{section.name}: FAILED", error.splitlines()[0][:200], met=False))
        else:
            rows.extend(r for r in outcome if r.section == section.name)
    return rows, facts


def _run_one(section: Section, args: argparse.Namespace, profile_dir: Path | None) -> list[Row] | Exception:
    """The section's rows, or the exception that stopped it (one broken section must not lose the others)."""
    try:
        return section.run(args.tmp, **section_kwargs(section, args.quick, args.count), profile_dir=profile_dir)
    except Exception as exc:
        logger.exception("bench %s failed", section.name)
        return exc


def render(rows: list[Row], meta: dict) -> str:
    """The markdown table with a note on the machine and its load."""
    load0, load1 = meta["load_start"], meta["load_end"]
    lines = [
        f"Measured {meta['date']} on {meta['cpus']} CPU(s), Python {meta['python']}, mode {meta['mode']}; "
        f"load average (1/5/15 min) {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f} at start, "
        f"{load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f} at end (other work on the machine disturbs the figures)"
        + _section_loads(meta.get("section_loads") or {})
        + f". Command: `{meta['command']}`.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row.cells()) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _section_loads(loads: dict[str, float]) -> str:
    """``; 1-min load at each section's start: latency 0.41, throughput 0.52`` (empty without sections)."""
    if not loads:
        return ""
    return "; 1-min load at each section's start: " + ", ".join(f"{name} {load:.2f}" for name, load in loads.items())


def write_profiles(out: Path) -> None:
    """Top functions by cumulative and own time, from each watcher-*.prof cProfile wrote."""
    for prof in sorted(out.glob("watcher-*.prof")):
        with open(out / f"profile-{prof.stem.removeprefix('watcher-')}.txt", "w", encoding="utf-8") as f:
            stats = pstats.Stats(str(prof), stream=f).strip_dirs()
            stats.sort_stats("cumulative").print_stats(30)
            stats.sort_stats("tottime").print_stats(20)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.tmp.mkdir(parents=True, exist_ok=True)
    args.tmp = Path(tempfile.mkdtemp(prefix="trainq-bench-", dir=args.tmp))  # this run's, removed at its end
    if not args.no_spread:
        spread_out(args.tmp)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mode": "quick" if args.quick else "full",
        "load_start": load_average(),
        "command": " ".join(["bench/run_all.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    try:
        rows, facts = run_sections(args)
    finally:
        remove_workspaces()
        shutil.rmtree(args.tmp, ignore_errors=True)
    meta["load_end"] = load_average()
    meta["section_loads"] = {name: f["load_at_start"][0] for name, f in facts.items()}
    table = render(rows, meta)
    print(table)
    atomic_write(args.out / "latest.md", table)
    atomic_write(
        args.out / "latest.json",
        json.dumps({**meta, "sections": facts, "rows": [r.to_dict() for r in rows]}, indent=1, default=str) + "\n",
    )
    if args.profile:
        write_profiles(args.out)
    return 1 if any(f["error"] for f in facts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
