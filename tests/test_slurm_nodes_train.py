"""The built-in trainer across Slurm nodes: one gloo world over the bridge of ``TRAINQ_SLURM_NODES=3``.

Each node runs one torchrun agent (``resources.nodes`` > 1 is one srun task per node); rank 0's node hosts the
static rendezvous at ``MASTER_ADDR``. The reference is the same job trained on one machine with the same world
size and global batch: the 2-node run must end with bitwise the same adapter.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest
from conftest import drop, tick_until
from test_slurm import (  # noqa: F401  (the autouse clean-up fixture is used by name)
    SLURM,
    finished,
    job_file,
    no_leftover_slurm_jobs,
    run_json,
)
from test_slurm_nodes import nodes_cluster, restart_nodes  # noqa: F401  (the module's cluster fixture, by name)
from trainer_util import BASE_TRAIN, build_tiny, output, records, run_trainer, summary, write_job

pytestmark = pytest.mark.slurm
pytest.importorskip("torch", reason="the training stack (pip install -e '.[train]') is not installed")

#: the run every test here trains (or resumes) to its end: short, with evals and checkpoints on the way
TRAIN = {**BASE_TRAIN, "max_steps": 12, "eval_every": 4, "log_every": 4, "checkpoint": {"every_steps": 4, "keep": 2}}
#: one thread per rank wherever it runs: the reference's ranks get one, so a node's single rank must too (the
#: trainer's default would give it both cores, and another reduction order in the matrix products)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
#: a guard against a hang, never a timing assertion (the machine is shared and loaded)
HANG_GUARD_S = 600


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def one_machine(tiny, tmp_path_factory) -> Path:
    """The reference: 2 ranks on this machine (world size 2, batch 4 per rank), by hand, without Slurm."""
    job = write_job(tmp_path_factory.mktemp("one") / "ref", tiny, **TRAIN, processes=2)
    assert run_trainer(job, timeout_s=HANG_GUARD_S) == 0, output(job)[-3000:]
    return job


def weights_sha256(job_dir: Path) -> str:
    files = sorted((job_dir / "adapter").glob("*.safetensors"))
    assert files, f"no weights in {job_dir / 'adapter'}"
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def train_job(tiny: Path, nodes: int = 2, processes: int = 1, env: dict | None = None, **job: object) -> str:
    train = {
        **TRAIN,
        "model": str(tiny / "model"),
        "data": {"train": str(tiny / "train.jsonl"), "eval": str(tiny / "eval.jsonl")},
        "processes": processes,
    }
    return job_file(train=train, resources={"nodes": nodes}, env={**ONE_THREAD, **(env or {})}, **job)


def test_two_nodes_train_one_world_to_done_bitwise_equal_to_one_machine(one_machine, tiny, queue_dir, watcher):
    w = watcher(**SLURM)
    drop(queue_dir, "across.yaml", train_job(tiny))
    done = tick_until(w, lambda: finished(queue_dir, "across"), HANG_GUARD_S, "the 2-node train job to finish")
    log = output(done)
    assert done.parent.name == "done", log[-4000:]
    assert "[rank 0] trainq: rank 0 of 2" in log and "[rank 1] trainq: rank 1 of 2" in log
    got = summary(done)
    assert got["outcome"] == "done" and got["world_size"] == 2 and got["steps"] == TRAIN["max_steps"]
    hosts = got["hosts"]
    assert len(hosts) == 2 and all(h.startswith("node") for h in hosts), got  # two hosts, not this machine
    assert json.loads((done / "env.json").read_text())["hosts"] == hosts
    assert summary(one_machine)["hosts"] == [got_host(one_machine)]
    assert weights_sha256(done) == weights_sha256(one_machine)
    assert run_json(done)["slurm_job_id"]


@pytest.fixture(scope="module")
def one_machine_four(tiny, tmp_path_factory) -> Path:
    """The reference for 2 nodes x 2 ranks: 4 ranks on this machine (world size 4, batch 4 per rank), by hand;
    4 ranks on these 2 cores need ``oversubscribe`` (it changes no number)."""
    job = write_job(tmp_path_factory.mktemp("one4") / "ref", tiny, **TRAIN, processes=4, oversubscribe=True)
    assert run_trainer(job, timeout_s=HANG_GUARD_S) == 0, output(job)[-3000:]
    return job


@pytest.mark.slow
def test_two_nodes_of_two_ranks_train_one_world_of_four_bitwise_equal_to_one_machine(
    one_machine_four, tiny, queue_dir, watcher
):
    w = watcher(**SLURM)
    drop(queue_dir, "quad.yaml", train_job(tiny, processes=2))
    done = tick_until(w, lambda: finished(queue_dir, "quad"), HANG_GUARD_S, "the 2-node x 2-rank train job to finish")
    log = output(done)
    assert done.parent.name == "done", log[-4000:]
    assert all(f"[rank {r}] trainq: rank {r} of 4" in log for r in range(4)), log[-4000:]
    got = summary(done)
    assert got["outcome"] == "done" and got["world_size"] == 4 and got["steps"] == TRAIN["max_steps"]
    hosts = got["hosts"]
    assert len(hosts) == 2 and all(h.startswith("node") for h in hosts), got  # each host once, in rank order
    assert json.loads((done / "env.json").read_text())["hosts"] == hosts
    assert summary(one_machine_four)["world_size"] == 4
    ours, reference = weights_sha256(done), weights_sha256(one_machine_four)
    print(f"\n2 nodes x 2 ranks on {hosts}: adapter sha256 {ours}; 1 machine x 4 ranks: {reference}")
    assert ours == reference


def got_host(job_dir: Path) -> str:
    return json.loads((job_dir / "env.json").read_text())["hosts"][0]


# -- faults across nodes ------------------------------------------------------------------------------------------

#: slow steps (the faults below strike mid-run) that change nothing in the numbers
SLOW = {"TRAINQ_TRAINER_FAULTS": "sleep_per_step=0.5"}


def time_to_end(fault: str, fault_at: float, done: Path, attempt: int = 0) -> None:
    """The fault table's last column (docs/slurm.md): printed (pytest -s), never asserted, since a loaded machine is
    slow. From the fault to the end of the attempt it struck (its exit record's ended_at) and to this test seeing
    the job concluded."""
    run = run_json(done)
    ended_at = datetime.fromisoformat(run["attempts"][attempt]["ended_at"]).timestamp()
    kind = (run["attempts"][attempt].get("diagnosis") or {}).get("kind") or run["status"]
    print(
        f"\n[fault table] {fault}: attempt {attempt + 1} {kind}"
        f" ended {ended_at - fault_at:.1f} s after the fault; concluded {time.time() - fault_at:.1f} s after it"
        f" (load {os.getloadavg()[0]:.1f})"
    )


def last_step(job_dir: Path) -> int:
    steps = [r.get("step") or 0 for r in records(job_dir, "step")]
    return max(steps, default=0)


def checkpointed(job_dir: Path, step: int) -> bool:
    return (job_dir / "checkpoints" / f"step-{step:06d}" / "manifest.json").is_file()


def rank_process(job_dir: Path, rank: int) -> psutil.Process | None:
    """The rank's trainer process (torchrun's child), wherever its node's namespace is: one process table here."""
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            line = " ".join(proc.cmdline())
            if env.get("TORCHELASTIC_RUN_ID") and env.get("RANK") == str(rank) and str(job_dir.name) in line:
                return proc
        except (psutil.Error, KeyError):
            continue
    return None


