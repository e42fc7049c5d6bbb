"""A full disk degrades the watcher, never kills it: on a real 4 MB tmpfs, with a real watcher process.

Needs root (mount -t tmpfs); skipped with the reason otherwise.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import PY, REPO, wait_until


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MB tmpfs mounted at tmp_path/disk; unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (mount -t tmpfs)")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(path: Path) -> None:
    """Write ``path`` until the disk is full."""
    chunk = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    with open(path.with_suffix(".small"), "wb", buffering=0) as f:  # the last partial pages too
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def job_file(root: Path, name: str, command: list[str]) -> Path:
    staged = root / ".staging" / f"{name}.yaml"
    staged.parent.mkdir(exist_ok=True)
    staged.write_text(yaml.safe_dump({"approved": True, "command": command}))
    return staged


def read_status(root: Path) -> dict | None:
    try:
        return json.loads((root / "status.json").read_text())
    except (OSError, ValueError):
        return None


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tmp") if ".staging" not in p.parts]


def test_full_disk_keeps_the_watcher_alive_records_the_true_outcome_and_resumes(small_disk, tmp_path):
    root = small_disk / "queue"
    for name in ("inbox", "pending", "running", "done", "failed"):
        (root / name).mkdir(parents=True)
    (root / "watcher.yaml").write_text("status_s: 0.3\nrescan_s: 0.5\nsettle_s: 0.1\n")
    go = tmp_path / "go"  # off the small disk: tells the running job to exit 0
    waits = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
    later = job_file(root, "later", [PY, "-c", "pass"])
    stderr = open(tmp_path / "watcher.stderr", "wb")  # off the small disk
    watcher = subprocess.Popen(
        [PY, "-m", "trainq.watcher", "--root", str(root), "watch"],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )
    seen_full = threading.Event()
    stop_watching = threading.Event()

    def watch_status() -> None:
        while not stop_watching.is_set():
            snap = read_status(root)
            if snap and snap["watcher"].get("disk_full") and "disk full" in " ".join(snap["watcher"]["problems"]):
                seen_full.set()
            time.sleep(0.02)

    reader = threading.Thread(target=watch_status, daemon=True)
    try:
        os.rename(job_file(root, "long", [PY, "-c", waits]), root / "inbox" / "long.yaml")
        wait_until(lambda: (root / "running" / "long" / "supervisor.json").exists(), 30, 0.05, what="long running")
        reader.start()
        fill(small_disk / "filler")
        os.rename(later, root / "inbox" / "later.yaml")  # a rename needs no space; claiming it fails
        wait_until(
            lambda: b"disk full" in (tmp_path / "watcher.stderr").read_bytes(),
            30,
            0.1,
            what="the watcher to notice the full disk",
        )
        wait_until(seen_full.is_set, 15, 0.1, what="status.json to say disk full (the watcher gave up its reserve)")
        assert not (root / ".trainq-reserve").exists()
        fill(small_disk / "filler2")  # what the reserve gave back is gone too
        go.touch()  # the job exits 0 while its exit record cannot be written
        time.sleep(2)  # it keeps going: watching, retrying, accepting nothing
        assert watcher.poll() is None, "the watcher died on a full disk"
        assert (root / "inbox" / "later.yaml").exists(), "a job was accepted while the disk was full"
        assert (root / "running" / "long").is_dir(), "the job's end was guessed from a failed write"
        assert not (root / "running" / "long" / "exit.json").exists()  # its supervisor retries under its lock
        assert not temp_files(root), temp_files(root)
        assert list((root / "pending").iterdir()) == [], "a failed claim left a folder in pending/"

        freed_at = time.time()
        for filler in small_disk.glob("filler*"):  # space frees: it carries on by itself
            filler.unlink()
        wait_until(lambda: (root / "done" / "long" / "run.json").exists(), 30, 0.1, what="long in done/")
        record = json.loads((root / "done" / "long" / "exit.json").read_text())
        assert record["exit_code"] == 0 and (root / "done" / "long" / "exit.json").stat().st_mtime >= freed_at - 1
        wait_until(lambda: (root / "done" / "later" / "run.json").exists(), 30, 0.1, what="later accepted and run")
        run = json.loads((root / "done" / "long" / "run.json").read_text())
        assert run["status"] == "done" and run["attempts"][-1]["exit_code"] == 0
        wait_until(
            lambda: (read_status(root) or {}).get("watcher", {}).get("disk_full") is False,
            10,
            0.1,
            what="status.json to say the disk is fine again",
        )
        assert watcher.poll() is None
        assert (root / ".trainq-reserve").stat().st_blocks * 512 >= 256 * 1024, "the reserve is taken back"
        snap = read_status(root)
        assert snap["watcher"]["pid"] == watcher.pid and snap["watcher"]["problems"] == []
        assert not temp_files(root), temp_files(root)
    finally:
        stop_watching.set()
        watcher.terminate()
        watcher.wait(timeout=30)
        go.touch()


def test_a_watcher_started_on_a_full_disk_stays_up_and_resumes(small_disk, tmp_path):
    """Was: a crash at start-up on every restart while the disk stayed full (a crash-looping service)."""
    root = small_disk / "queue"
    for name in ("inbox", "pending", "running", "done", "failed"):
        (root / name).mkdir(parents=True)
    (root / "watcher.yaml").write_text("status_s: 0.3\nrescan_s: 0.5\nsettle_s: 0.1\n")
    staged = job_file(root, "after", [PY, "-c", "pass"])
    fill(small_disk / "filler")
    os.rename(staged, root / "inbox" / "after.yaml")
    stderr = open(tmp_path / "watcher.stderr", "wb")
    watcher = subprocess.Popen(
        [PY, "-m", "trainq.watcher", "--root", str(root), "watch"],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )
    try:
        wait_until(
            lambda: b"disk full" in (tmp_path / "watcher.stderr").read_bytes(),
            30,
            0.1,
            what="the watcher to notice the full disk",
        )
        time.sleep(2)
        assert watcher.poll() is None, "the watcher died starting on a full disk"
        assert (root / "inbox" / "after.yaml").exists()
        for filler in small_disk.glob("filler*"):
            filler.unlink()
        wait_until(lambda: (root / "done" / "after" / "run.json").exists(), 30, 0.1, what="the job to run")
        assert watcher.poll() is None
        assert not temp_files(root), temp_files(root)
    finally:
        watcher.terminate()
        watcher.wait(timeout=30)
