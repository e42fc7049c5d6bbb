"""A run's vital signs (issue 30): clip fraction and update ratio in every step, the stacks of a stalled job,
and a learning-rate schedule that is checked (by the built-in trainer, and by the watcher for command jobs).

Real trainer runs on the tiny model, real stalled processes, real py-spy (skipped where it is not installed).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import PY, REPO, drop, run_json, tick_until
from trainer_util import build_tiny, events, records, run_trainer, summary, write_job

from trainq.watcher.spec.contract import EXIT_SCHEDULE
from trainq.watcher.spec.lrschedule import lr_deviation, scheduled_lr
from trainq.watcher.supervisor.stacks import innermost, py_spy

needs_py_spy = pytest.mark.skipif(py_spy() is None, reason="py-spy is not installed (the train extra installs it)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


_run = run_json


def _entry(root: Path, job_id: str) -> dict:
    try:
        jobs = json.loads((root / "status.json").read_text())["jobs"]
    except (OSError, ValueError, KeyError):
        return {}
    return next((j for j in jobs if j["id"] == job_id), {})


# -- the trainer's vitals ------------------------------------------------------------------------------------------


def test_a_too_high_lr_is_clipped_on_nearly_every_step_and_raises_one_health_event(tmp_path: Path, tiny: Path) -> None:
    job = write_job(
        tmp_path / "hot",
        tiny,
        method="full",
        lr=5.0,
        max_steps=14,
        eval_every=None,
        checkpoint={"every_steps": 100, "keep": 1},
        log_every=100,
    )
    run_trainer(job)
    steps = records(job, "step")
    assert len(steps) == 14 and all("clip" in r for r in steps)
    assert [r["step"] for r in steps if "update_ratio" in r] == [1, 10]  # measured on step 1 and every 10th
    assert not any("update_ratio_sample" in r for r in steps)  # the tiny model's weights are measured whole
    assert sum(r["clip"] for r in steps) >= 12, [r["grad_norm"] for r in steps]
    health = events(job, "health")
    assert [e["signal"] for e in health].count("clip_fraction") == 1, health  # once per crossing, not every step
    clip = next(e for e in health if e["signal"] == "clip_fraction")
    assert clip["value"] > 0.8 and clip["threshold"] == 0.5 and "lower lr" in clip["message"]
    assert "most steps are clipped" in clip["message"]
    assert all(r["update_ratio"] is None or r["update_ratio"] >= 0 for r in steps if "update_ratio" in r)


def test_a_calm_run_records_small_updates_and_no_health_event(tmp_path: Path, tiny: Path) -> None:
    job = write_job(
        tmp_path / "calm", tiny, lr=1e-4, max_steps=12, eval_every=None, checkpoint={"every_steps": 100, "keep": 1}
    )
    assert run_trainer(job) == 0
    ratios = {r["step"]: r["update_ratio"] for r in records(job, "step") if "update_ratio" in r}
    assert list(ratios) == [1, 10] and 0 < ratios[10] < 0.1, ratios  # warm-up's first step may apply lr 0
    assert not any(r["clip"] for r in records(job, "step")) and not events(job, "health")


def test_update_ratio_every_step_or_never(tmp_path: Path, tiny: Path) -> None:
    every = write_job(tmp_path / "every", tiny, lr=1e-4, max_steps=4, eval_every=None, health={"update_ratio_every": 1})
    assert run_trainer(every) == 0
    assert [r["step"] for r in records(every, "step") if "update_ratio" in r] == [1, 2, 3, 4]
    never = write_job(tmp_path / "never", tiny, lr=1e-4, max_steps=4, eval_every=None, health={"update_ratio_every": 0})
    assert run_trainer(never) == 0
    steps = records(never, "step")
    assert len(steps) == 4 and not any("update_ratio" in r for r in steps) and all("clip" in r for r in steps)


@pytest.mark.parametrize("clipped, alert", [(3, False), (25, False), (26, True)])
def test_the_clip_alert_means_most_steps_and_a_healthy_run_stays_quiet(tmp_path: Path, clipped: int, alert: bool):
    """Issue 37: 3 of 50 steps clipped (6 %, a healthy run) raised "clipped on most steps"; the default now alerts
    only when more than half of the last 50 steps were clipped, and says what share."""
    from types import SimpleNamespace

    from trainq.trainer.metrics import MetricsWriter
    from trainq.trainer.vitals import CLIP_WINDOW, VitalsCallback

    run = SimpleNamespace(config=SimpleNamespace(health=None), metrics=MetricsWriter(tmp_path / "metrics.jsonl"))
    vitals = VitalsCallback(run)
    for flag in [False] * 7 + [True] * clipped + [False] * (CLIP_WINDOW - clipped):  # the first 7 leave the window
        vitals.note_clip(flag)
    vitals._judge(CLIP_WINDOW, None)
    raised = events(tmp_path, "health")
    assert bool(raised) == alert, raised
    if alert:
        assert raised[0]["message"] == (
            f"step 50: gradients clipped on {clipped * 2}% of the last 50 steps (threshold 50%): most steps are "
            "clipped; lower lr or raise max_grad_norm"
        )


def _full_model_step(tiny: Path):
    """The tiny model (full fine-tuning), its AdamW, and one optimizer step to run between snapshot and ratio."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny / "model")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    ids = torch.arange(48).reshape(2, 24) % model.config.vocab_size

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, step


