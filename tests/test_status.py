"""status.json: schema, old samples, atomic writes under a concurrent reader, cadence, bounds."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from trainq.watcher.faces.status import (
    MAX_AWAITING,
    MAX_PENDING,
    StatusSnapshot,
    StatusWriter,
    job_entry,
    load_status,
    select_jobs,
)
from trainq.watcher.spec.units import iso_utc

REPO = Path(__file__).resolve().parent.parent
SCHEMAS = REPO / "schemas"
DATA = Path(__file__).resolve().parent / "data"
T0 = 1_780_000_000.0


def _validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture
def status_validator() -> jsonschema.Draft202012Validator:
    return _validator("status.schema.json")


def _snapshot(jobs: list[dict] | None = None, heartbeat: float = T0, step: int = 10) -> StatusSnapshot:
    jobs = (
        jobs
        if jobs is not None
        else [
            job_entry(
                "a",
                "running",
                "running/a",
                name="a",
                attempt=1,
                pid=123,
                health="healthy",
                submitted_at=iso_utc(T0 - 60),
                started_at=iso_utc(T0 - 30),
                progress={
                    "step": step,
                    "total_steps": 100,
                    "epoch": 0.1,
                    "loss": 2.1,
                    "eval_loss": None,
                    "tokens_per_s": 900.0,
                    "eta_s": 42,
                },
                gpus=[0],
            ),
            job_entry("b", "pending", "pending/b", waiting_for="2.1 GB RAM free, job needs 5 GB"),
        ]
    )
    counts = {"inbox": 0, "awaiting_approval": 0, "pending": 1, "running": 1, "done": 0, "failed": 0}
    watcher = {
        "pid": 1,
        "host": "h",
        "version": "0.1.0",
        "state": "running",
        "started_at": iso_utc(T0 - 100),
        "heartbeat_at": iso_utc(heartbeat),
    }
    resources = {
        "ram": {"total_gb": 24.0, "available_gb": 20.0},
        "disk": {"/q": {"total_gb": 100.0, "free_gb": 50.0}},
        "gpus": [],
        "battery": None,
    }
    return StatusSnapshot(watcher, counts, tuple(jobs), resources)


def _walk_properties(schema: dict, where: str = "#"):
    """Yield (where, subschema) for every property definition in a schema."""
    for name, sub in (schema.get("properties") or {}).items():
        yield f"{where}/{name}", sub
        yield from _walk_properties(sub, f"{where}/{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from _walk_properties(schema[key], f"{where}/{key}")
    for name, sub in (schema.get("$defs") or {}).items():
        yield from _walk_properties(sub, f"#/$defs/{name}")


@pytest.mark.parametrize("name", ["status.schema.json", "run.schema.json"])
def test_every_property_has_title_and_description(name: str) -> None:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    missing = [w for w, sub in _walk_properties(schema) if not (sub.get("title") and sub.get("description"))]
    assert missing == []


def test_old_status_sample_validates_and_loads(status_validator) -> None:
    data = json.loads((DATA / "status_v1.json").read_text())
    status_validator.validate(data)
    snapshot = StatusSnapshot.from_dict(data)
    assert snapshot.to_dict() == data
    assert snapshot.jobs[0]["progress"]["eta_s"] == 385


def test_old_run_sample_validates() -> None:
    validator = _validator("run.schema.json")
    data = json.loads((DATA / "run_v1.json").read_text())
    validator.validate(data)
    assert data["attempts"][1]["resumed_from"] == data["resume_from"]


@pytest.mark.parametrize(
    "breakage",
    [
        {"status": "finished"},
        {"attempt": -1},
        {"id": "has space"},
        {"executor": "k8s"},
        {"submitted_at": "yesterday"},
    ],
)
def test_run_schema_rejects_wrong_values(breakage: dict) -> None:
    data = {**json.loads((DATA / "run_v1.json").read_text()), **breakage}
    assert list(_validator("run.schema.json").iter_errors(data))


def test_status_schema_rejects_missing_job_key(status_validator) -> None:
    data = json.loads((DATA / "status_v1.json").read_text())
    del data["jobs"][0]["waiting_for"]
    assert list(status_validator.iter_errors(data))


def test_from_dict_refuses_newer_version() -> None:
    with pytest.raises(ValueError, match="schema_version 2"):
        StatusSnapshot.from_dict({"schema_version": 2, "watcher": {}, "counts": {}, "jobs": []})


def test_written_file_is_valid_and_loads(tmp_path: Path, status_validator) -> None:
    writer = StatusWriter(tmp_path / "status.json", tmp_path / "status.html")
    writer.force_write(_snapshot(), T0)
    data = json.loads((tmp_path / "status.json").read_text())
    status_validator.validate(data)
    assert load_status(tmp_path / "status.json") == _snapshot()
    assert "<progress" in (tmp_path / "status.html").read_text()


def test_non_finite_loss_is_written_as_null(tmp_path: Path, status_validator) -> None:
    snapshot = _snapshot()
    snapshot.jobs[0]["progress"]["loss"] = float("nan")
    StatusWriter(tmp_path / "status.json", None).force_write(snapshot, T0)
    text = (tmp_path / "status.json").read_text()
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    status_validator.validate(data)
    assert data["jobs"][0]["progress"]["loss"] is None


def test_no_write_when_only_heartbeat_changes_then_heartbeat_after_5s(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    writer = StatusWriter(path, None, status_s=1.0, heartbeat_s=5.0)
    assert writer.maybe_write(_snapshot(heartbeat=T0), T0)
    calls = [T0 + dt for dt in (0.1, 0.9, 1.0, 2.5, 4.99)]
    assert [writer.maybe_write(_snapshot(heartbeat=now), now) for now in calls] == [False] * len(calls)
    assert json.loads(path.read_text())["watcher"]["heartbeat_at"] == iso_utc(T0)
    assert writer.maybe_write(_snapshot(heartbeat=T0 + 5.0), T0 + 5.0)
    assert json.loads(path.read_text())["watcher"]["heartbeat_at"] == iso_utc(T0 + 5.0)


def test_change_is_written_once_status_s_has_passed(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    writer = StatusWriter(path, None, status_s=1.0, heartbeat_s=5.0)
    writer.maybe_write(_snapshot(step=10), T0)
    assert not writer.maybe_write(_snapshot(step=11), T0 + 0.5)
    assert writer.maybe_write(_snapshot(step=11), T0 + 1.0)
    assert json.loads(path.read_text())["jobs"][0]["progress"]["step"] == 11
    assert not writer.maybe_write(_snapshot(step=11), T0 + 2.5)


def test_change_made_in_place_is_noticed(tmp_path: Path) -> None:
    """The daemon may reuse its dicts: the writer must compare against its own copy."""
    path = tmp_path / "status.json"
    writer = StatusWriter(path, None, status_s=1.0)
    snapshot = _snapshot()
    writer.maybe_write(snapshot, T0)
    snapshot.jobs[0]["progress"]["step"] = 77
    assert writer.maybe_write(snapshot, T0 + 1.0)
    assert json.loads(path.read_text())["jobs"][0]["progress"]["step"] == 77


def test_html_follows_status_at_most_every_html_every_s(tmp_path: Path) -> None:
    html = tmp_path / "status.html"
    writer = StatusWriter(tmp_path / "status.json", html, status_s=0.0, html_every_s=2.0)
    writer.maybe_write(_snapshot(step=1), T0)
    first = html.read_text()
    writer.maybe_write(_snapshot(step=2), T0 + 1.0)
    assert html.read_text() == first
    writer.maybe_write(_snapshot(step=2), T0 + 2.0)  # nothing new in status.json, but the page owes step 2
    assert "2 / 100" in html.read_text()
    html.unlink()
    writer.maybe_write(_snapshot(step=2), T0 + 4.5)  # status.json unchanged: no page either
    assert not html.exists()


_READER = r"""
import json, sys, os
import jsonschema
path, stop, schema_path, count_path = sys.argv[1:5]
validator = jsonschema.Draft202012Validator(json.load(open(schema_path)))
reads = bad = 0
problems = []
print("ready", flush=True)
while not os.path.exists(stop):
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        continue
    reads += 1
    if reads % 10 == 0:
        with open(count_path, "w") as c:
            c.write(str(reads))
    try:
        validator.validate(json.loads(raw))
    except (ValueError, jsonschema.ValidationError) as e:
        bad += 1
        problems.append(str(e)[:200])
