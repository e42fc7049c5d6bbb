"""A real ``python -m trainq.watcher`` process, driven only through files, as users drive it."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import jsonschema
import psutil
from conftest import PY, REPO, drop, job_processes, wait_until

from trainq.watcher.spec.units import parse_iso


def read_status(root: Path) -> dict | None:
    try:
        return json.loads((root / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def status_validator():
    from trainq.watcher.spec.jobspec import schema_validator

    return schema_validator(REPO / "schemas", "status.schema.json")


def test_drop_run_done_with_fresh_heartbeat_and_never_a_partial_status(queue_dir, watcher_process):
    validator = status_validator()
    bad: list[str] = []
    stop = threading.Event()

    def poll_status():
        path = queue_dir / "status.json"
        # a read every millisecond: hundreds a second still catch a partial file, and the test's main thread gets
        # the GIL (a loop with no pause starved it on this VM: a join(5) once returned after 52 s)
        while not stop.wait(0.001):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            try:
                validator.validate(json.loads(data))
            except (ValueError, jsonschema.ValidationError) as exc:
                bad.append(str(exc)[:200])

    reader = threading.Thread(target=poll_status, daemon=True)
    reader.start()
    wp = watcher_process(env={"TRAINQ_ROOT": str(queue_dir)})
    for i in range(20):
        drop(queue_dir, f"j{i}.yaml", f"approved: true\ncommand: [sh, -c, 'echo hello {i}']\n")
    wait_until(lambda: len(os.listdir(queue_dir / "done")) == 20, 30, what="20 jobs done")
    status = wait_until(lambda: (s := read_status(queue_dir)) and s["counts"]["done"] == 20 and s, 10)
    age = time.time() - parse_iso(status["watcher"]["heartbeat_at"])  # as fresh as it was when read
    stop.set()
    reader.join(5)
    assert not bad, bad[:3]
    assert age < 6
    assert status["watcher"]["pid"] == wp.proc.pid
    assert "hello 3" in (queue_dir / "done" / "j3" / "output.log").read_text()


def test_heartbeat_keeps_beating_when_idle(queue_dir, watcher_process):
    watcher_process()
    first = wait_until(lambda: read_status(queue_dir), 10)["watcher"]["heartbeat_at"]
    later = wait_until(lambda: (s := read_status(queue_dir)) and s["watcher"]["heartbeat_at"] != first and s, 8)
    assert parse_iso(later["watcher"]["heartbeat_at"]) > parse_iso(first)


def test_second_watcher_process_refuses_naming_the_pid(queue_dir, watcher_process):
    wp = watcher_process()
    wait_until(lambda: read_status(queue_dir), 10)
    proc = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "watch", "--once"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert str(wp.proc.pid) in proc.stderr


def test_sigterm_leaves_jobs_running_and_a_new_watcher_adopts_them(queue_dir, watcher_process):
    wp = watcher_process()
    drop(queue_dir, "adopt.yaml", "approved: true\ncommand: [sh, -c, 'sleep 2; echo finished; exit 7']\n")
    wait_until(lambda: (queue_dir / "running" / "adopt").exists(), 10)
    wp.stop()
    assert (queue_dir / "running" / "adopt").exists()
    assert job_processes(queue_dir)
    watcher_process()
    wait_until(lambda: (queue_dir / "failed" / "adopt").exists(), 20)
    run = json.loads((queue_dir / "failed" / "adopt" / "run.json").read_text())
    assert run["attempts"][-1]["exit_code"] == 7
    assert "finished" in (queue_dir / "failed" / "adopt" / "output.log").read_text()


def test_job_that_ended_while_no_watcher_ran_is_recorded(queue_dir, watcher_process):
    wp = watcher_process()
    drop(queue_dir, "quick.yaml", "approved: true\ncommand: [sh, -c, 'sleep 1']\n")
    wait_until(lambda: (queue_dir / "running" / "quick").exists(), 10)
    wp.kill()
    wait_until(lambda: (queue_dir / "running" / "quick" / "exit.json").exists(), 10)
    watcher_process()
    wait_until(lambda: (queue_dir / "done" / "quick").exists(), 10)


def test_sigkilled_supervisor_fails_the_job_with_diagnosis(queue_dir, watcher_process):
    watcher_process()
    drop(queue_dir, "victim.yaml", "approved: true\ncommand: [sleep, '60']\n")
    started = queue_dir / "running" / "victim" / "supervisor.json"
    wait_until(lambda: started.exists(), 10)
    record = json.loads(started.read_text())
    os.kill(record["supervisor_pid"], signal.SIGKILL)
    wait_until(lambda: (queue_dir / "failed" / "victim").exists(), 15)
    run = json.loads((queue_dir / "failed" / "victim" / "run.json").read_text())
    assert run["status"] == "failed" and run["diagnosis"]["kind"] == "killed"
    wait_until(
        lambda: (
            not psutil.pid_exists(record["job_pid"])
            or psutil.Process(record["job_pid"]).status() == psutil.STATUS_ZOMBIE
        ),
        10,
    )


def test_chaos_watcher_sigkilled_30_times(queue_dir, watcher_process):
    """200 jobs, the watcher SIGKILLed at random moments >= 30 times: every job runs exactly once."""
    (queue_dir / "watcher.yaml").write_text("max_concurrent: 4\nrescan_s: 0.5\nsettle_s: 0.1\n")
    shared = queue_dir / "shared.txt"
    rng = random.Random(7)
    for i in range(200):
        delay = rng.randint(0, 300) / 1000
        drop(
            queue_dir,
            f"c{i:03d}.yaml",
            f"approved: true\ncommand: [sh, -c, 'echo $TRAINQ_JOB_ID >> {shared}; sleep {delay}']\n",
        )
    kills = 0
    wp = watcher_process()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.05, 0.6))
        wp.kill()
        kills += 1
        wp = watcher_process()
        if kills >= 30:
            break
    wait_until(lambda: len(os.listdir(queue_dir / "done")) == 200, 180, interval_s=0.2, what="all 200 done")
    wait_until(lambda: (s := read_status(queue_dir)) and s["counts"]["done"] == 200, 10)
    assert kills >= 30
    assert os.listdir(queue_dir / "running") == [] and os.listdir(queue_dir / "pending") == []
    assert os.listdir(queue_dir / "failed") == []
    ids = shared.read_text().split()
    assert sorted(ids) == sorted(f"c{i:03d}" for i in range(200)), "a job ran twice or never"
    status_validator().validate(read_status(queue_dir))
