"""Delivery: copy a job's results off the box with rsync, then verify the copy on the receiving side.

``python -m trainq.watcher.supervisor.deliver JOB_DIR`` is the runner. It holds ``delivery.lock`` (so one
runner delivers a job at a time, across watcher restarts), gathers what ``deliver.what`` names into a
scratch folder of links, runs ``rsync -rtL --checksum`` into ``TO/<job id>/``, and verifies: every file's
sha256 on the receiving side must equal the sent file's, and the sent files must equal what
``SHA256SUMS`` lists for them. Each try is recorded in ``delivery.json``; a failed or unverified try is
retried with backoff (``--checksum`` then re-sends exactly what differs), and ``verified`` is true only
after a verification passed. For a remote target (``host:/path``, ``rsync://``) the receiving side is
checked by rsync itself: a ``--checksum --dry-run`` pass that would change nothing.

Only regular files inside the job folder are sent (docs/wall.md): every file's real path must lie
in the job folder's, so a ``checkpoints/ckpt_latest`` link, a link inside ``adapter/`` or a metrics
``checkpoint`` record naming ``/etc`` sends nothing from there; what is skipped is listed in the record's
``skipped`` with why. The scratch folder links each checked file by its real path (one link per file, so
rsync's ``-L`` follows only links this runner made), and rsync gets ``--protect-args`` and ``--`` before
its paths, so a target can never be read as an option.

The watcher's side (``DeliveryQueue``) keeps one marker file per due delivery in ``ROOT/.trainq-deliveries/``,
starts runners for markers without a live one, and copies each final ``delivery.json`` into run.json's
``delivered`` (daemon/walls.py).

Test switch: ``TRAINQ_DELIVERY_FAULTS=corrupt_once`` flips one byte of the first local copy after rsync,
before verification (the retry must detect and re-send it); ``backoff=S`` sets the first backoff.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.fsutil import atomic_write_json, read_json, remove_quietly, sha256_file
from trainq.watcher.spec.interpreter import safe_module_argv
from trainq.watcher.spec.records import read_metrics_tail
from trainq.watcher.spec.units import iso_utc
from trainq.watcher.spec.wall import DELIVERABLES, is_remote_target

#: tries before a delivery is given up (recorded, never reported verified)
MAX_TRIES = 6
#: seconds before the second try; doubled for each later one
FIRST_BACKOFF_S = 10.0
#: longest one rsync may run, seconds
RSYNC_TIMEOUT_S = 3600
#: the runner's record and lock in the job folder
RECORD_NAME, LOCK_NAME = "delivery.json", "delivery.lock"
#: the test switch
ENV_FAULTS = "TRAINQ_DELIVERY_FAULTS"
#: where the watcher keeps one marker per due delivery (named by job id)
DUE_DIR = ".trainq-deliveries"
#: rsync's options before the paths: --protect-args (-s) sends names to the remote side unsplit and unexpanded
RSYNC_OPTIONS = ("-rtLs", "--checksum")

logger = logging.getLogger(__name__)


def items_for(paths: JobPaths, what: list[str]) -> dict[str, Path]:
    """Name in the delivery → source path, for what ``what`` names and exists."""
    found: dict[str, Path] = {}
    if "adapter" in what:
        for name in ("adapter", "model"):
            if (paths.dir / name).is_dir():
                found[name] = paths.dir / name
    if "ckpt_best" in what and paths.ckpt_best.exists():
        found["ckpt_best"] = paths.ckpt_best.resolve()
    if "ckpt_latest" in what:
        latest = paths.ckpt_latest if paths.ckpt_latest.exists() else _latest_recorded(paths)
        if latest is not None:
            found["ckpt_latest"] = latest.resolve()
    groups = {
        "logs": (paths.log, paths.metrics, paths.run, paths.dir / "events.jsonl"),
        "summary": (paths.summary, paths.dir / "env.json", paths.loss_png, paths.dir / "SHA256SUMS"),
    }
    for group, files in groups.items():
        if group in what:
            found.update({f.name: f for f in files if f.is_file() and not f.is_symlink()})
    return found


def _latest_recorded(paths: JobPaths) -> Path | None:
    """A command job's newest ``checkpoint`` record in metrics.jsonl that still exists (inside or not: the
    files are checked one by one when the delivery is gathered)."""
    for record in reversed(read_metrics_tail(paths.metrics)):
        if record.get("type") == "checkpoint" and isinstance(record.get("path"), str):
            path = _in_job_folder(Path(record["path"]), paths.dir)
            if path is not None:
                return path
    return None


def regular_files(items: dict[str, Path], job_dir: Path) -> tuple[dict[str, Path], list[str]]:
    """Relative path in the delivery → the real path of a regular file inside the job folder; and what was
    skipped, one line each (a link out of the folder, a special file, a folder reached through a link)."""
    inside = os.path.realpath(job_dir)
    files: dict[str, Path] = {}
    skipped: list[str] = []
    for name, src in items.items():
        real = os.path.realpath(src)
        if not _is_within(real, inside):
            skipped.append(f"{name}: {src} is outside the job folder (it resolves to {real})")
        elif os.path.isdir(real):
            _walk(name, real, inside, files, skipped)
        else:
            _add_file(name, real, inside, files, skipped)
    for line in skipped:
        logger.warning("job %s: delivery skips %s", job_dir.name, line)
    return files, skipped


def _walk(name: str, top: str, inside: str, files: dict[str, Path], skipped: list[str]) -> None:
    for folder, dirs, names in os.walk(top, followlinks=False):
        rel_dir = os.path.relpath(folder, top)
        for d in dirs:
            if os.path.islink(os.path.join(folder, d)):
                skipped.append(f"{_rel(name, rel_dir, d)}: a link to a folder is not followed")
        for n in sorted(names):
            _add_file(_rel(name, rel_dir, n), os.path.realpath(os.path.join(folder, n)), inside, files, skipped)


def _rel(name: str, rel_dir: str, leaf: str) -> str:
    return "/".join(part for part in (name, "" if rel_dir == "." else rel_dir, leaf) if part)


def _add_file(rel: str, real: str, inside: str, files: dict[str, Path], skipped: list[str]) -> None:
    if not _is_within(real, inside):
        skipped.append(f"{rel}: links out of the job folder (to {real})")
        return
    try:
        mode = os.lstat(real).st_mode
    except OSError as exc:
        skipped.append(f"{rel}: cannot be read ({exc.strerror})")
        return
    if stat.S_ISREG(mode):
        files[rel] = Path(real)
    else:
        skipped.append(f"{rel}: not a regular file")


def _is_within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _in_job_folder(path: Path, job_dir: Path) -> Path | None:
    """A recorded checkpoint path, followed from running/ID/... to wherever the job folder is now."""
    if not path.is_absolute():
        path = job_dir / path
    if path.exists():
        return path
    parts = path.parts
    if job_dir.name in parts:  # written while the job was in running/: the same place under its folder now
        moved = job_dir.joinpath(*parts[len(parts) - parts[::-1].index(job_dir.name) :])
        return moved if moved.exists() else None
    return None


def manifest(files: dict[str, Path]) -> dict[str, dict]:
    """Relative path in the delivery → {bytes, sha256} of every file sent (``regular_files``' answer)."""
    return {rel: {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for rel, f in files.items()}


def sums_problem(paths: JobPaths, sent: dict[str, dict]) -> str | None:
    """Where a sent file differs from what the job's SHA256SUMS lists for it (the source itself changed)."""
    try:
        lines = (paths.dir / "SHA256SUMS").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        digest, _, name = line.partition("  ")
        if name in sent and sent[name]["sha256"] != digest:
            return f"{name} does not match SHA256SUMS in the job folder"
    return None


def verify_local(dest: Path, sent: dict[str, dict]) -> str | None:
    """The first file of the copy whose sha256 differs from the one sent, or None when all match."""
    for rel, info in sent.items():
        copy = dest / rel
        if not copy.is_file():
            return f"{rel} is missing at {dest}"
        if sha256_file(copy) != info["sha256"]:
            return f"{rel} at {dest} does not match what was sent (sha256 differs)"
    return None


def _rsync(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["rsync", *args], capture_output=True, text=True, timeout=RSYNC_TIMEOUT_S, stdin=subprocess.DEVNULL
    )


def send(stage: Path, dest: str) -> str | None:
    """rsync the staged links' targets into ``dest``; an error line, or None."""
    if not is_remote_target(dest):
        Path(dest).mkdir(parents=True, exist_ok=True)
    try:
        done = _rsync([*RSYNC_OPTIONS, "--", f"{stage}/", dest.rstrip("/") + "/"])
    except FileNotFoundError:
        return "rsync is not installed on this machine"
    except subprocess.TimeoutExpired:
        return f"rsync ran past {RSYNC_TIMEOUT_S} s"
    if done.returncode != 0:
        return f"rsync exited {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}"
    return None


def verify_remote(stage: Path, dest: str) -> str | None:
    """A checksum dry run that would change nothing means the receiving side holds exactly what was sent."""
    done = _rsync(
        [*RSYNC_OPTIONS, "--dry-run", "--itemize-changes", "--out-format=%n", "--", f"{stage}/", dest.rstrip("/") + "/"]
    )
    if done.returncode != 0:
        return f"rsync (verify) exited {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}"
    differ = [line for line in done.stdout.splitlines() if line.strip() and not line.endswith("/")]
    return f"{len(differ)} file(s) differ at {dest}, first {differ[0]}" if differ else None


def _stage(files: dict[str, Path]) -> Path:
    """A scratch folder holding one link per checked file (its real path), at its place in the delivery."""
    stage = Path(tempfile.mkdtemp(prefix="trainq-deliver-"))
    for rel, real in files.items():
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(real, stage / rel)
    return stage


def _faults() -> dict[str, str]:
    text = os.environ.get(ENV_FAULTS, "")
    return dict(item.partition("=")[::2] for item in text.split(",") if item)


def _corrupt_one(dest: Path, sent: dict[str, dict]) -> None:
    """The test switch: flip the first byte of the first non-empty file of the copy."""
    for rel, info in sent.items():
        if info["bytes"]:
            with open(dest / rel, "r+b") as f:
                first = f.read(1)
                f.seek(0)
                f.write(bytes([first[0] ^ 0xFF]))
            return


def _target(to: str, submitted_from: str | None, job_dir: Path) -> str:
    """``deliver.to`` with a relative local path resolved against the submitted-from folder (docs/contract.md),
    else the queue root holding the job folder; remote targets (``host:/path``, ``rsync://``) stay as written."""
    to = os.path.expanduser(to)
    if is_remote_target(to) or os.path.isabs(to):
        return to
    base = submitted_from if submitted_from and os.path.isabs(submitted_from) else str(job_dir.resolve().parent.parent)
    return os.path.join(base, to)


def deliver(job_dir: Path) -> int:
    """The runner's work: every try recorded in delivery.json, until verified or MAX_TRIES."""
    paths = JobPaths(job_dir)
    lock_fd = os.open(job_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another runner delivers this job
    from trainq.watcher.spec.jobspec import load_job_file

    spec = load_job_file(paths.spec)
    deliver_spec = spec.deliver or {}
    record = read_json(job_dir / RECORD_NAME) or {}
    dest = _target(
        deliver_spec["to"], spec.submitted_from or (read_json(paths.run) or {}).get("submitted_from"), job_dir
    )
    dest = dest.rstrip("/") + "/" + job_dir.name
    faults = _faults()
    backoff = float(faults.get("backoff") or FIRST_BACKOFF_S)
    for tries in range(int(record.get("tries") or 0) + 1, MAX_TRIES + 1):
        error, verified, sent, skipped = _one_try(
            paths, deliver_spec, dest, corrupt=tries == 1 and "corrupt_once" in faults
        )
        record = {
            "to": dest,
            "at": iso_utc(time.time()),
            "verified": verified,
            "files": sorted(sent),
            "bytes": sum(i["bytes"] for i in sent.values()),
            "tries": tries,
            "error": error,
            "skipped": skipped,
            "state": "verified" if verified else "retrying" if tries < MAX_TRIES else "gave_up",
        }
        atomic_write_json(job_dir / RECORD_NAME, record)
        if verified:
            break
        if tries < MAX_TRIES:
            time.sleep(backoff * 2 ** (tries - 1))
    os.close(lock_fd)
    return 0


def _one_try(paths: JobPaths, deliver_spec: dict, dest: str, corrupt: bool) -> tuple[str | None, bool, dict, list[str]]:
    files, skipped = regular_files(items_for(paths, list(deliver_spec.get("what") or DELIVERABLES)), paths.dir)
    if not files:
        what = ", ".join(deliver_spec.get("what") or DELIVERABLES)
        return f"nothing to deliver: none of {what} exists inside the job folder", False, {}, skipped
    sent = manifest(files)
    problem = sums_problem(paths, sent)
    if problem:
        return problem, False, sent, skipped
    stage = _stage(files)
    try:
        error = send(stage, dest)
        if error:
            return error, False, sent, skipped
        if corrupt and not is_remote_target(dest):
            _corrupt_one(Path(dest), sent)
        error = verify_remote(stage, dest) if is_remote_target(dest) else verify_local(Path(dest), sent)
        return error, error is None, sent, skipped
    finally:
        shutil.rmtree(stage, ignore_errors=True)


class DeliveryQueue:
    """The watcher's side: a marker file per due delivery; runners started for markers without a live runner."""

    def __init__(self, root: Path) -> None:
        self.due_dir = root / DUE_DIR
        self._runners: dict[str, subprocess.Popen] = {}

    def add(self, job_id: str) -> None:
        """Make a job's delivery due (durably: a crash before it ran still delivers)."""
        self.due_dir.mkdir(exist_ok=True)
        atomic_write_json(self.due_dir / job_id, {"job_id": job_id, "due_at": iso_utc(time.time())})

    def due(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.due_dir) if not e.name.startswith("."))
        except FileNotFoundError:
            return []

    def done(self, job_id: str) -> None:
        remove_quietly(self.due_dir / job_id)

    def ensure_runner(self, job_id: str, job_dir: Path) -> None:
        """Start a runner unless ours still runs (a runner left by an earlier watcher finds the lock and exits)."""
        proc = self._runners.get(job_id)
        if proc is not None and proc.poll() is None:
            return
        self._runners[job_id] = subprocess.Popen(
            [*safe_module_argv(sys.executable, "trainq.watcher.supervisor.deliver"), str(job_dir)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )

    def reap(self) -> None:
        for job_id, proc in list(self._runners.items()):
            if proc.poll() is not None:
                del self._runners[job_id]

    def close(self) -> None:
        """Runners go on delivering after the watcher exits; only forget them."""
        self._runners.clear()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m trainq.watcher.supervisor.deliver JOB_DIR", file=sys.stderr)
        return 2
    return deliver(Path(argv[0]))


if __name__ == "__main__":
    sys.exit(main())
