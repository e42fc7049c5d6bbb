"""The benchmark suite still runs and still prints its table: bench/run_all.py --quick on two cheap sections."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._common import Row  # noqa: E402
from bench.run_all import (  # noqa: E402
    BY_NAME,
    HEADER,
    Section,
    parse_args,
    probe_rows,
    run_sections,
    section_kwargs,
    trainer_rows,
)

#: a real bench_trainer.py output (abridged numbers), the format run_all.py folds into rows
TRAINER_OUTPUT = """
40 LoRA steps on the small tiny model (median of 1; OMP_NUM_THREADS=1; load average 1.0 0.8 0.5 before, 1.2 0.9 0.6 after)

| runner | real tokens | train s | train CPU s | real tokens/s (wall) | real tokens per CPU-s | vs trainq | whole process s |
|---|---|---|---|---|---|---|---|
| trainq (defaults: packing on) | 4000 | 2.00 | 2.00 | 2000 | 2000 | 1.00x | 9.10 |
| plain Trainer + DataCollatorWithFlattening | 4000 | 2.50 | 2.50 | 1600 | 1600 | 0.80x | 8.50 |
| plain Trainer, padded | 4000 | 4.00 | 4.00 | 1000 | 1000 | 0.50x | 8.60 |
| trainq, packing off | 4000 | 4.20 | 4.20 | 952 | 952 | 0.48x | 9.00 |
| bare loop, padded | 4000 | 3.80 | 3.80 | 1053 | 1053 | 0.53x | 7.90 |

| stop latency (flag touched -> exited) | 0.41 s | checkpoint complete: True |

| packing runner | real tokens | train s | train CPU s | real tokens/s (wall) | real tokens per CPU-s | trainq packed vs it | whole process s |
|---|---|---|---|---|---|---|---|
| trainq, packed | 9000 | 3.00 | 3.00 | 3000 | 3000 | 1.00x | 10.00 |
| plain Trainer + DataCollatorWithFlattening | 9000 | 4.50 | 4.50 | 2000 | 2000 | 1.50x | 11.00 |
| plain Trainer, padded | 9000 | 6.00 | 6.00 | 1500 | 1500 | 2.00x | 12.00 |
"""


def _table_rows(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    assert lines[0] == "| " + " | ".join(HEADER) + " |", lines[0]
    assert lines[1] == "|---|---|---|---|---|"
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def _ms(cell: str) -> float:
    assert cell.endswith(" ms"), cell
    return float(cell.removesuffix(" ms"))


def test_quick_latency_and_help_print_the_table(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "run_all.py"),
            "--quick",
            "--only",
            "latency,help",
            "--count",
            "8",
            "--out",
            str(out),
            "--tmp",
            str(work),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    table = (out / "latest.md").read_text(encoding="utf-8")
    assert table in done.stdout
    assert "load average" in table
    rows = {cells[0]: cells for cells in _table_rows(table)}
    median = rows["1. drop→start latency, median"]
    assert 0 < _ms(median[1]) < 5000
    assert median[2].startswith("inotifywait loop ") and 0 < _ms(median[2].removeprefix("inotifywait loop ")) < 5000
    assert median[3] == "≤ 15 ms" and median[4] in ("yes", "**no**")
    assert "1. drop→start latency, p95" in rows
    assert any(name.startswith("4. `python -m trainq.watcher --help`") for name in rows)

    report = json.loads((out / "latest.json").read_text(encoding="utf-8"))
    assert set(report["sections"]) == {"latency", "help"}
    assert all(facts["error"] is None for facts in report["sections"].values())
    latency = next(r for r in report["rows"] if r["metric"] == "1. drop→start latency, median")
    assert len(latency["values"]["trainq_s"]) == 8 and len(latency["values"]["floor_s"]) == 8
    # after an idle spell: the same drops with a pause before each, beside the floor's
    assert len(latency["values"]["trainq_idle_s"]) == 3 and len(latency["values"]["floor_idle_s"]) == 3
    assert any(metric.startswith("1. drop→start after 1 s idle") for metric in rows)

    assert list(work.iterdir()) == [], "a section left its temp folder behind"
    marker = str(work)
    leftovers = [p.pid for p in psutil.process_iter(["cmdline"]) if any(marker in c for c in p.info["cmdline"] or ())]
    assert leftovers == [], f"benchmark processes left running: {leftovers}"


def test_an_unknown_section_is_refused_with_the_list(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run_all.py"), "--only", "latnecy", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "latnecy" in done.stderr and "throughput" in done.stderr
    assert not (tmp_path / "latest.md").exists()


def test_trainer_output_folds_into_rows() -> None:
    rows = trainer_rows(TRAINER_OUTPUT)
    assert rows[0].metric.startswith("8. trainer: 40 LoRA steps with the defaults (packing on)")
    assert (
        rows[0].trainq == "2.00 s"
        and rows[0].peer == "plain Trainer + flattening 2.50 s, padded 4.00 s, bare loop 3.80 s"
    )
    assert rows[0].values["load_average"] == "1.0 0.8 0.5"
    assert rows[1].trainq == "1.25× / 2.00×"
    packing = next(r for r in rows if "packing, real tokens per CPU-second" in r.metric)
    assert packing.trainq == "1.50× / 2.00×"
    assert rows[-1].trainq == "0.41 s" and rows[-1].met is True


def test_trainer_output_without_a_table_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no runner table"):
        trainer_rows("Traceback (most recent call last):\n  boom\n")


def test_probe_json_folds_into_rows() -> None:
    data = {
        "seconds": 2.0,
        "baseline_cpu_pct": 0.05,
        "real (no NVML here)": {"sample_us": 50.0, "tree_usage_us": 20.0, "tick_us": 120.0, "cpu_pct_at_1hz": 0.3},
        "real, no cache": {"sample_us": 90.0, "tree_usage_us": 40.0, "tick_us": 300.0},
    }
    rows = probe_rows(data)
    assert [r.trainq for r in rows] == ["0.30 % (120 µs/tick)"]
    assert rows[0].peer == "sleep-only loop 0.05 %"


def test_count_overrides_only_the_main_count() -> None:
    assert section_kwargs(BY_NAME["throughput"], quick=True, count=7) == {"jobs": 7, "runs": 1}
    assert section_kwargs(BY_NAME["idle"], quick=False, count=5) == {"seconds": 5.0}
    assert section_kwargs(BY_NAME["trainer"], quick=True, count=3) == {"quick": True}


def test_a_failing_section_is_reported_for_every_name_sharing_it(tmp_path: Path) -> None:
    calls = []

    def broken(base: Path, n: int, profile_dir: Path | None = None) -> list[Row]:
        calls.append(n)
        raise RuntimeError("watcher exited with status 1: boom")

    def fine(base: Path, n: int, profile_dir: Path | None = None) -> list[Row]:
        return [Row("ok", "fine row", "1 ms")]

    args = parse_args(["--quick", "--out", str(tmp_path), "--tmp", str(tmp_path)])
    args.sections = [
        Section("a", broken, {"n": 5}, {"n": 1}),
        Section("b", broken, {"n": 5}, {"n": 1}),
        Section("ok", fine, {"n": 5}, {"n": 1}),
    ]
    rows, facts = run_sections(args)
    assert calls == [1], "a function shared by two sections must run once"
    assert [r.metric for r in rows] == ["a: FAILED", "b: FAILED", "fine row"]
    assert rows[0].met is False and "boom" in rows[0].trainq
    assert facts["a"]["error"] and facts["b"]["error"] and facts["ok"]["error"] is None


def _probe_cycle_rows(*args: str) -> dict[str, list[str]]:
    """bench/probe_cycle.py run with ``args``: its tables' rows by first cell (the last row of that name wins)."""
    return {cells[0]: cells[1:] for cells in _probe_cycle_table(*args)}


