"""Checkpoint discovery for jobs with no trainq code: records, ckpt_latest, checkpoint-N, step-N, *.ckpt."""

from __future__ import annotations

import json
import os
import time
import zipfile
from pathlib import Path

from trainq.watcher.daemon.checkpoints import MAX_DEPTH, find_checkpoint, latest_checkpoint, note_skipped, rebase
from trainq.watcher.spec.contract import JobPaths


def _hf(folder: Path, step: int, complete: bool = True) -> Path:
    """A Hugging Face Trainer checkpoint folder (trainer_state.json is what it writes last)."""
    ckpt = folder / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"x" * 10)
    if complete:
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return ckpt


def _torch_file(path: Path, cut: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"x" * 2000)
    if cut:
        path.write_bytes(path.read_bytes()[:-30])
    return path


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (then, then))


def test_highest_complete_hf_checkpoint_in_any_output_dir(tmp_path: Path) -> None:
    job = JobPaths(tmp_path / "running" / "a")
    _hf(job.dir / "checkpoints", 10)
    _hf(job.dir / "out" / "run-1", 30)
    half = _hf(job.dir / "out" / "run-1", 40, complete=False)  # killed while saving
    found = find_checkpoint(job)
    assert found.path == str(job.dir / "out" / "run-1" / "checkpoint-30") and found.kind == "checkpoint-N"
    assert found.skipped == (
        f"{half}: incomplete (no trainer_state.json; the Trainer writes it last, so the save was interrupted)",
    )
    note_skipped(job.log, found)
    assert f"trainq: skipped checkpoint {half}: incomplete" in job.log.read_text()


def test_records_come_first_and_follow_the_folder_when_it_moves(tmp_path: Path) -> None:
    """A record written in running/a names …/running/a/out/…; after stop it lives in failed/a/out/…."""
    job = JobPaths(tmp_path / "queue" / "failed" / "a")
    _hf(job.dir / "out", 20)
    _hf(job.dir / "out", 10)
    old = tmp_path / "queue" / "running" / "a" / "out" / "checkpoint-10"
    job.metrics.write_text(json.dumps({"type": "checkpoint", "step": 10, "path": str(old)}) + "\n")
    found = find_checkpoint(job)
    assert found.path == str(job.dir / "out" / "checkpoint-10") and found.kind == "record"
    assert rebase(Path("out/x"), job) == job.dir / "out" / "x"
    assert rebase(Path("/scratch/run/x"), job) == Path("/scratch/run/x")


def test_ckpt_latest_before_numbered_folders(tmp_path: Path) -> None:
    job = JobPaths(tmp_path / "a")
    (job.checkpoints / "step-000005").mkdir(parents=True)
    (job.checkpoints / "step-000005" / "weights.pt").write_bytes(b"w")
    _hf(job.dir / "out", 50)
    assert find_checkpoint(job).kind == "checkpoint-N"
    os.symlink("step-000005", job.ckpt_latest)
    assert latest_checkpoint(job) == str(job.checkpoints / "step-000005")


def test_step_n_then_lightning_last_ckpt_first(tmp_path: Path) -> None:
    job = JobPaths(tmp_path / "a")
    _torch_file(job.dir / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=90.ckpt")
    last = _torch_file(job.dir / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt")
    assert find_checkpoint(job).path == str(last)
    cut = _torch_file(job.dir / "ckpts" / "step-30.pt", cut=True)
    (job.dir / "ckpts" / "step-20").mkdir()
    (job.dir / "ckpts" / "step-20" / "model.bin").write_bytes(b"m")
    found = find_checkpoint(job)
    assert found.path == str(job.dir / "ckpts" / "step-20") and found.kind == "step-N"
    assert any(str(cut) in line and "cut short" in line for line in found.skipped)


def test_a_young_checkpoint_of_a_running_job_is_not_chosen(tmp_path: Path) -> None:
    job = JobPaths(tmp_path / "a")
    older = _hf(job.dir / "checkpoints", 10)
    _age(older, 60)
    _hf(job.dir / "checkpoints", 20)  # just written: its files may still be flushing
    assert find_checkpoint(job, running=True).path == str(older)
    assert find_checkpoint(job, running=False).path == str(job.dir / "checkpoints" / "checkpoint-20")


def test_nothing_found_and_the_walk_is_bounded(tmp_path: Path) -> None:
    job = JobPaths(tmp_path / "a")
    job.dir.mkdir()
    assert find_checkpoint(job).path is None
    deep = job.dir.joinpath(*[f"d{i}" for i in range(MAX_DEPTH + 1)])
    _hf(deep, 5)
    assert find_checkpoint(job).path is None
    _hf(deep.parent.parent, 3)
    assert find_checkpoint(job).path == str(deep.parent.parent / "checkpoint-3")


HALF_SAVED = r"""
import os, sys
job, attempt = os.environ["TRAINQ_JOB_DIR"], int(os.environ["TRAINQ_ATTEMPT"])
print("attempt", attempt, "argv", sys.argv[1:], "resume", os.environ.get("TRAINQ_RESUME_FROM"), flush=True)
if attempt == 1:
    for step, done in ((5, True), (10, False)):  # killed while saving checkpoint-10
        folder = os.path.join(job, "out", f"checkpoint-{step}")
        os.makedirs(folder)
        open(os.path.join(folder, "model.safetensors"), "w").write("w")
        if done:
            open(os.path.join(folder, "trainer_state.json"), "w").write('{"global_step": %d}' % step)
    print("  5%|#  | 10/200 [00:01<00:19]\r", end="", flush=True)
    sys.exit(1)
"""


def test_a_retry_skips_a_half_saved_checkpoint_and_says_so(queue_dir, watcher, write_job):
    """Under a real watcher: the retry resumes from checkpoint-5, and output.log names the skipped checkpoint-10."""
    from conftest import PY, tick_until

    w = watcher()
    write_job(
        "half",
        command=[PY, "-c", HALF_SAVED],
        resume_args=["--resume_from_checkpoint", "{resume_from}"],
        retries={"max": 1, "on": ["unknown"], "backoff": "1s"},
    )
    tick_until(w, lambda: (queue_dir / "done" / "half").exists(), 30)
    run = json.loads((queue_dir / "done" / "half" / "run.json").read_text())
    good = str(queue_dir / "running" / "half" / "out" / "checkpoint-5")
    assert run["attempts"][1]["resumed_from"] == good
    log = (queue_dir / "done" / "half" / "output.log").read_bytes().decode()  # bytes: \r stays \r
    assert f"attempt 2 argv ['--resume_from_checkpoint', '{good}'] resume {good}" in log
    half = queue_dir / "running" / "half" / "out" / "checkpoint-10"
    assert f"\ntrainq: skipped checkpoint {half}: incomplete (no trainer_state.json" in log
    assert "[00:01<00:19]\r\ntrainq: skipped" in log  # after the bar's \r, on a line of its own


def test_a_big_data_tree_does_not_hide_a_shallow_output_dir(tmp_path, monkeypatch):
    """The walk is breadth first: out/checkpoint-N is found before data/ spends the entry budget."""
    import trainq.watcher.daemon.checkpoints as checkpoints

    monkeypatch.setattr(checkpoints, "MAX_ENTRIES", 100)
    job = JobPaths(tmp_path / "a")
    for shard in range(30):
        (job.dir / "data" / f"shard{shard}").mkdir(parents=True)
        for f in range(10):
            (job.dir / "data" / f"shard{shard}" / f"part{f}").touch()
    _hf(job.dir / "out", 7)
    assert find_checkpoint(job).path == str(job.dir / "out" / "checkpoint-7")
