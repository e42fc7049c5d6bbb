"""A run's vital signs (issue 30, made cheap in issue 37): clipped or not, the update's size against the weights,
and the learning rate checked against the schedule the trainer configured.

- ``clip``: the gradient norm before clipping exceeded ``max_grad_norm`` (every step: the Trainer computes the
  norm anyway, so the flag is free).
- ``update_ratio``: ‖Δθ‖ / ‖θ‖ over the trained parameters for one optimizer step, measured on step 1 and every
  ``health.update_ratio_every`` steps (default 10; 0: never), and on a step the schedule check stops. Measuring
  copies the trained parameters before the step into buffers allocated once and takes the difference in place after
  it (no allocation per measurement). A record between carries no ``update_ratio``; one that carries it holds that
  step's exact value, not an average. With more than ``RATIO_MAX_VALUES`` trained values (a full fine-tune of a
  model past ~8 M parameters) a fixed random sample of whole tensors is measured, and the record says so:
  ``update_ratio_sample`` is the share of the trained values it covers.
- thresholds (``train.health: {clip_fraction: 0.5, update_ratio: 0.1}``): crossing one writes an ``event``
  record (``event: health``) once per crossing; they never stop a run. The clip fraction alerts when most
  steps (more than half of the last 50) are clipped: a healthy run clips now and then, early on especially.
- the schedule: the lr the optimizer applies at step s must equal ``learning_rate × λ(s)`` of a reference
  schedule built from the same scheduler name and warm-up (stateless in s, so a resume or a rollback's
  lr halving raises nothing); a deviation beyond ``LR_RTOL`` ends the run with diagnosis ``schedule``.
"""

from __future__ import annotations

import math
import random
from collections import deque

import torch
from transformers import TrainerCallback, get_scheduler

from trainq.watcher.spec.contract import HEALTH_DEFAULTS

#: the thresholds: clipped on most (more than half) of the recent steps, updates above a tenth of the weights
DEFAULT_CLIP_FRACTION = HEALTH_DEFAULTS["clip_fraction"]
DEFAULT_UPDATE_RATIO = HEALTH_DEFAULTS["update_ratio"]
#: optimizer steps between two update-ratio measurements (train.health.update_ratio_every)
DEFAULT_RATIO_EVERY = 10
#: steps the clip fraction is taken over, and the fewest before it is judged
CLIP_WINDOW = 50
CLIP_MIN_STEPS = 10
#: most trained values the update ratio copies per measurement (beyond: a fixed sample of whole tensors, and the
#: record's update_ratio_sample says which share of the trained values it covers); 8 M float32 values are 32 MiB
RATIO_MAX_VALUES = 8 * 1024 * 1024
#: seed of that sample (the same tensors in every attempt and on every rank)
RATIO_SAMPLE_SEED = 37
#: relative tolerance between the applied and the scheduled lr (float32 lambdas differ by ~1e-7)
LR_RTOL = 1e-4
LR_ATOL = 1e-12
#: the outcome (and diagnosis kind) of a run stopped for a schedule deviation
OUTCOME_SCHEDULE = "schedule"
SCHEDULE_ADVICE = (
    "The learning rate applied differs from the configured schedule: check custom code that sets "
    "param_groups' lr, a scheduler changed on resume, or the warm-up settings."
)


class UpdateRatio:
    """‖θ_after − θ_before‖ / ‖θ_after‖ over the trained parameters, or over a fixed sample of whole tensors when they
    hold more than ``max_values`` values (``share``: the share of the trained values it covers, 1.0 for all)."""

    def __init__(self, params: list[torch.nn.Parameter], max_values: int = RATIO_MAX_VALUES):
        self.params = sample_tensors(params, max_values)
        total = sum(p.numel() for p in params)
        self.share = sum(p.numel() for p in self.params) / total if total else 1.0
        self.before = [torch.empty_like(p, memory_format=torch.preserve_format) for p in self.params]

    def snapshot(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self.before, self.params)

    def ratio(self) -> float | None:
        with torch.no_grad():
            torch._foreach_sub_(self.before, self.params)  # before − after, in place: no buffer allocated per call
            delta, weight = _norm(self.before), _norm(self.params)
        value = delta / weight if weight > 0 else None
        return value if value is not None and math.isfinite(value) else None


