"""The watcher's loop, driven tick by tick in-process: ordering, limits, flags, run.json, layout repair."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import jsonschema
import pytest
from conftest import PY, REPO, drop, tick_until, trainq

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import QueueLocked

SCHEMAS = REPO / "schemas"


def load(root: Path, rel: str) -> dict:
    return json.loads((root / rel).read_text())


def validator(name: str) -> jsonschema.Draft202012Validator:
    from trainq.watcher.spec.jobspec import schema_validator

    return schema_validator(SCHEMAS, name)


def test_job_runs_with_contract_environment_and_output_log(queue_dir, watcher, write_job):
    w = watcher()
    script = "import os,sys; [print(k, os.environ.get(k)) for k in sys.argv[1:]]"
    write_job(
        "env",
        command=[
            PY,
            "-c",
            script,
            "TRAINQ_JOB_ID",
            "TRAINQ_JOB_DIR",
            "TRAINQ_STOP_FLAG",
            "TRAINQ_METRICS",
            "TRAINQ_ATTEMPT",
            "TRAINQ_RESUME_FROM",
            "PWD",
        ],
        env={"GREETING": "{job_id}-{attempt}"},
    )
    tick_until(w, lambda: (queue_dir / "done" / "env").exists())
    log = (queue_dir / "done" / "env" / "output.log").read_text()
    job_dir = str(queue_dir / "running" / "env")
    assert "TRAINQ_JOB_ID env" in log
    assert f"TRAINQ_JOB_DIR {job_dir}" in log
    assert f"TRAINQ_STOP_FLAG {job_dir}/stop.flag" in log
    assert f"TRAINQ_METRICS {job_dir}/metrics.jsonl" in log
    assert "TRAINQ_ATTEMPT 1" in log
    assert "TRAINQ_RESUME_FROM None" in log
    assert "attempt 1" in log.splitlines()[0]  # the supervisor's separator line
    run = load(queue_dir, "done/env/run.json")
    validator("run.schema.json").validate(run)
    assert run["status"] == "done" and run["attempt"] == 1
    assert run["attempts"][0]["exit_code"] == 0


def test_placeholders_expand_in_command_env_and_cwd(queue_dir, watcher, write_job):
    w = watcher()
    write_job(
        "ph",
        command=[PY, "-c", "import os; print('CWD', os.getcwd()); print('V', os.environ['V'])", "{job_id}"],
        env={"V": "{job_id}/{attempt}"},
        cwd="{job_dir}",
    )
    tick_until(w, lambda: (queue_dir / "done" / "ph").exists())
    log = (queue_dir / "done" / "ph" / "output.log").read_text()
    assert f"CWD {queue_dir / 'running' / 'ph'}" in log
    assert "V ph/1" in log


def test_failed_exit_code_is_recorded_with_diagnosis(queue_dir, watcher, write_job):
    w = watcher()
    write_job("bad", command=[PY, "-c", "import sys; print('boom: something broke'); sys.exit(3)"])
    tick_until(w, lambda: (queue_dir / "failed" / "bad").exists())
    run = load(queue_dir, "failed/bad/run.json")
    assert run["status"] == "failed"
    assert run["attempts"][-1]["exit_code"] == 3
    assert run["diagnosis"]["kind"] == "unknown"
    assert "boom" in run["diagnosis"]["evidence"]


def _paused_queue_of_ordered_jobs(queue_dir: Path, watcher, write_job, jobs: dict[str, int]):
    """A paused queue (max_concurrent 1) holding ``jobs`` (name -> priority), written in that order, each appending
    its name to order.txt when it runs; (the watcher, order.txt) once all are pending."""
    (queue_dir / "pause.flag").touch()
    w = watcher(max_concurrent=1)
    marker = queue_dir / "order.txt"
    for name, priority in jobs.items():
        command = [PY, "-c", f"open({str(marker)!r}, 'a').write({name!r} + '\\n')"]
        write_job(name, command=command, **({"priority": priority} if priority else {}))
        time.sleep(0.01)
    tick_until(w, lambda: len(os.listdir(queue_dir / "pending")) == len(jobs))
    return w, marker


def test_priority_then_acceptance_order(queue_dir, watcher, write_job):
    w, marker = _paused_queue_of_ordered_jobs(queue_dir, watcher, write_job, {"low1": 0, "low2": 0, "high": 5})
    (queue_dir / "pause.flag").unlink()
    tick_until(w, lambda: len(os.listdir(queue_dir / "done")) == 3, 20)
    assert marker.read_text().split() == ["high", "low1", "low2"]


def test_a_new_priority_on_a_planned_pending_job_is_what_the_next_plan_uses(queue_dir, watcher, write_job):
    """Each pass plans the pending head from requests kept per job (starting.py's ``_request``): one planned while
    paused must be made again when ``trainq priority`` changes the job, or the plan would still start the older."""
    w, marker = _paused_queue_of_ordered_jobs(queue_dir, watcher, write_job, {"first": 0, "second": 0})
    for _ in range(3):
        w.tick(time.time())  # planned (and kept) while paused: both wait for pause.flag
    assert w.jobs["second"].request is not None, "the pass kept the request it planned with"
    out = trainq(queue_dir, "priority", "second", "5")
    assert out.returncode == 0, out.stderr
    tick_until(w, lambda: w.jobs["second"].priority == 5)
    (queue_dir / "pause.flag").unlink()
    tick_until(w, lambda: len(os.listdir(queue_dir / "done")) == 2, 20)
    assert marker.read_text().split() == ["second", "first"]


def test_max_concurrent_is_respected(queue_dir, watcher, write_job):
    w = watcher(max_concurrent=2)
    for i in range(4):
        write_job(f"s{i}", command=["sleep", "0.6"])
    most = 0
    deadline = time.monotonic() + 20
    while len(os.listdir(queue_dir / "done")) < 4 and time.monotonic() < deadline:
        w.tick(time.time())
        most = max(most, len(os.listdir(queue_dir / "running")))
        time.sleep(0.02)
    assert len(os.listdir(queue_dir / "done")) == 4
    assert most == 2


def test_pause_flag_holds_new_jobs_and_says_why(queue_dir, watcher, write_job):
    (queue_dir / "pause.flag").touch()
    w = watcher()
    write_job("p")
    tick_until(w, lambda: (queue_dir / "pending" / "p").exists())
    for _ in range(5):
        w.tick(time.time())
    assert not (queue_dir / "done" / "p").exists()
    w.report.write(w, time.time(), force=True)
    status = load(queue_dir, "status.json")
    assert status["watcher"]["state"] == "paused"
    entry = next(j for j in status["jobs"] if j["id"] == "p")
    assert "pause" in (entry["waiting_for"] or "")
    (queue_dir / "pause.flag").unlink()
    tick_until(w, lambda: (queue_dir / "done" / "p").exists())


def test_stop_flag_on_pending_cancels_at_once(queue_dir, watcher, write_job):
    (queue_dir / "pause.flag").touch()
    w = watcher()
    write_job("c")
    tick_until(w, lambda: (queue_dir / "pending" / "c").exists())
    (queue_dir / "pending" / "c" / "stop.flag").touch()
    tick_until(w, lambda: (queue_dir / "failed" / "c").exists())
    assert load(queue_dir, "failed/c/run.json")["status"] == "cancelled"


def test_root_stop_flag_stops_the_watcher_not_the_jobs(queue_dir, watcher, write_job):
    w = watcher()
    write_job("long", command=["sleep", "30"], stop_grace="0.5s")
    tick_until(w, lambda: (queue_dir / "running" / "long").exists())
    (queue_dir / "stop.flag").touch()
    w.tick(time.time())
    assert w.stopping and not (queue_dir / "stop.flag").exists()
    assert w.executor.is_alive(JobPaths(queue_dir / "running" / "long"), {})
    (queue_dir / "running" / "long" / "stop.flag").touch()
    tick_until(w, lambda: (queue_dir / "failed" / "long").exists(), 20)


def test_second_watcher_refuses_and_names_the_pid(queue_dir, watcher, watcher_config):
    from trainq.watcher.daemon.daemon import Watcher

    watcher()
    second = Watcher(queue_dir, watcher_config())
    with pytest.raises(QueueLocked) as info:
        second.start(install_signals=False)
    assert str(os.getpid()) in str(info.value)


def test_deleted_queue_folders_are_recreated(queue_dir, watcher, write_job):
    w = watcher()
    w.tick(time.time())
    shutil.rmtree(queue_dir / "done")
    shutil.rmtree(queue_dir / "inbox")
    w.tick(time.time())
    assert (queue_dir / "done").is_dir() and (queue_dir / "inbox").is_dir()
    write_job("after")
    tick_until(w, lambda: (queue_dir / "done" / "after").exists())


def test_unsatisfiable_job_fails_at_once(queue_dir, watcher, write_job):
    w = watcher()
    write_job("huge", resources={"ram_gb": 100000})
    tick_until(w, lambda: (queue_dir / "failed" / "huge").exists())
    run = load(queue_dir, "failed/huge/run.json")
    assert run["status"] == "failed" and run["diagnosis"]["kind"] == "unsatisfiable"
    assert "RAM" in run["diagnosis"]["evidence"] or "ram" in run["diagnosis"]["evidence"].lower()


def test_a_new_job_is_checked_and_told_why_it_waits_in_the_pass_that_takes_it_in(queue_dir, watcher, write_job):
    """Issue 38 plans a pass after a slot freed only until the slots are taken; a job new to pending/ is still
    decided in the pass that takes it in, while every slot is busy: failed at once when this machine can never
    run it, and given its reason to wait otherwise."""
    w = watcher()  # max_concurrent 1
    write_job("busy", command=["sleep", "4"])
    tick_until(w, lambda: (queue_dir / "running" / "busy").exists())
    for name in ("next", "huge"):
        write_job(name, resources={"ram_gb": 100000} if name == "huge" else {})
        tick_until(w, lambda name=name: not (queue_dir / "inbox" / f"{name}.yaml").exists())
    assert (queue_dir / "failed" / "huge").is_dir()
    w.report.write(w, time.time(), force=True)
    entry = next(j for j in load(queue_dir, "status.json")["jobs"] if j["id"] == "next")
    assert (entry["waiting_for"] or "").startswith("max_concurrent 1 reached")
    tick_until(w, lambda: (queue_dir / "done" / "next").exists(), timeout_s=60)


def test_allow_commands_rejects_other_executables(queue_dir, watcher, write_job):
    w = watcher(allow_commands=["true"])
    write_job("ok", command=["true"])
    write_job("nope", command=["rm", "-rf", "/nonexistent"])
    tick_until(w, lambda: (queue_dir / "done" / "ok").exists() and (queue_dir / "failed" / "nope").exists())
    run = load(queue_dir, "failed/nope/run.json")
    assert run["status"] == "rejected" and run["errors"][0]["path"] == "command"


def test_status_json_validates_and_lists_everything(queue_dir, watcher, write_job):
    w = watcher(keep_finished=3)
    for i in range(5):
        write_job(f"f{i}")
    write_job("run", command=["sleep", "30"], stop_grace=0.5)
    drop(queue_dir, "wait.yaml", "command: ['true']\n")
    tick_until(w, lambda: len(os.listdir(queue_dir / "done")) == 5 and (queue_dir / "running" / "run").exists())
    w.report.write(w, time.time(), force=True)
    status = load(queue_dir, "status.json")
    validator("status.schema.json").validate(status)
    assert status["counts"] == {"inbox": 1, "awaiting_approval": 1, "pending": 0, "running": 1, "done": 5, "failed": 0}
    finished = [j for j in status["jobs"] if j["state"] == "done"]
    assert len(finished) == 3
    running = [j for j in status["jobs"] if j["state"] == "running"]
    assert running[0]["id"] == "run" and running[0]["pid"]
    (queue_dir / "running" / "run" / "stop.flag").touch()
    tick_until(w, lambda: (queue_dir / "failed" / "run").exists(), 20)


def test_bad_watcher_yaml_stops_startup_with_a_clear_error(queue_dir):
    import subprocess

    (queue_dir / "watcher.yaml").write_text("max_concurrent: lots\nsettle: 1\n")
    proc = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "watch", "--once"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "watcher.yaml" in proc.stderr and "max_concurrent" in proc.stderr
    assert "settle" in proc.stderr


def test_a_job_accepted_and_started_in_one_pass_is_shown_started(queue_dir, watcher, monkeypatch):
    """A status write between a job's acceptance and its start put a status.json and a status.html write (with an
    fsync) into every drop→start, and the pass's own write then waited status_s: status.json showed a running job
    as pending. A short pass now writes once, at its end (any pass counts as short here: a loaded machine may take
    longer than SHORT_PASS_S over one)."""
    from trainq.watcher.daemon import daemon

    monkeypatch.setattr(daemon, "SHORT_PASS_S", 60.0)
    w = watcher(status_s=0.5, heartbeat_s=30)
    w.tick(time.time())
    staged = queue_dir / ".staging" / "quick.yaml"
    staged.parent.mkdir(exist_ok=True)
    staged.write_text("approved: true\ncommand: [sleep, '30']\nstop_grace: 0.2s\n")
    past = time.time() - 60
    os.utime(staged, (past, past))  # written long ago: ready to start the moment it is accepted
    time.sleep(0.6)  # a status write is due at the next change
    os.rename(staged, queue_dir / "inbox" / "quick.yaml")
    time.sleep(0.3)  # the inbox's inotify event is in
    try:
        w.tick(time.time())  # one pass: accepted, started, then status.json
        assert (queue_dir / "running" / "quick").is_dir(), "not accepted and started in one pass"
        entries = {e["id"]: e for e in json.loads((queue_dir / "status.json").read_text())["jobs"]}
        assert entries.get("quick", {}).get("state") == "running", entries
    finally:
        tick_until(w, lambda: w.jobs.get("quick") is not None, what="the job to be known")
        (w.jobs["quick"].dir / "stop.flag").touch()
        tick_until(w, lambda: (queue_dir / "failed" / "quick").is_dir(), timeout_s=30, what="the stop")


def test_an_idle_watcher_waits_for_the_rescan_not_for_status_s(queue_dir, watcher, write_job):
    """An empty queue woke every status_s (1 s) for a pass that had nothing to do; with nothing in flight the loop
    now sleeps until the rescan (job folders' flags) or the heartbeat, and a pending job brings status_s back."""
    w = watcher(status_s=0.5, rescan_s=3.0, heartbeat_s=5.0)
    tick_until(w, lambda: not w.report.dirty, what="the first status.json")
    w.tick(time.time())
    assert w._next_wait_s() > 1.0  # up to the rescan, 3 s after the last one (less the time the test took)

    (queue_dir / "pause.flag").touch()  # the job stays pending
    write_job("held")
    tick_until(w, lambda: w.jobs.get("held") is not None, what="the job to be accepted")
    assert w._next_wait_s() <= 0.5
