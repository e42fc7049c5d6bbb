"""What trainq adds to transformers' Trainer: per-step records, guards, stop/preempt, checkpoint cadence.

``TrainqTrainer`` overrides only what a callback cannot reach (the raw per-step loss, fault injection,
checkpoint writing); ``TrainqCallback`` does the rest at the Trainer's step boundaries.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import Trainer, TrainerCallback

from trainq.trainer import checkpoints
from trainq.trainer.config import TrainConfig
from trainq.trainer.distributed import StepVote, World, barrier
from trainq.trainer.faults import Faults
from trainq.trainer.metrics import MetricsWriter
from trainq.trainer.modeling import fingerprint, trainable_state
from trainq.trainer.plateau import PLATEAU_STEPS, PlateauWatch
from trainq.trainer.resume_knobs import apply_to_optimizer
from trainq.watcher.spec.contract import CKPT_BEST, CKPT_LATEST, RECORD_CHECKPOINT, RECORD_EVAL, RECORD_STEP
from trainq.watcher.spec.fsutil import atomic_write_json, touch

if TYPE_CHECKING:
    from trainq.trainer.packing import PackingDecision
    from trainq.trainer.plotter import LossPlotter

logger = logging.getLogger(__name__)

#: consecutive non-finite steps that trigger a rollback to ckpt_latest
NONFINITE_STREAK = 3
#: a loss above mean + SPIKE_SIGMAS * stdev of the last SPIKE_WINDOW steps is a spike
SPIKE_SIGMAS = 5.0
SPIKE_WINDOW = 100
#: steps of history needed before spikes are judged
SPIKE_MIN_HISTORY = 20
#: what the spike fault adds to a step's loss
SPIKE_FAULT_LOSS = 50.0
#: accelerate setups whose gradient clipping is torch's clip_grad_norm_ after unscaling (TrainqTrainer._clip_grad_norm)
_PLAIN_CLIP = ("NO", "MULTI_CPU", "MULTI_GPU")


@dataclass
class RunState:
    """Mutable state of one trainer process, shared by the Trainer subclass and the callback."""

    config: TrainConfig
    ckpt_dir: Path
    stop_flag: Path
    metrics: MetricsWriter
    faults: Faults
    attempt: int = 1
    lr_scale: float = 1.0
    rollbacks: int = 0
    best_eval_loss: float | None = None
    best_step: int | None = None
    last_eval_loss: float | None = None
    last_loss: float | None = None
    stop_reason: str | None = None  # "stopped" | "preempted" | "rollback" | "schedule"
    sigterm_received: bool = False
    nonfinite_streak: int = 0
    nan_consumed: set[int] = field(default_factory=set)
    losses: deque = field(default_factory=lambda: deque(maxlen=SPIKE_WINDOW))
    train_s: float = 0.0  # seconds inside trainer.train() in this process (every segment)
    train_cpu_s: float = 0.0  # CPU seconds of this process inside trainer.train() (tokens per CPU-second)
    tokens_seen: int = 0
    save_pending: bool = False
    resumed_lr_scale: float | None = None
    resumed_fingerprint: str | None = None
    resumed_lr: float | None = None  # the lr the resumed checkpoint's optimizer and scheduler were built with
    last_checkpoint: Path | None = None
    trainer: object | None = None  # the current segment's Trainer (an OOM leaves it behind for the summary)
    packing: PackingDecision | None = None  # made once per process
    tokens_before: int = 0  # tokens of earlier attempts (from the resumed checkpoint)
    resumed_step: int = 0
    resumed_from: Path | None = None  # the step-N folder this attempt resumed from
    finish_from: Path | None = None  # a checkpoint at the run's last step: write the outputs from it, train nothing
    data_files: tuple = ()
    plotter: LossPlotter | None = None  # warmed up while training runs
    step_vitals: dict = field(default_factory=dict)  # this step's clip and update_ratio (vitals.py)
    started_mono: float = field(default_factory=time.monotonic)  # for train.max_minutes_per_attempt
    world: World = field(default_factory=World)  # this rank among the job's ranks (distributed.py)
    early_stop: dict = field(default_factory=dict)  # early_stop.EarlyStopping's count and outcome (checkpointed)
    plateau: PlateauWatch = field(
        default_factory=lambda: PlateauWatch(None)
    )  # set with ln V once the tokenizer is known

    def on_sigterm(self, signum: int, frame: object) -> None:
        """Signal handler: only sets a flag; the next step boundary acts on it."""
        self.sigterm_received = True


def _rows_in(inputs: dict) -> int:
    """Examples in a micro-batch: its rows, or the sequences flattened into one packed row."""
    if "attention_mask" not in inputs and "position_ids" in inputs:
        return int((inputs["position_ids"] == 0).sum())
    return inputs["input_ids"].shape[0]


class TrainqTrainer(Trainer):
    """Trainer that keeps the raw per-step loss, injects the documented faults and writes tmp-then-rename checkpoints."""

    def __init__(self, *args, run: RunState, **kwargs):
        super().__init__(*args, **kwargs)
        self.run = run
        self.step_loss = torch.zeros(())
        self.step_tokens = 0
        self.last_grad_norm: float | None = None
        self._flop_params: int | None = None  # floating_point_ops' parameter count, taken once
        self._trained_params: list | None = None  # what _clip_grad_norm clips, listed once

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch; also sums the raw loss and tokens of the current optimizer step."""
        self._maybe_fake_oom(_rows_in(inputs))
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.step_loss = self.step_loss + loss.detach().float().cpu()
        self.step_tokens += (
            int(inputs["attention_mask"].sum()) if "attention_mask" in inputs else inputs["input_ids"].numel()
        )
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's loss, with the NaN/spike faults applied when the switch names this step."""
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not model.training:
            return result
        loss = result[0] if return_outputs else result
        step = self.state.global_step + 1
        if self._fault_nan(step):
            loss = loss * float("nan")
        if (
            step in self.run.faults.nan_grad_at
            and step not in self.run.nan_consumed
            and loss.requires_grad
            and self.run.faults.nan_rank in (None, self.run.world.rank)
        ):
            loss.register_hook(lambda grad: grad * float("nan"))  # gradients NaN, the loss value untouched
        if step in self.run.faults.spike_at:
            loss = loss + SPIKE_FAULT_LOSS / max(self.current_gradient_accumulation_steps, 1)
        return (loss, result[1]) if return_outputs else loss

    def _fault_nan(self, step: int) -> bool:
        faults = self.run.faults
        if faults.nan_rank is not None and faults.nan_rank != self.run.world.rank:
            return False
        if faults.nan_after is not None and step >= faults.nan_after:
            return True
        return step in faults.nan_at and step not in self.run.nan_consumed

    def _maybe_fake_oom(self, batch_size: int) -> None:
        step = self.state.global_step + 1
        faults = self.run.faults
        if step in faults.oom_at or (faults.oom_if_batch_over is not None and batch_size > faults.oom_if_batch_over):
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB (simulated by TRAINQ_TRAINER_FAULTS at step {step}, batch {batch_size})"
            )

    def floating_point_ops(self, inputs) -> int:
        """The Trainer's flos estimate (6 x tokens x parameters without embeddings) with the parameter count taken
        once: transformers counts it again at every micro-step, a walk over every module (~2 ms a step on the
        small benchmark model, a few % of its step) for a number that cannot change during training."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        if self._flop_params is None:
            self._flop_params = self.model.num_parameters(exclude_embeddings=True)
        return 6 * inputs[main_input].numel() * self._flop_params

    def _clip_grad_norm(self, model):
        """Clip as accelerate does for one process or DDP (unscale, then torch's clip over the gradients), over the
        trained parameters listed once: accelerate lists ``model.parameters()`` anew at every step. Other setups
        (FSDP, DeepSpeed, sharded grads) go through the Trainer's own path."""
        accelerator = self.accelerator
        if accelerator.distributed_type not in _PLAIN_CLIP or self._has_mixed_mesh_grads(model):
            return super()._clip_grad_norm(model)
        if self._trained_params is None:
            self._trained_params = [p for p in model.parameters() if p.requires_grad]
        accelerator.unscale_gradients()
        return torch.nn.utils.clip_grad_norm_(self._trained_params, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        value = super()._get_grad_norm(model, grad_norm)
        self.last_grad_norm = float(value) if value is not None else None
        return value

    def step_extras(self) -> dict:
        """Extra fields of the step record (method: dpo adds TRL's rewards); none for SFT."""
        return {}

    def pop_step(self) -> tuple[float, int]:
        """(raw loss, tokens) of the optimizer step that just ended; resets the accumulators."""
        loss, tokens = float(self.step_loss), self.step_tokens
        self.step_loss, self.step_tokens = torch.zeros(()), 0
        return loss, tokens

    def _save_checkpoint(self, model, trial) -> None:
        """Write step-N.tmp, seal it with a manifest, rename to step-N, then move the links and rotate."""
        save_checkpoint(self, self.run)


def _trainq_state(trainer: TrainqTrainer, run: RunState) -> dict:
    state = trainer.state
    return {
        "resumable": True,
        "step": state.global_step,
        "epoch": state.epoch,
        "world_size": run.world.world_size,
        "samples_seen": state.global_step * run.config.effective_batch * run.world.world_size,
        "best_eval_loss": run.best_eval_loss,
        "best_step": run.best_step,
        "lr_scale": run.lr_scale,
        "rollbacks": run.rollbacks,
        "trainable_fingerprint": fingerprint(trainable_state(trainer.model)),
        "tokens_seen": run.tokens_before + run.tokens_seen,
        "data_files": [f.to_dict() for f in run.data_files],
        "config": run.config.to_dict(),
        "time": time.time(),
        "early_stop": dict(run.early_stop),
    }


def save_checkpoint(trainer: TrainqTrainer, run: RunState) -> Path:
    """Everything exact resume needs, in a folder that only becomes visible when complete.

    Several ranks: rank 0 makes step-N.tmp, every rank writes its part (its RNG state; the model and optimizer
    come from rank 0 under DDP, from every rank under FSDP), and only after a barrier does rank 0 write the
    manifest and rename the folder, so a rank that dies mid-save never leaves a checkpoint that looks complete."""
    step = trainer.state.global_step
    world = run.world
    tmp = (
        checkpoints.begin(run.ckpt_dir, step)
        if world.is_main
        else run.ckpt_dir / f"{checkpoints.step_dir_name(step)}.tmp"
    )
    barrier(world)
    trainer.store_flos()
    trainer.save_model(str(tmp), _internal_call=True)
    if run.faults.kill_in_save == step:
        os.kill(os.getpid(), signal.SIGKILL)  # the documented fault: die with a half-written folder
    trainer._save_optimizer_and_scheduler(str(tmp))
    trainer._save_scaler(str(tmp))
    trainer._save_rng_state(str(tmp))
    state = _trainq_state(trainer, run)  # every rank: the fingerprint of FSDP shards is a collective
    barrier(world)  # every rank's part is on disk
    if not world.is_main:
        run.last_checkpoint = tmp.with_name(checkpoints.step_dir_name(step))
        return run.last_checkpoint
    trainer.state.save_to_json(str(tmp / "trainer_state.json"))
    atomic_write_json(tmp / checkpoints.STATE_FILE, state)
    final = checkpoints.publish(tmp)
    checkpoints.point_link(run.ckpt_dir, CKPT_LATEST, final)
    if run.best_step == step:
        checkpoints.point_link(run.ckpt_dir, CKPT_BEST, final)
    checkpoints.rotate(run.ckpt_dir, run.config.checkpoint.keep)
    run.metrics.write(RECORD_CHECKPOINT, step=step, path=str(final.resolve()), best=run.best_step == step)
    run.last_checkpoint = final
    return final


def peak_mem_mb() -> float:
    """Peak accelerator memory (CUDA) or peak resident memory of this process (CPU), MiB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _grads_nonfinite(model) -> bool:
    """Any non-finite gradient (DDP without clipping, where no global gradient norm is computed)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return bool(grads) and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


def _mean_sigma(values) -> tuple[float, float]:
    """Mean and population standard deviation in floats (statistics.pstdev is exact, in fractions: ~0.3 ms for
    100 losses at every step, for a threshold that needs no such precision)."""
    mean = math.fsum(values) / len(values)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


class TrainqCallback(TrainerCallback):
    """Records, guards, cadence and stop handling at the Trainer's step boundaries."""

    def __init__(self, run: RunState, has_eval: bool):
        self.run = run
        self.has_eval = has_eval
        # set by run.py right after the Trainer is built, before any hook runs
        self.trainer: TrainqTrainer = None  # type: ignore[assignment]
        self.step_started = time.perf_counter()
        self.last_save = time.monotonic()
        self.step_nonfinite = False
        self.step_nonfinite_grad = False
        self.step_lr: float | None = None
        self.vote = StepVote(run.world)

    def on_train_begin(self, args, state, control, **kwargs):
        """Apply a rollback's lr halving and verify a resumed adapter before the first step."""
        self.last_save = time.monotonic()
        self._rescale_lr(kwargs["optimizer"], kwargs["lr_scheduler"])
        if self.run.resumed_fingerprint is not None and self.run.world.is_main:  # rank 0's weights (FSDP: its shard)
            self._verify_resumed(state)

    def _rescale_lr(self, optimizer, scheduler) -> None:
        """The restored optimizer and scheduler take this run's lr (times the rollback scale) and weight_decay."""
        loaded = self.run.resumed_lr_scale if self.run.resumed_lr_scale is not None else self.run.lr_scale
        saved_lr = self.run.resumed_lr if self.run.resumed_lr is not None else self.run.config.lr
        apply_to_optimizer(optimizer, scheduler, self.run.config, saved_lr, loaded, self.run.lr_scale)

    def _verify_resumed(self, state) -> None:
        actual = fingerprint(trainable_state(self.trainer.model))
        if state.global_step <= 0:
            raise checkpoints.CheckpointError("resume: the checkpoint's step is 0; nothing to resume")
        if actual != self.run.resumed_fingerprint:
            raise checkpoints.CheckpointError(
                "resume: the loaded weights do not match the checkpoint's (a fresh adapter instead of the saved one, "
                "transformers#24252); refusing to continue"
            )

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_started = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """A non-finite step (loss, or gradient norm with a finite loss) is not applied: drop its gradients so the
        optimizer leaves weights and moments alone. Also note the lr this step applies (the scheduler moves on after)."""
        optimizer = self.trainer.optimizer
        self.step_lr = optimizer.param_groups[0]["lr"] if optimizer is not None else None
        grad_norm = self.trainer.last_grad_norm
        self.step_nonfinite_grad = grad_norm is not None and not math.isfinite(grad_norm)
        if self.run.world.is_distributed:  # the gradients are averaged over the ranks: the same verdict on each
            self.step_nonfinite = (
                self.step_nonfinite_grad if grad_norm is not None else _grads_nonfinite(self.trainer.model)
            )
        else:
            self.step_nonfinite = self.step_nonfinite_grad or not math.isfinite(float(self.trainer.step_loss))
        if self.step_nonfinite:
            for param in self.trainer.model.parameters():
                param.grad = None

    def on_step_end(self, args, state, control, **kwargs):
        """Faults, then one vote of the ranks (loss, tokens, stop, preemption, time cadence), then the record,
        guards, stop and checkpoint cadence, all from the voted values: every rank takes the same branch."""
        elapsed = time.perf_counter() - self.step_started
        loss, tokens = self.trainer.pop_step()
        self._apply_step_faults(state)
        vote = self.vote(
            loss,
            tokens,
            os.path.exists(self.run.stop_flag),
            self.run.sigterm_received,
            self._time_due(),
            state.global_step < state.max_steps and self._slice_used_up(),
        )
        loss, tokens = vote.loss, vote.tokens
        self.run.tokens_seen += tokens
        bad = self.step_nonfinite or not math.isfinite(loss)
        self.step_nonfinite = self.step_nonfinite_grad = False
        self._record_step(state, loss, tokens, elapsed, bad)
        nonfinite = self._guard_nonfinite(state, control, loss, bad)
        if self.run.stop_reason == "rollback":
            return control
        if not nonfinite:
            self._check_spike(state, loss)
            self._check_plateau(state, loss)
        self._schedule_save(state, control, defer=nonfinite, time_due=vote.due)
        self._check_stop(control, vote)
        if self.has_eval and state.global_step >= state.max_steps and not nonfinite:
            control.should_evaluate = True
        return control

    def _record_step(self, state, loss: float, tokens: int, elapsed: float, bad: bool) -> None:
        lr = self.step_lr
        self.run.metrics.write(
            RECORD_STEP,
            step=state.global_step,
            total_steps=state.max_steps,
            epoch=state.epoch,
            loss=loss,
            lr=lr,
            world_size=self.run.world.world_size,
            grad_norm=self.trainer.last_grad_norm,
            tokens_per_s=tokens / elapsed if elapsed > 0 else None,
            time=time.time(),
            peak_mem_mb=round(peak_mem_mb(), 1),
            **({"nonfinite": True} if bad else {}),
            **self.run.step_vitals,
            **self.trainer.step_extras(),
        )
        every = self.run.config.log_every
        if not self.run.world.is_main:
            return  # rank 0 speaks for the world (the loss and tokens it prints are the world's)
        if state.global_step % every == 0 or state.global_step in (1, state.max_steps) or bad:
            print(
                f"step {state.global_step}/{state.max_steps}: loss {loss:.4f}, lr {lr or 0:.1e}, {elapsed * 1000:.0f}ms",
                flush=True,
            )

    def _guard_nonfinite(self, state, control, loss: float, bad: bool) -> bool:
        """Count non-finite steps (loss or gradients); the third in a row asks run.py to roll back.
        True when this step was non-finite."""
        step = state.global_step
        if not bad:
            self.run.nonfinite_streak = 0
            self.run.last_loss = loss
            return False
        self.run.nan_consumed.add(step)
        self.run.nonfinite_streak += 1
        if math.isfinite(loss):
            self.run.metrics.event(
                "nonfinite_grad",
                f"step {step}: non-finite gradients with a finite loss ({loss:.4f}); the step was not applied",
                step=step,
                streak=self.run.nonfinite_streak,
                loss=loss,
            )
        else:
            self.run.metrics.event(
                "nonfinite_loss",
                f"step {step}: non-finite loss; the step was not applied",
                step=step,
                streak=self.run.nonfinite_streak,
            )
        if self.run.nonfinite_streak >= NONFINITE_STREAK:
            self.run.stop_reason = "rollback"
            control.should_training_stop = True
        return True

    def _check_spike(self, state, loss: float) -> None:
        history = self.run.losses
        if len(history) >= SPIKE_MIN_HISTORY:
            mean, sigma = _mean_sigma(history)
            threshold = mean + SPIKE_SIGMAS * sigma
            if loss > threshold:
                self.run.metrics.event(
                    "loss_spike",
                    f"step {state.global_step}: loss {loss:.4f} above mean + 5 sigma ({threshold:.4f})",
                    step=state.global_step,
                    loss=loss,
                    mean=mean,
                    sigma=sigma,
                )
                print(
                    f"step {state.global_step}: loss spike {loss:.4f} (mean {mean:.4f}, sigma {sigma:.4f})", flush=True
                )
        history.append(loss)

    def _check_plateau(self, state, loss: float) -> None:
        if not self.run.plateau.update(loss):
            return
        level = self.run.plateau.level
        message = (
            f"step {state.global_step}: loss {loss:.4f} has sat at ln V = {level:.4f} (a uniform prediction) for "
            f"{PLATEAU_STEPS} steps: the run is not learning; lower lr or set max_grad_norm"
        )
        self.run.metrics.event("plateau", message, step=state.global_step, loss=loss, uniform_loss=level)
        print(f"trainq: warning: {message}", flush=True)

    def _apply_step_faults(self, state) -> None:
        faults = self.run.faults
        if faults.sleep_per_step:
            time.sleep(faults.sleep_per_step)
        if faults.stop_at == state.global_step:
            touch(self.run.stop_flag)
        if faults.sigterm_at == state.global_step:
            os.kill(os.getpid(), signal.SIGTERM)

    def _check_stop(self, control, vote) -> None:
        if vote.preempt:
            self.run.stop_reason = "preempted"
        elif vote.stop:
            self.run.stop_reason = "stopped"
        elif vote.sliced:
            self.run.stop_reason = "sliced"  # save, exit EXIT_CHECKPOINT: the watcher starts the next slice at once
        else:
            return
        control.should_save = True
        control.should_training_stop = True

    def _slice_used_up(self) -> bool:
        """``train.max_minutes_per_attempt`` has passed since this process started."""
        limit = self.run.config.max_minutes_per_attempt
        return limit is not None and time.monotonic() - self.run.started_mono >= limit * 60

    def _time_due(self) -> bool:
        """every_minutes has passed since the last save (on this rank's clock: the vote makes it the world's)."""
        return time.monotonic() - self.last_save >= self.run.config.checkpoint.every_minutes * 60

    def _schedule_save(self, state, control, defer: bool, time_due: bool) -> None:
        """Every every_steps or every_minutes, whichever first; a non-finite step defers it to the next good one."""
        cadence = self.run.config.checkpoint
        due_steps = cadence.every_steps is not None and state.global_step % cadence.every_steps == 0
        if not (due_steps or time_due or self.run.save_pending):
            return
        if defer:
            self.run.save_pending = True
        else:
            control.should_save = True

    def on_save(self, args, state, control, **kwargs):
        self.last_save = time.monotonic()
        self.run.save_pending = False

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """Record the eval; a new best eval loss is checkpointed at once so ckpt_best names a real folder."""
        eval_loss = (metrics or {}).get("eval_loss")
        if eval_loss is None or not self.trainer.is_in_train:
            return
        self.run.last_eval_loss = eval_loss
        extras = {k.removeprefix("eval_"): v for k, v in (metrics or {}).items() if "/" in k}  # dpo: eval rewards
        self.run.metrics.write(
            RECORD_EVAL,
            step=state.global_step,
            total_steps=state.max_steps,
            epoch=state.epoch,
            eval_loss=eval_loss,
            time=time.time(),
            **extras,
        )
        if self.run.world.is_main:
            print(f"step {state.global_step}/{state.max_steps}: eval_loss {eval_loss:.4f}", flush=True)
        if _finite(eval_loss) and (self.run.best_eval_loss is None or eval_loss < self.run.best_eval_loss):
            self.run.best_eval_loss, self.run.best_step = eval_loss, state.global_step
            control.should_save = True
