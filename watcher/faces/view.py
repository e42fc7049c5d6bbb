"""`trainq status`: status.json drawn for a terminal with rich (the twin of status.html).

One line a job, so 30 jobs take 30 lines: id, state, progress, loss, ETA or elapsed, GPU and the
reason (why it waits, or a failure's diagnosis kind with its evidence line). Wider terminals also
get start and end times; ``--wide`` adds every column and wraps the reason with its advice.
``--follow`` fits the table to the terminal's height and says how many rows it hid.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.cells import cell_len
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.padding import Padding
from rich.text import Text

from trainq.watcher.faces.html import format_eta, format_number, wall_line
from trainq.watcher.faces.liveness import (
    ALIVE,
    BY_CLOCK,
    DEAD,
    WATCHING,
    Liveness,
    by_clock,
    check,
    clock_words,
    dead_words,
    offset_words,
    watch_for,
)
from trainq.watcher.faces.story import JobStory, from_entry, short_evidence
from trainq.watcher.faces.sweepview import sweep_lines
from trainq.watcher.spec.fsutil import read_json
from trainq.watcher.spec.text import printable_tree
from trainq.watcher.spec.units import parse_iso

logger = logging.getLogger(__name__)

#: how often --follow re-reads status.json (the watcher rewrites it at most every status_s, default 1 s)
FOLLOW_EVERY_S = 1.0
#: how long `trainq status` waits for a watcher that has just started to write status.json (seconds)
STARTUP_WAIT_S = 5.0
#: from this terminal width on, the compact table also shows start and end times
TIMES_FROM_COLUMNS = 130
_COUNT_KEYS = ("inbox", "awaiting_approval", "pending", "running", "done", "failed")
_STATE_STYLE = {
    "running": "green",
    "done": "green",
    "failed": "red",
    "timeout": "red",
    "rejected": "red",
    "cancelled": "yellow",
    "stopping": "yellow",
    "pending": "cyan",
    "awaiting": "magenta",
}
#: the order rows are drawn in, by state
_ROW_ORDER = {"running": 0, "pending": 1, "awaiting_approval": 2, "failed": 3, "done": 3}
#: which rows --follow hides first when the terminal is too short (highest first): done, then pending
_HIDE_ORDER: dict[str | None, int] = {"done": 4, "pending": 3, "awaiting_approval": 2, "failed": 1, "running": 0}
_STATE_ALIASES = {"awaiting": "awaiting_approval", "finished": "done,failed"}


@dataclass(frozen=True)
class Filters:
    """Which jobs to show: states/statuses (comma-separated), a sweep id, a glob on id or name."""

    states: str | None = None
    sweep: str | None = None
    pattern: str | None = None

    def wanted_states(self) -> set[str]:
        words = ",".join(_STATE_ALIASES.get(w.strip(), w.strip()) for w in (self.states or "").split(","))
        return {w for w in words.split(",") if w}

    def match(self, job: dict) -> bool:
        states = self.wanted_states()
        if states and job.get("state") not in states and job.get("status") not in states:
            return False
        if self.sweep and job.get("sweep") != self.sweep:
            return False
        return not (
            self.pattern and not any(fnmatch.fnmatchcase(str(job.get(k) or ""), self.pattern) for k in ("id", "name"))
        )

    @property
    def active(self) -> bool:
        return bool(self.states or self.sweep or self.pattern)


def missing_message(status_path: Path) -> str:
    """The one line shown when no watcher has written status.json."""
    return f"no watcher has written {status_path} yet — start one with `trainq watch`"


def _age_s(iso: str | None, now: float) -> float | None:
    at = parse_iso(iso)
    return None if at is None else max(0.0, now - at)


_WATCHER_STATE_STYLE: dict[str | None, str] = {"running": "green", "paused": "yellow"}


def _header(snapshot: dict, live: Liveness) -> Text:
    w = snapshot.get("watcher") or {}
    text = Text("trainq ", style="bold", no_wrap=True, overflow="ellipsis")
    text.append(f"{w.get('host')} · pid {w.get('pid')} · ")
    text.append(str(w.get("state")), style=_WATCHER_STATE_STYLE.get(w.get("state"), "red"))
    _heartbeat(text, live)
    for problem in w.get("problems") or ():
        text.append(f"\n{problem}", style="bold red")
    line = wall_line(snapshot)
    if line:
        text.append(f"\n{line}", style="bold magenta" if (snapshot.get("window") or {}).get("misses") else "magenta")
    return text


def _heartbeat(text: Text, live: Liveness) -> None:
    """The heartbeat's age, or why the watcher looks dead, in the words of what was measured (liveness.py)."""
    if live.verdict == DEAD:
        text.append(
            f"\nwatcher not responding: {dead_words(live, format_eta)} — is `trainq watch` running?", style="bold red"
        )
    elif live.verdict == ALIVE and live.how == BY_CLOCK:
        text.append(f" · heartbeat {format_eta(max(0.0, live.clock_age_s or 0.0))} ago", style="dim")
    elif live.verdict == ALIVE:
        text.append(f" · heartbeat {format_eta(live.changed_ago_s)} ago (seen changing from here)", style="dim")
    elif live.verdict == WATCHING:
        text.append(
            f" · heartbeat {clock_words(live.clock_age_s or 0.0, format_eta)} by this machine's clock: "
            "watching whether it changes",
            style="yellow",
        )
    offset = offset_words(live, format_eta)
    if offset:
        text.append(f"\n{offset}", style="yellow")


