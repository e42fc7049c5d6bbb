"""The attempt's snapshot: what ran, read by the supervisor just before it starts the job, written into ``snapshot/``
as the job starts (``read`` settles every record first; ``write`` then writes the four JSON files, so the job's start
does not wait for them).

The watcher's loop only describes what to record (``SnapshotRequest``, plain data in the LaunchSpec);
the reading, hashing and ``git`` calls happen here, in the job's own supervisor, so a slow disk or a
large repository delays that one job's start, never the queue (docs/records.md):

- ``code.json``: for a git working tree ``{"git": {"commit", "branch", "dirty", "untracked"}, "root"}``
  plus ``code.diff`` (``git diff --binary HEAD``: staged and unstaged changes) and ``untracked.tar`` (small
  untracked files, bounded); otherwise ``{"files": [{path, bytes, sha256}], "root"}`` for the files
  the command names, with a bounded copy in ``files.tar``;
- ``config.json``: the resolved job (built by the watcher);
- ``sources.json``: every path the job names or the trainer reads, ``[{path, bytes, sha256}]``;
- ``environment.json``: host, Python and its packages (cached per interpreter), torch and its CUDA,
  the NVIDIA driver, the GPUs given, and the names (never the values) of inherited variables.

Every size is bounded by a named constant below; what is left out is listed with why.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import tarfile
import time
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import IO, Any, cast

from trainq.watcher.spec.fsutil import (
    atomic_write,
    atomic_write_json,
    json_text,
    mode_beside,
    read_json,
    sha256_file,
    write_new,
)
from trainq.watcher.spec.text import redact_env

#: largest code.diff kept (bytes); a larger diff is not written (a cut diff cannot be applied)
MAX_DIFF_BYTES = 32 * 1024 * 1024
#: untracked (or, without git, named) files larger than this are listed but not copied (bytes)
MAX_ARCHIVED_FILE_BYTES = 1024 * 1024
#: most bytes copied into untracked.tar / files.tar
MAX_ARCHIVE_BYTES = 16 * 1024 * 1024
#: most untracked paths listed in code.json
MAX_LISTED = 1000
#: files larger than this are listed in sources.json with size but no sha256 (bytes)
MAX_HASHED_FILE_BYTES = 2 * 1024**3
#: in a model folder, only files up to this size are hashed (configs, tokenizer); weights get size and time
MAX_HASHED_MODEL_FILE_BYTES = 64 * 1024 * 1024
#: most files taken from one source folder
MAX_FILES_PER_SOURCE = 1000
#: how long one git command or the interpreter probe may take (seconds)
COMMAND_TIMEOUT_S = 60.0
#: every file an attempt's snapshot may hold (the previous attempt's are removed first)
SNAPSHOT_FILES = (
    "code.json",
    "code.diff",
    "untracked.tar",
    "files.tar",
    "config.json",
    "sources.json",
    "environment.json",
)


@dataclass(frozen=True)
class SnapshotRequest:
    """What the watcher asks the supervisor to record; JSON-able (it travels inside the LaunchSpec)."""

    config: dict
    code_dir: str | None = None  # where the job's code lives (its cwd, or the folder of the script it names)
    named: tuple[str, ...] = ()  # files the command names (the manifest when code_dir is no git tree)
    sources: tuple[str, ...] = ()  # data paths the job names or the trainer reads
    models: tuple[str, ...] = ()  # model folders the trainer reads (hashed with the smaller bound)
    python: str | None = None  # the job's interpreter, when it is a Python
    gpus: tuple[dict, ...] = ()  # the GPUs given: index, name, memory_total_mb
    job_env: tuple[str, ...] = ()  # names the job's own ``env:`` sets (values recorded, secrets redacted)
    cache_dir: str | None = None  # where per-interpreter package lists are cached

    def to_dict(self) -> dict:
        """A shallow dict (tuples as lists): its values are built for this request alone, so nothing is copied
        (``dataclasses.asdict`` deep-copied the resolved config at every launch: about 5 % of the loop's CPU)."""
        return {f.name: _listed(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> SnapshotRequest:
        tuples = ("named", "sources", "models", "gpus", "job_env")
        fields: dict[str, Any] = {k: tuple(v) if k in tuples else v for k, v in d.items()}
        return cls(**fields)


def _listed(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def redact(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the values of secret-looking names, and secret-looking values, replaced by ``<redacted>``."""
    return redact_env(env)


@dataclass
class Taken:
    """A snapshot read before the job starts, its four records not written yet (``write`` does that)."""

    folder: Path
    records: dict[str, object]
    #: the code summary the ``started`` event carries
    code: dict


def take(request: SnapshotRequest, job_dir: str, attempt: int, env: dict[str, str]) -> dict:
    """Write snapshot/ for this attempt; returns the code summary the ``started`` event carries."""
    taken = read(request, job_dir, attempt, env)
    write(taken)
    return taken.code


def read(request: SnapshotRequest, job_dir: str, attempt: int, env: dict[str, str]) -> Taken:
    """Everything the snapshot says, read before the job starts: the code (git's state, with code.diff and the
    archives written beside it now), the sources' hashes, the environment. ``write`` then writes the four records
    while the job starts: what they hold was settled before it ran, and the job starts without waiting for them."""
    out = Path(job_dir) / "snapshot"
    previous = _clear_previous(out)
    code = code_record(request, out)
    code["attempt"] = attempt
    found = [s for p in request.sources for s in source_records(p, previous)]
    found += [s for p in request.models for s in source_records(p, previous, MAX_HASHED_MODEL_FILE_BYTES)]
    records: dict[str, object] = {
        "code.json": code,
        "config.json": {**request.config, "attempt": attempt},
        "sources.json": found,
        "environment.json": environment(request, attempt, env),
    }
    git = code.get("git") or {}
    summary = {"commit": git.get("commit"), "dirty": git.get("dirty"), "diff_sha256": git.get("diff_sha256")}
    return Taken(out, records, {k: v for k, v in summary.items() if v is not None})


def write(taken: Taken) -> None:
    """Write the four records ``read`` settled."""
    mode = mode_beside(taken.folder / "code.json")
    for name, record in taken.records.items():
        _write_new(taken.folder / name, record, mode)


def _write_new(path: Path, obj: object, mode: int) -> None:
    """Write one snapshot file straight under its name: ``_clear_previous`` removed every old one, so this is a
    create, not a replace, and a temp file plus a rename would only add a rename (four per attempt). A reader
    racing the write finds no file or JSON it cannot parse yet, both of which it takes as "not recorded"."""
    try:
        write_new(path, json_text(obj), mode)
    except FileExistsError:  # made meanwhile by someone else: replace it whole, as before
        atomic_write_json(path, obj, durable=False)


def _clear_previous(out: Path) -> list:
    """Make ``out`` for this attempt: the previous attempt's files removed; its sources.json (read first), whose
    hashes are reused where size and mtime did not change. A folder made just now holds nothing to read or remove
    (a first attempt: eight syscalls saved per job)."""
    try:
        out.mkdir()
        return []
    except FileExistsError:
        pass
    previous = read_sources(out)  # its hashes are reused where size and mtime did not change
    for name in SNAPSHOT_FILES:  # a rename over an old file makes ext4 flush it first (auto_da_alloc): ~5 ms each
        (out / name).unlink(missing_ok=True)
    return previous


# ---------------------------------------------------------------- code


def code_record(request: SnapshotRequest, out: Path) -> dict:
    """code.json's content (and code.diff / untracked.tar or files.tar beside it)."""
    code_dir = request.code_dir
    top = git_top(code_dir) if code_dir else None
    if code_dir and top is not None:
        return _git_record(top, Path(code_dir), out)
    files = [r for p in request.named for r in source_records(p, [])]
    archived = _archive(out / "files.tar", [(Path(f["path"]), f["path"].lstrip("/")) for f in files])
    return {"root": request.code_dir, "files": files, "archive": archived}


def git_top(code_dir: str) -> Path | None:
    """The top of the git working tree holding ``code_dir`` (a ``.git`` folder or file), or None."""
    here = Path(code_dir).resolve()
    for folder in (here, *here.parents):
        if (folder / ".git").exists():
            return folder
    return None


def _git_record(top: Path, code_dir: Path, out: Path) -> dict:
    commit = _git(top, "rev-parse", "--verify", "-q", "HEAD")
    branch = _git(top, "symbolic-ref", "--short", "-q", "HEAD")
    git: dict = {"commit": commit or None, "branch": branch or None}
    diff, too_large = _git_diff(top) if commit else (b"", False)
    untracked = [p for p in (_git(top, "ls-files", "--others", "--exclude-standard", "-z") or "").split("\0") if p]
    git["dirty"] = bool(diff) or too_large
    git["untracked"] = untracked[:MAX_LISTED]
    if len(untracked) > MAX_LISTED:
        git["untracked_more"] = len(untracked) - MAX_LISTED
    if diff:
        atomic_write(out / "code.diff", diff, durable=False)
        git["diff_sha256"] = hashlib.sha256(diff).hexdigest()
        git["diff_bytes"] = len(diff)
    if too_large:
        git["diff_left_out"] = f"larger than {MAX_DIFF_BYTES} bytes"
    record: dict[str, object] = {"git": git, "root": str(top), "cwd": os.path.relpath(code_dir.resolve(), top)}
    record["archive"] = _archive(out / "untracked.tar", [(top / p, p) for p in untracked])
    return record


def _git_env() -> dict[str, str]:
    """git must read the job's tree, never write its index (GIT_OPTIONAL_LOCKS=0), whatever we inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_OPTIONAL_LOCKS="0", LC_ALL="C", GIT_TERMINAL_PROMPT="0")
    return env


def _git(top: Path, *args: str) -> str | None:
    """One git command's stdout, stripped of its last newline; None when it fails."""
    try:
        done = subprocess.run(
            ["git", "-C", str(top), *args],
            capture_output=True,
            env=_git_env(),
            timeout=COMMAND_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode("utf-8", "surrogateescape").rstrip("\n") if done.returncode == 0 else None


def _git_diff(top: Path) -> tuple[bytes, bool]:
    """``git diff --binary HEAD`` up to MAX_DIFF_BYTES: (diff, False), or (b"", True) when larger."""
    argv = ["git", "-C", str(top), "diff", "--binary", "--no-ext-diff", "--no-color", "--no-textconv", "HEAD"]
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=_git_env()
        )
    except OSError:
        return b"", False
    with proc:
        data = cast(IO[bytes], proc.stdout).read(MAX_DIFF_BYTES + 1)  # a pipe (stdout=PIPE), never None
        if len(data) > MAX_DIFF_BYTES:
            proc.kill()
            return b"", True
        try:
            proc.wait(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            return b"", False
    return (data, False) if proc.returncode == 0 else (b"", False)


def _archive(tar_path: Path, members: list[tuple[Path, str]]) -> dict | None:
    """Copy small regular files into ``tar_path`` up to MAX_ARCHIVE_BYTES; says what it holds and left out."""
    taken, left_out, total = [], [], 0
    for path, name in members:
        try:
            st = path.lstat()
        except OSError:
            continue
        if not path.is_file() or path.is_symlink():
            left_out.append({"path": name, "why": "not a regular file"})
        elif st.st_size > MAX_ARCHIVED_FILE_BYTES:
            left_out.append({"path": name, "why": f"larger than {MAX_ARCHIVED_FILE_BYTES} bytes"})
        elif total + st.st_size > MAX_ARCHIVE_BYTES:
            left_out.append({"path": name, "why": f"the archive is full ({MAX_ARCHIVE_BYTES} bytes)"})
        else:
            taken.append((path, name))
            total += st.st_size
    if not taken:
        return {"file": None, "files": 0, "bytes": 0, "left_out": left_out[:MAX_LISTED]} if left_out else None
    tmp = tar_path.with_name(f".{tar_path.name}.tmp")
    with tarfile.open(tmp, "w") as tar:
        for path, name in taken:
            try:
                tar.add(path, arcname=name, recursive=False)
            except OSError as exc:
                left_out.append({"path": name, "why": exc.strerror or str(exc)})
    os.replace(tmp, tar_path)
    return {"file": tar_path.name, "files": len(taken), "bytes": total, "left_out": left_out[:MAX_LISTED]}


# ---------------------------------------------------------------- sources


def read_sources(snapshot_dir: Path) -> list:
    """The list in ``snapshot_dir``'s sources.json; [] when absent or not a list."""
    try:
        data = json.loads((snapshot_dir / "sources.json").read_bytes())
    except (OSError, ValueError):
        return []
    return data if isinstance(data, list) else []


def source_records(path: str, previous: list, max_hashed: int = MAX_HASHED_FILE_BYTES) -> list[dict]:
    """``[{path, bytes, sha256}]`` for a file, or for each file of a folder (bounded); [] when absent."""
    root = Path(path)
    known = {s.get("path"): s for s in previous if isinstance(s, dict)}
    if root.is_file():
        return [_file_record(root, known, max_hashed)]
    if not root.is_dir():
        return []
    records: list[dict] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if len(records) >= MAX_FILES_PER_SOURCE:
                records.append({"path": str(root), "left_out": f"more than {MAX_FILES_PER_SOURCE} files"})
                return records
            records.append(_file_record(Path(folder) / name, known, max_hashed))
    return records


def _file_record(path: Path, known: dict, max_hashed: int) -> dict:
    try:
        st = path.stat()
    except OSError as exc:
        return {"path": str(path), "bytes": None, "sha256": None, "why": exc.strerror}
    record = {"path": str(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    old = known.get(str(path)) or {}
    if old.get("bytes") == st.st_size and old.get("mtime_ns") == st.st_mtime_ns and old.get("sha256"):
        return {**record, "sha256": old["sha256"]}  # the previous attempt's hash: same size and time
    if st.st_size > max_hashed:
        return {**record, "sha256": None, "why": f"larger than {max_hashed} bytes: not hashed"}
    try:
        return {**record, "sha256": _sha256(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)}
    except OSError as exc:
        return {**record, "sha256": None, "why": exc.strerror}


@lru_cache(maxsize=4096)
def _sha256(path: str, _dev: int, _ino: int, _size: int, _mtime_ns: int) -> str:
    """sha256 of a file, memoised per (file identity, size, mtime) for a pooled supervisor's later attempts."""
    return sha256_file(path)


# ---------------------------------------------------------------- environment


def environment(request: SnapshotRequest, attempt: int, env: dict[str, str]) -> dict:
    """environment.json's content: where and with what this attempt runs; no inherited value is written."""
    facts = python_facts(request.python, request.cache_dir) if request.python else None
    own = {k: env[k] for k in request.job_env if k in env}
    inherited = sorted(k for k in env if k not in own and not k.startswith("TRAINQ_"))
    packages = (facts or {}).get("packages")
    return {
        "attempt": attempt,
        "host": socket.gethostname(),
        "os": _os_name(),
        "python": {k: v for k, v in (facts or {}).items() if k != "packages"} or None,
        "packages": packages,
        "torch": {"version": packages.get("torch"), "cuda": (facts or {}).get("torch_cuda")}
        if packages and "torch" in packages
        else None,
        "nvidia_driver": nvidia_driver(),
        "gpus": list(request.gpus),
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "env": redact(own),
        "inherited_env": inherited,
    }


def _os_name() -> str:
    """``Linux-6.1.0-x86_64`` from uname (platform.platform() also reads the interpreter binary: slow)."""
    u = os.uname()
    return f"{u.sysname}-{u.release}-{u.machine}"


#: how long a pooled supervisor reuses the NVIDIA driver version it read (seconds): a driver is only replaced
#: with no job on the GPUs, and a snapshot a minute late to see it is still the version the job loaded
DRIVER_CACHE_S = 60.0
_driver_seen: tuple[float, str | None] | None = None


def nvidia_driver() -> str | None:
    """The NVIDIA kernel module's version from /proc (no NVML call), or None; read at most once a DRIVER_CACHE_S."""
    global _driver_seen
    now = time.monotonic()
    if _driver_seen is None or now - _driver_seen[0] >= DRIVER_CACHE_S:
        _driver_seen = (now, _read_nvidia_driver())
    return _driver_seen[1]


def _read_nvidia_driver() -> str | None:
    try:
        text = Path("/proc/driver/nvidia/version").read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]*)", text)
    return match.group(1) if match else None


#: run by the job's interpreter (or in this process when it is ours): its version, packages, torch's CUDA
_FACTS_SCRIPT = r"""
import importlib.metadata as m, json, re, sys
packages = {}
for d in m.distributions():
    name = d.metadata["Name"]
    if name and name not in packages:
        packages[name] = d.version
cuda = None
try:
    text = m.distribution("torch").locate_file("torch/version.py").read_text()
    found = re.search(r"^cuda\b[^=\n]*=\s*['\"]?([^'\"\n]+)", text, re.M)
    cuda = None if not found or found.group(1).strip() == "None" else found.group(1).strip()
except Exception:
    pass
dirs = {p: __import__("os").stat(p).st_mtime_ns for p in sys.path if p and __import__("os").path.isdir(p)}
print(json.dumps({"executable": sys.executable, "version": sys.version.split()[0], "prefix": sys.prefix,
                  "packages": dict(sorted(packages.items(), key=lambda kv: kv[0].lower())), "torch_cuda": cuda,
                  "_dirs": dirs}))
"""


def python_facts(python: str, cache_dir: str | None) -> dict | None:
    """The interpreter's version, prefix, packages and torch's CUDA; cached until its package folders change."""
    cache = Path(cache_dir) / f"python-{hashlib.sha1(python.encode()).hexdigest()[:16]}.json" if cache_dir else None
    cached = read_json(cache) if cache else None
    if cached and _dirs_unchanged(cached.get("_dirs") or {}) and cached.get("_python") == python:
        return {k: v for k, v in cached.items() if not k.startswith("_")}
    facts = _probe(python)
    if facts is None:
        return None
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(cache, {**facts, "_python": python}, durable=False)
        except OSError:
            pass  # a cache only
    return {k: v for k, v in facts.items() if not k.startswith("_")}


def _dirs_unchanged(dirs: dict) -> bool:
    """Installing or removing a package changes its site-packages folder's mtime."""
    try:
        return bool(dirs) and all(os.stat(p).st_mtime_ns == t for p, t in dirs.items())
    except OSError:
        return False


def _probe(python: str) -> dict | None:
    try:
        done = subprocess.run(
            [python, "-c", _FACTS_SCRIPT], capture_output=True, timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
        return json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
