"""Probes against the real machine (no NVIDIA driver here), simulated GPU and battery files, real processes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from conftest import wait_until

from trainq.watcher.daemon.resources import ENV_SIMULATE_BATTERY, GpuInfo, ResourceProbe, ram_bytes
from trainq.watcher.spec.contract import ENV_SIMULATE_GPUS

TWO_GPUS = [
    {
        "index": 0,
        "name": "Sim 6GB",
        "memory_total_mb": 6144,
        "memory_used_mb": 0,
        "utilization_pct": 0,
        "temperature_c": 41,
        "compute_capability": "8.6",
    },
    {"index": 1, "name": "Sim 6GB", "memory_total_mb": 6144},
]


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start real processes; every one is killed and reaped at teardown."""
    procs: list[subprocess.Popen] = []

    def start(*argv: str) -> subprocess.Popen:
        proc = subprocess.Popen(argv or ("sleep", "60"))
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def write_json(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj))
    return path


def probe_for(sim: Path, **env: str) -> ResourceProbe:
    return ResourceProbe(sim, env=env, cache_s=0.0)


def test_no_nvml_means_no_gpus_and_the_failure_is_remembered(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="trainq.watcher.daemon.resources")
    probe = ResourceProbe(env={}, cache_s=0.0)
    states = [probe.sample([]) for _ in range(3)]
    assert all(s.gpus == () and s.gpu_error is None for s in states)
    nvml_lines = [r for r in caplog.records if "NVML" in r.getMessage()]
    assert len(nvml_lines) == 1, "NVML initialisation must be tried once, not every sample"
    probe.close()
    probe.close()


def test_sample_reads_ram_and_disks_by_path(tmp_path: Path) -> None:
    not_yet = tmp_path / "later" / "cwd"
    with ResourceProbe(env={}) as probe:
        state = probe.sample([tmp_path, not_yet])
    assert 0 < state.ram_available_gb <= state.ram_total_gb
    total, free = state.disks[str(tmp_path)]
    assert 0 < free <= total
    assert state.disks[str(not_yet)][0] == total, "a missing cwd is measured on its parent"
    assert state.disks[str(not_yet)][1] == pytest.approx(free, abs=1.0)  # others write meanwhile
    assert state.disk_devices[str(not_yet)] == os.stat(tmp_path).st_dev


def test_simulated_gpus_from_file_and_env(tmp_path: Path) -> None:
    sim = write_json(tmp_path / "gpus.json", TWO_GPUS)
    for probe in (probe_for(sim), ResourceProbe(env={ENV_SIMULATE_GPUS: str(sim)})):
        gpus = probe.sample().gpus
        assert [g.index for g in gpus] == [0, 1]
        assert gpus[0] == GpuInfo(0, "Sim 6GB", 6144, 0, 0, 41, "8.6", (), True)
        assert gpus[1].memory_free_mb == 6144 and gpus[1].simulated


def test_simulation_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    sim = write_json(tmp_path / "gpus.json", TWO_GPUS)
    probe = probe_for(sim)
    assert len(probe.sample().gpus) == 2
    write_json(sim, [*TWO_GPUS, {"index": 2, "name": "Sim 24GB", "memory_total_mb": 24576}])
    assert [g.name for g in probe.sample().gpus] == ["Sim 6GB", "Sim 6GB", "Sim 24GB"]
    replacement = tmp_path / "new.json"  # editors that save by rename change the inode
    write_json(replacement, TWO_GPUS[:1])
    replacement.rename(sim)
    assert len(probe.sample().gpus) == 1


