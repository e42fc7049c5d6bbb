"""``trainq show ID`` and the messages of ``trainq logs`` for jobs that have no output: run.json in words.

Reads only files (run.json, metrics.jsonl's tail, status.json's entry for the job) and prints plain
lines: where the job is and why, its attempts with times and exits, the diagnosis with its
evidence, progress, and the paths worth opening.
"""

from __future__ import annotations

import time
from pathlib import Path

from trainq.watcher.cli.manage import Found, describe_end, job_exit_status
from trainq.watcher.faces.html import format_eta, format_number
from trainq.watcher.faces.story import REASONS, JobStory, end_words, load
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.fsutil import read_json
from trainq.watcher.spec.units import parse_iso

#: files and folders of a job folder worth naming, in the order ``show`` lists them
_PATHS = (
    "job.yaml",
    "run.json",
    "output.log",
    "metrics.jsonl",
    "checkpoints",
    "adapter",
    "model",
    "summary.json",
    "loss.png",
    "hook.log",
)


def show_lines(root: Path, found: Found, now: float | None = None) -> list[str]:
    """Everything ``trainq show`` prints for one job."""
    now = time.time() if now is None else now
    run = found.run
    story = job_story(root, found)
    lines = [
        headline(found, run),
        *_story(story),
        *_times(run, now),
        *_waiting(root, found, run),
        *_errors(run),
        *_diagnosis(story),
        *_rerun(root, found, run),
        *_attempts(run, now),
        *_progress(story, JobPaths(found.path)),
        *_paths(found),
    ]
    return lines


def job_story(root: Path, found: Found) -> JobStory:
    """The job's story (faces/story.py): status.json's where the watcher lists it, else from its folder."""
    return load(found.path, found.state, found.run, status_entry(root, found.id))


def _story(story: JobStory) -> list[str]:
    """The story's line (how it ended, or why it stops) and, for a retry, how the attempt before it ended."""
    lines = []
    if story.headline and story.state != "pending":  # a pending job's words are its waiting_for, shown below
        lines.append(f"  {story.headline}")
    if story.previous:
        lines.append(f"  attempt {story.attempt} {'running' if story.state == 'running' else 'next'}; {story.previous}")
    lines += [f"  note: {note.words()}" for note in story.notes]
    return lines


def _rerun(root: Path, found: Found, run: dict) -> list[str]:
    if found.state != "failed":
        return []
    from trainq.watcher.cli.again import rerun_line
    from trainq.watcher.spec.errors import InvalidJobSpec
    from trainq.watcher.spec.jobspec import load_job_file

    try:
        spec = load_job_file(found.path / "job.yaml")
    except (InvalidJobSpec, OSError):
        spec = None
    line = rerun_line(root, found.id, found.path, run, spec)
    return [line] if line else []


def headline(found: Found, run: dict) -> str:
    name = run.get("name")
    label = found.id if not name or name == found.id else f"{found.id} ({name})"
    status = run.get("status") or found.state
    extra = ""
    if found.state in ("done", "failed"):
        extra = f", exit status {job_exit_status(found)}"
    prio = f", priority {run.get('priority')}" if run.get("priority") else ""
    return f"job {label}: {status}{extra} — in {found.state}/{found.id}{prio}"


def _clock(iso: str | None) -> str:
    at = parse_iso(iso)
    return "–" if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def _span(start: str | None, end: str | None, now: float) -> str:
    a, b = parse_iso(start), parse_iso(end)
    if a is None:
        return ""
    return format_eta((b if b is not None else now) - a)


def _times(run: dict, now: float) -> list[str]:
    parts = [f"submitted {_clock(run.get('submitted_at'))}"]
    if run.get("started_at"):
        parts.append(f"started {_clock(run.get('started_at'))}")
    if run.get("finished_at"):
        parts.append(f"finished {_clock(run.get('finished_at'))}")
    span = _span(run.get("started_at"), run.get("finished_at"), now)
    if span:
        parts.append(f"{'took' if run.get('finished_at') else 'running for'} {span}")
    return ["  " + " · ".join(parts)]


def _waiting(root: Path, found: Found, run: dict) -> list[str]:
    if found.state != "pending":
        return []
    entry = status_entry(root, found.id) or {}
    why = entry.get("waiting_for") or run.get("waiting_for")
    if (root / "pause.flag").exists():
        why = "the queue is paused (pause.flag; `trainq resume`)" + (f"; then: {why}" if why else "")
    return [f"  waiting for: {why or 'its turn (the watcher plans pending jobs every few seconds)'}"]


def _errors(run: dict) -> list[str]:
    if run.get("status") != "rejected":
        return [f"  error: {run['error']}"] if run.get("error") and not run.get("diagnosis") else []
    errors = run.get("errors") or []
    lines = ["  rejected: the job file is invalid, so it never ran. Fix these (trainq edit ID), and it runs:"]
    for problem in errors:
        where = f"{problem.get('path')}: " if problem.get("path") else ""
        lines.append(f"    {where}{problem.get('message')}")
    if not errors and run.get("error"):
        lines.append(f"    {run['error']}")
    return lines


def _diagnosis(story: JobStory) -> list[str]:
    """The ended attempt's diagnosis: kind, evidence, and the advice fitted to where the job is now."""
    diagnosis = story.diagnosis or {}
    if not diagnosis:
        return []
    lines = [f"  diagnosis: {diagnosis.get('kind')}"]
    for i, line in enumerate(story.evidence.splitlines() or ["–"]):
        lines.append(f"    {'evidence: ' if i == 0 else '          '}{line}")
    if story.advice:
        lines.append(f"    advice: {story.advice}")
    return lines


