"""``early_stopping: {patience, min_delta}``: stop when the eval loss has not improved by more than ``min_delta``
for ``patience`` evals in a row, then put the best checkpoint's weights (``ckpt_best``) into the model before
``adapter/`` (or ``model/``) is written; summary.json's ``early_stopping`` says when it stopped and what it restored.

The count of evals without improvement is kept in every checkpoint (``trainq_state.json``), so a resumed run
stops where an uninterrupted one would.
"""

from __future__ import annotations

from transformers import TrainerCallback

from trainq.trainer import checkpoints
from trainq.watcher.spec.contract import CKPT_BEST


class EarlyStopping(TrainerCallback):
    """Counts evals without improvement (kept in ``run.early_stop``) and ends training at ``patience``."""

    def __init__(self, run, patience: int, min_delta: float):
        self.run = run
        self.patience = patience
        self.min_delta = min_delta

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        eval_loss = (metrics or {}).get("eval_loss")
        info = self.run.early_stop
        if eval_loss is None or info.get("stopped_at") is not None:
            return
        best = info.get("reference")
        if best is None or eval_loss < best - self.min_delta:
            info.update(reference=eval_loss, bad_evals=0)
            return
        info["bad_evals"] = info.get("bad_evals", 0) + 1
        if info["bad_evals"] < self.patience:
            return
        info["stopped_at"] = state.global_step
        control.should_training_stop = True
        self.run.metrics.event(
            "early_stop",
            f"step {state.global_step}: eval loss {eval_loss:.4f} has not improved on "
            f"{best:.4f} by more than {self.min_delta:g} for {self.patience} evals; stopping",
            step=state.global_step,
            eval_loss=eval_loss,
            best=best,
            patience=self.patience,
        )
        print(
            f"trainq: early stop at step {state.global_step}: no eval improvement for {self.patience} evals", flush=True
        )


def restore_best(model, run, full: bool) -> str | None:
    """Load ``ckpt_best``'s weights into ``model`` when training stopped early; returns the folder's name."""
    if run.early_stop.get("stopped_at") is None:
        return None
    best = checkpoints.link_target(run.ckpt_dir, CKPT_BEST)
    if best is None:
        return None
    checkpoints.load_initial_weights(model, best, full=full)
    run.early_stop["restored"] = best.name
    run.metrics.event(
        "early_stop_restored",
        f"restored the best checkpoint {best.name} (eval loss {run.best_eval_loss}) into the final weights",
        checkpoint=best.name,
        step=run.best_step,
    )
    return best.name
