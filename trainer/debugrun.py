"""``debug: true``: a short smoke run of the same config before the real one.

In ``JOB_DIR/debug/`` the trainer runs the job's own config shortened to ``smoke_steps`` (20 steps, or 2 % of the
run when that is fewer, at least 4), with an eval and a checkpoint halfway, then a second process resumes from
that checkpoint and finishes. It passes when both processes exit 0 with finite losses and the loss shows learning
(it falls by at least LEARN_MARGIN of its start and does not sit at ln V, the uniform-prediction level: plateau.py);
the verdict (losses,
peak memory, whether the resumed run matches the first one) goes to ``debug/verdict.json``, a ``debug`` event
and the log. On failure the real run never starts: this process exits with the smoke run's exit code and its
last line, so the watcher's diagnosis names what broke (data, oom, nan, ...).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from trainq.trainer.config import TrainConfig, read_job
from trainq.trainer.metrics import MetricsWriter, read_records
from trainq.trainer.plateau import LEARN_MARGIN, learning_verdict
from trainq.watcher.spec.contract import ENV_ATTEMPT, ENV_METRICS, ENV_RESUME_FROM, ENV_STOP_FLAG, EXIT_FAILED, EXIT_OK
from trainq.watcher.spec.fsutil import atomic_write_json
from trainq.watcher.spec.interpreter import safe_module_argv

#: smoke-run length: this many steps, or SMOKE_SHARE of the real run when fewer, never under SMOKE_MIN_STEPS
SMOKE_STEPS = 20
SMOKE_SHARE = 0.02
SMOKE_MIN_STEPS = 4
DEBUG_DIR = "debug"
VERDICT_FILE = "verdict.json"


def smoke_steps(config: TrainConfig, real_steps: int) -> int:
    """Steps of the smoke run (even, so the halfway checkpoint is a whole step)."""
    steps = max(SMOKE_MIN_STEPS, min(SMOKE_STEPS, math.ceil(real_steps * SMOKE_SHARE)))
    return steps + steps % 2


def smoke_block(block: dict, config: TrainConfig, steps: int) -> dict:
    """The job's train: block with absolute paths, shortened, evaluated and checkpointed halfway, no debug/export."""
    out = {k: v for k, v in block.items() if k not in ("debug", "export", "report_to", "epochs", "max_steps", "preset")}
    out["model"] = config.model
    for key in ("init_from", "chat_template"):  # the smoke job lives in debug/: its relative paths would not resolve
        if getattr(config, key):
            out[key] = getattr(config, key)
    if config.eval_samples_prompts:
        out["eval_samples"] = {**block["eval_samples"], "prompts": config.eval_samples_prompts}
    data = {"train": [{"path": p, "weight": w} for p, w in config.train_sources], "max_bad_rows": config.max_bad_rows}
    if config.eval_file:
        data["eval"] = config.eval_file
    out.update(
        data=data,
        max_steps=steps,
        eval_every=steps // 2,
        log_every=max(steps // 4, 1),
        checkpoint={"every_steps": steps // 2, "keep": 2},
        seq_len=config.seq_len,
        batch_size=config.batch_size,
        grad_accum=config.grad_accum,
    )
    return out


def _run(job: Path, env: dict[str, str], stop_flag: Path) -> tuple[int, str]:
    """One trainer process on the smoke folder; (exit code, its last output line)."""
    with open(job / "output.log", "ab") as log:
        code = subprocess.call(
            [*safe_module_argv(sys.executable, "trainq.trainer"), str(job)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, ENV_STOP_FLAG: str(stop_flag)},
        )
    lines = (job / "output.log").read_text(errors="replace").strip().splitlines()
    return code, lines[-1] if lines else ""


def run_debug(
    config: TrainConfig,
    job_dir: Path,
    stop_flag: Path,
    real_steps: int,
    metrics: MetricsWriter,
    uniform: float | None = None,
) -> int | None:
    """Run the smoke test; None when it passed (go on with the real run), else the exit code to end with."""
    steps = smoke_steps(config, real_steps)
    folder = job_dir / DEBUG_DIR
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    _job, block = read_job(job_dir)
    (folder / "job.yaml").write_text(
        yaml.safe_dump({"approved": True, "train": smoke_block(block, config, steps)}, sort_keys=False)
    )
    env = {k: v for k, v in os.environ.items() if k not in (ENV_RESUME_FROM, ENV_METRICS, ENV_ATTEMPT)}
    print(
        f"trainq: debug run: {steps} steps in {folder} (eval and checkpoint at step {steps // 2}, then a resume)",
        flush=True,
    )
    code, last = _run(folder, env, stop_flag)
    first = _step_losses(folder)
    resumed = None
    if code == EXIT_OK and (folder / "checkpoints" / _step_name(steps // 2)).is_dir():
        (folder / "metrics.jsonl").rename(folder / "metrics-first.jsonl")
        for name in ("summary.json",):
            (folder / name).unlink(missing_ok=True)
        env[ENV_RESUME_FROM] = str(folder / "checkpoints" / _step_name(steps // 2))
        code, last = _run(folder, env, stop_flag)
        resumed = _step_losses(folder)
    verdict = _verdict(folder, code, last, steps, first, resumed, uniform)
    atomic_write_json(folder / VERDICT_FILE, verdict)
    metrics.event("debug", verdict["message"], **{k: v for k, v in verdict.items() if k != "message"})
    print(f"trainq: {verdict['message']}", flush=True)
    if verdict["passed"]:
        return None
    why = verdict["not_learning"] or last
    print(f"trainq: debug run failed; the real run was not started: {why}", file=sys.stderr, flush=True)
    return code if code not in (EXIT_OK, None) else EXIT_FAILED


def _step_name(step: int) -> str:
    from trainq.trainer.checkpoints import step_dir_name

    return step_dir_name(step)


def _step_losses(folder: Path) -> dict[int, float | None]:
    return {r["step"]: r.get("loss") for r in read_records(folder / "metrics.jsonl") if r.get("type") == "step"}


def _verdict(
    folder: Path, code: int, last: str, steps: int, first: dict, resumed: dict | None, uniform: float | None = None
) -> dict:
    summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").is_file() else {}
    records = read_records(folder / "metrics.jsonl") + read_records(folder / "metrics-first.jsonl")
    peak = max((r.get("peak_mem_mb") or 0 for r in records), default=0)
    losses = [v for v in {**first, **(resumed or {})}.values()]
    finite = bool(losses) and all(v is not None and math.isfinite(v) for v in losses)
    evals = [r["eval_loss"] for r in records if r.get("type") == "eval"]
    overlap = sorted(set(first) & set(resumed or {}))
    resume_diff = (
        max(
            (abs(first[s] - resumed[s]) for s in overlap if first[s] is not None and resumed[s] is not None),
            default=None,
        )
        if resumed
        else None
    )
    by_step = {**first, **(resumed or {})}
    not_learning = learning_verdict([by_step[k] for k in sorted(by_step)], uniform) if finite else None
    passed = (
        code == EXIT_OK and resumed is not None and finite and summary.get("outcome") == "done" and not not_learning
    )
    what = (
        "passed"
        if passed
        else (f"FAILED: {not_learning}" if code == EXIT_OK and not_learning else f"FAILED (exit {code}: {last})")
    )
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    message = (
        f"debug run {what}: {steps} steps, loss {fmt(losses[0] if losses else None)} -> "
        f"{fmt(losses[-1] if losses else None)}, eval loss {fmt(evals[-1] if evals else None)}, peak memory {peak:.0f} MiB, "
        f"resumed from step {steps // 2}: {'yes' if resumed is not None else 'no'}"
        + (f" (max step-loss difference vs the first run {resume_diff:.2g})" if resume_diff is not None else "")
    )
    return {
        "passed": passed,
        "exit_code": code,
        "steps": steps,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "eval_loss": evals[-1] if evals else None,
        "peak_mem_mb": peak,
        "resumed": resumed is not None,
        "resume_loss_diff": resume_diff,
        "last_line": last,
        "not_learning": not_learning,
        "uniform_loss": uniform,
        "learn_margin": LEARN_MARGIN,
        "message": message,
    }
