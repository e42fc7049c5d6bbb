"""One training run, top to bottom: config -> setup -> data -> model -> resume -> Trainer loop -> finish."""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PrinterCallback, TrainingArguments

from trainq.trainer import artifacts, checkpoints, distributed, ladder, packing
from trainq.trainer.callbacks import RunState, TrainqCallback, TrainqTrainer
from trainq.trainer.config import ConfigError, TrainConfig, load_config
from trainq.trainer.data import MAX_REPORTED_BAD_ROWS, DataError, count_reasons, counts_text
from trainq.trainer.early_stop import restore_best
from trainq.trainer.faults import parse_faults
from trainq.trainer.knobs import initial_weights, round_three_callbacks
from trainq.trainer.metrics import MetricsWriter, read_records
from trainq.trainer.modeling import Precision, build_model, count_params, load_tokenizer, resolve_precision
from trainq.trainer.plateau import PlateauWatch, uniform_loss
from trainq.trainer.plotter import LossPlotter
from trainq.trainer.preflight import check_startup
from trainq.trainer.presets import Knobs, ModelShape, choose, free_gpu_mb
from trainq.trainer.resume_knobs import applied_changes, check_resume_knobs
from trainq.trainer.sources import LoadedData, changed_files, check_encoded, load_data, tokenize_cached
from trainq.trainer.vitals import OUTCOME_SCHEDULE, VitalsCallback
from trainq.watcher.spec.contract import (
    ENV_ATTEMPT,
    ENV_INIT_FROM,
    ENV_METRICS,
    ENV_RESUME_FROM,
    ENV_STOP_FLAG,
    ENV_TRAINER_FAULTS,
    EXIT_CHECKPOINT,
    EXIT_NAN,
    EXIT_OK,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_SCHEDULE,
    RECORD_DONE,
    JobPaths,
)
from trainq.watcher.spec.fsutil import process_start_ticks
from trainq.watcher.spec.units import iso_utc

if TYPE_CHECKING:
    from trainq.trainer.data import TokenizedDataset
    from trainq.trainer.dpo import PreferenceRows

logger = logging.getLogger(__name__)

#: rollbacks after non-finite streaks; the third request ends the run with EXIT_NAN
MAX_ROLLBACKS = 3
#: exit code per outcome
EXIT_FOR = {
    "done": EXIT_OK,
    "stopped": EXIT_OK,
    "preempted": EXIT_PREEMPTED,
    "nan": EXIT_NAN,
    "oom": EXIT_OOM,
    OUTCOME_SCHEDULE: EXIT_SCHEDULE,
    "sliced": EXIT_CHECKPOINT,
}


class ScheduleChanged(checkpoints.CheckpointError):
    """Raised when a resume would change the schedule, lr, seq_len or dropout without allow_changed_schedule."""


class DataChanged(DataError):
    """Raised when a data file's content differs from the checkpoint's without allow_changed_data."""


@dataclass(frozen=True)
class Invocation:
    """Where this process reads and writes, from the command line and the watcher's environment."""

    job_dir: Path
    metrics: Path
    stop_flag: Path
    attempt: int
    resume_from: Path | None
    init_from: Path | None = None  # TRAINQ_INIT_FROM: a checkpoint's weights, with a fresh optimizer and schedule

    @classmethod
    def from_args(cls, job_dir: Path, resume_from: str | None) -> Invocation:
        paths = JobPaths(job_dir.resolve())
        resume = resume_from or os.environ.get(ENV_RESUME_FROM) or None
        return cls(
            job_dir=paths.dir,
            metrics=Path(os.environ.get(ENV_METRICS) or paths.metrics),
            stop_flag=Path(os.environ.get(ENV_STOP_FLAG) or paths.stop_flag),
            attempt=int(os.environ.get(ENV_ATTEMPT) or 1),
            resume_from=Path(resume) if resume else None,
            init_from=Path(os.environ[ENV_INIT_FROM]) if os.environ.get(ENV_INIT_FROM) else None,
        )


# -- settling the config: preset, OOM ladder, checkpoint compatibility --------------------------------------


