"""Bring your own trainer: a real Hugging Face Trainer script under a real watcher, no trainq code in it.

One tiny model, one uninterrupted reference run, then: progress from the printed bar, stop + retry,
SIGKILL + automatic retry, each resuming from the right checkpoint-N, and final weights equal to the
reference's (HF resume is exact on CPU when max_steps stays fixed). The same with the one-line callback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import FAKE, PY, REPO, drop, job_processes, wait_until

HF_SCRIPT = FAKE / "hf_plain.py"
MAX_STEPS = 24
TRAIN_ARGS = [
    "--max_steps",
    str(MAX_STEPS),
    "--logging_steps",
    "4",
    "--per_device_train_batch_size",
    "4",
    "--learning_rate",
    "1e-3",
    "--report_to",
    "none",
    "--seed",
    "7",
    "--disable_tqdm",
    "false",
]
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run([PY, "-m", "trainq.trainer.tiny", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


@pytest.fixture(scope="module")
def reference(tiny: Path, tmp_path_factory) -> dict:
    """Final weights of an uninterrupted run of the same script and arguments."""
    out = tmp_path_factory.mktemp("reference")
    subprocess.run(
        [
            PY,
            str(HF_SCRIPT),
            *_script_args(tiny),
            "--output_dir",
            str(out / "run"),
            "--save_steps",
            "1000",
            "--save_weights",
            str(out / "final.pt"),
            *TRAIN_ARGS,
        ],
        check=True,
        env=dict(os.environ, **ENV),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=300,
    )
    return _weights(out / "final.pt")


def _script_args(tiny: Path) -> list[str]:
    return ["--model", str(tiny / "model"), "--data", str(tiny / "train.jsonl")]


def _weights(path: Path) -> dict:
    import torch

    return torch.load(path)


def _max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _submit(queue: Path, name: str, tiny: Path, *extra: str, **fields) -> Path:
    job = {
        "approved": True,
        "command": [
            PY,
            str(HF_SCRIPT),
            *_script_args(tiny),
            "--output_dir",
            "{job_dir}/checkpoints",
            "--save_weights",
            "{job_dir}/final.pt",
            *TRAIN_ARGS,
            *extra,
        ],
        "env": ENV,
        "resources": {"gpus": 0},
        "resume_args": ["--resume_from_checkpoint", "{resume_from}"],
        **fields,
    }
    drop(queue, f"{name}.yaml", yaml.safe_dump(job, sort_keys=False))
    return queue


def _cli(queue: Path, *args: str) -> str:
    done = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue), *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _run(queue: Path, job_id: str) -> dict | None:
    for state in ("running", "pending", "failed", "done"):
        path = queue / state / job_id / "run.json"
        try:
            return {**json.loads(path.read_text()), "state": state}
        except (FileNotFoundError, ValueError):
            continue
    return None


def _in_state(queue: Path, job_id: str, state: str, attempt: int | None = None) -> dict | None:
    run = _run(queue, job_id)
    if run and run["state"] == state and (attempt is None or run["attempt"] == attempt):
        return run
    return None


def _checkpoints(job_dir: Path) -> list[int]:
    """Steps of the complete checkpoint-N folders (trainer_state.json written)."""
    found = []
    for path in (job_dir / "checkpoints").glob("checkpoint-*"):
        if (path / "trainer_state.json").exists():
            found.append(int(path.name.split("-")[1]))
    return sorted(found)


def _signal_script(job_dir: Path, sig: int) -> None:
    """Signal the training script itself (not its supervisor), as the OOM killer or a preemption would."""
    [script] = [p for p in job_processes(job_dir) if str(HF_SCRIPT) in " ".join(p.cmdline())]
    script.send_signal(sig)


def _global_step(checkpoint: Path) -> int:
    return json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]


def _progress(queue: Path, job_id: str) -> dict | None:
    try:
        status = json.loads((queue / "status.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return next((j["progress"] for j in status["jobs"] if j["id"] == job_id and j["progress"]), None)


def _assert_finished_like_reference(queue: Path, job_id: str, reference: dict) -> None:
    job_dir = queue / "done" / job_id
    assert _global_step(job_dir / "checkpoints" / f"checkpoint-{MAX_STEPS}") == MAX_STEPS
    diff = _max_abs_diff(_weights(job_dir / "final.pt"), reference)
    print(f"{job_id}: max abs diff of final weights vs an uninterrupted run: {diff}")
    assert diff == 0.0


def test_plain_hf_script_resumes_after_stop_retry_and_sigkill(queue_dir, watcher_process, tiny, reference):
    """No trainq code: progress from the printed bar; stop+retry and SIGKILL+auto-retry resume from checkpoint-N."""
    watcher_process()
    _submit(
        queue_dir,
        "hf",
        tiny,
        "--save_steps",
        "4",
        "--step_sleep_s",
        "0.25",
        stop_grace="1s",
        retries={"max": 2, "on": ["killed", "unknown"], "backoff": "1s"},
    )
    running = queue_dir / "running" / "hf"
    progress = wait_until(
        lambda: (p := _progress(queue_dir, "hf")) and p["step"] and p["eta_s"] is not None and p,
        120,
        0.2,
        "step/total/ETA in status.json",
    )
    assert progress["total_steps"] == MAX_STEPS and 0 < progress["step"] <= MAX_STEPS
    wait_until(lambda: _checkpoints(running) and _checkpoints(running)[-1] >= 8, 60, 0.1, "checkpoint-8")

    # stop: the script ignores stop.flag, so it gets SIGTERM after stop_grace; retry resumes from the newest
    _cli(queue_dir, "stop", "hf")
    stopped = wait_until(lambda: _in_state(queue_dir, "hf", "failed"), 60, 0.1, "stopped")
    assert stopped["status"] == "cancelled"
    failed = queue_dir / "failed" / "hf"
    log = (failed / "output.log").read_bytes().decode()  # bytes: tqdm's \r must not pass for a newline
    assert "\ntrainq: stop requested by the user (stop.flag); SIGTERM in 1 s\n" in log
    assert "\ntrainq: sent SIGTERM to the job's process tree" in log
    newest = _checkpoints(failed)[-1]
    said = _cli(queue_dir, "retry", "hf")
    assert f"resuming from checkpoints/checkpoint-{newest}" in said

    second = wait_until(lambda: _in_state(queue_dir, "hf", "running", 2), 60, 0.1, "attempt 2")
    assert second["attempts"][-1]["resumed_from"] == str(running / "checkpoints" / f"checkpoint-{newest}")
    wait_until(lambda: _checkpoints(running)[-1] >= newest + 4, 90, 0.1, "a newer checkpoint")

    # SIGKILL (as the OOM killer would): retried automatically from the newest complete checkpoint
    _signal_script(running, signal.SIGKILL)
    third = wait_until(lambda: _in_state(queue_dir, "hf", "running", 3), 60, 0.05, "attempt 3")
    resumed = Path(third["attempts"][-1]["resumed_from"])
    assert resumed.parent == running / "checkpoints" and int(resumed.name.split("-")[1]) >= newest + 4
    assert third["attempts"][1]["diagnosis"]["kind"] == "killed"

    done = wait_until(lambda: _in_state(queue_dir, "hf", "done"), 120, 0.2, "done")
    assert [a["resumed_from"] is not None for a in done["attempts"]] == [False, True, True]
    log = (queue_dir / "done" / "hf" / "output.log").read_text()
    assert f"resuming from {resumed}" in log and f"final global_step {MAX_STEPS}" in log
    _assert_finished_like_reference(queue_dir, "hf", reference)


def test_hf_callback_stops_with_a_fresh_checkpoint_and_exits_0(queue_dir, watcher_process, tiny, reference):
    """With TrainqCallback: stop saves at the end of the step (no SIGTERM), exit 0; SIGTERM saves then exits 143."""
    watcher_process()
    _submit(
        queue_dir,
        "cb",
        tiny,
        "--trainq",
        "--save_steps",
        "1000",
        "--step_sleep_s",
        "0.25",
        stop_grace="60s",
        retries={"max": 2, "on": ["preempted", "killed", "unknown"], "backoff": "1s"},
    )
    running = queue_dir / "running" / "cb"
    wait_until(lambda: (p := _progress(queue_dir, "cb")) and (p["step"] or 0) >= 3, 120, 0.1, "step 3")
    _cli(queue_dir, "stop", "cb")
    stopped = wait_until(lambda: _in_state(queue_dir, "cb", "failed"), 60, 0.1, "stopped")
    failed = queue_dir / "failed" / "cb"
    assert stopped["status"] == "cancelled" and stopped["attempts"][-1]["exit_code"] == 0
    assert json.loads((failed / "exit.json").read_text())["signals_sent"] == []
    [step] = _checkpoints(failed)  # save_steps 1000: the only checkpoint is the one the stop asked for
    assert 3 <= step < MAX_STEPS
    records = [json.loads(line) for line in (failed / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["type"] == "checkpoint" and records[-1]["path"].endswith(
        f"running/cb/checkpoints/checkpoint-{step}"
    )
    assert {"step", "total_steps"} <= records[0].keys()

    assert f"resuming from checkpoints/checkpoint-{step}" in _cli(queue_dir, "retry", "cb")
    second = wait_until(lambda: _in_state(queue_dir, "cb", "running", 2), 60, 0.1, "attempt 2")
    assert second["attempts"][-1]["resumed_from"] == str(running / "checkpoints" / f"checkpoint-{step}")

    # preemption: SIGTERM to the script; the callback saves at the step's end and exits 143, retried at once
    wait_until(lambda: (p := _progress(queue_dir, "cb")) and (p["step"] or 0) >= step + 2, 90, 0.05, "2 more steps")
    _signal_script(running, signal.SIGTERM)
    third = wait_until(
        lambda: (r := _run(queue_dir, "cb")) and (r["attempt"] == 3 or r["state"] in ("done", "failed")) and r,
        90,
        0.05,
        "attempt 3",
    )
    assert third["attempts"][1]["exit_code"] == 143 and third["attempt"] == 3, third["attempts"][1]
    assert third["attempts"][1]["diagnosis"]["kind"] == "preempted"
    preempted_at = Path(third["attempts"][-1]["resumed_from"])
    assert int(preempted_at.name.split("-")[1]) >= step + 2
    wait_until(lambda: _in_state(queue_dir, "cb", "done"), 120, 0.2, "done")
    _assert_finished_like_reference(queue_dir, "cb", reference)


def test_plain_pytorch_loop_example_stops_and_resumes_exactly(tmp_path):
    """queue/examples/plain_loop.py (the README's loop): stop.flag saves step-N and exits 0; resuming ends
    where an uninterrupted run ends."""
    script = REPO / "queue" / "examples" / "plain_loop.py"

    def run(job: Path, **env: str) -> str:
        job.mkdir(exist_ok=True)
        base = {
            "TRAINQ_JOB_DIR": str(job),
            "TRAINQ_METRICS": str(job / "metrics.jsonl"),
            "TRAINQ_STOP_FLAG": str(job / "stop.flag"),
        }
        done = subprocess.run(
            [PY, str(script), "--steps", "30", "--save-every", "10"],
            capture_output=True,
            text=True,
            env=dict(os.environ, **ENV, **base, **env),
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    whole = run(tmp_path / "whole")
    job = tmp_path / "job"
    job.mkdir()
    (job / "stop.flag").touch()  # stopped at once: saves step-1 and exits 0
    assert run(job) == ""
    record = json.loads((job / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["type"] == "checkpoint" and record["path"] == str(job / "checkpoints" / "step-1")
    (job / "stop.flag").unlink()
    assert run(job, TRAINQ_RESUME_FROM=record["path"]) == whole
    assert "done at step 30" in whole


def test_lightning_callback_stops_with_a_checkpoint_and_resumes(queue_dir, watcher_process):
    """A real Lightning script with TrainqLightningCallback: stop saves and exits 0; retry resumes to max_steps."""
    pytest.importorskip("pytorch_lightning")
    watcher_process()
    job = {
        "approved": True,
        "command": [PY, str(FAKE / "lightning_script.py")],
        "env": ENV,
        "resources": {"gpus": 0},
        "stop_grace": "60s",
        "resume_args": ["--ckpt_path", "{resume_from}"],
    }
    drop(queue_dir, "pl.yaml", yaml.safe_dump(job, sort_keys=False))
    wait_until(lambda: (p := _progress(queue_dir, "pl")) and (p["step"] or 0) >= 5, 120, 0.1, "step 5")
    _cli(queue_dir, "stop", "pl")
    stopped = wait_until(lambda: _in_state(queue_dir, "pl", "failed"), 60, 0.1, "stopped")
    assert stopped["status"] == "cancelled" and stopped["attempts"][-1]["exit_code"] == 0
    [ckpt] = (queue_dir / "failed" / "pl" / "checkpoints").glob("trainq-step=*.ckpt")
    step = int(ckpt.stem.split("=")[1])
    assert f"resuming from checkpoints/{ckpt.name}" in _cli(queue_dir, "retry", "pl")
    done = wait_until(lambda: _in_state(queue_dir, "pl", "done"), 120, 0.2, "done")
    assert done["attempts"][-1]["resumed_from"].endswith(f"running/pl/checkpoints/{ckpt.name}")
    log = (queue_dir / "done" / "pl" / "output.log").read_text()
    assert f"resumed at global_step {step}" in log and "final global_step 40" in log


def test_integrations_import_light_and_do_nothing_outside_trainq(tmp_path):
    """Importing the integrations loads no torch/transformers; the callbacks load them only when asked for."""
    code = (
        "import sys; from trainq.trainer.integrations import TrainqLink; "
        "assert not {'torch', 'transformers', 'pytorch_lightning'} & set(sys.modules), sorted(sys.modules); "
        "link = TrainqLink.from_env({}); link.step(3, loss=1.0); "
        "assert not link.active and not link.stop_requested() and not link.catch_sigterm(); print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINQ_")}
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr
    assert list(tmp_path.iterdir()) == []


def test_shipped_hf_example_with_the_callback_stops_after_one_step(tmp_path, tiny):
    """queue/examples/hf_train.py --trainq: a stop.flag already there means save checkpoint-1 and exit 0."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "stop.flag").touch()
    env = dict(
        os.environ,
        **ENV,
        TRAINQ_JOB_DIR=str(job),
        TRAINQ_METRICS=str(job / "metrics.jsonl"),
        TRAINQ_STOP_FLAG=str(job / "stop.flag"),
    )
    done = subprocess.run(
        [
            PY,
            str(REPO / "queue" / "examples" / "hf_train.py"),
            *_script_args(tiny),
            "--output_dir",
            str(job / "checkpoints"),
            "--max_steps",
            "40",
            "--save_steps",
            "10",
            "--report_to",
            "none",
            "--trainq",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert _global_step(job / "checkpoints" / "checkpoint-1") == 1
    assert not (job / "checkpoints" / "final").exists()  # the script's save after train() did not run on it
    types = [json.loads(line)["type"] for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert types == ["step", "event", "checkpoint"]
