"""JSONL training data: parse and check rows, split off a held-out share by hash, tokenize, pad.

Row formats: ``{"text"}``; ``{"prompt", "completion"}`` (loss on the completion only); ``{"messages": [{"role",
"content"}, ...]}``, alpaca ``{"instruction", "input"?, "output"}`` and ShareGPT ``{"conversations": [{"from",
"value"}, ...]}`` (chat rows: the tokenizer's chat template when it has one, else ``role: content`` lines; loss on the
assistant turns unless ``train_on: all``, see chat.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

from trainq.trainer.chat import IGNORE_INDEX, UnmaskableTemplate, encode_messages
from trainq.watcher.spec.contract import EXIT_DATA

logger = logging.getLogger(__name__)

#: ShareGPT speaker names -> chat roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool", "function_call": "assistant", "observation": "tool"}
#: bad rows listed by line in the event record (the count is always exact)
MAX_REPORTED_BAD_ROWS = 20


class DataError(Exception):
    """Raised when a data file has no usable row (or cannot be read); one line naming file and line."""

    exit_code = EXIT_DATA


@dataclass(frozen=True)
class Row:
    """One usable record: ``kind`` is text|prompt|messages; ``line`` is 1-based in ``file``."""

    file: str
    line: int
    kind: str
    record: dict
    digest: str


@dataclass(frozen=True)
class BadRow:
    """One rejected line and why."""

    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: line {self.line}: {self.reason}"


def _check_messages(messages: object) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of {role, content}"
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            return f"messages[{i}] must be an object with string role and content"
    return None


def classify(record: object) -> tuple[str | None, str | None]:
    """Return (kind, None) for a usable record, else (None, reason)."""
    if not isinstance(record, dict):
        return None, "expected a JSON object"
    if "text" in record:
        ok = isinstance(record["text"], str) and record["text"].strip()
        return ("text", None) if ok else (None, "text must be a non-empty string")
    if "prompt" in record or "completion" in record:
        ok = isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str) and record["completion"]
        return ("prompt", None) if ok else (None, "prompt and completion must both be strings (completion non-empty)")
    if "messages" in record:
        reason = _check_messages(record["messages"])
        return (None, reason) if reason else ("messages", None)
    if "instruction" in record or "output" in record:
        ok = all(isinstance(record.get(k), str) for k in ("instruction", "output")) and record["output"] \
            and isinstance(record.get("input", ""), str)
        return ("alpaca", None) if ok else (None, "alpaca rows need string instruction and non-empty output (input optional)")
    if "conversations" in record:
        turns = record["conversations"]
        ok = isinstance(turns, list) and turns and all(
            isinstance(t, dict) and t.get("from") in SHAREGPT_ROLES and isinstance(t.get("value"), str) for t in turns)
        return ("sharegpt", None) if ok else (None, f"conversations must be a non-empty list of {{from, value}} with from in {sorted(SHAREGPT_ROLES)}")
    return None, "no text, prompt+completion, messages, instruction+output or conversations field"


def read_rows(path: str) -> tuple[list[Row], list[BadRow]]:
    """Parse a JSONL file into usable rows and bad rows (with line numbers)."""
    rows: list[Row] = []
    bad: list[BadRow] = []
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror}") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                bad.append(BadRow(path, number, f"not valid JSON ({exc.__class__.__name__})"))
                continue
            kind, reason = classify(record)
            if kind is None:
                bad.append(BadRow(path, number, reason or "unusable"))
                continue
            digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode("utf-8")).hexdigest()
            rows.append(Row(path, number, kind, record, digest))
    return rows, bad


def require_rows(path: str, rows: list[Row], bad: list[BadRow]) -> None:
    """Raise DataError naming the file (and the first bad line) when nothing is usable."""
    if rows:
        return
    if bad:
        raise DataError(f"{bad[0]}; no usable row in {path} ({len(bad)} bad rows; rows need text, prompt+completion or messages)")
    raise DataError(f"{path}: line 1: no usable row (the file is empty)")


def is_held_out(row: Row, fraction: float) -> bool:
    """Deterministic split by the record's hash: identical records always land on the same side."""
    return int(row.digest[:8], 16) / 0x1_0000_0000 < fraction


def split(rows: list[Row], fraction: float) -> tuple[list[Row], list[Row]]:
    """(train, eval) by hash; eval never holds a training record."""
    if fraction <= 0:
        return rows, []
    train = [r for r in rows if not is_held_out(r, fraction)]
    held = [r for r in rows if is_held_out(r, fraction)]
    return (train, held) if train else (rows, [])


def as_messages(row: Row) -> list[dict]:
    """The conversation of a messages, alpaca or ShareGPT row as ``[{role, content}, ...]``."""
    rec = row.record
    if row.kind == "alpaca":
        user = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
        return [{"role": "user", "content": user}, {"role": "assistant", "content": rec["output"]}]
    if row.kind == "sharegpt":
        return [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in rec["conversations"]]
    return rec["messages"]


def encode(row: Row, tokenizer, seq_len: int, train_on: str = "assistant") -> dict[str, list[int]]:
    """Token ids and labels for one row, truncated to ``seq_len``; prompts (and, for chat rows with
    ``train_on: assistant``, everything but the assistant turns) are masked out of the loss."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    rec = row.record
    if row.kind == "prompt":
        prompt = bos + tokenizer(rec["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(rec["completion"], add_special_tokens=False)["input_ids"] + eos
        ids, labels = prompt + completion, [IGNORE_INDEX] * len(prompt) + completion
    elif row.kind == "text":
        ids = bos + tokenizer(rec["text"], add_special_tokens=False)["input_ids"] + eos
        labels = list(ids)
    else:
        try:
            ids, labels = encode_messages(as_messages(row), tokenizer, train_on)
        except UnmaskableTemplate as exc:
            raise DataError(f"{row.file}: line {row.line}: train.train_on: {exc}") from None
    return {"input_ids": ids[:seq_len], "labels": labels[:seq_len]}


class TokenizedDataset:
    """A map-style dataset of pre-tokenized examples (the Trainer's sampler seeks by index)."""

    def __init__(self, examples: list[dict[str, list[int]]]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.examples[index]


def tokenize(rows: list[Row], tokenizer, seq_len: int, train_on: str = "assistant") -> TokenizedDataset:
    """Encode every row; rows whose labels are all masked (prompt filled seq_len) are dropped with a warning."""
    examples = []
    for row in rows:
        example = encode(row, tokenizer, seq_len, train_on)
        if all(label == IGNORE_INDEX for label in example["labels"][1:]):
            logger.warning("%s: line %d: prompt fills seq_len %d; row skipped", row.file, row.line, seq_len)
            continue
        examples.append(example)
    return TokenizedDataset(examples)


@dataclass(frozen=True)
class PadCollator:
    """Pads a batch to its longest example: pad id for inputs, IGNORE_INDEX for labels, 0 in the attention mask."""

    pad_id: int

    def __call__(self, features: list[dict[str, list[int]]]) -> dict:
        import torch

        width = max(len(f["input_ids"]) for f in features)
        ids, labels, mask = [], [], []
        for f in features:
            pad = width - len(f["input_ids"])
            ids.append(f["input_ids"] + [self.pad_id] * pad)
            labels.append(f["labels"] + [IGNORE_INDEX] * pad)
            mask.append([1] * len(f["input_ids"]) + [0] * pad)
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "attention_mask": torch.tensor(mask)}