def apply_preset(config: TrainConfig, metrics: MetricsWriter) -> tuple[TrainConfig, dict | None]:
    """``preset: auto``: the largest seq_len/batch/rank under 85% of free GPU memory (same effective batch)."""
    if config.preset != "auto":
        return config, None
    free = free_gpu_mb()
    if free is None:
        metrics.event(
            "preset", "preset: auto: no GPU found (NVML or TRAINQ_SIMULATE_GPUS); keeping the configured values"
        )
        return config, {"applied": False, "reason": "no GPU"}
    shape = ModelShape.from_config(json.loads((Path(config.model) / "config.json").read_text()))
    requested = Knobs(config.seq_len, config.batch_size, config.grad_accum, config.lora.r)
    choice = choose(shape, config.method, requested, free[0])
    knobs = choice.knobs
    world_size = distributed.World.from_env().world_size  # the preset fits one rank's GPU; the batch is per rank
    info = {
        "applied": True,
        "gpu": free[1],
        **choice.to_dict(),
        "params": shape.params,
        "global_batch": knobs.batch_size * knobs.grad_accum * world_size,
        "world_size": world_size,
    }
    metrics.event(
        "preset",
        f"preset: auto on {free[1]}: seq_len {knobs.seq_len}, batch_size {knobs.batch_size}, "
        f"grad_accum {knobs.grad_accum}, lora.r {knobs.lora_r}, global batch {info['global_batch']} "
        f"(x {world_size} ranks) (~{choice.estimate.total_mb:.0f} of "
        f"{choice.budget_mb:.0f} MiB budget)",
        **info,
    )
    return config.with_changes(
        seq_len=knobs.seq_len, batch_size=knobs.batch_size, grad_accum=knobs.grad_accum, lora_r=knobs.lora_r
    ), info


def apply_ladder(config: TrainConfig, inv: Invocation, metrics: MetricsWriter) -> tuple[TrainConfig, bool]:
    """After an OOM attempt, with oom_ladder: auto, take the next rung; True when knobs changed."""
    if config.oom_ladder != "auto" or inv.attempt <= 1:
        return config, False
    planned = ladder.plan(read_records(inv.metrics), inv.attempt)
    if planned is None:
        return config, False
    knobs, rung = planned
    if rung is not None:
        metrics.event(
            ladder.LADDER_EVENT,
            f"attempt {inv.attempt}: OOM ladder: {rung.change}",
            attempt=inv.attempt,
            to=knobs,
            change=rung.change,
        )
        print(f"trainq: attempt {inv.attempt} after out of memory: {rung.change}", flush=True)
    return config.with_changes(
        seq_len=knobs["seq_len"], batch_size=knobs["batch_size"], grad_accum=knobs["grad_accum"]
    ), True


def pin_to_checkpoint(config: TrainConfig, saved: dict) -> TrainConfig:
    """A resumed preset keeps the checkpoint's choice (free memory may differ now; the adapter shape may not)."""
    if config.preset != "auto":
        return config
    return config.with_changes(
        seq_len=saved["seq_len"],
        batch_size=saved["batch_size"],
        grad_accum=saved["grad_accum"],
        lora_r=saved["lora"]["r"],
    )


#: knobs a resume must keep (beyond max_steps/epochs/batch), each read from the config and a checkpoint's config dict
_RESUME_KNOBS = {
    "lr": (lambda c: c.lr, lambda d: d.get("lr")),
    "scheduler": (lambda c: c.scheduler, lambda d: d.get("scheduler")),
    "warmup_ratio": (lambda c: c.warmup_ratio, lambda d: d.get("warmup_ratio")),
    "lora.dropout": (lambda c: c.lora.dropout, lambda d: d.get("lora", {}).get("dropout")),
}


def check_schedule(config: TrainConfig, saved: dict, laddered: bool, folder: Path) -> None:
    """Refuse a changed max_steps/epochs/batch/accum/lr/scheduler/warmup/seq_len/dropout vs the checkpoint unless
    allowed (the ladder keeps the effective batch and may halve seq_len)."""
    keys = ["max_steps", "epochs"] + ([] if laddered else ["batch_size", "grad_accum", "seq_len"])
    changed = [f"{k} {saved.get(k)} -> {getattr(config, k)}" for k in keys if saved.get(k) != getattr(config, k)]
    changed += [
        f"{name} {old(saved)} -> {new(config)}"
        for name, (new, old) in _RESUME_KNOBS.items()
        if old(saved) is not None and old(saved) != new(config)
    ]
    if laddered and saved["batch_size"] * saved["grad_accum"] != config.effective_batch:
        changed.append(f"effective batch {saved['batch_size'] * saved['grad_accum']} -> {config.effective_batch}")
    if saved["lora"]["r"] != config.lora.r and config.method != "full":
        raise ScheduleChanged(
            f"{folder}: lora.r {saved['lora']['r']} -> {config.lora.r}: the adapter shape changed; resume needs the same rank"
        )
    if changed and not config.allow_changed_schedule:
        raise ScheduleChanged(
            f"{folder}: resume would change {', '.join(changed)}; set train.allow_changed_schedule: true to accept"
        )


