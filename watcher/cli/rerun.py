"""``trainq rerun ID [--here|--at-snapshot]``: run a job again from its snapshot, with lineage ``rerun_of``.

The new job is ID's job.yaml (its config as the user wrote it, sweep values already concrete) plus
``rerun_of: ID``. Before writing it, today's code is compared with ID's ``snapshot/code.json``: a git
tree's commit, its uncommitted changes (``git diff --binary HEAD``) and its untracked files; or the
sha256 of each file the command named. When anything differs the rerun is refused, naming each
difference, unless ``--here`` (run today's tree) or ``--at-snapshot`` (check the saved commit out in a
scratch worktree under ``ROOT/worktrees/``, apply ``code.diff``, unpack ``untracked.tar``, and point the
job's cwd and arguments there).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

from trainq.watcher.cli.submit import inbox_name
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import Problem
from trainq.watcher.spec.fsutil import atomic_write, read_json, sha256_file
from trainq.watcher.spec.jobspec import JobSpec, parse_mapping, read_spec_text

#: where --at-snapshot checks saved code out (one folder per rerun), under the queue root
WORKTREES = "worktrees"
#: most differences named in a refusal
MAX_NAMED = 8


class RerunRefused(Exception):
    """Raised when a rerun cannot run the job's snapshot as asked; the message says why and what to do."""


def rerun_data(root: Path, job_dir: Path, job_id: str, mode: str | None) -> tuple[dict, list[str]]:
    """The new job's mapping and the notes to print; RerunRefused when the code drifted and no mode says what to do."""
    data = _job_mapping(job_dir)
    code = read_json(JobPaths(job_dir).snapshot / "code.json")
    if code is None:
        if mode == "at-snapshot":
            raise RerunRefused(
                f"job {job_id} has no snapshot/code.json (snapshot: false, or it never started); rerun it with --here"
            )
        notes = [f"job {job_id} has no code snapshot: running today's code"]
    else:
        drift = code_drift(code)
        notes = []
        if drift and mode is None:
            raise RerunRefused(
                f"job {job_id} ran code that differs from today's: {'; '.join(drift)}. "
                "Rerun with --here to run today's code, or --at-snapshot to run the saved code "
                "in a scratch worktree"
            )
        if mode == "at-snapshot" and "train" in data:
            raise RerunRefused(
                f"job {job_id} is a train job: its code is trainq itself, which --at-snapshot does "
                f"not check out ({'; '.join(drift) or 'no difference today'}); rerun it with --here"
            )
        if mode == "at-snapshot":
            scratch = at_snapshot(root, job_id, job_dir, code)
            _point_at(data, code, scratch)
            notes.append(f"code: the snapshot, checked out in {scratch}")
        elif drift:
            notes.append(f"code: today's tree ({'; '.join(drift)})")
    data.pop("fork_of", None)
    data.pop("from_checkpoint", None)
    data["rerun_of"] = job_id
    JobSpec.from_dict(data, f"rerun of {job_id}")  # the validator's own errors, before anything is written
    return data, notes


def _job_mapping(job_dir: Path) -> dict:
    text = read_spec_text(JobPaths(job_dir).spec)
    data = text if isinstance(text, Problem) else parse_mapping(text)
    if isinstance(data, Problem):
        raise RerunRefused(f"{job_dir.name}/job.yaml: {data.message}")
    return data


def write_rerun(inbox: Path, job_id: str, data: dict) -> tuple[Path, int]:
    """Write the rerun into the inbox atomically (hidden temp name, then rename); its path and inode."""
    target = inbox_name(inbox, f"{job_id}-rerun.yaml")
    text = f"# rerun by trainq of {job_id}\n" + json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    tmp = inbox / f".{target.name}.tmp"
    atomic_write(tmp, text)
    ino = os.stat(tmp).st_ino  # before the rename: a watcher may take it at once
    os.replace(tmp, target)
    return target, ino


# ---------------------------------------------------------------- is today's code the snapshot's?


def code_drift(code: dict) -> list[str]:
    """Each way today's code differs from the snapshot's, in words; [] when it is the same."""
    if "git" in code:
        return _git_drift(Path(code["root"]), code["git"])
    drift = []
    for f in code.get("files") or []:
        now = _sha256(Path(f["path"]))
        if now is None:
            drift.append(f"{f['path']} is gone")
        elif f.get("sha256") and now != f["sha256"]:
            drift.append(f"{f['path']} changed (sha256 {f['sha256'][:12]} then, {now[:12]} now)")
    return _capped(drift)


def _git_drift(top: Path, saved: dict) -> list[str]:
    if not (top / ".git").exists():
        return [f"{top} is no longer a git working tree"]
    drift = []
    commit = _git(top, "rev-parse", "--verify", "-q", "HEAD").decode().strip() or None
    if commit != saved.get("commit"):
        drift.append(f"commit {_short(saved.get('commit'))} then, {_short(commit)} now in {top}")
    diff = _git(top, "diff", "--binary", "--no-ext-diff", "--no-color", "--no-textconv", "HEAD") if commit else b""
    now_sha = hashlib.sha256(diff).hexdigest() if diff else None
    if now_sha != saved.get("diff_sha256"):
        changed = _git(top, "diff", "--name-only", "HEAD").decode(errors="replace").split() if commit else []
        drift.append(
            "uncommitted changes differ"
            + (f" (changed now: {', '.join(changed[:MAX_NAMED])})" if changed else " (none now)")
        )
    untracked = set(
        _git(top, "ls-files", "--others", "--exclude-standard", "-z").decode(errors="replace").split("\0")
    ) - {""}
    before = set(saved.get("untracked") or [])
    added, removed = sorted(untracked - before), sorted(before - untracked)
    if added or removed:
        words = [f"+{p}" for p in added[:MAX_NAMED]] + [f"-{p}" for p in removed[:MAX_NAMED]]
        drift.append(f"untracked files differ ({', '.join(words)})")
    return drift