def _probe_cycle_table(*args: str) -> list[list[str]]:
    """bench/probe_cycle.py run with ``args``: every table row's cells, in order."""
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "probe_cycle.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("|---")
    ]


def test_probe_cycle_splits_a_serial_job_s_cycle_into_its_steps(tmp_path: Path) -> None:
    """bench/probe_cycle.py on a few serial jobs: every segment of the critical path is found in the stamps of the
    real watcher and pooled supervisors, and the segments add up to the whole cycle."""
    rows = _probe_cycle_rows("--jobs", "30", "--tmp", str(tmp_path))
    from bench.probe_cycle import SEGMENTS

    segments = [float(rows[name][0]) for name, _what in SEGMENTS]
    whole = float(rows["whole cycle"][0])
    assert all(ms > 0 for ms in segments), rows
    assert "median over" in rows["whole cycle"][1]
    assert 0.5 * whole <= sum(segments) <= 2 * whole  # medians of parts against the median of the whole
    assert {"watcher", "supervisor"} <= set(rows), rows  # the CPU table names both processes
    assert not list(tmp_path.glob("trainq-cycle-*")), "the probe removes its workspace"


def test_probe_cycle_splits_a_drop_s_path_into_its_steps(tmp_path: Path) -> None:
    """bench/probe_cycle.py --drops --fine: each single drop's path, from the rename into inbox/ to the job's exec,
    split into the watcher's and the pooled supervisor's steps, and the parts add up to the whole; the step table
    also times the steps inside them (the cgroup's only where this machine contains jobs in cgroups)."""
    table = _probe_cycle_table("--drops", "12", "--fine", "--tmp", str(tmp_path))
    rows = {cells[0]: cells[1:] for cells in table}
    from bench._cycle_stamps import FINE_SUPERVISOR_STEPS, FINE_WATCHER_STEPS
    from bench.probe_cycle import DROP_SEGMENTS

    timed = {(cells[0], cells[1]) for cells in table if len(cells) == 5}
    fine = {("watcher", step) for _, _, step in FINE_WATCHER_STEPS}
    fine |= {
        ("supervisor", step) for _, _, step in FINE_SUPERVISOR_STEPS if "cgroup" not in step and "Popen" not in step
    }
    assert fine <= timed, sorted(fine - timed)
    # the job starts by Popen, or (cgroup v2, after a quiet spell: the first drop) cloned into its group
    assert {step for process, step in timed if process == "supervisor" and step.startswith("spawn: ")} - {
        "spawn: enter the cgroup",
        "spawn: leave the cgroup",
    }, timed

    segments = [float(rows[name][0]) for name, _what in DROP_SEGMENTS]
    whole = float(rows["drop → exec"][0])
    assert all(ms > 0 for ms in segments), rows
    assert "median over" in rows["drop → exec"][1]
    assert 0.5 * whole <= sum(segments) <= 2 * whole
    assert {"watcher", "supervisor"} <= set(rows), rows  # the step table names both processes
    assert not list(tmp_path.glob("trainq-drops-*")), "the probe removes its workspace"
