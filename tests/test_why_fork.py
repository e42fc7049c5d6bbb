"""`trainq why` and `trainq fork` against a real watcher process and real job folders."""

from __future__ import annotations

import json

import psutil
from conftest import PY, trainq, wait_until
from test_workflows import _entry, _job, _run, _where

from trainq.watcher.cli.why import explain
from trainq.watcher.daemon.resources import GpuInfo, MachineState


def _holds(out: str) -> dict[str, str]:
    """gate -> words, for every HOLD line of `trainq why`."""
    rows = {}
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("HOLD "):
            gate, _, words = line[5:].partition("  ")
            rows[gate.strip()] = words.strip()
    return rows


def test_why_names_every_gate_that_holds_a_job(queue_dir, watcher_process, tmp_path):
    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps([{"index": 0, "name": "Sim 6GB", "memory_total_mb": 6144, "memory_used_mb": 0}]))
    battery = tmp_path / "battery.json"
    battery.write_text(json.dumps({"percent": 41, "power_plugged": False}))
    free_gb = psutil.disk_usage(str(queue_dir)).free / 2**30
    (queue_dir / "watcher.yaml").write_text(f"max_concurrent: 1\nmin_free_disk_gb: {free_gb - 1.0:.2f}\n")
    env = {"TRAINQ_SIMULATE_GPUS": str(gpus), "TRAINQ_SIMULATE_BATTERY": str(battery)}

    out = trainq(queue_dir, "why", "nothing-here")
    assert out.returncode == 2 and "no job with id 'nothing-here'" in out.stderr

    watcher_process(env=env)
    _job(
        queue_dir,
        "flaky",
        command=[PY, "-c", "raise SystemExit(1)"],
        resources={"gpus": 0, "allow_battery": True},
        retries={"max": 1, "on": ["unknown"], "backoff": "1h"},
    )
    wait_until(lambda: (_run(queue_dir, "flaky") or {}).get("not_before"), 20, what="flaky waits for its retry")
    _job(
        queue_dir,
        "hog",
        command=[PY, "-c", "import time; time.sleep(40)"],
        resources={"gpus": 1, "allow_battery": True},
        stop_grace="1s",
    )
    wait_until(lambda: _where(queue_dir, "hog") == "running", 20, what="hog runs")
    _job(queue_dir, "held", after=["flaky", "later"], resources={"gpus": 1, "disk_gb": 3})
    wait_until(lambda: (_entry(queue_dir, "held") or {}).get("waiting_for"), 20)

    holds = _holds(trainq(queue_dir, "why", "held", env=env).stdout)
    assert "flaky is pending" in holds["after flaky"]
    assert "no such job yet" in holds["after later"]
    assert holds["max_concurrent"] == "max_concurrent 1 reached (running: hog)"
    assert "on battery (41%)" in holds["battery"]
    assert "GPU 0 held by job hog" in holds["GPUs"]
    assert "job needs 3 GB + min_free_disk_gb" in holds["disk"]
    flaky = trainq(queue_dir, "why", "flaky", env=env).stdout
    assert "retry 2 of 2 may start in" in _holds(flaky)["backoff"], flaky

    (queue_dir / "pause.flag").touch()
    wait_until(lambda: json.loads((queue_dir / "status.json").read_text())["watcher"]["state"] == "paused", 10)
    assert "pause.flag is present" in _holds(trainq(queue_dir, "why", "held", env=env).stdout)["pause"]
    (queue_dir / "stop.flag").touch()
    wait_until(lambda: json.loads((queue_dir / "status.json").read_text())["watcher"]["state"] == "stopped", 10)
    assert "no watcher is running" in _holds(trainq(queue_dir, "why", "held", env=env).stdout)["watcher"]
    (queue_dir / "running" / "hog" / "stop.flag").touch()
    (queue_dir / "pause.flag").unlink()
    watcher_process(env=env)
    wait_until(lambda: _where(queue_dir, "hog") == "failed", 30, what="hog stopped")