def started(w, queue_dir: Path, name: str, what) -> Path:
    folder = queue_dir / "running" / name
    tick_until(w, lambda: folder.is_dir() and what(folder), HANG_GUARD_S, f"{name} to get going")
    return folder


def job_hosts(w, name: str) -> list[str]:
    """The nodes Slurm gave the job's current attempt, first (the batch host, rank 0's) first."""
    slurm_id = w.jobs[name].run["slurm_job_id"]
    listed = subprocess.run(["squeue", "-h", "-j", slurm_id, "-o", "%N"], capture_output=True, text=True, timeout=60)
    names = subprocess.run(
        ["scontrol", "show", "hostnames", listed.stdout.strip()], capture_output=True, text=True, timeout=60
    )
    return names.stdout.split()


def test_stop_flag_across_nodes_checkpoints_every_node_exits_0_and_resumes_bitwise(
    one_machine, tiny, queue_dir, watcher
):
    w = watcher(**SLURM)
    drop(queue_dir, "halt.yaml", train_job(tiny, env=SLOW))
    folder = started(w, queue_dir, "halt", lambda f: last_step(f) >= 2)
    (folder / "stop.flag").touch()
    fault_at = time.time()
    stopped = tick_until(w, lambda: finished(queue_dir, "halt"), HANG_GUARD_S, "halt to stop")
    time_to_end("stop.flag", fault_at, stopped)
    run = run_json(stopped)
    assert run["status"] == "cancelled" and run["attempts"][-1]["exit_code"] == 0, run
    latest = stopped / "checkpoints" / "ckpt_latest"
    # one complete checkpoint, with the part each node's rank wrote (rank 1 ran on node2)
    assert {"manifest.json", "rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in latest.iterdir()}
    assert summary(stopped)["outcome"] == "stopped" and len(summary(stopped)["hosts"]) == 2
    (stopped / "retry.flag").touch()
    done = queue_dir / "done" / "halt"
    tick_until(w, lambda: (done / "run.json").exists(), HANG_GUARD_S, "halt to resume")
    assert summary(done)["outcome"] == "done" and summary(done)["resumed_from"].startswith("checkpoints/step-")
    assert weights_sha256(done) == weights_sha256(one_machine)


def test_a_node_set_down_under_a_train_job_is_preempted_retried_and_resumed(one_machine, tiny, queue_dir, watcher):
    w = watcher(**SLURM)
    retries = {"max": 1, "on": ["preempted"], "backoff": "1s"}
    drop(queue_dir, "downed.yaml", train_job(tiny, env=SLOW, retries=retries))
    folder = started(w, queue_dir, "downed", lambda f: checkpointed(f, 4))
    second = job_hosts(w, "downed")[1]  # not the batch host, which squeue names
    try:
        subprocess.run(["scontrol", "update", f"NodeName={second}", "State=DOWN", "Reason=trainq-test"], check=True)
        fault_at = time.time()
        done = tick_until(w, lambda: finished(queue_dir, "downed"), HANG_GUARD_S, "downed to be retried to its end")
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={second}", "State=RESUME"], check=False)
    time_to_end(f"{second} set DOWN", fault_at, done)
    run = run_json(done)
    assert done.parent.name == "done" and len(run["attempts"]) == 2, (run, output(done)[-3000:])
    first = run["attempts"][0]["diagnosis"]
    assert first["kind"] == "preempted" and f"Slurm node {second} failed" in first["evidence"], first
    assert second not in summary(done)["hosts"]  # the retry ran where Slurm still had nodes
    assert summary(done)["resumed_from"].startswith("checkpoints/step-")
    assert weights_sha256(done) == weights_sha256(one_machine)
    assert folder.name == "downed"


def test_a_rank_killed_on_the_second_node_fails_the_job_naming_node_and_rank(tiny, queue_dir, watcher):
    w = watcher(**SLURM)
    drop(queue_dir, "shot.yaml", train_job(tiny, env=SLOW))
    folder = started(w, queue_dir, "shot", lambda f: last_step(f) >= 2)
    second = job_hosts(w, "shot")[1]
    victim = rank_process(folder, 1)
    assert victim is not None
    victim.kill()
    fault_at = time.time()
    done = tick_until(w, lambda: finished(queue_dir, "shot"), HANG_GUARD_S, "shot to fail")
    time_to_end(f"rank 1 SIGKILLed on {second}", fault_at, done)
    run = run_json(done)
    assert run["status"] == "failed" and run["diagnosis"]["kind"] == "killed", run
    assert f"rank 1 (pid {victim.pid} on {second}) was killed by SIGKILL" in run["diagnosis"]["evidence"], run
    # each node's torchrun reports its own rank, in whichever order they notice: node2 the kill, node1 (when its
    # rank died of the lost peer before its agent was stopped) only its rank's exit, as "unknown"
    failed = [r for r in records(done, "event") if r.get("event") == "rank_failed"]
    assert [r["rank"] for r in failed if r["kind"] == "killed"] == [1], failed
    assert all(r["kind"] == "unknown" for r in failed if r["rank"] != 1), failed


def test_the_slurmd_of_a_node_killed_under_a_train_job_leaves_the_job_running_to_done(tiny, queue_dir, watcher):
    """slurmd only starts and signals steps: the running step's slurmstepd keeps the ranks of node2 going."""
    w = watcher(**SLURM)
    drop(queue_dir, "orphan.yaml", train_job(tiny, env=SLOW))
    started(w, queue_dir, "orphan", lambda f: last_step(f) >= 2)
    second = job_hosts(w, "orphan")[1]
    pid_file = Path(os.environ.get("TRAINQ_SLURM_DIR", "/run/trainq-test-slurm")) / f"slurmd-{second}.pid"
    try:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        fault_at = time.time()
        done = tick_until(w, lambda: finished(queue_dir, "orphan"), HANG_GUARD_S, "orphan to finish")
        time_to_end(f"slurmd of {second} SIGKILLed", fault_at, done)
    finally:
        again = restart_nodes()
    assert again.returncode == 0, again.stderr
    assert done.parent.name == "done", output(done)[-3000:]
    assert second in summary(done)["hosts"]


def test_the_link_of_a_node_cut_ends_the_job_naming_the_silent_node(tiny, queue_dir, watcher):
    """node2's veth down: its rank can no longer answer, rank 0's collective times out (TRAINQ_COLLECTIVE_TIMEOUT_S),
    and the job ends then instead of when Slurm declares the node dead (SlurmdTimeout): srun, still waiting for the
    silent node's task, is ended by the node side (watcher/slurm/silent.py), and the diagnosis names the node."""
    w = watcher(**SLURM)
    quick = {**SLOW, "TRAINQ_COLLECTIVE_TIMEOUT_S": "20", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"}
    drop(queue_dir, "cut.yaml", train_job(tiny, env=quick))
    started(w, queue_dir, "cut", lambda f: last_step(f) >= 2)
    second = job_hosts(w, "cut")[1]
    link = f"trainq-v{second.removeprefix('node')}"
    try:
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        fault_at = time.time()
        done = tick_until(w, lambda: finished(queue_dir, "cut"), HANG_GUARD_S, "cut to end")
        time_to_end(f"link of {second} cut", fault_at, done)
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        subprocess.run(["scontrol", "update", f"NodeName={second}", "State=RESUME"], check=False)
    run = run_json(done)
    diagnosis = run["diagnosis"]
    evidence = diagnosis["evidence"]
    assert run["status"] == "failed" and diagnosis["kind"] == "preempted", (run, output(done)[-3000:])
    assert f"node {second} went silent" in evidence and "rank" in evidence, evidence
    assert "stopped answering" in evidence or "gave up waiting" in evidence, evidence  # what the ranks said
    assert run["attempts"][-1]["silent_nodes"] == [second], run["attempts"][-1]
    assert "sending SIGKILL to srun" in output(done)
