"""Padding-free packing: per-token loss identical to the padded batch, whole runs with the same loss curve, and the
start-up probe that decides whether a model can be packed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer_util import build_tiny, events, output, records, run_trainer, summary, write_job
from trainq.trainer import packing
from trainq.trainer.data import IGNORE_INDEX, PadCollator, read_rows, tokenize
from trainq.watcher.spec.contract import EXIT_OK

#: per-token losses of the packed and padded batch agree to this (fp32 on the CPU)
TOKEN_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


def per_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every labelled next token, in order (the model's own shift)."""
    logits, labels = logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    keep = labels != IGNORE_INDEX
    return torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="none")


def test_packed_batch_gives_the_same_per_token_loss_as_the_padded_one(tiny):
    from transformers import AutoModelForCausalLM

    from trainq.trainer.modeling import load_tokenizer

    tokenizer = load_tokenizer(str(tiny / "model"))
    rows, _ = read_rows(str(tiny / "train.jsonl"))
    examples = [tokenize(rows[:12], tokenizer, 64)[i] for i in range(12)]
    assert len({len(e["input_ids"]) for e in examples}) > 3, "rows of different lengths"
    model = AutoModelForCausalLM.from_pretrained(str(tiny / "model"), local_files_only=True)
    decision = packing.decide(None, model, "job.yaml")
    assert decision.enabled, decision.reason
    padded = PadCollator(tokenizer.pad_token_id)(examples)
    packed = packing.collator(tokenizer.pad_token_id, True)(examples)
    assert (
        packed["input_ids"].shape == (1, sum(len(e["input_ids"]) for e in examples)) and "attention_mask" not in packed
    )
    with torch.no_grad():
        a = per_token_losses(model(**padded).logits, padded["labels"])
        b = per_token_losses(model(**packed).logits, packed["labels"])
        loss_padded, loss_packed = model(**padded).loss, model(**packed).loss
    assert a.shape == b.shape and a.numel() == sum(len(e["input_ids"]) - 1 for e in examples)
    diff = float((a - b).abs().max())
    print(f"per-token loss, packed vs padded: max abs diff {diff:.2e} over {a.numel()} tokens")
    assert diff < TOKEN_TOLERANCE
    assert abs(float(loss_padded) - float(loss_packed)) < TOKEN_TOLERANCE


def test_with_use_cache_on_packed_rows_would_mix_so_decide_turns_it_off(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny / "model"), local_files_only=True)
    assert model.config.use_cache
    ok, diff = packing.probe(model)
    assert not ok and diff > 0.01, "transformers skips the packed-mask check when a cache is in use"
    assert packing.decide(None, model, "job.yaml").enabled and model.config.use_cache is False
    assert not packing.decide(False, model, "job.yaml").enabled


def test_packed_and_padded_runs_follow_the_same_loss_curve(tiny, tmp_path):
    curves = {}
    for flag in (True, False):
        job = write_job(
            tmp_path / f"packing-{flag}",
            tiny,
            max_steps=6,
            eval_every=3,
            packing=flag,
            lora={"dropout": 0.0},
            checkpoint={"every_steps": 100},
        )
        assert run_trainer(job) == EXIT_OK, output(job)
        curves[flag] = [r["loss"] for r in records(job, "step")] + [r["eval_loss"] for r in records(job, "eval")]
        assert summary(job)["packing"]["enabled"] is flag and events(job, "packing")
        assert all(r["tokens_per_s"] > 0 for r in records(job, "step"))
    print(f"packed {curves[True]}\npadded {curves[False]}")
    for a, b in zip(curves[True], curves[False], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