def check_data(config: TrainConfig, state: dict, data: LoadedData, folder: Path, metrics: MetricsWriter) -> None:
    """Refuse data whose content differs from what the checkpoint trained on, unless allow_changed_data."""
    if "data_files" not in state:
        return
    changes = changed_files(state["data_files"], data.files)
    if not changes:
        return
    if not config.allow_changed_data:
        raise DataChanged(
            f"{folder}: resume refused: {'; '.join(changes)}; restore the data or set "
            "train.allow_changed_data: true to train on the new data"
        )
    metrics.event(
        "data_changed", f"resuming on changed data (allow_changed_data): {'; '.join(changes)}", changes=changes
    )


# -- the run ------------------------------------------------------------------------------------------------


def total_steps(config: TrainConfig, train_rows: int, world_size: int = 1) -> int:
    """Optimizer steps of the whole run (as the Trainer counts them: the last partial accumulation still steps;
    each of ``world_size`` ranks takes its own batch per micro-step)."""
    if config.max_steps:
        return config.max_steps
    assert config.epochs is not None, "the schema asks for exactly one of max_steps and epochs"
    batches = math.ceil(train_rows / (config.batch_size * world_size))
    return max(math.ceil(config.epochs * math.ceil(batches / config.grad_accum)), 1)


def training_args(
    config: TrainConfig,
    precision: Precision,
    out_dir: Path,
    has_eval: bool,
    lr_scale: float,
    train_rows: int,
    job_dir: Path | None = None,
    args_class: type = TrainingArguments,
    **extra: object,
) -> TrainingArguments:
    """The Trainer knobs users know, mapped 1:1 from the train: block; checkpoints and logs are trainq's.
    Warm-up is passed as a whole number of steps, which every transformers version reads the same way."""
    length = {"max_steps": config.max_steps} if config.max_steps else {"num_train_epochs": config.epochs}
    world = distributed.World.from_env()
    warmup_steps = math.ceil(config.warmup_ratio * total_steps(config, train_rows, world.world_size))
    reporting: dict[str, object] = {"report_to": list(config.report_to) or "none", "logging_strategy": "no"}
    optimizer = {"optim": config.optim} if config.optim else {}  # unset: the Trainer's own default
    if config.report_to:
        reporting.update(logging_strategy="steps", logging_steps=config.log_every)
    gradient_checkpointing = config.gradient_checkpointing if config.method != "qlora" else False  # peft prepares qlora
    return args_class(
        output_dir=str(out_dir),
        per_device_train_batch_size=config.batch_size,
        per_device_eval_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        learning_rate=config.lr * lr_scale,
        lr_scheduler_type=config.scheduler,
        warmup_steps=warmup_steps,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        seed=config.seed,
        gradient_checkpointing=bool(gradient_checkpointing),
        bf16=precision.name == "bf16",
        fp16=precision.name == "fp16",
        use_cpu=not torch.cuda.is_available(),
        eval_strategy="steps" if has_eval and config.eval_every else "no",
        eval_steps=config.eval_every,
        save_strategy="no",
        logging_nan_inf_filter=False,
        **reporting,
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        **length,
        **optimizer,
        **extra,
        **distributed.training_kwargs(config, world, cpu=not torch.cuda.is_available()),
    )


def report_data(data: LoadedData, metrics: MetricsWriter) -> None:
    """Each file's sha256 and row counts (one ``data`` event); bad rows within the limit to stderr and an event."""
    metrics.event(
        "data",
        "; ".join(f"{f.role} {f.path}: {f.rows} rows, {f.bad_rows} bad, sha256 {f.sha256[:12]}" for f in data.files),
        files=[f.to_dict() for f in data.files],
        train_rows=len(data.train),
        eval_rows=len(data.eval),
    )
    report_bad_rows(data.bad, metrics, "reading")


