"""Checkpoint folders on disk: write to ``step-N.tmp/``, manifest last, rename, then move the links and rotate.

A checkpoint is complete when ``manifest.json`` (every other file's size and sha256, written last) matches
the folder. ``ckpt_latest`` and ``ckpt_best`` are relative symlinks to ``step-N`` folders, replaced atomically.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from trainq.watcher.spec.contract import CHECKPOINT_PREFIX, CKPT_BEST, CKPT_LATEST, EXIT_USAGE
from trainq.watcher.spec.fsutil import atomic_write_json, sha256_file

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
#: our own resume state inside a checkpoint (step, config, best eval loss, adapter fingerprint)
STATE_FILE = "trainq_state.json"
#: files above this size are checked by size only when verifying (hashing them would stall resume)
HASH_LIMIT_BYTES = 512 * 1024 * 1024
_STEP_DIR = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}(\d+)$")


class CheckpointError(Exception):
    """Raised when a checkpoint cannot be resumed from (incomplete, weights-only, mismatched); one line."""

    exit_code = EXIT_USAGE


def step_dir_name(step: int) -> str:
    """``step-000400``."""
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def step_of(path: Path) -> int | None:
    """The step number of a ``step-N`` folder name, else None."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make renames inside ``path`` durable."""
    _fsync_file(path)


def seal(folder: Path) -> dict:
    """Make every file readable and durable, then write the manifest last; return it."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        path.chmod(0o644)  # safetensors writes 0600
        _fsync_file(path)
        files[str(path.relative_to(folder))] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"complete": True, "files": files}
    atomic_write_json(folder / MANIFEST, manifest)
    return manifest


def verify(folder: Path) -> dict:
    """Return the manifest of a complete checkpoint; CheckpointError saying what is wrong otherwise."""
    manifest_path = folder / MANIFEST
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    if not manifest_path.is_file():
        if step_of(folder) is not None or folder.name.endswith(".tmp") or (folder / STATE_FILE).is_file():
            raise CheckpointError(
                f"{folder}: incomplete checkpoint (no {MANIFEST}: the save was interrupted); resume from an older step-N or ckpt_latest"
            )
        raise CheckpointError(
            f"{folder}: not a resumable checkpoint (weights only, no {MANIFEST}); give a checkpoints/step-N folder"
        )
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    for name, info in manifest["files"].items():
        _verify_file(folder, name, info)
    return manifest


def _verify_file(folder: Path, name: str, info: dict) -> None:
    path = folder / name
    if not path.is_file() or path.stat().st_size != info["size"]:
        raise CheckpointError(
            f"{folder}: {name} is missing or has the wrong size; the checkpoint is damaged, resume from an older one"
        )
    if info["size"] <= HASH_LIMIT_BYTES and sha256_file(path) != info["sha256"]:
        raise CheckpointError(f"{folder}: {name} does not match its sha256 in {MANIFEST}; the checkpoint is damaged")


def is_complete(folder: Path) -> bool:
    """True when ``verify`` passes."""
    try:
        verify(folder)
    except (CheckpointError, OSError, ValueError, KeyError):
        return False
    return True


def step_folders(ckpt_dir: Path) -> list[Path]:
    """``step-N`` folders (not ``.tmp``), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and not p.is_symlink() and step_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p) or 0)


def newest_complete(ckpt_dir: Path) -> Path | None:
    """The highest-step complete checkpoint, or None."""
    for folder in reversed(step_folders(ckpt_dir)):
        if is_complete(folder):
            return folder
    return None


def resolve_resume(path: Path) -> Path:
    """The folder to resume from: a named step-N must be complete; ckpt_latest (or checkpoints/) means the newest complete."""
    ckpt_dir = _checkpoints_dir_named_by(path)
    if ckpt_dir is not None:
        found = newest_complete(ckpt_dir)
        if found is None:
            raise CheckpointError(f"{path}: no complete checkpoint in {ckpt_dir}; start without --resume-from")
        return found
    folder = path.resolve()
    verify(folder)
    return folder


