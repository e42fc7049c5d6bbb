"""Slurm taking a running job away, for real, on the in-repo one-node cluster (tests/slurm/start.sh).

Two ways a cluster ends a job that did nothing wrong, each done by Slurm itself, not simulated: a job in the
higher-priority partition ``urgent`` preempts it (``PreemptType=preempt/partition_prio``, ``PreemptMode=CANCEL``:
SIGTERM, then SIGKILL after ``KillWait``), and an admin marks its node DOWN (``scontrol update State=DOWN``), which
Slurm records as NODE_FAIL. Both must end the attempt ``preempted`` with Slurm's words and be retried from the
job's own checkpoint when ``retries`` allows it.
"""

from __future__ import annotations

import socket
import subprocess

import pytest
from conftest import drop, tick_until, wait_until
from test_slurm import (  # noqa: F401  (the cluster fixtures are used by name)
    SLURM,
    finished,
    job_file,
    no_leftover_slurm_jobs,
    run_json,
    slurm_cluster,
    slurm_state,
)

pytestmark = pytest.mark.slurm

#: a command job that counts in its own checkpoint file and resumes from it: attempt 1 counts until Slurm takes it
#: away (at most 150 s), attempt 2 goes on from where 1 stopped and ends 20 counts later
COUNTER = (
    "n=$(cat count 2>/dev/null || echo 0); echo attempt $TRAINQ_ATTEMPT from $n; "
    "if [ $TRAINQ_ATTEMPT = 1 ]; then end=3000; else end=$((n + 20)); fi; "
    "trap 'echo stopping at $n; exit 143' TERM; "
    "while [ $n -lt $end ]; do n=$((n+1)); echo $n > count.tmp && mv count.tmp count; sleep 0.05; done; "
    "echo finished at $n"
)


def _counter_job(name: str, queue_dir) -> None:
    """The counter with the whole node (``--exclusive``), so anything else that must run has to take it away."""
    drop(
        queue_dir,
        f"{name}.yaml",
        job_file(
            command=["sh", "-c", COUNTER],
            retries={"max": 1, "on": ["preempted"], "backoff": "1s"},
            slurm={"sbatch_args": ["--exclusive"]},
        ),
    )


def _state_now(slurm_id: str) -> str:
    """What squeue shows for the job now (no waiting: the watcher must go on ticking)."""
    return subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%T", "-j", slurm_id], capture_output=True, text=True, timeout=60
    ).stdout.strip()


def _back_in_service(host: str) -> None:
    """RESUME the node (ReturnToService=2 may already have: slurmd's next registration returns a DOWN node, and
    RESUME then says "Invalid node state specified"), and wait until Slurm may schedule on it again."""
    subprocess.run(["scontrol", "update", f"NodeName={host}", "State=RESUME"], capture_output=True, timeout=60)

    def usable() -> bool:
        state = subprocess.run(
            ["sinfo", "-h", "-n", host, "-o", "%T"], capture_output=True, text=True, timeout=60
        ).stdout.strip()
        if state.startswith(("down", "drain", "fail")):
            subprocess.run(["scontrol", "update", f"NodeName={host}", "State=RESUME"], capture_output=True, timeout=60)
            return False
        return bool(state)

    wait_until(usable, 60, 0.5, f"node {host} back in service")


def _counted(queue_dir, name: str) -> int:
    for state in ("running", "done", "failed"):
        count = queue_dir / state / name / "count"
        if count.exists():
            try:
                return int(count.read_text() or 0)
            except ValueError:
                return 0
    return 0


