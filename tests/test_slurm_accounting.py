"""A cluster with accounting (slurmdbd): sacct tells how a job ended once slurmctld has forgotten it.

tests/slurm/start.sh with ``TRAINQ_SLURM_ACCOUNTING=1`` runs the one-node cluster with a real slurmdbd on a
private MariaDB and ``MinJobAge=2``: slurmctld purges a finished job within about 12 s, as a busy site's does
within minutes. The watcher detects accounting at its first poll (``scontrol show config``) and asks ``sacct``
about the jobs squeue no longer lists. Here a watcher is down while its job ends and is purged; the next one must
say how it really ended (Slurm's words), not "Slurm no longer knows job N".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from conftest import drop, tick_until, wait_until
from test_slurm import (  # noqa: F401  (the autouse clean-up fixture is used by name)
    CLUSTER_DIR,
    DEFAULT_CLUSTER,
    SLURM,
    _counting,
    _sh,
    finished,
    job_file,
    no_leftover_slurm_jobs,
    run_json,
    use_cluster,
)

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module", autouse=True)
def accounting_cluster():
    """The one-node cluster in accounting mode for this module (the next Slurm module's start switches back)."""
    yield from use_cluster({"TRAINQ_SLURM_ACCOUNTING": "1"})


def _purged(slurm_id: str) -> bool:
    """slurmctld no longer knows the job (squeue: "Invalid job id specified", or nothing)."""
    done = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%T", "-j", slurm_id], capture_output=True, text=True, timeout=60
    )
    return not done.stdout.strip()


def _started(w, queue_dir, name: str) -> str:
    log = queue_dir / "running" / name / "output.log"
    tick_until(w, lambda: log.exists() and "up" in log.read_text(), 60, f"{name} to start")
    return w.jobs[name].run["slurm_job_id"]


def test_a_job_cancelled_and_purged_while_no_watcher_looked_is_told_by_sacct(queue_dir, watcher, tmp_path, monkeypatch):
    sacct_calls = _counting(tmp_path, monkeypatch, "sacct")
    w = watcher(**SLURM)
    drop(queue_dir, "gone.yaml", job_file(command=["sh", "-c", "echo up; sleep 300"]))
    slurm_id = _started(w, queue_dir, "gone")
    w.close()  # the watcher is down from here on
    subprocess.run(["scancel", slurm_id], check=True, timeout=60)  # a user or an admin, not trainq
    wait_until(lambda: _purged(slurm_id), 90, 0.5, f"slurmctld to purge job {slurm_id}")
    w2 = watcher(**SLURM)
    done = tick_until(w2, lambda: finished(queue_dir, "gone"), 60, "gone to be concluded")
    run = run_json(done)
    assert run["status"] == "cancelled", run
    evidence = run["diagnosis"]["evidence"]
    assert "cancelled from outside trainq" in evidence and slurm_id in evidence, evidence
    assert "no longer knows" not in evidence
    assert any(f"-j {slurm_id}" in line for line in sacct_calls.read_text().splitlines())


def test_a_job_whose_node_side_died_without_a_record_gets_its_end_from_sacct(queue_dir, watcher, tmp_path, monkeypatch):
    """The node side and the job SIGKILLed (an OOM killer on the node, say): no exit record, the batch job ends
    FAILED; slurmctld forgets it before a watcher looks. The conclusion comes from sacct's record."""
    _counting(tmp_path, monkeypatch, "sacct")
    w = watcher(**SLURM)
    drop(queue_dir, "shot.yaml", job_file(command=["sh", "-c", "echo up; sleep 300"]))
    slurm_id = _started(w, queue_dir, "shot")
    folder = queue_dir / "running" / "shot"
    supervisor = json.loads((folder / "supervisor.json").read_text())
    w.close()
    os.killpg(supervisor["pgid"], signal.SIGKILL)
    os.kill(supervisor["supervisor_pid"], signal.SIGKILL)
    wait_until(lambda: _purged(slurm_id), 90, 0.5, f"slurmctld to purge job {slurm_id}")
    assert not (folder / "exit.json").exists()
    # no exit record: trainq waits exit_grace_s for one the shared filesystem may not show yet (60 s by default)
    w2 = watcher(executor="slurm", slurm={"poll_s": 0.2, "exit_grace_s": 5}, max_concurrent=4)
    done = tick_until(w2, lambda: finished(queue_dir, "shot"), 120, "shot to be concluded")
    run = run_json(done)
    assert run["status"] == "failed", run
    evidence = run["diagnosis"]["evidence"]
    assert "no longer knows" not in evidence, evidence
    record = json.loads((done / "exit.json").read_text())
    assert record.get("slurm_state") == "FAILED" and record.get("signal") == signal.SIGKILL, record


def test_a_real_qos_submit_limit_holds_the_job_back_until_a_slot_frees(queue_dir, watcher):
    """QOS normal allows 2 submitted jobs per user (sacctmgr; limits enforced): slurmctld refuses the third sbatch
    with QOSMaxSubmitJobPerUserLimit; trainq keeps it pending, says which limit, and submits it again."""
    limit = ["sacctmgr", "-i", "modify", "qos", "normal", "set"]
    subprocess.run([*limit, "MaxSubmitJobsPerUser=2"], check=True, capture_output=True, timeout=60)
    try:
        w = watcher(**SLURM)
        w.executor.limit_retry_s = 1.0  # the real wait is 30 s; only the wait shrinks here
        for name in ("q1", "q2", "q3"):
            drop(queue_dir, f"{name}.yaml", job_file(command=["sh", "-c", "sleep 3; echo in"]))
        seen: list[str] = []

        def one_held_back() -> bool:
            waiting = [w.jobs[n].run.get("waiting_for") or "" for n in ("q1", "q2", "q3") if n in w.jobs]
            seen.extend(x for x in waiting if "QOSMaxSubmitJobPerUserLimit" in x)
            return bool(seen)

        tick_until(w, one_held_back, 60, "Slurm's QOS limit to hold a job back")
        assert "submitting again" in seen[0] and "violates accounting/QOS policy" in seen[0], seen[0]
        for name in ("q1", "q2", "q3"):
            done = tick_until(w, lambda n=name: finished(queue_dir, n), 90, f"{name} to run")
            run = run_json(done)
            assert done.parent.name == "done" and len(run["attempts"]) == 1, run
    finally:
        subprocess.run([*limit, "MaxSubmitJobsPerUser=-1"], check=True, capture_output=True, timeout=60)


def test_stop_sh_stops_slurmdbd_and_its_database_too():
    """stop.sh's glob for slurmd's pid files (slurmd*.pid) matched slurmdbd.pid: it dropped that file, took
    slurmdbd for a slurmd whose name did not match, and left it running on a stopped MariaDB; the next
    accounting start failed (found running the suite twice on one machine). Last in this module: it stops the
    cluster, then brings it back for the fixture's own stop."""
    pids = {name: int((CLUSTER_DIR / f"{name}.pid").read_text()) for name in ("slurmdbd", "mariadbd")}
    try:
        stopped = _sh("stop.sh")
        assert stopped.returncode == 0, stopped.stderr
        for name, pid in pids.items():
            wait_until(lambda pid=pid: not _running(pid), 20, what=f"{name} ({pid}) to stop")
    finally:
        again = _sh("start.sh", env={**DEFAULT_CLUSTER, "TRAINQ_SLURM_ACCOUNTING": "1"})
    assert again.returncode == 0, again.stderr


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return "\nState:\tZ" not in status.read()
    except FileNotFoundError:
        return False
