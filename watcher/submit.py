"""What ``trainq submit`` does to a file before it lands in the inbox: read it safely, approve it, name it."""
from __future__ import annotations

import re
from pathlib import Path

from .errors import InvalidJobSpec, Problem
from .jobspec import read_spec_text

#: a top-level ``approved:`` line (not indented), whatever its value
_APPROVED_LINE = re.compile(r"^approved[ \t]*:.*$", re.MULTILINE)


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
    if _APPROVED_LINE.search(text):
        return _APPROVED_LINE.sub("approved: true", text, count=1)
    return "approved: true\n" + text


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