def report_bad_rows(bad: list, metrics: MetricsWriter, stage: str) -> None:
    """Bad rows within the limit: each to stderr (the first MAX_REPORTED_BAD_ROWS) and one ``bad_rows`` event."""
    if not bad:
        return
    for row in bad[:MAX_REPORTED_BAD_ROWS]:
        print(f"trainq: skipped bad row: {row}", file=sys.stderr, flush=True)
    metrics.event(
        "bad_rows",
        f"{len(bad)} bad rows skipped while {stage}: {counts_text(bad)}",
        count=len(bad),
        stage=stage,
        reasons=count_reasons(bad),
        rows=[
            {"file": r.file, "line": r.line, "reason": r.reason, "category": r.category}
            for r in bad[:MAX_REPORTED_BAD_ROWS]
        ],
    )


def run_segment(config, precision, datasets, tokenizer, run: RunState, resume: Path | None, inv: Invocation):
    """Build model + Trainer and train, resuming from ``resume``; returns the Trainer."""
    model = build_model(config, precision)
    trainable, total = count_params(model)
    if run.packing is None:
        run.packing = (
            packing.PackingDecision(False, "method: dpo pads chosen/rejected pairs (TRL's collator)")
            if config.method == "dpo"
            else packing.decide(config.packing, model, str(inv.job_dir / "job.yaml"))
        )
        run.metrics.event(
            "packing",
            f"packing {'on' if run.packing.enabled else 'off'}: {run.packing.reason}",
            **run.packing.to_dict(),
        )
    if run.world.is_main:
        print(
            f"trainq: {config.method} on {Path(config.model).name}: {trainable:,} trainable of {total:,} params, "
            f"{precision.name}, {len(datasets[0])} train / {len(datasets[1] or [])} eval rows, "
            f"packing {'on' if run.packing.enabled else 'off'} ({run.packing.reason})",
            flush=True,
        )
    if resume is None or config.method == "dpo":  # dpo: the reference is the starting adapter, on resume too
        initial_weights(model, config, run, inv, announce=resume is None)
    callback = TrainqCallback(run, has_eval=datasets[1] is not None)
    vitals = VitalsCallback(run, lr_bug_at=run.faults.lr_bug_at)
    dpo_extra = {}
    if config.method == "dpo":
        from trainq.trainer.dpo import build_dpo_trainer, dpo_arguments

        dpo_extra = dpo_arguments(config)
    args = training_args(
        config,
        precision,
        run.ckpt_dir,
        datasets[1] is not None,
        run.lr_scale,
        len(datasets[0]),
        inv.job_dir,
        **dpo_extra,
    )
    if config.method == "dpo":
        trainer = build_dpo_trainer(model, args, datasets, tokenizer, callback, run)
        trainer.add_callback(vitals)
    else:
        trainer = TrainqTrainer(
            model=model,
            args=args,
            train_dataset=datasets[0],
            eval_dataset=datasets[1],
            data_collator=packing.collator(tokenizer.pad_token_id, run.packing.enabled),
            callbacks=[vitals, callback],
            run=run,
        )
    run.trainer = trainer
    callback.trainer = trainer
    trainer.remove_callback(PrinterCallback)  # trainq prints its own one line per interval
    for extra in round_three_callbacks(config, run, tokenizer, inv.job_dir):
        trainer.add_callback(extra)
    if resume is not None:
        saved = checkpoints.read_state(resume)
        run.resumed_fingerprint, run.resumed_lr_scale = saved["trainable_fingerprint"], saved["lr_scale"]
        run.resumed_lr = saved["config"]["lr"]
    if run.finish_from is not None:
        return finish_only(trainer, run, config)
    if run.rollbacks:  # the abandoned segment's Trainer and model (reference cycles) go before the freeze keeps them
        gc.collect()
    # what set-up built (modules, data rows, the model's Python side: ~1 M objects) leaves the collector's walks:
    # the Trainer's gc.collect() as train() starts and each full collection during it skip them (issue 37, item 3)
    gc.freeze()
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:
        run.train_s += time.perf_counter() - started  # the trainer.train() window, as bench/ times the plain Trainer
        run.train_cpu_s += time.process_time() - cpu_started
        gc.unfreeze()
    return trainer


