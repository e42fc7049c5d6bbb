"""`trainq status`: status.json drawn for a terminal with rich (the twin of status.html)."""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.padding import Padding
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from trainq.watcher.fsutil import read_json
from trainq.watcher.html import STALE_HEARTBEAT_S, format_eta, format_number
from trainq.watcher.units import parse_iso
from trainq.watcher.text import printable_tree
from trainq.watcher.sweepview import sweep_lines

logger = logging.getLogger(__name__)

#: how often --follow re-reads status.json (the watcher rewrites it at most every status_s, default 1 s)
FOLLOW_EVERY_S = 1.0
_COUNT_KEYS = ("inbox", "awaiting_approval", "pending", "running", "done", "failed")
_STATUS_STYLE = {"done": "green", "failed": "red", "timeout": "red", "rejected": "red", "cancelled": "yellow"}


def missing_message(status_path: Path) -> str:
    """The one line shown when no watcher has written status.json."""
    return f"no watcher has written {status_path} yet — start one with `trainq watch`"


def _jobs(snapshot: dict, *states: str) -> list[dict]:
    return [j for j in snapshot.get("jobs") or () if j.get("state") in states]


def _label(job: dict) -> Text:
    name, job_id = job.get("name"), str(job.get("id"))
    text = Text(str(name) if name else job_id, style="bold")
    if name and name != job_id:
        text.append(f" ({job_id})", style="dim")
    return text


def _sub(text: Text) -> Padding:
    """A detail line under a job, indented two columns on every line it wraps to."""
    return Padding(text, (0, 0, 0, 2), expand=False)


def _age_s(iso: str | None, now: float) -> float | None:
    at = parse_iso(iso)
    return None if at is None else max(0.0, now - at)


def _header(snapshot: dict, now: float) -> Text:
    w = snapshot.get("watcher") or {}
    text = Text("trainq ", style="bold")
    text.append(f"{w.get('host')} · pid {w.get('pid')} · ")
    text.append(str(w.get("state")), style={"running": "green", "paused": "yellow"}.get(w.get("state"), "red"))
    age = _age_s(w.get("heartbeat_at"), now)
    if age is not None and age > STALE_HEARTBEAT_S:
        text.append(f"\nwatcher not responding: last heartbeat {format_eta(age)} ago — is `trainq watch` running?",
                    style="bold red")
    elif age is not None:
        text.append(f" · heartbeat {format_eta(age)} ago", style="dim")
    for problem in w.get("problems") or ():
        text.append(f"\n{problem}", style="bold red")
    return text


def _counts(snapshot: dict) -> Text:
    counts = snapshot.get("counts") or {}
    parts = [f"{key.replace('_', ' ')} {counts.get(key, 0)}" for key in _COUNT_KEYS]
    return Text(" · ".join(parts), style="cyan")


def _bar(progress: dict, width: int) -> Table:
    step, total = progress.get("step"), progress.get("total_steps")
    row = Table.grid(padding=(0, 1))
    if step is None or not total:
        row.add_row(Text(f"step {step if step is not None else '–'}"))
        return row
    bar_width = max(10, width - 32)
    pct = 100.0 * min(step, total) / total
    row.add_row(ProgressBar(total=total, completed=min(step, total), width=bar_width),
                Text(f"{step}/{total} {pct:3.0f}%"))
    return row


def _running_job(job: dict, width: int) -> Group:
    progress = job.get("progress") or {}
    health = job.get("health") or job.get("status")
    title = _label(job)
    title.append(f"  {health}", style="green" if health == "healthy" else "yellow")
    title.append(f"  attempt {job.get('attempt')}", style="dim")
    facts = Text(
        f"loss {format_number(progress.get('loss'))} · eval {format_number(progress.get('eval_loss'))}"
        f" · {format_number(progress.get('tokens_per_s'))} tok/s · ETA {format_eta(progress.get('eta_s'))}"
    )
    return Group(title, _sub(_bar(progress, width)), _sub(facts))


def _section(title: str, count: int) -> Text:
    return Text(f"\n{title} ({count})", style="bold underline")


def _running(snapshot: dict, width: int) -> list[RenderableType]:
    jobs = _jobs(snapshot, "running")
    body: list[RenderableType] = [_running_job(j, width) for j in jobs] or [Text("  no job is running", style="dim")]
    return [_section("Running", len(jobs)), *body]


def _pending(snapshot: dict) -> list[RenderableType]:
    jobs = _jobs(snapshot, "pending")
    lines: list[RenderableType] = []
    for job in jobs:
        line = _label(job)
        line.append(f"  prio {job.get('priority')}", style="dim")
        lines.append(line)
        if job.get("waiting_for"):
            lines.append(_sub(Text(f"waiting for: {job['waiting_for']}", style="yellow")))
    return [_section("Pending", len(jobs)), *(lines or [Text("  nothing is waiting", style="dim")])]


