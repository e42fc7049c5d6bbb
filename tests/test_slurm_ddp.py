"""A 2-rank train job as a Slurm batch job (the in-repo one-node cluster of tests/test_slurm.py)."""

from __future__ import annotations

import json

import pytest
from conftest import drop, tick_until
from test_slurm import SLURM, finished, job_file, no_leftover_slurm_jobs, slurm_cluster  # noqa: F401 - fixtures
from trainer_util import BASE_TRAIN, build_tiny

pytestmark = pytest.mark.slurm
pytest.importorskip("torch", reason="the training stack (pip install -e '.[train]') is not installed")


def test_train_job_with_two_processes_trains_to_done_under_slurm(queue_dir, watcher, tmp_path):
    tiny = build_tiny(tmp_path / "tiny")
    train = {
        **BASE_TRAIN,
        "model": str(tiny / "model"),
        "data": str(tiny / "train.jsonl"),
        "max_steps": 8,
        "eval_every": None,
        "checkpoint": {"every_steps": 4, "keep": 1},
        "processes": 2,
    }
    train = {k: v for k, v in train.items() if v is not None}
    w = watcher(**SLURM)
    drop(queue_dir, "ddp.yaml", job_file(train=train, resources={"nodes": 1, "tasks_per_node": 1}))
    done = tick_until(w, lambda: finished(queue_dir, "ddp"), 300, "the 2-rank train job to finish")
    log = (done / "output.log").read_text()
    assert done.parent.name == "done", log[-3000:]
    assert "[rank 0] trainq: rank 0 of 2" in log and "[rank 1] trainq: rank 1 of 2" in log
    summary = json.loads((done / "summary.json").read_text())
    assert summary["outcome"] == "done" and summary["world_size"] == 2
    assert json.loads((done / "run.json").read_text())["slurm_job_id"]
