"""executor: slurm at a cluster's scale (issue 25), on the in-repo one-node Slurm (tests/slurm/start.sh).

Every way a job can leave Slurm gets its own diagnosis; the node's heartbeat is watched while Slurm says RUNNING;
the polls ask only about the queue's own jobs and space out while nothing changes; sbatch never holds up the loop.
Jobs are real batch jobs run by slurmd under trainq's real node side. Two Slurm answers this one-node cluster
cannot give (a QOS submit limit needs slurmdbd; a slow controller) come from an sbatch wrapper on PATH that
prints Slurm's own words, then runs the real sbatch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import drop, tick_until
from test_slurm import (  # noqa: F401  (the cluster fixtures are used by name)
    SLURM,
    _counting,
    _live_slurm_ids,
    finished,
    job_file,
    no_leftover_slurm_jobs,
    run_json,
    slurm_cluster,
    slurm_state,
    status_job,
)

from trainq.watcher.slurm.batch import effective_time_min, short_limit_warning, signal_lead_s
from trainq.watcher.slurm.state import decode_status, parse_sacct, parse_squeue

pytestmark = pytest.mark.slurm

#: Slurm's own words when a QOS limit on submitted jobs refuses sbatch (slurmdbd with AccountingStorageEnforce)
QOS_LIMIT = (
    "sbatch: error: QOSMaxSubmitJobPerUserLimit\nsbatch: error: Batch job submission failed: Job violates "
    "accounting/QOS policy (job submit limit, user's size and/or time limits)\n"
)


def _wrapped_sbatch(tmp_path: Path, monkeypatch, body: str) -> Path:
    """An sbatch first on PATH that runs ``body`` (sh) and then the real sbatch; returns its folder."""
    wrapper = tmp_path / "bin" / "sbatch"
    wrapper.parent.mkdir(exist_ok=True)
    wrapper.write_text(f'#!/bin/sh\n{body}\nexec {shutil.which("sbatch")} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}:{os.environ['PATH']}")
    return wrapper.parent


# -- pure parts ------------------------------------------------------------------------------------


def test_squeue_and_sacct_answers_are_read_with_their_exit_status():
    out = (
        "4|FAILED|NonZeroExitCode|vm|768|(null)|\n5_2|PENDING|JobHeldUser|n/a|0|trainq:k:grid:array:t|x|\n"
        "6|CANCELLED|None|vm|15|trainq:k:j:1:t|\n"
    )
    jobs = parse_squeue(out)
    assert (jobs["4"].state, jobs["4"].exit_code, jobs["4"].exit_signal, jobs["4"].node) == ("FAILED", 3, None, "vm")
    assert jobs["5_2"].comment == "trainq:k:grid:array:t|x" and jobs["5_2"].node == ""  # a "|" in a tag stays
    assert (jobs["6"].exit_code, jobs["6"].exit_signal) == (None, 15)
    assert decode_status("") == (None, None) and decode_status("9") == (None, 9) and decode_status("0") == (0, None)
    sacct = parse_sacct("12|CANCELLED by 0|0:15|n1|None\n12.batch|CANCELLED|0:15|n1|\n13|COMPLETED|0:0|n2|None\n")
    assert set(sacct) == {"12", "13"} and sacct["12"].state == "CANCELLED" and sacct["12"].exit_signal == 15
    assert (sacct["13"].state, sacct["13"].exit_code, sacct["13"].node) == ("COMPLETED", 0, "n2")


def test_the_time_limit_warning_takes_at_most_half_of_a_short_limit():
    """--signal's lead is stop_grace + kill_after (>= 60 s) but at most half the time limit, --time in sbatch_args
    included: --time=2 with the default 125 s lead would stop every attempt the moment it starts."""
    assert signal_lead_s(120, 5) == 125 and signal_lead_s(0, 5) == 60
    assert signal_lead_s(120, 5, effective_time_min(None, ("--time=2",))) == 60
    assert signal_lead_s(120, 5, effective_time_min(9, ("-t", "1"))) == 30
    assert signal_lead_s(120, 5, effective_time_min(9, ("--time=1-0",))) == 125
    assert effective_time_min(9, ("--time=1:30",)) == 1.5 and effective_time_min(4, ("--time=UNLIMITED",)) is None
    # a limit of at most the lead + 60 s: Slurm's early warning may come at once, and the submission says so
    assert "at least --time=2" in short_limit_warning("--time=1 from the job file's slurm.sbatch_args", 1, 30)
    assert short_limit_warning("x", 3, 125) and short_limit_warning("x", 4, 125) is None
    assert short_limit_warning("x", None, 125) is None


# -- every way out of Slurm ---------------------------------------------------------------------------


def test_a_running_job_cancelled_from_outside_ends_cancelled_and_is_not_retried(queue_dir, watcher):
    w = watcher(**SLURM)
    drop(
        queue_dir,
        "victim.yaml",
        job_file(
            command=["sh", "-c", "echo up; sleep 300"],
            retries={"max": 2, "on": ["preempted", "killed", "unknown"], "backoff": "1s"},
        ),
    )
    log = queue_dir / "running" / "victim" / "output.log"
    tick_until(w, lambda: log.exists() and "up" in log.read_text(), 30, "victim to start")
    slurm_id = w.jobs["victim"].run["slurm_job_id"]
    subprocess.run(["scancel", slurm_id], check=True, timeout=60)  # a user or an admin, not trainq
    done = tick_until(w, lambda: finished(queue_dir, "victim"), 40, "victim to end")
    run = run_json(done)
    assert run["status"] == "cancelled" and len(run["attempts"]) == 1, run
    assert "cancelled from outside trainq" in run["diagnosis"]["evidence"] and slurm_id in run["diagnosis"]["evidence"]
    assert "retry.flag" in run["diagnosis"]["advice"]
    assert slurm_state(slurm_id) == "CANCELLED"


def test_a_queued_array_task_cancelled_from_outside_is_cancelled_and_the_array_is_throttled(queue_dir, watcher):
    """Slurm keeps no record of an array task cancelled before it started: trainq says cancelled, not "the queue
    root must be on a shared filesystem". slurm.array_limit: 2 becomes --array=1-3%2."""
    w = watcher(executor="slurm", slurm={"poll_s": 0.2, "array_limit": 2}, max_concurrent=8)
    drop(
        queue_dir,
        "held.yaml",
        job_file(command=["echo", "{x}"], sweep={"x": [1, 2, 3]}, slurm={"sbatch_args": ["--hold"]}),
    )
    ids = [f"held-{i}" for i in (1, 2, 3)]
    tick_until(
        w,
        lambda: all(i in w.jobs and w.jobs[i].run.get("waiting_for") == "Slurm: JobHeldUser" for i in ids),
        30,
        "the array to wait in Slurm",
    )
    sbatch = json.loads((queue_dir / "running" / "held-2" / "slurm.json").read_text())["sbatch"]
    assert "--array=1-3%2" in sbatch
    task = w.jobs["held-2"].run["slurm_job_id"]
    subprocess.run(["scancel", task], check=True, timeout=60)
    done = tick_until(w, lambda: finished(queue_dir, "held-2"), 40, "held-2 to end")
    run = run_json(done)
    assert run["status"] == "cancelled", run
    assert "before it started" in run["diagnosis"]["evidence"] and "shared filesystem" not in json.dumps(run)
    assert all(w.jobs[i].run.get("waiting_for") == "Slurm: JobHeldUser" for i in ("held-1", "held-3"))
    subprocess.run(["scancel", task.partition("_")[0]], check=True, timeout=60)  # squeue shows it as 12_[1,3%2]