def _counts(snapshot: dict) -> Text:
    counts = snapshot.get("counts") or {}
    parts = [f"{key.replace('_approval', '')} {counts.get(key, 0)}" for key in _COUNT_KEYS]
    return Text(" · ".join(parts), style="cyan", no_wrap=True, overflow="ellipsis")


def _ignored(snapshot: dict) -> list[Text]:
    ignored = snapshot.get("ignored") or []
    if not ignored:
        return []
    names = ", ".join(f"{e.get('name')}/" if "folder" in str(e.get("reason")) else str(e.get("name")) for e in ignored)
    return [
        Text(
            f"inbox ignores {len(ignored)} (not job files): {names}", style="yellow", overflow="ellipsis", no_wrap=True
        )
    ]


# -- one row per job ----------------------------------------------------------------------------------------
def _state_word(job: dict) -> str:
    if job.get("state") == "running" and job.get("health") == "stalled":
        return "stalled"
    return from_entry(job).state_word if job.get("state") else str(job.get("status"))


def _progress(job: dict, percent: bool = True) -> str:
    p = job.get("progress") or {}
    step, total = p.get("step"), p.get("total_steps")
    if step is None:
        return "–"
    if not total:
        return f"step {step}"
    return f"{step}/{total} {100.0 * min(step, total) / total:.0f}%" if percent else f"{step}/{total}"


def _dur(seconds: float | None) -> str:
    """format_eta without spaces: 42s, 6m25s, 2h03m."""
    return format_eta(seconds).replace(" ", "")


def _loss(job: dict) -> str:
    p = job.get("progress") or {}
    return short_number(p.get("loss"), _CAPS["LOSS"]) if p.get("loss") is not None else "–"


