"""Pools (docs/cli.md, pools): a job's ``pool:`` and the per-pool pause flag at the queue root.

A pool is like a pueue group or a Slurm partition: watcher.yaml ``pools: {gpu: {max_concurrent: 2}}``
gives each its own limit, and ``ROOT/pause.POOL.flag`` (``trainq pause --pool POOL``) holds only
that pool's jobs, as ``ROOT/pause.flag`` holds every job.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: a pool's name: also part of its pause flag's file name
POOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FLAG = re.compile(r"^pause\.([A-Za-z0-9_-]{1,64})\.flag$")


def pool_pause_flag(root: Path, pool: str) -> Path:
    """``ROOT/pause.POOL.flag``: present, no job of POOL starts."""
    return Path(root) / f"pause.{pool}.flag"


def paused_pools(root: Path) -> set[str]:
    """The pools whose pause flag is present at the root."""
    try:
        names = os.listdir(root)
    except OSError:
        return set()
    return {m.group(1) for m in map(_FLAG.match, names) if m}


def unknown_pool_words(pool: str, limits: dict[str, int]) -> str | None:
    """Why a job's pool cannot run here (None: watcher.yaml has it, or it is the default pool)."""
    if pool in limits:
        return None
    return f"pool {pool!r} is not in watcher.yaml pools (known: {', '.join(sorted(limits))})"