def _git(top: Path, *args: str) -> bytes:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_OPTIONAL_LOCKS="0", LC_ALL="C")
    done = subprocess.run(["git", "-C", str(top), *args], capture_output=True, env=env, stdin=subprocess.DEVNULL)
    return done.stdout if done.returncode == 0 else b""


def _short(commit: str | None) -> str:
    return commit[:12] if commit else "(no commit)"


def _capped(items: list[str]) -> list[str]:
    return items if len(items) <= MAX_NAMED else [*items[:MAX_NAMED], f"and {len(items) - MAX_NAMED} more"]


def _sha256(path: Path) -> str | None:
    try:
        return sha256_file(path)
    except OSError:
        return None


# ---------------------------------------------------------------- --at-snapshot


def at_snapshot(root: Path, job_id: str, job_dir: Path, code: dict) -> Path:
    """Recreate the snapshot's code in a fresh folder under ROOT/worktrees/; its path."""
    scratch = root.resolve() / WORKTREES / f"{job_id}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    for n in range(2, 1000):
        if not scratch.exists():
            break
        scratch = scratch.with_name(f"{scratch.name.rsplit('~', 1)[0]}~{n}")
    scratch.parent.mkdir(parents=True, exist_ok=True)
    snap = JobPaths(job_dir).snapshot
    if "git" in code:
        _git_checkout(Path(code["root"]), code["git"], snap, scratch)
        archive = snap / "untracked.tar"
    else:
        scratch.mkdir()
        archive = snap / "files.tar"
    try:
        _unpack(archive, scratch, code.get("archive"))
    except RerunRefused:
        _discard(scratch, Path(code["root"]) if "git" in code else None)
        raise
    return scratch


def _discard(scratch: Path, top: Path | None) -> None:
    """Remove a scratch worktree a refused rerun made (and git's record of it), whatever it holds by now."""
    if top is not None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        subprocess.run(
            ["git", "-C", str(top), "worktree", "remove", "--force", "--force", str(scratch)],
            capture_output=True,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    shutil.rmtree(scratch, ignore_errors=True)
    if top is not None:
        subprocess.run(["git", "-C", str(top), "worktree", "prune"], capture_output=True, stdin=subprocess.DEVNULL)


def _git_checkout(top: Path, git: dict, snap: Path, scratch: Path) -> None:
    if not git.get("commit"):
        raise RerunRefused(f"{top} had no commit when the job ran; --at-snapshot needs one (use --here)")
    if git.get("diff_left_out"):
        raise RerunRefused(f"the job's uncommitted diff was not saved ({git['diff_left_out']}); use --here")
    diff = snap / "code.diff"
    if git.get("diff_sha256") and not diff.exists():
        raise RerunRefused(f"{diff} is missing; the saved changes cannot be applied (use --here)")
    _run_git(top, "worktree", "add", "--detach", str(scratch), git["commit"])
    if not git.get("diff_sha256"):
        return
    try:
        _run_git(scratch, "apply", "--binary", "--whitespace=nowarn", str(diff.resolve()))
    except RerunRefused:
        subprocess.run(["git", "-C", str(top), "worktree", "remove", "--force", str(scratch)], capture_output=True)
        raise


def _run_git(where: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, env=env, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        raise RerunRefused(f"git {args[0]} in {where} failed: {why[-1] if why else done.returncode}")


def _unpack(tar_path: Path, into: Path, archive: dict | None) -> None:
    """Unpack a snapshot archive (regular files only, never outside ``into``); say what it could not hold."""
    if archive and archive.get("left_out"):
        names = ", ".join(item["path"] for item in archive["left_out"][:MAX_NAMED])
        print(f"trainq: note: not in the snapshot (too large or not regular files): {names}")
    if not tar_path.exists():
        return
    try:
        with tarfile.open(tar_path) as tar:
            tar.extractall(into, filter="data")  # refuses absolute paths, .., links out, devices (PEP 706)
    except tarfile.FilterError as exc:
        raise RerunRefused(
            f"{tar_path}: unsafe member refused ({exc}); the saved code was not checked out (use --here)"
        ) from None
    except (tarfile.TarError, OSError, EOFError) as exc:
        why = "not a readable tar archive" if isinstance(exc, tarfile.ReadError) else " ".join(str(exc).split())
        raise RerunRefused(
            f"{tar_path}: cannot be unpacked ({why}); the saved code was not checked out (use --here)"
        ) from None


def _point_at(data: dict, code: dict, scratch: Path) -> None:
    """Rewrite cwd and arguments that named the old tree (or, without git, the named files) to the copy."""
    if "git" in code:
        old = str(Path(code["root"]))
        move = lambda s: str(scratch) + s[len(old) :] if s == old or s.startswith(old + "/") else s  # noqa: E731
    else:  # the named files were copied to scratch/<their absolute path>; a cwd holding them moves along
        named = {f["path"] for f in code.get("files") or []}
        folders = {str(Path(p).parent) for p in named}
        move = lambda s: str(scratch / s.lstrip("/")) if s in named or s in folders else s  # noqa: E731
    if isinstance(data.get("cwd"), str):
        data["cwd"] = move(data["cwd"])
    command = data.get("command")
    if isinstance(command, list):
        data["command"] = [move(a) if isinstance(a, str) else a for a in command]
    elif isinstance(command, str):
        data["command"] = [move(a) for a in shlex.split(command)]
