"""Sweeps stay linear and bounded (issue 23 item 4), at sizes small enough for a test: output bounds, never time."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml
from conftest import PY, REPO, drop, tick_until

from trainq.watcher.faces.bounds import MAX_PARAMS, MAX_TEXT_CHARS
from trainq.watcher.spec.jobspec import load_job_file
from trainq.watcher.spec.sweeps import MAX_SWEEP_BYTES, apply_params, expand
from trainq.watcher.spec.units import parse_iso


def test_placeholders_are_filled_in_one_pass_and_values_stay_literal():
    out = apply_params({"command": ["echo", "{a}-{b}", "{job_id}", "{nokey}"]}, {"a": "{b}", "b": 2})
    assert out["command"] == ["echo", "{b}-2", "{job_id}", "{nokey}"]  # a value's braces are not filled again


def test_thousands_of_one_value_keys_expand_to_one_exact_job(tmp_path: Path):
    keys = [f"k{i:04d}" for i in range(3000)]  # the finding had 9,000 (195 s); bench/bench_chain.py has no part here
    job = {"approved": True, "command": ["echo", *(f"{{{k}}}" for k in keys)], "sweep": {k: [k.upper()] for k in keys}}
    path = tmp_path / "many.yaml"
    path.write_text(json.dumps(job))
    spec = load_job_file(path, "inbox/many.yaml")
    [variant] = expand(spec.raw)
    assert variant.data["command"] == ["echo", *(k.upper() for k in keys)]


def test_a_sweep_that_would_write_too_much_is_rejected_before_anything_is_written(queue_dir, watcher):
    big = "x" * 20_000  # copied into each of 1000 jobs: about 20 MB, over the 16 MiB bound
    text = json.dumps({"approved": True, "command": ["echo", "{i}", big], "sweep": {"i": list(range(1000))}})
    w = watcher()
    drop(queue_dir, "amp.yaml", text)
    tick_until(w, lambda: (queue_dir / "failed" / "amp" / "run.json").exists(), what="the sweep rejected")
    run = json.loads((queue_dir / "failed" / "amp" / "run.json").read_text())
    assert run["status"] == "rejected"
    assert run["errors"][0]["path"] == "sweep" and "MAX_SWEEP_BYTES" in run["errors"][0]["message"]
    assert f"{MAX_SWEEP_BYTES // 2**20} MiB" in run["error"]
    assert os.listdir(queue_dir / "pending") == [] and not list((queue_dir / "done").iterdir())


def test_status_json_and_html_stay_small_whatever_the_params_hold(queue_dir, watcher):
    keys = [f"p{i:03d}" for i in range(200)]
    job = {
        "approved": True,
        "command": ["true", *(f"{{{k}}}" for k in keys)],
        "sweep": {**{k: ["v" * 3000] for k in keys}, "n": [1, 2, 3]},
    }
    job["command"].append("{n}")
    (queue_dir / "pause.flag").touch()  # the jobs stay pending: each is listed with its params
    w = watcher()
    drop(queue_dir, "wide.yaml", json.dumps(job))
    tick_until(w, lambda: (queue_dir / "pending" / "wide-3").exists(), what="the sweep expanded")
    w.write_status(w.report.last_write + 10, force=True)
    status = json.loads((queue_dir / "status.json").read_text())
    entries = [e for e in status["jobs"] if e.get("sweep") == "wide"]
    assert len(entries) == 3
    assert len(entries[0]["params"]) == MAX_PARAMS + 1 and "more parameter" in entries[0]["params"]["…"]
    assert all(len(v) <= MAX_TEXT_CHARS + 20 for v in entries[0]["params"].values())
    assert entries[0]["params"]["p000"].endswith("…[+2700 chars]")
    assert (queue_dir / "status.json").stat().st_size < 64_000  # unbounded: 3 x 600 KB of params
    assert (queue_dir / "status.html").stat().st_size < 256_000
    out = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "status"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 0 and "wide-1" in out.stdout, out.stdout + out.stderr


def test_a_sweep_written_over_several_passes_ends_whole_in_order_and_holds_its_dependents(queue_dir, watcher):
    """Issue 36 item 8b: the jobs of a big sweep are written a slice a pass (SWEEP_SLICE_S), so the loop stays
    live; whatever the slicing, every job is written once, in grid order, and `after: [sweep]` waits for all."""
    n = 150
    (queue_dir / "pause.flag").touch()
    w = watcher()
    drop(
        queue_dir,
        "big.yaml",
        json.dumps({"approved": True, "command": ["true", "{i}"], "sweep": {"i": list(range(n))}}),
    )
    tick_until(w, lambda: (queue_dir / "pending" / "big-1").exists(), what="the first slice")
    drop(queue_dir, "then.yaml", json.dumps({"approved": True, "command": ["true"], "after": ["big"]}))
    seen: list[int] = []

    def step() -> bool:
        written = [p for p in os.listdir(queue_dir / "pending") if p.startswith("big-")]
        assert not seen or len(written) >= seen[-1]
        seen.append(len(written))
        return len(written) == n and not any(p.startswith(".sweep-") for p in os.listdir(queue_dir / "pending"))

    tick_until(w, step, 60, "every job of the sweep written and its staging folder gone")
    runs = [json.loads((queue_dir / "pending" / f"big-{i}" / "run.json").read_text()) for i in range(1, n + 1)]
    assert [r["sweep"]["index"] for r in runs] == list(range(1, n + 1))
    assert all(r["sweep"]["of"] == n and r["sweep"]["params"] == {"i": i - 1} for i, r in enumerate(runs, 1))
    orders = [r["order"] for r in runs]
    assert orders == sorted(orders) and len(set(orders)) == n  # acceptance order follows the grid
    text = (queue_dir / "pending" / "big-7" / "job.yaml").read_text()
    assert "sweep" not in yaml.safe_load(text) and yaml.safe_load(text)["command"] == ["true", "6"]
    (queue_dir / "pause.flag").unlink()
    then = lambda: json.loads((queue_dir / "done" / "then" / "run.json").read_text())  # noqa: E731
    tick_until(w, lambda: (queue_dir / "done" / "then" / "run.json").exists(), 240, "the dependent to run")
    assert len(os.listdir(queue_dir / "done")) == n + 1  # the dependent ran only after all n
    last_member = max(
        parse_iso(r["finished_at"])
        for r in (json.loads((queue_dir / "done" / f"big-{i}" / "run.json").read_text()) for i in range(1, n + 1))
    )
    assert parse_iso(then()["started_at"]) >= last_member
    print(f"{n} jobs written over {len(set(seen))} passes")