def _norm(tensors: list[torch.Tensor]) -> float:
    """The 2-norm of all ``tensors`` together, accumulated in float32 whatever their dtype."""
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def sample_tensors(params: list[torch.nn.Parameter], max_values: int) -> list[torch.nn.Parameter]:
    """All of ``params`` when they hold at most ``max_values`` values; else a fixed random sample of whole tensors
    (seeded: the same tensors at every measurement, every attempt, every rank), in the model's order, filled up to
    ``max_values`` (the smallest tensor alone when none fits)."""
    if sum(p.numel() for p in params) <= max_values:
        return list(params)
    order = list(range(len(params)))
    random.Random(RATIO_SAMPLE_SEED).shuffle(order)
    chosen, total = [], 0
    for i in order:
        if total + params[i].numel() <= max_values:
            chosen.append(i)
            total += params[i].numel()
    if not chosen and params:
        chosen = [min(range(len(params)), key=lambda i: params[i].numel())]
    return [params[i] for i in sorted(chosen)]


class ReferenceSchedule:
    """λ(step) of the schedule the run configured, rebuilt on a dummy parameter: stateless in the step."""

    def __init__(self, name: str, warmup_steps: int, total_steps: int, kwargs: dict | None = None):
        dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = get_scheduler(
            name,
            optimizer=dummy,
            num_warmup_steps=warmup_steps,
            num_training_steps=total_steps,
            scheduler_specific_kwargs=kwargs or {},
        )
        lambdas = getattr(scheduler, "lr_lambdas", None)
        self.factor = lambdas[0] if lambdas else None
        self.name, self.warmup_steps, self.total_steps = name, warmup_steps, total_steps

    def expected(self, base_lr: float, step: int) -> float | None:
        return None if self.factor is None else base_lr * float(self.factor(step))


