"""`trainq plot ID...`: several jobs' loss curves in one PNG (a sweep id stands for its jobs), real jobs, real
matplotlib; without matplotlib it says what to install, and the watcher never imports it."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import FAKE, PY, REPO, drop, tick_until, trainq

SLOW = str(FAKE / "slow_steps.py")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def _done(root: Path, w, *ids: str) -> None:
    tick_until(w, lambda: all((root / "done" / i / "run.json").exists() for i in ids), 60, what=f"{ids} done")


def test_plot_overlays_the_curves_of_jobs_and_of_a_sweep(queue_dir: Path, watcher, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    w = watcher(max_concurrent=4)
    for name in ("a", "b"):
        drop(queue_dir, f"{name}.yaml", yaml.safe_dump({"approved": True, "command": [PY, SLOW, "30", "0.01", "10"]}))
    sweep = {"approved": True, "command": [PY, SLOW, "{steps}", "0.01", "10"], "sweep": {"steps": [10, 20]}}
    drop(queue_dir, "sw.yaml", yaml.safe_dump(sweep))
    _done(queue_dir, w, "a", "b", "sw-1", "sw-2")
    out = trainq(queue_dir, "plot", "a", "b", "-o", str(tmp_path / "ab.png"), cwd=tmp_path)
    assert out.returncode == 0 and "loss curves of 2 job(s) (a, b)" in out.stdout, out.stderr
    width, height = _png_size(tmp_path / "ab.png")
    assert width > 500 and height > 300
    out = trainq(queue_dir, "plot", "sw", cwd=tmp_path)
    assert out.returncode == 0 and "(sw-1, sw-2)" in out.stdout, out.stderr
    assert _png_size(tmp_path / "sw-loss.png")[0] > 500
    out = trainq(queue_dir, "plot", "nope", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip().endswith("no job or sweep with id 'nope'"), out.stderr


def test_without_matplotlib_plot_says_what_to_install(queue_dir: Path, watcher, tmp_path: Path) -> None:
    w = watcher()
    drop(queue_dir, "a.yaml", yaml.safe_dump({"approved": True, "command": [PY, SLOW, "10", "0.01", "10"]}))
    _done(queue_dir, w, "a")
    blocker = tmp_path / "no-matplotlib"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    out = trainq(queue_dir, "plot", "a", cwd=tmp_path, env={"PYTHONPATH": f"{blocker}{os.pathsep}{REPO}"})
    assert (
        out.returncode == 1
        and out.stderr == "trainq: plot: needs matplotlib (the train extra): pip install 'trainq[train]'\n"
    )


def test_the_watcher_and_its_cli_never_import_matplotlib_at_import_time() -> None:
    code = (
        "import sys, trainq.watcher.cli.main, trainq.watcher.cli.plot, trainq.watcher.daemon.daemon\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'torch', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out
