"""Helpers for the trainer tests: a tiny model, job folders, real `python -m trainq.trainer` processes, polling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
#: a short run that still shows learning, evals and several checkpoints
BASE_TRAIN = {
    "method": "lora",
    "max_steps": 24,
    "batch_size": 4,
    "seq_len": 48,
    "lr": 0.005,
    "eval_every": 8,
    "log_every": 8,
    "checkpoint": {"every_steps": 8, "keep": 2},
}


def build_tiny(out_dir: Path) -> Path:
    """Build the tiny model and data in-process (the test process has torch loaded anyway)."""
    from trainq.trainer.tiny import build

    if not (out_dir / "model" / "config.json").is_file():
        build(out_dir)
    return out_dir


def write_job(job_dir: Path, tiny: Path, **train: object) -> Path:
    """A job folder whose job.yaml trains the tiny model; keyword args override BASE_TRAIN (None removes a key)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    block = {
        "model": str(tiny / "model"),
        "data": {"train": str(tiny / "train.jsonl"), "eval": str(tiny / "eval.jsonl")},
    }
    block.update(BASE_TRAIN)
    for key, value in train.items():
        if value is None:
            block.pop(key, None)
        else:
            block[key] = value
    (job_dir / "job.yaml").write_text(yaml.safe_dump({"approved": True, "train": block}, sort_keys=False))
    return job_dir


def trainer_env(**extra: str) -> dict[str, str]:
    """The environment for a trainer subprocess: one thread (the test machine is shared), no stray switches."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINQ_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    env.update(extra)
    return env


def start_trainer(job_dir: Path, *args: str, **env: str) -> subprocess.Popen:
    """Start `python -m trainq.trainer JOB_DIR` with output into JOB_DIR/output.log."""
    log = open(job_dir / "output.log", "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "trainq.trainer", str(job_dir), *args],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=trainer_env(**env),
        )
    finally:
        log.close()


def run_trainer(job_dir: Path, *args: str, timeout_s: float = 180, **env: str) -> int:
    """Run the trainer to completion; returns its exit code (the process is killed on timeout)."""
    proc = start_trainer(job_dir, *args, **env)
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def output(job_dir: Path) -> str:
    """What the trainer printed."""
    return (job_dir / "output.log").read_text(errors="replace")


def records(job_dir: Path, record_type: str | None = None) -> list[dict]:
    """Parsed metrics.jsonl records (of one type when given)."""
    path = job_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if record_type is None or r["type"] == record_type]


def events(job_dir: Path, name: str) -> list[dict]:
    """Event records with this event name."""
    return [r for r in records(job_dir, "event") if r.get("event") == name]


def summary(job_dir: Path) -> dict:
    """summary.json."""
    return json.loads((job_dir / "summary.json").read_text())


def adapter_tensors(folder: Path) -> dict:
    """The LoRA tensors saved in a folder."""
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest absolute difference over matching tensors (the key sets must match)."""
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05):
    """Poll ``predicate`` until truthy (returned) or fail after ``timeout_s`` × TRAINQ_TEST_SLACK (conftest.py)."""
    timeout_s *= float(os.environ.get("TRAINQ_TEST_SLACK", "3"))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s}s")
