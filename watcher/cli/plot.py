"""``trainq plot ID... [-o FILE]``: the loss curves of several jobs overlaid in one PNG (TensorBoard's and W&B's
most used view). A sweep id stands for its jobs. Each job draws its train loss (a line) and its eval loss
(dots, the same colour) by step, read from its metrics.jsonl.

matplotlib is in the ``train`` extra; it is imported inside the command only (the watcher never imports it).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from trainq.watcher.cli.manage import find_job, sweeps_of
from trainq.watcher.spec.contract import JobPaths

EXIT_OK, EXIT_ERROR, EXIT_INVALID = 0, 1, 2
#: most points drawn per curve (a long run is thinned evenly, its last point kept)
MAX_POINTS = 2000


class PlotUsage(Exception):
    """An id that names no job or sweep (exit status 2)."""


def expand(root: Path, ids: list[str]) -> list[tuple[str, Path]]:
    """(job id, folder) for each id; a sweep id gives its jobs in index order."""
    out: list[tuple[str, Path]] = []
    for job_id in ids:
        found = find_job(root, job_id)
        if found is not None:
            out.append((found.id, found.path))
            continue
        size = sweeps_of(root, job_id).get(job_id)
        if not size:
            raise PlotUsage(f"{root}: no job or sweep with id {job_id!r}")
        members = [find_job(root, f"{job_id}-{i}", by_name=False) for i in range(1, size + 1)]
        out += [(m.id, m.path) for m in members if m is not None]
    return out


def curves(job_dir: Path) -> dict[str, list[tuple[float, float]]]:
    """``{"loss": [(step, value)...], "eval_loss": [...]}`` from a job's metrics.jsonl (later attempts win a step)."""
    series: dict[str, dict[float, float]] = {"loss": {}, "eval_loss": {}}
    try:
        lines = JobPaths(job_dir).metrics.read_bytes().splitlines()
    except OSError:
        return {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not _number(record.get("step")):
            continue
        kind = record.get("type", "step")
        if kind == "step" and _number(record.get("loss")):
            series["loss"][float(record["step"])] = float(record["loss"])
        if kind in ("eval", "step") and _number(record.get("eval_loss")):
            series["eval_loss"][float(record["step"])] = float(record["eval_loss"])
    return {k: _thin(sorted(v.items())) for k, v in series.items() if v}


def _number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(points) <= MAX_POINTS:
        return points
    stride = len(points) / MAX_POINTS
    return [points[int(i * stride)] for i in range(MAX_POINTS - 1)] + [points[-1]]


def plot(root: Path, ids: list[str], out: Path | None) -> int:
    """Write the PNG; print where it is. 2 for an unknown id, 1 without matplotlib or without any curve."""
    try:
        jobs = expand(root, ids)
    except PlotUsage as exc:
        print(f"trainq: plot: {exc}", file=sys.stderr)
        return EXIT_INVALID
    drawn = {job_id: c for job_id, path in jobs if (c := curves(path))}
    if not drawn:
        print(f"trainq: plot: no loss records in the metrics.jsonl of {', '.join(i for i, _ in jobs)}", file=sys.stderr)
        return EXIT_ERROR
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("trainq: plot: needs matplotlib (the train extra): pip install 'trainq[train]'", file=sys.stderr)
        return EXIT_ERROR
    target = out or Path(f"{'-'.join(ids)}-loss.png")
    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    for i, (job_id, series) in enumerate(drawn.items()):
        colour = f"C{i % 10}"
        if series.get("loss"):
            ax.plot(*zip(*series["loss"], strict=True), color=colour, linewidth=1.2, label=f"{job_id} train")
        if series.get("eval_loss"):
            ax.plot(*zip(*series["eval_loss"], strict=True), "o--", color=colour, markersize=3, label=f"{job_id} eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"loss: {', '.join(ids)}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target)
    plt.close(fig)
    print(f"{target}: loss curves of {len(drawn)} job(s) ({', '.join(drawn)})")
    return EXIT_OK
