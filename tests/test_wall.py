"""Runs against a wall (docs/wall.md): deadlines, the window's ladder, verified delivery, cost.

Windows here are seconds long; the jobs are real programs (tests/fake_trainers/slow_steps.py, the
built-in trainer on the tiny model), the watchers real (in-process ones ticked by the test, or real
processes), rsync the real one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import FAKE, PY, REPO, drop, run_json, tick_until, wait_until

from trainq.watcher.spec.config import WatcherConfig
from trainq.watcher.spec.errors import InvalidWatcherConfig
from trainq.watcher.spec.units import iso_utc
from trainq.watcher.spec.wall import Cost, Deadline, Forecast, Window

SLOW = str(FAKE / "slow_steps.py")
needs_rsync = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed (.ci/system-deps)")


def _job(root: Path, name: str, **fields) -> Path:
    fields.setdefault("approved", True)
    return drop(root, f"{name}.yaml", yaml.safe_dump(fields, sort_keys=False))


_run = run_json


def _status(root: Path) -> dict:
    try:
        return json.loads((root / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _entry(root: Path, job_id: str) -> dict:
    return next((j for j in _status(root).get("jobs", []) if j["id"] == job_id), {})


def _window(seconds_to_final: float, freeze_early_s: float = 0.0, final_before_s: float = 60.0) -> dict:
    """A window whose final-checkpoint mark is ``seconds_to_final`` from now (freeze that much earlier still)."""
    ends = time.time() + seconds_to_final + final_before_s
    return {
        "ends_at": iso_utc(ends),
        "final_checkpoint_before": f"{final_before_s}s",
        "freeze_before": f"{final_before_s + freeze_early_s}s",
    }


# -- the arithmetic ----------------------------------------------------------------------------------------------


def test_cost_arithmetic_per_hour_and_per_gpu_hour() -> None:
    box = Cost(rate=2.49, currency="USD")
    assert box.of(1800, gpus=4) == {"amount": 1.245, "currency": "USD", "gpu_hours": 2.0, "hours": 0.5}
    per_gpu = Cost(rate=1.5, currency="EUR", per_gpu=True)
    assert per_gpu.of(7200, gpus=4)["amount"] == 12.0
    assert per_gpu.of(3600, gpus=0)["amount"] == 1.5  # a CPU job counts as one GPU-hour an hour


def test_a_deadline_is_a_time_or_a_duration_from_the_first_start() -> None:
    assert Deadline.parse("2026-12-02T08:00:00Z").at == 1796198400.0
    assert Deadline.parse("6h").resolve(1000.0) == 1000.0 + 6 * 3600
    assert Deadline.parse("6h").resolve(None) is None
    with pytest.raises(ValueError, match="ISO-8601"):
        Deadline.parse("tomorrow")


def test_the_forecast_says_the_rate_and_how_far_past_the_wall() -> None:
    now = 1796198400.0
    forecast = Forecast.from_progress({"step": 200, "total_steps": 2000, "eta_s": 4 * 3600}, now)
    assert forecast.steps_per_h == 450 and forecast.fits(now + 3 * 3600) is False
    assert (
        forecast.words(now + 3 * 3600, "wall") == "at 450 steps/h, 1,800 steps left: ends 12:00 UTC, 1 h after the wall"
    )


def test_the_window_and_cost_settings_are_checked_naming_the_field() -> None:
    with pytest.raises(InvalidWatcherConfig, match=r"cost.currency: expected a three-letter ISO 4217 code"):
        WatcherConfig.from_dict({"cost": {"per_hour": 2.49, "currency": "dollars"}})
    with pytest.raises(InvalidWatcherConfig, match=r"window.ends_at: expected an ISO-8601 time"):
        WatcherConfig.from_dict({"window": {"ends_at": "at eight"}})
    with pytest.raises(
        InvalidWatcherConfig, match=r"window.final_checkpoint_before: must not be longer than freeze_before"
    ):
        WatcherConfig.from_dict(
            {"window": {"ends_at": "2026-12-02T08:00:00Z", "freeze_before": "10m", "final_checkpoint_before": "20m"}}
        )
    with pytest.raises(InvalidWatcherConfig, match=r"cost: give exactly one of per_hour or per_gpu_hour"):
        WatcherConfig.from_dict({"cost": {"per_hour": 1, "per_gpu_hour": 2, "currency": "USD"}})
    window = WatcherConfig.from_dict({"window": {"ends_at": "2026-12-02T08:00:00Z"}}).window
    assert window == Window(ends_at=1796198400.0) and window.freeze_at == 1796198400.0 - 1800


def test_a_past_deadline_and_an_unwritable_target_are_rejected_naming_the_field(queue_dir: Path, watcher) -> None:
    w = watcher()
    _job(queue_dir, "late", command=["true"], deadline="2020-01-01T00:00:00Z")
    _job(queue_dir, "nowhere", command=["true"], deliver={"to": "/proc/self/no-such-place"})
    _job(queue_dir, "fine", command=["true"], deadline="2h", deliver={"to": str(queue_dir.parent / "results")})
    tick_until(
        w,
        lambda: (
            _run(queue_dir, "late").get("status") == "rejected"
            and _run(queue_dir, "nowhere").get("status") == "rejected"
            and _run(queue_dir, "fine").get("status") == "done"
        ),
    )
    late = _run(queue_dir, "late")["errors"]
    assert [e["path"] for e in late] == ["deadline"] and "is in the past" in late[0]["message"]
    assert [e["path"] for e in _run(queue_dir, "nowhere")["errors"]] == ["deliver.to"]
    out = subprocess.run(
        [PY, "-m", "trainq.watcher", "validate", str(queue_dir / "failed" / "late" / "job.yaml")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 2 and "deadline:" in out.stdout and "in the past" in out.stdout


# -- forecasts, the freeze, the final mark -----------------------------------------------------------------------


def test_a_job_that_will_not_fit_is_flagged_early(queue_dir: Path, watcher, caplog) -> None:
    caplog.set_level("INFO", logger="trainq.watcher")
    w = watcher(window=_window(seconds_to_final=120))
    _job(queue_dir, "long", command=[PY, SLOW, "4000", "0.05", "1000"])
    entry = tick_until(
        w, lambda: (e := _entry(queue_dir, "long")).get("fits") is False and e, 30, what="the forecast to say it misses"
    )
    assert entry["predicted_end"] > _status(queue_dir)["window"]["final_checkpoint_at"]
    assert "steps/h" in entry["forecast"] and "after the final checkpoint" in entry["forecast"]
    assert _status(queue_dir)["window"]["misses"] == ["long"]
    events = [
        json.loads(line)
        for line in (queue_dir / "running/long/metrics.jsonl").read_text().splitlines()
        if '"deadline"' in line
    ]
    assert len(events) == 1 and events[0]["type"] == "event" and "predicted to miss" in events[0]["message"]
    assert "job long: predicted to miss the final checkpoint" in caplog.text
    (queue_dir / "running/long/stop.flag").touch()
    tick_until(w, lambda: _run(queue_dir, "long").get("status") == "cancelled", 20)


def test_inside_the_freeze_only_a_job_that_fits_starts(queue_dir: Path, watcher) -> None:
    window = _window(seconds_to_final=30, freeze_early_s=60)  # frozen now, final mark in 30 s
    (queue_dir / "watcher.yaml").write_text(yaml.safe_dump({"window": window}))  # what `trainq why` reads
    w = watcher(window=window)
    _job(queue_dir, "big", command=["true"], expected_duration="1h")
    _job(queue_dir, "unknown", command=["true"])
    _job(queue_dir, "small", command=["true"], expected_duration="2s")
    tick_until(
        w,
        lambda: (
            _run(queue_dir, "small").get("status") == "done"
            and "freeze" in (_entry(queue_dir, "unknown").get("waiting_for") or "")
        ),
        20,
    )
    big, unknown = _entry(queue_dir, "big"), _entry(queue_dir, "unknown")
    assert big["status"] == "pending" and big["waiting_for"].startswith("window freeze since")
    assert "expected_duration 1 h" in big["waiting_for"] and "left before the final checkpoint" in big["waiting_for"]
    assert "no estimate of how long it runs (set expected_duration)" in unknown["waiting_for"]
    out = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "why", "big"], capture_output=True, text=True, cwd=REPO
    )
    assert "HOLD window" in out.stdout and "expected_duration 1 h" in out.stdout


def test_a_window_already_past_is_loud_in_status_and_why(queue_dir: Path, watcher, caplog) -> None:
    """The finding: ends_at an hour ago froze the queue with "nothing starts before the wall", an hour after it."""
    window = {"ends_at": iso_utc(time.time() - 3600)}
    (queue_dir / "watcher.yaml").write_text(yaml.safe_dump({"window": window}))  # what `trainq why` reads
    w = watcher(window=window)
    _job(queue_dir, "late", command=["true"], expected_duration="1s")
    tick_until(w, lambda: "window ended" in (_entry(queue_dir, "late").get("waiting_for") or ""), 20)
    w.write_status(time.time() + 10, force=True)
    status = _status(queue_dir)
    [problem] = [p for p in status["watcher"]["problems"] if "window" in p]
    assert re.fullmatch(rf"the window ended at {window['ends_at']} \(1 h( \d+ min)? ago\): nothing starts .*", problem)
    assert "window.ends_at in watcher.yaml" in problem
    assert _entry(queue_dir, "late")["status"] == "pending"
    assert "nothing starts before the wall" not in _entry(queue_dir, "late")["waiting_for"]
    out = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "why", "late"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert re.search(rf"HOLD window +the window ended at {window['ends_at']} \(1 h( \d+ min)? ago\)", out.stdout), (
        out.stdout
    )
    said = [r.getMessage() for r in caplog.records if "window ended" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("queue: the window ended at")  # once in watcher.log, not a tick


def test_a_restarted_watcher_keeps_the_ladder_and_stops_a_job_at_the_final_mark(
    queue_dir: Path, watcher_process
) -> None:
    (queue_dir / "watcher.yaml").write_text(
        yaml.safe_dump(
            {
                "settle_s": 0.1,
                "rescan_s": 0.2,
                "status_s": 0.1,
                "window": _window(seconds_to_final=8, freeze_early_s=30),
                "cost": {"per_hour": 3.6, "currency": "USD"},
            }
        )
    )
    first = watcher_process()
    _job(queue_dir, "steps", command=[PY, SLOW, "100000", "0.05", "20"], resume_args=[], expected_duration="1s")
    _job(queue_dir, "wide", command=["true"], expected_duration="6h")
    wait_until(
        lambda: (
            _entry(queue_dir, "steps").get("state") == "running"
            and "window freeze" in (_entry(queue_dir, "wide").get("waiting_for") or "")
        ),
        20,
    )
    first.kill(signal.SIGKILL)
    watcher_process()  # the same watcher.yaml: the ladder goes on from the clock, not from memory
    run = wait_until(
        # run.json says "cancelled" just before the folder moves: wait for failed/ too
        lambda: (
            (r := _run(queue_dir, "steps")).get("status") == "cancelled" and (queue_dir / "failed/steps").is_dir() and r
        ),
        40,
        what="the job stopped at the final-checkpoint mark",
    )
    assert run["reason"] == "window" and run["attempts"][-1]["cost"]["currency"] == "USD"
    assert run["cost"]["amount"] > 0
    checkpoints = sorted((queue_dir / "failed/steps/checkpoints").iterdir())
    assert checkpoints, "the stop left no checkpoint"
    assert "stop.flag seen: checkpoint" in (queue_dir / "failed/steps/output.log").read_text()
    wide = wait_until(
        lambda: (e := _entry(queue_dir, "wide")) and "past the final" in (e.get("waiting_for") or "") and e, 10
    )
    assert wide["status"] == "pending" and "past the final-checkpoint mark" in wide["waiting_for"]
    # the ledger holds the concluded attempt (status.json is rewritten within status_s of the conclusion)
    wait_until(lambda: _status(queue_dir)["cost"]["total"] >= round(run["cost"]["amount"], 4) - 1e-4, 10)


def test_a_command_job_stopped_at_its_own_deadline_resumes_from_its_checkpoint(
    queue_dir: Path, watcher, watcher_config
) -> None:
    w = watcher()
    _job(queue_dir, "dl", command=[PY, SLOW, "100000", "0.05", "10"], resume_args=[], deadline="3s")
    run = tick_until(w, lambda: (r := _run(queue_dir, "dl")).get("status") == "cancelled" and r, 30)
    assert run["reason"] == "deadline"
    spec = yaml.safe_load((queue_dir / "failed/dl/job.yaml").read_text())
    spec["deadline"] = "1h"  # still counted from the first start; a failed job's job.yaml is read at its retry
    (queue_dir / "failed/dl/job.yaml").write_text(yaml.safe_dump(spec))
    (queue_dir / "failed/dl/retry.flag").touch()
    run = tick_until(
        w,
        lambda: (r := _run(queue_dir, "dl")).get("status") in ("running", "cancelled") and r["attempt"] == 2 and r,
        30,
    )
    assert run["attempts"][-1]["resumed_from"] and "reason" not in run
    tick_until(w, lambda: "resumed from" in (queue_dir / "running/dl/output.log").read_text(), 20)
    (queue_dir / "running/dl/stop.flag").touch()
    tick_until(w, lambda: _run(queue_dir, "dl").get("status") == "cancelled", 20)


# -- delivery ------------------------------------------------------------------------------------------------------


def _results_script(tmp: Path) -> str:
    """A job that leaves a summary.json with its SHA256SUMS and one checkpoint record, then exits 0."""
    script = tmp / "results.py"
    script.write_text(
        "import hashlib, json, os, time\n"
        "d = os.environ['TRAINQ_JOB_DIR']\n"
        "open(os.path.join(d, 'summary.json'), 'w').write(json.dumps({'outcome': 'done', 'steps': 3}))\n"
        "digest = hashlib.sha256(open(os.path.join(d, 'summary.json'), 'rb').read()).hexdigest()\n"
        "open(os.path.join(d, 'SHA256SUMS'), 'w').write(digest + '  summary.json\\n')\n"
        "ck = os.path.join(d, 'checkpoints', 'step-3'); os.makedirs(ck)\n"
        "open(os.path.join(ck, 'weights.bin'), 'wb').write(os.urandom(4096))\n"
        "open(os.environ['TRAINQ_METRICS'], 'a').write(json.dumps({'type': 'checkpoint', 'step': 3, 'path': ck}) + '\\n')\n"
        "print('results written')\n"
    )
    return str(script)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@needs_rsync
def test_delivery_is_verified_and_a_corrupted_copy_is_detected_and_sent_again(
    queue_dir: Path, watcher, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("TRAINQ_DELIVERY_FAULTS", "corrupt_once,backoff=0.2")
    w = watcher()
    target = tmp_path / "results"
    _job(
        queue_dir,
        "ship",
        command=[PY, _results_script(tmp_path)],
        deliver={"to": str(target), "what": ["summary", "ckpt_latest", "logs"]},
    )
    run = tick_until(w, lambda: (r := _run(queue_dir, "ship")).get("delivered") and r, 30, what="run.json delivered")
    delivered = run["delivered"]
    assert delivered["verified"] is True and delivered["tries"] == 2, delivered  # the first copy was corrupted
    assert delivered["to"] == f"{target}/ship"
    assert {"summary.json", "SHA256SUMS", "output.log", "metrics.jsonl", "ckpt_latest/weights.bin"} <= set(
        delivered["files"]
    )
    copy, job = target / "ship", queue_dir / "done" / "ship"
    assert subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=copy, capture_output=True).returncode == 0
    assert _sha(copy / "ckpt_latest" / "weights.bin") == _sha(job / "checkpoints" / "step-3" / "weights.bin")
    assert not (queue_dir / ".trainq-deliveries" / "ship").exists()


@needs_rsync
def test_delivery_over_rsync_to_a_daemon_path(queue_dir: Path, watcher, tmp_path: Path) -> None:
    """``deliver.to: rsync://127.0.0.1:PORT/module``: the receiving side is checked by rsync's checksum dry run."""
    store = tmp_path / "store"
    store.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = tmp_path / "rsyncd.conf"
    conf.write_text(
        f"use chroot = no\n[results]\npath = {store}\nread only = no\nuid = {os.getuid()}\ngid = {os.getgid()}\n"
    )
    daemon = subprocess.Popen(
        ["rsync", "--daemon", "--no-detach", f"--port={port}", "--address=127.0.0.1", f"--config={conf}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(
            lambda: subprocess.run(["rsync", f"rsync://127.0.0.1:{port}/"], capture_output=True).returncode == 0, 10
        )
        w = watcher()
        _job(
            queue_dir,
            "remote",
            command=[PY, _results_script(tmp_path)],
            deliver={"to": f"rsync://127.0.0.1:{port}/results", "what": ["summary"]},
        )
        run = tick_until(w, lambda: (r := _run(queue_dir, "remote")).get("delivered") and r, 30)
        assert run["delivered"]["verified"] is True, run["delivered"]
        assert (
            subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=store / "remote", capture_output=True).returncode == 0
        )
    finally:
        daemon.terminate()
        daemon.wait(10)


