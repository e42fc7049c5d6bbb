"""A job folder appears whole (issue 35 item 7): built under a hidden name, then renamed into place.

A claim (and a rejection, and a sweep's job) used to make the folder in ``pending/`` or ``failed/`` first and
write run.json into it after, so a reader listing the folder at the wrong moment found a job with no
run.json. Now the folder is built in ``ROOT/.claiming/`` and renamed in whole (Maildir's tmp → new), and a
watcher killed in between neither loses nor doubles the job.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from conftest import drop, run_json, wait_until

from trainq.watcher.daemon.containment import CRASH_EXIT_CODE

STATES = ("pending", "running", "done", "failed")


class HalfMadeFolders:
    """A tight reader on another thread: every job folder it can open must hold run.json and job.yaml."""

    def __init__(self, root: Path):
        self.root = root
        self.seen: list[str] = []
        self.looked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HalfMadeFolders:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            for state in STATES:
                try:
                    names = os.listdir(self.root / state)
                except FileNotFoundError:
                    continue
                for name in names:
                    if not name.startswith("."):
                        self._look(state, name)

    def _look(self, state: str, name: str) -> None:
        try:
            fd = os.open(self.root / state / name, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            return  # it moved on (a rename keeps it whole): the next listing finds it where it went
        try:
            self.looked += 1
            missing = [f for f in ("run.json", "job.yaml") if not _exists_at(fd, f)]
            if missing:
                self.seen.append(f"{state}/{name} without {', '.join(missing)}")
        finally:
            os.close(fd)


def _exists_at(fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def test_a_tight_reader_never_sees_a_half_made_folder_in_a_150_job_burst(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text("max_concurrent: 8\nrescan_s: 0.2\nsettle_s: 0.05\n")
    watcher_process()
    wait_until(lambda: (queue_dir / "status.json").exists(), 30)
    expected = 0
    with HalfMadeFolders(queue_dir) as reader:
        for i in range(150):
            if i % 3 == 0:  # rejected: a claim straight into failed/
                drop(queue_dir, f"bad-{i}.yaml", "approved: true\ncommand: ['true']\nresources: {gpus: -1}\n")
            elif i % 10 == 1:  # a sweep: its two jobs are written by the watcher
                drop(queue_dir, f"grid-{i}.yaml", "approved: true\ncommand: [echo, '{v}']\nsweep: {v: [a, b]}\n")
                expected += 1
            else:
                drop(queue_dir, f"ok-{i}.yaml", "approved: true\ncommand: ['true']\n")
            expected += 1

        def concluded() -> int:
            return sum(len([n for n in os.listdir(queue_dir / s) if not n.startswith(".")]) for s in ("done", "failed"))

        wait_until(lambda: concluded() == expected, 120, interval_s=0.2, what="every job concluded")
    assert reader.looked > 300, reader.looked  # it really looked while the folders appeared
    assert reader.seen == []
    assert not os.listdir(queue_dir / ".claiming")  # nothing left half-built


@pytest.mark.parametrize("point", ["claim-staged", "claim-placed"])
def test_a_watcher_killed_mid_claim_neither_loses_nor_doubles_the_job(queue_dir, watcher_process, tmp_path, point):
    marker = tmp_path / "runs.txt"
    (queue_dir / "watcher.yaml").write_text("rescan_s: 0.2\nsettle_s: 0.05\n")
    job = {"approved": True, "command": ["sh", "-c", f"echo ran >> '{marker}'"]}
    drop(queue_dir, "cj.yaml", json.dumps(job))
    crashing = watcher_process(env={"TRAINQ_WATCHER_CRASH": f"{point}:cj"})
    assert crashing.proc.wait(timeout=60) == CRASH_EXIT_CODE
    visible = [s for s in STATES if (queue_dir / s / "cj").exists()]
    if point == "claim-staged":  # built, not yet in place: no reader can see it; the inbox still holds the file
        assert visible == [] and (queue_dir / "inbox" / "cj.yaml").exists()
        assert os.listdir(queue_dir / ".claiming")
    else:  # in place, whole; the inbox name not yet dropped (one file, two names)
        assert visible == ["pending"] and (queue_dir / "inbox" / "cj.yaml").stat().st_nlink == 2
        assert (queue_dir / "pending" / "cj" / "run.json").exists()
    watcher_process()
    wait_until(lambda: run_json(queue_dir, "cj").get("status") == "done", 30, what="cj done")
    wait_until(lambda: not (queue_dir / "inbox" / "cj.yaml").exists(), 10)
    assert marker.read_text() == "ran\n"  # run once
    assert [n for s in STATES for n in os.listdir(queue_dir / s) if not n.startswith(".")] == ["cj"]
    assert not os.listdir(queue_dir / ".claiming")