class VitalsCallback(TrainerCallback):
    """Measures each step's vitals into ``run.step_vitals`` (the step record carries them) and checks the lr.

    Registered before TrainqCallback, so the schedule check (and the test switch that breaks it) sees the lr
    before the step record is written."""

    def __init__(self, run, lr_bug_at: int | None = None, ratio_max_values: int = RATIO_MAX_VALUES):
        self.run = run
        self.lr_bug_at = lr_bug_at
        self.ratio_max_values = ratio_max_values
        self.ratio: UpdateRatio | None = None
        self.reference: ReferenceSchedule | None = None
        self.clips: deque = deque(maxlen=CLIP_WINDOW)
        self.clipped = 0  # how many of self.clips are True (kept as they come and go: no sum per step)
        self.alerting: set[str] = set()
        health = dict(getattr(run.config, "health", None) or {})
        self.clip_threshold = float(health.get("clip_fraction", DEFAULT_CLIP_FRACTION))
        self.ratio_threshold = float(health.get("update_ratio", DEFAULT_UPDATE_RATIO))
        self.ratio_every = int(health.get("update_ratio_every", DEFAULT_RATIO_EVERY))
        self.measuring = False  # this optimizer step's update ratio is being measured

    def measures(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) gets an update ratio: the first, then every ratio_every."""
        return self.ratio_every > 0 and (step == 1 or step % self.ratio_every == 0)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.ratio_every > 0:
            self.ratio = UpdateRatio([p for p in model.parameters() if p.requires_grad], self.ratio_max_values)
        self.reference = ReferenceSchedule(
            str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            args.get_warmup_steps(state.max_steps),
            state.max_steps,
            args.lr_scheduler_kwargs,
        )
        if self.reference.factor is None:
            self.run.metrics.event(
                "schedule_check",
                f"schedule check off: {self.reference.name} is not a function of the step",
                scheduler=self.reference.name,
            )

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        if optimizer is None:
            return control
        if self.lr_bug_at == state.global_step + 1:  # the test switch: a schedule bug at this step
            for group in optimizer.param_groups:
                group["lr"] *= 10.0
        stopped = self._check_lr(args, state, control, optimizer, model)
        self.measuring = self.ratio is not None and (stopped or self.measures(state.global_step + 1))
        if self.measuring and self.ratio is not None:
            self.ratio.snapshot()
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):
        grad_norm = getattr(self.run.trainer, "last_grad_norm", None)
        clipped = bool(
            args.max_grad_norm and grad_norm is not None and math.isfinite(grad_norm) and grad_norm > args.max_grad_norm
        )
        self.note_clip(clipped)
        self.run.step_vitals = {"clip": clipped}
        ratio = None
        if self.measuring and self.ratio is not None:
            ratio = self.run.step_vitals["update_ratio"] = self.ratio.ratio()
            if self.ratio.share < 1.0:
                self.run.step_vitals["update_ratio_sample"] = round(self.ratio.share, 4)
        self._judge(state.global_step + 1, ratio)
        return control

    def note_clip(self, clipped: bool) -> None:
        """One more step in the clip window (the oldest leaves it once the window is full)."""
        if len(self.clips) == CLIP_WINDOW:
            self.clipped -= self.clips[0]
        self.clips.append(clipped)
        self.clipped += clipped

    def _check_lr(self, args, state, control, optimizer, model) -> bool:
        """Stop the run (this step not applied) when the lr left the schedule; True when it did."""
        if self.reference is None or self.run.stop_reason is not None:
            return False
        step = state.global_step  # the scheduler has stepped this many times before this optimizer step
        expected = self.reference.expected(args.learning_rate, step)
        applied = float(optimizer.param_groups[0]["lr"])
        if expected is None or math.isclose(applied, expected, rel_tol=LR_RTOL, abs_tol=LR_ATOL):
            return False
        words = (
            f"step {step + 1}: lr {applied:.6g} applied, the schedule says {expected:.6g} "
            f"({self.reference.name}, {self.reference.warmup_steps} warm-up steps of {self.reference.total_steps}, "
            f"peak {args.learning_rate:.3g})"
        )
        print(f"trainq: schedule deviation: {words}", flush=True)
        self.run.metrics.event(
            OUTCOME_SCHEDULE,
            words,
            kind=OUTCOME_SCHEDULE,
            evidence=words,
            advice=SCHEDULE_ADVICE,
            step=step + 1,
            expected_lr=expected,
            applied_lr=applied,
        )
        self.run.stop_reason = OUTCOME_SCHEDULE
        control.should_training_stop = True
        for param in model.parameters():  # this step is not applied
            param.grad = None
        return True

    def _judge(self, step: int, ratio: float | None) -> None:
        """Threshold crossings become one event each (and clear when back under); words only for an event."""
        fraction = self.clipped / len(self.clips) if len(self.clips) >= CLIP_MIN_STEPS else None
        if self._crossed("clip_fraction", fraction, self.clip_threshold):
            self._alert(
                "clip_fraction", fraction, self.clip_threshold, step, self.clip_words(fraction, len(self.clips))
            )
        if self._crossed("update_ratio", ratio, self.ratio_threshold):
            self._alert(
                "update_ratio",
                ratio,
                self.ratio_threshold,
                step,
                f"update ratio {ratio or 0:.3g} (threshold {self.ratio_threshold:g}): each step moves the weights "
                "by a large fraction of their size; lower lr",
            )

    def clip_words(self, fraction: float | None, steps: int) -> str:
        """The clip alert in words: how many of the recent steps were clipped, and "most" only when it is so."""
        share = fraction or 0.0
        how = "most steps are clipped" if share > 0.5 else "more steps are clipped than the threshold allows"
        return (
            f"gradients clipped on {share:.0%} of the last {steps} steps (threshold {self.clip_threshold:.0%}): "
            f"{how}; lower lr or raise max_grad_norm"
        )

    def _crossed(self, name: str, value: float | None, threshold: float) -> bool:
        """True when ``value`` has just gone above ``threshold``; going back under clears the alert."""
        if value is None:
            return False
        if value > threshold:
            return name not in self.alerting
        self.alerting.discard(name)
        return False

    def _alert(self, name: str, value: float | None, threshold: float, step: int, message: str) -> None:
        self.alerting.add(name)
        self.run.metrics.event(
            "health", f"step {step}: {message}", signal=name, value=value, threshold=threshold, step=step
        )
        print(f"trainq: health: step {step}: {message}", flush=True)
