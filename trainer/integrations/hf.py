"""``TrainqCallback``: a transformers ``TrainerCallback`` that reports to trainq and stops cleanly."""

from __future__ import annotations

import os

from transformers import TrainerCallback

from trainq.trainer.integrations.link import EXIT_PREEMPTED, TrainqLink


class TrainqCallback(TrainerCallback):
    """Step, eval and checkpoint records to $TRAINQ_METRICS; on stop.flag or SIGTERM, save and stop.

    ``Trainer(..., callbacks=[TrainqCallback()])``. After a stop the Trainer saves a
    ``checkpoint-N`` at the end of the current step, then the script ends with ``SystemExit(0)``
    from inside ``train()`` (status ``cancelled``): the code after ``train()`` (a final save, an
    evaluation) never runs on a half-trained model. After a SIGTERM the same, with ``SystemExit(143)``
    so trainq's retry resumes it. ``TrainqCallback(exit_on_stop=False)`` lets ``train()`` return
    instead; then check ``callback.stopped`` before treating the model as trained.
    """

    def __init__(self, link: TrainqLink | None = None, exit_on_stop: bool = True) -> None:
        self.link = link or TrainqLink.from_env()
        self.exit_on_stop = exit_on_stop
        self._stop_step: int | None = None

    @property
    def stopped(self) -> bool:
        """True once a stop.flag or SIGTERM ended training early (the model is not fully trained)."""
        return self._stop_step is not None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.link.catch_sigterm()

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.link.step(state.global_step, total_steps=state.max_steps or None, epoch=state.epoch)
        if self._stop_step is None and self.link.stop_requested():
            self._stop_step = state.global_step
            why = "SIGTERM" if self.link.sigterm_received else "stop.flag"
            self.link.event("stopping", f"{why} at step {state.global_step}: saving a checkpoint and stopping")
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "eval_loss" in logs:
            self.link.eval(state.global_step, logs.get("eval_loss"), epoch=logs.get("epoch"))
        elif "loss" in logs:
            self.link.step(
                state.global_step,
                total_steps=state.max_steps or None,
                loss=logs.get("loss"),
                lr=logs.get("learning_rate"),
                grad_norm=logs.get("grad_norm"),
                epoch=logs.get("epoch"),
            )

    def on_save(self, args, state, control, **kwargs):
        # the Trainer calls on_save once checkpoint-N is complete (trainer_state.json written)
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(folder):
            self.link.checkpoint(folder, step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.link.sigterm_received and self._stop_step is not None:
            raise SystemExit(EXIT_PREEMPTED)
        if self.exit_on_stop and self._stop_step is not None:
            raise SystemExit(0)  # stopped: the checkpoint is saved; nothing after train() runs on this model
