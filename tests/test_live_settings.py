"""watcher.yaml is live (issue 35 item 5, docs/settings.md).

The watcher re-reads watcher.yaml when it changes: pools and limits apply without a restart, status.json
says when it was loaded (``watcher.config_loaded_at``), a change that cannot apply while running is named
in ``watcher.problems`` ("restart to apply: …"), and an invalid file keeps the last good settings.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import drop, run_json, tick_until, wait_until


def _status(root: Path) -> dict:
    try:
        return json.loads((root / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _write(root: Path, text: str) -> None:
    """Save watcher.yaml as an editor does (write elsewhere, rename over)."""
    tmp = root / ".watcher.yaml.new"
    tmp.write_text(text)
    os.replace(tmp, root / "watcher.yaml")


def test_a_pool_and_a_limit_added_to_watcher_yaml_apply_without_a_restart(queue_dir, watcher_process, tmp_path):
    _write(queue_dir, "rescan_s: 0.2\nsettle_s: 0.05\nstatus_s: 0.1\nmax_concurrent: 1\n")
    watcher_process()
    wait_until(lambda: _status(queue_dir).get("watcher", {}).get("config_loaded_at"), 30)
    loaded = _status(queue_dir)["watcher"]["config_loaded_at"]
    drop(queue_dir, "early.yaml", "approved: true\npool: gpu\ncommand: ['true']\n")
    wait_until(lambda: run_json(queue_dir, "early").get("status") == "rejected", 30)  # no such pool yet
    gate = tmp_path / "gate"
    try:
        for name in ("s1", "s2"):
            drop(
                queue_dir,
                f"{name}.yaml",
                f"approved: true\ncommand: [sh, -c, 'until [ -e {gate} ]; do sleep 0.05; done']\n",
            )
        wait_until(lambda: (queue_dir / "running" / "s1").is_dir(), 30)
        wait_until(lambda: "max_concurrent 1 reached" in _waiting_for(queue_dir, "s2"), 30)

        text = "rescan_s: 0.2\nsettle_s: 0.05\nstatus_s: 0.1\nmax_concurrent: 2\npools: {gpu: {max_concurrent: 1}}\n"
        _write(queue_dir, text)
        wait_until(lambda: (queue_dir / "running" / "s2").is_dir(), 30, what="s2 started under the new limit")
        drop(queue_dir, "late.yaml", "approved: true\npool: gpu\ncommand: ['true']\n")
        wait_until(lambda: run_json(queue_dir, "late").get("status") == "done", 30, what="the new pool's job done")
        watcher = _status(queue_dir)["watcher"]
        assert watcher["config_loaded_at"] >= loaded and watcher["problems"] == []
    finally:
        gate.touch()
    wait_until(lambda: run_json(queue_dir, "s2").get("status") == "done", 30)


def _waiting_for(root: Path, job_id: str) -> str:
    entry = next((j for j in _status(root).get("jobs", []) if j["id"] == job_id), {})
    return entry.get("waiting_for") or ""


def test_what_cannot_apply_is_named_and_an_invalid_file_keeps_the_last_good_settings(queue_dir, watcher):
    w = watcher()
    tick_until(w, lambda: _status(queue_dir).get("watcher", {}).get("config_loaded_at"))
    _write(queue_dir, "executor: slurm\nkeep_finished: 3\npools: {cpu: {max_concurrent: 2}}\n")
    tick_until(w, lambda: _status(queue_dir)["watcher"]["problems"])
    assert _status(queue_dir)["watcher"]["problems"] == [
        "restart to apply: executor (running with local, watcher.yaml says slurm)"
    ]
    assert w.config.executor == "local" and w.config.keep_finished == 3 and w.config.pools == {"cpu": 2}
    loaded = _status(queue_dir)["watcher"]["config_loaded_at"]

    _write(queue_dir, "keep_finished: -4\npools: {}\n")
    tick_until(w, lambda: "invalid" in " ".join(_status(queue_dir)["watcher"]["problems"]))
    (problem,) = _status(queue_dir)["watcher"]["problems"]
    assert problem.startswith(f"watcher.yaml is invalid, so the settings loaded at {loaded} stay in force: ")
    assert "keep_finished" in problem
    assert w.config.keep_finished == 3 and w.config.pools == {"cpu": 2}  # the last good ones
    drop(queue_dir, "c.yaml", "approved: true\npool: cpu\ncommand: ['true']\n")
    tick_until(w, lambda: run_json(queue_dir, "c").get("status") == "done")

    _write(queue_dir, "")  # every default again, and nothing held back
    tick_until(w, lambda: _status(queue_dir)["watcher"]["problems"] == [])
    assert w.config.keep_finished == 50 and w.config.pools == {}
    assert _status(queue_dir)["watcher"]["config_loaded_at"] >= loaded
