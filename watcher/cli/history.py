"""``trainq history [GLOB] [--state S] [--since T] [--kind K] [--sweep S] [--json|--csv]``: every finished job.

Read from ``ROOT/history.jsonl`` (faces/history.py), which the watcher appends to at each conclusion,
so it answers at once however many jobs finished (status.json keeps only the latest 50). A queue
without that file yet (made before this version) is read from its done/ and failed/ folders instead.
Jobs now pending or running again (retried) are left out: they have not finished.
"""

from __future__ import annotations

import csv
import fnmatch
import json
import os
import sys
import time
from pathlib import Path

from trainq.watcher.faces.history import FIELDS, read_records, record_of

EXIT_OK, EXIT_INVALID = 0, 2
#: the states and statuses --state takes
STATES = ("done", "failed", "cancelled", "timeout", "rejected", "removed")


class HistoryUsage(Exception):
    """Raised when an option's value cannot be used (exit status 2)."""


def history(
    root: Path,
    state: str | None = None,
    since: str | None = None,
    kind: str | None = None,
    sweep: str | None = None,
    fmt: str = "table",
    now: float | None = None,
    pattern: str | None = None,
) -> int:
    """Print the finished jobs that match, oldest conclusion first."""
    try:
        records = select(root, state, since, kind, sweep, now, pattern)
    except HistoryUsage as exc:
        print(f"trainq: history: {exc}", file=sys.stderr)
        return EXIT_INVALID
    out = sys.stdout
    if fmt == "json":
        out.write(json.dumps(records, ensure_ascii=False) + "\n")
    elif fmt == "csv":
        writer = csv.DictWriter(out, fieldnames=FIELDS, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(records)
    else:
        out.write(_table(records))
    return EXIT_OK


def select(
    root: Path,
    state: str | None,
    since: str | None,
    kind: str | None,
    sweep: str | None,
    now: float | None = None,
    pattern: str | None = None,
) -> list[dict]:
    """The matching records; HistoryUsage for a bad option value."""
    records = read_records(root)
    if records is None:
        records = _from_folders(root)
    live = _live_ids(root)
    wanted = _states(state)
    cutoff = _since(since, time.time() if now is None else now)
    if not (live or wanted or cutoff or kind or sweep or pattern):
        return list(records.values())
    out = []
    for record in records.values():
        if record["id"] in live:
            continue
        if wanted and record.get("state") not in wanted and record.get("status") not in wanted:
            continue
        if kind and kind not in (record.get("kind"), record.get("type")):
            continue
        if sweep and record.get("sweep") != sweep:
            continue
        if cutoff and (record.get("finished_at") or "") < cutoff:
            continue
        if pattern and not any(fnmatch.fnmatchcase(str(record.get(k) or ""), pattern) for k in ("id", "name")):
            continue
        out.append(record)
    return out


def _states(text: str | None) -> set[str]:
    if not text:
        return set()
    wanted = {s.strip() for s in text.split(",") if s.strip()}
    unknown = sorted(wanted - set(STATES))
    if unknown:
        raise HistoryUsage(f"--state {unknown[0]!r}: expected one of {', '.join(STATES)} (comma-separated)")
    return wanted


def _since(text: str | None, now: float) -> str | None:
    """``--since``: an ISO date/time (UTC unless it says) or an age (90m, 12h, 7d) → an ISO bound to compare with."""
    if not text:
        return None
    from trainq.watcher.spec.units import iso_utc, parse_duration_s

    stripped = text.strip()
    try:
        age = float(stripped[:-1]) * 86400 if stripped.endswith("d") else parse_duration_s(stripped)
        return iso_utc(now - age)
    except ValueError:
        pass
    from datetime import datetime, timezone

    try:
        when = datetime.fromisoformat(stripped.replace("Z", "+00:00"))
    except ValueError:
        when = None
    stamp = None if when is None else (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
    if stamp is None:
        raise HistoryUsage(
            f"--since {text!r}: expected an ISO date (2026-12-01, 2026-12-01T08:00Z) or an age (12h, 7d)"
        )
    return iso_utc(stamp)


def _live_ids(root: Path) -> set[str]:
    """Jobs pending or running now (a retried job's old conclusion no longer holds)."""
    live = set()
    for state in ("pending", "running"):
        try:
            live.update(os.listdir(root / state))
        except FileNotFoundError:
            pass
    return live


def _from_folders(root: Path) -> dict[str, dict]:
    """A queue without history.jsonl yet: its done/ and failed/ folders' run.json (slow for huge queues)."""
    from trainq.watcher.spec.contract import JobPaths
    from trainq.watcher.spec.fsutil import read_json

    found = []
    for state in ("done", "failed"):
        try:
            names = [n for n in os.listdir(root / state) if not n.startswith(".")]
        except FileNotFoundError:
            continue
        for name in names:
            run = read_json(JobPaths(root / state / name).run)
            if run is not None:
                found.append(record_of(name, state, run, None, None))
    found.sort(key=lambda r: r.get("finished_at") or "")
    return {r["id"]: r for r in found}


def _table(records: list[dict]) -> str:
    """One line a job: ID, STATUS (kind), REASON, TOOK, LOSS, EVAL, FINISHED, ATT, NAME; and a count at the end.

    REASON is the reason word (docs/contract.md, why a job stopped) (``-`` when the job ended by itself); LOSS and EVAL the last ones."""
    if not records:
        return "no finished job matches\n"
    width = min(max(len(r["id"]) for r in records), 40)
    lines = [
        f"{'ID':<{width}}  {'STATUS':<20}  {'REASON':<8}  {'TOOK':>8}  {'LOSS':>7}  {'EVAL':>7}  "
        f"{'FINISHED':<20}  {'ATT':>3}  NAME"
    ]
    for r in records:
        status = r.get("status") or r.get("state") or "?"
        if r.get("kind"):
            status += f" ({r['kind']})"
        name = r.get("name") if r.get("name") != r["id"] else ""
        lines.append(
            f"{r['id']:<{width}}  {status:<20}  {r.get('reason') or '-':<8}  {_took(r.get('duration_s')):>8}  "
            f"{_loss(r.get('final_loss')):>7}  {_loss(r.get('final_eval_loss')):>7}  "
            f"{_finished_at(r.get('finished_at')):<20}  {r.get('attempts') or 0:>3}  {name or ''}"
        )
    lines.append(f"{len(records)} finished job(s)")
    return "\n".join(lines) + "\n"


def _took(seconds: object) -> str:
    """How long it ran: 42s, 6m25s, 2h03m."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "-"
    s = round(seconds)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def _loss(value: object) -> str:
    """A loss in at most 7 characters, its magnitude kept: 2.134, 0.0012, 8.3e-05."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return "-"
    text = f"{value:.4g}"
    return text if len(text) <= 7 else f"{value:.1e}"


def _finished_at(iso: object) -> str:
    """The end time with its zone: the watcher writes UTC."""
    text = str(iso or "")
    return f"{text[:19].replace('T', ' ')} UTC" if text.endswith("Z") else (text[:19] or "-")
