"""Workflows with a real watcher process (docs/workflows.md): dependencies, sweeps, finish hooks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import PY, REPO, drop, wait_until

from trainq.watcher.spec.fsutil import read_json


def _run(root: Path, job_id: str, state: str | None = None) -> dict | None:
    for s in [state] if state else ["pending", "running", "done", "failed"]:
        path = root / s / job_id / "run.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return None


def _where(root: Path, job_id: str) -> str | None:
    for s in ("pending", "running", "done", "failed"):
        if (root / s / job_id / "job.yaml").exists():
            return s
    return None


def _job(root: Path, name: str, **fields) -> Path:
    fields.setdefault("approved", True)
    if "train" not in fields:
        fields.setdefault("command", ["true"])
    return drop(root, f"{name}.yaml", json.dumps(fields))  # JSON is YAML 1.2: "2e-4" stays a string


def _status(root: Path) -> dict:
    try:
        return json.loads((root / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _entry(root: Path, job_id: str) -> dict | None:
    return next((j for j in _status(root).get("jobs", []) if j["id"] == job_id), None)


def test_chain_runs_in_order_and_reads_the_first_folder(queue_dir, watcher_process):
    """a -> b -> c: each starts after the one before ended; c reads a's folder through {after:a}."""
    watcher_process()
    _job(
        queue_dir,
        "c",
        after=["b", "a"],
        command=[PY, "-c", "import sys; print(open(sys.argv[1]).read())", "{after:a}/made.txt"],
    )
    _job(queue_dir, "b", after="a", command=[PY, "-c", "import time; time.sleep(0.2)"])
    wait_until(lambda: (_entry(queue_dir, "c") or {}).get("waiting_for"), 15, what="c waits")
    waiting = _entry(queue_dir, "c")["waiting_for"]
    assert "after b (pending)" in waiting and "after a: no such job yet" in waiting, waiting
    _job(queue_dir, "a", command=[PY, "-c", "import time; time.sleep(0.5); open('made.txt','w').write('from a')"])
    wait_until(lambda: _where(queue_dir, "c") in ("done", "failed"), 30, what="c ends")
    runs = {j: _run(queue_dir, j, "done") for j in "abc"}
    assert all(runs.values()), runs
    assert runs["a"]["finished_at"] <= runs["b"]["started_at"] <= runs["b"]["finished_at"] <= runs["c"]["started_at"]
    assert "from a" in (queue_dir / "done" / "c" / "output.log").read_text()


def test_failed_dependency_fails_two_levels_at_once(queue_dir, watcher_process):
    watcher_process()
    _job(queue_dir, "base", command=[PY, "-c", "import time; time.sleep(0.5); raise SystemExit(3)"])
    wait_until(lambda: _where(queue_dir, "base"), 15)
    _job(queue_dir, "mid", after=["base"])
    _job(queue_dir, "top", after=["mid"])
    _job(queue_dir, "anyway", after=["base"], after_policy="any", command=[PY, "-c", "print('ran anyway')"])
    wait_until(lambda: _where(queue_dir, "base") == "failed", 30, what="base fails")
    ended = json.loads((queue_dir / "failed" / "base" / "run.json").read_text())["finished_at"]
    wait_until(lambda: _where(queue_dir, "top") == "failed", 10, what="top fails")
    for job_id in ("mid", "top"):
        run = _run(queue_dir, job_id, "failed")
        assert run["status"] == "failed" and run["attempt"] == 0
        assert run["diagnosis"]["kind"] == "dependency"
        assert _seconds(run["finished_at"]) - _seconds(ended) < 1.0
    assert "base ended failed" in _run(queue_dir, "mid")["diagnosis"]["evidence"]
    assert "mid ended failed" in _run(queue_dir, "top")["diagnosis"]["evidence"]
    wait_until(lambda: _where(queue_dir, "anyway") == "done", 20, what="after_policy any runs")


def _seconds(iso: str) -> float:
    from trainq.watcher.spec.units import parse_iso

    return parse_iso(iso)


