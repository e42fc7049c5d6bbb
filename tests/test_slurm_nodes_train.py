"""The built-in trainer across Slurm nodes: one gloo world over the bridge of ``TRAINQ_SLURM_NODES=3``.

Each node runs one torchrun agent (``resources.nodes`` > 1 is one srun task per node); rank 0's node hosts the
static rendezvous at ``MASTER_ADDR``. The reference is the same job trained on one machine with the same world
size and global batch: the 2-node run must end with bitwise the same adapter.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import drop, tick_until
from test_slurm import (  # noqa: F401  (the autouse clean-up fixture is used by name)
    SLURM,
    finished,
    job_file,
    no_leftover_slurm_jobs,
    run_json,
    use_cluster,
)
from test_slurm_nodes import NODES
from trainer_util import BASE_TRAIN, build_tiny, output, run_trainer, summary, write_job

pytestmark = pytest.mark.slurm
pytest.importorskip("torch", reason="the training stack (pip install -e '.[train]') is not installed")

#: the run every test here trains (or resumes) to its end: short, with evals and checkpoints on the way
TRAIN = {**BASE_TRAIN, "max_steps": 12, "eval_every": 4, "log_every": 4, "checkpoint": {"every_steps": 4, "keep": 2}}
#: one thread per rank wherever it runs: the reference's ranks get one, so a node's single rank must too (the
#: trainer's default would give it both cores, and another reduction order in the matrix products)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
#: a guard against a hang, never a timing assertion (the machine is shared and loaded)
HANG_GUARD_S = 600


@pytest.fixture(scope="module", autouse=True)
def nodes_cluster():
    yield from use_cluster({"TRAINQ_SLURM_NODES": str(NODES)})


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
    assert got["hosts"] == ["node1", "node2"], got
    assert json.loads((done / "env.json").read_text())["hosts"] == ["node1", "node2"]
    assert summary(one_machine)["hosts"] == [got_host(one_machine)]
    assert weights_sha256(done) == weights_sha256(one_machine)
    assert run_json(done)["slurm_job_id"]


def got_host(job_dir: Path) -> str:
    return json.loads((job_dir / "env.json").read_text())["hosts"][0]
