"""One job's trouble stays that job's: deleted folders, injected faults in every per-job step.

The faults come from the watcher's documented test switch TRAINQ_WATCHER_FAULTS (README,
"Switches"), which raises a real exception inside the named step for the named job.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import psutil
from conftest import FAKE, PY, job_processes, tick_until, wait_until


def load(root: Path, rel: str) -> dict:
    return json.loads((root / rel).read_text())


def status(root: Path) -> dict:
    return load(root, "status.json")


# -- deleted folders ---------------------------------------------------------------------------
def test_rm_rf_of_a_waiting_job_is_forgotten_with_one_log_line(queue_dir, watcher, write_job, caplog):
    """Was: FileNotFoundError out of tick() when start_pending renamed the vanished folder."""
    (queue_dir / "pause.flag").touch()
    w = watcher()
    write_job("gone")
    write_job("stays")
    tick_until(w, lambda: (queue_dir / "pending" / "gone").is_dir() and (queue_dir / "pending" / "stays").is_dir())
    shutil.rmtree(queue_dir / "pending" / "gone")
    (queue_dir / "pause.flag").unlink()
    with caplog.at_level(logging.INFO, logger="trainq.watcher"):
        tick_until(w, lambda: (queue_dir / "done" / "stays").is_dir(), what="the other job runs")
        tick_until(w, lambda: status(queue_dir)["counts"]["pending"] == 0)
    lines = [r.getMessage() for r in caplog.records if "gone" in r.getMessage()]
    assert len(lines) == 1 and "removed" in lines[0], lines
    assert not (queue_dir / "running" / "gone").exists() and not (queue_dir / "failed" / "gone").exists()
    assert "gone" not in [j["id"] for j in status(queue_dir)["jobs"]]


def test_rm_rf_of_a_waiting_job_in_backoff_or_behind_others(queue_dir, watcher, write_job):
    """A pending job the loop never touches (another one runs) is still noticed on the next rescan."""
    w = watcher(max_concurrent=1)
    write_job("busy", command=[PY, str(FAKE / "sleeps.py")], stop_grace="1s")
    tick_until(w, lambda: (queue_dir / "running" / "busy").is_dir())
    write_job("queued")
    tick_until(w, lambda: (queue_dir / "pending" / "queued").is_dir())
    shutil.rmtree(queue_dir / "pending" / "queued")
    tick_until(w, lambda: status(queue_dir)["counts"]["pending"] == 0, what="the removed job forgotten")
    (queue_dir / "running" / "busy" / "stop.flag").touch()
    tick_until(w, lambda: (queue_dir / "failed" / "busy").is_dir())


def test_rm_rf_of_a_running_job_stops_its_processes_and_the_loop_goes_on(queue_dir, watcher, write_job, caplog):
    """Was: FileNotFoundError writing run.json into the vanished folder (the loop died)."""
    w = watcher(max_concurrent=1)
    write_job("victim", command=[PY, str(FAKE / "sleeps.py")], stop_grace="1s")
    tick_until(w, lambda: (queue_dir / "running" / "victim").is_dir())
    wait_until(lambda: job_processes(queue_dir), what="the job process")
    procs = job_processes(queue_dir)
    with caplog.at_level(logging.INFO, logger="trainq.watcher"):
        shutil.rmtree(queue_dir / "running" / "victim")
        tick_until(w, lambda: status(queue_dir)["counts"]["running"] == 0, what="the removed job forgotten")
        write_job("next")
        tick_until(w, lambda: (queue_dir / "done" / "next").is_dir(), what="the next job runs")
    _gone, alive = psutil.wait_procs(procs, timeout=20)
    assert not alive, "the removed job's processes were not stopped"
    lines = [r.getMessage() for r in caplog.records if "victim" in r.getMessage() and "removed" in r.getMessage()]
    assert len(lines) == 1, lines
    assert not any((queue_dir / s / "victim").exists() for s in ("pending", "running", "done", "failed"))


def test_rm_rf_of_a_finished_job_is_forgotten_with_one_log_line(queue_dir, watcher, write_job, caplog):
    w = watcher()
    write_job("finished")
    write_job("kept")
    tick_until(w, lambda: (queue_dir / "done" / "finished").is_dir() and (queue_dir / "done" / "kept").is_dir())
    tick_until(w, lambda: {"finished", "kept"} <= {j["id"] for j in status(queue_dir)["jobs"]})
    with caplog.at_level(logging.INFO, logger="trainq.watcher"):
        shutil.rmtree(queue_dir / "done" / "finished")
        tick_until(w, lambda: "finished" not in {j["id"] for j in status(queue_dir)["jobs"]}, what="it unlisted")
        tick_until(w, lambda: status(queue_dir)["counts"]["done"] == 1, what="the count")
        for _ in range(5):
            w.tick(time.time())
    lines = [r.getMessage() for r in caplog.records if "finished" in r.getMessage() and "removed" in r.getMessage()]
    assert len(lines) == 1 and "done/finished" in lines[0], lines


def test_a_removed_job_resubmitted_under_its_id_is_not_ended_by_the_old_attempt(queue_dir, watcher, write_job):
    """The old supervisor stops its job but writes no exit record into the new folder of the same id."""
    w = watcher(max_concurrent=2)
    write_job("same", command=[PY, str(FAKE / "sleeps.py")], stop_grace="2s")
    tick_until(w, lambda: (queue_dir / "running" / "same" / "supervisor.json").exists())
    shutil.rmtree(queue_dir / "running" / "same")
    # the watcher itself, not status.json: a snapshot written before the job started also says 0 running, and a file
    # dropped before the removal is noticed is rightly given the next id (same-2), which this test does not follow
    tick_until(w, lambda: w.jobs.get("same") is None, what="the removed job forgotten")
    write_job("same", command=[PY, "-c", "import time; time.sleep(4)"])
    tick_until(w, lambda: (queue_dir / "running" / "same" / "supervisor.json").exists(), what="the new job running")
    tick_until(w, lambda: (queue_dir / "done" / "same").is_dir() or (queue_dir / "failed" / "same").is_dir(), 30)
    run = load(queue_dir, "done/same/run.json")
    assert run["status"] == "done" and run["attempts"][-1]["exit_code"] == 0


def test_an_error_outside_any_job_is_logged_once_and_jobs_still_run(queue_dir, watcher_process, write_job):
    """status.json made a folder by mistake: every status write fails; the loop's last net keeps the queue going."""
    (queue_dir / "status.json").mkdir()
    wp = watcher_process()
    for n in range(3):
        write_job(f"j{n}")
    wait_until(lambda: all((queue_dir / "done" / f"j{n}").is_dir() for n in range(3)), 30, 0.1, what="jobs to run")
    assert wp.proc.poll() is None
    log = (queue_dir / "watcher.log").read_text()
    assert log.count("IsADirectoryError") >= 1 and log.count("Traceback (most recent call last)") == 1, log[-2000:]