def test_cycle_is_rejected_naming_it(queue_dir, watcher_process):
    watcher_process()
    _job(queue_dir, "x", after=["y"])
    wait_until(lambda: _where(queue_dir, "x") == "pending", 15)
    _job(queue_dir, "y", after=["x"])
    wait_until(lambda: _where(queue_dir, "y") == "failed", 15, what="y rejected")
    run = _run(queue_dir, "y")
    assert run["status"] == "rejected"
    assert "y -> x -> y" in run["error"] and run["errors"][0]["path"] == "after"
    # x waited on y, which can never run: x fails too, instead of waiting forever
    wait_until(lambda: _where(queue_dir, "x") == "failed", 10, what="x fails")
    assert _run(queue_dir, "x")["diagnosis"]["kind"] == "dependency"


def test_dependencies_survive_a_watcher_restart(queue_dir, watcher_process):
    wp = watcher_process()
    _job(queue_dir, "later", after=["first"])
    wait_until(lambda: (_entry(queue_dir, "later") or {}).get("waiting_for") == "after first: no such job yet", 15)
    wp.stop()
    wp2 = watcher_process()
    wait_until(lambda: (_status(queue_dir).get("watcher") or {}).get("pid") == wp2.proc.pid, 15)
    wait_until(lambda: (_entry(queue_dir, "later") or {}).get("waiting_for") == "after first: no such job yet", 15)
    assert _where(queue_dir, "later") == "pending"
    _job(queue_dir, "first")
    wait_until(lambda: _where(queue_dir, "later") == "done", 20, what="later runs after first")


def test_sweep_of_command_jobs(queue_dir, watcher_process):
    """A 2x2 sweep: four concrete jobs, run.json sweep info, after: [sweep] waits for all four."""
    watcher_process()
    _job(
        queue_dir,
        "report",
        after=["grid"],
        command=[PY, "-c", "import sys; print(open(sys.argv[1]).read())", "{after:grid-3}/output.log"],
    )
    _job(
        queue_dir,
        "grid",
        command=[PY, "-c", "import sys,time; time.sleep(0.1); print(sys.argv[1:])", "{lr}"],
        sweep={"lr": ["1e-4", "2e-4"], "resources.ram_gb": [0, 0.001]},
    )
    wait_until(lambda: all(_where(queue_dir, f"grid-{i}") == "done" for i in range(1, 5)), 40, what="sweep runs")
    assert _where(queue_dir, "grid") is None and _where(queue_dir, "grid-5") is None
    run = _run(queue_dir, "grid-3")
    assert run["sweep"] == {"id": "grid", "index": 3, "params": {"lr": "2e-4", "resources.ram_gb": 0}, "of": 4}
    concrete = yaml.safe_load((queue_dir / "done" / "grid-3" / "job.yaml").read_text())
    assert "sweep" not in concrete and concrete["command"][-1] == "2e-4" and concrete["resources"] == {"ram_gb": 0}
    assert "['2e-4']" in (queue_dir / "done" / "grid-3" / "output.log").read_text()
    wait_until(lambda: _where(queue_dir, "report") == "done", 20, what="after the whole sweep")
    assert "['2e-4']" in (queue_dir / "done" / "report" / "output.log").read_text()
    assert _run(queue_dir, "report")["started_at"] >= max(
        _run(queue_dir, f"grid-{i}")["finished_at"] for i in range(1, 5)
    )
    entries = wait_until(
        lambda: (
            (
                found := [
                    e for e in _status(queue_dir).get("jobs", []) if e.get("sweep") == "grid" and e["state"] == "done"
                ]
            )
            and len(found) == 4
            and found
        ),
        10,
    )
    assert len(entries) == 4 and entries[0]["params"]
    out = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "status"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert "sweep grid: 4 job(s) listed, 4 ended" in out.stdout, out.stdout
    assert "lr=2e-4, resources.ram_gb=0.001" in out.stdout