def test_the_update_ratio_is_the_steps_own_and_a_sample_is_fixed_and_said(tmp_path: Path, tiny: Path) -> None:
    """Issue 37: the update ratio is ||theta_after - theta_before|| / ||theta_after|| of that optimizer step, computed
    by hand here over what it measures; past its budget it measures a fixed sample of whole tensors (the same at every
    measurement) and says which share of the trained values that is."""
    import torch

    from trainq.trainer.vitals import UpdateRatio, sample_tensors

    model, _, step = _full_model_step(tiny)
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    for budget in (total, total // 3):
        ratio = UpdateRatio(params, max_values=budget)
        measured = sum(p.numel() for p in ratio.params)
        assert (len(ratio.params) == len(params)) == (budget == total) and measured <= budget
        assert ratio.share == pytest.approx(measured / total) and (ratio.share < 1) == (budget < total)
        assert [id(p) for p in sample_tensors(params, budget)] == [id(p) for p in ratio.params]  # fixed
        for _ in range(2):  # the buffers are reused: a second measurement is as exact as the first
            before = [p.detach().clone() for p in ratio.params]
            ratio.snapshot()
            step()
            delta = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(ratio.params, before, strict=True)))
            weight = torch.sqrt(sum((p.detach() ** 2).sum() for p in ratio.params))
            assert ratio.ratio() == pytest.approx(float(delta / weight), rel=1e-5)


