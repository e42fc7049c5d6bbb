"""Issue 29: every run can be told apart and redone. Snapshots, events.jsonl, rerun, diff and checkpoint
exits, with real git repositories, real jobs under an in-process watcher, and the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PY, drop, tick_until

from trainq.watcher.spec import events
from trainq.watcher.spec.contract import JobPaths

TRAINQ = [sys.executable, "-m", "trainq.watcher"]


def trainq(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAINQ, "--root", str(root), *args], capture_output=True, text=True, timeout=60)


def git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


def make_repo(path: Path) -> Path:
    path.mkdir()
    git(path, "init", "-q")
    (path / "train.py").write_text(
        "import os\nMESSAGE = 'v1'\nopen(os.environ['TRAINQ_JOB_DIR'] + '/ran.txt', 'w').write(MESSAGE + '\\n')\n"
    )
    git(path, "add", ".")
    git(path, "commit", "-qm", "v1")
    return path


def names(job_dir: Path) -> list[str]:
    return [r["event"] for r in events.read(JobPaths(job_dir))]


def test_a_dirty_tree_is_rerun_exactly_after_it_changed(queue_dir, watcher, tmp_path):
    repo = make_repo(tmp_path / "repo")
    train = repo / "train.py"
    train.write_text(train.read_text().replace("'v1'", "'v1-dirty'"))  # uncommitted change
    (repo / "helper.py").write_text("X = 1\n")  # untracked file
    w = watcher()
    drop(queue_dir, "exp.yaml", f"approved: true\ncommand: [{PY}, train.py]\ncwd: {repo}\nenv: {{HF_TOKEN: hunter2}}\n")
    tick_until(w, lambda: (queue_dir / "done" / "exp").exists())
    done = queue_dir / "done" / "exp"
    assert (done / "ran.txt").read_text() == "v1-dirty\n"
    code = json.loads((done / "snapshot" / "code.json").read_text())
    assert code["git"]["dirty"] is True and code["git"]["untracked"] == ["helper.py"] and code["root"] == str(repo)
    assert "'v1-dirty'" in (done / "snapshot" / "code.diff").read_text()
    config = json.loads((done / "snapshot" / "config.json").read_text())
    assert config["command"] == [PY, "train.py"] and config["env"]["HF_TOKEN"] == "<redacted>"
    for name in os.listdir(done / "snapshot"):
        assert b"hunter2" not in (done / "snapshot" / name).read_bytes(), name

    git(repo, "commit", "-qam", "v2")  # the tree moves on: a new commit, and a new uncommitted change
    train.write_text(train.read_text().replace("'v1-dirty'", "'v3'"))
    refused = trainq(queue_dir, "rerun", "exp")
    assert refused.returncode == 1
    assert "commit" in refused.stderr and "train.py" in refused.stderr and "--at-snapshot" in refused.stderr
    assert not list((queue_dir / "inbox").iterdir())

    ran = trainq(queue_dir, "rerun", "exp", "--at-snapshot")
    assert ran.returncode == 0, ran.stderr
    tick_until(w, lambda: (queue_dir / "done" / "exp-rerun").exists())
    again = queue_dir / "done" / "exp-rerun"
    assert (again / "ran.txt").read_text() == "v1-dirty\n"  # the saved commit plus the saved diff ran
    run = json.loads((again / "run.json").read_text())
    assert run["lineage"] == {"rerun_of": "exp", "parents": ["exp"]}
    code2 = json.loads((again / "snapshot" / "code.json").read_text())
    assert code2["git"]["commit"] == code["git"]["commit"]
    assert code2["git"]["diff_sha256"] == code["git"]["diff_sha256"]
    assert code2["git"]["untracked"] == ["helper.py"]
    assert "'v3'" in train.read_text()  # the user's tree was left alone


def test_the_snapshot_is_the_tree_before_the_job_ran_though_its_records_are_written_as_it_starts(
    queue_dir, watcher, tmp_path
):
    """snapshot/'s records are written while the job starts (issue 38: the start does not wait for them); what they
    say is read before it: a job that edits its own code and leaves a file at once is recorded as it was."""
    repo = make_repo(tmp_path / "repo")
    (repo / "edit.py").write_text(
        "import pathlib\np = pathlib.Path('train.py')\np.write_text(p.read_text() + '# edited by the job\\n')\n"
        "pathlib.Path('left.txt').write_text('x')\n"
    )
    git(repo, "add", "edit.py")
    git(repo, "commit", "-qm", "edit")
    w = watcher()
    drop(queue_dir, "self.yaml", f"approved: true\ncommand: [{PY}, edit.py]\ncwd: {repo}\n")
    tick_until(w, lambda: (queue_dir / "done" / "self").exists())
    assert "edited by the job" in (repo / "train.py").read_text() and (repo / "left.txt").exists()
    snapshot = queue_dir / "done" / "self" / "snapshot"
    code = json.loads((snapshot / "code.json").read_text())
    assert code["git"]["dirty"] is False and code["git"]["untracked"] == []
    assert not (snapshot / "code.diff").exists()
    assert sorted(p.name for p in snapshot.glob("*.json")) == [
        "code.json",
        "config.json",
        "environment.json",
        "sources.json",
    ]
    started = [r for r in events.read(JobPaths(queue_dir / "done" / "self")) if r["event"] == "started"]
    assert started[-1]["code"]["dirty"] is False


def test_diff_of_two_sweep_members_shows_params_and_results(queue_dir, watcher):
    script = (
        "import json, os\nlr = float(os.environ['LR'])\n"
        "with open(os.environ['TRAINQ_METRICS'], 'a') as f:\n"
        "    for step in (1, 2):\n"
        "        f.write(json.dumps({'type': 'step', 'step': step, 'loss': lr * 10 / step}) + '\\n')\n"
    )
    (queue_dir.parent / "fit.py").write_text(script)
    w = watcher()
    drop(
        queue_dir,
        "lrs.yaml",
        f"approved: true\ncommand: [{PY}, {queue_dir.parent / 'fit.py'}]\n"
        "env: {LR: '{lr}'}\nsweep: {lr: ['0.1', '0.2']}\n",
    )
    tick_until(w, lambda: all((queue_dir / "done" / f"lrs-{i}").exists() for i in (1, 2)))
    out = trainq(queue_dir, "diff", "lrs-1", "lrs-2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.split() == ["lr", "0.1", "|", "0.2"] for line in lines), out.stdout
    assert any(line.split() == ["final_loss", "0.5", "|", "1"] for line in lines), out.stdout
    assert any(line.split() == ["steps", "2", "|", "2"] for line in lines), out.stdout
    assert "code: same" in lines and "data: same" in lines
    data = json.loads(trainq(queue_dir, "diff", "lrs-1", "lrs-2", "--json").stdout)
    assert data["differ"]["params"] == [["lr", "0.1", "0.2"]]


PREEMPTED_ONCE = """
import json, os, signal, sys, time
job = os.environ['TRAINQ_JOB_DIR']
resume = os.environ.get('TRAINQ_RESUME_FROM')
if resume:
    open(job + '/resumed.txt', 'w').write(resume)
    sys.exit(0)