def test_a_job_slurm_no_longer_knows_says_so_and_what_was_last_known(queue_dir, watcher):
    """A job purged from slurmctld (MinJobAge) before its end was seen: here an id Slurm never had, put where a
    watcher that was down for an hour would find a purged one."""
    w = watcher(**SLURM)
    drop(queue_dir, "lost.yaml", job_file(command=["true"], slurm={"sbatch_args": ["--hold"]}))
    tick_until(
        w,
        lambda: "lost" in w.jobs and w.jobs["lost"].run.get("waiting_for") == "Slurm: JobHeldUser",
        30,
        "lost to wait in Slurm",
    )
    real = w.jobs["lost"].run["slurm_job_id"]
    w.close()
    subprocess.run(["scancel", real], check=True, timeout=60)
    folder = queue_dir / "running" / "lost"
    purged = str(int(real) + 1_000_000)
    for name in ("run.json", "slurm.json"):
        (folder / name).write_text((folder / name).read_text().replace(f'"{real}"', f'"{purged}"'))
    w2 = watcher(**SLURM)
    done = tick_until(w2, lambda: finished(queue_dir, "lost"), 40, "lost to be concluded")
    run = run_json(done)
    assert run["status"] == "failed" and run["diagnosis"]["kind"] == "unknown", run
    evidence = run["diagnosis"]["evidence"]
    assert f"Slurm no longer knows job {purged}" in evidence and "last known: submitted at" in evidence
    assert "shared filesystem" not in evidence and "MinJobAge" in run["diagnosis"]["advice"]