def test_a_job_preempted_by_a_higher_priority_partition_is_retried_from_where_it_stopped(queue_dir, watcher):
    w = watcher(**SLURM)
    _counter_job("low", queue_dir)
    tick_until(w, lambda: _counted(queue_dir, "low") > 20, 60, "low to count")
    first_id = w.jobs["low"].run["slurm_job_id"]
    urgent = subprocess.run(
        ["sbatch", "--parsable", "--partition=urgent", "--exclusive", "--output=/dev/null", "--wrap", "sleep 3"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    urgent_id = urgent.stdout.strip().split(";")[0]
    try:
        tick_until(
            w,
            lambda: (w.jobs.get("low") is not None and w.jobs["low"].attempt == 2) or finished(queue_dir, "low"),
            90,
            "Slurm to preempt low and trainq to retry it",
        )
        stopped_at = _counted(queue_dir, "low")
        retrying = tick_until(
            w,
            lambda: (e := _entry(queue_dir, "low")).get("story", {}).get("previous") and e,
            60,
            "the retry's story in status.json",
        )
        done = tick_until(w, lambda: finished(queue_dir, "low"), 120, "attempt 2 to finish")
    finally:
        subprocess.run(["scancel", urgent_id], timeout=60)
    assert slurm_state(first_id) == "PREEMPTED"
    run = run_json(done)
    assert done.parent.name == "done" and len(run["attempts"]) == 2, run
    first = run["attempts"][0]["diagnosis"]
    assert first["kind"] == "preempted" and "Slurm preempted the job on node" in first["evidence"], first
    log = (done / "output.log").read_text()
    assert "finished at" in log
    resumed_from = int(log.split("attempt 2 from ")[1].split()[0])
    assert resumed_from >= stopped_at - 1 > 0  # attempt 2 went on from attempt 1's last count, not from 0
    _assert_preemption_story(queue_dir, done, retrying, w)


def _entry(root, job_id: str) -> dict:
    import json

    try:
        jobs = json.loads((root / "status.json").read_text()).get("jobs", [])
    except (OSError, ValueError):
        return {}
    return next((j for j in jobs if j["id"] == job_id), {})


def _assert_preemption_story(root, done, retrying: dict, w) -> None:
    """The reason (docs/contract.md, why a job stopped): trainq did not stop a preempted job, so no face gives it a reason; the retry's story
    is attempt 2's, with attempt 1's preemption one line below, and nobody advises retry.flag meanwhile."""
    import json

    story = retrying["story"]
    assert story["previous"].startswith("attempt 1 ended: preempted: "), story
    assert not story["headline"].startswith("preempted") and "retry.flag" not in json.dumps(story), story
    run = run_json(done)
    assert "reason" not in run and all(a.get("reason") is None for a in run["attempts"]), run
    events = [json.loads(x) for x in (done / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "stopping"], events
    assert all("reason" not in e for e in events if e["event"] in ("exited", "finished")), events
    history = [json.loads(x) for x in (root / "history.jsonl").read_text().splitlines()]
    assert "reason" not in [h for h in history if h["id"] == done.name][-1]
    entry = tick_until(w, lambda: (e := _entry(root, done.name)).get("state") == "done" and e, 30, "done listed")
    assert entry.get("reason") is None and entry["story"]["headline"] == "", entry


def test_a_node_marked_down_under_a_running_job_is_node_fail_and_the_job_runs_again(queue_dir, watcher):
    host = socket.gethostname().split(".")[0]
    w = watcher(**SLURM)
    _counter_job("unlucky", queue_dir)
    tick_until(w, lambda: _counted(queue_dir, "unlucky") > 20, 60, "unlucky to count")
    first_id = w.jobs["unlucky"].run["slurm_job_id"]
    down = ["scontrol", "update", f"NodeName={host}", "State=DOWN", "Reason=trainq test: node failure"]
    subprocess.run(down, check=True, timeout=60)
    try:
        tick_until(w, lambda: _state_now(first_id) == "NODE_FAIL", 60, "Slurm to end the job NODE_FAIL")
    finally:
        _back_in_service(host)
    done = tick_until(w, lambda: finished(queue_dir, "unlucky"), 120, "attempt 2 to finish")
    run = run_json(done)
    assert done.parent.name == "done" and len(run["attempts"]) == 2, run
    first = run["attempts"][0]["diagnosis"]
    assert first["kind"] == "preempted" and "failed while running the job (NODE_FAIL)" in first["evidence"], first
    assert f"node {host}" in first["evidence"]
    assert "finished at" in (done / "output.log").read_text()
