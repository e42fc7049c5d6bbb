"""The opt-in knobs of round three that hook into a run: ``init_from`` (starting weights) and the callbacks of
``early_stopping`` and ``eval_samples``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainq.trainer.callbacks import RunState
from trainq.trainer.config import ConfigError, TrainConfig
from trainq.trainer.early_stop import EarlyStopping

if TYPE_CHECKING:
    from trainq.trainer.run import Invocation


def round_three_callbacks(config: TrainConfig, run: RunState, tokenizer, job_dir: Path) -> list:
    """Callbacks of the opt-in knobs: early_stopping, eval_samples."""
    found = []
    if config.early_stopping_patience is not None:
        found.append(EarlyStopping(run, config.early_stopping_patience, config.early_stopping_min_delta))
    if config.eval_samples_prompts is not None:
        from trainq.trainer.eval_samples import EvalSamples

        found.append(EvalSamples(run, config, tokenizer, job_dir))
    return found


def initial_weights(model, config: TrainConfig, run: RunState, inv: Invocation, announce: bool) -> None:
    """``init_from`` (or the watcher's TRAINQ_INIT_FROM from a fork): load the weights, checked shape by shape."""
    source = inv.init_from or (Path(config.init_from) if config.init_from else None)
    if source is None:
        return
    from trainq.trainer import init_from

    try:
        kind, loaded = init_from.load(model, source, config.method)
    except ConfigError as exc:
        raise ConfigError(f"{inv.job_dir / 'job.yaml'}: {exc}") from None
    if announce:
        run.metrics.event(
            "init_from",
            f"initial weights from {source} ({kind}, {loaded} tensors); fresh optimizer and schedule",
            path=str(source),
            kind=kind,
            tensors=loaded,
        )
        print(
            f"trainq: initial weights from {source} ({kind}, {loaded} tensors); fresh optimizer and schedule",
            flush=True,
        )