os.makedirs(job + '/checkpoints/step-5')
with open(os.environ['TRAINQ_METRICS'], 'a') as f:
    f.write(json.dumps({'type': 'checkpoint', 'path': job + '/checkpoints/step-5', 'step': 5}) + '\\n')
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
os.kill(os.getppid(), signal.SIGTERM)  # the supervisor is told to stop, as a batch system's preemption does
time.sleep(60)
"""


def test_events_tell_the_story_of_a_preempted_retried_resumed_job(queue_dir, watcher):
    (queue_dir.parent / "job.py").write_text(PREEMPTED_ONCE)
    w = watcher()
    drop(
        queue_dir,
        "pre.yaml",
        f"approved: true\ncommand: [{PY}, {queue_dir.parent / 'job.py'}]\n"
        "resume_args: []\nretries: {max: 1, on: [preempted], backoff: 1s}\n",
    )
    tick_until(w, lambda: (queue_dir / "done" / "pre").exists(), 30)
    done = queue_dir / "done" / "pre"
    story = events.read(JobPaths(done))
    assert [r["event"] for r in story] == [
        "submitted",
        "accepted",
        "started",
        "checkpoint",
        "preempted",
        "exited",
        "retrying",
        "started",
        "exited",
        "finished",
    ]
    by = {(r["event"], r.get("attempt")): r for r in story}
    assert by[("checkpoint", 1)]["step"] == 5
    assert by[("exited", 1)]["stop_reason"] == "sigterm"
    assert by[("retrying", 2)]["after"] == "preempted" and by[("retrying", 2)]["resume_from"] == "checkpoints/step-5"
    assert by[("started", 2)]["resume_from"].endswith("checkpoints/step-5")
    assert by[("finished", None)]["status"] == "done" and by[("finished", None)]["attempts"] == 2
    assert all(r["time"].endswith("Z") for r in story)
    shown = trainq(queue_dir, "events", "pre")
    assert shown.returncode == 0 and [line.split()[1] for line in shown.stdout.splitlines()] == [
        r["event"] for r in story
    ]


CHECKPOINT_EXITS = """
import json, os, sys
job = os.environ['TRAINQ_JOB_DIR']
n = len([d for d in os.listdir(job + '/checkpoints')]) if os.path.isdir(job + '/checkpoints') else 0
with open(job + '/seen.txt', 'a') as f:
    f.write(str(os.environ.get('TRAINQ_RESUME_FROM')) + '\\n')
