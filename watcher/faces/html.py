"""status.html: the status snapshot as one self-contained page (inline CSS and SVG, no network), plus loss curves.

``CurveStore`` keeps a downsampled loss curve per job, fed incrementally with the records
``MetricsTail.poll`` reads (``tail.new_records``), so rendering costs the same at step 100 or 100,000.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from html import escape
from operator import itemgetter

from trainq.watcher.faces.liveness import bounds
from trainq.watcher.faces.story import JobStory, from_entry, short_evidence
from trainq.watcher.faces.sweepview import sweep_html
from trainq.watcher.spec.contract import RECORD_EVAL
from trainq.watcher.spec.units import parse_iso

#: most points kept per curve however long the run
MAX_CURVE_POINTS = 300
#: how the static page refreshes itself; `trainq serve` swaps it for live streams (faces/live.py)
REFRESH_META = '<meta http-equiv="refresh" content="2">'


class _Series:
    """One downsampled curve: each point averages a bucket of `stride` raw values; buckets merge as it grows.

    Each finished bucket's SVG text ("step,-value") is formatted once, so drawing costs a join, not a format.
    """

    def __init__(self, max_points: int) -> None:
        self.max_points = max(2, max_points)
        self.stride = 1
        self.buckets: list[list[float]] = []  # [last step, sum, count]
        self.pts: list[tuple[float, float]] = []  # (last step, mean) per bucket
        self.txt: list[str] = []  # SVG coordinates per bucket
        self.acc: list[float] | None = None

    def add(self, step: float, value: float) -> None:
        """Append one (step, value); a step going backwards (resume) drops what came after it."""
        last = self._last_step()
        if last is not None and step < last:
            self._rewind(step)
        acc = self.acc = self.acc or [step, 0.0, 0]
        acc[0], acc[1], acc[2] = step, acc[1] + value, acc[2] + 1
        if acc[2] >= self.stride:
            self._append(acc)
            self.acc = None
            if len(self.buckets) >= self.max_points:
                self._halve()

    def _append(self, bucket: list[float]) -> None:
        point = (bucket[0], bucket[1] / bucket[2])
        self.buckets.append(bucket)
        self.pts.append(point)
        self.txt.append(_svg_xy(point))

    def _last_step(self) -> float | None:
        if self.acc is not None:
            return self.acc[0]
        return self.buckets[-1][0] if self.buckets else None

    def _rewind(self, step: float) -> None:
        self.acc = None
        while self.buckets and self.buckets[-1][0] >= step:
            self.buckets.pop(), self.pts.pop(), self.txt.pop()

    def _halve(self) -> None:
        old = self.buckets
        self.buckets, self.pts, self.txt = [], [], []
        for a, b in zip(old[0::2], old[1::2], strict=False):
            self._append([b[0], a[1] + b[1], a[2] + b[2]])
        if len(old) % 2:
            self._append(old[-1])
        self.stride *= 2

    def points(self) -> list[tuple[float, float]]:
        """(step, mean value) per bucket, the unfinished one included."""
        return [*self.pts, (self.acc[0], self.acc[1] / self.acc[2])] if self.acc else list(self.pts)

    def svg_points(self) -> str:
        """The polyline's points attribute in data coordinates (x = step, y = -value)."""
        if not self.acc:
            return " ".join(self.txt)
        return " ".join([*self.txt, _svg_xy((self.acc[0], self.acc[1] / self.acc[2]))])


def _svg_xy(point: tuple[float, float]) -> str:
    # y is negated so larger losses sit higher once the viewBox maps data coordinates onto the plot
    return f"{point[0]:.10g},{-point[1]:.5g}"


