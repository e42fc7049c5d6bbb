"""The built-in trainer on several ranks (docs/distributed.md): 2 CPU ranks with gloo under torchrun, the tiny model.

One uninterrupted 2-rank run (module fixture) is the reference every interrupted run must equal bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import drop, wait_until
from trainer_util import build_tiny, events, output, records, run_trainer, start_trainer, summary, write_job

torch = pytest.importorskip("torch", reason="the training stack (pip install -e '.[train]') is not installed")

#: what every 2-rank job here adds to trainer_util.BASE_TRAIN
RANKS = {"processes": 2}
#: a stopped rank must end the job within collective timeout + torchrun's shutdown timeout (+ its 0.1 s polls)
FAST_FAILURE_ENV = {"TRAINQ_COLLECTIVE_TIMEOUT_S": "4", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"}
#: a generous guard against a hang (never a timing assertion: the suite must pass on a loaded machine)
HANG_GUARD_S = 300


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory) -> Path:
    """An uninterrupted 2-rank LoRA run: 24 steps, evals and checkpoints every 8."""
    job = write_job(tmp_path_factory.mktemp("ddp") / "reference", tiny, **RANKS)
    assert run_trainer(job, timeout_s=HANG_GUARD_S) == 0, output(job)[-3000:]
    return job


def weights_sha256(job_dir: Path, folder: str = "adapter") -> str:
    files = sorted((job_dir / folder).glob("*.safetensors"))
    assert files, f"no weights in {job_dir / folder}"
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def rank_processes(job_dir: Path) -> dict[int, psutil.Process]:
    """The job's rank processes by global rank (torchrun's children running python -m trainq.trainer)."""
    found = {}
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if (
                env.get("TORCHELASTIC_RUN_ID")
                and "trainq.trainer" in " ".join(proc.cmdline())
                and str(job_dir) in " ".join(proc.cmdline())
            ):
                found[int(env["RANK"])] = proc
        except (psutil.Error, KeyError, ValueError):
            continue
    return found


def last_step(job_dir: Path) -> int:
    return max((r.get("step") or 0 for r in records(job_dir, "step")), default=0)


def test_two_ranks_train_to_done_with_world_size_and_rank_prefixes(reference):
    steps = records(reference, "step")
    assert [r["step"] for r in steps] == list(range(1, 25))  # rank 0 alone writes: one record per step
    assert {r["world_size"] for r in steps} == {2}
    done = summary(reference)
    assert done["outcome"] == "done" and done["world_size"] == 2 and done["strategy"] == "ddp"
    assert json.loads((reference / "env.json").read_text())["world_size"] == 2
    log = output(reference)
    assert "[rank 0] trainq: rank 0 of 2" in log and "[rank 1] trainq: rank 1 of 2" in log
    assert "[rank 0] step 24/24" in log and "[rank 1] step" not in log  # rank 0 speaks for the world
    latest = reference / "checkpoints" / "ckpt_latest"
    assert {"rng_state_0.pth", "rng_state_1.pth", "manifest.json"} <= {p.name for p in latest.iterdir()}
    assert json.loads((latest / "trainq_state.json").read_text())["world_size"] == 2
    assert not (reference / ".torchrun").exists()
    assert done["tokens_per_s"] > 0 and all(r["tokens_per_s"] > 0 for r in steps)


def test_stop_then_resume_on_two_ranks_is_bitwise_equal(reference, tiny, tmp_path):
    job = write_job(tmp_path / "stopped", tiny, **RANKS)
    assert run_trainer(job, TRAINQ_TRAINER_FAULTS="stop_at=10", timeout_s=HANG_GUARD_S) == 0, output(job)[-3000:]
    assert summary(job)["outcome"] == "stopped" and summary(job)["steps"] == 10
    assert (job / "checkpoints" / "step-000010" / "manifest.json").is_file()
    (job / "stop.flag").unlink()
    assert run_trainer(job, "--resume-from", str(job / "checkpoints" / "ckpt_latest"), timeout_s=HANG_GUARD_S) == 0
    assert summary(job)["outcome"] == "done" and summary(job)["resumed_from"] == "checkpoints/step-000010"
    assert weights_sha256(job) == weights_sha256(reference)


@pytest.mark.slow  # a 2-rank trainer process or two (~15-30 s each on a quiet machine)
def test_sigterm_to_torchrun_checkpoints_every_rank_and_exits_143(tiny, tmp_path):
    job = write_job(tmp_path / "preempted", tiny, **RANKS)
    proc = start_trainer(job, TRAINQ_TRAINER_FAULTS="sleep_per_step=0.2")
    try:
        wait_until(lambda: last_step(job) >= 3, HANG_GUARD_S, 0.05, "step 3")
        proc.send_signal(signal.SIGTERM)  # what a supervisor or Slurm does; torchrun forwards it to the ranks
        assert proc.wait(timeout=HANG_GUARD_S) == 143, output(job)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert summary(job)["outcome"] == "preempted"
    step = summary(job)["steps"]
    assert (job / "checkpoints" / f"step-{step:06d}" / "manifest.json").is_file()


@pytest.mark.slow  # a 2-rank trainer process or two (~15-30 s each on a quiet machine)
def test_sigstopped_rank_fails_the_job_naming_it(tiny, tmp_path):
    job = write_job(tmp_path / "hung", tiny, **RANKS)
    proc = start_trainer(job, TRAINQ_TRAINER_FAULTS="sleep_per_step=0.1", **FAST_FAILURE_ENV)
    try:
        wait_until(lambda: last_step(job) >= 3, HANG_GUARD_S, 0.05, "step 3")
        ranks = rank_processes(job)
        ranks[1].send_signal(signal.SIGSTOP)
        code = proc.wait(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 128 + signal.SIGKILL
    failed = events(job, "rank_failed")[-1]
    assert failed["kind"] == "stalled" and failed["rank"] == 1
    assert "Timed out" in failed["evidence"] and "[rank 0]" in failed["evidence"]
    assert not psutil.pid_exists(ranks[1].pid) or ranks[1].status() == psutil.STATUS_ZOMBIE


def test_a_rank_that_never_joins_is_named_at_startup_never_as_preempted(tiny, tmp_path):
    """Issue 37: rank 1 starts late (the fault switch), past TRAINQ_RENDEZVOUS_TIMEOUT_S: the job exits 69 and the
    rank_failed event names rank 1, stage startup, diagnosis startup; never 143 or "killed by SIGTERM"."""
    from trainq.watcher.daemon.diagnosis import diagnose
    from trainq.watcher.spec.contract import EXIT_STARTUP

    job = write_job(tmp_path / "late", tiny, max_steps=2, eval_every=None, **RANKS)
    code = run_trainer(
        job,
        timeout_s=HANG_GUARD_S,
        TRAINQ_RENDEZVOUS_TIMEOUT_S="2",
        TRAINQ_COLLECTIVE_TIMEOUT_S="600",  # the steps' timeout no longer bounds the start
        TRAINQ_TRAINER_FAULTS="late_rank=1,late_join_s=120",
    )
    assert code == EXIT_STARTUP == 69, output(job)[-3000:]
    [failed] = events(job, "rank_failed")
    assert failed["rank"] == 1 and failed["stage"] == "startup" and failed["kind"] == "startup"
    assert failed["evidence"].startswith("rank 1 never joined the group within 2 s of start-up")
    assert "rank 0 gave up waiting" in failed["evidence"] and "joining 120 s late" in failed["evidence"]
    [said] = [line for line in output(job).splitlines() if line.endswith("torchrun stopped the other ranks")]
    assert said.startswith("trainq: rank 1 never joined") and "SIGTERM" not in said
    found = diagnose({"exit_code": code}, output(job), records(job))
    assert found.kind == "startup" and "TRAINQ_RENDEZVOUS_TIMEOUT_S" in found.advice


def test_a_rank_ended_by_torchruns_sigterm_is_a_consequence_not_the_cause(tmp_path):
    """torchrun stops the remaining ranks with SIGTERM once one fails: the other failure is the cause, and a
    SIGTERM alone is never reported as the preemption code 143."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from trainq.trainer.launch import _root_cause, report_failure

    crashed = ProcessFailure(local_rank=1, pid=2, exitcode=1, error_file="")
    ended = ProcessFailure(local_rank=0, pid=1, exitcode=-signal.SIGTERM, error_file="")
    ended.timestamp = crashed.timestamp - 1  # even when torchrun's SIGTERM is seen first
    assert _root_cause({0: ended, 1: crashed})[0] == 1
    (tmp_path / "logs").mkdir()
    code = report_failure({0: ended}, tmp_path / "logs", tmp_path)
    assert code == 1 and code != 128 + signal.SIGTERM
    [failed] = events(tmp_path, "rank_failed")
    assert failed["stage"] == "startup" and "ended by SIGTERM" in failed["evidence"]