print(json.dumps({"reads": reads, "bad": bad, "problems": problems[:3]}))
"""


def test_concurrent_reader_never_sees_partial_or_invalid_file(tmp_path: Path) -> None:
    path, stop = tmp_path / "status.json", tmp_path / "stop"
    writer = StatusWriter(path, None, status_s=0.0)
    writer.force_write(_snapshot(), T0)
    count = tmp_path / "reads"
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(path), str(stop), str(SCHEMAS / "status.schema.json"), str(count)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout.readline().strip() == "ready"
        many = [job_entry(f"p{i}", "pending", f"pending/p{i}", waiting_for="x" * (i % 97)) for i in range(60)]
        i, deadline = 0, time.monotonic() + 60
        # at least 500 writes, and on until the reader has read 50 times (a loaded machine reads slowly)
        while i < 500 or (_reads_so_far(count) < 50 and time.monotonic() < deadline):
            jobs = list(_snapshot(step=i).jobs) + many[: i % 60]
            assert writer.maybe_write(_snapshot(jobs, heartbeat=T0 + i, step=i), T0 + i * 0.01)
            i += 1
        stop.touch()
        out, _ = reader.communicate(timeout=30)
    finally:
        reader.kill()
        reader.wait()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bad"] == 0, result["problems"]
    assert result["reads"] >= 50


def _many_jobs() -> list[dict]:
    jobs = [job_entry(f"r{i}", "running", f"running/r{i}", progress=None) for i in range(3)]
    jobs += [
        job_entry(
            f"p{i:05d}",
            "pending",
            f"pending/p{i:05d}",
            priority=i % 7,
            name=f"pending job {i}",
            submitted_at=iso_utc(T0 + i),
            waiting_for="waiting for a free GPU (0 of 1 free)",
        )
        for i in range(10_000)
    ]
    jobs += [job_entry(f"w{i}", "awaiting_approval", f"inbox/w{i:04d}.yaml") for i in range(500)]
    jobs += [
        job_entry(
            f"d{i}",
            "done" if i % 2 else "failed",
            f"done/d{i}",
            status="done" if i % 2 else "failed",
            finished_at=iso_utc(T0 + i),
        )
        for i in range(5_000)
    ]
    return jobs


def test_ten_thousand_pending_jobs_stay_under_200_kb(tmp_path: Path, status_validator) -> None:
    path = tmp_path / "status.json"
    writer = StatusWriter(path, tmp_path / "status.html", keep_finished=50)
    writer.force_write(_snapshot(_many_jobs()), T0)
    size = path.stat().st_size
    assert size < 200 * 1024, size
    data = json.loads(path.read_text())
    status_validator.validate(data)
    by_state = {}
    for job in data["jobs"]:
        by_state.setdefault(job["state"], []).append(job)
    assert len(by_state["running"]) == 3
    assert len(by_state["pending"]) == MAX_PENDING and len(by_state["awaiting_approval"]) == MAX_AWAITING
    assert len(by_state["done"]) + len(by_state["failed"]) == 50
    assert {j["priority"] for j in by_state["pending"]} == {6}
    assert min(j["finished_at"] for j in by_state["done"] + by_state["failed"]) == iso_utc(T0 + 4950)


def test_select_jobs_orders_pending_next_to_start_first() -> None:
    jobs = [
        job_entry("late-high", "pending", "pending/late-high", priority=5, order=9),
        job_entry("early-low", "pending", "pending/early-low", priority=0, order=1),
        job_entry("early-high", "pending", "pending/early-high", priority=5, order=2),
        job_entry("run", "running", "running/run"),
    ]
    chosen = select_jobs(jobs, max_pending=2)
    assert [j["id"] for j in chosen] == ["run", "early-high", "late-high"]


def test_maybe_write_cost_for_100_jobs(tmp_path: Path) -> None:
    """The watcher may call every tick: an unchanged snapshot must cost microseconds, not a serialisation."""
    jobs = [job_entry(f"j{i}", "pending", f"pending/j{i}", waiting_for="a GPU") for i in range(100)]
    writer = StatusWriter(tmp_path / "status.json", None, status_s=1.0)
    writer.maybe_write(_snapshot(jobs), T0)
    snapshots = [_snapshot([dict(j) for j in jobs], heartbeat=T0 + 1 + i * 0.001) for i in range(200)]
    started = time.perf_counter()
    for i, snapshot in enumerate(snapshots):
        assert not writer.maybe_write(snapshot, T0 + 1 + i * 0.001)
    per_call_us = (time.perf_counter() - started) / len(snapshots) * 1e6
    assert per_call_us < 2000, per_call_us


def _reads_so_far(count: Path) -> int:
    try:
        return int(count.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0
