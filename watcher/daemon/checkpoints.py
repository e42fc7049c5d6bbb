"""Where a job resumes: the newest complete checkpoint it left, found with no trainq code in the job.

Newest first (docs/byot.md, how resume is found): a ``{"type": "checkpoint", "path": ...}`` record in metrics.jsonl;
``checkpoints/ckpt_latest``; the highest-numbered ``checkpoint-N`` (Hugging Face Trainer) below the
job folder; the highest ``step-N``; a Lightning ``*.ckpt`` (``last.ckpt`` first). A candidate that is
incomplete (an HF folder without its ``trainer_state.json``, which the Trainer writes last; a torch
file cut short) or, while the job runs, younger than ``SETTLE_S`` is never chosen; incomplete ones
are reported in ``Discovery.skipped`` so the caller can say so in output.log.

The walk is cheap: it runs only when an attempt ends, starts or is retried (never per tick), goes at
most ``MAX_DEPTH`` folders down, never into a checkpoint, and reads at most ``MAX_ENTRIES`` entries.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from trainq.watcher.daemon.diagnosis import read_metrics_tail
from trainq.watcher.spec.contract import RECORD_CHECKPOINT, JobPaths

#: a checkpoint modified less than this many seconds ago may still be being written (only while the job runs)
SETTLE_S = 5.0
#: how many folders below the job folder the walk looks (job/out/run-1/checkpoint-N is depth 3)
MAX_DEPTH = 4
#: most directory entries one walk reads, so a huge output tree costs bounded time
MAX_ENTRIES = 20000
#: bytes of metrics.jsonl's end searched for checkpoint records
RECORDS_TAIL_BYTES = 262144
#: the folder names of queue states a job folder moves between
_STATE_FOLDERS = ("pending", "running", "done", "failed")
#: file written last into an HF Trainer checkpoint folder
HF_STATE_FILE = "trainer_state.json"
#: the built-in trainer's completeness marker in a step-N folder
TRAINQ_MANIFEST = "manifest.json"

_HF_DIR = re.compile(r"^checkpoint-(\d+)$")
_STEP = re.compile(r"^step-(\d+)(\.(pt|pth|bin|ckpt|safetensors))?$")
_LIGHTNING_STEP = re.compile(r"step=(\d+)")
_SKIPPED_DIRS = {"__pycache__", "node_modules", "wandb", "mlruns"}

# kinds, best first: the order the contract lists them in
KIND_RECORD, KIND_LATEST, KIND_HF, KIND_STEP, KIND_LIGHTNING = "record", "ckpt_latest", "checkpoint-N", "step-N", "ckpt"


@dataclass(frozen=True)
class Discovery:
    """The chosen checkpoint (absolute path, or None) and the candidates passed over as incomplete."""

    path: str | None
    kind: str | None = None
    skipped: tuple[str, ...] = ()


@dataclass
class _Walk:
    """Candidates found below the job folder, by kind: (rank, path); higher rank is newer."""

    hf: list[tuple[tuple, Path]] = field(default_factory=list)
    step: list[tuple[tuple, Path]] = field(default_factory=list)
    ckpt: list[tuple[tuple, Path]] = field(default_factory=list)
    entries: int = 0


def find_checkpoint(paths: JobPaths, *, running: bool = False, now: float | None = None) -> Discovery:
    """The newest complete checkpoint of the job in ``paths`` (see the module docstring)."""
    now = time.time() if now is None else now
    skipped: list[str] = []

    def usable(path: Path, named: bool = False) -> bool:
        problem = incomplete_reason(path, running=running, now=now, named=named)
        if problem is None:
            return True
        if problem != _TOO_YOUNG:
            skipped.append(f"{path}: {problem}")
        return False

    for path in _recorded(paths):
        if usable(path, named=True):
            return Discovery(str(path), KIND_RECORD, tuple(skipped))
    latest = paths.ckpt_latest
    if os.path.lexists(latest) and latest.exists():
        resolved = latest.resolve()
        if usable(resolved, named=True):
            return Discovery(str(resolved), KIND_LATEST, tuple(skipped))
    walk = _Walk()
    _scan(paths.dir, walk)  # only below the job folder: an output dir outside it may be shared by other jobs
    for kind, found in ((KIND_HF, walk.hf), (KIND_STEP, walk.step), (KIND_LIGHTNING, walk.ckpt)):
        for _rank, path in sorted(found, key=lambda item: item[0], reverse=True):
            if usable(path):
                return Discovery(str(path), kind, tuple(dict.fromkeys(skipped)))
    return Discovery(None, None, tuple(dict.fromkeys(skipped)))


def checkpoint_mtime(path: str | os.PathLike) -> float | None:
    """When a checkpoint (file or folder) was last written: its own mtime or its newest file's; None when gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _newest_mtime(Path(path), st.st_mtime)