def test_a_nan_on_one_rank_rolls_every_rank_back_together(tiny, tmp_path):
    """The NaN guard decides from the loss reduced across ranks: rank 1's bad steps roll both ranks back to the
    same checkpoint (ranks that decided apart would hang in the next collective or drift)."""
    job = write_job(tmp_path / "nan", tiny, checkpoint={"every_steps": 4, "keep": 2}, eval_every=None, **RANKS)
    code = run_trainer(job, TRAINQ_TRAINER_FAULTS="nan_at=6,7,8,nan_rank=1", timeout_s=HANG_GUARD_S)
    assert code == 0, output(job)[-3000:]
    assert [r["step"] for r in records(job, "step") if r.get("nonfinite")] == [6, 7, 8]
    rollback = events(job, "rollback")
    assert len(rollback) == 1 and rollback[0]["to"].endswith("step-000004"), rollback
    done = summary(job)
    assert done["outcome"] == "done" and done["rollbacks"] == 1 and done["world_size"] == 2


def test_resume_with_another_world_size_is_refused_naming_both(reference, tmp_path):
    job = tmp_path / "one-rank"
    job.mkdir()
    shutil.copytree(reference / "checkpoints", job / "checkpoints", symlinks=True)
    spec = yaml.safe_load((reference / "job.yaml").read_text())
    spec["train"]["processes"] = 1
    (job / "job.yaml").write_text(yaml.safe_dump(spec))
    assert run_trainer(job, "--resume-from", str(job / "checkpoints" / "step-000016"), timeout_s=HANG_GUARD_S) == 2
    last = output(job).strip().splitlines()[-1]
    assert "world size 2" in last and "world size 1" in last and "allow_changed_schedule" in last


