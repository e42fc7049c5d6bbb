"""Pools (docs/cli.md, pools): watcher.yaml pools with their own max_concurrent, a job's pool:, pause --pool.

Against a real watcher process: jobs that block until a release file exists show that each pool
holds its own limit while the others fill theirs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import PY, REPO, wait_until
from test_workflows import _entry, _job, _run, _status, _where


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(root), *args], capture_output=True, text=True, cwd=REPO, timeout=60
    )


def _blocker(release: Path) -> list[str]:
    return [PY, "-c", f"import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.05)"]


def _running(root: Path) -> set[str]:
    return {j["id"] for j in _status(root).get("jobs", []) if j["state"] == "running"}


def test_each_pool_holds_its_own_limit_under_a_real_watcher(queue_dir, watcher_process, tmp_path):
    release = tmp_path / "release"
    (queue_dir / "watcher.yaml").write_text(
        "max_concurrent: 1\npools: {gpu: {max_concurrent: 2}, cpu: {max_concurrent: 1}}\n"
    )
    watcher_process()
    for name in ("g1", "g2", "g3"):
        _job(queue_dir, name, pool="gpu", command=_blocker(release), resources={"gpus": 0}, stop_grace="1s")
    for name in ("c1", "c2"):
        _job(queue_dir, name, pool="cpu", command=_blocker(release), resources={"gpus": 0}, stop_grace="1s")
    for name in ("d1", "d2"):
        _job(queue_dir, name, command=_blocker(release), resources={"gpus": 0}, stop_grace="1s")
    _job(queue_dir, "typo", pool="gpus", command=["true"])

    wait_until(lambda: _running(queue_dir) == {"g1", "g2", "c1", "d1"}, 30, what="2 gpu, 1 cpu, 1 default running")
    wait_until(lambda: "max_concurrent" in ((_entry(queue_dir, "g3") or {}).get("waiting_for") or ""), 20)
    assert _entry(queue_dir, "g3")["waiting_for"] == "pool gpu: max_concurrent 2 reached (running: g1, g2)"
    assert _entry(queue_dir, "g3")["pool"] == "gpu" and _entry(queue_dir, "d2")["pool"] == "default"
    assert "pool cpu: max_concurrent 1 reached (running: c1)" in _entry(queue_dir, "c2")["waiting_for"]
    rejected = _run(queue_dir, "typo", "failed")
    assert rejected["status"] == "rejected" and rejected["errors"][0]["path"] == "pool"
    assert "'gpus' is not in watcher.yaml pools (known: cpu, default, gpu)" in rejected["errors"][0]["message"]

    why = _cli(queue_dir, "why", "g3").stdout
    assert "HOLD max_concurrent  pool gpu: max_concurrent 2 reached (running: g1, g2)" in why, why
    assert _running(queue_dir) == {"g1", "g2", "c1", "d1"}  # still: nothing past the limits started meanwhile
    view = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "status", "--wide"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "COLUMNS": "200"},
    )
    assert "pool gpu: max_concurrent 2 reached" in " ".join(view.stdout.split()), view.stdout

    out = _cli(queue_dir, "pause", "--pool", "cpu")
    assert out.returncode == 0 and (queue_dir / "pause.cpu.flag").exists(), out.stderr
    wait_until(lambda: "pool cpu paused" in ((_entry(queue_dir, "c2") or {}).get("waiting_for") or ""), 20)
    assert "HOLD pool" in _cli(queue_dir, "why", "c2").stdout
    release.touch()  # everything running ends; gpu and default fill again, cpu stays paused
    wait_until(lambda: all(_where(queue_dir, j) == "done" for j in ("g1", "g2", "g3", "d1", "d2", "c1")), 30)
    assert _where(queue_dir, "c2") == "pending"
    assert _cli(queue_dir, "resume", "--pool", "cpu").returncode == 0
    wait_until(lambda: _where(queue_dir, "c2") == "done", 30, what="c2 runs once its pool resumes")


def test_pools_are_validated_in_watcher_yaml(queue_dir):
    import pytest

    from trainq.watcher.spec.config import WatcherConfig
    from trainq.watcher.spec.errors import InvalidJobSpec

    config = WatcherConfig.from_dict({"pools": {"gpu": {"max_concurrent": 2}}, "max_concurrent": 3})
    assert config.pool_limits() == {"default": 3, "gpu": 2}
    with pytest.raises(InvalidJobSpec) as bad:
        WatcherConfig.from_dict({"pools": {"gpu": {"max_concurent": 2}}})
    assert "pools.gpu" in "\n".join(bad.value.lines())