def short_number(value: object, width: int) -> str:
    """A metric in at most ``width`` characters without losing its magnitude: 2.134, 0.0012, 8.3e-5, 1.2e6.

    Cutting ``8.344e-05`` to the column would show ``8.344…``, a loss 100,000 times too big.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return format_number(value, 4)
    for digits in (4, 3, 2):
        text = f"{value:.{digits}g}"
        if len(text) <= width and "e" not in text:
            return text
    mantissa, _, exponent = f"{value:.{max(0, width - 5)}e}".partition("e")
    compact = f"{mantissa}e{int(exponent)}"
    while len(compact) > width and "." in mantissa:  # drop mantissa digits before the exponent
        mantissa = mantissa[:-1].rstrip(".")
        compact = f"{mantissa}e{int(exponent)}"
    return compact


def _time(job: dict, now: float) -> str:
    """ETA for a running job (elapsed when unknown); how long a finished one took; how long a pending one waits."""
    state = job.get("state")
    if state == "running":
        eta = (job.get("progress") or {}).get("eta_s")
        if eta is not None:
            return f"ETA {_dur(eta)}"
        return f"+{_dur(_age_s(job.get('started_at'), now))}" if job.get("started_at") else "–"
    if state in ("done", "failed"):
        start, end = parse_iso(job.get("started_at")), parse_iso(job.get("finished_at"))
        return _dur(end - start) if start is not None and end is not None else "–"
    if state == "pending" and job.get("submitted_at"):
        return f"+{_dur(_age_s(job.get('submitted_at'), now))}"
    return "–"


def _clock(iso: str | None, now: float) -> str:
    at = parse_iso(iso)
    if at is None:
        return "–"
    local = time.localtime(at)
    same_day = time.localtime(now)[:3] == local[:3]
    return time.strftime("%H:%M:%S" if same_day else "%b %d %H:%M", local)


def _gpus(job: dict) -> str:
    gpus = job.get("gpus") or []
    return ",".join(map(str, gpus)) if gpus else "–"


def _reason(job: dict, wide: bool) -> Text:
    """The job's story in a cell: why it waits, what it does, or how it ended (kind: evidence); --wide adds
    the advice. The words are the story's (faces/story.py); this only picks the style and the length."""
    story = from_entry(job)
    state = story.state
    if story.diagnosis:
        text = Text(f"{story.diagnosis.get('kind')}: ", style="bold red")
        text.append((story.evidence.strip().replace("\\n", "\n") or "–") if wide else short_evidence(story.evidence))
        if wide and story.advice:
            text.append(f"\nadvice: {story.advice}", style="dim")
        return text
    if state in ("done", "failed") and story.status != "done":
        words = story.headline
        if story.status == "rejected" and not wide:  # the file is known: the row's id
            words = words.split(": ", 1)[-1]
        return Text(words, style="yellow" if story.reason or story.status == "cancelled" else "red")
    if state == "pending":
        return Text(story.headline, style="yellow")
    if state == "awaiting_approval":
        return Text(str(job.get("approval_hint") or f"set approved: true in {job.get('dir')}"), style="magenta")
    if state == "running" and job.get("waiting_for"):  # launched, not started yet (queued in Slurm)
        return Text(str(job["waiting_for"]), style="yellow")
    if state == "running":
        return Text(" · ".join(_running_parts(job, story)))
    outputs = job.get("outputs") or {}
    if state == "done":
        p = story.progress or {}
        parts = [f"eval {format_number(p['eval_loss'])}"] if p.get("eval_loss") is not None else []
        if outputs.get("loss_png"):
            parts.append(f"loss plot: {outputs['loss_png']}")
        return Text(" · ".join(parts), style="dim")
    return Text("")


def _running_parts(job: dict, story: JobStory) -> list[str]:
    """A running job: its attempt when it is a retry, what it does (or why it stops), the notes that hold."""
    p = story.progress or {}
    parts = [f"attempt {story.attempt}"] if story.previous else []
    parts.append(story.headline or str(job.get("health") or story.status))
    if job.get("fits") is False:
        parts.append(f"MISSES its wall: {job.get('forecast')}")
    if job.get("vitals"):
        parts.append(f"health: {job['vitals']}")
    parts += [note.text for note in story.notes if note.kind == "health"]
    if p.get("tokens_per_s") is not None:
        parts.append(f"{format_number(p['tokens_per_s'])} tok/s")
    if p.get("eval_loss") is not None:
        parts.append(f"eval {format_number(p['eval_loss'])}")
    return parts