#: attempts ``show`` lists one line each (the latest); older ones are counted on one line
SHOWN_ATTEMPTS = 20


def _attempts(run: dict, now: float) -> list[str]:
    attempts = [a for a in run.get("attempts") or [] if isinstance(a, dict)]
    if not attempts:
        return []
    total = max(int(run.get("attempt") or 0), len(attempts))
    lines = [f"  attempts ({total}):"]
    earlier = total - min(len(attempts), SHOWN_ATTEMPTS)
    if earlier > 0:
        lines.append(f"    {_earlier_words(run, attempts[: len(attempts) - SHOWN_ATTEMPTS], earlier)}")
    for a in attempts[-SHOWN_ATTEMPTS:]:
        if a.get("ended_at"):
            end = f"ended {_clock(a.get('ended_at'))} after {_span(a.get('started_at'), a.get('ended_at'), now)}"
        else:
            end = f"running for {_span(a.get('started_at'), None, now)}"
        how = _exit_words(a)
        extra = [
            f"gpus {','.join(map(str, a['gpus']))}" if a.get("gpus") else "",
            f"resumed from {a['resumed_from']}" if a.get("resumed_from") else "",
            f"slurm job {a['slurm_job_id']}" if a.get("slurm_job_id") else "",
        ]
        tail = " · ".join(x for x in [how, *extra] if x)
        lines.append(f"    #{a.get('n')} started {_clock(a.get('started_at'))}, {end}" + (f" · {tail}" if tail else ""))
    return lines


def _earlier_words(run: dict, listed: list[dict], count: int) -> str:
    """One line for the attempts not listed: how they ended, from run.json's ``attempts_earlier`` and the rest."""
    from trainq.watcher.daemon.jobs import fold_attempts

    folded: dict = {"attempts_earlier": dict(run.get("attempts_earlier") or {}), "attempts": [*listed, {}]}
    fold_attempts(folded, keep=1)  # the kept-but-unlisted ones counted the same way as the folded ones
    e = folded["attempts_earlier"]
    ends = [f"exit {code} ×{n}" for code, n in sorted((e.get("exit_codes") or {}).items(), key=lambda kv: -kv[1])]
    ends += [f"{sig} ×{n}" for sig, n in sorted((e.get("signals") or {}).items(), key=lambda kv: -kv[1])]
    words = f"… {count} earlier attempt{'s' if count != 1 else ''}"
    if e.get("checkpoint_exits"):
        words += f", {e['checkpoint_exits']} of them checkpoint exits"
    if ends:
        words += ": " + ", ".join(ends[:6])
    if e.get("runtime_s"):
        words += f"; {format_eta(e['runtime_s'])} in all"
    return words


def _exit_words(attempt: dict) -> str:
    stop = f" ({end_words('', attempt['reason'], None)})" if attempt.get("reason") in REASONS else ""
    if attempt.get("signal"):
        return f"killed by {attempt.get('signal_name') or 'signal ' + str(attempt['signal'])}{stop}"
    if attempt.get("exit_code") is not None:
        return f"exit {attempt['exit_code']}{stop}"
    return ""


def _progress(story: JobStory, paths: JobPaths) -> list[str]:
    """The last step's figures; a finished train job adds the whole run's rate from summary.json (evaluations and
    checkpoints included), so the two throughputs a user sees are told apart."""
    last = story.progress or {}
    parts = []
    if last.get("step") is not None:
        total = f"/{last['total_steps']}" if last.get("total_steps") else ""
        parts.append(f"step {last['step']}{total}")
    if last.get("loss") is not None:
        parts.append(f"loss {format_number(last['loss'])}")
    if last.get("eval_loss") is not None:
        parts.append(f"eval loss {format_number(last['eval_loss'])}")
    if last.get("tokens_per_s") is not None:
        parts.append(f"{format_number(last['tokens_per_s'])} tok/s stepping")
    whole = (read_json(paths.summary) or {}).get("tokens_per_s") if story.state in ("done", "failed") else None
    if isinstance(whole, (int, float)):
        parts.append(f"{format_number(whole)} tok/s over the run (summary.json)")
    return ["  progress: " + " · ".join(parts)] if parts else []


def _paths(found: Found) -> list[str]:
    present = [name + ("/" if (found.path / name).is_dir() else "") for name in _PATHS if (found.path / name).exists()]
    return (
        [f"  folder: {found.path.resolve()}", "  files: " + " ".join(present)]
        if present
        else [f"  folder: {found.path.resolve()}"]
    )


def status_entry(root: Path, job_id: str) -> dict | None:
    """The job's entry in status.json, if the watcher lists it."""
    status = read_json(root / "status.json") or {}
    return next((j for j in status.get("jobs") or () if j.get("id") == job_id), None)


def no_output_words(root: Path, found: Found) -> str | None:
    """Why ``trainq logs`` has nothing to print for a job without output.log, or None when it has one."""
    if JobPaths(found.path).log.exists():
        return None
    run = found.run
    if run.get("status") == "rejected":
        return "\n".join([headline(found, run), *_errors(run)])
    if found.state == "pending":
        return "\n".join(
            [f"job {found.id} is pending: it has not started, so it has no output yet.", *_waiting(root, found, run)]
        )
    if found.state in ("done", "failed"):
        return f"job {found.id}: {describe_end(found)}; it wrote no output.log"
    return None