def test_one_rank_failing_gives_its_own_exit_code_not_sruns(queue_dir, watcher):
    w = watcher(**SLURM)
    cmd = ["sh", "-c", "if [ $RANK = 1 ]; then echo rank 1 fails; exit 7; fi; sleep 120"]
    drop(
        queue_dir,
        "ranks.yaml",
        job_file(
            command=cmd,
            resources={"nodes": 1, "tasks_per_node": 2},
            retries={"max": 1, "on": ["preempted"], "backoff": "1s"},
        ),
    )
    done = tick_until(w, lambda: finished(queue_dir, "ranks"), 60, "ranks to fail")
    run = run_json(done)
    attempt = run["attempts"][-1]
    assert len(run["attempts"]) == 1 and attempt["exit_code"] == 7, run
    assert run["diagnosis"]["kind"] == "unknown" and "rank 1 exited 7" in run["diagnosis"]["evidence"]
    assert attempt["failed_rank"] == 1 and attempt["srun_exit_code"] not in (None, 7), attempt
    record = json.loads((done / "exit.json").read_text())  # the exit record says it too: srun's status beside it
    assert (record["exit_code"], record["failed_rank"], record["srun_exit_code"]) == (7, 1, attempt["srun_exit_code"])


def test_a_submit_limit_makes_the_job_wait_then_submits_it_again(queue_dir, watcher, tmp_path, monkeypatch):
    """QOSMaxSubmitJobPerUserLimit (once): the job goes back to pending, waiting_for names the limit, and it runs
    once the limit lets it in; nothing fails."""
    once, said = tmp_path / "limited-once", tmp_path / "qos-limit.txt"
    said.write_text(QOS_LIMIT)
    _wrapped_sbatch(tmp_path, monkeypatch, f"[ -e {once} ] || {{ touch {once}; cat {said} >&2; exit 1; }}")
    w = watcher(**SLURM)
    w.executor.limit_retry_s = 1.0  # the real wait is 30 s; only the wait shrinks here
    drop(queue_dir, "limited.yaml", job_file(command=["echo", "in at last"]))
    tick_until(
        w,
        lambda: (
            "limited" in w.jobs and "QOSMaxSubmitJobPerUserLimit" in (w.jobs["limited"].run.get("waiting_for") or "")
        ),
        30,
        "the limit to hold the job",
    )
    assert (queue_dir / "pending" / "limited").is_dir() and w.jobs["limited"].run["attempt"] == 0
    done = tick_until(w, lambda: finished(queue_dir, "limited"), 40, "limited to run")
    run = run_json(done)
    assert (
        done.parent.name == "done" and len(run["attempts"]) == 1 and "in at last" in (done / "output.log").read_text()
    )


# -- the loop never waits on sbatch, and asks Slurm little --------------------------------------------


def test_the_loop_goes_on_while_sbatch_hangs(queue_dir, watcher, tmp_path, monkeypatch):
    """sbatch blocks (a controller that does not answer) until the test lets it go: meanwhile the loop runs,
    status.json is rewritten and says the job is being submitted, and a stop of another job is carried out."""
    go = tmp_path / "go"
    _wrapped_sbatch(tmp_path, monkeypatch, f"while [ ! -e {go} ]; do sleep 0.05; done")
    w = watcher(**SLURM)
    drop(queue_dir, "early.yaml", job_file(command=["sleep", "300"], slurm={"sbatch_args": ["--hold"]}))
    tick_until(
        w,
        lambda: (status_job(queue_dir, "early") or {}).get("waiting_for") == "Slurm: being submitted (sbatch)",
        30,
        "early to be in sbatch",
    )
    before = json.loads((queue_dir / "status.json").read_text())["watcher"]["heartbeat_at"]
    (queue_dir / "running" / "early" / "stop.flag").touch()
    drop(queue_dir, "late.yaml", job_file(command=["true"]))
    tick_until(
        w,
        lambda: (
            "late" in w.jobs
            and json.loads((queue_dir / "status.json").read_text())["watcher"]["heartbeat_at"] != before
        ),
        30,
        "the loop to go on while sbatch hangs",
    )
    go.touch()
    tick_until(w, lambda: finished(queue_dir, "early") and finished(queue_dir, "late"), 40, "both to end")
    assert run_json(finished(queue_dir, "early"))["status"] == "cancelled"
    assert finished(queue_dir, "late").parent.name == "done"