if n == 3:
    sys.exit(0)
os.makedirs(f'{job}/checkpoints/step-{n + 1}')
with open(os.environ['TRAINQ_METRICS'], 'a') as f:
    f.write(json.dumps({'type': 'checkpoint', 'path': f'{job}/checkpoints/step-{n + 1}', 'step': n + 1}) + '\\n')
sys.exit(85)
"""


def test_a_script_exiting_85_three_times_then_0_is_done_in_4_attempts_without_retries(queue_dir, watcher):
    (queue_dir.parent / "slices.py").write_text(CHECKPOINT_EXITS)
    w = watcher()
    drop(
        queue_dir,
        "sl.yaml",
        f"approved: true\ncommand: [{PY}, {queue_dir.parent / 'slices.py'}]\ncheckpoint_exit_code: 85\n",
    )  # retries.max stays 0: a failure would end it
    tick_until(w, lambda: (queue_dir / "done" / "sl").exists(), 30)
    done = queue_dir / "done" / "sl"
    run = json.loads((done / "run.json").read_text())
    assert run["status"] == "done" and run["attempt"] == 4 and len(run["attempts"]) == 4
    assert run["checkpoint_restarts"] == 3 and not run.get("retries_used")
    assert [a.get("checkpoint_exit") for a in run["attempts"]] == [True, True, True, None]
    assert [a["exit_code"] for a in run["attempts"]] == [85, 85, 85, 0]
    seen = (done / "seen.txt").read_text().split()
    assert seen[0] == "None" and [Path(s).name for s in seen[1:]] == ["step-1", "step-2", "step-3"]
    retrying = [r for r in events.read(JobPaths(done)) if r["event"] == "retrying"]
    assert [(r["after"], r["counted"]) for r in retrying] == [("checkpoint_exit", False)] * 3


def test_snapshot_false_writes_none_and_inherited_secrets_are_never_written(queue_dir, watcher, monkeypatch, tmp_path):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps([{"index": i, "name": f"Sim {i}", "memory_total_mb": 6144} for i in (0, 1)]))
    w = watcher(simulate_gpus=str(gpus))
    drop(queue_dir, "off.yaml", 'approved: true\ncommand: ["true"]\nsnapshot: false\nresources: {gpus: 0}\n')
    drop(queue_dir, "on.yaml", f"approved: true\ncommand: [{PY}, -c, 'print(1)']\nresources: {{gpus: 1}}\n")
    tick_until(w, lambda: all((queue_dir / "done" / j).exists() for j in ("off", "on")))
    assert not (queue_dir / "done" / "off" / "snapshot").exists()
    snap = queue_dir / "done" / "on" / "snapshot"
    environment = json.loads((snap / "environment.json").read_text())
    assert "SECRET_TOKEN" in environment["inherited_env"]  # its name, for telling runs apart
    assert [g["name"] for g in environment["gpus"]] == ["Sim 0"] and environment["cuda_visible_devices"] == "0"
    assert environment["python"]["version"] == sys.version.split()[0] and environment["packages"]
    for path in snap.iterdir():
        assert b"hunter2" not in path.read_bytes(), path.name


def test_events_are_appended_never_rewritten_and_rotate_at_their_bound(tmp_path, monkeypatch):
    paths = JobPaths(tmp_path)
    monkeypatch.setattr(events, "MAX_EVENTS_BYTES", 400)
    for i in range(12):
        assert events.emit(paths, "checkpoint", step=i, path=f"checkpoints/step-{i}")
    kept = [r["step"] for r in events.read(paths)]
    assert kept == list(range(kept[0], 12)) and kept[0] > 0  # oldest generation dropped, order kept
    assert paths.events.stat().st_size <= 400 and paths.events_rotated.stat().st_size <= 400
    with pytest.raises(ValueError):
        events.event("exploded")


def test_rerun_and_diff_name_an_unknown_job_and_exit_2(queue_dir):
    for args in (("rerun", "nope"), ("diff", "nope", "nada"), ("events", "nope")):
        out = trainq(queue_dir, *args)
        assert out.returncode == 2 and "no job with id 'nope'" in out.stderr


def test_the_trainer_exits_85_with_a_checkpoint_after_max_minutes_per_attempt(tmp_path):
    from tests.trainer_util import build_tiny, output, run_trainer, summary, write_job
    from trainq.watcher.spec.contract import EXIT_CHECKPOINT
    from trainq.watcher.spec.jobspec import load_job_file

    job = write_job(tmp_path / "job", build_tiny(tmp_path / "tiny"), max_minutes_per_attempt=1e-4, eval_every=None)
    assert load_job_file(job / "job.yaml").checkpoint_exit_code == EXIT_CHECKPOINT  # the watcher's side of it
    assert run_trainer(job) == EXIT_CHECKPOINT, output(job)
    first = summary(job)
    assert first["outcome"] == "sliced" and first["steps"] >= 1
    assert os.readlink(job / "checkpoints" / "ckpt_latest") == f"step-{first['steps']:06d}"
    assert first["steps"] < first["total_steps"]  # sliced before the end; the next attempt resumes from ckpt_latest


def _hostile_tar(path: Path, outside: Path) -> None:
    """A tar a hostile user left as snapshot/untracked.tar: a member climbing out of the checkout, one with
    an absolute path, and a link out (each refused by tarfile's ``data`` filter)."""
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        ok = tarfile.TarInfo("helper.py")
        ok.size = 6
        tar.addfile(ok, io.BytesIO(b"X = 1\n"))
        climb = tarfile.TarInfo(f"../../../../../../../..{outside}")
        climb.size = 5
        tar.addfile(climb, io.BytesIO(b"owned"))
        link = tarfile.TarInfo("etc")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc"
        tar.addfile(link)


def test_rerun_at_snapshot_refuses_a_hostile_untracked_tar_in_one_line_and_leaves_no_worktree(
    queue_dir, watcher, tmp_path
):
    repo = make_repo(tmp_path / "repo")
    (repo / "helper.py").write_text("X = 1\n")  # untracked: the snapshot keeps it in untracked.tar
    w = watcher()
    drop(queue_dir, "exp.yaml", f"approved: true\ncommand: [{PY}, train.py]\ncwd: {repo}\n")
    tick_until(w, lambda: (queue_dir / "done" / "exp").exists())
    snap = queue_dir / "done" / "exp" / "snapshot"
    assert (snap / "untracked.tar").exists()
    outside = tmp_path / "escaped.txt"
    for bad, needle in ((_hostile_tar, "unsafe member refused"), (None, "cannot be unpacked")):
        if bad is None:
            (snap / "untracked.tar").write_bytes(b"not a tar at all" * 64)
        else:
            bad(snap / "untracked.tar", outside)
        out = trainq(queue_dir, "rerun", "exp", "--at-snapshot")
        assert out.returncode == 1, out.stdout + out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert needle in out.stderr and "untracked.tar" in out.stderr, out.stderr
        assert not outside.exists()
        assert not list((queue_dir / "worktrees").iterdir())  # the scratch checkout is gone
        assert len(git(repo, "worktree", "list").splitlines()) == 1  # and so is git's record of it
        assert not list((queue_dir / "inbox").iterdir())
