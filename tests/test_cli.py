"""The trainq command line: a thin layer over the files, with exit codes 0 / 2 (invalid input) / 1."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from conftest import PY, REPO, tick_until


def trainq(*args: str, root: Path | None = None, check_rc: int | None = None) -> subprocess.CompletedProcess:
    cmd = [PY, "-m", "trainq.watcher"] + (["--root", str(root)] if root else []) + list(args)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stdout + proc.stderr
    return proc


def test_init_creates_the_five_folders(tmp_path):
    root = tmp_path / "q"
    out = trainq("init", str(root), check_rc=0)
    assert {p.name for p in root.iterdir()} == {"inbox", "pending", "running", "done", "failed"}
    assert str(root) in out.stdout


def test_validate_lists_every_problem_with_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("approved: true\ncommand: [echo]\npriority: high\nresources: {gpus: -1, gpu: 2}\ntimeout: soon\n")
    good = tmp_path / "good.yaml"
    good.write_text("command: [echo, hi]\n")
    out = trainq("validate", str(good), str(bad), check_rc=2)
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith(f"{good}: ok, valid, awaiting approval")
    problems = [line for line in lines[1:]]
    assert len(problems) == 4, problems
    assert all(line.startswith(f"{bad}: ") for line in problems)
    for field in ("priority", "resources.gpus", "resources.gpu", "timeout"):
        assert any(f": {field}: " in line for line in problems), (field, problems)
    trainq("validate", str(good), check_rc=0)


def test_submit_approve_renames_in_atomically_and_never_clobbers(queue_dir, tmp_path):
    src = tmp_path / "job.yaml"
    src.write_text("# mine\napproved: false\ncommand: [echo, hi]\n")
    trainq("submit", str(src), "--approve", root=queue_dir, check_rc=0)
    trainq("submit", str(src), root=queue_dir, check_rc=0)
    inbox = sorted(p.name for p in (queue_dir / "inbox").iterdir())
    assert inbox == ["job-2.yaml", "job.yaml"]
    assert (queue_dir / "inbox" / "job.yaml").read_text() == "# mine\napproved: true\ncommand: [echo, hi]\n"
    assert "approved: false" in (queue_dir / "inbox" / "job-2.yaml").read_text()
    assert src.read_text().startswith("# mine\napproved: false")  # the user's file is untouched


def test_submit_refuses_an_invalid_file_with_exit_2(queue_dir, tmp_path):
    src = tmp_path / "bad.yaml"
    src.write_text("approved: true\n")
    out = trainq("submit", str(src), root=queue_dir, check_rc=2)
    assert "command" in out.stderr and str(src) in out.stderr
    assert list((queue_dir / "inbox").iterdir()) == []


def test_status_logs_stop_retry_over_the_files(queue_dir, watcher, write_job):
    w = watcher()
    write_job("hello", command=["sh", "-c", "echo hello-from-job; exit 3"])
    tick_until(w, lambda: (queue_dir / "failed" / "hello").exists())
    w.report.write(w, time.time(), force=True)
    status = json.loads(trainq("status", "--json", root=queue_dir, check_rc=0).stdout)
    assert status["counts"]["failed"] == 1
    assert "hello-from-job" in trainq("logs", "hello", root=queue_dir, check_rc=0).stdout
    assert "only for jobs in pending/ or running/" in trainq("stop", "hello", root=queue_dir, check_rc=2).stderr
    trainq("retry", "hello", root=queue_dir, check_rc=0)
    assert (queue_dir / "failed" / "hello" / "retry.flag").exists()
    trainq("stop", "nope", root=queue_dir, check_rc=2)
    text = trainq("status", root=queue_dir, check_rc=0).stdout
    assert "hello" in text


def test_help_is_fast():
    started = time.monotonic()
    trainq("--help", check_rc=0)
    assert time.monotonic() - started < 5  # the benchmark holds the real figure (<= 300 ms)
