"""``trainq preview JOB_FILE [-n N]`` (``python -m trainq.trainer.preview``): the first N training rows as the trainer
will see them, every token with its label state, the way ``axolotl preprocess --debug`` shows them.

Each token prints as ``text(label)``: the label is the token id when the token is trained on, ``-100`` when it is
masked (a prompt, a user turn, a system prompt). On a terminal, trained tokens are green and masked ones grey.
Rows the trainer would skip are listed with their line and reason; the last lines count every file's bad rows
(reading and tokenizing all rows, as the trainer does) and say whether the ``data.max_bad_rows`` gate would pass
or refuse the data. Nothing is trained and nothing is written.
``method: dpo`` rows print the prompt (masked) followed by the chosen and the rejected answer (trained).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trainq.trainer.chat import IGNORE_INDEX

#: ANSI colours on a terminal: trained, masked, reset
_GREEN, _GREY, _RESET = "\033[32m", "\033[90m", "\033[0m"


def load_job_file(path: Path):
    """The TrainConfig of a job file anywhere (relative paths resolve against its cwd:, else its folder)."""
    from trainq.trainer.config import ConfigError, TrainConfig, _check_paths, base_dirs_for, validate_block
    from trainq.watcher.spec.yaml12 import YamlError, load_yaml12

    try:
        job = load_yaml12(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    except YamlError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(job, dict) or "train" not in job:
        raise ConfigError(f"{path}: train: missing; preview shows what the built-in trainer would train on")
    validate_block(job["train"], str(path))
    config = TrainConfig.from_dict(job["train"], base_dirs_for(job, path.parent.resolve()))
    _check_paths(config, str(path))
    return config


def show_token(text: str, label: int, color: bool) -> str:
    """``text(label)``, coloured by label state on a terminal."""
    shown = f"{text!r}"[1:-1] + f"({label})"
    if not color:
        return shown
    return f"{_GREY if label == IGNORE_INDEX else _GREEN}{shown}{_RESET}"


def render_example(ids: list[int], labels: list[int], tokenizer, color: bool) -> str:
    """Every token of one example with its label."""
    return " ".join(show_token(tokenizer.decode([t]), label, color) for t, label in zip(ids, labels, strict=False))


def _sft_lines(row, tokenizer, config, color: bool) -> list[str]:
    from trainq.trainer.data import RowError, encode

    try:
        example = encode(row, tokenizer, config.seq_len, config.train_on)
    except RowError as exc:
        return [f"row {row.file}: line {row.line} ({row.kind}): SKIPPED, a bad row: {exc.bad.reason}"]
    trained = sum(label != IGNORE_INDEX for label in example["labels"])
    return [
        f"row {row.file}: line {row.line} ({row.kind}): {len(example['input_ids'])} tokens, {trained} trained",
        render_example(example["input_ids"], example["labels"], tokenizer, color),
    ]


def _dpo_lines(row, tokenizer, config, color: bool) -> list[str]:
    if row.kind != "preference":
        return [
            f"row {row.file}: line {row.line} ({row.kind}): SKIPPED, a bad row: method: dpo needs "
            "{prompt, chosen, rejected} rows"
        ]
    prompt = tokenizer(row.record["prompt"], add_special_tokens=False)["input_ids"]
    lines = [f"row {row.file}: line {row.line} (preference): prompt {len(prompt)} tokens (masked)"]
    for side in ("chosen", "rejected"):
        answer = tokenizer(row.record[side] + (tokenizer.eos_token or ""), add_special_tokens=False)["input_ids"]
        ids = (prompt + answer)[: config.seq_len]
        labels = ([IGNORE_INDEX] * len(prompt) + answer)[: config.seq_len]
        lines.append(f"  {side}: " + render_example(ids, labels, tokenizer, color))
    return lines


def preview(path: Path, count: int, color: bool) -> str:
    """The preview text of the first ``count`` training rows of the job file at ``path``."""
    from trainq.trainer.modeling import load_tokenizer
    from trainq.trainer.sources import load_data

    config = load_job_file(path)
    data = load_data(config.train_sources, config.eval_file, config.eval_fraction, sys.maxsize)  # gated below
    tokenizer = load_tokenizer(config.model, config.chat_template)
    lines = [
        f"{path}: {config.method}, seq_len {config.seq_len}, train_on {config.train_on}, "
        f"{len(data.train)} train rows; token(label): label -100 is masked, else trained"
    ]
    lines += [f"bad row (skipped): {bad}" for bad in data.bad[:count]]
    render = _dpo_lines if config.method == "dpo" else _sft_lines
    for row in data.train[:count]:
        lines += render(row, tokenizer, config, color)
    return "\n".join([*lines, *gate_lines(data, tokenizer, config)])


def gate_lines(data, tokenizer, config) -> list[str]:
    """Each file's bad rows (reading and, for SFT, tokenizing every row, as the trainer does) and the verdict of
    the ``data.max_bad_rows`` gate: whether the trainer would skip them and train, or refuse the data (exit 65)."""
    from trainq.trainer.data import DataError, counts_text, tokenize
    from trainq.trainer.sources import bad_row_limit, check_encoded

    encoded = []
    if config.method != "dpo":  # dpo rows are checked while reading (TRL pads the pairs)
        train_set = tokenize(data.train, tokenizer, config.seq_len, config.train_on)
        eval_set = tokenize(data.eval, tokenizer, config.seq_len, config.train_on) if data.eval else None
        encoded = train_set.bad + (eval_set.bad if eval_set is not None else [])
    lines = []
    for info in data.files:
        bad = [b for b in data.bad + encoded if b.file == info.path]
        total = info.rows + info.bad_rows
        limit = bad_row_limit(config.max_bad_rows, total)
        verdict = "within the limit: the trainer skips them" if len(bad) <= limit else "over the limit: REFUSED"
        lines.append(
            f"bad rows: {info.path}: {len(bad)} of {total}"
            + (f" ({counts_text(bad)})" if bad else "")
            + f"; data.max_bad_rows {config.max_bad_rows:g} allows {limit}: {verdict}"
        )
    try:
        if config.method != "dpo":
            check_encoded(data, train_set, eval_set, config.max_bad_rows)
        else:
            _check_read_gate(data, config.max_bad_rows)
    except DataError as exc:
        return [*lines, f"gate: the trainer would refuse this data (exit {exc.exit_code}): {exc}"]
    return [*lines, "gate: passes; the trainer would train on these rows"]


def _check_read_gate(data, max_bad_rows: float) -> None:
    """The reading stage's gate alone (method: dpo), file by file, as the trainer applies it."""
    from trainq.trainer.sources import check_bad_rows

    for info in data.files:
        bad = [b for b in data.bad if b.file == info.path]
        check_bad_rows(info.path, [None] * info.rows, bad, max_bad_rows)  # type: ignore[list-item]  # only counted


def main(argv: list[str] | None = None) -> int:
    """Print the preview; a bad job file or data is one line naming the file and field (exit code as training)."""
    parser = argparse.ArgumentParser(
        prog="trainq preview", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("job_file", type=Path, help="a job file with a train: block (anywhere: inbox/, pending/, ...)")
    parser.add_argument("-n", type=int, default=3, metavar="N", help="rows to show (default 3)")
    args = parser.parse_args(argv)
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}.items():
        os.environ.setdefault(key, value)
    try:
        print(preview(args.job_file, max(args.n, 0), color=sys.stdout.isatty()))
    except Exception as exc:
        code = getattr(exc, "exit_code", None)
        if code is None:
            raise
        print(f"trainq: {exc}", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
