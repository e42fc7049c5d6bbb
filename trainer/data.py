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

#: role names accepted in ``messages`` (``role``) and ShareGPT ``conversations`` (``from``), and the chat role each
#: one means; any other name makes the row a bad row (documented in docs/trainer.md)
ROLE_NAMES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "function_call": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
    "observation": "tool",
}
SHAREGPT_ROLES = ROLE_NAMES
#: each bad-row category in words (the counts of an empty data set name them)
CATEGORY_WORDS = {
    "json": "not JSON",
    "format": "no usable format",
    "role": "unknown role",
    "no_assistant": "no assistant turn",
    "template": "chat template error",
    "unmaskable": "unmaskable",
    "truncated": "cut by more than half at seq_len",
    "no_trained_tokens": "no trained token within seq_len",
}
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
    """One rejected line, why, and the kind of problem (``category``, for the per-reason counts)."""

    file: str
    line: int
    reason: str
    category: str = "format"

    def __str__(self) -> str:
        return f"{self.file}: line {self.line}: {self.reason}"


class RowError(DataError):
    """Raised when one row cannot be used (a bad row: counted against max_bad_rows, never the end of a job alone)."""

    def __init__(self, row: Row, reason: str, category: str):
        super().__init__(f"{row.file}: line {row.line}: {reason}")
        self.bad = BadRow(row.file, row.line, reason, category)


class _Unusable(Exception):
    """A record that cannot be used, with its category (raised by the checks below, caught in read_rows)."""

    def __init__(self, reason: str, category: str = "format"):
        super().__init__(reason)
        self.reason, self.category = reason, category