def finish_only(trainer, run: RunState, config: TrainConfig):
    """A checkpoint at the run's last step whose outputs were never written (stopped while finishing): load its
    weights and let ``finish`` write them, training nothing (the Trainer would take a step past the end)."""
    assert run.finish_from is not None  # set whenever finish_only is chosen
    checkpoints.load_initial_weights(trainer.model, run.finish_from, full=config.method == "full")
    trainer.state.global_step = trainer.state.max_steps = run.resumed_step
    steps = [r for r in read_records(run.metrics.path) if r.get("type") == "step" and r["step"] <= run.resumed_step]
    run.last_loss = steps[-1].get("loss") if steps else None
    if run.world.is_main:
        print(
            f"trainq: {run.finish_from.name} is the run's last step ({run.resumed_step}): writing the final "
            "outputs from it, no training",
            flush=True,
        )
    return trainer


def train_with_rollbacks(config, precision, datasets, tokenizer, run: RunState, resume: Path | None, inv: Invocation):
    """Train; after three non-finite steps in a row roll back to ckpt_latest with the lr halved (at most twice)."""
    while True:
        run.stop_reason, run.nonfinite_streak = None, 0
        trainer = run_segment(config, precision, datasets, tokenizer, run, resume, inv)
        if run.stop_reason != "rollback":
            return trainer
        step = trainer.state.global_step
        if run.rollbacks + 1 >= MAX_ROLLBACKS:
            run.stop_reason = "nan"
            return trainer
        run.rollbacks += 1  # counts rollbacks carried out (summary.json and the final message agree)
        trainer = None  # run.trainer keeps the abandoned segment's Trainer until the next one replaces it
        resume = checkpoints.newest_complete(run.ckpt_dir)
        run.lr_scale /= 2
        target = resume.name if resume else "the start"
        run.metrics.event(
            "rollback",
            f"step {step}: {run.nonfinite_streak} non-finite steps in a row; rolling back to "
            f"{target} with lr x{run.lr_scale:g}",
            step=step,
            to=str(resume) if resume else None,
            lr_scale=run.lr_scale,
            rollbacks=run.rollbacks,
        )
        print(f"trainq: non-finite loss at step {step}; rolling back to {target}, lr x{run.lr_scale:g}", flush=True)


def is_oom(exc: BaseException) -> bool:
    """torch's OOM error, or a RuntimeError that says out of memory."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def record_oom(exc: BaseException, config: TrainConfig, run: RunState, inv: Invocation) -> str:
    """The OOM event (with the knobs in effect and the ladder advice); returns the final stderr line."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    advice = ladder.advice(config)
    if not run.world.is_main:  # the rank that ran out of memory says so, whichever it is (the ladder reads it)
        run.metrics = MetricsWriter(inv.metrics)
    where = f"rank {run.world.rank}: " if run.world.is_distributed else ""
    run.metrics.event(
        ladder.OOM_EVENT,
        f"{where}out of memory: {first}",
        attempt=inv.attempt,
        advice=advice,
        **ladder.knobs_of(config),
        **({"rank": run.world.rank} if run.world.is_distributed else {}),
    )
    return f"trainq: out of memory: {first}; {advice}"


def _relative(path: Path | None, job_dir: Path) -> str | None:
    """A path inside the job folder as seen from it (the folder moves between queue states); others stay absolute."""
    if path is None:
        return None
    try:
        return str(path.resolve().relative_to(job_dir.resolve()))
    except ValueError:
        return str(path)


def world_info(config: TrainConfig, world: distributed.World) -> dict:
    """What env.json and summary.json say about the ranks (``hosts``: where they ran, each host once, in rank order)."""
    return {
        "world_size": world.world_size,
        "hosts": list(dict.fromkeys(world.hosts)),
        "processes": world.local_world_size,
        "strategy": config.strategy if world.is_distributed else None,
    }


