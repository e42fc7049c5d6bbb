"""``trainq diff A B``: what differs between two jobs, from their files alone.

Five sections, each from the job folder: config (``snapshot/config.json``, else job.yaml; sweep
params from run.json), code (``snapshot/code.json`` and the diff's sha256), data (``sources.json``),
environment (``environment.json``: Python, torch, CUDA, driver, GPUs, packages) and results (final
and best loss, steps, runtime, status: ``summary.json`` for train jobs, else ``metrics.jsonl`` and
run.json's attempts).
"""

from __future__ import annotations

import json
from collections.abc import Set as AbstractSet
from pathlib import Path

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import Problem
from trainq.watcher.spec.fsutil import read_json
from trainq.watcher.spec.jobspec import parse_mapping, read_spec_text
from trainq.watcher.spec.units import parse_iso
from trainq.watcher.supervisor.snapshot import read_sources

#: config keys that always differ between two jobs and say nothing about what they ran
_NOISE = {"attempt", "lineage", "rerun_of", "fork_of", "name", "sweep", "approved"}
#: most package changes listed
MAX_PACKAGES = 20


def describe(job_dir: Path) -> dict:
    """Everything ``compare`` needs about one job, read from its folder."""
    paths = JobPaths(job_dir)
    run = read_json(paths.run) or {}
    snap = paths.snapshot
    return {
        "id": job_dir.name,
        "state": job_dir.parent.name,
        "status": run.get("status"),
        "params": (run.get("sweep") or {}).get("params"),
        "config": read_json(snap / "config.json") or _job_yaml(paths),
        "code": read_json(snap / "code.json"),
        "sources": read_sources(snap),
        "environment": read_json(snap / "environment.json"),
        "results": results(paths, run),
    }


def _job_yaml(paths: JobPaths) -> dict:
    text = read_spec_text(paths.spec)
    data = text if isinstance(text, Problem) else parse_mapping(text)
    return {} if isinstance(data, Problem) else data


def results(paths: JobPaths, run: dict) -> dict:
    """Final and best loss, steps, runtime (seconds over every attempt), attempts."""
    summary = read_json(paths.summary) or {}
    found = {
        "final_loss": summary.get("final_loss"),
        "best_eval_loss": summary.get("best_eval_loss"),
        "steps": summary.get("steps"),
    }
    if not summary:
        found.update(_from_metrics(paths.metrics))
    found["runtime_s"] = _runtime_s(run)
    found["attempts"] = run.get("attempt")
    return found


def _from_metrics(path: Path) -> dict:
    loss = eval_best = best_loss = step = None
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return {}
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if not isinstance(r, dict):
            continue
        if isinstance(r.get("loss"), (int, float)):
            loss = r["loss"]
            best_loss = loss if best_loss is None else min(best_loss, loss)
        if isinstance(r.get("eval_loss"), (int, float)):
            eval_best = r["eval_loss"] if eval_best is None else min(eval_best, r["eval_loss"])
        if isinstance(r.get("step"), int):
            step = max(step or 0, r["step"])
    return {"final_loss": loss, "best_eval_loss": eval_best, "best_loss": best_loss, "steps": step}


def _runtime_s(run: dict) -> float | None:
    folded = (run.get("attempts_earlier") or {}).get("runtime_s")  # attempts older than run.json keeps in full
    total, seen = (float(folded), True) if isinstance(folded, (int, float)) else (0.0, False)
    for attempt in run.get("attempts") or []:
        start, end = parse_iso(attempt.get("started_at")), parse_iso(attempt.get("ended_at"))
        if start is not None and end is not None:
            total, seen = total + max(0.0, end - start), True
    return round(total, 3) if seen else None


# ---------------------------------------------------------------- comparing


def compare(a: dict, b: dict) -> dict[str, list[tuple[str, object, object]]]:
    """Per section, the (what, A's, B's) rows that differ (results: every row)."""
    return {
        "params": _params(a, b),
        "config": _differing(_flat(a["config"]), _flat(b["config"]), skip=_NOISE),
        "code": _code(a["code"], b["code"]),
        "data": _data(a["sources"], b["sources"], _root(a["code"]), _root(b["code"])),
        "environment": _environment(a["environment"] or {}, b["environment"] or {}),
        "results": [
            (k, a["results"].get(k), b["results"].get(k))
            for k in ("status", "final_loss", "best_eval_loss", "best_loss", "steps", "runtime_s", "attempts")
            if k != "status" and (a["results"].get(k) is not None or b["results"].get(k) is not None)
        ]
        + [("status", a["status"], b["status"])],
    }