def _text_of(content: object) -> str | None:
    """A message's text: a string, or OpenAI-style parts [{type: text, text}] joined; None when neither."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return None


def _check_message(i: int, msg: object) -> None:
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise _Unusable(f"messages[{i}] must be an object with a string role and content")
    if msg["role"] not in ROLE_NAMES:
        raise _Unusable(f"messages[{i}]: unknown role {msg['role']!r} (known: {', '.join(sorted(ROLE_NAMES))})", "role")
    if _text_of(msg.get("content")) is not None:
        return
    calls = msg.get("tool_calls")
    if (
        msg.get("content") is None
        and isinstance(calls, list)
        and calls
        and all(isinstance(c, dict) and isinstance(c.get("function", c).get("name"), str) for c in calls)
    ):
        return  # the OpenAI/HF tool-call shape: content null, tool_calls [{type, function: {name, arguments}}]
    raise _Unusable(f"messages[{i}] must be an object with string role and content (or content null with tool_calls)")


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise _Unusable("messages must be a non-empty list of {role, content}")
    for i, msg in enumerate(messages):
        _check_message(i, msg)


def _check_conversations(turns: object) -> None:
    if (
        not isinstance(turns, list)
        or not turns
        or not all(
            isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str) for t in turns
        )
    ):
        raise _Unusable("conversations must be a non-empty list of {from, value} strings")
    unknown = next((t["from"] for t in turns if t["from"] not in ROLE_NAMES), None)
    if unknown is not None:
        raise _Unusable(f"conversations: unknown speaker {unknown!r} (known: {', '.join(sorted(ROLE_NAMES))})", "role")


def _kind_of(record: object) -> str:
    """The row format of a record, or _Unusable saying why it has none."""
    if not isinstance(record, dict):
        raise _Unusable("expected a JSON object")
    if "text" in record:
        if isinstance(record["text"], str) and record["text"].strip():
            return "text"
        raise _Unusable("text must be a non-empty string")
    if "prompt" in record and "chosen" in record and "rejected" in record:
        if (
            all(isinstance(record[k], str) for k in ("prompt", "chosen", "rejected"))
            and record["chosen"]
            and record["rejected"]
        ):
            return "preference"
        raise _Unusable("prompt, chosen and rejected must be strings (chosen and rejected non-empty)")
    if "prompt" in record or "completion" in record:
        if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str) and record["completion"]:
            return "prompt"
        raise _Unusable("prompt and completion must both be strings (completion non-empty)")
    if "messages" in record:
        _check_messages(record["messages"])
        return "messages"
    if "instruction" in record or "output" in record:
        if (
            all(isinstance(record.get(k), str) for k in ("instruction", "output"))
            and record["output"]
            and isinstance(record.get("input", ""), str)
        ):
            return "alpaca"
        raise _Unusable("alpaca rows need string instruction and non-empty output (input optional)")
    if "conversations" in record:
        _check_conversations(record["conversations"])
        return "sharegpt"
    raise _Unusable(
        "no text, prompt+completion, messages, instruction+output, conversations or prompt+chosen+rejected field"
    )


def classify(record: object) -> tuple[str | None, str | None]:
    """Return (kind, None) for a usable record, else (None, reason)."""
    try:
        return _kind_of(record), None
    except _Unusable as exc:
        return None, exc.reason


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
                bad.append(BadRow(path, number, f"not valid JSON ({exc.__class__.__name__})", "json"))
                continue
            try:
                kind = _kind_of(record)
            except _Unusable as exc:
                bad.append(BadRow(path, number, exc.reason, exc.category))
                continue
            digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode("utf-8")).hexdigest()
            rows.append(Row(path, number, kind, record, digest))
    return rows, bad


def count_reasons(bad: list[BadRow]) -> dict[str, int]:
    """How many bad rows of each category, in words, most frequent first."""
    counts: dict[str, int] = {}
    for row in bad:
        words = CATEGORY_WORDS.get(row.category, row.category)
        counts[words] = counts.get(words, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def counts_text(bad: list[BadRow]) -> str:
    """``3 unknown role, 1 not JSON``."""
    return ", ".join(f"{n} {words}" for words, n in count_reasons(bad).items())


def require_rows(path: str, rows: list[Row], bad: list[BadRow]) -> None:
    """Raise DataError naming the file (and the first bad line) when nothing is usable."""
    if rows:
        return
    if bad:
        raise DataError(
            f"{bad[0]}; no usable row in {path} ({len(bad)} bad rows: {counts_text(bad)}; rows need text, "
            "prompt+completion, messages, instruction+output, conversations or prompt+chosen+rejected)"
        )
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


def _tool_calls(calls: list) -> list[dict]:
    """Tool calls in the HF shape ``{type, function: {name, arguments}}``, JSON-string arguments parsed (as HF
    templates expect a mapping)."""
    out = []
    for call in calls:
        function = dict(call.get("function", call))
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass  # a template gets the string as it was written
        out.append({"type": "function", "function": {k: v for k, v in function.items() if k != "type"}})
    return out


def _message(msg: dict) -> dict:
    """One message with its role mapped (ROLE_NAMES), its text as a string and tool calls in the HF shape."""
    out = {k: v for k, v in msg.items() if k not in ("role", "content", "tool_calls")}
    out["role"] = ROLE_NAMES[msg["role"]]
    out["content"] = _text_of(msg.get("content")) or ""
    if msg.get("tool_calls"):
        out["tool_calls"] = _tool_calls(msg["tool_calls"])
    return out


def as_messages(row: Row) -> list[dict]:
    """The conversation of a messages, alpaca or ShareGPT row as ``[{role, content}, ...]`` (roles mapped)."""
    rec = row.record
    if row.kind == "alpaca":
        user = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
        return [{"role": "user", "content": user}, {"role": "assistant", "content": rec["output"]}]
    if row.kind == "sharegpt":
        return [{"role": ROLE_NAMES[t["from"]], "content": t["value"]} for t in rec["conversations"]]
    return [_message(m) for m in rec["messages"]]


def _encode_chat(row: Row, tokenizer, train_on: str) -> tuple[list[int], list[int]]:
    messages = as_messages(row)
    if train_on == "assistant" and not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
        raise RowError(
            row, f"no assistant turn (roles: {roles}); train_on: assistant has nothing to train", "no_assistant"
        )
    try:
        return encode_messages(messages, tokenizer, train_on)
    except UnmaskableTemplate as exc:
        raise RowError(row, f"train.train_on: {exc}", "unmaskable") from None
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RowError(
            row, f"the chat template failed on this row: {type(exc).__name__}: {first}", "template"
        ) from None


def encode(row: Row, tokenizer, seq_len: int, train_on: str = "assistant") -> dict[str, list[int]]:
    """Token ids and labels for one row, truncated to ``seq_len``; prompts (and, for chat rows with
    ``train_on: assistant``, everything but the assistant turns) are masked out of the loss.
    RowError (a bad row) when the row cannot be encoded, would lose more than half its tokens to ``seq_len``, or
    keeps no trained token."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    rec = row.record
    if row.kind == "preference":
        raise RowError(
            row, "a prompt/chosen/rejected row is preference data: it trains only with method: dpo", "format"
        )
    if row.kind == "prompt":
        prompt = bos + tokenizer(rec["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(rec["completion"], add_special_tokens=False)["input_ids"] + eos
        ids, labels = prompt + completion, [IGNORE_INDEX] * len(prompt) + completion
    elif row.kind == "text":
        ids = bos + tokenizer(rec["text"], add_special_tokens=False)["input_ids"] + eos
        labels = list(ids)
    else:
        ids, labels = _encode_chat(row, tokenizer, train_on)
    if len(ids) > 2 * seq_len:
        raise RowError(
            row,
            f"{len(ids)} tokens: more than half would be cut at seq_len {seq_len}; raise seq_len or split the row",
            "truncated",
        )
    example = {"input_ids": ids[:seq_len], "labels": labels[:seq_len]}
    if all(label == IGNORE_INDEX for label in example["labels"][1:]):
        raise RowError(row, f"no trained token within seq_len {seq_len} (the prompt fills it)", "no_trained_tokens")
    return example


class TokenizedDataset:
    """A map-style dataset of pre-tokenized examples (the Trainer's sampler seeks by index), and the rows that
    could not be encoded (``bad``)."""

    def __init__(self, examples: list[dict[str, list[int]]], bad: list[BadRow] | None = None):
        self.examples = examples
        self.bad = bad or []

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.examples[index]


def tokenize(rows: list[Row], tokenizer, seq_len: int, train_on: str = "assistant") -> TokenizedDataset:
    """Encode every row; a row that cannot be encoded is a bad row (``.bad``, once per line), never an error."""
    examples, bad, seen = [], [], set()
    for row in rows:
        try:
            examples.append(encode(row, tokenizer, seq_len, train_on))
        except RowError as exc:
            if (row.file, row.line) not in seen:  # a weighted file repeats its rows
                seen.add((row.file, row.line))
                bad.append(exc.bad)
    return TokenizedDataset(examples, bad)


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
