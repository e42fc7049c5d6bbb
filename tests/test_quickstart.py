"""The README's quick start, as written, then the shipped Hugging Face example: it ends done.

The watcher is started as the quick start starts it, ``.venv/bin/trainq watch`` without activating the
venv, on a PATH whose python has no torch (or no python at all): the job's bare ``python`` must still be
the watcher's own (spec/interpreter.py), not the system one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import PY, REPO, wait_until

#: a PATH with only the system folders: its python3 (if any) lacks torch, and `python` may not exist
SYSTEM_PATH = "/usr/bin:/bin"


def _trainq(cwd: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    trainq = Path(PY).parent / "trainq"  # .venv/bin/trainq, as the README calls it
    return subprocess.run([str(trainq), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_quick_start_then_the_shipped_hf_example_ends_done(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "TRAINQ_ROOT")}
    env.update(PATH=SYSTEM_PATH, OMP_NUM_THREADS="1")
    assert _trainq(tmp_path, "init", "queue", env=env).returncode == 0
    shutil.copytree(REPO / "queue" / "examples", tmp_path / "queue" / "examples")
    built = _trainq(tmp_path, "tiny", "queue/demo", env=env)  # the example's own first step
    assert built.returncode == 0, built.stderr
    watcher = subprocess.Popen(
        [str(Path(PY).parent / "trainq"), "watch", "-q"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        out = _trainq(tmp_path, "submit", "queue/examples/hf-trainer.yaml", env=env)
        # "job hf-trainer" once the watcher took it; a watcher still starting on a loaded machine is not there yet
        # within submit's wait, and submit then says which id the file will get
        assert out.returncode == 0 and "hf-trainer" in out.stdout, out.stdout + out.stderr
        folder = {}

        def ended() -> bool:
            for state in ("done", "failed"):
                if (tmp_path / "queue" / state / "hf-trainer" / "run.json").exists():
                    folder["state"] = state
                    return json.loads((tmp_path / "queue" / state / "hf-trainer" / "run.json").read_text()).get(
                        "status"
                    ) not in (None, "running", "pending")
            return False

        wait_until(ended, 300, interval_s=0.5, what="the HF example ends")
        job = tmp_path / "queue" / folder["state"] / "hf-trainer"
        assert folder["state"] == "done", (job / "output.log").read_text()[-3000:]
        run = json.loads((job / "run.json").read_text())
        assert run["attempts"][0]["program"] == str(Path(PY).parent / "python")
    finally:
        watcher.terminate()
        watcher.wait(timeout=30)
