"""`trainq status` in a terminal: sections, 80 columns, literal user text, missing/stale files, --json, --follow."""
from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from trainq.watcher.units import iso_utc
from trainq.watcher.view import render_status

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"


def _snapshot(heartbeat_age_s: float = 1.0) -> dict:
    data = json.loads((DATA / "status_v1.json").read_text())
    data["watcher"]["heartbeat_at"] = iso_utc(time.time() - heartbeat_age_s)
    return data


def _text(snapshot: dict, width: int = 80) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(render_status(snapshot, width))
    return console.export_text()


def test_sections_and_facts_fit_80_columns() -> None:
    text = _text(_snapshot())
    for needle in ("Running (1)", "Pending (1)", "Awaiting approval (1)", "Recently finished (2)", "Machine",
                   "120/400", "loss 1.834", "910.5 tok/s", "ETA 6m 25s", "waiting for: 2.1 GB RAM free",
                   "failed (oom)", "advice: lower batch_size", "loss plot: done/tiny-1/loss.png",
                   "held by llama-lora-a", "inbox 2 · awaiting approval 1"):
        assert needle in text, needle
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "━" in text  # the progress bar


def test_narrow_terminal_still_fits() -> None:
    text = _text(_snapshot(), width=50)
    assert max(len(line) for line in text.splitlines()) <= 50 and "Running (1)" in text


def test_job_names_are_shown_literally() -> None:
    snapshot = _snapshot()
    snapshot["jobs"][0]["name"] = "[red]boom[/red] <b>"
    assert "[red]boom[/red] <b>" in _text(snapshot)


def test_stale_heartbeat_says_watcher_not_responding() -> None:
    assert "watcher not responding" in _text(_snapshot(heartbeat_age_s=600))
    assert "watcher not responding" not in _text(_snapshot(heartbeat_age_s=2))


def test_watcher_problems_such_as_a_full_disk_are_shown() -> None:
    snapshot = _snapshot()
    line = "disk full since 2026-11-30T19:00:00Z (status.json: No space left on device); no job is accepted"
    snapshot["watcher"].update(disk_full=True, problems=[line])
    assert "disk full since" in _text(snapshot, width=200)
    from trainq.watcher.html import render_html

    assert "disk full since" in render_html(snapshot, {})
    assert "disk full" not in _text(_snapshot())


def _status_cmd(status_path: Path, *, follow: bool = False, json_out: bool = False) -> list[str]:
    code = ("import sys; from pathlib import Path; from trainq.watcher.view import print_status; "
            f"sys.exit(print_status(Path(sys.argv[1]), follow={follow}, json_out={json_out}))")
    return [sys.executable, "-c", code, str(status_path)]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)


def test_missing_status_file_is_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "queue" / "status.json"
    for cmd in (_status_cmd(path), _status_cmd(path, json_out=True)):
        result = _run(cmd)
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr == f"no watcher has written {path} yet — start one with `trainq watch`\n"


def test_print_and_json(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    path.write_text(json.dumps(_snapshot()))
    printed = _run(_status_cmd(path))
    assert printed.returncode == 0 and "Running (1)" in printed.stdout
    as_json = _run(_status_cmd(path, json_out=True))
    assert as_json.returncode == 0 and as_json.stdout == path.read_text()


def _read_until(fd: int, needle: str, deadline_s: float = 30.0) -> str:
    seen = b""
    deadline = time.monotonic() + deadline_s
    while needle.encode() not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} never appeared in: {seen[-2000:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            seen += os.read(fd, 65536)
    return seen.decode("utf-8", "replace")


def test_follow_redraws_until_ctrl_c(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    path.write_text(json.dumps(_snapshot()))
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "80", "LINES": "60", "PYTHONPATH": str(REPO), "TERM": "xterm"}
    proc = subprocess.Popen(_status_cmd(path, follow=True), stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=env)
    os.close(slave)
    try:
        _read_until(master, "Running (1)")
        changed = _snapshot()
        changed["jobs"][0]["progress"]["step"] = 321
        path.write_text(json.dumps(changed))
        _read_until(master, "321/400")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