def finish(outcome: str, trainer, tokenizer, config: TrainConfig, run: RunState, inv: Invocation, timing: dict) -> int:
    """Final artifacts, summary.json, loss.png, SHA256SUMS and the done record; returns the exit code.
    A rank other than 0 only takes its part in saving the final weights (FSDP gathers them)."""
    trainer = trainer or run.trainer
    final_dir = inv.job_dir / ("model" if config.method == "full" else "adapter")
    fsdp = run.world.is_distributed and config.strategy == "fsdp" and outcome == "done" and trainer is not None
    if fsdp:
        distributed.save_full_weights(trainer, tokenizer, final_dir, run.world)  # every rank joins the gather
    if not run.world.is_main:
        return EXIT_FOR[outcome]
    names = ["summary.json", "loss.png", artifacts.ENV_FILE]
    merged = None
    plotter = run.plotter or LossPlotter()
    # the step records are all written: the helper draws loss.png while the model is saved
    plotter.request(inv.metrics, inv.job_dir / "loss.png", f"{inv.job_dir.name}: {config.method} ({outcome})")
    if outcome == "done" and trainer is not None:
        if not fsdp:
            restore_best(trainer.model, run, full=config.method == "full")
            artifacts.save_final(trainer, tokenizer, final_dir)
        names.insert(0, final_dir.name)
        if config.export_merge and config.method != "full":
            from trainq.trainer.export import export_merged

            merged = export_merged(trainer.model, config, tokenizer, inv.job_dir / "merged", run.metrics)
            names.insert(1, merged.name)
    now = time.time()
    state = trainer.state if trainer is not None else None
    train_s = run.train_s
    ckpt = lambda step: _relative(run.ckpt_dir / checkpoints.step_dir_name(step), inv.job_dir)  # noqa: E731
    summary = {
        "outcome": outcome,
        "exit_code": EXIT_FOR[outcome],
        "steps": state.global_step if state else run.resumed_step,
        "total_steps": state.max_steps if state else None,
        "final_loss": run.last_loss,
        "final_eval_loss": run.last_eval_loss,
        "best_eval_loss": run.best_eval_loss,
        "best_step": run.best_step,
        "best_checkpoint": ckpt(run.best_step) if run.best_step else None,
        "latest_checkpoint": _relative(run.last_checkpoint, inv.job_dir),
        "output": final_dir.name if outcome == "done" else None,
        "merged": merged.name if merged else None,
        "attempt": inv.attempt,
        "resumed_from": _relative(run.resumed_from, inv.job_dir),
        "rollbacks": run.rollbacks,
        **world_info(config, run.world),
        "early_stopping": run.early_stop or None,
        "tokens_per_s": run.tokens_seen / train_s if train_s > 0 else None,
        "tokens": run.tokens_before + run.tokens_seen,
        "tokens_this_attempt": run.tokens_seen,
        "packing": run.packing.to_dict() if run.packing else None,
        "train_on": config.train_on,
        "data": [f.to_dict() for f in run.data_files],
        "durations_s": {
            "setup": round(timing["setup"], 3),
            "train": round(train_s, 3),
            "train_cpu": round(run.train_cpu_s, 3),
            "total": round(now - timing["start"], 3),
        },
        "started_at": iso_utc(timing["start"]),
        "finished_at": iso_utc(now),
    }
    summary = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}
    artifacts.write_summary(inv.job_dir, summary)
    plotter.wait()
    artifacts.write_sums(inv.job_dir, names)
    run.metrics.write(
        RECORD_DONE,
        outcome=outcome,
        step=summary["steps"],
        total_steps=summary["total_steps"],
        loss=run.last_loss,
        eval_loss=run.last_eval_loss,
        exit_code=EXIT_FOR[outcome],
    )
    run.metrics.sync()
    print(
        f"trainq: {outcome} at step {summary['steps']}/{summary['total_steps']} "
        f"(loss {run.last_loss}, best eval loss {run.best_eval_loss}); summary.json written",
        flush=True,
    )
    return EXIT_FOR[outcome]


def check_reporters(config: TrainConfig, job_dir: Path) -> None:
    """``report_to: [tensorboard]`` needs a TensorBoard writer installed; say so before any work is done."""
    import importlib.util

    if "tensorboard" in config.report_to and not any(
        importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")
    ):
        raise ConfigError(
            f"{job_dir / 'job.yaml'}: train.report_to: tensorboard needs the tensorboard package in the "
            "trainer's environment (pip install 'trainq[tensorboard]'); remove it or install it"
        )


def settle_config(config: TrainConfig, inv: Invocation, metrics: MetricsWriter, data: LoadedData, world_size: int = 1):
    """Preset, OOM ladder and the resume checks; returns (config, resume folder, its saved state, preset info)."""
    resume = checkpoints.resolve_resume(inv.resume_from) if inv.resume_from else None
    saved = checkpoints.read_state(resume) if resume else None
    config, preset_info = (pin_to_checkpoint(config, saved["config"]), None) if saved else apply_preset(config, metrics)
    config, laddered = apply_ladder(config, inv, metrics)
    if saved and resume is not None:  # a saved state comes only from a resume folder
        config = distributed.keep_global_batch(config, saved, world_size, resume)
        check_schedule(config, saved["config"], laddered, resume)
        check_resume_knobs(config, saved["config"], resume)
        check_data(config, saved, data, resume, metrics)
        record_changes(config, saved, resume, metrics)
    return config, resume, saved, preset_info


