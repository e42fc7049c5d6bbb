"""Text that people read (watcher.log, the terminal view): never a forged line, never a terminal escape."""

from __future__ import annotations

import logging
import re
from typing import overload

#: C0 controls, DEL and C1 controls (ESC starts terminal escapes; CR and LF start forged log lines)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``) and lone surrogates shown as U+FFFD."""
    if not text.isascii():
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if not _CONTROL.search(text):
        return text
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


@overload
def printable_tree(value: dict) -> dict: ...
@overload
def printable_tree(value: object) -> object: ...
def printable_tree(value: object) -> object:
    """Every string in a JSON-like tree (keys too) made ``printable``."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_tree(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable_tree(v) for v in value]
    return value


class PrintableFormatter(logging.Formatter):
    """A Formatter whose messages hold no control characters: one record is one line of watcher.log.

    A job's file name, name or error text reaches log messages; escaping here keeps every record on
    one line whatever a message's arguments hold. Tracebacks (exc_info) stay multi-line.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)