def latest_checkpoint(paths: JobPaths, running: bool = False) -> str | None:
    """The newest complete checkpoint's absolute path, or None (``running``: pass over ones still settling)."""
    return find_checkpoint(paths, running=running).path


# -- metrics records -----------------------------------------------------------------------------
def _recorded(paths: JobPaths) -> list[Path]:
    """Paths of checkpoint records, newest first, rebased onto the folder the job is in now."""
    found: list[Path] = []
    for record in reversed(read_metrics_tail(paths.metrics, max_bytes=RECORDS_TAIL_BYTES)):
        if record.get("type") != RECORD_CHECKPOINT or not isinstance(record.get("path"), str) or not record["path"]:
            continue
        path = rebase(Path(record["path"]), paths)
        if path not in found and os.path.lexists(path):
            found.append(path)
    return found


def rebase(path: Path, paths: JobPaths) -> Path:
    """A path recorded while the job folder was elsewhere (``…/running/ID/out/ckpt``) → the same file now.

    Job folders move between queue states by rename, and their checkpoints move with them. A
    relative path is taken relative to the job folder; a path outside any job folder stays as is.
    """
    if not path.is_absolute():
        return paths.dir / path
    parts = path.parts
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] == paths.dir.name and parts[i - 1] in _STATE_FOLDERS:
            return paths.dir.joinpath(*parts[i + 1 :])
    return path


# -- the walk ------------------------------------------------------------------------------------
def _scan(top: Path, walk: _Walk) -> None:
    """Collect checkpoint candidates below ``top``, breadth first (shallow output folders are seen before a
    deep data tree spends the entry budget), at most MAX_DEPTH down, never through a symlinked folder."""
    level = [top]
    for _depth in range(MAX_DEPTH + 1):
        below: list[str] = []
        for folder in level:
            if walk.entries >= MAX_ENTRIES:
                return
            below.extend(_scan_one(folder, walk))
        level = [Path(p) for p in sorted(below)]
        if not level:
            return


