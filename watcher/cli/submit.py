"""What ``trainq submit`` does to a file before it lands in the inbox: read it safely, approve it, name it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import cast

from trainq.watcher.spec.errors import InvalidJobSpec, Problem
from trainq.watcher.spec.jobspec import read_spec_text
from trainq.watcher.spec.yaml12 import load_yaml12


def read_job_text(path: Path) -> str:
    """The job file's text, following a symlink the user named on purpose; InvalidJobSpec if unreadable."""
    try:
        text = read_spec_text(path, follow_symlinks=True)
    except FileNotFoundError:
        raise InvalidJobSpec(str(path), [Problem("", "no such file")]) from None
    if isinstance(text, Problem):
        raise InvalidJobSpec(str(path), [text])
    return text


def approve_text(text: str) -> str:
    """The same text with ``approved: true``: the top-level line replaced, or one added at the top."""
    return set_top_level(text, "approved", "true", at_top=True)


def debug_text(text: str, display: str) -> str:
    """The same text with ``debug: true`` in its ``train:`` mapping (``trainq submit --debug``).

    Only that key is added (or its value replaced): the rest of the file stays byte for byte, comments
    included. The key goes in front of the mapping's first key, found with PyYAML's node positions, so block
    and flow style both work; the result is parsed again and must equal the original plus the key.
    InvalidJobSpec naming the file when the job is not a train job or the text cannot be changed safely.
    """
    import yaml

    data = load_yaml12(text)
    if not isinstance(data, dict) or not isinstance(data.get("train"), dict):
        raise InvalidJobSpec(
            display,
            [
                Problem(
                    "command",
                    "--debug adds train.debug: true, so it is for train jobs only; a command job runs its own program",
                )
            ],
        )
    root = cast(yaml.MappingNode, yaml.compose(text, Loader=yaml.SafeLoader))  # a valid job file: a mapping
    train = next(v for k, v in root.value if k.value == "train")
    existing = next((v for k, v in train.value if k.value == "debug"), None)
    if existing is not None:
        start, end, insert = existing.start_mark.index, existing.end_mark.index, "true"
    else:
        first = train.value[0][0].start_mark
        start = end = first.index
        insert = (
            "debug: true, " if train.flow_style else "debug: true\n" + text[first.index - first.column : first.index]
        )
    new = text[:start] + insert + text[end:]
    expected = dict(data, train=dict(data["train"], debug=True))
    if load_yaml12(new) != expected:
        raise InvalidJobSpec(
            display,
            [Problem("train.debug", "could not add debug: true to this file's layout; add it under train: yourself")],
        )
    return new


def set_top_level(text: str, key: str, value: str, at_top: bool = False) -> str:
    """The same text with the top-level (not indented) ``key:`` line set to ``key: value``; added if missing.

    Only that one line changes, so the user's comments and layout stay as they wrote them.
    """
    line = re.compile(rf"^{re.escape(key)}[ \t]*:.*$", re.MULTILINE)
    if line.search(text):
        return line.sub(lambda _m: f"{key}: {value}", text, count=1)
    if at_top:
        return f"{key}: {value}\n" + text
    return text + ("" if not text or text.endswith("\n") else "\n") + f"{key}: {value}\n"


def inbox_name(inbox: Path, file_name: str) -> Path:
    """A free name in the inbox for ``file_name`` (``x.yaml``, ``x-2.yaml``, …), ending in .yaml."""
    stem, dot, suffix = file_name.rpartition(".")
    if not dot or suffix.lower() not in ("yaml", "yml"):
        stem, suffix = file_name, "yaml"
    candidate = inbox / f"{stem}.{suffix}"
    n = 2
    while candidate.exists() or candidate.is_symlink():
        candidate = inbox / f"{stem}-{n}.{suffix}"
        n += 1
    return candidate


def pools_now(root: Path | None) -> dict[str, int] | None:
    """The pools ROOT/watcher.yaml names now (read live, as the watcher will); None when it cannot be read."""
    if root is None or not Path(root).is_dir():
        return None
    from trainq.watcher.spec.config import load_watcher_config

    try:
        return load_watcher_config(Path(root), {}).pool_limits()
    except (InvalidJobSpec, OSError):
        return None  # the watcher keeps its last good settings; acceptance checks against those


def submit_base(path: Path) -> Path:
    """The folder a job file's relative paths resolve against: its own, or the queue root for an inbox file."""
    folder = Path(os.path.abspath(path)).parent
    if folder.name == "inbox" and (folder.parent / "pending").is_dir():
        return folder.parent
    return folder


def with_submitted_from(text: str, folder: Path, display: str) -> str:
    """The text with ``submitted_from: FOLDER`` added at its end (docs/contract.md), unless it names one.

    Only that line is added, so comments and layout stay; the result is parsed again and must equal the
    original plus the key (a file in flow style cannot take a line: InvalidJobSpec says what to do).
    """
    data = load_yaml12(text)
    if not isinstance(data, dict) or "submitted_from" in data:
        return text
    new = set_top_level(text, "submitted_from", json.dumps(str(folder), ensure_ascii=False))
    try:
        same = load_yaml12(new) == dict(data, submitted_from=str(folder))
    except Exception:
        same = False
    if not same:
        raise InvalidJobSpec(
            display,
            [
                Problem(
                    "submitted_from",
                    f"could not add submitted_from: {folder} to this file's layout; add that line yourself",
                )
            ],
        )
    return new


def check_before_submit(spec, display: str, base: Path, root: Path | None, now: float, stem: str = "job") -> None:
    """What acceptance would refuse, refused now (docs/contract.md): InvalidJobSpec listing each problem.

    ``stem``: the job's id to be; its folder will be ``ROOT/pending/<stem>`` (its depth is what counts).
    """
    from trainq.watcher.spec.jobspec import check_submission
    from trainq.watcher.spec.refusals import check_knowable

    check_submission(spec, display, now)
    job_dir = str(Path(root).resolve() / "pending" / stem) if root is not None else None
    check_knowable(spec, display, base, pools_now(root), job_dir)
