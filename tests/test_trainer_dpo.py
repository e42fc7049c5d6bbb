"""method: dpo through TRL's DPOTrainer, keeping trainq's promises: rewards in the step records, stop then resume
bitwise equal to an uninterrupted run on the CPU, a changed beta or changed data refused on resume."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.trainer_util import (
    adapter_tensors,
    build_tiny,
    max_abs_diff,
    output,
    records,
    run_trainer,
    summary,
    write_job,
)
from trainq.watcher.spec.contract import EXIT_DATA, EXIT_OK, EXIT_USAGE

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


def preference_file(path: Path, count: int = 64) -> Path:
    rng = random.Random(3)
    words = ["red", "blue", "green", "cat", "dog", "fox", "bird", "hill", "tree"]
    rows = [
        {
            "prompt": " ".join(rng.choice(words) for _ in range(5)) + " is",
            "chosen": " a red cat.",
            "rejected": f" a {rng.choice(words)} dog.",
        }
        for _ in range(count)
    ]
    rows.append({"text": "not a preference row"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dpo_job(job: Path, tiny: Path, data: Path, **extra) -> Path:
    return write_job(
        job,
        tiny,
        method="dpo",
        data={"train": str(data), "max_bad_rows": 1},
        max_steps=8,
        lr=0.005,
        eval_every=4,
        log_every=4,
        checkpoint={"every_steps": 4, "keep": 2},
        **extra,
    )


@pytest.mark.slow  # five trainer processes (~40 s on a quiet machine)
def test_dpo_records_rewards_and_resumes_bitwise_after_a_stop(tiny, tmp_path):
    data = preference_file(tmp_path / "pref.jsonl")
    whole = dpo_job(tmp_path / "whole", tiny, data)
    assert run_trainer(whole) == EXIT_OK, output(whole)
    steps = records(whole, "step")
    assert all(k in steps[-1] for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"))
    assert steps[-1]["rewards/margins"] > 0 and steps[-1]["loss"] < steps[0]["loss"], "the chosen answer gains"
    assert "rewards/margins" in records(whole, "eval")[-1]
    assert summary(whole)["output"] == "adapter"
    bad = [r for r in records(whole, "event") if r.get("event") == "bad_rows"]
    assert bad and "dpo needs {prompt, chosen, rejected}" in bad[-1]["rows"][0]["reason"]

    split = dpo_job(tmp_path / "split", tiny, data)
    assert run_trainer(split, TRAINQ_TRAINER_FAULTS="stop_at=4") == EXIT_OK, output(split)
    assert summary(split)["outcome"] == "stopped"
    (split / "stop.flag").unlink()
    resume = {"TRAINQ_RESUME_FROM": str(split / "checkpoints" / "ckpt_latest"), "TRAINQ_ATTEMPT": "2"}

    dpo_job(split, tiny, data, dpo={"beta": 0.5})
    assert run_trainer(split, **resume) == EXIT_USAGE
    assert "resume refused: dpo.beta 0.1 -> 0.5" in output(split).strip().splitlines()[-1]

    dpo_job(split, tiny, data)
    assert run_trainer(split, **resume) == EXIT_OK, output(split)
    assert summary(split)["steps"] == 8 and summary(split)["resumed_from"] == "checkpoints/step-000004"
    assert max_abs_diff(adapter_tensors(whole / "adapter"), adapter_tensors(split / "adapter")) == 0.0
    assert [r["loss"] for r in records(whole, "step")][4:] == [
        r["loss"] for r in records(split, "step") if r["step"] > 4
    ]

    with data.open("a") as f:
        f.write(json.dumps({"prompt": "new", "chosen": " a", "rejected": " b"}) + "\n")
    assert run_trainer(split, **resume) == EXIT_DATA
    assert "resume refused: train data" in output(split).strip().splitlines()[-1]
