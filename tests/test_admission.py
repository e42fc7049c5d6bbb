"""Admission over real probe samples: simulated GPU files, real RAM/disk readings, real processes."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from trainq.watcher.daemon.admission import Decision, Holding, Limits, Request, plan, resources_dict
from trainq.watcher.daemon.resources import ENV_SIMULATE_BATTERY, MachineState, ResourceProbe


def sim_gpu(index: int, total_mb: float = 6144, processes: list[dict] | None = None) -> dict:
    return {
        "index": index,
        "name": f"Sim {total_mb / 1024:g}GB",
        "memory_total_mb": total_mb,
        "memory_used_mb": 0,
        "utilization_pct": 0,
        "processes": processes or [],
    }


@pytest.fixture
def gpus_file(tmp_path: Path) -> Callable[..., Path]:
    """Write the simulation file (one dict per GPU) and return its path."""

    def write(*gpus: dict) -> Path:
        path = tmp_path / "gpus.json"
        path.write_text(json.dumps(list(gpus)))
        return path

    return write


@pytest.fixture
def machine(tmp_path: Path, gpus_file: Callable[..., Path]) -> Callable[..., MachineState]:
    """A real sample with GPUs from the simulation file (2 free 6 GB GPUs unless given)."""
    probe = ResourceProbe(gpus_file(sim_gpu(0), sim_gpu(1)), env={}, cache_s=0.0)

    def sample(*gpus: dict) -> MachineState:
        if gpus:
            gpus_file(*gpus)
        return probe.sample([tmp_path])

    yield sample
    probe.close()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait(timeout=10)


def jobs(*ids: str, **needs: object) -> list[Request]:
    return [Request(job_id, order=n, **needs) for n, job_id in enumerate(ids)]


def by_id(decisions: list[Decision]) -> dict[str, Decision]:
    return {d.job_id: d for d in decisions}


def started(decisions: list[Decision]) -> dict[str, tuple[int, ...]]:
    return {d.job_id: d.gpus for d in decisions if d.start}


def test_jobs_get_different_gpus_and_the_third_waits_until_one_frees(machine: Callable) -> None:
    state = machine()
    limits = Limits(max_concurrent=4)
    first = plan(jobs("a", "b", "c", gpus=1), [], state, limits)
    assert started(first) == {"a": (0,), "b": (1,)}
    assert by_id(first)["a"].env == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert by_id(first)["c"].waiting_for == "GPU 0 held by job a; GPU 1 held by job b"
    holdings = [Holding("a", gpus=(0,)), Holding("b", gpus=(1,))]
    assert started(plan(jobs("c", gpus=1), holdings, state, limits)) == {}
    assert started(plan(jobs("c", gpus=1), holdings[1:], state, limits)) == {"c": (0,)}


def test_default_gpu_count_is_one_with_gpus_and_zero_without(machine: Callable, tmp_path: Path) -> None:
    with_gpus = plan(jobs("a"), [], machine(), Limits())
    assert started(with_gpus) == {"a": (0,)}
    without = plan(jobs("a"), [], ResourceProbe(env={}).sample([tmp_path]), Limits())
    assert without == [Decision("a", True, (), {}, None, None)], "no GPUs: no CUDA variables at all"
    zero = plan(jobs("a", gpus=0), [], machine(), Limits())
    assert zero[0].start and zero[0].env["CUDA_VISIBLE_DEVICES"] == "", "a CPU job must not see the GPUs"


def test_foreign_process_blocks_its_gpu_while_it_lives(machine: Callable, sleeper: subprocess.Popen) -> None:
    foreign = [{"pid": sleeper.pid, "used_mb": 900}]
    state = machine(sim_gpu(0, processes=foreign))
    waiting = plan(jobs("a", gpus=1), [], state, Limits())[0]
    assert waiting.waiting_for == f"GPU 0 used by foreign process {sleeper.pid} (sleep, 900 MB)"
    sleeper.kill()
    sleeper.wait(timeout=10)
    assert started(plan(jobs("a", gpus=1), [], machine(), Limits())) == {"a": (0,)}


def test_foreign_threshold_is_five_percent_or_512_mb(machine: Callable, sleeper: subprocess.Popen) -> None:
    def blocked(total_mb: float, used_mb: float) -> bool:
        state = machine(sim_gpu(0, total_mb, [{"pid": sleeper.pid, "used_mb": used_mb}]))
        return not plan(jobs("a", gpus=1), [], state, Limits())[0].start

    assert not blocked(6144, 300) and blocked(6144, 310)  # 5% of 6 GB is 307 MB
    assert not blocked(81920, 512) and blocked(81920, 513)  # 512 MB caps it on big GPUs


def test_dead_pid_in_the_file_does_not_block(machine: Callable) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=10)
    state = machine(sim_gpu(0, processes=[{"pid": gone.pid, "used_mb": 5000}]))
    assert started(plan(jobs("a", gpus=1), [], state, Limits())) == {"a": (0,)}


def test_our_own_process_on_a_gpu_is_not_foreign(machine: Callable, sleeper: subprocess.Popen) -> None:
    state = machine(sim_gpu(0, processes=[{"pid": sleeper.pid, "used_mb": 5000}]), sim_gpu(1))
    holding = Holding("a", gpus=(0,), pids=(sleeper.pid,))
    res = resources_dict(state, [holding])
    assert res["gpus"][0]["held_by"] == "a" and res["gpus"][0]["foreign"] == []
    # the same process found on a GPU its job was not given still keeps other jobs off that GPU
    stray = Holding("a", gpus=(1,), pids=(sleeper.pid,))
    assert plan(jobs("b", gpus=1), [stray], state, Limits(max_concurrent=2))[0].waiting_for == (
        "GPU 0 held by job a; GPU 1 held by job a"
    )


def test_unsatisfiable_jobs_are_reported_at_once(machine: Callable, tmp_path: Path) -> None:
    state = machine()
    total_disk = state.disks[str(tmp_path)][0]
    cases = {
        "four-gpus": (Request("four-gpus", gpus=4), "needs 4 GPUs; 2 scheduled here"),
        "big-gpu": (Request("big-gpu", gpus=1, gpu_memory_gb=8), "needs 1 GPU with 8 GB each; 0 here have that much"),
        "ram": (Request("ram", gpus=0, ram_gb=state.ram_total_gb + 1), "GB RAM; this machine has"),
        "disk": (Request("disk", gpus=0, disk_gb=total_disk + 1, disk_path=tmp_path), "that filesystem holds"),
    }
    decisions = by_id(plan([r for r, _ in cases.values()], [], state, Limits(max_concurrent=9, paused=True)))
    for job_id, (_, words) in cases.items():
        assert not decisions[job_id].start and words in (decisions[job_id].unsatisfiable or ""), job_id
    only_gpu_1 = plan([Request("x", gpus=2)], [], state, Limits(gpu_ids=(1,)))[0]
    assert only_gpu_1.unsatisfiable == "needs 2 GPUs; 1 scheduled here (watcher.yaml gpus: [1])"


def test_no_gpus_readable_waits_instead_of_failing(machine: Callable, gpus_file: Callable, tmp_path: Path) -> None:
    (tmp_path / "gpus.json").write_text("[{")
    state = machine()
    assert state.gpus == () and state.gpu_error
    decision = plan(jobs("a"), [], state, Limits())[0]
    assert decision.unsatisfiable is None and decision.waiting_for.startswith("GPUs unavailable: ")


def test_ram_gate_with_the_real_probe(machine: Callable) -> None:
    state = machine()
    free = state.ram_available_gb
    between = (free + state.ram_total_gb) / 2
    decision = plan(jobs("a", gpus=0, ram_gb=between), [], state, Limits())[0]
    assert decision.waiting_for == f"{free:.1f} GB RAM free, job needs {between:g} GB"
    over = plan(jobs("a", gpus=0, ram_gb=state.ram_total_gb + 0.5), [], state, Limits())[0]
    assert over.unsatisfiable and not over.start
    kept = plan(jobs("a", gpus=0, ram_gb=0.2), [], state, Limits(min_free_ram_gb=free - 0.1))[0]
    assert kept.waiting_for.endswith(f"job needs 0.2 GB + min_free_ram_gb {free - 0.1:g}")


def test_declared_but_unused_ram_is_not_double_booked(machine: Callable) -> None:
    state = machine()
    free = state.ram_available_gb
    running = [Holding("r", ram_gb=4.0, rss_gb=1.0)]  # 3 GB still to come
    limits = Limits(max_concurrent=9)
    fits = plan(jobs("a", gpus=0, ram_gb=free - 3.5), running, state, limits)[0]
    too_much = plan(jobs("a", gpus=0, ram_gb=free - 2.5), running, state, limits)[0]
    assert fits.start and not too_much.start
    assert "(after 3.0 GB promised to running jobs)" in too_much.waiting_for
    over_used = [Holding("r", ram_gb=4.0, rss_gb=6.0)]  # using more than declared: nothing more is promised
    assert plan(jobs("a", gpus=0, ram_gb=free - 0.5), over_used, state, limits)[0].start
    # two jobs in one plan: the first one's declaration counts against the second
    pair = plan(jobs("a", "b", gpus=0, ram_gb=free * 0.6), [], state, limits)
    assert [d.start for d in pair] == [True, False]


def test_disk_gate_counts_declared_disk_per_filesystem(machine: Callable, tmp_path: Path) -> None:
    state = machine()
    total, free = state.disks[str(tmp_path)]
    if free >= total - 1:
        pytest.skip("the test filesystem is empty: no room between free and total")
    limits = Limits(max_concurrent=9)
    between = plan([Request("a", gpus=0, disk_gb=free + 0.5, disk_path=tmp_path)], [], state, limits)[0]
    assert between.waiting_for == f"{free:.1f} GB disk free on {tmp_path}, job needs {free + 0.5:g} GB"
    # a running job on the same path promised most of the free space
    running = [Holding("r", disk_gb=free - 1, disk_used_gb=0.5, disk_path=tmp_path)]
    decision = plan([Request("a", gpus=0, disk_gb=2, disk_path=tmp_path)], running, state, limits)[0]
    assert not decision.start and "promised to running jobs" in decision.waiting_for
    assert plan([Request("a", gpus=0, disk_gb=1, disk_path=tmp_path)], running, state, limits)[0].start
    # two jobs in one plan, one in a subfolder of the same filesystem: the first one's disk counts
    sub = tmp_path / "job-b"
    state = ResourceProbe(env={}).sample([tmp_path, sub])
    pair = [
        Request("a", order=0, gpus=0, disk_gb=free * 0.6, disk_path=tmp_path),
        Request("b", order=1, gpus=0, disk_gb=free * 0.6, disk_path=sub),
    ]
    assert [d.start for d in plan(pair, [], state, limits)] == [True, False]


def test_disk_of_a_path_never_sampled_is_not_guessed(machine: Callable, tmp_path: Path) -> None:
    decision = plan([Request("a", gpus=0, disk_gb=1, disk_path=tmp_path / "elsewhere")], [], machine(), Limits())[0]
    assert decision.waiting_for == f"disk space of {tmp_path / 'elsewhere'} not measured yet"


def test_battery_gate(tmp_path: Path) -> None:
    battery = tmp_path / "battery.json"
    battery.write_text('{"percent": 62, "power_plugged": false}')
    probe = ResourceProbe(env={ENV_SIMULATE_BATTERY: str(battery)})
    state = probe.sample([])
    waiting = plan(jobs("a", gpus=0), [], state, Limits())[0]
    assert waiting.waiting_for == "on battery (62%); set resources.allow_battery: true to allow"
    assert plan(jobs("a", gpus=0, allow_battery=True), [], state, Limits())[0].start
    battery.write_text('{"percent": 62, "power_plugged": true}')
    assert plan(jobs("a", gpus=0), [], probe.sample([]), Limits())[0].start


def test_paused_and_max_concurrent_say_so(machine: Callable) -> None:
    state = machine()
    assert plan(jobs("a"), [], state, Limits(paused=True))[0].waiting_for == "paused (pause.flag)"
    decisions = plan(jobs("b", "c", gpus=0), [Holding("a")], state, Limits(max_concurrent=2))
    assert decisions[0].start
    assert decisions[1].waiting_for == "max_concurrent 2 reached (running: a, b)"


def test_a_plan_until_full_stops_deciding_once_every_slot_is_taken(machine: Callable) -> None:
    """Issue 38: a pass after a slot freed decides only until the slots are gone; a job that cannot use the free
    slot (it needs a GPU that is held) is still passed over for one behind it that can."""
    state = machine()
    decisions = plan(jobs("b", "c", "d", gpus=0), [Holding("a")], state, Limits(max_concurrent=2), until_full=True)
    assert [(d.job_id, d.start) for d in decisions] == [("b", True)]
    held = [Holding("a", gpus=(0,)), Holding("x", gpus=(1,))]
    requests = [Request("wants-gpu", order=0, gpus=1), Request("cpu", order=1, gpus=0), Request("late", order=2)]
    decisions = plan(requests, held, state, Limits(max_concurrent=3), until_full=True)
    assert [(d.job_id, d.start) for d in decisions] == [("wants-gpu", False), ("cpu", True)]
    pools = Limits(max_concurrent=2, pools={"default": 1, "eval": 1})
    eval_job = [Request("e", order=0, gpus=0, pool="eval"), Request("f", order=1, gpus=0, pool="eval")]
    decisions = plan(eval_job, [Holding("a")], state, pools, until_full=True)
    assert [(d.job_id, d.start) for d in decisions] == [("e", True)]
    decisions = plan(eval_job, [], state, pools, until_full=True)  # default's slot is free: f is decided (waits)
    assert [(d.job_id, d.start) for d in decisions] == [("e", True), ("f", False)]
    assert len(plan(jobs("b", "c", "d", gpus=0), [Holding("a")], state, Limits(max_concurrent=2))) == 3
    # a new job is decided whatever: its first decision is its check for "never", and says why it waits
    requests = [*jobs("b", "c", gpus=0), Request("huge", order=5, gpus=8)]
    decisions = plan(requests, [], state, Limits(max_concurrent=1), until_full=True, always=frozenset({"huge"}))
    assert [(d.job_id, d.start) for d in decisions] == [("b", True), ("huge", False)]
    assert "needs 8 GPUs" in (decisions[1].unsatisfiable or "")


def test_priority_first_then_acceptance_order(machine: Callable) -> None:
    requests = [
        Request("old", priority=0, order=1, gpus=1),
        Request("older", priority=0, order=0, gpus=1),
        Request("urgent", priority=5, order=9, gpus=1),
    ]
    decisions = plan(requests, [], machine(), Limits(max_concurrent=9))
    assert [d.job_id for d in decisions] == ["urgent", "older", "old"]
    assert started(decisions) == {"urgent": (0,), "older": (1,)}


def test_big_job_is_not_starved_by_small_ones(machine: Callable) -> None:
    state = machine()
    limits = Limits(max_concurrent=9)
    queue = [Request("big-1", order=0, gpus=2)] + [Request(f"small-{n}", order=n, gpus=1) for n in (1, 2, 3)]
    holdings = [Holding("a", gpus=(0,))]
    decisions = by_id(plan(queue, holdings, state, limits))
    assert not any(d.start for d in decisions.values()), "GPU 1 is reserved for big-1"
    assert decisions["big-1"].waiting_for == "needs 2 GPUs, 1 free: GPU 0 held by job a"
    assert decisions["small-1"].waiting_for == (
        "GPU 0 held by job a; GPU 1 reserved for earlier job big-1 (needs 2 GPUs)"
    )
    # a higher-priority big job says so
    urgent = by_id(plan([replace(queue[0], priority=1), queue[1]], holdings, state, limits))
    assert "GPU 1 reserved for higher-priority job big-1 (needs 2 GPUs)" in urgent["small-1"].waiting_for
    # as soon as a's GPU frees, big-1 starts on both; the small ones wait for it
    after = by_id(plan(queue, [], state, limits))
    assert started(list(after.values())) == {"big-1": (0, 1)}
    assert after["small-1"].waiting_for == "GPU 0 held by job big-1; GPU 1 held by job big-1"


def test_free_gpus_go_to_the_reservation_first(machine: Callable) -> None:
    state = machine(sim_gpu(0), sim_gpu(1), sim_gpu(2))
    limits = Limits(max_concurrent=9)
    queue = [Request("big-1", order=0, gpus=2)] + [Request(f"small-{n}", order=n, gpus=1) for n in (1, 2)]
    decisions = by_id(plan(queue, [Holding("a", gpus=(0,)), Holding("b", gpus=(1,))], state, limits))
    # big-1 reserves the free GPU 2 and then GPU 0, so nothing is left to backfill onto
    assert started(list(decisions.values())) == {}
    assert decisions["small-1"].waiting_for == (
        "GPU 0 held by job a; GPU 1 held by job b; GPU 2 reserved for earlier job big-1 (needs 2 GPUs)"
    )
    # when b frees GPU 1, big-1 starts on GPUs 1 and 2 at once
    assert started(plan(queue, [Holding("a", gpus=(0,))], state, limits)) == {"big-1": (1, 2)}


def test_small_jobs_backfill_outside_the_reservation(machine: Callable) -> None:
    # big-1 needs two 10 GB GPUs: it reserves GPUs 0 and 1; the 6 GB GPU 2 is outside its reservation
    state = machine(sim_gpu(0, 12288), sim_gpu(1, 12288), sim_gpu(2, 6144))
    limits = Limits(max_concurrent=9)
    queue = [Request("big-1", order=0, gpus=2, gpu_memory_gb=10)]
    queue += [Request(f"small-{n}", order=n, gpus=1) for n in (1, 2)]
    decisions = by_id(plan(queue, [Holding("a", gpus=(0,))], state, limits))
    assert started(list(decisions.values())) == {"small-1": (2,)}
    assert decisions["small-2"].waiting_for == (
        "GPU 0 held by job a; GPU 2 held by job small-1; GPU 1 reserved for earlier job big-1 (needs 2 GPUs)"
    )
    # the stream goes on while a runs: a small job ends, the next one takes GPU 2, never GPU 1
    holdings = [Holding("a", gpus=(0,)), Holding("small-1", gpus=(2,))]
    assert started(plan(queue[::2], holdings, state, limits)) == {}
    assert started(plan(queue[::2], holdings[:1], state, limits)) == {"small-2": (2,)}
    # a ends: big-1 starts on GPUs 0 and 1 although small-2 still runs
    assert started(plan(queue[:1], [Holding("small-2", gpus=(2,))], state, limits)) == {"big-1": (0, 1)}


def test_reservation_only_for_jobs_blocked_by_gpus_alone(machine: Callable) -> None:
    state = machine()
    big = Request("big-1", order=0, gpus=2, ram_gb=state.ram_available_gb + 0.01)
    queue = [big, Request("small", order=1, gpus=1)]
    decisions = by_id(plan(queue, [Holding("a", gpus=(0,))], state, Limits(max_concurrent=9)))
    assert decisions["small"].start and decisions["small"].gpus == (1,), "big-1 also waits for RAM: no reservation"


def test_reservation_prefers_free_gpus_over_foreign_held(machine: Callable, sleeper: subprocess.Popen) -> None:
    foreign = [{"pid": sleeper.pid, "used_mb": 2000}]
    state = machine(sim_gpu(0, processes=foreign), sim_gpu(1), sim_gpu(2))
    queue = [Request("big-1", order=0, gpus=2), Request("small", order=1, gpus=1)]
    decisions = by_id(plan(queue, [Holding("a", gpus=(1,))], state, Limits(max_concurrent=9)))
    # big-1 takes free GPU 2 and our GPU 1 (frees when a ends) rather than the foreign-held GPU 0
    assert not decisions["small"].start
    assert "GPUs 1, 2 reserved" not in decisions["small"].waiting_for  # GPU 1 is reported as held
    assert "GPU 2 reserved for earlier job big-1" in decisions["small"].waiting_for
    assert f"GPU 0 used by foreign process {sleeper.pid}" in decisions["small"].waiting_for


def test_gpu_memory_per_gpu(machine: Callable, sleeper: subprocess.Popen) -> None:
    # GPU 0 is 6 GB, GPU 1 is 12 GB with a small foreign user (200 MB is under 512 MB)
    state = machine(sim_gpu(0), sim_gpu(1, 12288, [{"pid": sleeper.pid, "used_mb": 200}]))
    assert started(plan(jobs("a", gpus=1, gpu_memory_gb=8), [], state, Limits())) == {"a": (1,)}
    tight = plan(jobs("a", gpus=1, gpu_memory_gb=11.9), [], state, Limits())[0]
    assert tight.waiting_for == (
        f"GPU 0 too small (6.0 GB, job needs 11.9 GB per GPU); "
        f"GPU 1 has 11.8 GB beside foreign process {sleeper.pid} (sleep, 200 MB), job needs 11.9 GB per GPU"
    )


def test_from_resources_reads_a_job_files_mapping(tmp_path: Path) -> None:
    resources = {"gpus": 2, "gpu_memory_gb": 5, "ram_gb": 4, "allow_battery": True}
    req = Request.from_resources("a", 3, 7, resources, tmp_path)
    assert req == Request("a", 3, 7, 2, 5, 4.0, 0.0, True, tmp_path)
    assert Request.from_resources("b", 0, 0, None) == Request("b")


RESOURCES_SCHEMA = {
    "type": "object",
    "required": ["ram", "disk", "gpus", "battery"],
    "additionalProperties": False,
    "properties": {
        "ram": {
            "type": "object",
            "required": ["total_gb", "available_gb"],
            "additionalProperties": False,
            "properties": {"total_gb": {"type": "number"}, "available_gb": {"type": "number"}},
        },
        "disk": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["total_gb", "free_gb"],
                "additionalProperties": False,
                "properties": {"total_gb": {"type": "number"}, "free_gb": {"type": "number"}},
            },
        },
        "gpus": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": [
                    "index",
                    "name",
                    "memory_total_mb",
                    "memory_used_mb",
                    "memory_free_mb",
                    "utilization_pct",
                    "temperature_c",
                    "compute_capability",
                    "held_by",
                    "foreign",
                    "simulated",
                ],
                "properties": {
                    "index": {"type": "integer"},
                    "name": {"type": "string"},
                    "memory_total_mb": {"type": "number"},
                    "memory_used_mb": {"type": "number"},
                    "memory_free_mb": {"type": "number"},
                    "utilization_pct": {"type": ["number", "null"]},
                    "temperature_c": {"type": ["number", "null"]},
                    "compute_capability": {"type": ["string", "null"]},
                    "held_by": {"type": ["string", "null"]},
                    "simulated": {"type": "boolean"},
                    "foreign": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["pid", "name", "used_mb"],
                            "additionalProperties": False,
                            "properties": {
                                "pid": {"type": "integer"},
                                "name": {"type": ["string", "null"]},
                                "used_mb": {"type": "number"},
                            },
                        },
                    },
                },
            },
        },
        "battery": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "required": ["percent", "power_plugged"],
                    "properties": {
                        "percent": {"type": ["number", "null"]},
                        "power_plugged": {"type": ["boolean", "null"]},
                    },
                },
            ]
        },
    },
}


def test_resources_dict_shape(machine: Callable, sleeper: subprocess.Popen, tmp_path: Path) -> None:
    state = machine(sim_gpu(0, processes=[{"pid": sleeper.pid, "used_mb": 900}]), sim_gpu(1))
    res = resources_dict(state, [Holding("llama-a", gpus=(1,))])
    jsonschema.validate(res, RESOURCES_SCHEMA)
    json.dumps(res)
    assert res["gpus"][0]["foreign"] == [{"pid": sleeper.pid, "name": "sleep", "used_mb": 900}]
    assert res["gpus"][0]["held_by"] is None and res["gpus"][1]["held_by"] == "llama-a"
    assert res["gpus"][1]["memory_free_mb"] == 6144 and res["gpus"][1]["simulated"] is True
    assert (set(res["disk"]) == {str(tmp_path)} and res["battery"] is None) or isinstance(res["battery"], dict)
    empty = resources_dict(ResourceProbe(env={}).sample([]), [])
    jsonschema.validate(empty, RESOURCES_SCHEMA)
    assert empty["gpus"] == [] and empty["disk"] == {}


def test_resources_dict_matches_the_status_schema_when_present(machine: Callable) -> None:
    schema_path = Path(__file__).resolve().parents[1] / "schemas" / "status.schema.json"
    if not schema_path.exists():
        pytest.skip("schemas/status.schema.json not written yet")
    schema = json.loads(schema_path.read_text())
    sub = schema.get("properties", {}).get("resources")
    if sub is None:
        pytest.skip("status schema has no resources property")
    res = resources_dict(machine(), [Holding("a", gpus=(0,))])
    jsonschema.validate(res, {**schema, **sub} if "$defs" in schema else sub)
