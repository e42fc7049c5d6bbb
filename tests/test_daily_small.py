"""The smaller frictions of issue 24, each against real files and (where it matters) a real watcher."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import PY, trainq, wait_until
from test_workflows import _entry, _job, _where


def test_loss_column_keeps_the_magnitude_of_small_losses():
    from trainq.watcher.faces.view import _loss, short_number

    assert _loss({"progress": {"loss": 8.344e-05}}) == "8.3e-5"
    assert [short_number(v, 6) for v in (2.1345, 0.001234, 1234567.0, -3.2e-7)] == ["2.135", "0.0012", "1.2e6", "-3e-7"]


def test_validate_counts_a_sweeps_jobs_and_env_keys_sweep(tmp_path):
    sweep = tmp_path / "grid.yaml"
    sweep.write_text("approved: true\ncommand: [echo, '{lr}']\nsweep: {lr: [1, 2, 3], env.SEED: [1, 2]}\n")
    out = trainq(tmp_path, "validate", str(sweep))
    assert (
        out.returncode == 0
        and out.stdout.strip() == f"{sweep}: ok, approved; a sweep: it becomes 6 jobs (lr, env.SEED)"
    )
    from trainq.watcher.spec.sweeps import expand
    from trainq.watcher.spec.yaml12 import load_yaml12

    assert [v.data["env"] for v in expand(load_yaml12(sweep.read_text()))][:2] == [{"SEED": 1}, {"SEED": 2}]


@pytest.mark.skipif(
    any(__import__("importlib").util.find_spec(m) for m in ("tensorboard", "tensorboardX")),
    reason="tensorboard is installed here, so report_to: [tensorboard] is valid",
)
def test_report_to_tensorboard_without_the_package_is_refused_at_validation(tmp_path):
    job = tmp_path / "tb.yaml"
    job.write_text("approved: true\ntrain: {model: /m, data: /d.jsonl, max_steps: 2, report_to: [tensorboard]}\n")
    out = trainq(tmp_path, "validate", str(job))
    assert out.returncode == 2 and out.stdout.strip() == (
        f"{job}: train.report_to: tensorboard needs the tensorboard package beside trainq "
        "(pip install 'trainq[tensorboard]'); install it, or remove tensorboard"
    )


#: prints Hugging Face Trainer log dicts with an eval_loss that depends on {lr}
HF_LIKE = "print({'loss': 2.0, 'epoch': 1.0}); print({'eval_loss': %s, 'epoch': 1.0}); print({'eval_loss': 9.0})"


def test_command_sweep_ranked_by_eval_loss_and_cli_frictions(queue_dir, watcher_process, tmp_path):
    (queue_dir / "watcher.yaml").write_text("max_concurrent: 2\n")
    watcher_process()
    _job(queue_dir, "grid", command=[PY, "-c", HF_LIKE % "{lr}"], sweep={"lr": ["0.5", "0.25"]}, resources={"gpus": 0})
    _job(
        queue_dir,
        "long",
        command=[PY, "-c", "import time; time.sleep(60)"],
        stop_grace="45s",
        resources={"gpus": 0},
        resume_args=["--resume", "{resume_from}"],
    )
    wait_until(lambda: _where(queue_dir, "grid-2") == "done" and _where(queue_dir, "long") == "running", 30)
    wait_until(lambda: (_entry(queue_dir, "grid-2") or {}).get("best_eval_loss") is not None, 20)
    assert {_entry(queue_dir, f"grid-{i}")["best_eval_loss"] for i in (1, 2)} == {0.5, 0.25}

    rm = trainq(queue_dir, "rm", "long")
    assert rm.returncode == 2 and "can resume: rm would delete its checkpoints too" in rm.stderr
    assert _where(queue_dir, "long") == "running"
    stop = trainq(queue_dir, "stop", "long")
    assert "it shows `stopping` for up to its stop_grace (45s)" in stop.stdout, stop.stdout
    assert trainq(queue_dir, "stop", "--now", "long").returncode == 0
    waited = trainq(queue_dir, "wait", "long")
    assert waited.returncode == 1 and "cancelled" in waited.stdout  # not 143: a stop is no failure of the job's

    refused = trainq(queue_dir, "clean", "grid-1", "nope")
    assert refused.returncode == 2 and "no job with id 'nope'" in refused.stderr and _where(queue_dir, "grid-1")
    cleaned = trainq(queue_dir, "clean", "grid-1")
    assert cleaned.returncode == 0 and "removed 1 finished job(s): done/grid-1" in cleaned.stdout
    assert _where(queue_dir, "grid-1") is None and _where(queue_dir, "grid-2") == "done"


def test_shell_completion_of_ids_for_why_and_stop(queue_dir):
    (queue_dir / "running" / "lora-a").mkdir()
    (queue_dir / "failed" / "lora-b").mkdir()

    def complete(line: str) -> list[str]:
        env = dict(os.environ, _ARGCOMPLETE="1", COMP_LINE=line, COMP_POINT=str(len(line)), _ARGCOMPLETE_IFS="\n")
        done = subprocess.run(
            ["sh", "-c", f"'{Path(PY).with_name('trainq')}' 8>&1 9>/dev/null"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return done.stdout.split()

    for command in ("why", "stop", "retry", "logs", "fork"):
        assert complete(f"trainq --root {queue_dir} {command} lora") == ["lora-a", "lora-b"], command