# -- one injected fault per step ------------------------------------------------------------------
FAULTS = ",".join(f"{step}:f-{step}" for step in ("admit", "plan", "start", "watch", "finish", "retry", "recover"))


def test_an_exception_in_any_step_fails_only_that_job_and_the_watcher_lives(queue_dir, watcher_process, write_job):
    """TRAINQ_WATCHER_FAULTS raises inside each guarded step; each job ends visible, the pid stays the same."""
    (queue_dir / "pause.flag").touch()
    first = watcher_process()
    write_job("f-recover")
    wait_until(lambda: (queue_dir / "pending" / "f-recover").is_dir(), 20, what="f-recover accepted")
    first.stop()
    (queue_dir / "pause.flag").unlink()
    wp = watcher_process(env={"TRAINQ_WATCHER_FAULTS": FAULTS})
    pid = wp.proc.pid
    wait_until(lambda: (queue_dir / "failed" / "f-recover").is_dir(), 20, what="f-recover failed by recovery")
    write_job("f-admit")
    write_job("f-plan")
    write_job("f-start")
    write_job("f-watch", command=[PY, str(FAKE / "sleeps.py")], stop_grace="1s")
    write_job("f-finish")
    write_job(
        "f-retry", command=[PY, "-c", "raise SystemExit(3)"], retries={"max": 2, "on": ["unknown"], "backoff": "1s"}
    )
    write_job("ok", command=[PY, "-c", "print('fine')"], priority=-1)
    names = ["f-recover", "f-admit", "f-plan", "f-start", "f-watch", "f-finish", "f-retry"]
    wait_until(
        lambda: (
            all((queue_dir / "failed" / n / "run.json").exists() for n in names)
            and (queue_dir / "done" / "ok").is_dir()
        ),
        60,
        0.2,
        what="every job to end",
    )
    assert wp.proc.poll() is None, "the watcher died"
    for name in names:
        run = load(queue_dir, f"failed/{name}/run.json")
        want = "rejected" if name == "f-admit" else "failed"
        assert run["status"] == want, (name, run["status"])
        text = json.dumps(run)
        assert "InjectedFault" in text and name.split("-")[1] in text, (name, run.get("error"))
        if name != "f-admit":
            assert run["diagnosis"]["kind"] == "unknown" and "InjectedFault" in run["diagnosis"]["evidence"], name
    assert load(queue_dir, "failed/f-retry/run.json")["attempt"] == 1, "the retry step failed, so no second attempt"
    wait_until(lambda: status(queue_dir)["counts"]["failed"] == len(names), 10, what="status.json counts")
    snap = status(queue_dir)
    assert snap["watcher"]["pid"] == pid
    listed = {j["id"]: j for j in snap["jobs"]}
    assert all(listed[n]["state"] == "failed" and "InjectedFault" in (listed[n]["error"] or "") for n in names)
    log = (queue_dir / "watcher.log").read_text()
    assert log.count("Traceback (most recent call last)") >= len(names)
    for step in ("admit", "plan", "start", "watch", "finish", "retry", "recover"):
        assert f"step {step}" in log, step


