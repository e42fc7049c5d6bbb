"""The learning-rate schedule a command job declares (``expected_lr``), as a function of the step (issue 30).

``{schedule: cosine|linear|constant, peak: 2e-4, warmup_steps: 100, total_steps: 10000, tolerance: 0.01}``:
linear warm-up from 0 to ``peak`` over ``warmup_steps``, then constant, linear decay to 0, or a cosine half
wave to 0 at ``total_steps`` (the Hugging Face schedules of those names). Scripts log the lr they applied
at a step either before or after their scheduler stepped, so a logged lr matches when it equals the
schedule at ``step`` or at ``step - 1``, within ``tolerance`` (relative; default 1 %).
"""

from __future__ import annotations

import math

#: relative difference allowed between a logged lr and the schedule's value
DEFAULT_TOLERANCE = 0.01


def scheduled_lr(plan: dict, step: int) -> float:
    """The schedule's lr after ``step`` scheduler steps."""
    peak, warmup, total = float(plan["peak"]), int(plan.get("warmup_steps") or 0), int(plan["total_steps"])
    if step < warmup:
        return peak * step / max(1, warmup)
    kind = plan.get("schedule", "cosine")
    if kind == "constant":
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return peak * (1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_deviation(plan: dict, step: int, lr: float) -> str | None:
    """Why ``lr`` logged at ``step`` is off the declared schedule (in words), or None when it is on it."""
    tolerance = float(plan.get("tolerance", DEFAULT_TOLERANCE))
    candidates = [scheduled_lr(plan, s) for s in (step, step - 1) if s >= 0]
    if any(math.isclose(lr, want, rel_tol=tolerance, abs_tol=1e-12) for want in candidates):
        return None
    return (
        f"step {step}: lr {lr:.6g} logged, the declared schedule says {candidates[0]:.6g} "
        f"({plan.get('schedule', 'cosine')}, peak {float(plan['peak']):.3g}, {int(plan.get('warmup_steps') or 0)} "
        f"warm-up steps of {int(plan['total_steps'])})"
    )