def _scan_one(folder: Path, walk: _Walk) -> list[str]:
    """Collect the checkpoints directly in ``folder``; return its other sub-folders."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    walk.entries += len(entries)
    subdirs = []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        if not _collect(entry, is_dir, walk) and is_dir and entry.name not in _SKIPPED_DIRS:
            subdirs.append(entry.path)
    return subdirs


def _collect(entry: os.DirEntry, is_dir: bool, walk: _Walk) -> bool:
    """Record ``entry`` if it is a checkpoint; True when it is one (the walk does not go inside)."""
    path = Path(entry.path)
    hf = _HF_DIR.match(entry.name)
    if hf and is_dir:
        walk.hf.append(((int(hf.group(1)), _mtime(entry)), path))
        return True
    step = _STEP.match(entry.name)
    if step and (is_dir or step.group(2)):
        walk.step.append(((int(step.group(1)), _mtime(entry)), path))
        return True
    if entry.name.endswith(".ckpt") and not is_dir:
        lightning = _LIGHTNING_STEP.search(entry.name)
        rank = (entry.name == "last.ckpt", int(lightning.group(1)) if lightning else -1, _mtime(entry))
        walk.ckpt.append((rank, path))
        return True
    return False


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


# -- completeness --------------------------------------------------------------------------------
_TOO_YOUNG = "too young"


def incomplete_reason(
    path: Path, *, running: bool = False, now: float | None = None, named: bool = False
) -> str | None:
    """Why ``path`` is not a checkpoint to resume from (None when it is one).

    ``named``: the job itself named it (a record, ckpt_latest), so only evidence of an interrupted
    save counts against it; a folder found by the walk must also hold something.
    """
    try:
        st = path.stat()
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if running and (now or time.time()) - _newest_mtime(path, st.st_mtime) < SETTLE_S:
        return _TOO_YOUNG
    if path.is_dir():
        return _folder_problem(path, named)
    return _file_problem(path, st.st_size)


def _newest_mtime(path: Path, mtime: float) -> float:
    """The folder's own mtime or its newest file's (files written in place do not touch the folder's)."""
    if not path.is_dir():
        return mtime
    try:
        return max([mtime] + [e.stat().st_mtime for e in os.scandir(path) if e.is_file()])
    except OSError:
        return mtime


def _folder_problem(path: Path, named: bool) -> str | None:
    try:
        names = set(os.listdir(path))
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if not names and not named:
        return "empty folder"
    if _HF_DIR.match(path.name) and HF_STATE_FILE not in names:
        return f"incomplete (no {HF_STATE_FILE}; the Trainer writes it last, so the save was interrupted)"
    if HF_STATE_FILE in names and not _is_json(path / HF_STATE_FILE):
        return f"incomplete ({HF_STATE_FILE} is not valid JSON)"
    return None


def _file_problem(path: Path, size: int) -> str | None:
    if size == 0:
        return "empty file"
    if path.suffix in (".ckpt", ".pt", ".pth") and not _is_complete_torch_file(path):
        return "incomplete (not a complete torch file: the save was cut short)"
    return None


#: largest trainer_state.json read to check it (the Trainer's, log history included, is far smaller)
MAX_STATE_BYTES = 64 << 20


def _open_regular(path: Path, follow: bool) -> BinaryIO | None:
    """``path`` opened for reading if it is a regular file, else None: the job made these files, and a
    FIFO must never block the watcher nor /dev/zero feed it without end (O_NONBLOCK, then fstat)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def _is_json(path: Path) -> bool:
    f = _open_regular(path, follow=False)
    if f is None:
        return False
    try:
        with f:
            json.loads(f.read(MAX_STATE_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return False
    return True


def _is_complete_torch_file(path: Path) -> bool:
    """torch.save writes a zip whose central directory comes last, so a cut-short one has none.

    Files in torch's legacy (pickle) format cannot be checked without loading them: they pass.
    (Symlinks are followed: Lightning's ``save_last: link`` makes last.ckpt one.)
    """
    f = _open_regular(path, follow=True)
    if f is None:
        return False
    try:
        with f:
            if f.read(2) != b"PK":
                return True
            return zipfile.is_zipfile(f)
    except OSError:
        return False


def note_skipped(log: Path, discovery: Discovery) -> None:
    """Append one ``trainq:`` line per skipped checkpoint to output.log, where the user reads the job's story."""
    if not discovery.skipped:
        return
    lines = "".join(f"trainq: skipped checkpoint {reason}\n" for reason in discovery.skipped)
    try:
        fd = os.open(log, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError:
        return  # a symlink or FIFO the job put there is never written through
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            lines = "\n" + lines  # the job's last line was unfinished (a progress bar ends in \r)
        os.write(fd, lines.encode("utf-8", errors="replace"))
    except OSError:
        pass
    finally:
        os.close(fd)
