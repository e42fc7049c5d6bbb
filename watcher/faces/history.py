"""``ROOT/history.jsonl``: one line per job conclusion, kept by the watcher, read by ``trainq history``.

status.json lists only the ``keep_finished`` latest finished jobs; this file lists every one, like
Slurm's accounting (``sacct``). The watcher appends one JSON object per line each time a job reaches
done/ or failed/ (a retried job gets a new line when it concludes again: the last line of an id is
its truth). Each line is written with one ``write`` on an ``O_APPEND`` descriptor, so concurrent
readers never see half a record except at the very end, which they skip. ``trainq clean`` and
``rm`` do not erase it: like sacct, history remembers jobs whose folders are gone. Delete or
truncate the file to forget them.

A record: ``{"id", "name", "state", "status", "type": "train"|"command", "kind": diagnosis kind or
null, "sweep", "pool", "submitted_at", "started_at", "finished_at", "attempts", "exit_code", "reason",
"duration_s", "final_loss", "final_eval_loss"}``; ``reason`` is the reason word (docs/contract.md, why a job stopped) (absent when
the job ended by itself), ``duration_s`` the seconds from its first start to its end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainq.watcher.faces.story import derive
from trainq.watcher.spec.units import parse_iso

#: the file's name at the queue root
HISTORY_FILE = "history.jsonl"
#: record fields, in the order ``--csv`` prints them
FIELDS = (
    "id",
    "name",
    "state",
    "status",
    "type",
    "kind",
    "sweep",
    "pool",
    "submitted_at",
    "started_at",
    "finished_at",
    "attempts",
    "exit_code",
    "reason",
    "duration_s",
    "final_loss",
    "final_eval_loss",
)


def history_path(root: Path) -> Path:
    return Path(root) / HISTORY_FILE


def record_of(
    job_id: str, state: str, run: dict, is_train: bool | None, pool: str | None, progress: dict | None = None
) -> dict:
    """The history record of a job that just concluded, from its run.json and its final progress."""
    attempts = run.get("attempts") or []
    last = attempts[-1] if attempts else {}
    diagnosis = run.get("diagnosis") or {}
    story = derive(job_id, state, run, progress=progress)
    start, end = parse_iso(run.get("started_at")), parse_iso(run.get("finished_at"))
    record = {
        "id": job_id,
        "name": run.get("name") or job_id,
        "state": state,
        "status": run.get("status") or state,
        "type": None if is_train is None else ("train" if is_train else "command"),
        "kind": diagnosis.get("kind"),
        "sweep": (run.get("sweep") or {}).get("id"),
        "pool": pool,
        "submitted_at": run.get("submitted_at"),
        "started_at": run.get("started_at"),
        "finished_at": run.get("finished_at"),
        "attempts": max(int(run.get("attempt") or 0), len(attempts)),  # run.json keeps the last 100 in full
        "exit_code": last.get("exit_code"),
        "duration_s": round(end - start, 1) if start is not None and end is not None else None,
        "final_loss": (story.progress or {}).get("loss"),
        "final_eval_loss": (story.progress or {}).get("eval_loss"),
    }
    if story.reason:
        record["reason"] = story.reason
    return record


def append_record(root: Path, record: dict) -> None:
    """Append one line (one ``write`` on an O_APPEND descriptor: lines from one writer never interleave)."""
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(os.path.join(root, HISTORY_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_records(root: Path) -> dict[str, dict] | None:
    """Every job's latest record, oldest conclusion first; None when the watcher has written no history yet."""
    try:
        with open(history_path(root), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    end = data.rfind(b"\n")
    body = data[: end + 1] if end >= 0 else b""  # a last line without its newline is still being written
    try:  # one C call for the whole file: 100,000 records parse in a fraction of a second
        records = json.loads(b"[" + body.rstrip(b"\n").replace(b"\n", b",") + b"]")
    except ValueError:
        records = _parse_lines(body)  # a damaged line somewhere: skip it, keep the rest
    try:  # the usual case: every line a record with an id; a dict keeps an id's newest record
        latest = {record["id"]: record for record in records}
    except (TypeError, KeyError):
        records = [r for r in records if isinstance(r, dict) and isinstance(r.get("id"), str)]
        latest = {record["id"]: record for record in records}
    if len(latest) < len(records):  # some job concluded twice (retried): order by the newest conclusion
        return dict(sorted(latest.items(), key=lambda item: item[1].get("finished_at") or ""))
    return latest


def _parse_lines(body: bytes) -> list:
    records = []
    for line in body.split(b"\n"):
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