def test_a_bad_fault_switch_stops_startup_with_one_line(queue_dir):
    import subprocess

    from conftest import REPO

    proc = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "watch", "--once"],
        env={**__import__("os").environ, "TRAINQ_WATCHER_FAULTS": "nosuchstep:x"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "TRAINQ_WATCHER_FAULTS" in proc.stderr and "nosuchstep" in proc.stderr


# -- recovery never harms a stranger ------------------------------------------------------------------
def test_recovery_after_a_reboot_fails_the_job_as_killed_and_signals_no_stranger(queue_dir, watcher):
    """A running/ folder left by a watcher that ran before a reboot, its recorded pgid reused by a stranger."""
    import os
    import subprocess

    stranger = subprocess.Popen(
        ["sleep", "300"],
        start_new_session=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("TRAINQ_")},
    )
    try:
        job = queue_dir / "running" / "before-reboot"
        job.mkdir()
        (job / "job.yaml").write_text("approved: true\ncommand: [sleep, '1000']\n")
        (job / "run.json").write_text(
            json.dumps(
                {
                    "schema_version": 1,
                    "id": "before-reboot",
                    "name": "before-reboot",
                    "status": "running",
                    "priority": 0,
                    "order": 1,
                    "submitted_at": "2026-01-01T00:00:00Z",
                    "started_at": "2026-01-01T00:00:01Z",
                    "attempt": 1,
                    "attempts": [{"n": 1, "pid": 4242, "started_at": "2026-01-01T00:00:01Z"}],
                }
            )
        )
        born = psutil.Process(stranger.pid).create_time() - 1.0  # "the job" started just before the stranger
        (job / "supervisor.json").write_text(
            json.dumps(
                {
                    "attempt": 1,
                    "supervisor_pid": 4242,
                    "job_pid": stranger.pid,
                    "pgid": stranger.pid,
                    "job_create_time": born,
                    "boot_time": psutil.boot_time() - 86400,
                    "boot_id": "00000000-0000-0000-0000-000000000000",
                }
            )
        )
        watcher()
        run = load(queue_dir, "failed/before-reboot/run.json")
        assert run["status"] == "failed" and run["diagnosis"]["kind"] == "killed"
        assert stranger.poll() is None, "recovery killed a process that was not the job's"
    finally:
        stranger.kill()
        stranger.wait()
