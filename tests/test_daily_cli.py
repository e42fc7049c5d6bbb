"""Daily use, round two (issue 24): submit -- CMD, logs --tail, id completion, history."""

from __future__ import annotations

import argparse
import json

from conftest import PY, trainq, wait_until
from test_workflows import _job, _run, _where

from trainq.watcher.spec.jobspec import parse_job_text


def test_submit_dash_dash_writes_a_valid_job_with_every_option(queue_dir, tmp_path):
    (queue_dir / "watcher.yaml").write_text("pools: {cpu: {max_concurrent: 2}}\n")
    out = trainq(
        queue_dir,
        "submit",
        "--name",
        "hello",
        "--priority",
        "3",
        "--after",
        "prep",
        "--gpus",
        "0",
        "--ram",
        "512M",
        "--timeout",
        "2h",
        "--pool",
        "cpu",
        "--",
        PY,
        "-c",
        "print('hi --there')",
    )
    assert out.returncode == 0, out.stderr
    assert "it becomes job hello" in out.stdout  # no watcher: it says which id the job will get
    spec = parse_job_text((queue_dir / "inbox" / "hello.yaml").read_text(), "hello.yaml")
    assert spec.approved and spec.name == "hello" and spec.priority == 3 and spec.after == ("prep",)
    assert spec.command == (PY, "-c", "print('hi --there')")
    assert spec.resources.gpus == 0 and spec.resources.ram_gb == 0.5 and spec.timeout_s == 7200 and spec.pool == "cpu"

    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "train.py").write_text("print('training')\n")
    out = trainq(queue_dir, "submit", "--", "python3", "tools/train.py", "--lr", "1e-4", cwd=tmp_path)
    assert "it becomes job train" in out.stdout, out.stdout  # named after the script, not the interpreter
    bad = trainq(queue_dir, "submit", "--ram", "lots", "--", "true")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "resources.ram_gb" in bad.stderr
    both = trainq(queue_dir, "submit", "x.yaml", "--name", "n")
    assert both.returncode == 2 and "--name is for `trainq submit [OPTIONS] -- CMD ARGS...`" in both.stderr
    assert sorted(p.name for p in (queue_dir / "inbox").iterdir()) == ["hello.yaml", "train.yaml"]


def test_submit_dash_dash_prints_the_id_and_the_job_runs(queue_dir, watcher_process):
    watcher_process()
    wait_until(lambda: (queue_dir / "status.json").exists(), 30)
    out = trainq(
        queue_dir, "submit", "--gpus", "0", "--", PY, "-c", "print('\\n'.join(f'line {i}' for i in range(50)))"
    )
    assert out.returncode == 0 and out.stdout.strip() == "job python", out.stdout + out.stderr
    wait_until(lambda: _where(queue_dir, "python") == "done", 30)
    tail = trainq(queue_dir, "logs", "python", "--tail", "3")
    assert tail.returncode == 0 and tail.stdout.splitlines() == ["line 47", "line 48", "line 49"], tail.stdout


def test_logs_tail_counts_lines_from_the_end(queue_dir, tmp_path):
    from trainq.watcher.cli.job_commands import tail_offset

    log = tmp_path / "output.log"
    log.write_bytes(b"a\nbb\nccc\n")
    assert log.read_bytes()[tail_offset(log, 2) :] == b"bb\nccc\n"
    assert log.read_bytes()[tail_offset(log, 9) :] == b"a\nbb\nccc\n"
    assert tail_offset(log, 0) == log.stat().st_size
    log.write_bytes(b"a\nbb\nunfinished")
    assert log.read_bytes()[tail_offset(log, 1) :] == b"unfinished"
    log.write_bytes(b"x" * 200_000 + b"\n" + b"y\n" * 3)
    assert log.read_bytes()[tail_offset(log, 3, block=1000) :] == b"y\n" * 3


def test_every_command_that_takes_an_id_completes_ids():
    from trainq.watcher.cli.main import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    takes_id = {}
    for name, command in sub.choices.items():
        for action in command._actions:
            if action.dest in ("id", "ids"):
                takes_id[name] = getattr(action, "completer", None)
    for name in ("stop", "retry", "why", "logs", "fork", "rm", "show", "wait", "edit", "priority", "clean"):
        assert takes_id.get(name) is not None, f"{name} has no id completion"


def test_history_lists_every_finished_job_with_filters(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text("keep_finished: 2\nmax_concurrent: 4\n")
    watcher_process()
    for i in range(4):
        _job(queue_dir, f"ok{i}", command=["true"], resources={"gpus": 0})
    _job(queue_dir, "bad", command=[PY, "-c", "raise SystemExit(3)"], resources={"gpus": 0})
    _job(queue_dir, "typo", command=["true"], priority="high")
    ids = [f"ok{i}" for i in range(4)] + ["bad", "typo"]
    wait_until(lambda: all(_where(queue_dir, j) in ("done", "failed") for j in ids), 30)
    status = json.loads((queue_dir / "status.json").read_text())
    assert len([j for j in status["jobs"] if j["state"] in ("done", "failed")]) <= 2  # status.json keeps 2

    listed = json.loads(trainq(queue_dir, "history", "--json").stdout)
    assert sorted(r["id"] for r in listed) == sorted(ids)
    bad = next(r for r in listed if r["id"] == "bad")
    assert bad["status"] == "failed" and bad["type"] == "command" and bad["exit_code"] == 3 and bad["attempts"] == 1
    failed = trainq(queue_dir, "history", "--state", "failed,rejected", "--csv").stdout.splitlines()
    assert failed[0].startswith("id,name,state,status") and sorted(line.split(",")[0] for line in failed[1:]) == [
        "bad",
        "typo",
    ]
    assert [r["id"] for r in json.loads(trainq(queue_dir, "history", "--kind", "unknown", "--json").stdout)] == ["bad"]
    assert json.loads(trainq(queue_dir, "history", "--since", "2999-01-01", "--json").stdout) == []
    table = trainq(queue_dir, "history", "--since", "1h").stdout
    assert "6 finished job(s)" in table and "failed (unknown)" in table
    assert trainq(queue_dir, "history", "--since", "yesterday").returncode == 2

    (queue_dir / "failed" / "bad" / "retry.flag").touch()  # retried: not finished while it runs again
    wait_until(lambda: _run(queue_dir, "bad", "failed") and _run(queue_dir, "bad", "failed")["attempt"] == 2, 30)
    again = json.loads(trainq(queue_dir, "history", "--json").stdout)
    assert next(r for r in again if r["id"] == "bad")["attempts"] == 2 and len(again) == 6
