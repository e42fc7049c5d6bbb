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

from trainq.watcher.faces.view import Filters, render_status
from trainq.watcher.spec.units import iso_utc

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


def _lines(text: str) -> list[str]:
    return text.splitlines()


def test_one_line_per_job_with_the_facts_at_80_columns() -> None:
    text = _text(_snapshot())
    rows = {line.split()[0]: line for line in _lines(text) if line.split()}
    assert {"llama-lora-a", "sft-7", "draft", "tiny-1", "big-batch"} <= set(rows), text
    for job_id, needles in {
        "llama-lora-a": ("running", "120/400", "1.834", "ETA 6m25s", " 0 "),
        "sft-7": ("pending", "2.1 GB RAM free"),
        "draft": ("awaiting", "set approved: true"),
        "tiny-1": ("done", "40/40", "5.91", "1m09s"),
        "big-batch": ("failed", "oom: OutOfMemoryError: CUDA"),
    }.items():
        for needle in needles:
            assert needle in rows[job_id], (job_id, needle, rows[job_id])
    assert "inbox 2 · awaiting 1 · pending 1" in text and "GPU 0 Sim 6GB" in text and "held by llama-lora-a" in text
    assert max(len(line) for line in _lines(text)) <= 80


def test_wide_terminals_add_times_and_wide_mode_adds_evidence_and_advice() -> None:
    text = _text(_snapshot(), width=200)
    header = next(line for line in _lines(text) if line.startswith("ID "))
    assert "STARTED" in header and "ENDED" in header
    wide = _render(_snapshot(), 120, wide=True)
    assert "NAME" in wide and "PRIO" in wide
    assert "oom: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in wide
    assert "advice: lower batch_size from 16 to 8" in wide


def test_narrow_terminal_still_fits() -> None:
    text = _text(_snapshot(), width=50)
    assert max(len(line) for line in text.splitlines()) <= 50 and "llama-l" in text


def test_job_names_are_shown_literally() -> None:
    snapshot = _snapshot()
    snapshot["jobs"][0]["id"] = "[red]boom[/red]"
    assert "[red]boom[/red]" in _text(snapshot, width=120)


def test_stale_heartbeat_says_watcher_not_responding() -> None:
    assert "watcher not responding" in _text(_snapshot(heartbeat_age_s=600))
    assert "watcher not responding" not in _text(_snapshot(heartbeat_age_s=2))


def test_watcher_problems_such_as_a_full_disk_are_shown() -> None:
    snapshot = _snapshot()
    line = "disk full since 2026-11-30T19:00:00Z (status.json: No space left on device); no job is accepted"
    snapshot["watcher"].update(disk_full=True, problems=[line])
    assert "disk full since" in _text(snapshot, width=200)
    from trainq.watcher.faces.html import render_html

    assert "disk full since" in render_html(snapshot, {})
    assert "disk full" not in _text(_snapshot())


def mixed_jobs(now: float) -> dict:
    """A status.json with 30 mixed jobs: running, pending (a sweep), awaiting, seven kinds of failure, done."""
    snapshot = _snapshot()
    jobs = []
    for i in range(3):
        jobs.append(
            {
                "id": f"lora-run-{i}",
                "state": "running",
                "status": "running",
                "started_at": iso_utc(now - 300),
                "health": "healthy",
                "gpus": [i],
                "dir": f"running/lora-run-{i}",
                "progress": {"step": 120, "total_steps": 400, "loss": 1.83, "tokens_per_s": 910.5, "eta_s": 385},
            }
        )
    for i in range(1, 9):
        jobs.append(
            {
                "id": f"lrs-{i}",
                "state": "pending",
                "status": "pending",
                "sweep": "lrs",
                "dir": f"pending/lrs-{i}",
                "submitted_at": iso_utc(now - 60),
                "waiting_for": "after lora-run-0 (running)",
            }
        )
    jobs.append({"id": "draft", "state": "awaiting_approval", "status": "awaiting_approval", "dir": "inbox/draft.yaml"})
    failures = {
        "oom": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "unsatisfiable": "needs 500 GB RAM; this machine has 23.5 GB",
        "data": "FileNotFoundError: [Errno 2] No such file or directory: '/d/train.jsonl'",
        "nan": "step 12: loss is nan",
        "unknown": "Traceback (most recent call last):\nValueError: bad lr",
        "killed": "killed by SIGKILL",
        "timeout": "stopped at the timeout",
    }
    for i, (kind, evidence) in enumerate(failures.items()):
        jobs.append(
            {
                "id": f"f-{kind}",
                "state": "failed",
                "status": "failed",
                "dir": f"failed/f-{kind}",
                "started_at": iso_utc(now - 900),
                "finished_at": iso_utc(now - 600 + i),
                "diagnosis": {"kind": kind, "evidence": evidence, "advice": f"fix {kind}"},
            }
        )
    for i in range(11):
        jobs.append(
            {
                "id": f"done-{i}",
                "state": "done",
                "status": "done",
                "dir": f"done/done-{i}",
                "started_at": iso_utc(now - 5000),
                "finished_at": iso_utc(now - 4000 - i),
                "progress": {"step": 40, "total_steps": 40, "loss": 5.91},
            }
        )
    snapshot["jobs"] = jobs
    snapshot["counts"] = {"inbox": 1, "awaiting_approval": 1, "pending": 8, "running": 3, "done": 11, "failed": 7}
    return snapshot


