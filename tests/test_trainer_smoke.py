"""A smoke run that checks learning: debug: true fails a run whose loss sits at ln V (a uniform prediction) or does
not fall; the real run flags a plateau at ln V as an event and in status.json's progress; start-up errors (target
modules, a missing tokenizer) are reported before any smoke training."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tests.trainer_util import build_tiny, events, output, run_trainer, write_job
from trainq.trainer.plateau import LEARN_MARGIN, PLATEAU_STEPS, learning_verdict
from trainq.watcher.faces.progress import MetricsTail
from trainq.watcher.spec.contract import EXIT_FAILED, EXIT_OK, EXIT_USAGE

#: lr 1e4 without clipping: the tiny model collapses to a uniform prediction within a step or two
DEAD = {"lr": 10000.0, "max_grad_norm": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


def test_learning_verdict_states_the_margin_and_the_uniform_level():
    level = math.log(377)
    assert learning_verdict([6.9, 6.5, 6.2, 5.9], level) is None
    assert learning_verdict([6.9, 6.5, 5.96, 5.92], level) is None, "passing through ln V on the way down"
    flat = learning_verdict([5.0, 5.0, 4.99, 4.99], level)
    assert flat and "did not fall" in flat and f"{LEARN_MARGIN:.0%}" in flat
    dead = learning_verdict([6.9, 6.0, level, level], level)
    assert dead and "ln V = 5.9322" in dead and "377-token" in dead


def test_debug_fails_a_dead_run_and_never_starts_the_real_one(tiny, tmp_path):
    job = write_job(tmp_path / "job", tiny, debug=True, **DEAD)
    assert run_trainer(job) == EXIT_FAILED, output(job)
    verdict = json.loads((job / "debug" / "verdict.json").read_text())
    assert not verdict["passed"] and verdict["exit_code"] == EXIT_OK and "uniform prediction" in verdict["not_learning"]
    assert verdict["uniform_loss"] == pytest.approx(math.log(377))
    assert "the real run was not started: the loss sits at" in output(job).strip().splitlines()[-1]
    assert not events(job, "start") and not (job / "adapter").exists()


def test_the_real_run_flags_a_plateau_at_ln_v_in_metrics_and_status(tiny, tmp_path):
    job = write_job(
        tmp_path / "job", tiny, max_steps=PLATEAU_STEPS + 4, eval_every=None, checkpoint={"every_steps": 100}, **DEAD
    )
    assert run_trainer(job) == EXIT_OK, output(job)
    found = events(job, "plateau")
    assert len(found) == 1 and found[0]["step"] >= PLATEAU_STEPS and "not learning" in found[0]["message"]
    tail = MetricsTail(job / "metrics.jsonl")
    tail.poll()
    assert "ln V = 5.9322" in tail.progress["warning"]


def test_startup_errors_come_before_any_smoke_training(tiny, tmp_path):
    job = write_job(tmp_path / "typo", tiny, debug=True, lora={"target_modules": ["q_proj", "v_prj"]})
    assert run_trainer(job) == EXIT_USAGE
    last = output(job).strip().splitlines()[-1]
    assert "train.lora.target_modules: v_prj matches no module" in last and "v_proj" in last and "job.yaml" in last
    assert not (job / "debug").exists(), "no smoke run was started"

    bare = tmp_path / "bare"
    shutil.copytree(tiny / "model", bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    job = write_job(tmp_path / "notok", tiny, debug=True, model=str(bare))
    assert run_trainer(job) == EXIT_USAGE
    last = output(job).strip().splitlines()[-1]
    assert "has no tokenizer" in last and "sentencepiece" not in last and not (job / "debug").exists()