def test_a_sampled_update_ratio_is_labelled_in_the_step_record(tmp_path: Path, tiny: Path) -> None:
    """The trainer's own hooks around real optimizer steps: with the whole set measured the record carries no label;
    with a sample, update_ratio_sample is the share of trained values it covers."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState, TrainingArguments

    from trainq.trainer.metrics import MetricsWriter
    from trainq.trainer.vitals import VitalsCallback

    model, optimizer, step = _full_model_step(tiny)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    args = TrainingArguments(output_dir=str(tmp_path / "args"), use_cpu=True, report_to="none", learning_rate=1e-2)
    for budget in (total, total // 3):
        run = SimpleNamespace(
            config=SimpleNamespace(health=None),
            metrics=MetricsWriter(tmp_path / "metrics.jsonl"),
            trainer=SimpleNamespace(last_grad_norm=0.5),
            stop_reason=None,
            step_vitals={},
        )
        vitals = VitalsCallback(run, ratio_max_values=budget)
        state, control = TrainerState(max_steps=10), TrainerControl()
        vitals.on_train_begin(args, state, control, model=model)  # linear, no warm-up: step 0 applies the full lr
        vitals.on_pre_optimizer_step(args, state, control, optimizer=optimizer, model=model)
        step()
        vitals.on_optimizer_step(args, state, control)
        assert run.step_vitals["clip"] is False and run.step_vitals["update_ratio"] > 0
        if budget == total:
            assert "update_ratio_sample" not in run.step_vitals
        else:
            share = run.step_vitals["update_ratio_sample"]
            assert share == pytest.approx(vitals.ratio.share, abs=1e-4) and 0 < share < 1


def test_a_schedule_bug_stops_the_run_at_the_first_deviating_step(tmp_path: Path, tiny: Path) -> None:
    job = write_job(tmp_path / "bug", tiny, max_steps=12, eval_every=None, checkpoint={"every_steps": 100, "keep": 1})
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="lr_bug_at=5") == EXIT_SCHEDULE
    [deviation] = events(job, "schedule")
    assert deviation["kind"] == "schedule" and deviation["step"] == 5
    assert math.isclose(deviation["applied_lr"], 10 * deviation["expected_lr"], rel_tol=1e-6)
    assert "step 5: lr" in deviation["evidence"] and "the schedule says" in deviation["evidence"]
    fifth = [r for r in records(job, "step") if r["step"] == 5]
    assert max(r["step"] for r in records(job, "step")) == 5 and fifth[0]["update_ratio"] == 0  # not applied
    assert summary(job)["outcome"] == "schedule"


def test_a_resume_and_a_rollback_raise_no_false_deviation(tmp_path: Path, tiny: Path) -> None:
    job = write_job(tmp_path / "rr", tiny, max_steps=16, eval_every=None, checkpoint={"every_steps": 2, "keep": 3})
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="stop_at=5") == 0  # stopped after a checkpoint
    latest = summary(job)["latest_checkpoint"]
    (job / "stop.flag").unlink()  # what the watcher does before a retry
    code = run_trainer(job, "--resume-from", str(job / latest), TRAINQ_TRAINER_FAULTS="nan_at=9,10,11")
    assert code == 0, (job / "output.log").read_text()[-2000:]
    assert events(job, "rollback") or events(job, "nonfinite_loss")  # the rollback happened (lr halved)
    assert not events(job, "schedule"), events(job, "schedule")


# -- the watcher: status, stacks, a declared schedule ----------------------------------------------------------------


def _script(tmp: Path, name: str, body: str) -> str:
    path = tmp / f"{name}.py"
    path.write_text(body)
    return str(path)


def test_status_shows_the_clip_fraction_and_a_health_line(queue_dir: Path, watcher, tmp_path: Path) -> None:
    writer = _script(
        tmp_path,
        "clippy",
        (
            "import json, os, time\n"
            "m = open(os.environ['TRAINQ_METRICS'], 'a', buffering=1)\n"
            "for s in range(1, 31):\n"
            "    m.write(json.dumps({'type': 'step', 'step': s, 'total_steps': 1000, 'loss': 1.0, 'clip': s % 3 != 0,\n"
            "                        'update_ratio': 0.25, 'time': time.time()}) + '\\n')\n"
            "time.sleep(60)\n"
        ),
    )
    w = watcher()
    drop(queue_dir, "clippy.yaml", yaml.safe_dump({"approved": True, "command": [PY, writer], "stop_grace": "1s"}))
    entry = tick_until(w, lambda: (e := _entry(queue_dir, "clippy")).get("vitals") and e, 20)
    assert entry["progress"]["clip_fraction"] == pytest.approx(20 / 30, abs=1e-3)
    assert entry["progress"]["update_ratio"] == 0.25
    assert "clip fraction 0.67 > 0.5 over 30 steps" in entry["vitals"] and "update ratio 0.25 > 0.1" in entry["vitals"]
    out = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "why", "clippy"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert "health: clip fraction 0.67" in out.stdout
    (queue_dir / "running/clippy/stop.flag").touch()
    tick_until(w, lambda: _run(queue_dir, "clippy").get("status") == "cancelled", 20)


STUCK = {
    "sleep": (
        "import time\n\ndef stuck_here():\n    time.sleep(3600)\n\nprint('about to hang', flush=True)\nstuck_here()\n",
        "stuck_here",
    ),
    "lock": (
        "import threading\n\nlock = threading.Lock()\nlock.acquire()\n\ndef wait_for_lock():\n    lock.acquire()\n\n"
        "print('about to hang', flush=True)\nwait_for_lock()\n",
        "wait_for_lock",
    ),
}


@needs_py_spy
@pytest.mark.parametrize("how", sorted(STUCK))
def test_a_stalled_job_gets_its_stacks_recorded_and_a_diagnosis_naming_the_function(
    queue_dir: Path, watcher, tmp_path: Path, how: str
) -> None:
    body, function = STUCK[how]
    w = watcher()
    drop(
        queue_dir,
        "hang.yaml",
        yaml.safe_dump(
            {
                "approved": True,
                "command": [PY, _script(tmp_path, "hang", body)],
                "stall_after": "2s",
                "stop_grace": "4s",
                "retries": {"max": 0, "on": ["stalled"]},
            }
        ),
    )
    run = tick_until(w, lambda: (r := _run(queue_dir, "hang")).get("status") == "failed" and r, 60)
    assert run["diagnosis"]["kind"] == "stalled"
    assert function in run["diagnosis"]["evidence"], run["diagnosis"]
    stacks = sorted((queue_dir / "failed/hang/stacks").glob("*.txt"))
    assert stacks and function in stacks[0].read_text()


def test_innermost_frames_come_from_the_main_thread() -> None:
    dump = (
        'Process 1: python x.py\nPython v3.11.7\n\nThread 7 (idle): "worker"\n    poll (a.py:1)\n'
        'Thread 1 (idle): "MainThread"\n    stuck_here (x.py:3)\n    <module> (x.py:6)\n'
    )
    assert innermost(dump) == ["stuck_here (x.py:3)", "<module> (x.py:6)"]
    unnamed = "Process 9: python hang.py\n\nThread 9 (idle)\n    stuck_here (hang.py:4)\n    <module> (hang.py:7)\n"
    assert innermost(unnamed) == ["stuck_here (hang.py:4)", "<module> (hang.py:7)"]  # a lone thread has no name


def test_the_declared_schedule_matches_the_hugging_face_ones() -> None:
    import torch
    from transformers import get_scheduler

    plan = {"schedule": "cosine", "peak": 2e-4, "warmup_steps": 10, "total_steps": 100}
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-4)
    reference = get_scheduler("cosine", optimizer=opt, num_warmup_steps=10, num_training_steps=100)
    for step in (0, 5, 10, 37, 99):
        assert scheduled_lr(plan, step) == pytest.approx(2e-4 * reference.lr_lambdas[0](step), rel=1e-9)
    assert lr_deviation(plan, 37, scheduled_lr(plan, 36)) is None  # logged before or after the scheduler stepped
    assert "step 37: lr 0.002 logged" in lr_deviation(plan, 37, 2e-3)


def test_a_command_job_off_its_declared_schedule_is_flagged_and_with_abort_fails_as_schedule(
    queue_dir: Path, watcher, tmp_path: Path
) -> None:
    writer = _script(
        tmp_path,
        "sched",
        (
            "import json, math, os, sys, time\n"
            "bug = int(sys.argv[1])\n"
            "m = open(os.environ['TRAINQ_METRICS'], 'a', buffering=1)\n"
            "for s in range(1, 400):\n"
            "    lr = 2e-4 * s / 10 if s < 10 else 2e-4 * 0.5 * (1 + math.cos(math.pi * (s - 10) / 990))\n"
            "    lr = lr * 3 if s >= bug else lr\n"
            "    m.write(json.dumps({'type': 'step', 'step': s, 'lr': lr, 'loss': 1.0}) + '\\n')\n"
            "    time.sleep(0.02)\n"
            "    if os.path.exists(os.environ['TRAINQ_STOP_FLAG']): sys.exit(0)\n"
        ),
    )
    plan = {"schedule": "cosine", "peak": 2e-4, "warmup_steps": 10, "total_steps": 1000}
    w = watcher()
    drop(
        queue_dir,
        "good.yaml",
        yaml.safe_dump({"approved": True, "command": [PY, writer, "100000"], "expected_lr": plan}),
    )
    drop(
        queue_dir,
        "bad.yaml",
        yaml.safe_dump(
            {"approved": True, "command": [PY, writer, "7"], "expected_lr": plan, "abort_on_lr_deviation": True}
        ),
    )
    bad = tick_until(w, lambda: (r := _run(queue_dir, "bad")).get("status") == "failed" and r, 60)
    assert bad["diagnosis"]["kind"] == "schedule" and bad["diagnosis"]["evidence"].startswith("step 7: lr")
    flagged = [
        json.loads(x) for x in (queue_dir / "failed/bad/metrics.jsonl").read_text().splitlines() if '"schedule"' in x
    ]
    assert len(flagged) == 1 and flagged[0]["step"] == 7
    good = tick_until(w, lambda: (r := _run(queue_dir, "good")).get("status") == "done" and r, 60)
    assert "lr_deviation" not in good