def _previous(job: dict) -> Text | None:
    """The line below a retry's row: how its previous attempt ended."""
    previous = from_entry(job).previous
    return Text(f"  ↳ {previous}", style="dim", no_wrap=True, overflow="ellipsis") if previous else None


#: widest each short column may get (characters); the reason gets what is left
_CAPS = {"ID": 24, "NAME": 24, "STATE": 9, "PROGRESS": 11, "LOSS": 6, "TIME": 10, "STARTED": 12, "ENDED": 12, "GPU": 5}
#: the columns shrunk first when the terminal is narrow, each down to its floor
_SHRINK = (("ID", 16), ("ID", 12), ("PROGRESS", 8), ("TIME", 7), ("STATE", 7), ("NAME", 8), ("ID", 8))
#: share of the width the reason keeps before the other columns shrink
_REASON_SHARE = 0.36
#: ... but no more than this many columns (wider terminals give it the rest anyway)
_REASON_ENOUGH = 36


def _cells(job: dict, now: float, wide: bool, times: bool) -> dict[str, Text]:
    state = _state_word(job)
    cells = {"ID": Text(str(job.get("id")))}
    if wide:
        cells.update(
            NAME=Text(str(job.get("name") or "")),
            PRIO=Text(str(job.get("priority") or 0)),
            TRY=Text(str(job.get("attempt") or 0)),
        )
    cells.update(
        STATE=Text(state, style=_STATE_STYLE.get(state, "")),
        PROGRESS=Text(_progress(job, times)),
        LOSS=Text(_loss(job)),
        TIME=Text(_time(job, now)),
    )
    if times:
        cells.update(STARTED=Text(_clock(job.get("started_at"), now)), ENDED=Text(_clock(job.get("finished_at"), now)))
    cells.update(GPU=Text(_gpus(job)), REASON=_reason(job, wide))
    return cells


def _widths(rows: list[dict[str, Text]], width: int, wide: bool) -> dict[str, int]:
    """Each short column as wide as its content (capped); narrow terminals shrink them so REASON keeps a share."""
    names = [n for n in rows[0] if n != "REASON"]
    widths = {n: min(max(cell_len(n), *(r[n].cell_len for r in rows)), _CAPS.get(n, 99)) for n in names}
    if wide:
        return widths
    over = sum(widths.values()) + len(names) + min(int(width * _REASON_SHARE), _REASON_ENOUGH) - width
    for name, floor in _SHRINK:
        if over <= 0:
            break
        cut = min(over, max(0, widths.get(name, floor) - floor))
        if name in widths:
            widths[name] -= cut
            over -= cut
    widths["REASON"] = max(4, width - sum(widths.values()) - len(names))
    return widths


def _line(cells: dict[str, Text], widths: dict[str, int]) -> Text:
    """One row: every cell cut (…) or padded to its column's width, one space between columns."""
    line = Text(no_wrap=True, overflow="ellipsis")
    for i, (name, cell) in enumerate(cells.items()):
        if name not in widths:
            continue
        cell = cell.copy()
        cell.truncate(widths[name], overflow="ellipsis", pad=name not in ("REASON", "LOSS"))
        if name == "LOSS":
            cell.pad_left(widths[name] - cell.cell_len)
        line.append_text(Text(" ") if i else Text())
        line.append_text(cell)
    line.rstrip()
    return line


def _table(jobs: list[dict], width: int, now: float, wide: bool) -> list[RenderableType]:
    """The header line and one line per job; with ``wide``, each job's reason (evidence, advice) below it."""
    times = wide or width >= TIMES_FROM_COLUMNS
    rows = [_cells(job, now, wide, times) for job in jobs]
    widths = _widths(rows, width - 1, wide)
    if wide:
        widths.pop("REASON", None)
    header = _line({n: Text(n) for n in rows[0]}, widths)
    header.stylize("bold")
    lines: list[RenderableType] = [header]
    for job, row in zip(jobs, rows, strict=True):
        lines.append(_line(row, widths))
        if wide and row["REASON"].plain:
            lines.append(Padding(row["REASON"], (0, 0, 0, 4)))
        previous = _previous(job)
        if previous is not None:
            lines.append(previous)
    return lines