def record_changes(config: TrainConfig, saved: dict, resume: Path, metrics: MetricsWriter) -> None:
    """One ``event`` per knob an allowed resume changes (``resume_change``: knob, old, new), and a line each."""
    for knob, old, new in applied_changes(config, saved["config"]):
        words = f"resume from {resume.name}: {knob} {old} -> {new} (allowed; applied from step {saved['step'] + 1})"
        metrics.event("resume_change", words, knob=knob, old=old, new=new, step=saved["step"])
        print(f"trainq: {words}", flush=True)


def process_started_at(pid: int) -> float:
    """When ``pid`` started, on the wall clock, to a clock tick (10 ms): its start in ticks after boot
    (``/proc/PID/stat``) set against the uptime now. psutil's ``create_time`` adds the boot time in whole seconds
    and reads up to 1 s early (0.4 s here), so a stop.flag written just before a resume looked newer than it."""
    try:
        ticks = process_start_ticks(pid)
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process(pid).create_time()
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def clear_stale_stop_flag(stop_flag: Path, world: distributed.World) -> None:
    """A stop.flag older than this attempt's start was meant for an earlier attempt (a hand-run resume would
    otherwise train one step and stop): rank 0 removes it and says so. The attempt started when this process
    did, or its torchrun agent (the parent) with several ranks: a stop asked while the ranks import is kept."""
    if not world.is_main:
        return
    try:
        written = stop_flag.stat().st_mtime
    except FileNotFoundError:
        return
    started = process_started_at(os.getppid() if world.is_distributed else os.getpid())
    if written >= started:
        return
    stop_flag.unlink(missing_ok=True)
    print(
        f"trainq: removed a stale {stop_flag.name} written at {iso_utc(written)}, before this attempt started "
        f"({iso_utc(started)}); touch it again to stop this attempt",
        flush=True,
    )


def finished_at(config: TrainConfig, resume: Path, saved: dict) -> int | None:
    """The last step of the run when the checkpoint ``resume`` already reached it (else None): the configured
    max_steps, or the Trainer's own count of an epochs run saved in the checkpoint (same epochs)."""
    planned = config.max_steps
    if planned is None and saved["config"].get("epochs") == config.epochs:
        planned = json.loads((resume / "trainer_state.json").read_text()).get("max_steps")
    return saved["step"] if planned and saved["step"] >= planned else None


def outputs_written(job_dir: Path, config: TrainConfig) -> bool:
    """summary.json says done and the final adapter/ (or model/) is there."""
    try:
        done = json.loads((job_dir / "summary.json").read_text()).get("outcome") == "done"
    except (OSError, ValueError):
        return False
    return done and (job_dir / ("model" if config.method == "full" else "adapter")).is_dir()


