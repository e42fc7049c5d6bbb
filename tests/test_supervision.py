"""Supervision through the watcher: stop, kill-tree, timeout, stall, retries with resume, attempt separators."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
from conftest import FAKE, PY, job_processes, tick_until

RESUMABLE = r"""
import json, os, sys
job = os.environ["TRAINQ_JOB_DIR"]
attempt = int(os.environ["TRAINQ_ATTEMPT"])
print("attempt", attempt, "argv", sys.argv[1:], "resume", os.environ.get("TRAINQ_RESUME_FROM"), flush=True)
if attempt == 1:
    ckpt = os.path.join(job, "checkpoints", "step-3")
    os.makedirs(ckpt)
    with open(os.environ["TRAINQ_METRICS"], "a") as f:
        f.write(json.dumps({"type": "checkpoint", "step": 3, "path": ckpt}) + "\n")
    print("RuntimeError: simulated crash after a checkpoint", flush=True)
    sys.exit(1)
"""


def run_of(root: Path, state: str, job_id: str) -> dict:
    return json.loads((root / state / job_id / "run.json").read_text())


def test_stop_kills_a_sigterm_ignoring_tree_with_double_forked_grandchild(queue_dir, watcher, write_job):
    w = watcher()
    write_job("stubborn", command=[PY, str(FAKE / "ignores_sigterm_with_grandchildren.py")], stop_grace="1s")
    pids_file = queue_dir / "running" / "stubborn" / "pids.txt"
    tick_until(w, pids_file.exists, 20)
    pids = [int(p) for p in pids_file.read_text().split()]
    assert all(psutil.pid_exists(p) for p in pids)
    (queue_dir / "running" / "stubborn" / "stop.flag").touch()
    started = time.monotonic()
    tick_until(w, lambda: (queue_dir / "failed" / "stubborn").exists(), 1 + 10 + 5)
    assert time.monotonic() - started <= 1 + 10
    run = run_of(queue_dir, "failed", "stubborn")
    assert run["status"] == "cancelled"
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not job_processes(queue_dir)


def test_cooperative_stop_needs_no_signal(queue_dir, watcher, write_job):
    w = watcher()
    write_job("coop", command=[PY, str(FAKE / "cooperative.py")], stop_grace="60s")
    tick_until(w, lambda: "ready" in _read(queue_dir / "running" / "coop" / "output.log"), 20)
    (queue_dir / "running" / "coop" / "stop.flag").touch()
    tick_until(
        w,
        lambda: (
            run_of(queue_dir, "running", "coop")["status"] == "stopping"
            if (queue_dir / "running" / "coop").exists()
            else True
        ),
        5,
    )
    tick_until(w, lambda: (queue_dir / "failed" / "coop").exists(), 10)
    run = run_of(queue_dir, "failed", "coop")
    assert run["status"] == "cancelled"
    assert run["attempts"][-1]["exit_code"] == 0
    assert (queue_dir / "failed" / "coop" / "checkpoints" / "step-1" / "state.txt").exists()
    exit_record = json.loads((queue_dir / "failed" / "coop" / "exit.json").read_text())
    assert exit_record["signals_sent"] == []


def test_timeout_is_a_stop_recorded_as_timeout(queue_dir, watcher, write_job):
    w = watcher()
    write_job("slow", command=["sleep", "60"], timeout="1s", stop_grace="0.5s")
    tick_until(w, lambda: (queue_dir / "failed" / "slow").exists(), 20)
    run = run_of(queue_dir, "failed", "slow")
    assert run["status"] == "timeout"
    assert run["diagnosis"]["kind"] == "timeout"


def test_retry_resumes_from_the_checkpoint_with_resume_args(queue_dir, watcher, write_job):
    w = watcher()
    write_job(
        "resumable",
        command=[PY, "-c", RESUMABLE],
        resume_args=["--resume", "{resume_from}"],
        retries={"max": 1, "on": ["unknown"], "backoff": "1s"},
    )
    tick_until(
        w,
        lambda: (
            (queue_dir / "pending" / "resumable").exists() and run_of(queue_dir, "pending", "resumable")["attempt"] == 1
        ),
        20,
    )
    waiting = run_of(queue_dir, "pending", "resumable")
    assert "retry 2 of 2" in waiting["waiting_for"]
    tick_until(w, lambda: (queue_dir / "done" / "resumable").exists(), 20)
    log = (queue_dir / "done" / "resumable" / "output.log").read_text()
    ckpt = str(queue_dir / "running" / "resumable" / "checkpoints" / "step-3")
    assert f"attempt 2 argv ['--resume', '{ckpt}'] resume {ckpt}" in log
    assert "attempt 1 argv [] resume None" in log
    assert log.count("===== trainq: job resumable, attempt") == 2
    run = run_of(queue_dir, "done", "resumable")
    assert [a["n"] for a in run["attempts"]] == [1, 2]
    assert run["attempts"][0]["diagnosis"]["kind"] == "unknown"


def test_no_retry_when_the_kind_is_not_listed(queue_dir, watcher, write_job):
    w = watcher()
    write_job("once", command=[PY, "-c", "import sys; sys.exit(1)"], retries={"max": 3, "on": ["oom"], "backoff": "1s"})
    tick_until(w, lambda: (queue_dir / "failed" / "once").exists(), 20)
    assert run_of(queue_dir, "failed", "once")["attempt"] == 1


def test_retry_flag_requeues_a_failed_job(queue_dir, watcher, write_job):
    w = watcher()
    marker = queue_dir / "second-time"
    write_job("again", command=["sh", "-c", f"test -e {marker} || {{ touch {marker}; exit 4; }}"])
    tick_until(w, lambda: (queue_dir / "failed" / "again").exists(), 20)
    (queue_dir / "failed" / "again" / "retry.flag").touch()
    tick_until(w, lambda: (queue_dir / "done" / "again").exists(), 20)
    run = run_of(queue_dir, "done", "again")
    assert run["attempt"] == 2 and run["status"] == "done"
    assert not (queue_dir / "done" / "again" / "retry.flag").exists()


def test_stall_shows_in_status_and_retries_when_asked(queue_dir, watcher, write_job):
    w = watcher()
    write_job("quiet", command=["sh", "-c", "echo start; sleep 60"], stall_after="0.5s", stop_grace="0.5s")
    tick_until(w, lambda: any(j.health == "stalled" for j in w.jobs.values()), 10)
    w.report.write(w, time.time(), force=True)
    status = json.loads((queue_dir / "status.json").read_text())
    assert next(j for j in status["jobs"] if j["id"] == "quiet")["health"] == "stalled"
    (queue_dir / "running" / "quiet" / "stop.flag").touch()
    tick_until(w, lambda: (queue_dir / "failed" / "quiet").exists(), 15)

    write_job(
        "stuck",
        command=["sh", "-c", "echo $TRAINQ_ATTEMPT; sleep 60"],
        stall_after="0.5s",
        stop_grace="0.5s",
        retries={"max": 1, "on": ["stalled"], "backoff": "1s"},
    )
    tick_until(w, lambda: (queue_dir / "failed" / "stuck").exists(), 30)
    run = run_of(queue_dir, "failed", "stuck")
    assert run["attempt"] == 2
    assert [a["diagnosis"]["kind"] for a in run["attempts"]] == ["stalled", "stalled"]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""
