"""Resume tells the truth: every knob a resume changes is either applied (and then recorded) or refused by name.

``run.check_schedule`` already refuses a changed max_steps/epochs/batch/accum/seq_len/lr/scheduler/warmup/dropout
unless ``allow_changed_schedule``. This module adds the rest:

- knobs no resume can change (the saved adapter, optimizer state or RNG state would not mean the same thing):
  ``method``, ``lora.r``/``alpha``/``target_modules``/``dora``/``rslora``, ``optim``, ``seed``, ``init_from``, ``dpo.beta``;
- knobs that change which tokens train (``train_on``, ``eval_fraction``, ``chat_template``): a data change, refused
  unless ``allow_changed_data``;
- ``weight_decay``, refused unless ``allow_changed_schedule`` and then applied, like ``lr``: the Trainer restores
  the optimizer and scheduler from the checkpoint, which would silently keep the old values (``apply_to_optimizer``).

Everything else (eval/log/checkpoint cadence, max_grad_norm, packing, precision, export, report_to, ...) is read
afresh by the new process, so it is applied as written and recorded as applied.
"""

from __future__ import annotations

from pathlib import Path

from trainq.trainer.checkpoints import CheckpointError
from trainq.trainer.config import TrainConfig

#: knobs no resume may change: (name, value in the current config, value in a checkpoint's config dict, default)
_FIXED = {
    "method": (lambda c: c.method, lambda d: d.get("method")),
    "lora.alpha": (lambda c: c.lora.alpha, lambda d: d.get("lora", {}).get("alpha")),
    "lora.target_modules": (
        lambda c: _listed(c.lora.target_modules),
        lambda d: _listed(d.get("lora", {}).get("target_modules")),
    ),
    "lora.dora": (lambda c: getattr(c.lora, "dora", False), lambda d: d.get("lora", {}).get("dora", False)),
    "lora.rslora": (lambda c: getattr(c.lora, "rslora", False), lambda d: d.get("lora", {}).get("rslora", False)),
    "optim": (lambda c: c.optim, lambda d: d.get("optim")),
    "seed": (lambda c: c.seed, lambda d: d.get("seed")),
    "init_from": (lambda c: getattr(c, "init_from", None), lambda d: d.get("init_from")),
    "dpo.beta": (lambda c: getattr(c, "dpo_beta", None), lambda d: d.get("dpo_beta")),
}
#: knobs that change the tokenized data: refused unless allow_changed_data
_DATA = {
    "train_on": (lambda c: c.train_on, lambda d: d.get("train_on")),
    "eval_fraction": (lambda c: c.eval_fraction, lambda d: d.get("eval_fraction")),
    "chat_template": (lambda c: getattr(c, "chat_template", None), lambda d: d.get("chat_template")),
}
#: optimizer knobs restored from the checkpoint: refused unless allow_changed_schedule, then applied on load
_OPTIMIZER = {"weight_decay": (lambda c: c.weight_decay, lambda d: d.get("weight_decay"))}


#: the checkpoint config key of a knob whose name is not its top-level key
_SAVED_KEY = {"dpo.beta": "dpo_beta"}


def _listed(value: object) -> object:
    return list(value) if isinstance(value, (list, tuple)) else value


def _changes(table: dict, config: TrainConfig, saved: dict) -> list[str]:
    """``name old -> new`` for each knob of ``table`` whose checkpoint value is known and differs."""
    out = []
    for name, (new, old) in table.items():
        if _SAVED_KEY.get(name, name.split(".")[0]) not in saved:
            continue  # a checkpoint from before the knob existed: its default applied
        if old(saved) != new(config):
            out.append(f"{name} {old(saved)} -> {new(config)}")
    return out


def check_resume_knobs(config: TrainConfig, saved: dict, folder: Path) -> None:
    """Refuse, naming each, the knobs a resume from ``folder`` cannot apply (see the module docstring)."""
    fixed = _changes(_FIXED, config, saved)
    if fixed:
        raise CheckpointError(
            f"{folder}: resume refused: {', '.join(fixed)}: the checkpoint's weights, optimizer and "
            "random state were made with the old value; start a new job (trainq fork) to change it"
        )
    data = _changes(_DATA, config, saved)
    if data and not config.allow_changed_data:
        raise CheckpointError(
            f"{folder}: resume refused: {', '.join(data)} changes which tokens train; set "
            "train.allow_changed_data: true to accept"
        )
    optimizer = _changes(_OPTIMIZER, config, saved)
    if optimizer and not config.allow_changed_schedule:
        raise CheckpointError(
            f"{folder}: resume would change {', '.join(optimizer)}; set train.allow_changed_schedule: true to accept"
        )


def apply_to_optimizer(
    optimizer, scheduler, config: TrainConfig, saved_lr: float, saved_scale: float, lr_scale: float
) -> None:
    """After the Trainer loaded the checkpoint's optimizer and scheduler: put this run's lr (times its rollback
    scale) and weight_decay in place of the saved ones, so an allowed change is the change that trains."""
    factor = (config.lr * lr_scale) / (saved_lr * saved_scale)
    if factor != 1.0:
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        for group in optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
    if optimizer.param_groups:
        optimizer.param_groups[0]["weight_decay"] = config.weight_decay  # group 0: the Trainer's decayed parameters


#: knobs an allowed resume may change (allow_changed_schedule / allow_changed_data), each recorded by
#: ``applied_changes`` as an ``event`` naming the knob, the checkpoint's value and the value now applied
_ALLOWED = {
    "max_steps": (lambda c: c.max_steps, lambda d: d.get("max_steps")),
    "epochs": (lambda c: c.epochs, lambda d: d.get("epochs")),
    "batch_size": (lambda c: c.batch_size, lambda d: d.get("batch_size")),
    "grad_accum": (lambda c: c.grad_accum, lambda d: d.get("grad_accum")),
    "seq_len": (lambda c: c.seq_len, lambda d: d.get("seq_len")),
    "lr": (lambda c: c.lr, lambda d: d.get("lr")),
    "scheduler": (lambda c: c.scheduler, lambda d: d.get("scheduler")),
    "warmup_ratio": (lambda c: c.warmup_ratio, lambda d: d.get("warmup_ratio")),
    "lora.dropout": (lambda c: c.lora.dropout, lambda d: d.get("lora", {}).get("dropout")),
    **_OPTIMIZER,
    **_DATA,
}


def applied_changes(config: TrainConfig, saved: dict) -> list[tuple[str, object, object]]:
    """(knob, old, new) for each allowed knob whose value differs from the checkpoint's config ``saved`` (call it
    after the checks: every change left is one the job allowed and this run applies)."""
    out = []
    for name, (new, old) in _ALLOWED.items():
        if _SAVED_KEY.get(name, name.split(".")[0]) not in saved:
            continue
        if old(saved) != new(config):
            out.append((name, old(saved), new(config)))
    return out
