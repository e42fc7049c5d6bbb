"""Retry, edit and the small ones of issue 23 hold across crashes: real watchers, real jobs, real kills.

Crashes come from the documented test switch TRAINQ_WATCHER_CRASH (watcher/daemon/containment.py),
which ends the watcher process with ``os._exit`` right after a named step, as a SIGKILL there would.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from conftest import drop, tick_until, wait_until

from trainq.watcher.daemon.containment import CRASH_EXIT_CODE
from trainq.watcher.spec.units import parse_iso


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fails_then_succeeds(marker: Path) -> str:
    """A job that exits 3 on its first run and prints ``second run`` on the next."""
    script = f"if [ -e '{marker}' ]; then echo second run; else touch '{marker}'; exit 3; fi"
    return yaml.safe_dump({"approved": True, "command": ["sh", "-c", script]})


def _failed_once_with_a_retry_flag(queue_dir: Path, watcher_process, tmp_path: Path) -> None:
    """Job ``rj`` failed on its first run under a watcher now stopped, and retry.flag touched in failed/rj."""
    (queue_dir / "watcher.yaml").write_text("rescan_s: 0.2\nsettle_s: 0.1\n")
    drop(queue_dir, "rj.yaml", _fails_then_succeeds(tmp_path / "ran-once"))
    first = watcher_process()
    wait_until(lambda: (_read(queue_dir / "failed" / "rj" / "run.json") or {}).get("status") == "failed", 20)
    first.stop()
    (queue_dir / "failed" / "rj" / "retry.flag").touch()


@pytest.mark.parametrize("point", ["retry-saved", "retry-moved", "retry-done"])
def test_a_retry_survives_a_watcher_crash_at_each_step(queue_dir, watcher_process, tmp_path, point):
    _failed_once_with_a_retry_flag(queue_dir, watcher_process, tmp_path)
    crashing = watcher_process(env={"TRAINQ_WATCHER_CRASH": f"{point}:rj"})
    assert crashing.proc.wait(timeout=60) == CRASH_EXIT_CODE
    if point == "retry-saved":  # the finding: run.json says pending while the folder is still in failed/
        assert (_read(queue_dir / "failed" / "rj" / "run.json") or {}).get("status") == "pending"
    watcher_process()
    wait_until(lambda: (queue_dir / "done" / "rj").exists(), 30, what="the retried job done")
    assert "second run" in (queue_dir / "done" / "rj" / "output.log").read_text()
    assert not (queue_dir / "done" / "rj" / "retry.flag").exists()
    run = _read(queue_dir / "done" / "rj" / "run.json")
    assert run["status"] == "done" and run["attempt"] == 2


@pytest.mark.parametrize("half_cleared", [False, True])
def test_a_crash_while_starting_a_retry_runs_the_retry(queue_dir, watcher_process, tmp_path, half_cleared):
    """The soak's findings (2026-12-07): a watcher killed between moving a retried job into running/ and any
    supervisor taking attempt 2 left the folder in running/ with attempt 1's start and exit records, and run.json
    still saying pending. The next watcher's recovery took attempt 1's exit record for the current attempt's and
    failed the job again: the retry never ran. ``half_cleared``: killed while clearing those records itself
    (forking a supervisor in-process, the spawner helper gone), exit.json removed and the start record not yet:
    recovery called attempt 1 lost and failed the job as killed."""
    _failed_once_with_a_retry_flag(queue_dir, watcher_process, tmp_path)
    crashing = watcher_process(env={"TRAINQ_WATCHER_CRASH": "start-moved:rj"})
    assert crashing.proc.wait(timeout=60) == CRASH_EXIT_CODE
    left = queue_dir / "running" / "rj"
    assert (_read(left / "exit.json") or {}).get("attempt") == 1  # attempt 1's records, beside a pending run.json
    assert (_read(left / "run.json") or {}).get("status") == "pending"
    if half_cleared:
        (left / "exit.json").unlink()  # where a SIGKILL between _clear_records' two unlinks leaves the folder
    watcher_process()
    wait_until(lambda: (queue_dir / "done" / "rj").exists() or (queue_dir / "failed" / "rj").exists(), 30)
    assert (queue_dir / "done" / "rj").exists(), "the retry was failed again on attempt 1's exit record"
    assert "second run" in (queue_dir / "done" / "rj" / "output.log").read_text()
    run = _read(queue_dir / "done" / "rj" / "run.json")
    assert run["status"] == "done" and run["attempt"] == 2
    assert [a["n"] for a in run["attempts"]] == [1, 2]


def test_an_edit_just_before_the_start_is_what_runs(queue_dir, watcher, write_job):
    w = watcher(rescan_s=3600)  # no rescan after the first pass: only the start's own check can see the edit
    (queue_dir / "pause.flag").touch()
    write_job("ed", command=["sh", "-c", "echo old command"])
    tick_until(w, lambda: (queue_dir / "pending" / "ed" / "run.json").exists())
    spec = queue_dir / "pending" / "ed" / "job.yaml"
    spec.write_text(yaml.safe_dump({"approved": True, "command": ["sh", "-c", "echo new command"]}))
    (queue_dir / "pause.flag").unlink()
    tick_until(w, lambda: (queue_dir / "done" / "ed").exists(), what="the edited job done")
    log = (queue_dir / "done" / "ed" / "output.log").read_text()
    assert "new command" in log and "old command" not in log


def test_a_dependent_starts_in_the_pass_that_finishes_its_dependency(queue_dir, watcher, write_job):
    w = watcher(rescan_s=3600)
    write_job("link1", command=["true"])
    write_job("link2", command=["sleep", "30"], after=["link1"])
    tick_until(w, lambda: (queue_dir / "running" / "link1").exists(), what="link1 started")
    wait_until(lambda: (queue_dir / "running" / "link1" / "exit.json").exists(), what="link1 ended")
    w.tick(time.time())
    assert (queue_dir / "done" / "link1").is_dir()
    assert (queue_dir / "running" / "link2").is_dir(), "link2 should start in the pass that finished link1"
    (queue_dir / "running" / "link2" / "stop.flag").write_text("now\n")
    tick_until(w, lambda: (queue_dir / "failed" / "link2").exists())


def test_a_clean_sigterm_leaves_the_watcher_state_stopped(queue_dir, watcher_process):
    from test_end_to_end import status_validator

    wp = watcher_process()
    wait_until(lambda: (_read(queue_dir / "status.json") or {}).get("watcher", {}).get("pid") == wp.proc.pid, 20)
    wp.stop()
    status = _read(queue_dir / "status.json")
    assert status["watcher"]["state"] == "stopped"
    status_validator().validate(status)


def test_finished_at_is_the_exit_time_not_the_time_a_stopped_watcher_resumed(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text("rescan_s: 0.2\n")
    wp = watcher_process()
    drop(queue_dir, "nap.yaml", "approved: true\ncommand: [sleep, '0.5']\n")
    wait_until(lambda: (queue_dir / "running" / "nap" / "supervisor.json").exists(), 20)
    os.kill(wp.proc.pid, signal.SIGSTOP)
    try:
        exit_record = queue_dir / "running" / "nap" / "exit.json"
        wait_until(lambda: _read(exit_record), 20, what="the job's exit record")
        ended_at = _read(exit_record)["ended_at"]
        time.sleep(1.5)  # the watcher stays stopped well past the job's end
    finally:
        resumed_at = time.time()
        os.kill(wp.proc.pid, signal.SIGCONT)
    wait_until(lambda: (queue_dir / "done" / "nap").exists(), 20)
    run = _read(queue_dir / "done" / "nap" / "run.json")
    assert run["finished_at"] == ended_at
    assert parse_iso(run["finished_at"]) < resumed_at - 1.0


def test_a_writer_that_appends_line_by_line_makes_exactly_one_job(queue_dir, watcher_process):
    """``>>`` per line, closing each time, small pauses: one job, not 33 rejected ones (the finding)."""
    (queue_dir / "watcher.yaml").write_text("settle_s: 2\nrescan_s: 0.2\n")  # pauses far below it, even at load 40
    wp = watcher_process()
    wait_until(lambda: (_read(queue_dir / "status.json") or {}).get("watcher", {}).get("pid") == wp.proc.pid, 20)
    lines = ["approved: true\n", "name: appended\n", "priority: 3\n", "command: [echo, hi]\n"]  # 60 bytes
    target = queue_dir / "inbox" / "app.yaml"
    for line in lines:
        with open(target, "a", encoding="utf-8") as f:
            f.write(line)
        time.sleep(0.1)  # far shorter than settle_s: the writer is still at work
    wait_until(lambda: (queue_dir / "done" / "app").exists(), 60, what="the appended job done")
    wait_until(lambda: not target.exists(), 10)
    assert os.listdir(queue_dir / "failed") == [] and os.listdir(queue_dir / "done") == ["app"]
    run = _read(queue_dir / "done" / "app" / "run.json")
    assert run["name"] == "appended" and run["priority"] == 3


@pytest.mark.parametrize("point", ["start-moved", "concluded"])
def test_a_crash_while_starting_or_finishing_runs_the_job_exactly_once(queue_dir, watcher_process, tmp_path, point):
    ledger = tmp_path / "ledger"
    drop(queue_dir, "once.yaml", yaml.safe_dump({"approved": True, "command": ["sh", "-c", f"echo ran >> '{ledger}'"]}))
    crashing = watcher_process(env={"TRAINQ_WATCHER_CRASH": f"{point}:once"})
    assert crashing.proc.wait(timeout=60) == CRASH_EXIT_CODE
    watcher_process()
    wait_until(lambda: (queue_dir / "done" / "once").exists(), 30, what="the job done")
    assert ledger.read_text() == "ran\n"
    assert (_read(queue_dir / "done" / "once" / "run.json") or {}).get("status") == "done"
