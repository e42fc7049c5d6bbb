"""Issue 37's loose ends of resume: a finished run resumed trains nothing and says so (and writes its outputs from
the last checkpoint when they are missing); a stop.flag older than the attempt is cleared with a line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer_util import build_tiny, output, records, run_trainer, summary, write_job
from trainq.trainer.distributed import World
from trainq.trainer.run import clear_stale_stop_flag
from trainq.watcher.spec.contract import EXIT_OK

SHORT = {"max_steps": 8, "eval_every": None, "checkpoint": {"every_steps": 4, "keep": 3}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def finished(tiny, tmp_path_factory) -> Path:
    job = write_job(tmp_path_factory.mktemp("done") / "job", tiny, **SHORT)
    assert run_trainer(job) == EXIT_OK, output(job)[-3000:]
    return job


def test_resuming_a_finished_run_trains_nothing_and_says_so(finished):
    before = {name: (finished / name).read_bytes() for name in ("metrics.jsonl", "summary.json", "SHA256SUMS")}
    latest = finished / "checkpoints" / "ckpt_latest"
    assert run_trainer(finished, "--resume-from", str(latest)) == EXIT_OK, output(finished)[-3000:]
    said = "trainq: step-000008 is step 8 of 8: this run is finished (summary.json says done); nothing to train"
    assert said in output(finished) and "step 9/8" not in output(finished)
    assert {name: (finished / name).read_bytes() for name in before} == before


def test_a_finished_run_without_its_outputs_writes_them_from_the_last_checkpoint(finished, tmp_path):
    job = tmp_path / "copy"
    shutil.copytree(finished, job, symlinks=True)
    adapter = (job / "adapter" / "adapter_model.safetensors").read_bytes()
    shutil.rmtree(job / "adapter")
    (job / "summary.json").unlink()
    steps = len(records(job, "step"))
    assert run_trainer(job, "--resume-from", str(job / "checkpoints" / "ckpt_latest")) == EXIT_OK, output(job)
    assert "writing the final outputs from it, no training" in output(job)
    assert len(records(job, "step")) == steps  # no step trained
    assert (job / "adapter" / "adapter_model.safetensors").read_bytes() == adapter
    done = summary(job)
    assert done["outcome"] == "done" and done["steps"] == 8 and done["final_loss"] == records(job, "step")[-1]["loss"]


def test_a_stale_stop_flag_is_cleared_with_a_line_and_the_resume_trains_to_the_end(tiny, tmp_path):
    job = write_job(tmp_path / "job", tiny, **SHORT)
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="stop_at=4") == EXIT_OK, output(job)[-3000:]
    flag = job / "stop.flag"
    assert flag.exists() and summary(job)["outcome"] == "stopped"
    assert run_trainer(job, "--resume-from", str(job / "checkpoints" / "ckpt_latest")) == EXIT_OK
    assert "trainq: removed a stale stop.flag written at " in output(job)
    assert summary(job)["outcome"] == "done" and summary(job)["steps"] == 8 and not flag.exists()


def test_a_stop_flag_written_just_before_the_attempt_started_is_stale(tmp_path):
    """0.15 s before the process starts is before it: psutil's create_time (boot time in whole seconds) read the
    start up to 1 s early and kept such a flag, so a quick resume after a stop trained nothing (seen in a run)."""
    flag = tmp_path / "stop.flag"
    code = (
        "import sys; from pathlib import Path; from trainq.trainer.distributed import World; "
        "from trainq.trainer.run import clear_stale_stop_flag, process_started_at; import os, time; "
        "print(round(time.time() - process_started_at(os.getpid()), 3)); "
        "clear_stale_stop_flag(Path(sys.argv[1]), World())"
    )
    for _ in range(3):
        flag.touch()
        time.sleep(0.15)
        done = subprocess.run([sys.executable, "-c", code, str(flag)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        age = float(done.stdout.splitlines()[0])
        assert 0 <= age < 60, done.stdout  # the process's own age, as read: never in the future
        assert not flag.exists() and "removed a stale stop.flag" in done.stdout, done.stdout


def test_a_stop_flag_newer_than_the_attempt_is_kept(tmp_path, capsys):
    flag = tmp_path / "stop.flag"
    flag.touch()  # this test process started before it: a stop asked during this attempt
    clear_stale_stop_flag(flag, World())
    assert flag.exists() and capsys.readouterr().out == ""
    past = time.time() - 10 * 365 * 24 * 3600
    os.utime(flag, (past, past))  # before any process of this machine started
    clear_stale_stop_flag(flag, World())
    assert not flag.exists() and "removed a stale stop.flag" in capsys.readouterr().out
