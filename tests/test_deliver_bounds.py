"""Issue 36, item 5: delivery sends only regular files inside the job folder (docs/wall.md).

Before this change the runner followed a ``checkpoints/ckpt_latest`` link to ``/etc`` (shadow and passwd
included), a link inside ``adapter/``, and a metrics ``checkpoint`` record naming any path; a
``deliver.to`` starting with ``-`` reached rsync's arguments.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import PY, drop, run_json, tick_until

from trainq.watcher.supervisor.deliver import send

pytestmark = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed (.ci/system-deps)")


def _script(tmp: Path, body: str) -> str:
    """A job that writes a real checkpoint and summary, then whatever ``body`` adds; exits 0."""
    script = tmp / "job.py"
    script.write_text(
        "import json, os\n"
        "d = os.environ['TRAINQ_JOB_DIR']\n"
        "ck = os.path.join(d, 'checkpoints', 'step-3'); os.makedirs(ck)\n"
        "open(os.path.join(ck, 'weights.bin'), 'wb').write(b'w' * 64)\n"
        "open(os.path.join(d, 'summary.json'), 'w').write(json.dumps({'outcome': 'done'}))\n"
        "os.makedirs(os.path.join(d, 'adapter'))\n"
        "open(os.path.join(d, 'adapter', 'adapter_config.json'), 'w').write('{}')\n" + body
    )
    return str(script)


def _delivered(queue_dir: Path, w, name: str) -> dict:
    return tick_until(w, lambda: run_json(queue_dir, name).get("delivered"), 60, what=f"{name} delivered")


def _everything_under(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def test_a_ckpt_latest_link_to_etc_sends_nothing_from_etc(queue_dir, watcher, tmp_path):
    body = (
        "os.symlink('/etc', os.path.join(d, 'checkpoints', 'ckpt_latest'))\n"
        "os.symlink('/etc/passwd', os.path.join(d, 'adapter', 'weights.safetensors'))\n"
        "os.symlink('/etc', os.path.join(d, 'adapter', 'more'))\n"
    )
    target = tmp_path / "results"
    w = watcher()
    job = {"approved": True, "command": [PY, _script(tmp_path, body)], "deliver": {"to": str(target)}}
    drop(queue_dir, "etc.yaml", yaml.safe_dump(job))
    delivered = _delivered(queue_dir, w, "etc")
    copy = target / "etc"
    sent = _everything_under(copy)
    assert not [p for p in sent if "passwd" in p or "shadow" in p or "hostname" in p], sent
    assert "adapter/adapter_config.json" in delivered["files"] and "summary.json" in delivered["files"]
    assert not [f for f in delivered["files"] if f.startswith("ckpt_latest")], delivered["files"]
    assert delivered["verified"] is True, delivered
    skipped = "\n".join(delivered["skipped"])
    assert "ckpt_latest" in skipped and "/etc" in skipped, skipped
    assert "adapter/weights.safetensors" in skipped and "adapter/more" in skipped, skipped
    events = [json.loads(line) for line in (queue_dir / "done" / "etc" / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "delivered" for e in events)


def test_a_checkpoint_record_naming_a_path_outside_is_skipped(queue_dir, watcher, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "private.key").write_text("not yours\n")
    body = (
        "import shutil; shutil.rmtree(os.path.join(d, 'checkpoints'))\n"
        f"open(os.environ['TRAINQ_METRICS'], 'a').write(json.dumps({{'type': 'checkpoint', 'step': 3, "
        f"'path': {str(outside)!r}}}) + '\\n')\n"
    )
    target = tmp_path / "results"
    w = watcher()
    job = {
        "approved": True,
        "command": [PY, _script(tmp_path, body)],
        "deliver": {"to": str(target), "what": ["ckpt_latest", "summary"]},
    }
    drop(queue_dir, "record.yaml", yaml.safe_dump(job))
    delivered = _delivered(queue_dir, w, "record")
    assert not list(target.rglob("private.key")), _everything_under(target)
    assert delivered["files"] == ["summary.json"], delivered
    assert any("outside the job folder" in line and str(outside) in line for line in delivered["skipped"]), delivered


def test_a_deliver_to_starting_with_a_dash_is_refused_at_submit(queue_dir, watcher, tmp_path):
    mark = tmp_path / "ran"
    w = watcher()
    job = {"approved": True, "command": ["true"], "deliver": {"to": f"--rsync-path=touch {mark}"}}
    drop(queue_dir, "dash.yaml", yaml.safe_dump(job))
    tick_until(w, lambda: (queue_dir / "failed" / "dash" / "run.json").exists())
    run = json.loads((queue_dir / "failed" / "dash" / "run.json").read_text())
    assert run["status"] == "rejected" and [e["path"] for e in run["errors"]] == ["deliver.to"], run
    assert "starts with '-'" in run["error"] and "\n" not in run["error"]
    (tmp_path / "dash.yaml").write_text(yaml.safe_dump(job))
    out = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "validate", str(tmp_path / "dash.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "deliver.to" in out.stderr + out.stdout, out
    assert not mark.exists()


def test_rsync_reads_the_target_as_a_path_never_as_an_option(tmp_path, monkeypatch):
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "f.txt").write_text("x\n")
    monkeypatch.chdir(tmp_path)
    assert send(stage, "--dry-run") is None  # before: rsync took it as its option (and a stray '/')
    assert (tmp_path / "--dry-run" / "f.txt").read_text() == "x\n"