def test_bad_sweeps_are_rejected_naming_the_key(queue_dir, watcher_process):
    watcher_process()
    _job(queue_dir, "big", command=["echo", "{a}", "{b}"], sweep={"a": list(range(50)), "b": list(range(21))})
    _job(queue_dir, "nofield", command=["true"], sweep={"train.lr": [1e-4]})
    wait_until(lambda: _where(queue_dir, "big") == "failed" and _where(queue_dir, "nofield") == "failed", 15)
    assert "1050 jobs" in _run(queue_dir, "big")["error"] and _run(queue_dir, "big")["errors"][0]["path"] == "sweep.a"
    assert _run(queue_dir, "nofield")["errors"][0]["path"] == "sweep.train.lr"


HOOK = (
    "import os,sys,time; time.sleep(float(sys.argv[2])); "
    "open(os.path.join(os.environ['TRAINQ_JOB_DIR'], 'hook-runs.txt'), 'a').write("
    "sys.argv[1] + ' ' + os.environ['TRAINQ_STATUS'] + ' ' + os.environ['TRAINQ_DIAGNOSIS'] + chr(10))"
)


def test_on_finish_runs_once_across_a_watcher_sigkill_before_the_hook(queue_dir, watcher_process):
    """The job ends while no watcher runs (killed between the job's end and its hook): the next one runs it once."""
    wp = watcher_process()
    _job(
        queue_dir,
        "h",
        command=[PY, "-c", "import time; time.sleep(1.5); raise SystemExit(4)"],
        on_finish=[PY, "-c", HOOK, "{job_id}:{status}", "0"],
    )
    wait_until(lambda: _where(queue_dir, "h") == "running", 15)
    wp.kill()
    wait_until(lambda: (queue_dir / "running" / "h" / "exit.json").exists(), 20, what="job ends without a watcher")
    watcher_process()
    wait_until(lambda: (read_json(queue_dir / "failed" / "h" / "hook.json") or {}).get("state") == "ended", 20)
    time.sleep(1.0)
    lines = (queue_dir / "failed" / "h" / "hook-runs.txt").read_text().splitlines()
    assert lines == ["h:failed failed unknown"]
    assert "on_finish of h (failed)" in (queue_dir / "failed" / "h" / "hook.log").read_text()
    assert _run(queue_dir, "h")["status"] == "failed"


def test_on_finish_is_not_run_again_when_the_watcher_dies_during_it(queue_dir, watcher_process):
    wp = watcher_process()
    _job(queue_dir, "g", command=["true"], on_finish=[PY, "-c", HOOK, "{job_id}", "1.5"])
    wait_until(lambda: (queue_dir / "done" / "g" / "hook.json").exists(), 20, what="hook starts")
    wp.kill()
    watcher_process()
    wait_until(lambda: (queue_dir / "done" / "g" / "hook-runs.txt").exists(), 20)
    time.sleep(2.5)
    assert (queue_dir / "done" / "g" / "hook-runs.txt").read_text().splitlines() == ["g done "]
    assert json.loads((queue_dir / "done" / "g" / "hook.json").read_text())["exit_code"] == 0


def test_on_finish_is_killed_at_its_limit_and_never_changes_the_status(queue_dir, watcher_process):
    watcher_process(env={"TRAINQ_HOOK_TIMEOUT_S": "1"})
    _job(queue_dir, "slow", command=["true"], on_finish=[PY, "-c", "import time; time.sleep(30)"])
    wait_until(lambda: (read_json(queue_dir / "done" / "slow" / "hook.json") or {}).get("state") == "ended", 20)
    record = json.loads((queue_dir / "done" / "slow" / "hook.json").read_text())
    assert record["timed_out"] is True
    assert "was killed" in (queue_dir / "done" / "slow" / "hook.log").read_text()
    assert _run(queue_dir, "slow")["status"] == "done"


