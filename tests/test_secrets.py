"""Issue 12, item 7: secrets and file modes. env_passthrough keeps the watcher's tokens out of jobs,
job folders are private unless the root is group-shared, the watcher never follows a symlink a
job put in its folder, and names never forge a log line or reach the terminal as escapes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from conftest import PY, drop, tick_until, wait_until
from rich.console import Console

from trainq.watcher.faces.view import render_status
from trainq.watcher.spec.text import PrintableFormatter, printable

PRINT_ENV = "import os; print(sorted(k for k in os.environ if k.startswith(('SECRET', 'KEEP', 'OWN'))))"


def test_env_passthrough_keeps_other_variables_out(queue_dir, watcher, monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    monkeypatch.setenv("KEEP_ME", "1")
    w = watcher(env_passthrough=["PATH", "KEEP_*"])
    drop(queue_dir, "env.yaml", f'approved: true\ncommand: [{PY}, -c, "{PRINT_ENV}"]\nenv: {{OWN: x}}\n')
    tick_until(w, lambda: (queue_dir / "done" / "env").exists())
    log = (queue_dir / "done" / "env" / "output.log").read_text()
    assert "['KEEP_ME', 'OWN']" in log and "hunter2" not in log


def test_without_env_passthrough_everything_passes_as_before(queue_dir, watcher, monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    w = watcher()
    drop(queue_dir, "env.yaml", f'approved: true\ncommand: [{PY}, -c, "{PRINT_ENV}"]\n')
    tick_until(w, lambda: (queue_dir / "done" / "env").exists())
    assert "'SECRET_TOKEN'" in (queue_dir / "done" / "env" / "output.log").read_text()


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_job_folders_are_private_unless_the_root_is_group_shared(queue_dir, watcher):
    os.chmod(queue_dir, 0o755)
    w = watcher()
    drop(queue_dir, "private.yaml", 'approved: true\ncommand: ["true"]\n')
    tick_until(w, lambda: (queue_dir / "done" / "private").exists())
    assert _mode(queue_dir / "done" / "private") == 0o700
    assert _mode(queue_dir / "done" / "private" / "run.json") == 0o600
    os.chmod(queue_dir, 0o2775)  # setgid + group-writable: a queue shared by a team
    drop(queue_dir, "shared.yaml", 'approved: true\ncommand: ["true"]\n')
    tick_until(w, lambda: (queue_dir / "done" / "shared").exists())
    assert _mode(queue_dir / "done" / "shared") & 0o770 == 0o777 & ~_umask() & 0o770  # the umask decides
    assert _mode(queue_dir / "done" / "shared" / "run.json") == 0o644


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_symlinked_output_log_is_never_followed(queue_dir, watcher, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT\n")
    secret.chmod(0o600)
    swap = f"import os; os.remove('output.log'); os.symlink({str(secret)!r}, 'output.log'); raise SystemExit(3)"
    w = watcher()
    drop(
        queue_dir,
        "swap.yaml",
        f'approved: true\ncommand: [{PY}, -c, "{swap}"]\nretries: {{max: 1, on: [unknown], backoff: 1s}}\n',
    )
    tick_until(w, lambda: (queue_dir / "failed" / "swap").exists(), 30)
    run = json.loads((queue_dir / "failed" / "swap" / "run.json").read_text())
    assert "TOP-SECRET" not in json.dumps(run)  # the diagnosis never read the symlink's target
    assert secret.read_text() == "TOP-SECRET-CONTENT\n"  # the retry's supervisor never appended to it
    assert [a["n"] for a in run["attempts"]] == [1, 2]


def test_names_never_forge_a_log_line_or_reach_the_terminal_as_escapes(queue_dir, watcher_process):
    wp = watcher_process()
    wait_until(lambda: (queue_dir / "status.json").exists(), 30)
    forged = "x\n2026-01-01 00:00:00,000 INFO job evil: pending -> done\x1b[2J.yaml"
    drop(queue_dir, forged, 'approved: true\ncommand: ["true"]\n')
    wait_until(lambda: os.listdir(queue_dir / "done"), 30)
    wait_until(lambda: "-> done" in (queue_dir / "watcher.log").read_text(), 30)
    lines = (queue_dir / "watcher.log").read_text().splitlines()
    assert not any(line.startswith("2026-01-01") or "\x1b" in line for line in lines), lines
    assert any("\\n2026-01-01" in line for line in lines)
    assert wp.proc.poll() is None
    snapshot = {"jobs": [{"id": "a", "name": "evil\x1b]0;title\x07\r\nFAKE", "state": "done", "status": "done"}]}
    console = Console(record=True, width=100, force_terminal=True)
    console.print(render_status(snapshot, 100))
    assert "\x1b]0;" not in console.export_text(styles=True)


def test_printable_formatter_keeps_one_record_on_one_line() -> None:
    import logging

    record = logging.LogRecord("t", logging.INFO, __file__, 1, "job %s: %s", ("a\nb", "\x1b[31mred\r"), None)
    line = PrintableFormatter("%(levelname)s %(message)s").format(record)
    assert line == "INFO job a\\nb: \\x1b[31mred\\r"
    assert printable("caf\udcc3\udca9") == "café" and printable("\udcff") == "\ufffd"
