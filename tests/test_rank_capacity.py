"""CPU ranks bounded by the machine (issue 37): train.processes above the usable cores (unless oversubscribe) or
above what RAM holds is refused at acceptance and at start, naming the field and the figure; with GPUs (simulated)
the ranks are bounded by the GPUs as before. The watcher reads the model folder's weight headers, never torch."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import drop, tick_until
from trainer_util import REPO, build_tiny, events, output, trainer_env, write_job

from trainq.watcher.spec.capacity import (
    GIB,
    RANK_BASE_BYTES,
    CpuMachine,
    cgroup_cpu_quota,
    cgroup_memory_limit,
    model_weights,
    usable_cores,
)

CORES = len(os.sched_getaffinity(0))


def fake_model(folder: Path, params: int) -> Path:
    """A model folder whose one safetensors file declares ``params`` fp32 values (the header alone: the watcher
    reads nothing else, and a file of that size would not fit this disk)."""
    folder.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [params], "data_offsets": [0, 4 * params]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (folder / "config.json").write_text("{}")
    return folder


def train_job(model: Path, **train: object) -> str:
    """A train job on ``model`` whose data file exists (a missing one is refused at submit, before any rank rule)."""
    data = model.parent / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    block = {"model": str(model), "data": str(data), "max_steps": 2, **train}
    return yaml.safe_dump({"approved": True, "train": block})


def rejected(queue_dir: Path, job_id: str) -> dict:
    return json.loads((queue_dir / "failed" / job_id / "run.json").read_text())


def test_more_cpu_ranks_than_cores_are_refused_at_acceptance_unless_oversubscribed(queue_dir, watcher, tmp_path):
    model = fake_model(tmp_path / "m", 1000)
    (queue_dir / "pause.flag").touch()  # accepted jobs stay pending: nothing here should train
    w = watcher()
    drop(queue_dir, "many.yaml", train_job(model, processes=CORES + 1))
    drop(queue_dir, "allowed.yaml", train_job(model, processes=CORES + 1, oversubscribe=True))
    drop(queue_dir, "within.yaml", train_job(model, processes=max(CORES, 2), oversubscribe=CORES < 2))
    tick_until(w, lambda: (queue_dir / "failed" / "many" / "run.json").exists(), what="many rejected")
    run = rejected(queue_dir, "many")
    assert run["status"] == "rejected" and [e["path"] for e in run["errors"]] == ["train.processes"]
    words = run["errors"][0]["message"]
    assert f"{CORES + 1} CPU ranks" in words and f"{CORES} usable core" in words and "oversubscribe" in words
    assert run["error"].startswith("inbox/many.yaml: train.processes: ")
    tick_until(w, lambda: (queue_dir / "pending" / "allowed").exists(), what="oversubscribed job accepted")
    tick_until(w, lambda: (queue_dir / "pending" / "within").exists(), what="job within the cores accepted")


def test_ranks_beyond_ram_are_refused_even_oversubscribed_and_name_the_figure(queue_dir, watcher, tmp_path):
    machine = CpuMachine.probe()
    params = machine.ram_bytes // 16  # full fine-tuning holds 16 bytes per parameter: one rank alone fills RAM
    model = fake_model(tmp_path / "big", params)
    (queue_dir / "pause.flag").touch()
    w = watcher()
    drop(queue_dir, "full.yaml", train_job(model, processes=2, method="full", oversubscribe=True))
    drop(queue_dir, "lora.yaml", train_job(model, processes=2, method="lora", oversubscribe=True))
    tick_until(w, lambda: (queue_dir / "failed" / "full" / "run.json").exists(), what="full rejected")
    [error] = rejected(queue_dir, "full")["errors"]
    assert error["path"] == "train.processes"
    need = 2 * (RANK_BASE_BYTES + params * 16)
    assert f"need at least {need / GIB:.1f} GiB of RAM" in error["message"]
    assert f"this machine has {machine.ram_bytes / GIB:.1f} GiB" in error["message"]
    assert f"{params / 1e6:,.1f} M parameters" in error["message"] and "method full" in error["message"]
    # lora holds the frozen weights only (4 bytes each): two ranks fit
    tick_until(w, lambda: (queue_dir / "pending" / "lora").exists(), what="lora accepted")


def test_with_simulated_gpus_cpu_cores_do_not_bound_the_ranks(queue_dir, watcher_config, tmp_path, monkeypatch):
    from trainq.watcher.daemon.daemon import Watcher

    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps([{"index": i, "name": "Sim", "memory_total_mb": 8192} for i in range(CORES + 1)]))
    (queue_dir / "pause.flag").touch()
    w = Watcher(queue_dir, watcher_config(), env={**os.environ, "TRAINQ_SIMULATE_GPUS": str(gpus)})
    w.start(install_signals=False)
    try:
        drop(queue_dir, "gpu.yaml", train_job(fake_model(tmp_path / "m", 1000), processes=CORES + 1))
        tick_until(w, lambda: (queue_dir / "pending" / "gpu").exists(), what="GPU ranks accepted")
    finally:
        w.close()


def test_cgroup_quota_and_memory_limit_lower_the_figures(tmp_path):
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    proc.mkdir()
    (cg / "v2" / "jobs" / "one").mkdir(parents=True)
    (cg / "cpu" / "box").mkdir(parents=True)
    (proc / "cgroup").write_text("4:cpu,cpuacct:/box\n3:memory:/box\n0::/jobs/one\n")
    (proc / "mounts").write_text(
        f"cgroup2 {cg / 'v2'} cgroup2 rw 0 0\ncgroup {cg / 'cpu'} cgroup rw,cpu,cpuacct 0 0\n"
        f"cgroup {cg / 'mem'} cgroup rw,memory 0 0\n"
    )
    assert cgroup_cpu_quota(proc) is None and cgroup_memory_limit(proc) is None
    (cg / "v2" / "jobs" / "cpu.max").write_text("150000 100000\n")  # an ancestor's quota binds too
    assert cgroup_cpu_quota(proc) == 1.5
    (cg / "cpu" / "box" / "cpu.cfs_quota_us").write_text("50000\n")
    (cg / "cpu" / "box" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(proc) == 0.5
    cores, source = usable_cores(proc)
    assert cores == 1 and "cgroup CPU quota of 0.5" in source
    (cg / "v2" / "jobs" / "one" / "memory.max").write_text("2147483648\n")
    assert cgroup_memory_limit(proc) == 2 * GIB


def test_weights_are_counted_from_the_tiny_models_headers(tmp_path):
    tiny = build_tiny(tmp_path / "tiny")
    from safetensors.numpy import load_file

    expected = sum(v.size for v in load_file(str(tiny / "model" / "model.safetensors")).values())
    weights = model_weights(tiny / "model")
    assert weights.params == expected and weights.how == "safetensors headers"


def _pinned_to_one_core():
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def test_trainer_by_hand_refuses_ranks_over_its_cores_naming_the_field(tmp_path):
    job = write_job(tmp_path / "job", build_tiny(tmp_path / "tiny"), processes=2)
    done = subprocess.run(
        [sys.executable, "-m", "trainq.trainer", str(job)],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_pinned_to_one_core,
    )
    assert done.returncode == 2, done.stderr
    assert "job.yaml: train.processes: 2 CPU ranks but this machine has 1 usable core" in done.stderr


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_oversubscribed_ranks_train_with_one_warning(tmp_path):
    job = write_job(
        tmp_path / "job", build_tiny(tmp_path / "tiny"), processes=2, oversubscribe=True, max_steps=2, eval_every=None
    )
    with open(job / "output.log", "wb") as log:
        code = subprocess.run(
            [sys.executable, "-m", "trainq.trainer", str(job)],
            cwd=REPO,
            env=trainer_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=300,
            preexec_fn=_pinned_to_one_core,
        ).returncode
    assert code == 0, output(job)[-3000:]
    warnings = [line for line in output(job).splitlines() if "trainq: warning: 2 CPU ranks on 1 usable core" in line]
    assert len(warnings) == 1, output(job)[-3000:]
    [event] = events(job, "oversubscribe")
    assert "train.oversubscribe: true" in event["message"]
