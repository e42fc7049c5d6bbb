"""A sweep at a glance: its jobs grouped, each one's values beside its best eval loss, best first.

``workflow_entry`` adds the sweep fields to a status.json job entry (the daemon's side);
``sweep_groups`` groups the entries of a status.json, and ``sweep_lines`` / ``sweep_html`` draw
them for ``trainq status`` and status.html. Kept apart from view.py and html.py so each can
call it with one line.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Protocol

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.folders import JobState
from trainq.watcher.spec.fsutil import read_json
from trainq.watcher.spec.jobspec import JobSpec
from trainq.watcher.spec.records import parse_records, read_tail


class JobView(Protocol):
    """The parts of the daemon's Job that a sweep entry reads."""

    @property
    def run(self) -> dict: ...
    @property
    def state(self) -> JobState: ...
    @property
    def spec(self) -> JobSpec | None: ...
    @property
    def paths(self) -> JobPaths: ...


#: how much of metrics.jsonl is read for a finished job's best eval loss when summary.json has none (bytes)
BEST_EVAL_MAX_BYTES = 512 * 1024


@dataclass(frozen=True)
class SweepRow:
    job_id: str
    status: str
    params: dict
    best_eval_loss: float | None


@dataclass(frozen=True)
class SweepGroup:
    sweep_id: str
    rows: tuple[SweepRow, ...]  # best eval loss first, then those without one, by id

    @property
    def has_losses(self) -> bool:
        return any(r.best_eval_loss is not None for r in self.rows)


def workflow_entry(job: JobView) -> dict:
    """status.json entry fields for sweeps: ``sweep``, ``params``, and a finished train job's or sweep member's
    ``best_eval_loss`` (docs/contract.md, status.json)."""
    sweep = job.run.get("sweep") or {}
    out: dict = {}
    if sweep:
        out.update(sweep=sweep.get("id"), params=sweep.get("params"))
    if job.state.value in ("done", "failed") and job.spec is not None and job.spec.is_train:
        out["best_eval_loss"] = best_eval_loss(job.paths.metrics, job.paths.summary)
    elif sweep and job.state.value in ("done", "failed") and job.spec is not None:
        # a sweep member's row compares it with its siblings; a lone command job's entry has no such row, and
        # reading its log's tail at every finish costs the loop two reads and a regex pass per job
        out["best_eval_loss"] = best_logged_eval_loss(job.paths.metrics, job.paths.log)
    return out


def best_logged_eval_loss(metrics_path, log_path) -> float | None:
    """A command job's lowest finite ``eval_loss``: from its metrics records (any type) and from the
    Hugging Face log dicts it printed into output.log (the same parse its live progress uses)."""
    from trainq.watcher.faces.progress_log import hf_dicts

    losses = [r.get("eval_loss") for r in parse_records(read_tail(metrics_path, BEST_EVAL_MAX_BYTES).splitlines())]
    losses += [d.get("eval_loss") for d in hf_dicts(read_tail(log_path, BEST_EVAL_MAX_BYTES))]
    finite = []
    for value in losses:
        try:
            # transformers 5 prints floats as strings; None and junk raise and are passed over
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            finite.append(number)
    return min(finite) if finite else None


def best_eval_loss(metrics_path, summary_path=None) -> float | None:
    """summary.json's ``best_eval_loss``, else the lowest finite ``eval_loss`` in metrics.jsonl's tail, or None."""
    summary = read_json(summary_path) if summary_path is not None else None
    best = (summary or {}).get("best_eval_loss")
    if isinstance(best, (int, float)) and math.isfinite(best):
        return float(best)
    losses = [
        r.get("eval_loss")
        for r in parse_records(read_tail(metrics_path, BEST_EVAL_MAX_BYTES).splitlines())
        if r.get("type") == "eval"
    ]
    finite = [float(x) for x in losses if isinstance(x, (int, float)) and math.isfinite(x)]
    return min(finite) if finite else None


def sweep_groups(jobs: list[dict]) -> list[SweepGroup]:
    """The status.json entries that belong to sweeps, grouped by sweep id (in first-seen order)."""
    groups: dict[str, list[SweepRow]] = {}
    for job in jobs:
        if job.get("sweep"):
            groups.setdefault(job["sweep"], []).append(
                SweepRow(
                    str(job.get("id")), str(job.get("status")), dict(job.get("params") or {}), job.get("best_eval_loss")
                )
            )
    return [SweepGroup(sweep_id, tuple(sorted(rows, key=_rank))) for sweep_id, rows in groups.items()]


def _rank(row: SweepRow) -> tuple:
    loss = row.best_eval_loss
    head, _, index = row.job_id.rpartition("-")
    return (loss is None, loss if loss is not None else 0.0, head, int(index) if index.isdigit() else 0)


def _params_text(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _loss_text(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def sweep_lines(jobs: list[dict]) -> list[str]:
    """Plain lines for a terminal: one heading per sweep, one row per job, best eval loss first."""
    lines = []
    for group in sweep_groups(jobs):
        ended = sum(1 for r in group.rows if r.status not in ("pending", "running", "stopping"))
        lines.append(
            f"sweep {group.sweep_id}: {len(group.rows)} job(s) listed, {ended} ended"
            + (", best eval loss first" if group.has_losses else "")
        )
        width = max(len(r.job_id) for r in group.rows)
        for row in group.rows:
            loss = f"  best eval loss {_loss_text(row.best_eval_loss)}" if group.has_losses else ""
            lines.append(f"  {row.job_id:<{width}}  {row.status:<9}{loss}  {_params_text(row.params)}")
    return lines


def sweep_html(jobs: list[dict]) -> str:
    """One table per sweep for status.html (empty when no sweep is listed)."""
    parts = []
    for group in sweep_groups(jobs):
        keys = list(dict.fromkeys(k for r in group.rows for k in r.params))
        loss_head = ["best eval loss"] if group.has_losses else []
        head = "".join(f"<th>{html.escape(k)}</th>" for k in ["job", "status", *keys, *loss_head])
        rows = "".join(
            f"<tr><td>{html.escape(r.job_id)}</td><td>{html.escape(r.status)}</td>"
            + "".join(f"<td>{html.escape(str(r.params.get(k, '')))}</td>" for k in keys)
            + (f"<td>{_loss_text(r.best_eval_loss)}</td>" if group.has_losses else "")
            + "</tr>"
            for r in group.rows
        )
        parts.append(
            f'<section class="sweep"><h2>Sweep {html.escape(group.sweep_id)}</h2>'
            f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></section>"
        )
    return "".join(parts)