def test_sweep_of_tiny_train_jobs_is_compared_in_status(queue_dir, watcher_process, tmp_path):
    """Two learning rates on the tiny model: status.json and `trainq status` list them best eval loss first."""
    pytest.importorskip("torch", reason="the training stack is not installed")
    tiny = tmp_path / "tiny"
    subprocess.run([PY, "-m", "trainq.trainer.tiny", str(tiny)], check=True, cwd=REPO, capture_output=True, timeout=300)
    watcher_process()
    train = {
        "model": str(tiny / "model"),
        "data": {"train": str(tiny / "train.jsonl"), "eval": str(tiny / "eval.jsonl")},
        "method": "lora",
        "max_steps": 16,
        "batch_size": 4,
        "seq_len": 32,
        "eval_every": 8,
        "seed": 3,
        "checkpoint": {"every_steps": 8, "keep": 1},
    }
    _job(queue_dir, "lrs", train=train, sweep={"train.lr": [0.00001, 0.01]})
    wait_until(lambda: all(_where(queue_dir, f"lrs-{i}") in ("done", "failed") for i in (1, 2)), 240, what="sweep")
    assert [_where(queue_dir, f"lrs-{i}") for i in (1, 2)] == ["done", "done"]

    def listed() -> dict:
        found = {e["id"]: e for e in _status(queue_dir).get("jobs", []) if e.get("sweep") == "lrs"}
        return found if all(e["state"] == "done" for e in found.values()) and len(found) == 2 else {}

    entries = wait_until(listed, 10, what="status.json lists both finished jobs")
    assert entries["lrs-2"]["params"] == {"train.lr": 0.01}
    losses = {i: entries[i]["best_eval_loss"] for i in entries}
    assert all(isinstance(v, float) for v in losses.values()) and losses["lrs-2"] < losses["lrs-1"], losses
    out = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "status"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    ).stdout
    rows = [line for line in out.splitlines() if line.strip().startswith("lrs-") and "best eval loss" in line]
    assert "best eval loss first" in out and rows[0].split()[0] == "lrs-2", out
    assert f"{losses['lrs-2']:.4f}" in rows[0] and "train.lr=0.01" in rows[0]
    html = (queue_dir / "status.html").read_text()
    assert "Sweep lrs" in html and html.index(f"{losses['lrs-2']:.4f}") < html.index(f"{losses['lrs-1']:.4f}")

    # fork the better one from its checkpoint: its weights, a fresh optimizer and schedule
    fork = subprocess.run(
        [
            PY,
            "-m",
            "trainq.watcher",
            "--root",
            str(queue_dir),
            "fork",
            "lrs-2",
            "--from-checkpoint",
            "--set",
            "train.max_steps=4",
            "--set",
            "train.eval_every=2",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert fork.returncode == 0, fork.stderr
    wait_until(lambda: _where(queue_dir, "lrs-2-fork") in ("done", "failed"), 120, what="the fork")
    assert _where(queue_dir, "lrs-2-fork") == "done", (queue_dir / "failed" / "lrs-2-fork" / "output.log").read_text()
    assert "initial weights from" in (queue_dir / "done" / "lrs-2-fork" / "output.log").read_text()

    def first(job):
        return next(
            json.loads(line)["loss"]
            for line in (queue_dir / "done" / job / "metrics.jsonl").read_text().splitlines()
            if '"type": "step"' in line or '"type":"step"' in line
        )

    assert first("lrs-2-fork") < first("lrs-2") - 0.1, (first("lrs-2-fork"), first("lrs-2"))
    assert _run(queue_dir, "lrs-2-fork")["lineage"]["fork_of"] == "lrs-2"


def test_bench_sweep_section_runs(tmp_path):
    """bench/run_all.py's sweep section on a small sweep: every row measured, status.json within bounds."""
    sys.path.insert(0, str(REPO))
    from bench.bench_sweep import bench_sweep

    rows = bench_sweep(tmp_path, variants=60, seconds=0.5)
    assert len(rows) == 6
    sizes = [r for r in rows if "status.json size" in r.metric]
    assert all(r.met for r in sizes), [r.cells() for r in rows]


def test_a_sweep_interrupted_by_a_crash_is_finished_at_start_up(queue_dir, watcher_process):
    """The watcher died after claiming a sweep file and writing one of its jobs: the next one writes the rest."""
    staging = queue_dir / "pending" / ".sweep-part"
    staging.mkdir()
    (staging / "job.yaml").write_text(
        json.dumps({"approved": True, "command": ["echo", "{n}"], "sweep": {"n": [1, 2, 3]}})
    )
    (queue_dir / "pending" / "part-1").mkdir()
    (queue_dir / "pending" / "part-1" / "job.yaml").write_text(json.dumps({"approved": True, "command": ["echo", "1"]}))
    (queue_dir / "pending" / "part-1" / "run.json").write_text(
        json.dumps(
            {
                "schema_version": 1,
                "id": "part-1",
                "status": "pending",
                "attempt": 0,
                "attempts": [],
                "sweep": {"id": "part", "index": 1, "params": {"n": 1}, "of": 3},
            }
        )
    )
    watcher_process()
    wait_until(lambda: all(_where(queue_dir, f"part-{i}") == "done" for i in (1, 2, 3)), 30, what="the whole sweep")
    assert not staging.exists() and _where(queue_dir, "part-4") is None
    assert (queue_dir / "done" / "part-2" / "output.log").read_text().strip().endswith("2")


def test_a_sweep_closing_a_cycle_is_rejected(queue_dir, watcher_process):
    watcher_process()
    _job(queue_dir, "b", after=["s"])
    wait_until(lambda: _where(queue_dir, "b") == "pending", 15)
    _job(queue_dir, "s", after=["b"], command=["echo", "{n}"], sweep={"n": [1, 2]})
    wait_until(lambda: _where(queue_dir, "s-1") == "failed" and _where(queue_dir, "s-2") == "failed", 15)
    assert "s-1 -> b -> s" in _run(queue_dir, "s-1")["error"]
    wait_until(lambda: _where(queue_dir, "b") == "failed", 10)
    assert _run(queue_dir, "b")["diagnosis"]["kind"] == "dependency"


def test_on_finish_of_a_job_finished_just_before_a_crash_runs_once_at_start_up(queue_dir, watcher_process):
    """The state a SIGKILL leaves right after the final move: done/ID with no hook.json. The next watcher runs it once."""
    job = queue_dir / "done" / "quick"
    job.mkdir()
    (job / "job.yaml").write_text(
        json.dumps({"approved": True, "command": ["true"], "on_finish": [PY, "-c", HOOK, "{job_id}:{status}", "0"]})
    )
    (job / "run.json").write_text(
        json.dumps(
            {
                "schema_version": 1,
                "id": "quick",
                "status": "done",
                "attempt": 1,
                "attempts": [],
                "finished_at": "2026-01-01T00:00:00Z",
            }
        )
    )
    wp = watcher_process()
    wait_until(lambda: (read_json(job / "hook.json") or {}).get("state") == "ended", 20, what="the hook")
    wp.stop()
    watcher_process()  # a second start must not run it again
    time.sleep(2.0)
    assert (job / "hook-runs.txt").read_text().splitlines() == ["quick:done done "]


def test_a_finished_sweeps_id_is_not_given_to_a_later_job_after_a_restart(queue_dir, watcher_process):
    wp = watcher_process()
    _job(queue_dir, "exp", command=["echo", "{n}"], sweep={"n": [1, 2]})
    wait_until(lambda: _where(queue_dir, "exp-1") == "done" and _where(queue_dir, "exp-2") == "done", 20)
    wp.stop()
    watcher_process()
    _job(queue_dir, "exp")  # a plain job with the sweep's file name
    _job(queue_dir, "waits", after=["exp"])  # still means the whole (finished) sweep
    wait_until(lambda: _where(queue_dir, "waits") == "done", 20, what="after: [exp] means the sweep")
    assert _where(queue_dir, "exp") is None and _where(queue_dir, "exp-3") == "done"
