"""What the watcher records of each job (docs/records.md): the snapshot request and its events.

The watcher only describes the snapshot (``snapshot_request``: no reading, no hashing, no git); the
job's supervisor takes it before the job starts (watcher/supervisor/snapshot.py). The events the
watcher itself knows (submitted, accepted, held, released, retrying, finished) are appended here;
the supervisor appends started, checkpoint, stopping, preempted and exited.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trainq.watcher import __version__
from trainq.watcher.spec import events
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.jobspec import JobSpec
from trainq.watcher.spec.text import redact_value, redacted
from trainq.watcher.supervisor.snapshot import SnapshotRequest, redact

#: the folder holding the trainq package (a git checkout for an editable install): a train job's code
TRAINQ_SOURCE = Path(__file__).resolve().parent.parent.parent
#: interpreters whose first argument is the script (so the script, not the interpreter, is the code)
_PYTHON_NAMES = ("python", "python3")


def snapshot_request(
    spec: JobSpec,
    run: dict,
    argv: list[str],
    cwd: str,
    launch_env: dict[str, str],
    gpus: list[dict],
    root: Path,
    python: str,
) -> SnapshotRequest:
    """Describe this attempt's snapshot: resolved config, where the code is, what it reads, which Python."""
    named = _named_paths(argv, cwd)
    config = _resolved_config(spec, run, argv, cwd, launch_env)
    sources: tuple[str, ...]
    models: tuple[str, ...]
    code_dir: str | None
    interpreter: str | None
    files: tuple[str, ...]
    if spec.is_train:
        sources, models = _train_sources(spec.train or {}, cwd)
        code_dir, interpreter, files = str(TRAINQ_SOURCE), python, ()
    else:
        sources, models = tuple(str(p) for p in named), ()
        code_dir = cwd if spec.cwd else _script_dir(argv, named)
        interpreter = _interpreter(argv, launch_env)
        files = tuple(str(p) for p in named if p.is_file())
    return SnapshotRequest(
        config=config,
        code_dir=code_dir,
        named=files,
        sources=sources,
        models=models,
        python=interpreter,
        gpus=tuple(gpus),
        job_env=tuple(spec.env),
        cache_dir=str(root / ".cache"),
    )


def _resolved_config(spec: JobSpec, run: dict, argv: list[str], cwd: str, env: dict[str, str]) -> dict:
    """The job after placeholders and defaults (durations in seconds); secrets redacted by name and by value
    (env values and command arguments wholly, credential shapes anywhere)."""
    config = spec.to_dict()
    config.update(cwd=cwd, env=redact(env), trainq_version=__version__)
    if not spec.is_train:
        config["command"] = [redact_value(a) for a in argv]
    for key in ("sweep", "lineage"):
        if run.get(key):
            config[key] = run[key]
    clean = redacted(config)
    assert isinstance(clean, dict)  # redaction keeps a value's shape
    return clean


def _named_paths(argv: list[str], cwd: str) -> list[Path]:
    """Existing files and folders the arguments name (``--data=x`` too), relative ones against ``cwd``."""
    found: list[Path] = []
    for i, item in enumerate(argv):
        if i == 0 and not _is_own_code(item):
            continue
        for candidate in (item, item.partition("=")[2]):
            if not candidate or len(candidate) > 4096 or "\0" in candidate:
                continue
            path = Path(cwd, candidate) if not os.path.isabs(candidate) else Path(candidate)
            if path.exists() and path not in found:
                found.append(path)
                break
    return found


def _is_own_code(argv0: str) -> bool:
    """``./train.sh`` is the job's code; ``python3`` or ``/usr/bin/python3`` (an installed program) is not."""
    if "/" not in argv0:
        return False
    folder = os.path.dirname(os.path.abspath(argv0))
    on_path = {os.path.abspath(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p}
    return folder not in on_path and not Path(argv0).name.startswith(_PYTHON_NAMES)


def _script_dir(argv: list[str], named: list[Path]) -> str | None:
    """The folder of the first file the command names (its script), when no cwd was given."""
    first = next((p for p in named if p.is_file()), None)
    return str(first.resolve().parent) if first else None


def _interpreter(argv: list[str], env: dict[str, str]) -> str | None:
    """The job's Python (its first argument), as a path; None for other programs."""
    if not argv or not os.path.basename(argv[0]).startswith(_PYTHON_NAMES):
        return None
    if "/" in argv[0]:
        return os.path.abspath(argv[0])
    return shutil.which(argv[0], path=env.get("PATH") or os.environ.get("PATH"))


def _train_sources(train: dict, cwd: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The data files of a ``train:`` block, and its model folder (hashed with a smaller bound)."""
    data = train.get("data")
    files: list[object] = []  # what the file says; only strings are paths
    if isinstance(data, str):
        files.append(data)
    elif isinstance(data, dict):
        parts = data.get("train")
        for part in parts if isinstance(parts, list) else [parts]:
            files.append(part.get("path") if isinstance(part, dict) else part)
        files.append(data.get("eval"))
    resolve = lambda p: os.path.join(cwd, os.path.expanduser(p))  # noqa: E731 - absolute paths stay
    sources = tuple(resolve(f) for f in files if isinstance(f, str))
    model = train.get("model")
    return sources, ((resolve(model),) if isinstance(model, str) else ())


def gpu_facts(machine, given: list[int]) -> list[dict]:
    """Index, name and memory of each GPU given, from the admission's machine sample."""
    gpus = getattr(machine, "gpus", ()) or ()
    return [
        {"index": g.index, "name": g.name, "memory_total_mb": g.memory_total_mb, "simulated": g.simulated}
        for g in gpus
        if g.index in given
    ]


# ---------------------------------------------------------------- the watcher's events


def accepted(paths: JobPaths, run: dict, file_name: str, submitted_at: float | None, now: float) -> None:
    """``submitted`` (when the file landed) and ``accepted`` (now), in one write."""
    events.append(
        paths,
        events.event("submitted", submitted_at or now, file=file_name),
        events.event("accepted", now, priority=run.get("priority"), sweep=run.get("sweep"), lineage=run.get("lineage")),
    )


def rejected(paths: JobPaths, run: dict, file_name: str, submitted_at: float | None, now: float) -> None:
    events.append(
        paths,
        events.event("submitted", submitted_at or now, file=file_name),
        events.event("finished", now, status="rejected", error=run.get("error")),
    )


def finished(paths: JobPaths, run: dict, now: float) -> None:
    diagnosis = run.get("diagnosis") or {}
    events.emit(
        paths,
        "finished",
        now,
        status=run.get("status"),
        attempts=run.get("attempt"),
        diagnosis=diagnosis.get("kind"),
        error=run.get("error"),
        reason=run.get("reason"),
    )
