"""Issue 37, item 3: the loop's two shortcuts give the Trainer's own numbers: the flos estimate with the parameter
count taken once, and gradient clipping over the trained parameters listed once (the speed is measured in
bench/bench_trainer.py's loop section, never here)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from tests.trainer_util import build_tiny
from trainq.trainer.callbacks import TrainqTrainer


def _lora_trainer(tmp_path: Path) -> tuple[TrainqTrainer, dict]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tiny = build_tiny(tmp_path / "tiny")
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny / "model"), LoraConfig(r=4, target_modules="all-linear")
    )
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", max_grad_norm=0.01)
    trainer = TrainqTrainer(model=model, args=args, run=None)
    ids = torch.arange(24).reshape(2, 12) % model.config.vocab_size
    return trainer, {"input_ids": ids, "labels": ids}


def test_flos_and_clipping_equal_the_trainers_own(tmp_path):
    trainer, batch = _lora_trainer(tmp_path)
    model = trainer.model
    assert trainer.floating_point_ops(batch) == Trainer.floating_point_ops(trainer, batch) > 0
    assert trainer.floating_point_ops(batch) == Trainer.floating_point_ops(trainer, batch)  # cached: still equal
    model(**batch).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    theirs = Trainer._clip_grad_norm(trainer, model)  # accelerate's path
    clipped = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name, param in model.named_parameters():
        if name in grads:
            param.grad.copy_(grads[name])
    ours = trainer._clip_grad_norm(model)
    assert torch.equal(ours, theirs) and float(ours) > 0.01  # the clip really clipped
    after = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert after.keys() == clipped.keys() and all(torch.equal(after[n], clipped[n]) for n in after)
