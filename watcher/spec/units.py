"""Durations and timestamps as job files and status files spell them."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import overload

# fullmatch on the stripped text: one \s* run between number and unit, so a failed match backtracks
# over it once (linear); the old ``\s*(unit)?\s*$`` tried every split of a run of spaces (quadratic)
_DURATION = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|h|d)?")
#: seconds per unit suffix; a bare number is seconds
_UNIT_S = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
#: longest duration any setting takes (one year, in seconds): past it, deadline arithmetic overflows
MAX_DURATION_S = 365 * 86400
#: the same limit as people write it
MAX_DURATION_TEXT = "365d"
#: longest duration string read; nothing sensible is longer, and it caps the work a bad one costs
MAX_DURATION_CHARS = 64

#: the pattern job/watcher schemas use for duration strings (kept in step with parse_duration_s).
#: Linear on any input: the optional unit group cannot re-split the spaces the trailing \s* takes.
DURATION_PATTERN = r"^\s*(\d+(\.\d+)?|\.\d+)(\s*(ms|s|m|h|d))?\s*$"


def parse_duration_s(value: object) -> float:
    """``90``, ``"90"``, ``"90s"``, ``"1.5h"``, ``"10m"``, ``"6h"`` → seconds, at most MAX_DURATION_S.

    ValueError otherwise. Linear time in the length of the text, which is capped anyway.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a duration like 90, 90s, 10m or 1.5h (got {_short(value)})")
    if isinstance(value, str):
        value = _parse_text(value)
    if not 0 <= value <= MAX_DURATION_S:  # also refuses nan
        what = "cannot be negative" if value < 0 else f"must be at most {MAX_DURATION_TEXT} ({MAX_DURATION_S} s)"
        raise ValueError(f"a duration {what} (got {_short(value)})")
    return float(value)


def is_zero_duration(value: object) -> bool:
    """True for a well-formed duration of 0; malformed ones are the schema's to report."""
    try:
        return value is not None and parse_duration_s(value) == 0
    except ValueError:
        return False


def _parse_text(text: str) -> float:
    stripped = text.strip()
    match = _DURATION.fullmatch(stripped) if len(stripped) <= MAX_DURATION_CHARS else None
    if not match:
        raise ValueError(f"expected a duration like 90, 90s, 10m or 1.5h (got {_short(text)})")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@overload
def iso_utc(ts: float) -> str: ...
@overload
def iso_utc(ts: float | None) -> str | None: ...
def iso_utc(ts: float | None) -> str | None:
    """Unix time → ISO-8601 UTC with millisecond precision and a ``Z``; None stays None."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_iso(text: str | None) -> float | None:
    """ISO-8601 (as iso_utc writes it) → unix time; None or junk → None."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