def test_keep_global_batch_when_allowed(tiny):
    from trainq.trainer.config import load_config
    from trainq.trainer.distributed import WorldSizeChanged, keep_global_batch

    config = load_config(write_job(tiny / "gb", tiny, batch_size=4, grad_accum=1, allow_changed_schedule=True))
    one = keep_global_batch(config, {"world_size": 2}, 1, "ckpt")
    assert (one.batch_size, one.grad_accum) == (4, 2)  # 4 x 1 x 2 ranks == 4 x 2 x 1 rank
    four = keep_global_batch(config, {"world_size": 2}, 4, "ckpt")
    assert (four.batch_size, four.grad_accum) == (2, 1)
    with pytest.raises(WorldSizeChanged, match="cannot be split"):
        keep_global_batch(config, {"world_size": 1}, 3, "ckpt")


@pytest.mark.slow  # a 2-rank trainer process or two (~15-30 s each on a quiet machine)
def test_full_fine_tuning_on_two_ranks(tiny, tmp_path):
    job = write_job(
        tmp_path / "full",
        tiny,
        method="full",
        lr=0.002,
        max_steps=8,
        eval_every=4,
        checkpoint={"every_steps": 4, "keep": 1},
        **RANKS,
    )
    assert run_trainer(job, timeout_s=HANG_GUARD_S) == 0, output(job)[-3000:]
    assert summary(job)["outcome"] == "done" and summary(job)["world_size"] == 2
    assert (job / "model" / "model.safetensors").is_file()
    assert "find_unused_parameters=True" not in output(job)


def test_fsdp_on_cpu_ranks_is_refused_naming_the_field(tiny, tmp_path):
    job = write_job(tmp_path / "fsdp", tiny, method="full", strategy="fsdp", **RANKS)
    assert run_trainer(job, timeout_s=HANG_GUARD_S, CUDA_VISIBLE_DEVICES="") == 2
    assert "train.strategy: fsdp needs GPU ranks" in output(job)


