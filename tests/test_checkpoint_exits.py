"""Checkpoint exits are bounded (issue 36 item 4; docs/contract.md).

A ``checkpoint_exit_code`` exit that made no new checkpoint since the previous one is a failed attempt
(diagnosis ``no_checkpoint``; retries and backoff apply), and run.json keeps the last 100 attempts in
full with counts for the rest, so ``trainq show`` and ``trainq why`` work on a job with 10,000 attempts.
Real jobs under an in-process watcher; the 10,000-attempt folder is written the way the watcher writes one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import drop, tick_until

from trainq.watcher.daemon.jobs import MAX_ATTEMPTS_KEPT, fold_attempts, new_run
from trainq.watcher.spec import events
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.units import iso_utc

TRAINQ = [sys.executable, "-m", "trainq.watcher"]


def trainq(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAINQ, "--root", str(root), *args], capture_output=True, text=True, timeout=120)


def job_text(script: str, extra: str = "") -> str:
    return (
        "approved: true\n"
        f"command: [sh, -c, {json.dumps(script)}]\n"
        "checkpoint_exit_code: 85\n"
        "snapshot: false\n"
        "resources: {gpus: 0}\n" + extra
    )


def test_a_job_that_always_exits_85_without_a_checkpoint_fails_after_its_retries(queue_dir, watcher):
    """The finding: exit 85 and nothing else restarted ~466 times a minute, without end."""
    w = watcher()
    drop(queue_dir, "loop.yaml", job_text("echo saving nothing; exit 85", "retries: {max: 2, backoff: 1s}\n"))
    tick_until(w, lambda: (queue_dir / "failed" / "loop" / "run.json").exists(), 60, "the loop to end failed")
    run = json.loads((queue_dir / "failed" / "loop" / "run.json").read_text())
    assert run["status"] == "failed" and run["attempt"] == 3, run  # the first attempt and its 2 retries
    assert run["diagnosis"]["kind"] == "no_checkpoint"
    assert "exit code 85" in run["diagnosis"]["evidence"] and "no checkpoint" in run["diagnosis"]["evidence"]
    assert not run.get("checkpoint_restarts") and run["retries_used"] == 2
    assert [a["diagnosis"]["kind"] for a in run["attempts"]] == ["no_checkpoint"] * 3
    retrying = [r for r in events.read(JobPaths(queue_dir / "failed" / "loop")) if r["event"] == "retrying"]
    assert [(r["after"], r["backoff_s"]) for r in retrying] == [("no_checkpoint", 1.0)] * 2  # backoff applied
    why = trainq(queue_dir, "why", "loop")
    assert why.returncode == 0 and "no_checkpoint" in why.stdout, why.stdout + why.stderr


SAVES_ONCE = """
n=$TRAINQ_ATTEMPT
if [ "$n" = 1 ]; then mkdir -p "$TRAINQ_JOB_DIR/checkpoints/step-1" && echo 1 > "$TRAINQ_JOB_DIR/checkpoints/step-1/state"; fi
echo "attempt $n resumes from ${TRAINQ_RESUME_FROM:-nothing}"
exit 85
"""


def test_a_checkpoint_exit_after_one_that_saved_is_a_failure_when_it_saved_nothing_new(queue_dir, watcher):
    w = watcher()
    drop(queue_dir, "once.yaml", job_text(SAVES_ONCE))  # retries.max 0: the stale exit ends the job
    tick_until(w, lambda: (queue_dir / "failed" / "once" / "run.json").exists(), 60, "the job to fail")
    run = json.loads((queue_dir / "failed" / "once" / "run.json").read_text())
    assert run["attempt"] == 2 and run["checkpoint_restarts"] == 1, run
    assert [a.get("checkpoint_exit") for a in run["attempts"]] == [True, None]
    assert run["attempts"][1]["resumed_from"].endswith("checkpoints/step-1")
    assert run["diagnosis"]["kind"] == "no_checkpoint"
    assert "still checkpoints/step-1" in run["diagnosis"]["evidence"], run["diagnosis"]
    assert run["checkpoint_mark"]["path"] == "checkpoints/step-1"


SAVES_IN_PLACE = """
mkdir -p "$TRAINQ_JOB_DIR/checkpoints/ckpt_latest"
echo "$TRAINQ_ATTEMPT" > "$TRAINQ_JOB_DIR/checkpoints/ckpt_latest/state"
[ "$TRAINQ_ATTEMPT" -ge 3 ] && exit 0
exit 85
"""


def test_a_checkpoint_saved_again_in_place_counts_as_new(queue_dir, watcher):
    """ckpt_latest as a folder rewritten each time: same path, newer contents, so no failure is counted."""
    w = watcher()
    drop(queue_dir, "inplace.yaml", job_text(SAVES_IN_PLACE))
    tick_until(w, lambda: (queue_dir / "done" / "inplace").exists(), 60, "the job to end done")
    run = json.loads((queue_dir / "done" / "inplace" / "run.json").read_text())
    assert run["attempt"] == 3 and run["checkpoint_restarts"] == 2 and run["diagnosis"] is None
    assert [a["exit_code"] for a in run["attempts"]] == [85, 85, 0]


#: a real job past MAX_ATTEMPTS_KEPT attempts, each a checkpoint exit that saved a new step-N
MANY_SLICES = 105
SLICES = f"""
n=$TRAINQ_ATTEMPT
[ "$n" -ge {MANY_SLICES} ] && exit 0
mkdir -p "$TRAINQ_JOB_DIR/checkpoints/step-$n" && echo "$n" > "$TRAINQ_JOB_DIR/checkpoints/step-$n/state"
exit 85
"""


def test_run_json_keeps_the_last_100_attempts_in_full_and_counts_the_rest(queue_dir, watcher):
    w = watcher()
    drop(queue_dir, "slices.yaml", job_text(SLICES))
    tick_until(w, lambda: (queue_dir / "done" / "slices").exists(), 240, f"{MANY_SLICES} slices to end done")
    run = json.loads((queue_dir / "done" / "slices" / "run.json").read_text())
    assert run["attempt"] == MANY_SLICES and run["checkpoint_restarts"] == MANY_SLICES - 1
    assert len(run["attempts"]) == MAX_ATTEMPTS_KEPT
    assert [a["n"] for a in run["attempts"]] == list(range(MANY_SLICES - MAX_ATTEMPTS_KEPT + 1, MANY_SLICES + 1))
    folded = run["attempts_earlier"]
    assert folded["count"] == MANY_SLICES - MAX_ATTEMPTS_KEPT == folded["checkpoint_exits"]
    assert (folded["first_n"], folded["last_n"]) == (1, MANY_SLICES - MAX_ATTEMPTS_KEPT)
    assert folded["exit_codes"] == {"85": MANY_SLICES - MAX_ATTEMPTS_KEPT} and folded["runtime_s"] > 0
    history = [json.loads(line) for line in (queue_dir / "history.jsonl").read_text().splitlines()]
    assert [r["attempts"] for r in history if r["id"] == "slices"] == [MANY_SLICES]


def _attempt(n: int, start: float) -> dict:
    return {
        "n": n,
        "pid": 4000 + n % 1000,
        "job_pid": 5000 + n % 1000,
        "started_at": iso_utc(start),
        "resumed_from": f"checkpoints/step-{n - 1}" if n > 1 else None,
        "gpus": [],
        "program": "/bin/sh",
        "ended_at": iso_utc(start + 0.1),
        "exit_code": 85 if n < 10_000 else 1,
        "signal": None,
        "signal_name": None,
        "stop_reason": None,
        "diagnosis": None,
    }


def _ten_thousand_attempts(root: Path, job_id: str, fold: bool) -> Path:
    """A job folder in failed/ after 10,000 attempts, as the watcher leaves one (``fold``: this watcher; else
    one from before the bound, with every attempt in full)."""
    job = root / "failed" / job_id
    job.mkdir(parents=True)
    (job / "job.yaml").write_text(job_text("exit 85"))
    (job / "output.log").write_text("".join(f"trainq: attempt {n}\nsaving\n" for n in range(9990, 10_001)))
    start = 1_780_000_000.0
    run = new_run(None, 1, start, name=job_id)
    run.update(id=job_id, executor="local")
    for n in range(1, 10_001):
        attempt = _attempt(n, start + n)
        if n < 10_000:
            attempt["checkpoint_exit"] = True
        run["attempts"].append(attempt)
        run["attempt"] = n
        if fold:
            fold_attempts(run)
    run.update(
        status="failed",
        finished_at=iso_utc(start + 10_001),
        checkpoint_restarts=9_999,
        diagnosis={"kind": "unknown", "advice": "Read the end of output.log.", "evidence": "exit code 1"},
    )
    (job / "run.json").write_text(json.dumps(run))
    return job


def test_show_and_why_work_on_a_job_with_ten_thousand_attempts(queue_dir):
    folded = _ten_thousand_attempts(queue_dir, "tenk", fold=True)
    assert (folded / "run.json").stat().st_size < 64_000  # unfolded: about 3 MB, and growing 300 B a restart
    _ten_thousand_attempts(queue_dir, "legacy", fold=False)
    for job_id in ("tenk", "legacy"):
        show = trainq(queue_dir, "show", job_id)
        assert show.returncode == 0, show.stderr
        lines = show.stdout.splitlines()
        assert len(lines) < 60, show.stdout  # one line per attempt would be 10,000
        assert "attempts (10000):" in show.stdout
        assert "… 9980 earlier attempts, 9980 of them checkpoint exits: exit 85 ×9980" in show.stdout, show.stdout
        assert "#10000 started" in show.stdout and "exit 1" in show.stdout
        why = trainq(queue_dir, "why", job_id)
        assert why.returncode == 0 and "exit code 1" in why.stdout, why.stdout + why.stderr
        assert len(why.stdout.splitlines()) < 30