def test_listed_pid_counts_only_while_its_process_lives(tmp_path: Path, spawn: Callable) -> None:
    sleeper = spawn()
    done = spawn("true")
    done.wait(timeout=10)
    gpus = [dict(TWO_GPUS[0], processes=[{"pid": sleeper.pid, "used_mb": 900}, {"pid": done.pid, "used_mb": 700}])]
    probe = probe_for(write_json(tmp_path / "gpus.json", gpus))
    procs = probe.sample().gpus[0].processes
    assert [(p.pid, p.used_mb, p.name) for p in procs] == [(sleeper.pid, 900, "sleep")], "dead pid must be dropped"
    sleeper.kill()
    sleeper.wait(timeout=10)
    assert probe.sample().gpus[0].processes == ()


def test_used_memory_defaults_to_the_live_processes(tmp_path: Path, spawn: Callable) -> None:
    sleeper = spawn()
    gpus = [{"index": 0, "memory_total_mb": 8192, "processes": [{"pid": sleeper.pid, "used_mb": 1000, "name": "x"}]}]
    gpu = probe_for(write_json(tmp_path / "gpus.json", gpus)).sample().gpus[0]
    assert (gpu.memory_used_mb, gpu.memory_free_mb, gpu.processes[0].name) == (1000, 7192, "x")


@pytest.mark.parametrize(
    "content, field",
    [
        ("not json", "Expecting value"),
        ('{"index": 0}', "expected a JSON list"),
        ('[{"index": "zero", "memory_total_mb": 1}]', "[0].index"),
        ('[{"index": 0}]', "[0].memory_total_mb"),
        ('[{"index": 0, "memory_total_mb": 1, "processes": [{"pid": true, "used_mb": 1}]}]', "[0].processes[0].pid"),
        ('[{"index": 0, "memory_total_mb": 1}, {"index": 0, "memory_total_mb": 1}]', "unique"),
        ("\xff", "invalid simulate_gpus"),
    ],
)
def test_malformed_simulation_file_means_no_gpus_and_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str, field: str
) -> None:
    sim = tmp_path / "gpus.json"
    sim.write_text(content, encoding="latin-1")
    probe = probe_for(sim)
    states = [probe.sample() for _ in range(3)]
    assert all(s.gpus == () for s in states)
    assert field in (states[0].gpu_error or "") and str(sim) in states[0].gpu_error
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and field in warnings[0].getMessage()
    write_json(sim, TWO_GPUS)
    fixed = probe.sample()
    assert len(fixed.gpus) == 2 and fixed.gpu_error is None


def test_missing_simulation_file_is_an_error_not_a_crash(tmp_path: Path) -> None:
    state = probe_for(tmp_path / "absent.json").sample()
    assert state.gpus == () and "not found" in state.gpu_error


def test_simulated_battery_is_reread(tmp_path: Path) -> None:
    battery = write_json(tmp_path / "battery.json", {"percent": 62, "power_plugged": False})
    probe = ResourceProbe(env={ENV_SIMULATE_BATTERY: str(battery)})
    assert probe.sample().battery == {"percent": 62, "power_plugged": False}
    write_json(battery, {"percent": 100, "power_plugged": True})
    assert probe.sample().battery == {"percent": 100, "power_plugged": True}
    battery.write_text('{"percent": "full"}')
    assert probe.sample().battery is None


def test_tree_usage_covers_children_and_measures_cpu(tmp_path: Path, spawn: Callable) -> None:
    # a parent holding ~60 MB that starts a busy child: the tree's RSS and CPU must include both
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "blob = bytearray(60 * 1024 * 1024)\n"
        # the busy child stops by itself once orphaned: a SIGTERM before `try` must not leave it spinning
        "child = subprocess.Popen([sys.executable, '-c', 'import os\\np = os.getppid()\\nwhile os.getppid() == p: pass'])\n"
        "try:\n    time.sleep(60)\nfinally:\n    child.kill()\n    child.wait()\n"
    )
    parent = spawn(sys.executable, "-c", script)
    probe = ResourceProbe(env={}, tree_rescan_s=0.0)
    first = wait_until(lambda: (u := probe.tree_usage([parent.pid]))["rss_mb"] > 60 and u)
    assert first["gpu_memory_mb"] == 0
    # only the child burns CPU, so a busy reading proves descendants are counted
    wait_until(lambda: probe.tree_usage([parent.pid])["cpu_pct"] > 5, timeout_s=20)
    parent.terminate()
    parent.wait(timeout=10)
    wait_until(lambda: probe.tree_usage([parent.pid])["rss_mb"] == 0)