@pytest.mark.gpu
def test_fsdp_full_fine_tuning_on_two_gpus(tiny, tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("FSDP needs 2 CUDA GPUs: accelerate shards only GPU ranks (CPU ranks are refused)")
    job = write_job(
        tmp_path / "fsdp",
        tiny,
        method="full",
        lr=0.002,
        max_steps=8,
        strategy="fsdp",
        checkpoint={"every_steps": 4, "keep": 1},
        **RANKS,
    )
    assert run_trainer(job, timeout_s=HANG_GUARD_S, CUDA_VISIBLE_DEVICES="0,1") == 0, output(job)[-3000:]
    assert summary(job)["strategy"] == "fsdp" and (job / "model" / "model.safetensors").is_file()


def test_validation_names_the_field():
    from trainq.watcher.spec.capacity import nodes_problem
    from trainq.watcher.spec.errors import InvalidJobSpec
    from trainq.watcher.spec.jobspec import JobSpec

    train = {"model": "/m", "data": "/d.jsonl", "max_steps": 1}
    cases = {
        "train.processes": {"resources": {"gpus": 2}, "train": {**train, "processes": 4}},
        "train.strategy": {"train": {**train, "method": "qlora", "strategy": "fsdp"}},
        "resources.tasks_per_node": {"resources": {"nodes": 2, "tasks_per_node": 2}, "train": train},
    }
    for field, job in cases.items():
        with pytest.raises(InvalidJobSpec) as caught:
            JobSpec.from_dict({"approved": True, **job}, "inbox/x.yaml")
        assert [p.path for p in caught.value.problems] == [field]
    assert JobSpec.from_dict({"approved": True, "resources": {"gpus": 2}, "train": {**train, "processes": 2}})
    problem = nodes_problem({"resources": {"nodes": 2}}, "local")
    assert problem.path == "resources.nodes" and "executor: slurm" in problem.message
    assert nodes_problem({"resources": {"nodes": 2}}, "slurm") is None


def test_nodes_without_slurm_are_rejected_by_the_watcher(queue_dir, watcher):
    from conftest import tick_until

    w = watcher()
    drop(queue_dir, "multi.yaml", 'approved: true\nresources: {nodes: 2}\ncommand: ["true"]\n')
    drop(queue_dir, "fine.yaml", 'approved: true\ncommand: ["true"]\n')
    tick_until(w, lambda: (queue_dir / "failed" / "multi" / "run.json").exists(), what="multi rejected")
    run = json.loads((queue_dir / "failed" / "multi" / "run.json").read_text())
    assert run["status"] == "rejected" and [e["path"] for e in run["errors"]] == ["resources.nodes"]
    tick_until(
        w,
        lambda: any((queue_dir / state / "fine").exists() for state in ("pending", "running", "done")),
        what="the other job is accepted",
    )


@pytest.mark.slow  # a 2-rank trainer process or two (~15-30 s each on a quiet machine)
def test_sigkilled_rank_is_diagnosed_and_retried_bitwise_under_the_watcher(reference, queue_dir, watcher_process):
    spec = yaml.safe_load((reference / "job.yaml").read_text())
    spec.update(
        env={"TRAINQ_TRAINER_FAULTS": "sleep_per_step=0.1"},
        stop_grace="60s",
        retries={"max": 1, "on": ["killed"], "backoff": "1s"},
    )
    watcher_process()
    drop(queue_dir, "ranks.yaml", yaml.safe_dump(spec))
    running = queue_dir / "running" / "ranks"
    wait_until(lambda: last_step(running) >= 10 if running.exists() else False, HANG_GUARD_S, 0.1, "step 10")
    rank1 = wait_until(lambda: rank_processes(running).get(1), 30, 0.1, "rank 1")
    rank1.send_signal(signal.SIGKILL)
    done = queue_dir / "done" / "ranks"
    wait_until(lambda: done.exists() or (queue_dir / "failed" / "ranks").exists(), HANG_GUARD_S, 0.2, "the end")
    assert done.exists(), (queue_dir / "failed" / "ranks" / "output.log").read_text()[-3000:]
    run = json.loads((done / "run.json").read_text())
    first = run["attempts"][0]["diagnosis"]
    assert run["attempt"] == 2 and first["kind"] == "killed"
    assert first["evidence"].startswith("rank 1 (pid ") and "SIGKILL" in first["evidence"]
    assert "checkpoints/step-" in (run["attempts"][1]["resumed_from"] or "")
    assert weights_sha256(done) == weights_sha256(reference)