def _render(snapshot: dict, width: int, height: int | None = None, **kw) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(render_status(snapshot, width, height=height, **kw))
    return console.export_text()


def test_thirty_jobs_fit_80x24_keeping_failures_and_saying_what_is_hidden() -> None:
    text = _render(mixed_jobs(time.time()), 80, height=24)
    lines = _lines(text)
    assert len(lines) <= 23 and max(len(line) for line in lines) <= 80, text
    for kind in ("oom", "unsatisfiable", "data", "nan", "unknown", "killed", "timeout"):
        row = next(line for line in lines if line.startswith(f"f-{kind}"[:12]))
        assert f"{kind}: " in row, row  # the kind, then the start of its evidence
    assert "unsatisfiable: needs 500 GB" in text and "unknown: ValueError: bad lr" in text
    assert sum(line.startswith("lora-run-") for line in lines) == 3
    hidden = next(line for line in lines if "hidden" in line)
    assert hidden.startswith("… ") and "11 done" in hidden, hidden
    assert "GPU 0 Sim 6GB" in text  # the machine is never cut off


def test_thirty_jobs_fit_200x50_all_rows_with_times() -> None:
    text = _render(mixed_jobs(time.time()), 200, height=50)
    lines = _lines(text)
    assert len(lines) <= 49 and max(len(line) for line in lines) <= 200
    assert (
        "hidden" not in text
        and sum(1 for line in lines if line.startswith(("lora", "lrs", "f-", "done", "draft"))) == 30
    )
    assert "oom: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in text


def test_filters_by_state_sweep_and_glob() -> None:
    snapshot = mixed_jobs(time.time())

    def ids(**kw) -> set[str]:
        text = _render(snapshot, 120, filters=Filters(**kw))
        return {
            line.split()[0] for line in _lines(text)[3:] if line and not line.startswith(("RAM", "GPU", "sweep ", " "))
        }

    assert ids(states="failed") == {
        f"f-{k}" for k in ("oom", "unsatisfiable", "data", "nan", "unknown", "killed", "timeout")
    }
    assert ids(sweep="lrs") == {f"lrs-{i}" for i in range(1, 9)}
    assert "sweep lrs: 8 job(s) listed" in _render(snapshot, 120, filters=Filters(sweep="lrs"))
    assert ids(pattern="lora-*") == {"lora-run-0", "lora-run-1", "lora-run-2"}
    assert ids(states="running,awaiting") == {"lora-run-0", "lora-run-1", "lora-run-2", "draft"}
    assert "no job matches" in _render(snapshot, 80, filters=Filters(pattern="zzz"))


def _status_cmd(status_path: Path, *, follow: bool = False, json_out: bool = False) -> list[str]:
    code = (
        "import sys; from pathlib import Path; from trainq.watcher.faces.view import print_status; "
        f"sys.exit(print_status(Path(sys.argv[1]), follow={follow}, json_out={json_out}))"
    )
    return [sys.executable, "-c", code, str(status_path)]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)


def test_missing_status_file_is_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "queue" / "status.json"  # no queue folder either: no wait for a watcher to start
    for cmd in (_status_cmd(path), _status_cmd(path, json_out=True)):
        result = _run(cmd)
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr == f"no watcher has written {path} yet — start one with `trainq watch`\n"


def test_print_and_json(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    path.write_text(json.dumps(_snapshot()))
    printed = _run(_status_cmd(path))
    assert printed.returncode == 0 and "llama-lora-a" in printed.stdout
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


def _drain_until_exit(fd: int, proc: subprocess.Popen, deadline_s: float) -> int | None:
    """Read the terminal as a real one would while ``proc`` winds up: a full pty buffer blocks its last redraw."""
    deadline = time.monotonic() + deadline_s
    while proc.poll() is None and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                os.read(fd, 65536)
            except OSError:  # EIO: the slave side closed as the process ended
                break
    return proc.wait(timeout=max(0.1, deadline - time.monotonic()))


def test_follow_redraws_until_ctrl_c(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    path.write_text(json.dumps(_snapshot()))
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "80", "LINES": "60", "PYTHONPATH": str(REPO), "TERM": "xterm"}
    # Ctrl-C's default, whatever this run inherited (a run started in the background ignores SIGINT)
    proc = subprocess.Popen(
        _status_cmd(path, follow=True),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=REPO,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(slave)
    try:
        _read_until(master, "llama-lora-a")
        changed = _snapshot()
        changed["jobs"][0]["progress"]["step"] = 321
        path.write_text(json.dumps(changed))
        _read_until(master, "321/400")
        proc.send_signal(signal.SIGINT)
        assert _drain_until_exit(master, proc, 30.0) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
