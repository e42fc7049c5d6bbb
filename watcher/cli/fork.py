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

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import InvalidJobSpec, Problem
from trainq.watcher.spec.folders import JobState
from trainq.watcher.spec.fsutil import atomic_write
from trainq.watcher.daemon.jobs import latest_checkpoint
from trainq.watcher.spec.jobspec import JobSpec, parse_mapping, read_spec_text
from trainq.watcher.cli.submit import inbox_name
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
    return None


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
    if from_checkpoint:
        checkpoint = latest_checkpoint(JobPaths(job_dir), running=job_dir.parent.name == "running")
        if checkpoint is None:
            raise InvalidJobSpec(display, [Problem("from_checkpoint", f"job {job_id} has no checkpoint yet "
                                                                      "(no checkpoint record, no checkpoints/ckpt_latest, "
                                                                      "no complete checkpoint-N, step-N or *.ckpt)")])
        data["from_checkpoint"] = checkpoint
    JobSpec.from_dict(data, display)  # the validator's own errors, before anything is written
    return data


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
    """Write the fork into the inbox atomically (hidden temp name, then rename); returns its path."""
    target = inbox_name(inbox, f"{job_id}-fork.yaml")
    text = f"# forked by trainq from {job_id}\n" + json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    tmp = inbox / f".{target.name}.tmp"
    atomic_write(tmp, text)
    os.replace(tmp, target)
    return target