def main_run(job_dir: Path, resume_arg: str | None, plotter: LossPlotter | None = None) -> int:
    """Everything after argument parsing; errors with an exit code propagate to __main__.

    ``plotter``: a loss.png helper __main__ started before the heavy imports (one is started here otherwise).
    """
    timing = {"start": time.time()}
    inv = Invocation.from_args(job_dir, resume_arg)
    config = load_config(inv.job_dir)
    world = distributed.World.from_env()
    faults = parse_faults(os.environ.get(ENV_TRAINER_FAULTS))
    clear_stale_stop_flag(inv.stop_flag, world)
    distributed.init(world, cpu=not torch.cuda.is_available(), late_join_s=faults.join_delay_s(world.rank))
    world = distributed.with_hosts(world)
    if world.is_distributed:
        print(
            f"trainq: rank {world.rank} of {world.world_size} (local rank {world.local_rank}, "
            f"{'cpu' if not torch.cuda.is_available() else f'cuda:{world.local_rank}'}, pid {os.getpid()})",
            flush=True,
        )
    check_reporters(config, inv.job_dir)
    if config.report_to:
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(inv.job_dir / "tensorboard")  # read by transformers' callback
    metrics = MetricsWriter(inv.metrics if world.is_main else Path(os.devnull))  # rank 0 alone writes records
    data = load_data(config.train_sources, config.eval_file, config.eval_fraction, config.max_bad_rows)
    config, resume, saved, preset_info = settle_config(config, inv, metrics, data, world.world_size)
    end = finished_at(config, resume, saved) if saved else None
    if end is not None and outputs_written(inv.job_dir, config):
        if world.is_main:
            print(
                f"trainq: {resume.name} is step {end} of {end}: this run is finished (summary.json says done); "
                "nothing to train, nothing written",
                flush=True,
            )
        return EXIT_OK
    report_data(data, metrics)
    check_startup(
        config, inv.job_dir / "job.yaml"
    )  # model, weights, tokenizer, target modules, template: before any (smoke) training
    precision = resolve_precision(config.precision)
    tokenizer = load_tokenizer(config.model, config.chat_template)
    cache_dir = inv.job_dir / ".cache" / "tokenized" if config.data_cache else None
    if not world.is_main:
        distributed.barrier(world)  # rank 0 tokenizes (and fills the cache) first; the others then read it
    train_set: TokenizedDataset | PreferenceRows
    eval_set: TokenizedDataset | PreferenceRows | None
    if config.method == "dpo":
        from trainq.trainer.dpo import datasets_for

        (train_set, eval_set), cached = datasets_for(data, tokenizer, config.seq_len), False
    else:
        train_set, eval_set, cached = tokenize_cached(
            data, tokenizer, config.seq_len, config.train_on, config.eval_fraction, cache_dir
        )
    if world.is_main:
        distributed.barrier(world)
    if cached and world.is_main:
        print(f"trainq: tokenized data from the cache ({len(train_set)} train rows)", flush=True)
    report_bad_rows(check_encoded(data, train_set, eval_set, config.max_bad_rows), metrics, "tokenizing")
    eval_set = eval_set if eval_set else None  # every eval row filtered out: no eval
    if config.debug and resume is None and world.is_distributed:
        metrics.event("debug", "debug: the smoke run is not made with several ranks; training directly")
    elif config.debug and resume is None:
        from trainq.trainer.debugrun import run_debug

        code = run_debug(
            config,
            inv.job_dir,
            inv.stop_flag,
            total_steps(config, len(data.train)),
            metrics,
            uniform_loss(len(tokenizer)),
        )
        if code is not None:
            return code
    metrics.event(
        "start",
        f"attempt {inv.attempt}: {config.method}, pid {os.getpid()}" + (f", resuming from {resume}" if resume else ""),
        attempt=inv.attempt,
        pid=os.getpid(),
        resume_from=str(resume) if resume else None,
    )
    env = artifacts.environment(config.to_dict(), {"name": precision.name, "reason": precision.reason}, preset_info)
    if world.is_main:
        artifacts.write_env(
            inv.job_dir, {**env, "data": [f.to_dict() for f in data.files], **world_info(config, world)}
        )

    run = RunState(
        config=config,
        ckpt_dir=JobPaths(inv.job_dir).checkpoints,
        stop_flag=inv.stop_flag,
        metrics=metrics,
        faults=faults,
        attempt=inv.attempt,
        data_files=data.files,
        resumed_from=resume,
        world=world,
    )
    if saved:
        run.lr_scale, run.rollbacks = saved["lr_scale"], saved.get("rollbacks", 0)
        run.best_eval_loss, run.best_step = saved["best_eval_loss"], saved["best_step"]
        run.tokens_before, run.resumed_step = saved.get("tokens_seen", 0), saved["step"]
        run.early_stop = dict(saved.get("early_stop") or {})
        run.finish_from = resume if end is not None else None  # trained to the end; the outputs were not written
    run.plateau = PlateauWatch(uniform_loss(len(tokenizer)))
    signal.signal(signal.SIGTERM, run.on_sigterm)
    run.plotter = plotter or LossPlotter().start()  # imports matplotlib on another core while the model trains
    timing["setup"] = time.time() - timing["start"]
    trainer = None
    try:
        trainer = train_with_rollbacks(config, precision, (train_set, eval_set), tokenizer, run, resume, inv)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not is_oom(exc):
            raise
        line = record_oom(exc, config, run, inv)
        finish("oom", trainer, tokenizer, config, run, inv, timing)
        print(line, file=sys.stderr, flush=True)  # last, so the watcher's diagnosis finds it as the evidence line
        return EXIT_OOM
    outcome = run.stop_reason or "done"
    code = finish(outcome, trainer, tokenizer, config, run, inv, timing)
    if outcome == "nan":
        print(
            f"trainq: training diverged: non-finite loss persisted through {run.rollbacks} rollbacks "
            f"(lr x{run.lr_scale:g}); lower lr or check the data",
            file=sys.stderr,
            flush=True,
        )
    return code
