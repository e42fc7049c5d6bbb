"""The data files of a run: read, gate on bad rows, hash, weight and mix; and the tokenized-data cache.

Every file's sha256 and row counts are recorded (summary.json, env.json, a ``data`` event in metrics.jsonl and
each checkpoint), so a resume can refuse data that changed under it (``allow_changed_data: true`` overrides).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from trainq.trainer.checkpoints import sha256_file
from trainq.trainer.data import (
    BadRow,
    DataError,
    Row,
    TokenizedDataset,
    counts_text,
    read_rows,
    require_rows,
    split,
    tokenize,
)

logger = logging.getLogger(__name__)

#: bad lines named in the error when the limit is exceeded
NAMED_BAD_LINES = 3
#: bump when the cached example layout changes
CACHE_FORMAT = 2


@dataclass(frozen=True)
class DataFile:
    """One data file as this run read it."""

    path: str
    role: str  # train | eval
    sha256: str
    rows: int
    bad_rows: int
    weight: float = 1.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LoadedData:
    """Rows for training and evaluation, what was rejected, and the files they came from."""

    train: list[Row]
    eval: list[Row]
    bad: list[BadRow]
    files: tuple[DataFile, ...] = ()


def bad_row_limit(max_bad_rows: float, total: int) -> int:
    """``max_bad_rows`` as a count: >= 1 is a count, below 1 a share of the file's lines."""
    return int(max_bad_rows) if max_bad_rows >= 1 else math.floor(max_bad_rows * total)


def check_bad_rows(path: str, rows: list[Row], bad: list[BadRow], max_bad_rows: float) -> None:
    """DataError naming the first bad lines when the file has more bad rows than allowed."""
    limit = bad_row_limit(max_bad_rows, len(rows) + len(bad))
    if len(bad) <= limit:
        return
    first = "; ".join(f"line {b.line}: {b.reason}" for b in bad[:NAMED_BAD_LINES])
    raise DataError(
        f"{path}: {len(bad)} bad rows of {len(rows) + len(bad)}, over train.data.max_bad_rows "
        f"({max_bad_rows:g} -> {limit} allowed): {first}; fix the rows or raise the limit"
    )


def weighted(rows: list[Row], weight: float) -> list[Row]:
    """Each row ``int(weight)`` times, plus the share ``weight % 1`` of rows chosen by hash (deterministic)."""
    whole, part = int(weight), weight - int(weight)
    out = rows * whole
    if part > 0:
        out += [r for r in rows if int(r.digest[8:16], 16) / 0x1_0000_0000 < part]
    return out


def _read(path: str, role: str, max_bad_rows: float, weight: float = 1.0) -> tuple[list[Row], list[BadRow], DataFile]:
    rows, bad = read_rows(path)
    require_rows(path, rows, bad)
    check_bad_rows(path, rows, bad, max_bad_rows)
    return rows, bad, DataFile(path, role, sha256_file(Path(path)), len(rows), len(bad), weight)


def load_data(
    train: str | tuple | list, eval_file: str | None, eval_fraction: float, max_bad_rows: float = 0
) -> LoadedData:
    """Read, gate and hash the data files (no tokenizer needed: this runs before the model loads).

    ``train`` is one path or a sequence of ``(path, weight)``; the held-out split happens per file, before weighting,
    so a repeated row never lands on both sides.
    """
    sources = [(train, 1.0)] if isinstance(train, str) else list(train)
    train_rows, eval_rows, bad, files = [], [], [], []
    for path, weight in sources:
        rows, file_bad, info = _read(path, "train", max_bad_rows, weight)
        if eval_file is None:
            rows, held = split(rows, eval_fraction)
            eval_rows += held
        train_rows += weighted(rows, weight)
        bad += file_bad
        files.append(info)
    if eval_file is not None:
        eval_rows, eval_bad, info = _read(eval_file, "eval", max_bad_rows)
        bad += eval_bad
        files.append(info)
    return LoadedData(train_rows, eval_rows, bad, tuple(files))