def test_new_children_are_found_at_the_next_rescan(tmp_path: Path, spawn: Callable) -> None:
    go, ready = tmp_path / "go", tmp_path / "ready"
    script = (
        "import os, subprocess, sys, time\n"
        f"open({str(ready)!r}, 'w').close()\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        "subprocess.run(['sleep', '60'])\n"
    )
    parent = spawn(sys.executable, "-c", script)
    now = [0.0]
    probe = ResourceProbe(env={}, tree_rescan_s=5.0, clock=lambda: now[0])
    wait_until(ready.exists)
    alone = probe.tree_usage([parent.pid])["rss_mb"]
    go.touch()
    child = psutil.Process(wait_until(lambda: psutil.Process(parent.pid).children())[0].pid)
    assert probe.tree_usage([parent.pid])["rss_mb"] < alone + 0.5, "no rescan before tree_rescan_s"
    now[0] = 5.0
    child_mb = child.memory_info().rss / 2**20
    assert probe.tree_usage([parent.pid])["rss_mb"] > alone + child_mb - 0.5
    child.kill()
    parent.wait(timeout=10)


def test_tree_usage_sums_gpu_memory_of_the_tree(tmp_path: Path, spawn: Callable) -> None:
    job = spawn()
    other = spawn()
    gpus = [
        dict(TWO_GPUS[0], processes=[{"pid": job.pid, "used_mb": 700}, {"pid": other.pid, "used_mb": 300}]),
        dict(TWO_GPUS[1], processes=[{"pid": job.pid, "used_mb": 50}]),
    ]
    probe = probe_for(write_json(tmp_path / "gpus.json", gpus))
    assert probe.tree_usage([job.pid])["gpu_memory_mb"] == 750
    assert probe.tree_usage([job.pid, other.pid])["gpu_memory_mb"] == 1050
    assert probe.tree_usage([]) == {"rss_mb": 0, "cpu_pct": 0, "gpu_memory_mb": 0}


def _has_nvidia_driver() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_nvidia_driver(), reason="needs an NVIDIA driver (NVML)")
def test_real_nvml_reports_every_gpu_with_memory_and_our_own_processes() -> None:
    """On a GPU machine: names, memory, utilisation, compute capability, and a CUDA process we start."""
    probe = ResourceProbe(env={}, cache_s=0.0)
    try:
        gpus, error = probe.gpus()
        assert error is None and gpus, "NVML is there but reported no GPU"
        for gpu in gpus:
            assert gpu.name and gpu.memory_total_mb > 0
            assert 0 <= gpu.memory_used_mb <= gpu.memory_total_mb
            assert gpu.compute_capability and "." in gpu.compute_capability
        user = subprocess.Popen(
            [sys.executable, "-c", "import torch, time; x = torch.ones(64 << 20, device='cuda'); time.sleep(30)"]
        )
        try:
            seen = wait_until(lambda: any(p.pid == user.pid for g in probe.gpus()[0] for p in g.processes), 60)
            assert seen
            usage = probe.tree_usage([user.pid])
            assert usage["gpu_memory_mb"] >= 200
        finally:
            user.kill()
            user.wait()
    finally:
        probe.close()


def test_ram_is_read_from_meminfo_as_psutil_reads_it():
    """Issue 38: each plan read RAM through psutil.virtual_memory (all of /proc/meminfo parsed); ram_bytes reads
    the two numbers it needs. Total is the same number; available is live, so it is compared within a margin."""
    total, available = ram_bytes()
    vm = psutil.virtual_memory()
    assert total == vm.total
    assert 0 < available <= total
    assert abs(available - vm.available) < 256 * 1024**2