def _rows(snapshot: dict, filters: Filters) -> list[dict]:
    jobs = [j for j in snapshot.get("jobs") or () if filters.match(j)]
    order = {id(j): i for i, j in enumerate(jobs)}  # within a state, status.json's order (next / latest first)
    return sorted(jobs, key=lambda j: (_ROW_ORDER.get(j.get("state"), 9), order[id(j)]))


def fit_rows(rows: list[dict], room: int) -> tuple[list[dict], list[dict]]:
    """(shown, hidden): at most ``room`` rows, hiding done jobs first, then pending, awaiting, failed, running."""
    if len(rows) <= room:
        return rows, []
    ranked = sorted(range(len(rows)), key=lambda i: (_HIDE_ORDER.get(rows[i].get("state"), 5), i), reverse=True)
    hide = set(ranked[: len(rows) - max(0, room)])
    return [r for i, r in enumerate(rows) if i not in hide], [r for i, r in enumerate(rows) if i in hide]


def _hidden_line(hidden: list[dict]) -> Text:
    by_state: dict[str, int] = {}
    for job in hidden:
        key = _state_word(job)
        by_state[key] = by_state.get(key, 0) + 1
    what = ", ".join(f"{n} {state}" for state, n in by_state.items())
    return Text(
        f"… {len(hidden)} more row(s) hidden ({what}): a taller terminal, --state, --sweep or a GLOB shows them",
        style="dim",
        overflow="ellipsis",
        no_wrap=True,
    )


def _gpu_line(gpu: dict) -> Text:
    text = Text(f"GPU {gpu.get('index')} {gpu.get('name')} ", style="bold", overflow="ellipsis", no_wrap=True)
    parts = [f"{format_number(gpu.get('memory_used_mb'), 6)}/{format_number(gpu.get('memory_total_mb'), 6)} MB"]
    if gpu.get("utilization_pct") is not None:
        parts.append(f"{format_number(gpu['utilization_pct'])}% busy")
    if gpu.get("temperature_c") is not None:
        parts.append(f"{format_number(gpu['temperature_c'])}°C")
    parts.append(f"held by {gpu['held_by']}" if gpu.get("held_by") else "free")
    if gpu.get("foreign"):
        parts.append(f"{len(gpu['foreign'])} foreign process(es)")
    text.append(" · ".join(parts), style="")
    return text


def _machine(snapshot: dict) -> list[Text]:
    res = snapshot.get("resources") or {}
    ram = res.get("ram") or {}
    lines = [
        Text(
            f"RAM {format_number(ram.get('available_gb'), 3)}/{format_number(ram.get('total_gb'), 3)} GB free",
            overflow="ellipsis",
            no_wrap=True,
        )
    ]
    return lines + [_gpu_line(g) for g in res.get("gpus") or ()]


