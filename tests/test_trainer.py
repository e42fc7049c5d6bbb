"""The real trainer as real processes (`python -m trainq.trainer JOB_DIR`) on the tiny model: runs, stops, kills, resumes."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.trainer_util import (
    adapter_tensors,
    build_tiny,
    events,
    max_abs_diff,
    output,
    records,
    run_trainer,
    start_trainer,
    summary,
    trainer_env,
    wait_until,
    write_job,
)
from trainq.watcher.spec.contract import EXIT_NAN, EXIT_OK, EXIT_OOM, EXIT_PREEMPTED, EXIT_USAGE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory) -> Path:
    """One uninterrupted 24-step run every resume test compares against."""
    job = write_job(tmp_path_factory.mktemp("ref") / "job", tiny)
    assert run_trainer(job) == EXIT_OK, output(job)
    return job


def test_lora_run_converges_and_writes_every_artifact(reference):
    steps = records(reference, "step")
    assert [r["step"] for r in steps] == list(range(1, 25))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3, "the loss should clearly fall"
    for key in ("step", "total_steps", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "time", "peak_mem_mb"):
        assert steps[-1][key] is not None, key
    assert isinstance(steps[-1]["time"], float) and steps[-1]["total_steps"] == 24
    assert [r["step"] for r in records(reference, "eval")] == [8, 16, 24]
    assert records(reference, "done")[-1]["outcome"] == "done"
    assert "step 8/24: loss " in output(reference)
    result = summary(reference)
    assert result["outcome"] == "done" and result["steps"] == 24 and result["best_eval_loss"] is not None
    assert result["best_checkpoint"] == "checkpoints/step-000024" and (reference / result["best_checkpoint"]).is_dir()
    assert result["output"] == "adapter" and result["latest_checkpoint"] == "checkpoints/step-000024"
    assert (reference / "loss.png").read_bytes()[:8] == PNG_MAGIC
    env = json.loads((reference / "env.json").read_text())
    assert env["torch"] and env["transformers"] and env["peft"] and env["config"]["max_steps"] == 24
    assert (reference / "adapter" / "adapter_model.safetensors").stat().st_mode & 0o777 == 0o644
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=reference, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "adapter/adapter_model.safetensors: OK" in check.stdout


def test_retention_keeps_last_two_plus_links(reference):
    ckpts = reference / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if not p.is_symlink()) == ["step-000016", "step-000024"]
    assert os.readlink(ckpts / "ckpt_latest") == "step-000024"
    assert (ckpts / "ckpt_best").is_symlink() and not os.path.isabs(os.readlink(ckpts / "ckpt_best"))
    assert [r["step"] for r in records(reference, "checkpoint")] == [8, 16, 24]
    assert all(Path(r["path"]).is_absolute() for r in records(reference, "checkpoint"))


def test_stop_flag_then_resume_matches_uninterrupted_run(reference, tiny, tmp_path):
    job = write_job(tmp_path / "job", tiny)
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="stop_at=11") == EXIT_OK, output(job)
    assert summary(job)["outcome"] == "stopped" and summary(job)["steps"] == 11
    assert os.readlink(job / "checkpoints" / "ckpt_latest") == "step-000011"
    (job / "stop.flag").unlink()
    code = run_trainer(job, TRAINQ_RESUME_FROM=str(job / "checkpoints" / "ckpt_latest"), TRAINQ_ATTEMPT="2")
    assert code == EXIT_OK, output(job)
    assert [r["step"] for r in records(job, "step")] == list(range(1, 25))
    diff = max_abs_diff(adapter_tensors(reference / "adapter"), adapter_tensors(job / "adapter"))
    print(f"stop/resume max abs diff vs uninterrupted: {diff}")
    assert diff == 0.0


def test_sigkill_at_random_step_then_resume_matches(reference, tiny, tmp_path):
    job = write_job(tmp_path / "job", tiny, checkpoint={"every_steps": 4, "keep": 2})
    kill_after = random.Random().randint(9, 18)
    proc = start_trainer(job, TRAINQ_TRAINER_FAULTS="sleep_per_step=0.15")
    try:
        wait_until(lambda: any(r["step"] >= kill_after for r in records(job, "step")), timeout_s=120)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    latest = os.readlink(job / "checkpoints" / "ckpt_latest")
    code = run_trainer(job, "--resume-from", str(job / "checkpoints" / "ckpt_latest"), TRAINQ_ATTEMPT="2")
    assert code == EXIT_OK, output(job)
    diff = max_abs_diff(adapter_tensors(reference / "adapter"), adapter_tensors(job / "adapter"))
    print(f"SIGKILL after step {kill_after} (resumed from {latest}): max abs diff {diff}")
    assert diff == 0.0


def test_sigterm_is_preemption_with_checkpoint(tiny, tmp_path):
    job = write_job(tmp_path / "job", tiny)
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="sigterm_at=5") == EXIT_PREEMPTED, output(job)
    assert summary(job)["outcome"] == "preempted"
    assert os.readlink(job / "checkpoints" / "ckpt_latest") == "step-000005"
    assert records(job, "done")[-1]["outcome"] == "preempted"


def test_kill_during_save_never_becomes_latest(tiny, tmp_path):
    job = write_job(tmp_path / "job", tiny, checkpoint={"every_steps": 4, "keep": 2})
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="kill_in_save=8") == -signal.SIGKILL
    ckpts = job / "checkpoints"
    assert (ckpts / "step-000008.tmp").is_dir() and not (ckpts / "step-000008.tmp" / "manifest.json").exists()
    assert os.readlink(ckpts / "ckpt_latest") == "step-000004"
    shutil.copytree(ckpts / "step-000008.tmp", ckpts / "step-000008")  # a half-written folder under the final name
    from trainq.trainer.checkpoints import CheckpointError, resolve_resume

    assert resolve_resume(ckpts / "ckpt_latest").name == "step-000004"
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        resolve_resume(ckpts / "step-000008")
    code = run_trainer(job, "--resume-from", str(ckpts / "step-000008"))
    assert code == EXIT_USAGE and "incomplete checkpoint" in output(job).splitlines()[-1]


def test_time_cadence_and_preset_from_simulated_gpu(tiny, tmp_path):
    sim = tmp_path / "gpus.json"
    sim.write_text(json.dumps([{"index": 0, "name": "Sim 6GB", "memory_total_mb": 6144, "memory_used_mb": 0}]))
    job = write_job(
        tmp_path / "job",
        tiny,
        max_steps=10,
        batch_size=2,
        grad_accum=2,
        preset="auto",
        eval_every=None,
        checkpoint={"every_minutes": 0.002, "keep": 2},
    )
    code = run_trainer(job, TRAINQ_TRAINER_FAULTS="sleep_per_step=0.2", TRAINQ_SIMULATE_GPUS=str(sim))
    assert code == EXIT_OK, output(job)
    saved = [r["step"] for r in records(job, "checkpoint")]
    assert len(saved) >= 4, f"the 0.12 s time rule should fire on most steps: {saved}"
    folders = sorted(p.name for p in (job / "checkpoints").iterdir() if not p.is_symlink())
    assert len(folders) == 2 and os.readlink(job / "checkpoints" / "ckpt_latest") in folders
    preset = events(job, "preset")[0]
    assert preset["applied"] and preset["knobs"]["batch_size"] == 4 and preset["knobs"]["grad_accum"] == 1
    assert json.loads((job / "env.json").read_text())["preset"]["estimate"]["total_mb"] > 0


def test_nan_rolls_back_with_halved_lr_and_spike_is_an_event(tiny, tmp_path):
    job = write_job(tmp_path / "job", tiny, max_steps=30, checkpoint={"every_steps": 4, "keep": 2}, eval_every=None)
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="nan_at=6,7,8,spike_at=28") == EXIT_OK, output(job)
    bad = [r for r in records(job, "step") if r.get("nonfinite")]
    assert [r["step"] for r in bad] == [6, 7, 8] and all(r["loss"] is None for r in bad)
    rollback = events(job, "rollback")
    assert len(rollback) == 1 and rollback[0]["lr_scale"] == 0.5 and rollback[0]["to"].endswith("step-000004")
    everything = records(job)
    before_rollback = everything[: everything.index(rollback[0])]
    assert [r["step"] for r in before_rollback if r["type"] == "checkpoint"] == [4], "a non-finite step is never saved"
    assert [e["step"] for e in events(job, "loss_spike")] == [28]
    assert summary(job)["outcome"] == "done" and summary(job)["rollbacks"] == 1


def test_persistent_nan_exits_66_after_rollbacks(tiny, tmp_path):
    job = write_job(tmp_path / "job", tiny, checkpoint={"every_steps": 2, "keep": 2}, eval_every=None)
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="nan_after=5") == EXIT_NAN, output(job)
    assert len(events(job, "rollback")) == 2
    assert "training diverged: non-finite loss persisted through 2 rollbacks" in output(job).splitlines()[-1]
    assert summary(job)["outcome"] == "nan" and summary(job)["rollbacks"] == 2, "summary and message agree"


def test_oom_gives_advice_and_next_attempt_takes_a_rung(tiny, tmp_path):
    job = write_job(tmp_path / "job", tiny, max_steps=6, batch_size=8, eval_every=None)
    faults = "oom_if_batch_over=4"
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS=faults) == EXIT_OOM, output(job)
    last = output(job).strip().splitlines()[-1]
    assert last.startswith("trainq: out of memory: ") and "batch_size 8 -> 4" in last
    oom = events(job, "oom")[0]
    assert oom["batch_size"] == 8 and "grad_accum" in oom["advice"]
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS=faults, TRAINQ_ATTEMPT="2") == EXIT_OK, output(job)
    rung = events(job, "oom_ladder")[0]
    assert rung["to"]["batch_size"] == 4 and rung["to"]["grad_accum"] == 2
    assert summary(job)["outcome"] == "done"


def test_help_says_how_to_run_by_hand():
    result = subprocess.run(
        [os.sys.executable, "-m", "trainq.trainer", "--help"],
        capture_output=True,
        text=True,
        env=trainer_env(),
        cwd=Path(__file__).resolve().parent.parent,
        timeout=60,
    )
    assert (
        result.returncode == 0 and "python -m trainq.trainer JOB_DIR" in result.stdout and "stop.flag" in result.stdout
    )
