"""A dead run, told from a learning one: the loss sits at ln V (V = the tokenizer's vocabulary), the loss of a
uniform prediction over every token, or the loss does not fall.

Used twice: ``debug: true`` fails the smoke run on either (debugrun.py), and the real run writes a ``plateau``
event (once; the watcher shows it as ``progress.warning`` in status.json) when its last PLATEAU_STEPS losses all
sit at ln V.
"""

from __future__ import annotations

import math
import statistics

#: a loss within this share of ln V counts as "at the uniform-prediction level"
UNIFORM_TOLERANCE = 0.01
#: ...and flat: the losses of the smoke run's second half spread by less than this share of ln V
FLATNESS = 0.001
#: steps in a row at ln V before the real run flags a plateau
PLATEAU_STEPS = 20
#: the smoke run must lower its loss by at least this share of its starting loss (first quarter vs last quarter)
LEARN_MARGIN = 0.01


def uniform_loss(vocab_size: int) -> float:
    """ln V: the cross-entropy of predicting every token with probability 1/V."""
    return math.log(max(vocab_size, 2))


def at_uniform(losses: list[float], level: float) -> bool:
    """Every loss within UNIFORM_TOLERANCE of ln V (and there is at least one)."""
    return bool(losses) and all(abs(x - level) <= UNIFORM_TOLERANCE * level for x in losses)


def learning_verdict(losses: list[float], level: float | None) -> str | None:
    """None when the smoke run's losses show learning; else why not, in words (stating the margin).

    Not learning: the mean of the last quarter of steps is not LEARN_MARGIN below the first quarter's. Named a dead
    run when it ends at ln V, or when its second half sits flat at ln V whatever came before (a run passing through
    ln V on its way down is neither)."""
    if len(losses) < 4:
        return None
    quarter = max(len(losses) // 4, 1)
    first, last = statistics.fmean(losses[:quarter]), statistics.fmean(losses[-quarter:])
    fell = last <= first * (1 - LEARN_MARGIN)
    half = losses[len(losses) // 2 :]
    flat_at_level = level is not None and at_uniform(half, level) and max(half) - min(half) <= FLATNESS * level
    if level is not None and ((not fell and at_uniform(losses[-1:], level)) or flat_at_level):
        return (
            f"the loss sits at {losses[-1]:.4f}, ln V = {level:.4f} for the {round(math.exp(level))}-token "
            "vocabulary: a uniform prediction (a dead run: lr too high, no clipping?)"
        )
    if not fell:
        return (
            f"the loss did not fall: {first:.4f} over the first {quarter} steps, {last:.4f} over the last "
            f"{quarter} (needs at least {LEARN_MARGIN:.0%} lower)"
        )
    return None


class PlateauWatch:
    """Counts steps in a row at ln V; ``update`` returns True once, when the streak reaches PLATEAU_STEPS."""

    def __init__(self, level: float | None):
        self.level = level
        self.streak = 0
        self.flagged = False

    def update(self, loss: float) -> bool:
        if self.level is None or self.flagged:
            return False
        self.streak = self.streak + 1 if at_uniform([loss], self.level) else 0
        if self.streak >= PLATEAU_STEPS:
            self.flagged = True
        return self.flagged