class CurveStore:
    """Downsampled train and eval loss curves per job; the daemon feeds it and drops jobs it no longer shows."""

    def __init__(self, max_points: int = MAX_CURVE_POINTS) -> None:
        self.max_points = max_points
        self._series: dict[str, dict[str, _Series]] = {}

    def feed(self, job_id: str, records: Iterable[dict]) -> None:
        """Add metrics records (as MetricsTail.new_records gives them) to the job's curves."""
        series = self._series.setdefault(job_id, {})
        for record in records:
            step = record.get("step")
            if isinstance(step, bool) or not isinstance(step, (int, float)):
                continue
            if record.get("type") != RECORD_EVAL:
                self._add(series, "loss", step, record.get("loss"))
            self._add(series, "eval_loss", step, record.get("eval_loss"))

    def _add(self, series: dict[str, _Series], key: str, step: float, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        if key not in series:
            series[key] = _Series(self.max_points)
        series[key].add(step, float(value))

    def retain(self, job_ids: Iterable[str]) -> None:
        """Forget every job not in ``job_ids`` (call with the jobs status.json still lists)."""
        keep = set(job_ids)
        for job_id in [j for j in self._series if j not in keep]:
            del self._series[job_id]

    def forget(self, job_id: str) -> None:
        """Drop one job's curves."""
        self._series.pop(job_id, None)

    def curves(self) -> dict[str, dict]:
        """{job_id: {"loss": [(step, value), ...], "eval_loss": [...], "svg": {"loss": "x,y ..."}}} for render_html.

        "svg" holds preformatted polyline points (optional: render_html formats the points without it).
        """
        return {job_id: self._curve(series) for job_id, series in self._series.items()}

    @staticmethod
    def _curve(series: dict[str, _Series]) -> dict:
        curve: dict = {key: s.points() for key, s in series.items()}
        curve["svg"] = {key: s.svg_points() for key, s in series.items()}
        return curve


# -- formatting helpers --------------------------------------------------------------------------


def _e(value: object) -> str:
    """Escaped text for element content and quoted attributes; None shows as a dash."""
    return "–" if value is None else escape(str(value), quote=True)


def wall_line(snapshot: dict) -> str | None:
    """ "window: wall 08:00 UTC · freeze 07:30 · final checkpoint 07:45 · fits a, b · misses c · cost 12.40 USD"."""
    window, cost = snapshot.get("window"), snapshot.get("cost")
    parts = []
    if window:
        clock = lambda iso: str(iso or "")[11:16]  # noqa: E731
        parts.append(
            f"window: wall {clock(window.get('ends_at'))} UTC ({window.get('phase')}) · freeze "
            f"{clock(window.get('freeze_at'))} · final checkpoint {clock(window.get('final_checkpoint_at'))}"
        )
        if window.get("fits"):
            parts.append("fits " + ", ".join(window["fits"]))
        if window.get("misses"):
            parts.append("MISSES " + ", ".join(window["misses"]))
    if cost:
        spent = f"cost {cost.get('total'):.2f} {cost.get('currency')}"
        projected = (window or {}).get("projected_cost")
        parts.append(spent + (f" (by the final checkpoint {projected['total']:.2f})" if projected else ""))
    return " · ".join(parts) or None


def format_eta(seconds: float | None) -> str:
    """42 → '42s', 185 → '3m 05s', 7380 → '2h 03m'; None → '–'."""
    if seconds is None:
        return "–"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def format_number(value: object, digits: int = 4) -> str:
    """Short human form of a metric; None → '–'."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "–" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def _when(iso: object) -> str:
    """A timestamp shortened for reading with its zone (2026-11-29 09:30:00 UTC), the full ISO form in its tooltip."""
    if not iso:
        return "–"
    text = str(iso)
    short = text.replace("T", " ")[:19] + _zone(text)
    return f'<time datetime="{_e(iso)}" title="{_e(iso)}">{_e(short)}</time>'


def _zone(iso: str) -> str:
    """The zone an ISO-8601 time names: `` UTC`` for Z (every time the watcher writes), else its offset."""
    if iso.endswith("Z") or iso.endswith("+00:00"):
        return " UTC"
    tail = iso[19:].lstrip("0123456789.")
    return f" {tail}" if tail else ""


def _label(job: dict) -> str:
    """A job's title: its id (what every command takes), its name beside it when it has another."""
    name, job_id = job.get("name"), job.get("id")
    if name and name != job_id:
        return f'{_e(job_id)} <span class="id">{_e(name)}</span>'
    return _e(job_id)


# -- loss curve ----------------------------------------------------------------------------------


def _bounds(series: dict[str, list]) -> tuple[float, float, float, float]:
    """(first step, last step, lowest, highest value) over the curves; points are in step order."""
    x0 = min(pts[0][0] for pts in series.values())
    x1 = max(pts[-1][0] for pts in series.values())
    lo = min(min(map(itemgetter(1), pts)) for pts in series.values())
    hi = max(max(map(itemgetter(1), pts)) for pts in series.values())
    return x0, x1, lo, hi


def _view_box(x0: float, x1: float, lo: float, hi: float) -> str:
    """The viewBox over steps x0..x1 and values lo..hi (5 % room above and below): it maps data coordinates
    (step, -loss) onto the plot, so points need no per-render scaling."""
    dx, dy = (x1 - x0) or 1.0, (hi - lo) or 1.0
    pad = dy * 0.05
    return f"{x0:.10g} {-hi - pad:.6g} {dx:.10g} {dy + 2 * pad:.6g}"


def _points(pts: list, preformatted: str | None) -> str:
    """A polyline's points attribute."""
    text = preformatted or " ".join(map(_svg_xy, pts))
    # one point (the first eval) is a zero-length line: its round caps draw it as a dot
    return f"{text} {text}" if len(pts) == 1 else text


#: legend text per curve
_CURVE_NAMES = {"loss": "train", "eval_loss": "eval"}


def render_curve(curve: dict | None) -> str:
    """Inline SVG of the train (and eval) loss by step; empty string when there is nothing to draw."""
    curve = curve or {}
    series = {k: curve[k] for k in ("loss", "eval_loss") if curve.get(k)}
    if not series:
        return ""
    x0, x1, lo, hi = _bounds(series)
    view = _view_box(x0, x1, lo, hi)
    svg = curve.get("svg") or {}
    lines = "".join(f'<polyline class="{k}" points="{_points(pts, svg.get(k))}"/>' for k, pts in series.items())
    # a key only for the curves drawn: before the first eval there is no eval line to point at
    keys = "".join(f'<span class="key"><i class="k {k}"></i>{_CURVE_NAMES[k]}</span>' for k in series)
    return (
        f'<svg class="curve" viewBox="{view}" preserveAspectRatio="none" role="img" '
        f'aria-label="loss by step">{lines}</svg>'
        f'<div class="axis"><span>step {format_number(x0)}</span>'
        f"<span>{keys} loss {format_number(lo, 3)}–{format_number(hi, 3)}</span>"
        f"<span>step {format_number(x1)}</span></div>"
    )


#: colours of overlaid curves: matplotlib's tab10, the ones `trainq plot` draws the same jobs in
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def render_overlay(curves_by_job: dict[str, dict | None], title: str) -> str:
    """Inline SVG of several jobs' train loss by step, overlaid, one colour each, with its key; "" with no curve."""
    series = {job_id: c["loss"] for job_id, curve in curves_by_job.items() if (c := curve or {}).get("loss")}
    if not series:
        return ""
    x0, x1, lo, hi = _bounds(series)
    view = _view_box(x0, x1, lo, hi)
    colours = {job_id: PALETTE[i % len(PALETTE)] for i, job_id in enumerate(series)}
    lines = "".join(
        f'<polyline class="overlay" style="stroke:{colours[job_id]}" '
        f'points="{_points(pts, ((curves_by_job[job_id] or {}).get("svg") or {}).get("loss"))}"/>'
        for job_id, pts in series.items()
    )
    keys = "".join(
        f'<span class="key"><i class="k" style="background:{c}"></i>{_e(job_id)}</span>'
        for job_id, c in colours.items()
    )
    return (
        f'<svg class="curve overlay" viewBox="{view}" preserveAspectRatio="none" role="img" '
        f'aria-label="{_e(title)}">{lines}</svg>'
        f'<div class="axis"><span>step {format_number(x0)}</span>'
        f"<span>train loss {format_number(lo, 3)}–{format_number(hi, 3)}</span>"
        f'<span>step {format_number(x1)}</span></div><div class="keys">{keys}</div>'
    )


def _sweep_curves(snapshot: dict, curves: dict[str, dict]) -> str:
    """Each listed sweep's jobs' loss curves overlaid (the serve page shows the same, live)."""
    by_sweep: dict[str, dict[str, dict | None]] = {}
    for job in snapshot.get("jobs") or ():
        if job.get("sweep"):
            by_sweep.setdefault(str(job["sweep"]), {})[str(job.get("id"))] = curves.get(job.get("id"))
    parts = []
    for sweep_id, members in by_sweep.items():
        svg = render_overlay(members, f"loss by step of sweep {sweep_id}")
        if svg:
            parts.append(f'<section class="sweep-curves"><h2>Sweep {_e(sweep_id)}: loss by step</h2>{svg}</section>')
    return "".join(parts)


# -- sections ------------------------------------------------------------------------------------


def _header(snapshot: dict, heartbeat_s: float = 5.0) -> str:
    w = snapshot.get("watcher") or {}
    heartbeat = w.get("heartbeat_at")
    stale_s, confirm_s = bounds(heartbeat_s)
    return (
        f'<header><h1>trainq</h1><div class="meta">{_e(w.get("host"))} · watcher pid {_e(w.get("pid"))} · '
        f'v{_e(w.get("version"))} · <b class="wstate {_e(w.get("state"))}">{_e(w.get("state"))}</b> · '
        f'started {_when(w.get("started_at"))} · heartbeat <time id="hb" datetime="{_e(heartbeat)}" '
        f'data-stale-s="{stale_s:g}" data-confirm-s="{confirm_s:g}">'
        f"{_e(str(heartbeat or '').replace('T', ' ')[:19])} UTC</time></div></header>"
        '<div id="stale" class="banner" hidden><span id="stale-what">watcher not responding</span>: no heartbeat for '
        '<span id="age"></span>. Is <code>trainq watch</code> running?</div>'
        f'<noscript><div class="banner">JavaScript is off: if the heartbeat above is more than '
        f"{stale_s:g} s old, the watcher is not responding.</div></noscript>"
        + "".join(f'<div class="banner">{_e(problem)}</div>' for problem in w.get("problems") or ())
        + (f'<div class="meta wall">{_e(wall)}</div>' if (wall := wall_line(snapshot)) else "")
    )


def _serve_link(url: str | None) -> str:
    if not url:
        return ""
    return f'<div class="meta serve">live page: <a href="{_e(url)}">{_e(url)}</a> (trainq serve; it asks for its token)</div>'


def _counts(snapshot: dict) -> str:
    counts = snapshot.get("counts") or {}
    cells = "".join(
        f'<div class="count {key}"><b>{_e(counts.get(key, 0))}</b>{key.replace("_", " ")}</div>'
        for key in ("inbox", "awaiting_approval", "pending", "running", "done", "failed")
    )
    return f'<section class="counts">{cells}</section>'


def _progress_bar(progress: dict) -> str:
    step, total = progress.get("step"), progress.get("total_steps")
    if step is None or not total:
        return f'<progress></progress> <span class="steps">step {_e(step)}</span>'
    pct = 100.0 * min(step, total) / total
    return (
        f'<progress value="{int(step)}" max="{int(total)}"></progress> '
        f'<span class="steps">{int(step)} / {int(total)} ({pct:.0f}%)</span>'
    )


def _facts(pairs: list[tuple[str, str]], css: str = "") -> str:
    return f'<dl class="{css}">' + "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in pairs) + "</dl>"


def _running_card(job: dict, curve: dict | None) -> str:
    story = from_entry(job)
    progress = story.progress or {}
    health = "stalled" if story.state_word == "stalled" else job.get("health") or story.status
    usage = job.get("usage") or {}
    facts = [
        ("loss", format_number(progress.get("loss"))),
        ("eval loss", format_number(progress.get("eval_loss"))),
        ("epoch", format_number(progress.get("epoch"), 3)),
        ("tokens/s", format_number(progress.get("tokens_per_s"), 4)),
        ("ETA", format_eta(progress.get("eta_s"))),
        ("attempt", _e(job.get("attempt"))),
        ("GPUs", _e(",".join(map(str, job.get("gpus") or [])) or None)),
        ("RSS MB", format_number(usage.get("rss_mb"), 5)),
    ]
    if job.get("deadline") or job.get("forecast"):
        facts.append(
            (
                "deadline",
                _e(
                    {True: "fits", False: "MISSES", None: "?"}[job.get("fits")]
                    + (f": {job['forecast']}" if job.get("forecast") else "")
                ),
            )
        )
    if progress.get("clip_fraction") is not None or progress.get("update_ratio") is not None:
        facts += [
            ("clip fraction", format_number(progress.get("clip_fraction"), 2)),
            ("update ratio", format_number(progress.get("update_ratio"), 3)),
        ]
    if job.get("vitals"):
        facts.append(("health", _e(job["vitals"])))
    return (
        f'<article class="job running" id="job-{_e(job.get("id"))}"><h3>{_label(job)} '
        f'<span class="badge {_e(health)}">{_e(health)}</span></h3>'
        f"{_story_lines(story)}"
        f'<div class="bar">{_progress_bar(progress)}</div>{_facts(facts)}{render_curve(curve)}{_notes_and_samples(story)}'
        f'<div class="dir">{_e(job.get("dir"))} · started {_when(job.get("started_at"))}</div></article>'
    )


def _story_lines(story: JobStory) -> str:
    """What the running job does when it says more than its badge (stopping, and why), and a retry's previous end."""
    out = f'<p class="why">{_e(story.headline)}</p>' if story.headline and story.headline != story.state_word else ""
    if story.previous:
        out += f'<p class="previous">attempt {_e(story.attempt)} running; {_e(story.previous)}</p>'
    return out


def _notes_and_samples(story: JobStory) -> str:
    """The notes that still hold (a loss plateau until the loss leaves it) and the latest sample generations."""
    progress = story.progress or {}
    out = "".join(f'<p class="warning">{_e(note.words())}</p>' for note in story.notes)
    samples = [s for s in progress.get("samples") or () if isinstance(s, dict)]
    if samples:
        rows = "".join(f"<li><q>{_e(s.get('prompt'))}</q> → <q>{_e(s.get('completion'))}</q></li>" for s in samples)
        out += f'<details class="samples"><summary>sample generations</summary><ul>{rows}</ul></details>'
    return out


def _running(snapshot: dict, curves: dict[str, dict]) -> str:
    jobs = [j for j in snapshot.get("jobs") or () if j.get("state") == "running"]
    if not jobs:
        return '<section><h2>Running</h2><p class="none">No job is running.</p></section>'
    cards = "".join(_running_card(j, curves.get(j.get("id"))) for j in jobs)
    return f'<section><h2>Running</h2><div class="cards">{cards}</div></section>'


def _table(title: str, css: str, heads: tuple[str, ...], rows: list[str], empty: str) -> str:
    if not rows:
        return f'<section class="{css}"><h2>{title}</h2><p class="none">{empty}</p></section>'
    head = "".join(f"<th>{h}</th>" for h in heads)
    return (
        f'<section class="{css}"><h2>{title}</h2><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></section>"
    )


def _pending(snapshot: dict) -> str:
    rows = [
        f"<tr><td>{_label(j)}</td><td>{_e(j.get('priority'))}</td><td>{_e(j.get('attempt'))}</td>"
        f'<td class="t">{_when(j.get("submitted_at"))}</td><td class="why">{_e(j.get("waiting_for"))}</td></tr>'
        for j in snapshot.get("jobs") or ()
        if j.get("state") == "pending"
    ]
    heads = ("job", "priority", "attempt", "submitted", "waiting for")
    return _table("Pending", "pending", heads, rows, "Nothing is waiting.")


def _awaiting(snapshot: dict) -> str:
    rows = [
        f"<tr><td>{_label(j)}</td><td>{_e(j.get('dir'))}</td>"
        f"<td>{_e(j.get('approval_hint') or 'set approved: true in the file')}</td></tr>"
        for j in snapshot.get("jobs") or ()
        if j.get("state") == "awaiting_approval"
    ]
    return _table("Awaiting approval", "awaiting", ("job", "file", "to approve"), rows, "No file awaits approval.")


def _ignored(snapshot: dict) -> str:
    """Inbox entries that are not job files, with why (nothing when there are none)."""
    rows = [
        f'<tr><td>inbox/{_e(e.get("name"))}</td><td class="why">{_e(e.get("reason"))}</td></tr>'
        for e in snapshot.get("ignored") or ()
    ]
    if not rows:
        return ""
    return _table("Ignored in inbox", "ignored", ("entry", "why it is not taken"), rows, "")


def _outcome(job: dict) -> str:
    """Its status, the story's one line (how it ended), the advice, and the evidence once (only what the line
    does not already say)."""
    story = from_entry(job)
    parts = [f'<b class="status {_e(story.status)}">{_e(story.status)}</b>']
    if story.headline:
        parts.append(f'<span class="why">{_e(story.headline)}</span>')
    if story.advice:
        parts.append(f'<span class="advice">{_e(story.advice)}</span>')
    evidence = story.evidence.strip()
    if evidence and short_evidence(evidence) != evidence:
        parts.append(f'<code class="evidence">{_e(evidence)}</code>')
    return "<br>".join(parts)


def _outputs(job: dict) -> str:
    outputs = job.get("outputs") or {}
    links = [
        f'<a href="{_e(path)}">{_e(path)}</a>' for path in (outputs.get("loss_png"), outputs.get("adapter")) if path
    ]
    return "<br>".join(links) or _e(job.get("dir"))


def _finished(snapshot: dict) -> str:
    rows = [
        f'<tr class="{_e(j.get("state"))}" id="ended-{_e(j.get("id"))}"><td>{_label(j)}</td><td>{_outcome(j)}</td>'
        f'<td class="n">{_final_loss(j)}</td><td class="t">{_took(j)}</td>'
        f'<td class="t">{_when(j.get("finished_at"))}</td><td>{_e(j.get("attempt"))}</td><td>{_outputs(j)}</td></tr>'
        for j in snapshot.get("jobs") or ()
        if j.get("state") in ("done", "failed")
    ]
    heads = ("job", "outcome", "final loss", "took", "finished", "attempts", "outputs")
    return _table("Recently finished", "finished", heads, rows, "No job has finished yet.")


def _final_loss(job: dict) -> str:
    """The last train loss, and the last eval loss when there is one."""
    progress = job.get("progress") or {}
    text = format_number(progress.get("loss"))
    if progress.get("eval_loss") is not None:
        text += f' <span class="id">eval {format_number(progress["eval_loss"])}</span>'
    return text


def _took(job: dict) -> str:
    """How long the job ran, first start to end."""
    start, end = parse_iso(job.get("started_at")), parse_iso(job.get("finished_at"))
    return format_eta(end - start) if start is not None and end is not None else "–"


def _gpu_card(gpu: dict) -> str:
    total, used = gpu.get("memory_total_mb") or 0, gpu.get("memory_used_mb") or 0
    foreign = ", ".join(
        f"{_e(p.get('name') or 'pid')} {_e(p.get('pid'))} ({format_number(p.get('used_mb'))} MB)"
        for p in gpu.get("foreign") or ()
    )
    facts = [
        ("memory", f"{format_number(used, 6)} / {format_number(total, 6)} MB"),
        ("utilisation", _unit(gpu.get("utilization_pct"), "%")),
        ("temperature", _unit(gpu.get("temperature_c"), " °C")),
        ("held by", _e(gpu.get("held_by")) if gpu.get("held_by") else '<span class="none">nobody (free)</span>'),
    ]
    sim = ' <span class="badge sim">simulated</span>' if gpu.get("simulated") else ""
    return (
        f'<article class="gpu"><h3>GPU {_e(gpu.get("index"))} · {_e(gpu.get("name"))}{sim}</h3>'
        f'<meter value="{float(used)}" min="0" max="{float(total) or 1.0}"></meter>{_facts(facts, "two")}'
        f'<div class="dir">other processes: {foreign or "none"}</div></article>'
    )


def _unit(value: object, unit: str) -> str:
    """A reading with its unit, or a bare dash when the GPU does not report it."""
    return "–" if value is None else f"{format_number(value)}{unit}"


def _machine(snapshot: dict) -> str:
    res = snapshot.get("resources") or {}
    ram, battery = res.get("ram") or {}, res.get("battery")
    items = [f"RAM {format_number(ram.get('available_gb'), 3)} of {format_number(ram.get('total_gb'), 3)} GB free"]
    items += [
        f"disk {_e(path)}: {format_number(d.get('free_gb'), 4)} of {format_number(d.get('total_gb'), 4)} GB free"
        for path, d in (res.get("disk") or {}).items()
    ]
    if battery:
        plugged = "plugged in" if battery.get("power_plugged") else "on battery"
        items.append(f"battery {format_number(battery.get('percent'), 3)}% ({plugged})")
    cards = "".join(_gpu_card(g) for g in res.get("gpus") or ()) or '<p class="none">No GPU.</p>'
    return (
        f'<section class="machine"><h2>Machine</h2><p>{" · ".join(items)}</p><div class="cards">{cards}</div></section>'
    )


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0 auto;max-width:1200px;padding:12px;color:#1d2330;background:#f6f7f9;
overflow-wrap:anywhere}section{overflow-x:auto}
header{display:flex;gap:16px;align-items:baseline;flex-wrap:wrap}h1{margin:0;font-size:22px}
.meta{color:#556}.wstate.running{color:#17803d}.wstate.paused{color:#b26b00}.wstate.stopping{color:#b3261e}
.banner{background:#b3261e;color:#fff;padding:8px 12px;border-radius:6px;margin:8px 0;font-weight:600}
.counts{display:flex;gap:8px;margin:12px 0;flex-wrap:wrap}
.count{background:#fff;border:1px solid #dde;border-radius:6px;padding:6px 12px;text-align:center;min-width:90px}
.count b{display:block;font-size:22px}.count.failed b{color:#b3261e}.count.running b{color:#1d5fd6}
h2{font-size:16px;margin:18px 0 6px}.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(470px,100%),1fr));gap:10px}
article{background:#fff;border:1px solid #dde;border-radius:8px;padding:10px}h3{margin:0 0 6px;font-size:15px}
.id,.dir{color:#778;font-size:12px;font-weight:normal}.bar{display:flex;align-items:center;gap:8px}
progress{flex:1;height:14px}meter{width:100%;height:14px}.steps{white-space:nowrap}
dl{display:grid;grid-template-columns:repeat(3,minmax(0,1fr));gap:2px 10px;margin:6px 0}dl div{display:flex;gap:6px;white-space:nowrap;overflow:hidden}
@media (max-width:600px){dl{grid-template-columns:repeat(2,minmax(0,1fr))}.count{min-width:60px}}
dt{color:#667}dd{margin:0;font-variant-numeric:tabular-nums;overflow:hidden;text-overflow:ellipsis}td.t{white-space:nowrap}
.badge{font-size:11px;border-radius:10px;padding:1px 7px;background:#e3e6ec;font-weight:normal}
.badge.healthy{background:#d8f0df}.badge.stalled{background:#ffe2b3}.badge.stopping{background:#f6d2cf}
svg.curve{width:100%;height:90px;background:#fafbfd;border:1px solid #eef}
polyline{fill:none;stroke-width:1.5;stroke-linecap:round;stroke-linejoin:round;vector-effect:non-scaling-stroke}polyline.eval_loss{stroke-width:3}polyline.loss{stroke:#1d5fd6}polyline.eval_loss{stroke:#e07a00}
.axis{display:flex;justify-content:space-between;color:#778;font-size:11px}
.key{margin-right:8px;white-space:nowrap}i.k{display:inline-block;width:12px;height:3px;vertical-align:middle;margin-right:3px}i.k.loss{background:#1d5fd6}i.k.eval_loss{background:#e07a00}
table{border-collapse:collapse;width:100%;background:#fff}th,td{border-bottom:1px solid #eef;padding:4px 6px;text-align:left;vertical-align:top}
.status.done{color:#17803d}.status.failed,.status.timeout,.error{color:#b3261e}.status.cancelled{color:#b26b00}
dl.two{grid-template-columns:repeat(2,minmax(0,1fr))}.banner code{background:rgba(255,255,255,.2);color:#fff}
code{font-size:12px;background:#f0f1f4;padding:0 3px;white-space:pre-wrap}.previous,.advice{color:#667}
polyline.overlay{stroke-width:1.5}.keys{display:flex;flex-wrap:wrap;font-size:11px;color:#556}.none{color:#778}.why{color:#8a4b00}
"""

# the page is a static file: only the browser can tell how old the heartbeat is now, and its clock need not
# agree with the watcher's. The rules of faces/liveness.py: where the browser's clock agrees with the heartbeat
# it judges; where not, the browser watches the heartbeat change across the page's reloads (sessionStorage
# keeps each value and the browser time it was first seen). `trainq serve`'s live script calls
# trainqHeartbeat(value) again for every heartbeat it is sent.
_SCRIPT = """
(function(){var KEY='trainq-heartbeat:'+location.pathname,mem=null;
function words(s){s=Math.max(0,Math.round(s));return s<60?s+' s':s<3600?Math.floor(s/60)+' min '+s%60+' s':
 Math.floor(s/3600)+' h '+Math.floor(s%3600/60)+' min';}
function byClock(s){return s>=0?words(s)+' ago':words(-s)+' in the future';}
function seen(v,now){var old=mem;try{old=JSON.parse(sessionStorage.getItem(KEY))||old;}catch(e){}
 if(old&&old.v===v)return old;mem={v:v,at:now,moved:!!(old&&old.v)};
 try{sessionStorage.setItem(KEY,JSON.stringify(mem));}catch(e){}return mem;}
window.trainqHeartbeat=function(v){var hb=document.getElementById('hb'),t=Date.parse(v);if(!hb||!v||isNaN(t))return;
 var now=Date.now(),bound=Number(hb.dataset.staleS),confirm=Number(hb.dataset.confirmS)||bound,r=seen(v,now);
 var clock=(now-t)/1000,watched=(now-r.at)/1000,off=(r.at-t)/1000,what=null,age='',note;
 if(Math.abs(clock)<=bound){note=words(clock)+' ago';}
 else if(r.moved&&watched<=bound){note='changed '+words(watched)+' ago, timed by this browser, whose clock is '+
  words(Math.abs(off))+(off>=0?' ahead of':' behind')+' the watcher\\'s';}
 else if(r.moved){what='watcher not responding';note=byClock(clock)+' by this browser\\'s clock';
  age=words(watched)+', timed by this browser (its clock is '+words(Math.abs(off))+(off>=0?' ahead of':' behind')+
  ' the watcher\\'s)';}
 else{note=byClock(clock)+' by this browser\\'s clock';
  if(watched>=confirm){what='watcher not responding';age=byClock(clock)+' by this browser\\'s clock, and none '+
   'while it watched for '+words(watched);}
  else{what='watcher may not be responding';age=byClock(clock)+' by this browser\\'s clock, which may not agree '+
   'with the watcher\\'s; watching for a new one';}}
 hb.setAttribute('datetime',v);hb.textContent=v.replace('T',' ').slice(0,19)+' UTC ('+note+')';
 var stale=document.getElementById('stale');if(!stale)return;stale.hidden=!what;
 if(what){document.getElementById('stale-what').textContent=what;document.getElementById('age').textContent=age;}};
var hb=document.getElementById('hb');if(hb)trainqHeartbeat(hb.getAttribute('datetime'));})();
"""


def render_html(
    snapshot: dict, curves: dict[str, dict], heartbeat_s: float = 5.0, *, serve_url: str | None = None
) -> str:
    """The whole status page for a status.json object and CurveStore.curves(); ``heartbeat_s``: how often the
    watcher rewrites its heartbeat (the page's stale bounds follow it); ``serve_url``: the live page of a running
    `trainq serve`, linked (without its token: the browser that has it asks for it)."""
    body = "".join(
        (
            _header(snapshot, heartbeat_s),
            _serve_link(serve_url),
            _counts(snapshot),
            _running(snapshot, curves),
            _pending(snapshot),
            _awaiting(snapshot),
            _ignored(snapshot),
            _finished(snapshot),
            sweep_html(list(snapshot.get("jobs") or ())),
            _sweep_curves(snapshot, curves),
            _machine(snapshot),
        )
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'{REFRESH_META}<meta name="viewport" content="width=device-width">'
        f"<title>trainq · {_e((snapshot.get('counts') or {}).get('running', 0))} running</title>"
        f"<style>{_CSS}</style></head><body>{body}<script>{_SCRIPT}</script></body></html>\n"
    )
