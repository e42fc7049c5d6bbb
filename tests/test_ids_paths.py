"""Ids and names (one rule: an id wins, a name is an alias when one job carries it) and absolute fork paths."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import PY, drop, trainq, wait_until
from test_workflows import _entry, _where

from trainq.watcher.spec.jobspec import parse_job_text


def _job(root: Path, file_stem: str, **fields) -> Path:
    fields.setdefault("approved", True)
    fields.setdefault("command", ["true"])
    return drop(root, f"{file_stem}.yaml", json.dumps(fields))


def test_a_name_is_an_alias_where_an_id_is_taken_and_refused_when_shared(queue_dir, watcher_process):
    watcher_process()
    _job(queue_dir, "a1", name="trainer-x", command=[PY, "-c", "print('from a1')"], resources={"gpus": 0})
    _job(queue_dir, "d1", name="dup", command=["true"], resources={"gpus": 0})
    _job(queue_dir, "d2", name="dup", command=["true"], resources={"gpus": 0})
    wait_until(lambda: all(_where(queue_dir, j) == "done" for j in ("a1", "d1", "d2")), 30)
    _job(queue_dir, "later", after=["trainer-x"], resources={"gpus": 0})

    assert trainq(queue_dir, "why", "trainer-x").stdout.startswith("job a1: done (done/a1)")
    assert "from a1" in trainq(queue_dir, "logs", "trainer-x").stdout
    assert json.loads(trainq(queue_dir, "show", "trainer-x", "--json").stdout)["id"] == "a1"
    assert trainq(queue_dir, "wait", "trainer-x").returncode == 0
    shared = trainq(queue_dir, "retry", "dup")
    assert shared.returncode == 2 and "2 jobs are named 'dup' (d1, d2): give the id" in shared.stderr
    assert trainq(queue_dir, "why", "dup").returncode == 2
    assert "no job with id 'nobody'" in trainq(queue_dir, "logs", "nobody").stderr
    wait_until(lambda: "named" in ((_entry(queue_dir, "later") or {}).get("waiting_for") or ""), 20)
    assert _entry(queue_dir, "later")["waiting_for"] == (
        "after trainer-x: no job with id trainer-x; job a1 is named trainer-x (after: takes ids: write after: [a1])"
    )


def test_fork_prints_the_id_it_gets_and_says_when_it_is_not_the_first(queue_dir):
    (queue_dir / "done" / "a").mkdir()
    (queue_dir / "done" / "a" / "job.yaml").write_text('approved: true\ncommand: ["true"]\n')
    first = trainq(queue_dir, "fork", "a")
    assert first.returncode == 0 and first.stdout.startswith("job a-fork: fork of a submitted as inbox/a-fork.yaml")
    (queue_dir / "done" / "a-fork-2").mkdir()  # an id taken in a state folder is skipped too
    second = trainq(queue_dir, "fork", "a", "--set", "priority=2")
    assert second.stdout.startswith(
        "job a-fork-3: fork of a submitted as inbox/a-fork-3.yaml (an earlier fork of a holds a-fork)"
    ), second.stdout
    assert sorted(p.name for p in (queue_dir / "inbox").iterdir()) == ["a-fork-3.yaml", "a-fork.yaml"]


def test_fork_from_checkpoint_with_a_relative_root_writes_an_absolute_path(tmp_path):
    root = tmp_path / "queue"
    job = root / "failed" / "train-a"
    for name in ("inbox", "pending", "running", "done"):
        (root / name).mkdir(parents=True)
    (job / "checkpoint-20").mkdir(parents=True)
    (job / "checkpoint-20" / "trainer_state.json").write_text("{}")
    (job / "job.yaml").write_text(
        "approved: true\ncommand: [python3, train.py]\nresume_args: [--resume, '{resume_from}']\n"
    )

    out = trainq("queue", "fork", "train-a", "--from-checkpoint", cwd=tmp_path)  # the README's default ./queue
    assert out.returncode == 0, out.stderr
    spec = parse_job_text((root / "inbox" / "train-a-fork.yaml").read_text(), "fork")
    assert spec.from_checkpoint == str((job / "checkpoint-20").resolve()) and os.path.isabs(spec.from_checkpoint)

    bad = trainq("queue", "fork", "train-a", "--set", "from_checkpoint=nowhere/step-3", cwd=tmp_path)
    assert bad.returncode == 2 and f"from_checkpoint: {tmp_path / 'nowhere' / 'step-3'} does not exist" in bad.stderr
    rel = trainq(
        "queue", "fork", "train-a", "--set", "from_checkpoint=queue/failed/train-a/checkpoint-20", cwd=tmp_path
    )
    assert rel.returncode == 0, rel.stderr
    spec = parse_job_text((root / "inbox" / "train-a-fork-2.yaml").read_text(), "fork")
    assert spec.from_checkpoint == str((job / "checkpoint-20").resolve())
