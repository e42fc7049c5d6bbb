"""``TrainqLightningCallback``: a Lightning ``Callback`` that reports to trainq and stops cleanly.

Built on the Lightning flavour the script uses (``lightning.pytorch`` or ``pytorch_lightning``: a
Trainer accepts only its own package's Callback), picked from what is already imported.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from typing import Any

from trainq.trainer.integrations.link import TrainqLink

#: Lightning packages, in the order tried when the script has imported neither yet
_FLAVOURS = ("lightning.pytorch", "pytorch_lightning")


def _lightning():
    for name in _FLAVOURS:
        if name in sys.modules:
            return sys.modules[name]
    for name in _FLAVOURS:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("TrainqLightningCallback needs Lightning: pip install lightning (or pytorch-lightning)")


def _number(value: Any) -> float | None:
    """A tensor or number as a finite float, else None."""
    try:
        number = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return number if math.isfinite(number) else None


def _loss(outputs: object) -> float | None:
    if isinstance(outputs, dict):
        outputs = outputs.get("loss")
    return _number(outputs) if outputs is not None else None


class _Hooks:
    """The callback's behaviour; mixed into the installed Lightning's ``Callback`` below."""

    def __init__(self, link: TrainqLink | None = None) -> None:
        super().__init__()
        self.link = link or TrainqLink.from_env()
        self.stopped_at: int | None = None
        self._recorded: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = int(trainer.global_step)
        if trainer.is_global_zero:
            self.link.step(
                step, total_steps=_total_steps(trainer), loss=_loss(outputs), epoch=_epoch(trainer, batch_idx)
            )
            self._record_saved(trainer, step)
        sigterm = bool(getattr(trainer, "received_sigterm", False))  # Lightning owns SIGTERM and raises after this hook
        if self.stopped_at is None and (self.link.stop_requested() or sigterm):
            self._save_and_stop(trainer, step, "SIGTERM" if sigterm else "stop.flag")

    def _save_and_stop(self, trainer, step: int, why: str) -> None:
        """Save where the job's checkpoints go, record it, and end fit() after this batch."""
        self.stopped_at = step
        folder = getattr(trainer.checkpoint_callback, "dirpath", None) or os.path.join(
            str(self.link.job_dir or trainer.default_root_dir), "checkpoints"
        )
        path = os.path.join(folder, f"trainq-step={step}.ckpt")
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            self.link.checkpoint(path, step=step)
            self.link.event("stopping", f"{why} at step {step}: saved {path} and stopping")
        trainer.should_stop = True

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        value = next((metrics[k] for k in ("val_loss", "eval_loss", "validation_loss") if k in metrics), None)
        if value is not None:
            self.link.eval(int(trainer.global_step), _number(value), epoch=trainer.current_epoch)
        self._record_saved(trainer, int(trainer.global_step))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self._record_saved(trainer, int(trainer.global_step))

    def _record_saved(self, trainer, step: int) -> None:
        """A checkpoint record for each file ModelCheckpoint finished writing (its last/best paths)."""
        for callback in getattr(trainer, "checkpoint_callbacks", []) or []:
            for path in (getattr(callback, "last_model_path", ""), getattr(callback, "best_model_path", "")):
                if path and path not in self._recorded and os.path.exists(path):
                    self._recorded.add(path)
                    self.link.checkpoint(path, step=step)


def _total_steps(trainer) -> int | None:
    total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
    if total is None:
        try:
            estimated = trainer.estimated_stepping_batches
        except Exception:  # Lightning raises several kinds before the dataloaders exist
            return None
        total = int(estimated) if math.isfinite(estimated) else None
    return total


def _epoch(trainer, batch_idx: int) -> float | None:
    batches = trainer.num_training_batches
    if not batches or not math.isfinite(batches):
        return None
    return trainer.current_epoch + (batch_idx + 1) / batches


def _build():
    base = _lightning().Callback

    class TrainqLightningCallback(_Hooks, base):  # type: ignore[misc, valid-type]  # Lightning's Callback, found at run time
        """Step, eval and checkpoint records to $TRAINQ_METRICS; on stop.flag (or SIGTERM), save and stop.

        ``L.Trainer(..., callbacks=[TrainqLightningCallback()])``; resume with ``trainer.fit(model,
        ckpt_path=os.environ.get("TRAINQ_RESUME_FROM"))``.
        """

    return TrainqLightningCallback


TrainqLightningCallback = _build()
