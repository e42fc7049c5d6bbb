"""A removed dependency counts as ended ``removed`` for its dependents, across restarts (issue 23 item 3)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from conftest import PY, REPO, drop, wait_until


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(root), *args], capture_output=True, text=True, cwd=REPO, timeout=60
    )


def _submit_chain(root: Path) -> None:
    drop(root, "dep.yaml", "approved: true\ncommand: ['true']\n")
    drop(root, "need.yaml", "approved: true\ncommand: ['true']\nafter: [dep]\n")
    drop(root, "anyway.yaml", "approved: true\ncommand: ['true']\nafter: [dep]\nafter_policy: any\n")


def _check_dependents(root: Path) -> None:
    wait_until(lambda: (root / "failed" / "need").exists(), 20, what="need failed")
    run = _read(root / "failed" / "need" / "run.json")
    assert run["status"] == "failed" and run["diagnosis"]["kind"] == "dependency"
    assert "dependency dep was removed" in run["diagnosis"]["evidence"]
    why = _cli(root, "why", "need")
    assert "dependency dep was removed" in why.stdout, why.stdout
    (root / "pause.flag").unlink()
    wait_until(lambda: (root / "done" / "anyway").exists(), 20, what="anyway done")


def test_trainq_rm_of_a_pending_dependency_ends_it_removed_for_its_dependents(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text("rescan_s: 0.2\n")
    (queue_dir / "pause.flag").touch()
    watcher_process()
    _submit_chain(queue_dir)
    wait_until(lambda: all((queue_dir / "pending" / j).exists() for j in ("dep", "need", "anyway")), 20)
    assert _cli(queue_dir, "rm", "dep").returncode == 0
    _check_dependents(queue_dir)
    stone = _read(queue_dir / ".removed" / "dep.json")
    assert stone["by"] == "trainq rm" and stone["status"] == "pending"


def test_rm_rf_while_no_watcher_runs_is_found_at_the_restart(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text("rescan_s: 0.2\n")
    (queue_dir / "pause.flag").touch()
    wp = watcher_process()
    _submit_chain(queue_dir)
    wait_until(
        lambda: all(
            _read(queue_dir / "pending" / j / "run.json").get("after_seen") == ["dep"] for j in ("need", "anyway")
        ),
        20,
        what="the dependents saw dep",
    )
    wp.kill()
    shutil.rmtree(queue_dir / "pending" / "dep")
    watcher_process()
    _check_dependents(queue_dir)


def test_a_removal_the_watcher_saw_is_remembered_after_a_restart(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text("rescan_s: 0.2\n")
    (queue_dir / "pause.flag").touch()
    wp = watcher_process()
    drop(queue_dir, "dep.yaml", "approved: true\ncommand: ['true']\n")
    # the claim complete: its last write is the accepted event (an rm -rf racing that write fails "not empty")
    accepted = queue_dir / "pending" / "dep" / "events.jsonl"
    wait_until(lambda: accepted.exists() and '"accepted"' in accepted.read_text(), 20)
    shutil.rmtree(queue_dir / "pending" / "dep")
    wait_until(lambda: (queue_dir / ".removed" / "dep.json").exists(), 20, what="the watcher's tombstone")
    wp.kill()
    drop(queue_dir, "need.yaml", "approved: true\ncommand: ['true']\nafter: [dep]\n")  # submitted after the removal
    drop(queue_dir, "anyway.yaml", "approved: true\ncommand: ['true']\nafter: [dep]\nafter_policy: any\n")
    watcher_process()
    _check_dependents(queue_dir)
    drop(queue_dir, "dep.yaml", "approved: true\ncommand: ['true']\n")  # the id taken again: no longer removed
    wait_until(lambda: (queue_dir / "done" / "dep").exists(), 20)
    assert not (queue_dir / ".removed" / "dep.json").exists()


def test_a_dependency_cleaned_up_after_it_ended_done_still_counts_done(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text("rescan_s: 0.2\n")
    watcher_process()
    drop(queue_dir, "made.yaml", "approved: true\ncommand: ['true']\n")
    wait_until(lambda: (queue_dir / "done" / "made").exists(), 20)
    assert _cli(queue_dir, "clean", "--done").returncode == 0
    assert _read(queue_dir / ".removed" / "made.json")["status"] == "done"
    drop(queue_dir, "uses.yaml", "approved: true\ncommand: ['true']\nafter: [made]\n")
    wait_until(lambda: (queue_dir / "done" / "uses").exists(), 20, what="the dependent of a cleaned done job")


def test_rm_rf_while_no_watcher_runs_before_the_dependents_were_accepted(queue_dir, watcher_process):
    """The soak's finding: dependents dropped while no watcher ran, after their dependency's folder was
    rm -rf'd, waited forever ("no such job yet"): nothing on disk said the id had ever existed."""
    (queue_dir / "watcher.yaml").write_text("rescan_s: 0.2\n")
    wp = watcher_process()
    drop(queue_dir, "made.yaml", "approved: true\ncommand: ['true']\n")
    wait_until(lambda: (queue_dir / "done" / "made").exists(), 20)
    (queue_dir / "pause.flag").touch()
    drop(queue_dir, "dep.yaml", "approved: true\ncommand: ['true']\n")
    wait_until(lambda: (queue_dir / "pending" / "dep" / "job.yaml").exists(), 20)  # the claim complete
    wp.kill()
    shutil.rmtree(queue_dir / "pending" / "dep")
    shutil.rmtree(queue_dir / "done" / "made")  # a finished job cleaned up by hand: it stays done
    _submit_chain_after_removal(queue_dir)
    drop(queue_dir, "uses.yaml", "approved: true\ncommand: ['true']\nafter: [made]\n")
    watcher_process()
    _check_dependents(queue_dir)
    assert _read(queue_dir / ".removed" / "dep.json")["by"] == "found gone when a watcher started"
    wait_until(lambda: (queue_dir / "done" / "uses").exists(), 20, what="the dependent of a cleaned-up done job")


def _submit_chain_after_removal(root: Path) -> None:
    drop(root, "need.yaml", "approved: true\ncommand: ['true']\nafter: [dep]\n")
    drop(root, "anyway.yaml", "approved: true\ncommand: ['true']\nafter: [dep]\nafter_policy: any\n")