def test_why_reports_ram_with_numbers(queue_dir):
    """The RAM gate (machine given, since this machine's free RAM cannot be steered by a test)."""
    (queue_dir / "pending" / "big").mkdir()
    (queue_dir / "pending" / "big" / "job.yaml").write_text("approved: true\ncommand: [echo]\nresources: {ram_gb: 6}\n")
    (queue_dir / "pending" / "big" / "run.json").write_text(json.dumps({"id": "big", "status": "pending"}))
    machine = MachineState(
        ram_total_gb=16,
        ram_available_gb=2.5,
        disks={str(queue_dir.resolve()): (100.0, 50.0)},
        gpus=(GpuInfo(0, "Sim", 6144, 0),),
    )
    lines = explain(queue_dir, "big", machine=machine)
    assert any("HOLD RAM" in line and "2.5 GB RAM free, job needs 6 GB" in line for line in lines), lines
    assert any("ok   disk" in line and "50.0 GB free" in line for line in lines), lines


def test_why_explains_a_failure_with_evidence_and_advice(queue_dir, watcher_process):
    watcher_process()
    _job(
        queue_dir,
        "dep",
        command=[PY, "-c", "import sys; print('CUDA out of memory. Tried to allocate 2 GiB'); sys.exit(1)"],
    )
    _job(queue_dir, "after-it", after=["dep"])
    wait_until(lambda: _where(queue_dir, "after-it") == "failed", 30)
    out = trainq(queue_dir, "why", "dep").stdout
    assert "diagnosis: oom" in out and "CUDA out of memory" in out and "advice:" in out and "batch_size" in out
    out = trainq(queue_dir, "why", "after-it").stdout
    assert "diagnosis: dependency" in out and "dependency dep ended failed (oom)" in out
    assert "trainq why dep" in out


def test_fork_writes_a_valid_job_with_lineage(queue_dir, watcher_process):
    watcher_process()
    _job(queue_dir, "base", command=[PY, "-c", "import os; print('lr', os.environ.get('LR'))"], env={"LR": "1"})
    wait_until(lambda: _where(queue_dir, "base") == "done", 20)
    bad = trainq(queue_dir, "fork", "base", "--set", "resources.ram=4")
    assert bad.returncode == 2 and "resources.ram: unknown key 'ram' (did you mean 'ram_gb'?)" in bad.stderr
    bad = trainq(queue_dir, "fork", "base", "--set", "priority=high")
    assert bad.returncode == 2 and "priority: must be an integer" in bad.stderr
    assert not [p for p in (queue_dir / "inbox").iterdir()]
    assert trainq(queue_dir, "fork", "nope").returncode == 2

    ok = trainq(queue_dir, "fork", "base", "--set", "env.LR=2", "--set", "priority=3")
    assert ok.returncode == 0, ok.stderr
    wait_until(lambda: _where(queue_dir, "base-fork") == "done", 20)
    assert "lr 2" in (queue_dir / "done" / "base-fork" / "output.log").read_text()
    assert _run(queue_dir, "base-fork")["lineage"] == {"fork_of": "base", "parents": ["base"]}
    assert trainq(queue_dir, "fork", "base-fork").returncode == 0
    wait_until(lambda: _where(queue_dir, "base-fork-fork") == "done", 20)
    assert _run(queue_dir, "base-fork-fork")["lineage"] == {"fork_of": "base-fork", "parents": ["base-fork", "base"]}


def test_fork_from_checkpoint_gives_a_command_job_its_parent_checkpoint(queue_dir, watcher_process):
    watcher_process()
    _job(
        queue_dir,
        "ck",
        command=[
            PY,
            "-c",
            "import os; os.makedirs('checkpoints/ckpt_latest'); open('checkpoints/ckpt_latest/w','w').write('7')",
        ],
    )
    wait_until(lambda: _where(queue_dir, "ck") == "done", 20)
    assert (
        trainq(
            queue_dir,
            "fork",
            "ck",
            "--from-checkpoint",
            "--set",
            "command=[" + PY + ", -c, \"import os; print(open(os.environ['TRAINQ_RESUME_FROM'] + '/w').read())\"]",
        ).returncode
        == 0
    )
    wait_until(lambda: _where(queue_dir, "ck-fork") == "done", 20)
    assert "7" in (queue_dir / "done" / "ck-fork" / "output.log").read_text()
    assert _run(queue_dir, "ck-fork")["attempts"][0]["resumed_from"].endswith("done/ck/checkpoints/ckpt_latest")
