"""One-line trainq integrations for training scripts you already have (no trainq code needed otherwise).

    from trainq.trainer.integrations import TrainqCallback           # Hugging Face Trainer
    trainer = Trainer(..., callbacks=[TrainqCallback()])

    from trainq.trainer.integrations import TrainqLightningCallback  # Lightning
    trainer = L.Trainer(..., callbacks=[TrainqLightningCallback()])

Each writes step/eval/checkpoint records to ``$TRAINQ_METRICS`` and, when ``$TRAINQ_STOP_FLAG``
appears, saves a checkpoint at the end of the step and stops training, so ``trainq stop`` loses
nothing and the script exits 0 (recorded ``cancelled``); a SIGTERM (preemption) does the same and then
exits 143, so a retry resumes. Outside trainq (no ``TRAINQ_*`` variables) they do nothing.

Importing this package is light: transformers or Lightning load only when a callback is asked for.
"""

from __future__ import annotations

from trainq.trainer.integrations.link import TrainqLink

__all__ = ["TrainqCallback", "TrainqLightningCallback", "TrainqLink"]


def __getattr__(name: str):
    if name == "TrainqCallback":
        from trainq.trainer.integrations.hf import TrainqCallback

        return TrainqCallback
    if name == "TrainqLightningCallback":
        from trainq.trainer.integrations.lightning import TrainqLightningCallback

        return TrainqLightningCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
