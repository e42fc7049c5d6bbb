"""Train jobs end to end: the real trainer (tiny model, CPU) under the real watcher process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import PY, REPO, drop, wait_until

torch = pytest.importorskip("torch", reason="the training stack (pip install -e '.[train]') is not installed")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny model and dataset, built once for this module."""
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run([PY, "-m", "trainq.trainer.tiny", str(out)], check=True, cwd=REPO, capture_output=True, timeout=300)
    return out


def train_job(tiny: Path, faults: str | None = None, **overrides) -> str:
    train = {
        "model": str(tiny / "model"),
        "data": {"train": str(tiny / "train.jsonl"), "eval": str(tiny / "eval.jsonl")},
        "method": "lora",
        "max_steps": 24,
        "batch_size": 4,
        "seq_len": 32,
        "eval_every": 8,
        "seed": 3,
        "checkpoint": {"every_steps": 4, "keep": 2},
    }
    train.update(overrides.pop("train", {}))
    job = {"approved": True, "train": train, "stop_grace": "60s"}
    if faults:
        job["env"] = {"TRAINQ_TRAINER_FAULTS": faults}
    job.update(overrides)
    return yaml.safe_dump(job, sort_keys=False)


def status(root: Path) -> dict:
    try:
        return json.loads((root / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def job_entry(root: Path, job_id: str) -> dict:
    return next((j for j in status(root).get("jobs", []) if j["id"] == job_id), {})


def adapter_bytes(job_dir: Path) -> bytes:
    files = sorted((job_dir / "adapter").glob("*.safetensors"))
    assert files, f"no adapter in {job_dir}"
    from safetensors.torch import load_file

    tensors = load_file(str(files[0]))
    return b"".join(tensors[k].numpy().tobytes() for k in sorted(tensors))


def run_json(job_dir: Path) -> dict:
    return json.loads((job_dir / "run.json").read_text())


def test_lora_job_reaches_done_with_artifacts_and_rising_progress(queue_dir, watcher_process, tiny):
    watcher_process()
    drop(queue_dir, "lora.yaml", train_job(tiny, faults="sleep_per_step=0.15"))
    seen_steps = []

    def progressed():
        entry = job_entry(queue_dir, "lora")
        step = (entry.get("progress") or {}).get("step")
        if step is not None and (not seen_steps or step != seen_steps[-1]):
            seen_steps.append(step)
        return (queue_dir / "done" / "lora").exists() or (queue_dir / "failed" / "lora").exists()

    wait_until(progressed, 240, interval_s=0.1, what="train job finished")
    job_dir = queue_dir / "done" / "lora"
    assert job_dir.exists(), (queue_dir / "failed" / "lora" / "output.log").read_text()[-2000:]
    assert len(seen_steps) >= 3 and seen_steps == sorted(seen_steps), seen_steps
    for name in ("adapter", "summary.json", "loss.png", "env.json", "SHA256SUMS", "metrics.jsonl"):
        assert (job_dir / name).exists(), name
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=job_dir, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert (job_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    final = wait_until(lambda: job_entry(queue_dir, "lora").get("state") == "done" and job_entry(queue_dir, "lora"), 10)
    assert (final.get("outputs") or {}).get("loss_png", "").endswith("loss.png")
    # two throughputs, told apart: the last step's, and the whole run's (evaluations and checkpoints included)
    whole = json.loads((job_dir / "summary.json").read_text())["tokens_per_s"]
    shown = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "show", "lora"], capture_output=True, text=True
    ).stdout
    assert "tok/s stepping" in shown and f"{whole:.4g} tok/s over the run (summary.json)" in shown, shown


def test_stop_then_retry_resumes_and_matches_an_uninterrupted_run(queue_dir, watcher_process, tiny):
    watcher_process()
    drop(queue_dir, "whole.yaml", train_job(tiny))
    drop(queue_dir, "halves.yaml", train_job(tiny, faults="sleep_per_step=0.25"))
    wait_until(lambda: (queue_dir / "done" / "whole").exists(), 240, 0.2, "uninterrupted run done")
    wait_until(
        lambda: ((job_entry(queue_dir, "halves").get("progress") or {}).get("step") or 0) >= 6,
        120,
        0.1,
        "halves at step 6",
    )
    (queue_dir / "running" / "halves" / "stop.flag").touch()
    stopped = queue_dir / "failed" / "halves"
    wait_until(stopped.exists, 120, 0.1, "stopped job in failed/")
    run = run_json(stopped)
    assert run["status"] == "cancelled"
    assert (stopped / "checkpoints" / "ckpt_latest").exists()
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["outcome"] == "stopped"
    (stopped / "retry.flag").touch()
    done = queue_dir / "done" / "halves"
    wait_until(done.exists, 240, 0.2, "resumed job done")
    run = run_json(done)
    assert run["attempt"] == 2 and run["attempts"][-1]["resumed_from"]
    assert "resuming from" in (done / "output.log").read_text()
    assert adapter_bytes(done) == adapter_bytes(queue_dir / "done" / "whole")


def test_sigkill_watcher_during_training_then_restart_adopts_it(queue_dir, watcher_process, tiny):
    wp = watcher_process()
    drop(queue_dir, "adopt.yaml", train_job(tiny, faults="sleep_per_step=0.2"))
    wait_until(lambda: ((job_entry(queue_dir, "adopt").get("progress") or {}).get("step") or 0) >= 3, 120, 0.1)
    wp.kill()
    watcher_process()
    wait_until(lambda: (queue_dir / "done" / "adopt").exists(), 240, 0.2, "adopted job done")
    assert run_json(queue_dir / "done" / "adopt")["attempt"] == 1


def test_sigkill_trainer_retries_from_last_checkpoint(queue_dir, watcher_process, tiny):
    watcher_process()
    job = train_job(tiny, faults="sleep_per_step=0.2", retries={"max": 1, "on": ["killed"], "backoff": "1s"})
    drop(queue_dir, "crash.yaml", job)
    ckpt = queue_dir / "running" / "crash" / "checkpoints" / "ckpt_latest"
    wait_until(ckpt.exists, 180, 0.1, "first checkpoint")
    started = json.loads((queue_dir / "running" / "crash" / "supervisor.json").read_text())
    os.kill(started["job_pid"], signal.SIGKILL)
    wait_until(
        lambda: (queue_dir / "done" / "crash").exists() or (queue_dir / "failed" / "crash").exists(),
        240,
        0.2,
        "crash job finished",
    )
    done = queue_dir / "done" / "crash"
    assert done.exists(), (queue_dir / "failed" / "crash" / "output.log").read_text()[-3000:]
    run = run_json(done)
    assert run["attempt"] == 2
    assert run["attempts"][0]["diagnosis"]["kind"] == "killed"
    assert "checkpoints/step-" in (run["attempts"][1]["resumed_from"] or "")
