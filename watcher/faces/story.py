"""One story per job (docs/contract.md, why a job stopped): what every face says about a job, derived in one place.

``derive`` builds a ``JobStory`` from a job's run.json (with, where the watcher has them, its live
progress and health): where it is, its status, why its attempt stopped (``reason``, one word of
docs/contract.md, why a job stopped), the attempt running now and how the one before it ended, its progress, the
advice that fits its state, and notes that each hold for an attempt and a step range. status.json
carries each listed job's story (``reason``, ``story``); the faces that read status.json (the status
row, status.html, the serve page) take it back with ``from_entry``, the faces that read a job folder
(``show``, ``why``, ``history``, ``events``) build it with ``load``. A face formats a story; none
decides on its own why a job stopped (git's porcelain over one object model).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from trainq.watcher.faces.progress import PROGRESS_KEYS
from trainq.watcher.spec import events as job_events
from trainq.watcher.spec.contract import (
    REASON_PHRASES,
    REASON_REMOVED,
    REASON_TIMEOUT,
    REASON_USER,
    REASON_WATCHER,
    JobPaths,
    stop_flag_reason,
)
from trainq.watcher.spec.fsutil import open_no_follow, read_json

#: the reason words, in docs/contract.md's order
REASONS = tuple(REASON_PHRASES)
#: run.json ``stop_requested_by`` (what the watcher asked a stop for) -> the reason word
_REQUESTED_BY = {
    "deadline": "deadline",
    "window": "window",
    "stalled": "stalled",
    "schedule": REASON_WATCHER,
    "internal_error": REASON_WATCHER,
}
#: the supervisor's stop mechanism (exit record ``stop_reason``) -> the reason word, when nothing better is known
_MECHANISM = {"stop_flag": REASON_USER, "timeout": REASON_TIMEOUT, "folder_removed": REASON_REMOVED}
#: a loss this share below the level a health note was raised at means the signal recovered
RECOVERED_SHARE = 0.05
#: statuses of a job whose folder is in done/ or failed/
_FINISHED = ("done", "failed")
#: ``torch.cuda.OutOfMemoryError: …`` → ``OutOfMemoryError: …`` in a headline: the words that matter first
_MODULE_PREFIX = re.compile(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Z]\w*(?:Error|Exception|Warning)\b)")
_ERRNO = re.compile(r"\[Errno \d+\] ")
#: how much of metrics.jsonl ``load`` reads for a job's last progress (bytes)
_METRICS_TAIL_BYTES = 16384


@dataclass(frozen=True)
class Note:
    """Something said about a job (a health warning, an lr deviation) for the attempt and steps it holds for."""

    text: str
    kind: str = "health"
    attempt: int | None = None
    from_step: int | None = None
    to_step: int | None = None  # the last step it held for; None while it holds

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict) -> Note:
        return cls(
            str(data.get("text") or ""),
            str(data.get("kind") or "health"),
            _int(data.get("attempt")),
            _int(data.get("from_step")),
            _int(data.get("to_step")),
        )

    def words(self) -> str:
        """The note with what it holds for: ``… (attempt 2, since step 21)``."""
        where = [f"attempt {self.attempt}"] if self.attempt else []
        if self.from_step is not None:
            where.append(
                f"since step {self.from_step}" if self.to_step is None else f"steps {self.from_step}–{self.to_step}"
            )
        return f"{self.text} ({', '.join(where)})" if where else self.text


@dataclass(frozen=True)
class JobStory:
    """One job as every face tells it."""

    id: str
    state: str  # where it is: awaiting_approval, pending, running, done, failed
    status: str  # run.json's status
    reason: str | None = (
        None  # why the attempt stopped (docs/contract.md, why a job stopped), None when it ended by itself
    )
    attempt: int = 0  # the attempt running now, or the last one
    progress: dict | None = None
    headline: str = ""  # one line: why it is where it is ("" for a running or done job with nothing to say)
    previous: str | None = None  # a retry: how the attempt before it ended
    diagnosis: dict | None = None  # the ended attempt's {kind, evidence, advice} (finished jobs only)
    advice: str | None = None  # what to do, fitted to the state (never a flag the state cannot use)
    notes: tuple[Note, ...] = field(default_factory=tuple)

    @property
    def state_word(self) -> str:
        """The STATE column: where it is, or its status where that says more (cancelled, stopping, stalled)."""
        if self.state == "awaiting_approval":
            return "awaiting"
        if self.status == "stopping" and self.reason == "stalled":
            return "stalled"
        if self.status and self.status not in ("pending", "running", "done", "failed"):
            return self.status
        return self.state

    @property
    def evidence(self) -> str:
        return str((self.diagnosis or {}).get("evidence") or "")

    def to_entry(self) -> dict:
        """The status.json fields of the story: ``reason`` and ``story`` (headline, previous, advice, notes)."""
        story: dict = {"headline": self.headline}
        if self.previous:
            story["previous"] = self.previous
        if self.advice:
            story["advice"] = self.advice
        if self.notes:
            story["notes"] = [n.to_dict() for n in self.notes]
        return {"reason": self.reason, "story": story}


# -- the one derivation ---------------------------------------------------------------------------------------
def reason_for(run: dict, exit_record: dict | None = None) -> str | None:
    """Why the current attempt stopped, as one reason word (docs/contract.md, why a job stopped); None when it ended by itself.

    The supervisor's timeout wins (it stopped the job first); then what the watcher asked the stop for
    (``stop_requested_by``); then the word the supervisor read in the stop.flag; then the mechanism.
    """
    record = exit_record or {}
    how = record.get("stop_reason")
    if how == "timeout":
        return REASON_TIMEOUT
    asked = _REQUESTED_BY.get(str(run.get("stop_requested_by")))
    if asked:
        return asked
    if record.get("reason") in REASONS:
        return record["reason"]
    if how in _MECHANISM:
        return run.get("reason") if run.get("reason") in REASONS else _MECHANISM[how]
    if run.get("status") == "stopping":
        return run.get("reason") if run.get("reason") in REASONS else REASON_USER
    return None


def flag_reason(paths: JobPaths) -> str:
    """The reason a job's stop.flag carries (the watcher writes its own word into it; a user's flag says ``user``)."""
    try:
        with open_no_follow(paths.stop_flag) as f:  # the job can make it a FIFO: never block on it
            return stop_flag_reason(f.read(16))
    except OSError:
        return REASON_USER


def derive(
    job_id: str,
    state: str,
    run: dict,
    *,
    progress: dict | None = None,
    health: str | None = None,
    waiting_for: str | None = None,
    stopping: dict | None = None,
) -> JobStory:
    """The story of a job from its run.json, its progress and health (the watcher's), and its newest
    ``stopping`` event (when run.json has not caught up with the supervisor)."""
    status = str(run.get("status") or state)
    attempt = _int(run.get("attempt")) or 0
    reason = _reason(run, state, status, stopping)
    finished = state in _FINISHED
    diagnosis = (run.get("diagnosis") or None) if finished else None
    return JobStory(
        id=job_id,
        state=state,
        status=status,
        reason=reason,
        attempt=attempt,
        progress=progress,
        headline=_headline(state, status, reason, diagnosis, run, health, waiting_for),
        previous=None if finished else _previous(run, state),
        diagnosis=diagnosis,
        advice=_advice(state, diagnosis),
        notes=_notes(run, state, attempt, progress),
    )


def _reason(run: dict, state: str, status: str, stopping: dict | None) -> str | None:
    if state in ("pending", "awaiting_approval"):
        return REASON_USER if status == "cancelled" else None
    said = run.get("reason")
    if said in REASONS:
        return said
    if state == "running":
        if status == "stopping" and stopping and stopping.get("reason") in REASONS:
            return stopping["reason"]
        return reason_for(run) if status == "stopping" else None
    last = (run.get("attempts") or [{}])[-1] or {}
    if "reason" in last:
        return None  # the watcher concluded it knowing the reason words: no word, it ended by itself
    # a run.json from before the reason words: its last attempt's exit says how it was stopped
    if status == "cancelled" or last.get("stop_reason") in _MECHANISM:
        return reason_for(run, last) or (REASON_USER if status == "cancelled" else None)
    return None


def _headline(
    state: str,
    status: str,
    reason: str | None,
    diagnosis: dict | None,
    run: dict,
    health: str | None,
    waiting_for: str | None,
) -> str:
    if state in _FINISHED:
        return end_words(status, reason, diagnosis, run.get("error"))
    if state == "running" and status == "stopping":
        return f"stopping {REASON_PHRASES.get(reason or REASON_USER)}"
    if state == "running":
        return waiting_for or (health if health and health != "healthy" else "")
    if state == "pending":
        return waiting_for or run.get("waiting_for") or "next to start"
    return waiting_for or ""


def end_words(status: str, reason: str | None, diagnosis: dict | None, error: str | None = None) -> str:
    """How an attempt ended, in one line: ``oom: OutOfMemoryError: …``, ``stopped at its deadline``, an error."""
    if diagnosis:
        return f"{diagnosis.get('kind')}: {short_evidence(diagnosis.get('evidence'))}"
    if reason:
        return f"stopped {REASON_PHRASES[reason]}"
    if error:
        return str(error)
    if status == "cancelled":
        return f"stopped {REASON_PHRASES[REASON_USER]}"
    return "" if status == "done" else status


def short_evidence(evidence: object) -> str:
    """The line of the evidence a one-line face shows: its last, without module prefixes and errno tags."""
    # printable_tree writes the evidence's line breaks as \n: its last line is what a row shows
    lines = str(evidence or "").strip().replace("\\n", "\n").splitlines()
    last = lines[-1].strip() if lines else ""
    return _ERRNO.sub("", _MODULE_PREFIX.sub("", last)) or "–"


def _previous(run: dict, state: str) -> str | None:
    """A job running (or waiting) again: how its previous attempt ended."""
    attempts = [a for a in run.get("attempts") or () if isinstance(a, dict)]
    if state == "running":
        attempts = attempts[:-1]  # the last one is the one running
    ended = [a for a in attempts if a.get("ended_at")]
    if not ended:
        return None
    last = ended[-1]
    how = end_words(
        "failed" if last.get("diagnosis") else "done",
        last.get("reason") if last.get("reason") in REASONS else None,
        last.get("diagnosis"),
    )
    if last.get("checkpoint_exit"):
        how = "exited with its checkpoint_exit_code (saved; run again)"
    return f"attempt {last.get('n') or len(ended)} ended: {how or 'exit 0'}"


def _advice(state: str, diagnosis: dict | None) -> str | None:
    """The diagnosis's advice only where it can be acted on: a job in failed/ (retry.flag, `trainq retry`, `edit`).

    A running or pending job's diagnosis belongs to its previous attempt (``previous``): no advice."""
    advice = (diagnosis or {}).get("advice")
    return str(advice) if advice and state == "failed" else None


def _notes(run: dict, state: str, attempt: int, progress: dict | None) -> tuple[Note, ...]:
    """The notes that still hold: a health warning until the loss recovers, an lr deviation of this attempt."""
    notes = []
    progress = progress or {}
    warning, at = progress.get("warning"), progress.get("warning_at") or {}
    if warning and isinstance(at, dict) and at.get("this_attempt", True) and not _recovered(progress, at):
        notes.append(Note(str(warning), "health", attempt or None, _int(at.get("step"))))
    deviation = run.get("lr_deviation") or {}
    if deviation.get("words") and (_int(deviation.get("attempt")) == attempt or state in _FINISHED):
        notes.append(
            Note(str(deviation["words"]), "schedule", _int(deviation.get("attempt")), _int(deviation.get("step")))
        )
    return tuple(notes)


def _recovered(progress: dict, at: dict) -> bool:
    """The loss has left the level the warning was raised at (the run learns again)."""
    loss, level = _float(progress.get("loss")), _float(at.get("level"))
    step, since = _int(progress.get("step")), _int(at.get("step"))
    if step is not None and since is not None and step < since:
        return True  # a resumed attempt from before the warning: it has not reached it again
    return loss is not None and level is not None and loss < level * (1 - RECOVERED_SHARE)


# -- faces that read status.json, and faces that read a job folder ----------------------------------------------
def from_entry(entry: dict) -> JobStory:
    """The story status.json carries for a job (written by the watcher with ``to_entry``); nothing re-derived."""
    said = entry.get("story")
    if not isinstance(said, dict):  # a status.json from before the reason words: derive from what it holds
        return derive(
            str(entry.get("id")),
            str(entry.get("state")),
            entry,
            progress=entry.get("progress"),
            health=entry.get("health"),
            waiting_for=entry.get("waiting_for"),
        )
    state = str(entry.get("state"))
    return JobStory(
        id=str(entry.get("id")),
        state=state,
        status=str(entry.get("status") or state),
        reason=entry.get("reason") if entry.get("reason") in REASONS else None,
        attempt=_int(entry.get("attempt")) or 0,
        progress=entry.get("progress"),
        headline=str(said.get("headline") or ""),
        previous=said.get("previous"),
        diagnosis=(entry.get("diagnosis") or None) if state in _FINISHED else None,
        advice=said.get("advice"),
        notes=tuple(Note.from_dict(n) for n in said.get("notes") or () if isinstance(n, dict)),
    )


def load(job_dir: Path, state: str, run: dict | None = None, entry: dict | None = None) -> JobStory:
    """The story of the job in ``job_dir`` (folder ``state``): its status.json entry's where the watcher lists it
    (it knows the live progress and health), else derived from run.json, events.jsonl and metrics.jsonl."""
    if entry is not None and isinstance(entry.get("story"), dict) and entry.get("state") == state:
        return from_entry(entry)
    paths = JobPaths(Path(job_dir))
    run = read_json(paths.run) or {} if run is None else run
    stopping = _last_event(paths, "stopping", _int(run.get("attempt"))) if state == "running" else None
    return derive(job_dir.name, state, run, progress=last_progress(paths), stopping=stopping)


def _last_event(paths: JobPaths, name: str, attempt: int | None) -> dict | None:
    found = [r for r in job_events.read(paths) if r.get("event") == name and _int(r.get("attempt")) == attempt]
    return found[-1] if found else None


def last_progress(paths: JobPaths) -> dict | None:
    """The job's progress as its metrics.jsonl's last records say it (step, total_steps, loss, eval_loss...)."""
    try:
        with open_no_follow(paths.metrics) as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - _METRICS_TAIL_BYTES))
            data = f.read(_METRICS_TAIL_BYTES)
    except OSError:
        return None
    merged: dict = {}
    for line in data.splitlines()[1 if len(data) >= _METRICS_TAIL_BYTES else 0 :]:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or record.get("type", "step") not in ("step", "eval", "done"):
            continue
        merged.update({k: record[k] for k in PROGRESS_KEYS if _float(record.get(k)) is not None})
    return merged or None