def changed_files(saved: list[dict], current: tuple[DataFile, ...]) -> list[str]:
    """Each difference between a checkpoint's data files and this run's, in words (files compared in order per
    role, by content: a job folder that moved between queue states keeps its data)."""
    changes = []
    for role in ("train", "eval"):
        before = [f for f in saved if f["role"] == role]
        now = [f for f in current if f.role == role]
        for old, new in zip(before, now, strict=False):
            if old["sha256"] != new.sha256:
                changes.append(
                    f"{role} data {new.path} changed (sha256 {old['sha256'][:12]} -> {new.sha256[:12]}, "
                    f"rows {old['rows']} -> {new.rows})"
                )
            elif old.get("weight", 1.0) != new.weight:
                changes.append(f"{role} data {new.path} weight {old.get('weight', 1.0)} -> {new.weight}")
        changes += [f"{role} data {f.path} added" for f in now[len(before) :]]
        changes += [f"{role} data {f['path']} removed" for f in before[len(now) :]]
    return changes


# -- the tokenized-data cache ------------------------------------------------------------------------------


def cache_key(files: tuple[DataFile, ...], tokenizer, seq_len: int, train_on: str, eval_fraction: float) -> str:
    """Data hashes + tokenizer (vocabulary, specials, chat template) + seq_len + train_on."""
    digest = hashlib.sha256()
    tok = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": tokenizer.special_tokens_map,
        "template": getattr(tokenizer, "chat_template", None),
        "class": type(tokenizer).__name__,
    }
    digest.update(json.dumps(tok, sort_keys=True, default=str).encode())
    content = [(f.role, f.sha256, f.weight) for f in files]  # not the paths: the job folder moves between states
    digest.update(json.dumps([CACHE_FORMAT, content, seq_len, train_on, eval_fraction], sort_keys=True).encode())
    return digest.hexdigest()


def tokenize_cached(
    data: LoadedData, tokenizer, seq_len: int, train_on: str, eval_fraction: float, cache_dir: Path | None
) -> tuple[TokenizedDataset, TokenizedDataset | None, bool]:
    """(train set, eval set or None, whether it came from the cache); writes the cache when it was missing."""
    key = cache_key(data.files, tokenizer, seq_len, train_on, eval_fraction)
    path = cache_dir / f"{key}.pkl" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            with open(path, "rb") as f:
                train, evals = pickle.load(f)  # our own file, written below by this same code
            return TokenizedDataset(*train), TokenizedDataset(*evals) if evals is not None else None, True
        except (OSError, pickle.UnpicklingError, EOFError, ValueError) as exc:
            logger.warning("%s: unreadable tokenized cache (%s); tokenizing again", path, exc)
    train_set = tokenize(data.train, tokenizer, seq_len, train_on)
    eval_set = tokenize(data.eval, tokenizer, seq_len, train_on) if data.eval else None
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(
                (
                    (train_set.examples, train_set.bad),
                    (eval_set.examples, eval_set.bad) if eval_set is not None else None,
                ),
                f,
            )
        os.replace(tmp, path)
    return train_set, eval_set, False


class EncodedRows(Protocol):
    """A split as tokenizing left it: TokenizedDataset, or dpo's PreferenceRows."""

    bad: list[BadRow]

    def __len__(self) -> int: ...


def check_encoded(
    data: LoadedData, train_set: EncodedRows, eval_set: EncodedRows | None, max_bad_rows: float
) -> list[BadRow]:
    """Gate the rows tokenizing rejected (with each file's parse errors) on ``max_bad_rows``, and refuse a training
    set that filtering emptied, with the count of each reason; returns the newly rejected rows."""
    encoded_bad = train_set.bad + (eval_set.bad if eval_set is not None else [])
    for info in data.files:
        mine = [b for b in data.bad if b.file == info.path] + [b for b in encoded_bad if b.file == info.path]
        total = info.rows + info.bad_rows
        limit = bad_row_limit(max_bad_rows, total)
        if len(mine) > limit:
            first = "; ".join(
                f"line {b.line}: {b.reason}" for b in sorted(mine, key=lambda b: b.line)[:NAMED_BAD_LINES]
            )
            raise DataError(
                f"{info.path}: {len(mine)} bad rows of {total} ({counts_text(mine)}), over "
                f"train.data.max_bad_rows ({max_bad_rows:g} -> {limit} allowed): {first}; fix the rows or "
                "raise the limit"
            )
    if len(train_set) == 0:
        train_files = ", ".join(f.path for f in data.files if f.role == "train")
        every = data.bad + encoded_bad
        raise DataError(
            f"{train_files}: no usable training row after filtering ({len(every)} bad: "
            f"{counts_text(every)}); first: {every[0] if every else 'none'}"
        )
    return encoded_bad