def _checkpoints_dir_named_by(path: Path) -> Path | None:
    """The checkpoints/ folder when ``path`` is ckpt_latest or checkpoints/ itself, else None."""
    if path.name == CKPT_LATEST:
        return path.parent
    if path.is_dir() and not path.is_symlink() and step_of(path) is None and (path / CKPT_LATEST).is_symlink():
        return path
    return None


def point_link(ckpt_dir: Path, link_name: str, target: Path) -> None:
    """Atomically make ``ckpt_dir/link_name`` a relative symlink to ``target`` (symlink to a temp name, rename)."""
    tmp = ckpt_dir / f".{link_name}.{os.getpid()}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target.name, tmp)
    os.replace(tmp, ckpt_dir / link_name)


def link_target(ckpt_dir: Path, link_name: str) -> Path | None:
    """Where a link points (resolved inside ``ckpt_dir``), or None."""
    link = ckpt_dir / link_name
    if not link.is_symlink():
        return None
    return ckpt_dir / os.readlink(link)


def rotate(ckpt_dir: Path, keep: int) -> list[Path]:
    """Delete complete step folders beyond the newest ``keep``, never a link target; also stale ``.tmp`` folders."""
    protected = {p.name for p in (link_target(ckpt_dir, CKPT_LATEST), link_target(ckpt_dir, CKPT_BEST)) if p}
    folders = step_folders(ckpt_dir)
    removed = []
    for folder in folders[: max(len(folders) - keep, 0)]:
        if folder.name not in protected:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    for stale in ckpt_dir.glob(f"{CHECKPOINT_PREFIX}*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    return removed


def begin(ckpt_dir: Path, step: int) -> Path:
    """A fresh ``step-N.tmp`` folder to write into."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / f"{step_dir_name(step)}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish(tmp: Path) -> Path:
    """Seal ``step-N.tmp`` and rename it to ``step-N`` (replacing an older folder of the same step)."""
    seal(tmp)
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    old = final.with_name(final.name + ".old")
    if final.exists():  # the same step saved again after a rollback
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(folder: Path) -> dict:
    """The trainq state saved inside a checkpoint."""
    try:
        return json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no {STATE_FILE}; not a trainq checkpoint") from None


def load_initial_weights(model, folder: Path, full: bool) -> int:
    """Load a checkpoint's weights into a freshly built model (``trainq fork --from-checkpoint``); returns the count.

    Only the weights: the optimizer, scheduler and step start fresh. The checkpoint is verified
    against its manifest first, and every tensor must land on a parameter of the same shape, so
    a fork never trains on from a silently fresh adapter (transformers#24252, axolotl#1134).
    """
    import torch
    from safetensors.torch import load_file

    folder = resolve_resume(Path(folder))
    verify(folder)
    names = ["model.safetensors"] if full else ["adapter_model.safetensors"]
    files = [folder / n for n in names if (folder / n).is_file()] or sorted(folder.glob("model-*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no {' or '.join(names)} to take initial weights from")
    state: dict = {}
    for path in files:
        state.update(load_file(str(path)))
    if full:
        targets = dict(model.named_parameters())
        wanted = state
    else:
        from peft import get_peft_model_state_dict

        targets = get_peft_model_state_dict(model)
        wanted = {k: v for k, v in state.items() if k in targets}
    missing = sorted(set(targets) - set(wanted)) if not full else []
    if not wanted or missing:
        raise CheckpointError(
            f"{folder}: its weights do not fit this model ({len(wanted)} of {len(targets)} tensors "
            f"match{'; missing ' + ', '.join(missing[:3]) if missing else ''}); fork with the "
            "same model and lora settings"
        )
    for key, tensor in wanted.items():
        if tuple(tensor.shape) != tuple(targets[key].shape):
            raise CheckpointError(
                f"{folder}: {key} has shape {tuple(tensor.shape)}, this model's is "
                f"{tuple(targets[key].shape)}; fork with the same lora.r and model"
            )
    if full:
        model.load_state_dict(wanted, strict=False)
    else:
        from peft import set_peft_model_state_dict

        with torch.no_grad():
            set_peft_model_state_dict(model, wanted)
    return len(wanted)