def removed(job_id: str, stone: dict) -> JobStory:
    """The story of a job whose folder was removed (its tombstone, spec/tombstones.py): a job removed while it
    was live (pending or running) stopped for ``removed``; one removed after it ended keeps its end."""
    state, status = str(stone.get("state") or "removed"), str(stone.get("status") or "")
    live = state in ("pending", "running") or status in ("pending", "running", "stopping")
    reason = REASON_REMOVED if live else None
    headline = (
        f"stopped {REASON_PHRASES[REASON_REMOVED]}" if live else f"{status or 'ended'}, then its folder was removed"
    )
    return JobStory(id=job_id, state="removed", status=status or "removed", reason=reason, headline=headline)


def event_words(record: dict) -> str | None:
    """What a ``stopping`` or ``finished`` event means, in the story's words (``trainq events`` prints it)."""
    reason = record.get("reason")
    if record.get("event") == "stopping" and reason in REASONS:
        return f"stopping {REASON_PHRASES[reason]}"
    if record.get("event") == "finished" and reason in REASONS:
        return f"stopped {REASON_PHRASES[reason]}"
    return None


def _int(value: object) -> int | None:
    number = _float(value)
    return None if number is None else int(number)


def _float(value: object) -> float | None:
    """A finite number as float (never a bool); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