def _params(a: dict, b: dict) -> list:
    pa, pb = a.get("params") or {}, b.get("params") or {}
    return [(k, pa.get(k), pb.get(k)) for k in dict.fromkeys([*pa, *pb])]


def _flat(value: object, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _differing(fa: dict, fb: dict, skip: AbstractSet[str] = frozenset()) -> list:
    keys = dict.fromkeys([*fa, *fb])
    return [(k, fa.get(k), fb.get(k)) for k in keys if k.split(".")[0] not in skip and fa.get(k) != fb.get(k)]


def _code(ca: dict | None, cb: dict | None) -> list:
    if ca is None or cb is None:
        return [("snapshot", "yes" if ca else "none", "yes" if cb else "none")] if ca != cb else []
    ga, gb = ca.get("git") or {}, cb.get("git") or {}
    if ga or gb:
        rows = [
            ("root", ca.get("root"), cb.get("root")),
            ("commit", ga.get("commit"), gb.get("commit")),
            ("uncommitted diff (sha256)", ga.get("diff_sha256"), gb.get("diff_sha256")),
            ("untracked", ga.get("untracked"), gb.get("untracked")),
        ]
        return [r for r in rows if r[1] != r[2]]
    fa = {_in_code(f["path"], _root(ca)): f.get("sha256") for f in ca.get("files") or []}
    fb = {_in_code(f["path"], _root(cb)): f.get("sha256") for f in cb.get("files") or []}
    return _differing(fa, fb)


def _root(code: dict | None) -> str | None:
    return (code or {}).get("root")


def _data(sa: list, sb: list, root_a: str | None, root_b: str | None) -> list:
    """sha256 per path; a path inside the job's code root is shown relative to it (``<code>/train.py``)."""
    fa = {_in_code(s.get("path"), root_a): s.get("sha256") for s in sa if isinstance(s, dict)}
    fb = {_in_code(s.get("path"), root_b): s.get("sha256") for s in sb if isinstance(s, dict)}
    return _differing(fa, fb)


def _in_code(path: str | None, root: str | None) -> str | None:
    if path and root and path.startswith(root.rstrip("/") + "/"):
        return "<code>/" + path[len(root.rstrip("/")) + 1 :]
    return path


def _environment(ea: dict, eb: dict) -> list:
    rows = []
    for key, pick in (
        ("host", lambda e: e.get("host")),
        ("python", lambda e: (e.get("python") or {}).get("version")),
        ("torch", lambda e: (e.get("torch") or {}).get("version")),
        ("cuda", lambda e: (e.get("torch") or {}).get("cuda")),
        ("nvidia_driver", lambda e: e.get("nvidia_driver")),
        ("gpus", lambda e: [g.get("name") for g in e.get("gpus") or []] or None),
    ):
        if pick(ea) != pick(eb):
            rows.append((key, pick(ea), pick(eb)))
    pa, pb = ea.get("packages"), eb.get("packages")
    if not pa or not pb:
        count = lambda p: f"{len(p)} listed" if p else None  # noqa: E731
        return rows + ([("packages", count(pa), count(pb))] if pa or pb else [])
    changed = _differing(pa, pb)
    rows += [(f"package {k}", va, vb) for k, va, vb in changed[:MAX_PACKAGES]]
    if len(changed) > MAX_PACKAGES:
        rows.append((f"and {len(changed) - MAX_PACKAGES} more packages", "", ""))
    return rows


def render(a: dict, b: dict, sections: dict[str, list]) -> list[str]:
    """The comparison as aligned lines: a header, then each section's rows (``same`` when none differ)."""
    lines = [f"A: {a['id']} ({a['state']}, {a['status']})", f"B: {b['id']} ({b['state']}, {b['status']})"]
    for name, rows in sections.items():
        if name == "params" and not rows:
            continue
        if not rows:
            lines.append(f"{name}: same")
            continue
        lines.append(f"{name}:")
        width = min(40, max(len(r[0]) for r in rows))
        lines += [f"  {r[0]:<{width}}  {_shown(r[1])}  |  {_shown(r[2])}" for r in rows]
    return lines


def _shown(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 72 else text[:69] + "..."
