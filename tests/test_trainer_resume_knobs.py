"""Resume tells the truth: a knob a resume cannot apply is refused by name (a test per knob), and an allowed
change (lr, weight_decay with allow_changed_schedule) is the value that trains and the value recorded."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.trainer_util import build_tiny, events, output, records, run_trainer, write_job
from trainq.trainer.checkpoints import CheckpointError, read_state
from trainq.trainer.config import TrainConfig
from trainq.trainer.resume_knobs import check_resume_knobs
from trainq.watcher.spec.contract import EXIT_OK, EXIT_USAGE

KNOBS = {
    "scheduler": "constant",
    "warmup_ratio": 0.0,
    "max_steps": 8,
    "eval_every": None,
    "checkpoint": {"every_steps": 4, "keep": 3},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def stopped(tiny, tmp_path_factory) -> Path:
    """A job stopped at step 4 of 8, with its checkpoint."""
    job = write_job(tmp_path_factory.mktemp("resume") / "job", tiny, **KNOBS)
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="stop_at=4") == EXIT_OK, output(job)
    (job / "stop.flag").unlink()
    return job


def saved_config(job: Path) -> tuple[TrainConfig, dict]:
    saved = read_state(job / "checkpoints" / "step-000004")["config"]
    return TrainConfig.from_saved(saved), saved


@pytest.mark.parametrize(
    "knob, change",
    [
        ("lora.target_modules", lambda c: replace(c, lora=replace(c.lora, target_modules=("q_proj", "v_proj")))),
        ("optim", lambda c: replace(c, optim="adafactor")),
        ("method", lambda c: replace(c, method="full")),
        ("lora.alpha", lambda c: replace(c, lora=replace(c.lora, alpha=64))),
        ("seed", lambda c: replace(c, seed=7)),
        ("lora.dora", lambda c: replace(c, lora=replace(c.lora, dora=True))),
    ],
)
def test_a_knob_no_resume_can_apply_is_refused_by_name(stopped, knob, change):
    config, saved = saved_config(stopped)
    check_resume_knobs(config, saved, stopped)  # unchanged: accepted
    with pytest.raises(CheckpointError, match=rf"resume refused: {knob} .* -> "):
        check_resume_knobs(
            replace(change(config), allow_changed_schedule=True, allow_changed_data=True), saved, stopped
        )


def test_weight_decay_and_train_on_need_their_allowance(stopped):
    config, saved = saved_config(stopped)
    with pytest.raises(CheckpointError, match=r"weight_decay 0\.0 -> 0\.1; set train\.allow_changed_schedule"):
        check_resume_knobs(replace(config, weight_decay=0.1), saved, stopped)
    check_resume_knobs(replace(config, weight_decay=0.1, allow_changed_schedule=True), saved, stopped)
    with pytest.raises(CheckpointError, match=r"train_on assistant -> all .*allow_changed_data"):
        check_resume_knobs(replace(config, train_on="all"), saved, stopped)


def test_a_changed_method_is_a_refusal_not_a_crash(stopped, tiny):
    job = stopped
    write_job(job, tiny, **KNOBS, method="full")
    resume = {"TRAINQ_RESUME_FROM": str(job / "checkpoints" / "step-000004"), "TRAINQ_ATTEMPT": "2"}
    assert run_trainer(job, **resume) == EXIT_USAGE
    last = output(job).strip().splitlines()[-1]
    assert "resume refused: method lora -> full" in last and "Traceback" not in output(job)


def test_allowed_lr_and_weight_decay_changes_are_applied_and_recorded(stopped, tiny):
    import torch

    job = stopped
    write_job(job, tiny, **KNOBS, lr=0.001, weight_decay=0.1, allow_changed_schedule=True)
    resume = {"TRAINQ_RESUME_FROM": str(job / "checkpoints" / "step-000004"), "TRAINQ_ATTEMPT": "3"}
    assert run_trainer(job, **resume) == EXIT_OK, output(job)
    lrs = {r["step"]: r["lr"] for r in records(job, "step")}
    assert lrs[4] == pytest.approx(0.005) and [lrs[s] for s in (5, 6, 7, 8)] == pytest.approx([0.001] * 4)
    groups = torch.load(job / "checkpoints" / "step-000008" / "optimizer.pt", weights_only=False)["param_groups"]
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    recorded = json.loads((job / "env.json").read_text())["config"]
    assert recorded["lr"] == 0.001 and recorded["weight_decay"] == 0.1
    assert read_state(job / "checkpoints" / "step-000008")["config"]["weight_decay"] == 0.1
    changes = {e["knob"]: (e["old"], e["new"], e["step"]) for e in events(job, "resume_change")}
    assert changes == {"lr": (0.005, 0.001, 4), "weight_decay": (0.0, 0.1, 4)}
    assert "trainq: resume from step-000004: lr 0.005 -> 0.001 (allowed; applied from step 5)" in output(job)
