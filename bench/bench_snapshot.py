"""How long an attempt's snapshot takes (issue 29): a git tree of SIZE_MB, dirty, with untracked files.

    .venv/bin/python bench/bench_snapshot.py [--size-mb 1024] [--files 2000] [--runs 5] [--keep DIR]

Builds the repository in a temporary folder (random bytes, so git cannot shortcut), commits it,
changes three tracked files, adds five small untracked files and one 5 MB one, then times
``snapshot.take`` as the supervisor runs it before exec: the first (which probes the interpreter's
packages) and the median of the next RUNS. Prints the figures with the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainq.watcher.supervisor import snapshot


def git(repo: Path, *args: str) -> None:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "b",
        "GIT_AUTHOR_EMAIL": "b@b",
        "GIT_COMMITTER_NAME": "b",
        "GIT_COMMITTER_EMAIL": "b@b",
    }
    subprocess.run(
        ["git", "-C", str(repo), "-c", "core.looseCompression=0", "-c", "core.compression=0", *args],
        check=True,
        capture_output=True,
        env=env,
    )


def build(repo: Path, size_mb: int, files: int) -> None:
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    per_file = size_mb * 1024 * 1024 // files
    for i in range(files):
        folder = repo / f"pkg{i % 20}"
        folder.mkdir(exist_ok=True)
        (folder / f"part{i}.bin").write_bytes(os.urandom(per_file))
    (repo / "train.py").write_text("print('train')\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "big")


def dirty(repo: Path) -> None:
    (repo / "train.py").write_text("print('train, changed')\n")
    for i in range(2):
        with open(repo / f"pkg{i}" / f"part{i}.bin", "r+b") as f:
            f.write(b"changed")
    for i in range(5):
        (repo / f"new{i}.py").write_text(f"X = {i}\n")
    (repo / "big_untracked.bin").write_bytes(os.urandom(5 * 1024 * 1024))


def time_take(repo: Path, job: Path, cache: Path) -> float:
    request = snapshot.SnapshotRequest(
        config={"command": ["python", "train.py"]},
        code_dir=str(repo),
        named=(str(repo / "train.py"),),
        sources=(str(repo / "train.py"),),
        python=sys.executable,
        cache_dir=str(cache),
    )
    start = time.perf_counter()
    snapshot.take(request, str(job), 1, dict(os.environ))
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--keep", help="build (or reuse) the repository here instead of a temporary folder")
    args = parser.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="trainq-bench-snapshot-"))
    repo, job, cache = work / "repo", work / "job", work / "cache"
    try:
        if not (repo / ".git").exists():
            t = time.perf_counter()
            build(repo, args.size_mb, args.files)
            dirty(repo)
            print(f"built a {args.size_mb} MB repository of {args.files} files in {time.perf_counter() - t:.1f} s")
        job.mkdir(exist_ok=True)
        shutil.rmtree(cache, ignore_errors=True)
        first = time_take(repo, job, cache)
        warm = [time_take(repo, job, cache) for _ in range(args.runs)]
        code = (job / "snapshot" / "code.json").read_text()
        diff_kb = (job / "snapshot" / "code.diff").stat().st_size / 1024
        print(
            f"snapshot of a dirty {args.size_mb} MB git tree: first {first:.3f} s (probes the packages), "
            f"then median {statistics.median(warm):.3f} s (min {min(warm):.3f}, max {max(warm):.3f}) over "
            f"{args.runs}; code.diff {diff_kb:.0f} KB; untracked.tar "
            f"{(job / 'snapshot' / 'untracked.tar').stat().st_size / 1024:.0f} KB; "
            f"'big_untracked.bin' left out: {'big_untracked.bin' in code}; load average "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}"
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
