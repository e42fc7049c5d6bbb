"""Fix and re-run (issue 24 item 1): `trainq edit` on a failed job runs it again under the same id, resuming;
`retry` of a dependent whose dependency failed names that one; advice names only what applies."""

from __future__ import annotations

import json
import os

from conftest import PY, trainq, wait_until
from test_workflows import _job, _run, _where

#: a resumable script: saves step-N folders; crashes at step 3 unless --steps says fewer; prints where it resumed
SCRIPT = """
import os, sys
args = sys.argv[1:]
start = int(os.path.basename(args[args.index('--resume') + 1]).split('-')[1]) if '--resume' in args else 0
print('resumed at', start, flush=True)
crash_at = int(args[args.index('--crash-at') + 1])
for step in range(start + 1, 6):
    if step == crash_at:
        raise SystemExit('boom at step %d' % step)
    os.makedirs('step-%d' % step)
    open('step-%d/state' % step, 'w').write(str(step))
print('finished', flush=True)
"""


def test_edit_a_failed_job_runs_it_again_under_the_same_id_from_its_checkpoint(queue_dir, watcher_process, tmp_path):
    script = tmp_path / "steps.py"
    script.write_text(SCRIPT)
    watcher_process()
    _job(
        queue_dir,
        "steps",
        command=[PY, str(script), "--crash-at", "3"],
        resume_args=["--resume", "{resume_from}"],
        resources={"gpus": 0},
    )
    wait_until(lambda: (_run(queue_dir, "steps", "failed") or {}).get("status") == "failed", 30)
    why = trainq(queue_dir, "why", "steps").stdout
    assert "to run it again (resuming from step-2): trainq retry steps; to change it first: trainq edit steps" in why

    editor = tmp_path / "fix.sh"
    editor.write_text('#!/bin/sh\nsed -i \'s/"3"/"99"/; s/, 3]/, 99]/\' "$1"\n')
    editor.chmod(0o755)
    out = trainq(queue_dir, "edit", "steps", env={"EDITOR": str(editor)})
    assert out.returncode == 0, out.stderr
    assert "it runs again as attempt 2 under the same id, resuming from step-2 (retry.flag)" in out.stdout, out.stdout
    wait_until(lambda: _where(queue_dir, "steps") == "done", 30, what="the edited job ends done")
    run = _run(queue_dir, "steps", "done")
    assert run["attempt"] == 2 and run["attempts"][-1]["resumed_from"].endswith("step-2")
    log = (queue_dir / "done" / "steps" / "output.log").read_text()
    assert "resumed at 2" in log and "finished" in log
    assert (queue_dir / "done" / "steps" / "job.attempt-1.yaml").read_text() != (
        queue_dir / "done" / "steps" / "job.yaml"
    ).read_text()
    assert not list((queue_dir / "inbox").iterdir())  # no second job: the same id ran again


def test_a_rejected_job_is_fixed_with_edit_and_runs_under_its_id(queue_dir, watcher_process, tmp_path):
    watcher_process()
    _job(queue_dir, "typo", command=["true"], priority="high", resources={"gpus": 0})
    wait_until(lambda: (_run(queue_dir, "typo", "failed") or {}).get("status") == "rejected", 30)
    assert "trainq edit typo" in trainq(queue_dir, "retry", "typo").stderr
    editor = tmp_path / "fix.sh"
    editor.write_text('#!/bin/sh\nsed -i \'s/"high"/1/\' "$1"\n')
    editor.chmod(0o755)
    out = trainq(queue_dir, "edit", "typo", env={"EDITOR": str(editor)})
    assert out.returncode == 0 and "runs it under the same id" in out.stdout, out.stdout + out.stderr
    wait_until(lambda: _where(queue_dir, "typo") == "done", 30)


def test_retry_of_a_dependent_names_the_failed_dependency_and_does_nothing(queue_dir, watcher_process):
    watcher_process()
    _job(queue_dir, "prep", command=[PY, "-c", "raise SystemExit(2)"], resources={"gpus": 0})
    _job(queue_dir, "train", after=["prep"], command=["true"], resources={"gpus": 0})
    wait_until(lambda: (_run(queue_dir, "train", "failed") or {}).get("status") == "failed", 30)
    out = trainq(queue_dir, "retry", "train")
    assert out.returncode == 2 and out.stderr.strip() == (
        "trainq: job train runs after prep, which ended failed: retry that first (`trainq retry prep`), "
        "then this one; nothing done"
    )
    assert not (queue_dir / "failed" / "train" / "retry.flag").exists()
    assert "first `trainq retry prep`" in trainq(queue_dir, "why", "train").stdout
    assert "first `trainq retry prep`" in trainq(queue_dir, "show", "train").stdout


def test_advice_names_only_what_applies(queue_dir, watcher_process):
    watcher_process()
    _job(queue_dir, "plain", command=[PY, "-c", "raise SystemExit(1)"], resources={"gpus": 0})
    _job(queue_dir, "nomod", command=["python", "-c", "import no_such_module_xyz"], resources={"gpus": 0})
    wait_until(lambda: all(_where(queue_dir, j) == "failed" for j in ("plain", "nomod")), 30)
    plain = _run(queue_dir, "plain", "failed")["diagnosis"]
    assert "checkpoint" not in plain["advice"] and "from the start" in plain["advice"], plain
    why = trainq(queue_dir, "why", "plain").stdout
    assert "resuming" not in why and "to run it again (from the start (the job declares no resume_args))" in why

    nomod = _run(queue_dir, "nomod", "failed")
    program = nomod["attempts"][-1]["program"]
    assert program == os.path.join(os.path.dirname(os.path.abspath(PY)), "python")  # the watcher's python came first
    assert nomod["diagnosis"]["evidence"] == "ModuleNotFoundError: No module named 'no_such_module_xyz'"
    assert f"the interpreter that ran, {program}, does not have it" in nomod["diagnosis"]["advice"]
    json.dumps(nomod)


def test_rerun_line_fits_the_job(tmp_path):
    from trainq.watcher.cli.again import rerun_line
    from trainq.watcher.spec.jobspec import parse_job_text

    spec = parse_job_text("approved: true\ncommand: [x]\nresources: {gpus: 0, ram_gb: 9999}\n", "j")
    unsat = {"status": "failed", "attempts": [], "diagnosis": {"kind": "unsatisfiable"}}
    assert "lower its resources" in rerun_line(tmp_path, "j", tmp_path, unsat, spec)
    never = {"status": "cancelled", "attempts": []}
    assert rerun_line(tmp_path, "j", tmp_path, never, spec) == (
        "  to run it (it never started): trainq retry j; to change it first: trainq edit j"
    )
    assert rerun_line(tmp_path, "j", tmp_path, {"status": "done"}, spec) is None
