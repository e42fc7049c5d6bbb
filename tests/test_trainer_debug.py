"""``debug: true``: a smoke run (eval, checkpoint, resume) before the real run; a failing one stops the job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer_util import build_tiny, events, output, records, run_trainer, summary, write_job
from trainq.watcher.spec.contract import EXIT_OK, EXIT_OOM


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


def test_debug_run_passes_then_the_real_run_trains(tiny, tmp_path):
    job = write_job(tmp_path / "job", tiny, max_steps=10, eval_every=None, debug=True, checkpoint={"every_steps": 100})
    assert run_trainer(job) == EXIT_OK, output(job)
    verdict = json.loads((job / "debug" / "verdict.json").read_text())
    assert verdict["passed"] and verdict["resumed"] and verdict["steps"] == 4 and verdict["peak_mem_mb"] > 0
    assert verdict["resume_loss_diff"] == 0.0, "the smoke run's resume matches its own first run exactly on the CPU"
    assert events(job, "debug")[0]["passed"]
    assert "debug run passed: 4 steps" in output(job)
    assert [r["step"] for r in records(job, "step")] == list(range(1, 11)) and summary(job)["outcome"] == "done"


def test_a_failing_debug_run_never_starts_the_real_one(tiny, tmp_path):
    job = write_job(tmp_path / "job", tiny, max_steps=10, eval_every=None, debug=True)
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="oom_at=3") == EXIT_OOM
    last = output(job).strip().splitlines()[-1]
    assert last.startswith("trainq: debug run failed; the real run was not started: trainq: out of memory")
    assert not records(job, "step") and not (job / "adapter").exists() and not (job / "summary.json").exists()
    verdict = events(job, "debug")[0]
    assert not verdict["passed"] and verdict["exit_code"] == EXIT_OOM
