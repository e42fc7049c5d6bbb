"""Durations and timestamps as job files and status files spell them."""
from __future__ import annotations

import re
from datetime import datetime, timezone

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")
#: seconds per unit suffix; a bare number is seconds
_UNIT_S = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

#: the pattern job/watcher schemas use for duration strings (kept in step with parse_duration_s)
DURATION_PATTERN = r"^\s*(\d+(\.\d+)?|\.\d+)\s*(ms|s|m|h|d)?\s*$"


def parse_duration_s(value: object) -> float:
    """``90``, ``"90"``, ``"90s"``, ``"1.5h"``, ``"10m"``, ``"6h"`` → seconds; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 90, 90s, 10m or 1.5h (got {value!r})")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a duration cannot be negative (got {value!r})")
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(f"expected a duration like 90, 90s, 10m or 1.5h (got {value!r})")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


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