def test_polls_ask_only_about_the_queues_jobs_and_space_out_while_nothing_changes(
    queue_dir, watcher, tmp_path, monkeypatch
):
    calls = _counting(tmp_path, monkeypatch, "squeue")
    w = watcher(executor="slurm", slurm={"poll_s": 0.2, "poll_max_s": 1.6}, max_concurrent=8)
    for i in range(3):
        drop(queue_dir, f"h{i}.yaml", job_file(command=["true"], slurm={"sbatch_args": ["--hold"]}))
    tick_until(
        w,
        lambda: all(
            ((w.jobs.get(f"h{i}") and w.jobs[f"h{i}"].run.get("waiting_for")) or "") == "Slurm: JobHeldUser"
            for i in range(3)
        ),
        30,
        "three to wait in Slurm",
    )
    ids = sorted(w.jobs[f"h{i}"].run["slurm_job_id"] for i in range(3))
    calls.write_text("")
    tick_until(
        w,
        lambda: w.executor._interval_s == 1.6 and len(calls.read_text().splitlines()) >= 4,
        30,
        "the polls to space out",
    )
    asked = calls.read_text().splitlines()
    assert all("--me" not in line and f"-j {','.join(sorted(ids, key=int))}" in line for line in asked), asked
    drop(queue_dir, "more.yaml", job_file(command=["true"]))  # an event: a submission
    tick_until(w, lambda: finished(queue_dir, "more"), 30, "more to run")
    assert w.executor._interval_s < 1.6


# -- the node's health while Slurm says RUNNING ---------------------------------------------------------


def test_a_silent_node_is_stalled_then_cancelled_and_retried_as_preempted(queue_dir, watcher):
    """The node side stops (SIGSTOP: a hung node) while Slurm says RUNNING: after 3 heartbeat periods the job
    shows stalled, after 18 trainq cancels it as a node failure; attempt 2 runs. Heartbeat 0.3 s here."""
    w = watcher(executor="slurm", slurm={"poll_s": 0.2, "heartbeat_s": 0.3}, max_concurrent=4)
    cmd = ["sh", "-c", "echo attempt $TRAINQ_ATTEMPT; [ $TRAINQ_ATTEMPT = 2 ] && exit 0; sleep 300"]
    drop(queue_dir, "hung.yaml", job_file(command=cmd, retries={"max": 1, "on": ["preempted"], "backoff": "1s"}))
    folder = queue_dir / "running" / "hung"
    tick_until(
        w, lambda: (folder / "supervisor.json").exists() and (folder / "heartbeat.json").exists(), 30, "hung to start"
    )
    node_side = json.loads((folder / "supervisor.json").read_text())["supervisor_pid"]
    os.kill(node_side, signal.SIGSTOP)
    try:
        tick_until(
            w, lambda: (status_job(queue_dir, "hung") or {}).get("health") == "stalled", 30, "hung to show stalled"
        )
        assert "no heartbeat" in (w.jobs["hung"].run.get("health_reason") or "")
        tick_until(
            w,
            lambda: (w.jobs.get("hung") is not None and w.jobs["hung"].attempt == 2) or finished(queue_dir, "hung"),
            60,
            "trainq to give up on the node",
        )
    finally:
        try:
            os.kill(node_side, signal.SIGCONT)
        except ProcessLookupError:
            pass  # Slurm's cancel ended it (SIGCONT, SIGTERM, then SIGKILL after KillWait)
    done = tick_until(w, lambda: finished(queue_dir, "hung"), 60, "attempt 2 to finish")
    run = run_json(done)
    assert done.parent.name == "done" and len(run["attempts"]) == 2, run
    first = run["attempts"][0]["diagnosis"]
    assert first["kind"] == "preempted" and "node failure" in first["evidence"] and "no heartbeat" in first["evidence"]
    assert json.loads((done / "slurm.json").read_text()).get("node_lost") is None  # attempt 2's record


def test_the_node_side_outlives_an_unwritable_folder_and_the_job_ends_once_it_is_writable(queue_dir, watcher):
    """The job folder turns unwritable (chattr +i) as the job ends: the node-side supervisor retries its exit
    record instead of crashing, and the job is done as soon as the folder is writable again."""
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr (e2fsprogs)")
    probe = queue_dir.parent / "probe"
    probe.mkdir()
    if subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem has no immutable flag")
    subprocess.run(["chattr", "-i", str(probe)], check=True)
    w = watcher(**SLURM)
    drop(queue_dir, "frozen.yaml", job_file(command=["sh", "-c", 'echo finishing; chattr +i "$TRAINQ_JOB_DIR"']))
    folder = queue_dir / "running" / "frozen"
    try:
        tick_until(
            w,
            lambda: (
                "cannot write the exit record"
                in ((folder / "output.log").read_text() if (folder / "output.log").exists() else "")
            ),
            30,
            "the supervisor to find its folder unwritable",
        )
        slurm_id = w.jobs["frozen"].run["slurm_job_id"]
        assert slurm_id in _live_slurm_ids() and "frozen" in w.jobs  # alive and waiting, not crashed
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    done = tick_until(w, lambda: finished(queue_dir, "frozen"), 40, "frozen to end once writable")
    assert done.parent.name == "done" and run_json(done)["attempts"][-1]["exit_code"] == 0
    assert slurm_state(slurm_id) == "COMPLETED"
