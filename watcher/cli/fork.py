"""``trainq fork ID [--set KEY=VALUE]… [--from-checkpoint]``: a new job file made from an existing job.

The fork is ID's job.yaml with the changes and ``fork_of: ID``, written into the inbox under a
temporary name and renamed in (as ``trainq submit`` does). It is validated first, exactly as the
watcher will: a ``--set`` naming an unknown field or a bad value fails with the validator's own
error and nothing is written. The watcher records ``lineage: {fork_of, parents}`` in run.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainq.watcher.daemon.jobs import latest_checkpoint
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import InvalidJobSpec, Problem
from trainq.watcher.spec.folders import JobState
from trainq.watcher.spec.fsutil import atomic_write
from trainq.watcher.spec.jobspec import JobSpec, parse_mapping, read_spec_text
from trainq.watcher.spec.sweeps import set_dotted
from trainq.watcher.spec.yaml12 import YamlError, load_yaml12


def find_job_dir(root: Path, job_id: str) -> Path | None:
    """The folder of job ``job_id`` in any state, or None."""
    if not job_id or job_id.startswith(".") or "/" in job_id:
        return None
    for state in JobState:
        path = root / state.value / job_id
        if (path / "job.yaml").exists():
            return path
    from trainq.watcher.cli.names import id_for_name

    named = id_for_name(root, job_id)  # AmbiguousName when several jobs carry it
    return find_job_dir(root, named) if named and named != job_id else None


def fork_data(job_dir: Path, job_id: str, sets: list[str], from_checkpoint: bool) -> dict:
    """ID's job mapping with ``--set`` changes, ``fork_of`` and maybe ``from_checkpoint``; InvalidJobSpec if invalid."""
    display = f"fork of {job_id}"
    text = read_spec_text(JobPaths(job_dir).spec)
    data = text if isinstance(text, Problem) else parse_mapping(text)
    if isinstance(data, Problem):
        raise InvalidJobSpec(f"{job_dir.name}/job.yaml", [data])
    data.pop("from_checkpoint", None)
    for item in sets:
        key, value = _parse_set(item, display)
        set_dotted(data, key, value)
    data["fork_of"] = job_id
    if "from_checkpoint" in data:  # --set from_checkpoint=PATH: the caller's path, made absolute now
        data["from_checkpoint"] = _checked_checkpoint(data["from_checkpoint"], display)
    if from_checkpoint:
        checkpoint = latest_checkpoint(JobPaths(job_dir), running=job_dir.parent.name == "running")
        if checkpoint is None:
            raise InvalidJobSpec(
                display,
                [
                    Problem(
                        "from_checkpoint",
                        f"job {job_id} has no checkpoint yet "
                        "(no checkpoint record, no checkpoints/ckpt_latest, "
                        "no complete checkpoint-N, step-N or *.ckpt)",
                    )
                ],
            )
        data["from_checkpoint"] = _checked_checkpoint(str((job_dir / checkpoint).resolve()), display)
    JobSpec.from_dict(data, display)  # the validator's own errors, before anything is written
    return data


def _checked_checkpoint(value: object, display: str) -> str:
    """An absolute path to an existing checkpoint (a relative one is taken from the caller's cwd, once, here)."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidJobSpec(display, [Problem("from_checkpoint", f"expected a checkpoint path (got {value!r})")])
    path = Path(os.path.expanduser(value)).resolve()
    if not path.exists():
        raise InvalidJobSpec(
            display, [Problem("from_checkpoint", f"{path} does not exist; name an existing checkpoint folder or file")]
        )
    return str(path)


def _parse_set(item: str, display: str) -> tuple[str, object]:
    key, eq, raw = item.partition("=")
    key = key.strip()
    if not eq or not key:
        raise InvalidJobSpec(display, [Problem("", f"--set {item!r}: write KEY=VALUE, e.g. --set train.lr=2e-4")])
    if key in ("sweep", "fork_of") or key.startswith("sweep."):
        raise InvalidJobSpec(display, [Problem(key, "is set by trainq fork itself or makes no sense in a fork")])
    try:
        value = load_yaml12(raw) if raw.strip() else ""
    except YamlError as exc:
        raise InvalidJobSpec(display, [Problem(key, f"--set value {raw!r} is not a YAML value: {exc}")]) from None
    return key, value


def write_fork(inbox: Path, job_id: str, data: dict) -> Path:
    """Write the fork into the inbox atomically (hidden temp name, then rename); returns its path.

    Its name is ``ID-fork.yaml``, or ``ID-fork-N.yaml`` for the first N whose id is free in the inbox and in
    every state folder, so the id the watcher gives it is the file's stem (fork_words says which).
    """
    target = _free_fork_name(inbox, job_id)
    text = f"# forked by trainq from {job_id}\n" + json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    tmp = inbox / f".{target.name}.tmp"
    atomic_write(tmp, text)
    os.replace(tmp, target)
    return target


def _free_fork_name(inbox: Path, job_id: str) -> Path:
    from trainq.watcher.spec.folders import _with_suffix, id_from_name

    root = inbox.parent
    base = id_from_name(f"{job_id}-fork.yaml")
    for n in range(1, 10_000):
        candidate = base if n == 1 else _with_suffix(base, n)
        taken = [p for p in (inbox / f"{candidate}.yaml", inbox / f"{candidate}.yml") if p.exists() or p.is_symlink()]
        if not taken and not any((root / s.value / candidate).exists() for s in JobState):
            return inbox / f"{candidate}.yaml"
    raise InvalidJobSpec(f"fork of {job_id}", [Problem("", "no free fork id (10,000 forks exist)")])


def fork_words(root: Path, target: Path, job_id: str, data: dict) -> str:
    """The line ``trainq fork`` prints: the id the fork gets, and which fork of ID it is."""
    fork_id = target.stem
    earlier = fork_id != f"{job_id}-fork"
    approval = "" if data.get("approved") is True else "; it awaits approval (set approved: true in it)"
    note = f" (an earlier fork of {job_id} holds {job_id}-fork)" if earlier else ""
    return f"job {fork_id}: fork of {job_id} submitted as inbox/{target.name}{note}{approval}"
