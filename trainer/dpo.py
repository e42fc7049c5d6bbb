"""``method: dpo``: preference training of a LoRA adapter through TRL's ``DPOTrainer`` (the well-kept
implementation: trainq writes none of the loss), with every trainq promise kept by the same subclass and callback
as SFT: per-step records (plus ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies``), stop.flag and SIGTERM, tmp-then-rename checkpoints, exact resume, data drift refusal.

Rows are ``{"prompt", "chosen", "rejected"}`` strings. The reference model is the starting adapter (``init_from``,
else the fresh one, which computes exactly the base model), held frozen by TRL as a second adapter named ``ref``.
A row whose prompt plus longer answer exceeds twice ``seq_len`` is a bad row, as in SFT.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets.utils.logging import disable_progress_bar
from trl import DPOConfig, DPOTrainer

from trainq.trainer.callbacks import TrainqTrainer
from trainq.trainer.config import TrainConfig
from trainq.trainer.data import BadRow, Row
from trainq.trainer.sources import LoadedData

#: TRL's per-step metrics copied into each step record (averaged over the step's micro-batches)
STEP_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


@dataclass
class PreferenceRows:
    """Preference rows of one split, and the rows that could not be used (``bad``, as TokenizedDataset has)."""

    rows: list[dict] = field(default_factory=list)
    bad: list[BadRow] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def to_dataset(self):
        """A ``datasets.Dataset`` (TRL tokenizes it)."""
        from datasets import Dataset

        disable_progress_bar()  # TRL maps the rows; its bars would fill output.log
        return Dataset.from_list(self.rows)


def preference_rows(rows: list[Row], tokenizer, seq_len: int) -> PreferenceRows:
    """Keep prompt/chosen/rejected rows that fit; others are bad rows (once per line)."""
    out, seen = PreferenceRows(), set()
    for row in rows:
        reason, category = _problem(row, tokenizer, seq_len)
        if reason is None:
            rec = row.record
            out.rows.append({"prompt": rec["prompt"], "chosen": rec["chosen"], "rejected": rec["rejected"]})
        elif (row.file, row.line) not in seen:
            seen.add((row.file, row.line))
            out.bad.append(BadRow(row.file, row.line, reason, category))
    return out


def _problem(row: Row, tokenizer, seq_len: int) -> tuple[str | None, str]:
    if row.kind != "preference":
        return "method: dpo needs {prompt, chosen, rejected} rows", "format"
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    longest = count(row.record["prompt"]) + max(count(row.record["chosen"]), count(row.record["rejected"])) + 1
    if longest > 2 * seq_len:
        return (
            f"{longest} tokens: more than half would be cut at seq_len {seq_len}; raise seq_len or shorten",
            "truncated",
        )
    return None, ""


def datasets_for(data: LoadedData, tokenizer, seq_len: int) -> tuple[PreferenceRows, PreferenceRows | None]:
    """(train, eval or None) preference rows of the loaded data."""
    evals = preference_rows(data.eval, tokenizer, seq_len) if data.eval else None
    return preference_rows(data.train, tokenizer, seq_len), evals


def dpo_arguments(config: TrainConfig) -> dict:
    """What run.training_args adds for DPO: TRL's DPOConfig with beta and max_length (= seq_len)."""
    return {
        "args_class": DPOConfig,
        "beta": config.dpo_beta,
        "max_length": config.seq_len,
        "precompute_ref_log_probs": False,
    }


class TrainqDPOTrainer(TrainqTrainer, DPOTrainer):
    """TRL's DPOTrainer under trainq's step records, faults and checkpoints (TrainqTrainer comes first in the MRO)."""

    def step_extras(self) -> dict:
        """TRL's metrics of the step that just ended, averaged; clears them (logging_strategy is "no")."""
        collected = self._metrics["train"]
        extras = {k: sum(v) / len(v) for k, v in collected.items() if k in STEP_METRICS and v}
        collected.clear()
        return extras


def build_dpo_trainer(model, args, datasets, tokenizer, callback, run) -> TrainqDPOTrainer:
    """The DPO trainer over ``datasets`` (PreferenceRows; eval may be None)."""
    train, evals = datasets
    return TrainqDPOTrainer(
        model=model,
        args=args,
        train_dataset=train.to_dataset(),
        eval_dataset=evals.to_dataset() if evals is not None else None,
        processing_class=tokenizer,
        callbacks=[callback],
        run=run,
    )