# -- the built-in trainer at the final mark ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run([PY, "-m", "trainq.trainer.tiny", str(out)], check=True, capture_output=True, timeout=300)
    return out


def test_a_train_job_is_stopped_at_the_final_mark_with_a_checkpoint_and_resumes(
    queue_dir: Path, watcher_config, tiny: Path, tmp_path: Path
) -> None:
    from trainq.watcher.daemon.daemon import Watcher

    train = {
        "model": str(tiny / "model"),
        "data": {"train": str(tiny / "train.jsonl"), "eval": str(tiny / "eval.jsonl")},
        "method": "lora",
        "max_steps": 12,
        "batch_size": 2,
        "seq_len": 32,
        "eval_every": 1000,
        "checkpoint": {"every_steps": 1000, "keep": 2},
    }
    _job(
        queue_dir,
        "tr",
        train=train,
        env={"TRAINQ_TRAINER_FAULTS": "sleep_per_step=0.25", "OMP_NUM_THREADS": "1"},
        deliver={"to": str(tmp_path / "out"), "what": ["ckpt_latest", "summary"]},
    )
    cost = {"per_gpu_hour": 2.0, "currency": "USD"}
    first = Watcher(queue_dir, watcher_config(cost=cost), env=dict(os.environ))
    first.start(install_signals=False)
    try:  # wait until it trains, then a watcher whose window's final mark is now takes over
        tick_until(first, lambda: ((_entry(queue_dir, "tr").get("progress") or {}).get("step") or 0) >= 3, 180)
    finally:
        first.close()
    second = Watcher(queue_dir, watcher_config(cost=cost, window=_window(seconds_to_final=0.5)), env=dict(os.environ))
    second.start(install_signals=False)
    try:
        run = tick_until(second, lambda: (r := _run(queue_dir, "tr")).get("delivered") and r, 120)
    finally:
        second.close()
    assert run["status"] == "cancelled" and run["reason"] == "window"
    job = queue_dir / "failed" / "tr"
    summary = json.loads((job / "summary.json").read_text())
    assert summary["outcome"] == "stopped" and summary["latest_checkpoint"]
    assert summary["cost"]["currency"] == "USD" and summary["cost"]["amount"] > 0
    assert run["delivered"]["verified"] is True and any(f.startswith("ckpt_latest/") for f in run["delivered"]["files"])
    third = Watcher(queue_dir, watcher_config(), env=dict(os.environ))  # the box is back: no window
    third.start(install_signals=False)
    try:
        (job / "retry.flag").touch()
        run = tick_until(third, lambda: (r := _run(queue_dir, "tr")).get("status") == "done" and r, 180)
    finally:
        third.close()
    assert (
        run["attempts"][-1]["resumed_from"]
        and json.loads((queue_dir / "done/tr/summary.json").read_text())["resumed_from"]
    )