def _awaiting(snapshot: dict) -> list[RenderableType]:
    jobs = _jobs(snapshot, "awaiting_approval")
    if not jobs:
        return []
    lines = [Text.assemble(_label(j), (f"  {j.get('dir')}: set approved: true to submit", "dim")) for j in jobs]
    return [_section("Awaiting approval", len(jobs)), *lines]


def _finished_job(job: dict) -> Group:
    status = str(job.get("status"))
    line = Text.assemble(_label(job), "  ", (status, _STATUS_STYLE.get(status, "")))
    details: list[RenderableType] = []
    diagnosis = job.get("diagnosis") or {}
    if diagnosis:
        line.append(f" ({diagnosis.get('kind')})", style="red")
        details.append(_sub(Text(f"advice: {diagnosis.get('advice')}")))
    if job.get("error") and not diagnosis:
        details.append(_sub(Text(f"error: {job['error']}", style="red")))
    loss_png = (job.get("outputs") or {}).get("loss_png")
    if loss_png:
        details.append(_sub(Text(f"loss plot: {loss_png}", style="dim")))
    return Group(line, *details)


def _finished(snapshot: dict) -> list[RenderableType]:
    jobs = _jobs(snapshot, "done", "failed")
    body = [_finished_job(j) for j in jobs] or [Text("  no job has finished yet", style="dim")]
    return [_section("Recently finished", len(jobs)), *body]


def _gpu_line(gpu: dict) -> Padding:
    text = Text(f"GPU {gpu.get('index')} {gpu.get('name')}", style="bold")
    parts = [f"{format_number(gpu.get('memory_used_mb'), 6)}/{format_number(gpu.get('memory_total_mb'), 6)} MB"]
    if gpu.get("utilization_pct") is not None:
        parts.append(f"{format_number(gpu['utilization_pct'])}% busy")
    if gpu.get("temperature_c") is not None:
        parts.append(f"{format_number(gpu['temperature_c'])}°C")
    parts.append(f"held by {gpu['held_by']}" if gpu.get("held_by") else "free")
    text.append("  " + " · ".join(parts))
    if gpu.get("foreign"):
        text.append(f" · {len(gpu['foreign'])} foreign process(es)", style="yellow")
    return _sub(text)


def _machine(snapshot: dict) -> list[RenderableType]:
    res = snapshot.get("resources") or {}
    ram = res.get("ram") or {}
    lines: list[RenderableType] = [_sub(Text(
        f"RAM {format_number(ram.get('available_gb'), 3)}/{format_number(ram.get('total_gb'), 3)} GB free"
    ))]
    lines += [_gpu_line(g) for g in res.get("gpus") or ()]
    return [Text("\nMachine", style="bold underline"), *lines]


def render_status(snapshot: dict, width: int = 80, now: float | None = None) -> RenderableType:
    """The whole status as one rich renderable: header, counts, running, pending, awaiting, finished, machine."""
    now = time.time() if now is None else now
    snapshot = printable_tree(snapshot)  # names, ids and errors come from job files: no terminal escapes
    return Group(
        _header(snapshot, now), _counts(snapshot), *_running(snapshot, width), *_pending(snapshot),
        *_awaiting(snapshot), *_finished(snapshot), *_sweeps(snapshot), *_machine(snapshot),
    )


def _sweeps(snapshot: dict) -> list[RenderableType]:
    lines = sweep_lines(list(snapshot.get("jobs") or ()))
    return [Text("\nSweeps", style="bold underline"), *(Text("  " + line) for line in lines)] if lines else []


def _view(snapshot: dict | None, status_path: Path, width: int) -> RenderableType:
    return Text(missing_message(status_path)) if snapshot is None else render_status(snapshot, width)


def print_status(status_path: Path, follow: bool = False, json_out: bool = False) -> int:
    """Print status.json (as JSON, once, or redrawn until Ctrl-C); 1 when no watcher has written it yet."""
    status_path = Path(status_path)
    if json_out:
        return _print_json(status_path)
    console = Console()
    if follow:
        return _follow(status_path, console)
    snapshot = read_json(status_path)
    if snapshot is None:
        print(missing_message(status_path), file=sys.stderr)
        return 1
    console.print(render_status(snapshot, console.width))
    return 0


def _print_json(status_path: Path) -> int:
    try:
        sys.stdout.write(status_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        print(missing_message(status_path), file=sys.stderr)
        return 1
    return 0


def _follow(status_path: Path, console: Console) -> int:
    snapshot = read_json(status_path)
    try:
        with Live(_view(snapshot, status_path, console.width), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(FOLLOW_EVERY_S)
                # keep the last good picture if the file vanished for a moment (queue moved, disk hiccup)
                snapshot = read_json(status_path) or snapshot
                live.update(_view(snapshot, status_path, console.width), refresh=True)
    except KeyboardInterrupt:
        return 0
