"""Data gates as real trainer runs: the bad-row limit, data hashes in summary.json, refusing changed data or knobs
on resume, weighted datasets, the tokenized-data cache; and the metric fixes that go with resuming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer_util import build_tiny, events, output, records, run_trainer, summary, write_job
from trainq.trainer.checkpoints import sha256_file
from trainq.trainer.data import DataError
from trainq.trainer.sources import load_data
from trainq.watcher.spec.contract import EXIT_DATA, EXIT_OK, EXIT_OOM, EXIT_USAGE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


def lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_bad_rows_over_the_limit_fail_naming_the_first_lines(tmp_path):
    data = lines(tmp_path / "d.jsonl", [{"text": "good row"}, "{broken", {"txt": "typo"}])
    with pytest.raises(
        DataError,
        match=r"d\.jsonl: 2 bad rows of 3, over train\.data\.max_bad_rows \(0 -> 0 allowed\): "
        r"line 2: not valid JSON.*; line 3: no text",
    ) as info:
        load_data(str(data), None, 0.0)
    assert info.value.exit_code == EXIT_DATA
    assert len(load_data(str(data), None, 0.0, max_bad_rows=2).train) == 1
    with pytest.raises(DataError, match=r"0\.5 -> 1 allowed"):
        load_data(str(data), None, 0.0, max_bad_rows=0.5)


def test_weights_repeat_or_thin_rows_deterministically(tmp_path):
    a = lines(tmp_path / "a.jsonl", [{"text": f"a row {i}"} for i in range(100)])
    b = lines(tmp_path / "b.jsonl", [{"text": f"b row {i}"} for i in range(100)])
    data = load_data([(str(a), 2.0), (str(b), 0.5)], None, 0.0)
    from_a = sum(r.file == str(a) for r in data.train)
    from_b = sum(r.file == str(b) for r in data.train)
    assert from_a == 200 and 30 < from_b < 70
    assert [f.weight for f in data.files] == [2.0, 0.5]
    again = load_data([(str(a), 2.0), (str(b), 0.5)], None, 0.0)
    assert [r.line for r in again.train] == [r.line for r in data.train]


def test_data_file_over_the_limit_fails_the_job_with_exit_data(tiny, tmp_path):
    data = lines(tmp_path / "d.jsonl", [{"text": "the red cat"}, "{broken", {"txt": "typo"}])
    job = write_job(tmp_path / "job", tiny, data=str(data), max_steps=2, eval_fraction=0)
    assert run_trainer(job) == EXIT_DATA
    last = output(job).strip().splitlines()[-1]
    assert "d.jsonl: 2 bad rows of 3" in last and "line 2: not valid JSON" in last and "line 3: no text" in last


def test_resume_refuses_changed_data_and_knobs_then_allows_on_request(tiny, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_bytes((tiny / "train.jsonl").read_bytes())
    job = write_job(
        tmp_path / "job",
        tiny,
        data={"train": str(data), "eval": str(tiny / "eval.jsonl")},
        max_steps=8,
        eval_every=None,
        checkpoint={"every_steps": 4, "keep": 2},
    )
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="stop_at=4") == EXIT_OK, output(job)
    first = summary(job)
    assert first["data"][0]["sha256"] == sha256_file(data) and first["data"][0]["rows"] == 400
    assert events(job, "data")[0]["files"][1]["role"] == "eval"
    assert first["latest_checkpoint"] == "checkpoints/step-000004" and first["tokens"] > 0
    (job / "stop.flag").unlink()
    resume = {"TRAINQ_RESUME_FROM": str(job / "checkpoints" / "ckpt_latest"), "TRAINQ_ATTEMPT": "2"}

    with data.open("a") as f:
        f.write(json.dumps({"text": "a new row"}) + "\n")
    assert run_trainer(job, **resume) == EXIT_DATA
    last = output(job).strip().splitlines()[-1]
    assert "resume refused: train data" in last and "rows 400 -> 401" in last and "allow_changed_data" in last

    write_job(
        job,
        tiny,
        data={"train": str(data), "eval": str(tiny / "eval.jsonl")},
        max_steps=8,
        eval_every=None,
        checkpoint={"every_steps": 4, "keep": 2},
        allow_changed_data=True,
        lr=0.001,
        seq_len=32,
        lora={"dropout": 0.1},
    )
    assert run_trainer(job, **resume) == EXIT_USAGE
    last = output(job).strip().splitlines()[-1]
    assert "seq_len 48 -> 32" in last and "lr 0.005 -> 0.001" in last and "lora.dropout 0.05 -> 0.1" in last

    write_job(
        job,
        tiny,
        data={"train": str(data), "eval": str(tiny / "eval.jsonl")},
        max_steps=8,
        eval_every=None,
        checkpoint={"every_steps": 4, "keep": 2},
        allow_changed_data=True,
    )
    assert run_trainer(job, **resume) == EXIT_OK, output(job)
    assert events(job, "data_changed")
    final = summary(job)
    assert final["steps"] == 8 and final["tokens"] > final["tokens_this_attempt"] > 0
    assert final["tokens"] - final["tokens_this_attempt"] == first["tokens"], "tokens count every attempt"
    assert final["resumed_from"] == "checkpoints/step-000004" and final["best_checkpoint"] == "checkpoints/step-000008"


def test_logged_lr_is_the_lr_the_step_applied(tiny, tmp_path):
    job = write_job(
        tmp_path / "job",
        tiny,
        max_steps=4,
        eval_every=None,
        scheduler="linear",
        warmup_ratio=0.0,
        lr=0.004,
        checkpoint={"every_steps": 100},
    )
    assert run_trainer(job) == EXIT_OK, output(job)
    assert [round(r["lr"], 6) for r in records(job, "step")] == [0.004, 0.003, 0.002, 0.001]


def test_tokenized_cache_is_reused_on_resume(tiny, tmp_path):
    job = write_job(tmp_path / "job", tiny, max_steps=4, eval_every=None, checkpoint={"every_steps": 2})
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="stop_at=2") == EXIT_OK, output(job)
    assert "from the cache" not in output(job) and list((job / ".cache" / "tokenized").glob("*.pkl"))
    (job / "stop.flag").unlink()
    assert run_trainer(job, TRAINQ_RESUME_FROM=str(job / "checkpoints" / "ckpt_latest")) == EXIT_OK, output(job)
    assert "tokenized data from the cache" in output(job)


def test_oom_summary_counts_the_steps_done_and_nan_grads_are_skipped(tiny, tmp_path):
    job = write_job(tmp_path / "oom", tiny, max_steps=4, eval_every=None, checkpoint={"every_steps": 100})
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="oom_at=3") == EXIT_OOM
    assert summary(job)["steps"] == 2 and summary(job)["outcome"] == "oom"
    job = write_job(tmp_path / "grad", tiny, max_steps=4, eval_every=None, checkpoint={"every_steps": 100})
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="nan_grad_at=2") == EXIT_OK, output(job)
    step2 = records(job, "step")[1]
    assert step2["nonfinite"] and step2["loss"] is not None, "the loss was finite, the gradients were not"
    assert events(job, "nonfinite_grad")[0]["step"] == 2
    from tests.trainer_util import adapter_tensors

    assert all(bool(t.isfinite().all()) for t in adapter_tensors(job / "adapter").values())


def test_knobs_reach_the_trainer_and_warmup_is_whole_steps(tiny, tmp_path):
    from trainq.trainer.config import load_config
    from trainq.trainer.modeling import resolve_precision
    from trainq.trainer.run import training_args

    job = write_job(
        tmp_path / "job",
        tiny,
        max_steps=5,
        eval_every=None,
        gradient_checkpointing=True,
        optim="sgd",
        warmup_ratio=0.5,
        lr=0.05,
        checkpoint={"every_steps": 100},
    )
    args = training_args(load_config(job), resolve_precision("fp32"), job / "checkpoints", False, 1.0, 400, job)
    assert args.gradient_checkpointing and args.optim == "sgd" and args.warmup_steps == 3
    epochs = write_job(
        tmp_path / "epochs", tiny, max_steps=None, epochs=2, batch_size=4, grad_accum=2, warmup_ratio=0.1
    )
    assert training_args(load_config(epochs), resolve_precision("fp32"), job, False, 1.0, 100, job).warmup_steps == 3
    assert run_trainer(job) == EXIT_OK, output(job)
    assert summary(job)["steps"] == 5 and all(r["loss"] is not None for r in records(job, "step"))
