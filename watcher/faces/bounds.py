"""Bounds on what one job entry of status.json (and so status.html) may hold, whatever its job file held.

A sweep's ``params``, a job's name, error or evidence come from files users (or their scripts)
write: an 800 KB sweep once made status.json 40 MB, past what ``trainq status`` reads. Every
string is cut at MAX_TEXT_CHARS and marked with how much was cut, ``params`` lists at most
MAX_PARAMS keys and says how many it left out, and lists at most MAX_LIST_ITEMS items, so an
entry stays a few KB. The job's own files (run.json, job.yaml) keep everything.
"""

from __future__ import annotations

#: longest string kept in a status.json job entry; longer ones end with CUT_MARK
MAX_TEXT_CHARS = 300
#: most sweep parameters listed per job entry
MAX_PARAMS = 20
#: most items kept of any list in a job entry
MAX_LIST_ITEMS = 50
#: the key under which a cut ``params`` says how many keys it left out
MORE_PARAMS_KEY = "…"
#: nesting below which values are replaced by CUT_MARK (entries are shallow; this only stops a hostile one)
MAX_DEPTH = 6


def cut_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` itself when short, else its start marked ``…[+N chars]``."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[+{len(text) - limit} chars]"


def bounded_entry(entry: dict) -> dict:
    """A job entry with every string, list and ``params`` within bounds (the entry itself when it already is)."""
    if _is_small(entry, 0):
        return entry
    out: dict[str, object] = {}
    for key, value in entry.items():
        if key == "params" and isinstance(value, dict):
            out[key] = bounded_params(value)
        else:
            out[key] = _bounded(value, 1)
    return out


def bounded_params(params: dict) -> dict:
    """At most MAX_PARAMS keys, each value cut; one more key says how many were left out."""
    items = list(params.items())
    out = {cut_text(str(k), 64): _bounded(v, 2) for k, v in items[:MAX_PARAMS]}
    if len(items) > MAX_PARAMS:
        out[MORE_PARAMS_KEY] = f"{len(items) - MAX_PARAMS} more parameter(s) in the job's run.json"
    return out


def _bounded(value: object, depth: int) -> object:
    if isinstance(value, str):
        return cut_text(value)
    if depth >= MAX_DEPTH and isinstance(value, (dict, list, tuple)):
        return "…[cut: nested too deep]"
    if isinstance(value, dict):
        shown = list(value.items())[:MAX_LIST_ITEMS]
        out = {cut_text(str(k), 64): _bounded(v, depth + 1) for k, v in shown}
        if len(value) > MAX_LIST_ITEMS:
            out[MORE_PARAMS_KEY] = f"{len(value) - MAX_LIST_ITEMS} more key(s)"
        return out
    if isinstance(value, (list, tuple)):
        items = [_bounded(v, depth + 1) for v in list(value)[:MAX_LIST_ITEMS]]
        if len(value) > MAX_LIST_ITEMS:
            items.append(f"…[+{len(value) - MAX_LIST_ITEMS} items]")
        return items
    return value


def _is_small(value: object, depth: int) -> bool:
    """True when nothing in ``value`` needs cutting (the common case: checked without copying)."""
    if isinstance(value, str):
        return len(value) <= MAX_TEXT_CHARS
    if isinstance(value, dict):
        if depth >= MAX_DEPTH or len(value) > (MAX_PARAMS if depth == 1 else MAX_LIST_ITEMS):
            return False
        return all(len(str(k)) <= 64 and _is_small(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        if depth >= MAX_DEPTH or len(value) > MAX_LIST_ITEMS:
            return False
        return all(_is_small(v, depth + 1) for v in value)
    return True