def render_status(
    snapshot: dict,
    width: int = 80,
    now: float | None = None,
    *,
    height: int | None = None,
    wide: bool = False,
    filters: Filters | None = None,
    liveness: Liveness | None = None,
) -> RenderableType:
    """The whole status: header, counts, one row per job, machine; fitted to ``height`` lines when given.

    ``liveness``: the reader's verdict on the watcher (liveness.check); without one, this machine's clock judges.
    Once watching measured how far this clock is off the watcher's, job times are taken by the watcher's clock.
    """
    now = time.time() if now is None else now
    snapshot = printable_tree(snapshot)  # names, ids and errors come from job files: no terminal escapes
    filters = filters or Filters()
    live = liveness or by_clock(snapshot.get("watcher") or {}, now)
    head: list[RenderableType] = [_header(snapshot, live), _counts(snapshot), *_ignored(snapshot)]
    if offset_words(live, format_eta) and live.offset_s is not None:
        now -= live.offset_s  # started_at, submitted_at, … are the watcher's clock too
    machine = _machine(snapshot)
    rows = _rows(snapshot, filters)
    hidden: list[dict] = []
    if height is not None and not wide:
        fixed = sum(str(t).count("\n") + 1 for t in head) + len(machine) + 1  # + the table's header line
        room = height - fixed - 1  # the last line stays free for the cursor
        room -= sum(1 for r in rows if r.get("state") == "running" and from_entry(r).previous)  # their ↳ lines
        rows, hidden = fit_rows(rows, room if len(rows) <= room else room - 1)  # - the "hidden" line
    if rows:
        body: list[RenderableType] = _table(rows, width, now, wide)
    else:
        body = [
            Text(
                "no job matches the filters" if filters.active else "no jobs yet: drop a job file into inbox/",
                style="dim",
            )
        ]
    if hidden:
        body.append(_hidden_line(hidden))
    sweeps = _sweeps(snapshot, filters) if height is None or wide or filters.sweep else []
    return Group(*head, *body, *sweeps, *machine)


def _sweeps(snapshot: dict, filters: Filters) -> list[RenderableType]:
    """Each sweep's jobs with their parameters, best eval loss first (left out of --follow unless asked)."""
    jobs = [j for j in snapshot.get("jobs") or () if not filters.sweep or j.get("sweep") == filters.sweep]
    return [Text(line, no_wrap=True, overflow="ellipsis") for line in sweep_lines(jobs)]


def _view(snapshot: dict | None, status_path: Path, console: Console, wide: bool, filters: Filters) -> RenderableType:
    """One --follow frame; the heartbeat's age is what this reader saw of it (liveness.HeartbeatWatch)."""
    if snapshot is None:
        return Text(missing_message(status_path))
    live = watch_for(status_path).observe(snapshot.get("watcher") or {}, time.time(), time.monotonic())
    return render_status(snapshot, console.width, height=console.height, wide=wide, filters=filters, liveness=live)


def read_status(status_path: Path, wait_s: float = STARTUP_WAIT_S) -> dict | None:
    """status.json, waiting up to ``wait_s`` for a watcher that has just started to write it."""
    deadline = time.monotonic() + wait_s
    snapshot = read_json(status_path)
    while snapshot is None and time.monotonic() < deadline and status_path.parent.is_dir():
        time.sleep(0.1)
        snapshot = read_json(status_path)
    return snapshot


def print_status(
    status_path: Path, follow: bool = False, json_out: bool = False, wide: bool = False, filters: Filters | None = None
) -> int:
    """Print status.json (as JSON, once, or redrawn until Ctrl-C); 1 when no watcher has written it yet."""
    status_path = Path(status_path)
    filters = filters or Filters()
    if json_out:
        return _print_json(status_path)
    console = Console()
    if follow:
        return _follow(status_path, console, wide, filters)
    snapshot = read_status(status_path)
    if snapshot is None:
        print(missing_message(status_path), file=sys.stderr)
        return 1
    snapshot, live = check(status_path, snapshot)  # may watch the heartbeat for a few seconds: liveness.py
    console.print(render_status(snapshot, console.width, wide=wide, filters=filters, liveness=live))
    return 0


def _print_json(status_path: Path) -> int:
    if read_status(status_path) is None:
        print(missing_message(status_path), file=sys.stderr)
        return 1
    sys.stdout.write(status_path.read_text(encoding="utf-8"))
    return 0


def _follow(status_path: Path, console: Console, wide: bool, filters: Filters) -> int:
    snapshot = read_json(status_path)
    try:
        with Live(_view(snapshot, status_path, console, wide, filters), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(FOLLOW_EVERY_S)
                # keep the last good picture if the file vanished for a moment (queue moved, disk hiccup)
                snapshot = read_json(status_path) or snapshot
                live.update(_view(snapshot, status_path, console, wide, filters), refresh=True)
    except KeyboardInterrupt:
        return 0
