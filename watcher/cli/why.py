"""``trainq why ID``: where a job is and why, in words and numbers.

For a waiting job every gate is shown, holding or passing, with its numbers (not only the first
that holds, and not a list of machine attributes to decode: HTCondor's ``condor_q
-better-analyze`` prints requirement expressions and match counts; this says what to do).
For a finished job: how it ended, the diagnosis with its evidence and advice, and the hook.
Everything is read from the queue's files and a fresh sample of the machine; the watcher
need not be running (if it is not, that is the first thing said).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from trainq.watcher.daemon.admission import Holding, Limits, Request, gate_report
from trainq.watcher.faces.story import JobStory, load, removed
from trainq.watcher.spec.config import paused_pools
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import InvalidJobSpec
from trainq.watcher.spec.folders import JobState
from trainq.watcher.spec.fsutil import read_json
from trainq.watcher.spec.jobspec import JobSpec, load_job_file
from trainq.watcher.spec.tombstones import ended_status, read_tombstone, removal_words
from trainq.watcher.spec.units import iso_utc, parse_iso

_PASS, _HOLD = "ok  ", "HOLD"


@dataclass(frozen=True)
class Found:
    """A job as found on disk."""

    job_id: str
    state: str  # inbox (awaiting approval), pending, running, done, failed
    path: Path
    run: dict
    spec: JobSpec | None


def find(root: Path, job_id: str) -> Found | None:
    """The job with id ``job_id`` (or an inbox file of that stem), or None."""
    if not job_id or "/" in job_id or job_id.startswith("."):
        return None
    for state in JobState:
        path = root / state.value / job_id
        if (path / "job.yaml").exists() or (path / "run.json").exists():
            return Found(job_id, state.value, path, read_json(JobPaths(path).run) or {}, _spec(path / "job.yaml"))
    for suffix in (".yaml", ".yml", ".YAML", ".YML"):
        path = root / "inbox" / f"{job_id}{suffix}"
        if path.is_file():
            return Found(job_id, "inbox", path, {}, _spec(path))
    from trainq.watcher.cli.names import id_for_name

    named = id_for_name(root, job_id)  # AmbiguousName when several jobs carry it
    return find(root, named) if named and named != job_id else None


def _spec(path: Path) -> JobSpec | None:
    try:
        return load_job_file(path)
    except (InvalidJobSpec, OSError):
        return None


def explain(root: Path, job_id: str, now: float | None = None, machine=None) -> list[str] | None:
    """The lines ``trainq why`` prints, or None for an unknown id; ``machine`` replaces a fresh sample (tests)."""
    now = time.time() if now is None else now
    found = find(root, job_id)
    if found is None:
        return None
    if found.state == "inbox":
        return _inbox(found)
    if found.state == "pending":
        return _pending(root, found, now, machine)
    if found.state == "running":
        return _running(root, found, now)
    return _finished(root, found, now)


def _story(root: Path, found: Found) -> JobStory:
    """The job's story (faces/story.py): status.json's where the watcher lists it, else from its folder."""
    status = read_json(root / "status.json") or {}
    entry = next((j for j in status.get("jobs") or () if j.get("id") == found.job_id), None)
    return load(found.path, found.state, found.run, entry)


def removed_lines(root: Path, job_id: str) -> list[str] | None:
    """``trainq why`` (and ``show``) of a job whose folder was removed: its tombstone's story, or None."""
    stone = read_tombstone(root, job_id)
    if stone is None:
        return None
    story = removed(job_id, stone)
    return [
        f"job {job_id}: {story.headline}",
        f"  it was {removal_words(stone)}; its run.json and events.jsonl went with the folder "
        "(trainq history keeps its line)",
    ]


# -- each state -----------------------------------------------------------------------------------
def _inbox(found: Found) -> list[str]:
    name = f"inbox/{found.path.name}"
    if found.spec is None:
        from trainq.watcher.spec.yaml12 import load_yaml12

        try:
            data = load_yaml12(found.path.read_text(encoding="utf-8"))
        except Exception:
            data = None
        if found.path.stat().st_size == 0 or (
            isinstance(data, dict) and "approved" in data and data["approved"] is not True
        ):
            return [
                f"job {found.job_id}: {name} is a draft (not approved) that does not validate yet; it stays in "
                "the inbox until it is fixed and approved",
                f"  see why: trainq validate {found.path}",
            ]
        return [
            f"job {found.job_id}: {name} is in the inbox and does not validate; the watcher will reject it",
            f"  see why: trainq validate {found.path}",
        ]
    if not found.spec.approved:
        return [
            f"job {found.job_id}: {name} waits for approval",
            f"  {found.spec.approval_hint or 'add approved: true to the file'}",
        ]
    return [f"job {found.job_id}: {name} is approved and waits for the watcher to take it (is one running?)"]


def _pending(root: Path, found: Found, now: float, machine) -> list[str]:
    run, spec = found.run, found.spec
    submitted = parse_iso(run.get("submitted_at"))
    head = f"job {found.job_id}: pending (pending/{found.job_id}), not started"
    if run.get("attempt"):
        head = f"job {found.job_id}: pending again after {run['attempt']} attempt(s)"
    lines = [head + (f", submitted {_ago(now - submitted)} ago" if submitted else "")]
    previous = _story(root, found).previous
    if previous:
        lines.append(f"  {previous}")
    if spec is None:
        return [*lines, "  its job.yaml no longer validates: the watcher will fail it"]
    rows = [_watcher_row(root, now), *_dependency_rows(root, spec), _backoff_row(run, spec, now)]
    rows += _admission_rows(root, found, spec, machine)
    holding = [r for r in rows if r[1] == _HOLD]
    lines.append(
        f"  {len(holding)} of {len(rows)} gates hold it:"
        if holding
        else f"  every gate passes ({len(rows)} checked): it starts on the watcher's next pass"
    )
    width = max(len(r[0]) for r in rows)
    lines += [f"  {flag} {gate:<{width}}  {words}" for gate, flag, words in sorted(rows, key=lambda r: r[1] != _HOLD)]
    ahead = None if any(r[0].startswith("after ") and r[1] == _HOLD for r in rows) else _ahead(root, found)
    if ahead:
        lines.append(f"  in line: {ahead}")
    said = run.get("waiting_for")
    if said:
        lines.append(f"  the watcher last wrote: {said}")
    return lines


def _running(root: Path, found: Found, now: float) -> list[str]:
    run = found.run
    attempt = (run.get("attempts") or [{}])[-1]
    started = parse_iso(attempt.get("started_at"))
    words = f"job {found.job_id}: {run.get('status', 'running')} (running/{found.job_id}), attempt {run.get('attempt')}"
    lines = [words + (f", started {_ago(now - started)} ago" if started else "")]
    status = read_json(root / "status.json") or {}
    entry: dict = next((j for j in status.get("jobs") or () if j.get("id") == found.job_id), {})
    if attempt.get("pid"):
        lines.append(
            f"  supervisor pid {attempt['pid']}, gpus {run.get('gpus') or 'none'}, health {entry.get('health')}"
        )
    progress = entry.get("progress") or {}
    if progress.get("step") is not None:
        total = f"/{progress['total_steps']}" if progress.get("total_steps") else ""
        eta = f", about {_ago(progress['eta_s'])} left" if progress.get("eta_s") is not None else ""
        lines.append(f"  step {progress['step']}{total}, loss {progress.get('loss')}{eta}")
    story = _story(root, found)
    if story.status == "stopping":
        lines.append(f"  {story.headline} since {run.get('stop_requested_at')}: waiting for it to checkpoint and exit")
    if story.previous:
        lines.append(f"  {story.previous}")
    lines += [f"  note: {note.words()}" for note in story.notes if note.kind == "health"]
    waiting = entry.get("waiting_for") if entry else run.get("waiting_for")  # status.json is the newer
    if waiting:
        lines.append(f"  {waiting}")
    if entry.get("forecast") or entry.get("deadline"):
        fits = {True: "fits", False: "does NOT fit", None: "no forecast yet"}[entry.get("fits")]
        lines.append(
            f"  deadline {entry.get('deadline') or 'none (the window)'}: {fits}"
            + (f"; {entry['forecast']}" if entry.get("forecast") else "")
        )
    lines += _vitals_lines(entry, run)
    return lines


def _vitals_lines(entry: dict, run: dict) -> list[str]:
    """The vital signs: clip fraction and update ratio (and whether past their thresholds), an lr deviation."""
    progress = entry.get("progress") or {}
    measured = []
    if progress.get("clip_fraction") is not None:
        measured.append(f"clip fraction {progress['clip_fraction']:.2f}")
    if progress.get("update_ratio") is not None:
        measured.append(f"update ratio {progress['update_ratio']:.3g}")
    lines = []
    if entry.get("vitals"):
        lines.append(f"  health: {entry['vitals']}")
    elif measured:
        lines.append(f"  health: ok ({', '.join(measured)})")
    deviation = run.get("lr_deviation")
    if deviation and not (entry.get("vitals") or "").endswith(deviation.get("words", "")):
        lines.append(f"  lr off its declared schedule: {deviation.get('words')}")
    return lines


def stack_lines(root: Path, job_id: str) -> list[str]:
    """``trainq why ID --stack``: record the running job's Python stacks now (bounded) and show the main thread."""
    from trainq.watcher.supervisor.leftovers import process_tree
    from trainq.watcher.supervisor.stacks import capture

    path = root / "running" / job_id
    if not path.is_dir():
        return [f"  --stack: {job_id} is not running; nothing to record"]
    pids = process_tree(JobPaths(path))
    if not pids:
        return ["  --stack: no live process found for the job"]
    summary = capture(path, pids, "trainq why --stack")
    lines = [f"  stacks of {len(pids)} process(es) recorded in {path.name}/{summary.get('file')}"]
    if summary.get("innermost"):
        lines.append("  main thread: " + " <- ".join(summary["innermost"]))
    lines += [f"  stack: {e}" for e in summary.get("errors") or ()]
    return lines


def _finished(root: Path, found: Found, now: float) -> list[str]:
    run = found.run
    story = _story(root, found)
    ended = parse_iso(run.get("finished_at"))
    lines = [
        f"job {found.job_id}: {story.status} ({found.state}/{found.job_id})"
        + (f", ended {_ago(now - ended)} ago" if ended else "")
        + f" after {run.get('attempt', 0)} attempt(s)"
    ]
    if story.headline and not run.get("errors"):
        lines.append(f"  {story.headline}")
    for problem in run.get("errors") or ():
        lines.append(f"  error: {problem.get('path') or 'file'}: {problem.get('message')}")
    diagnosis = story.diagnosis or {}
    if diagnosis:
        lines.append(f"  diagnosis: {diagnosis.get('kind')}")
        if story.evidence:
            lines.append(f"  evidence:  {story.evidence}")
        if story.advice:
            lines.append(f"  advice:    {story.advice}")
        if diagnosis.get("kind") == "dependency":
            lines.append("  see the dependency itself: trainq why " + _dep_named(story.evidence))
    from trainq.watcher.cli.again import rerun_line

    rerun = rerun_line(found.path.parent.parent, found.job_id, found.path, run, found.spec)
    if rerun:
        lines.append(rerun)
    delivered = run.get("delivered")
    if delivered:
        lines.append(
            f"  delivered to {delivered.get('to')} at {delivered.get('at')}: "
            + ("verified" if delivered.get("verified") else f"NOT verified ({delivered.get('error')})")
        )
    if run.get("cost"):
        lines.append(
            f"  cost: {run['cost'].get('amount'):.2f} {run['cost'].get('currency')}"
            f" ({run['cost'].get('gpu_hours')} GPU-hours)"
        )
    hook = read_json(JobPaths(found.path).hook_record)
    if hook:
        code = "killed at its time limit" if hook.get("timed_out") else f"exit code {hook.get('exit_code')}"
        lines.append(
            f"  on_finish: {hook.get('state')}"
            + (f", {code}" if hook.get("state") == "ended" else "")
            + " (output in hook.log)"
        )
    return lines


def _dep_named(evidence: str) -> str:
    words = evidence.split()
    return words[words.index("dependency") + 1] if "dependency" in words[:-1] else "DEPENDENCY"


# -- gates ------------------------------------------------------------------------------------
def _watcher_row(root: Path, now: float) -> tuple[str, str, str]:
    """Whether a watcher looks after the queue, judged as faces/liveness.py says (this machine's clock where it
    agrees with the heartbeat, else watching the heartbeat change for a few seconds)."""
    from trainq.watcher.faces.liveness import BY_CLOCK, check, dead_words, offset_words

    status = read_json(root / "status.json") or {}
    watcher = status.get("watcher") or {}
    beat = parse_iso(watcher.get("heartbeat_at"))
    if beat is None or watcher.get("state") in ("stopping", "stopped"):
        last = f"last heartbeat {_ago(now - beat)} ago" if beat else "no status.json"
        return ("watcher", _HOLD, f"no watcher is running on this queue ({last}); start one: trainq watch")
    _, live = check(root / "status.json", status)
    if not live.is_alive:
        return (
            "watcher",
            _HOLD,
            f"no watcher is running on this queue ({dead_words(live, _ago)}); start one: trainq watch",
        )
    where = f"pid {watcher.get('pid')} on {watcher.get('host')}"
    if live.how == BY_CLOCK:
        return ("watcher", _PASS, f"{where}, heartbeat {_ago(now - beat)} ago")
    offset = offset_words(live, _ago)
    return (
        "watcher",
        _PASS,
        f"{where}, heartbeat seen changing {_ago(live.changed_ago_s)} ago from this machine"
        + (f"; {offset}" if offset else ""),
    )


def _dependency_rows(root: Path, spec: JobSpec) -> list[tuple[str, str, str]]:
    if not spec.after:
        return [("dependencies", _PASS, "none (no after:)")]
    rows = []
    for dep in spec.after:
        ended, ok, words = _dependency(root, dep)
        if not ended:
            rows.append((f"after {dep}", _HOLD, words))
        elif ok or spec.after_policy == "any":
            rows.append((f"after {dep}", _PASS, words))
        else:
            rows.append((f"after {dep}", _HOLD, words + "; the watcher fails this job as soon as it looks"))
    return rows


def _dependency(root: Path, dep: str) -> tuple[bool, bool, str]:
    """(ended, ended done, words) for a job or sweep id, from the folders."""
    for state in JobState:
        path = root / state.value / dep
        if path.is_dir():
            run = read_json(JobPaths(path).run) or {}
            status = run.get("status") or state.value
            if state in (JobState.PENDING, JobState.RUNNING):
                return False, False, f"{dep} is {status} ({state.value}/{dep}); see trainq why {dep}"
            return True, state is JobState.DONE, f"{dep} ended {status}"
    stone = read_tombstone(root, dep)
    if stone is not None:  # its folder was removed (trainq rm, rm -rf): it counts as ended
        status = ended_status(stone)
        return True, status == "done", f"{dep} was {removal_words(stone)}: it counts as ended {status}"
    first = read_json(JobPaths(root / "pending" / f"{dep}-1").run) or read_tombstone(root, f"{dep}-1") or {}
    for state in JobState:
        first = read_json(JobPaths(root / state.value / f"{dep}-1").run) or first
    info = first.get("sweep") or {}
    if info.get("id") == dep and isinstance(info.get("of"), int):
        members = [_dependency(root, f"{dep}-{i}") for i in range(1, info["of"] + 1)]
        ended = sum(1 for m in members if m[0])
        failed = sum(1 for m in members if m[0] and not m[1])
        words = f"sweep {dep}: {ended} of {len(members)} jobs ended" + (f", {failed} not done" if failed else "")
        return ended == len(members), failed == 0, words
    return False, False, f"{dep}: no such job yet (it waits until a job or sweep with that id is submitted)"


def _backoff_row(run: dict, spec: JobSpec, now: float) -> tuple[str, str, str]:
    not_before = parse_iso(run.get("not_before"))
    if not_before is None or not_before <= now:
        words = "not a retry" if not run.get("attempt") else "backoff over"
        return ("backoff", _PASS, words)
    total = 1 + spec.retries.max
    return (
        "backoff",
        _HOLD,
        f"retry {run.get('attempt', 0) + 1} of {total} may start in "
        f"{_ago(not_before - now)} (at {iso_utc(not_before)}, backoff {spec.retries.backoff_s:g}s)",
    )


def _admission_rows(root: Path, found: Found, spec: JobSpec, machine=None) -> list[tuple[str, str, str]]:
    from trainq.watcher.daemon.resources import ResourceProbe
    from trainq.watcher.spec.config import load_watcher_config

    try:
        config = load_watcher_config(root, os.environ)
    except InvalidJobSpec as exc:
        return [("watcher.yaml", _HOLD, exc.lines()[0])]
    running = _running_holdings(root)
    if machine is None:
        probe = ResourceProbe(simulate_gpus=config.simulate_gpus, env=os.environ)
        try:
            machine = probe.sample([root.resolve()])
        finally:
            probe.close()
    res = spec.resources
    req = Request(
        found.job_id,
        spec.priority,
        int(found.run.get("order") or 0),
        res.gpus,
        res.gpu_memory_gb,
        res.ram_gb,
        res.disk_gb,
        res.allow_battery,
        root.resolve(),
        pool=spec.pool,
    )
    limits = Limits(
        config.max_concurrent,
        config.gpus,
        config.min_free_ram_gb,
        config.min_free_disk_gb,
        paused=(root / "pause.flag").exists(),
        pools=config.pool_limits() if config.pools else None,
        paused_pools=frozenset(paused_pools(root)),
    )
    gates = gate_report(req, running, machine, limits)
    wall = _window_row(config, found, spec)
    if gates["never"]:
        return [("machine", _HOLD, f"this machine can never run it: {gates['never']}")]
    ok = _ok_words(req, running, machine, limits)
    return [
        (gate, _HOLD if gates[key] else _PASS, gates[key] or ok[key])
        for gate, key in (
            ("pause", "pause"),
            ("pool", "pool"),
            ("max_concurrent", "max_concurrent"),
            ("RAM", "ram"),
            ("disk", "disk"),
            ("battery", "battery"),
            ("GPUs", "gpus"),
        )
    ] + wall


def _window_row(config, found: Found, spec: JobSpec) -> list[tuple[str, str, str]]:
    """The window's freeze as a gate (watcher.yaml ``window:``), with the estimate it judged by."""
    from trainq.watcher.spec.wall import freeze_hold, minutes

    window = config.window
    if window is None:
        return []
    remaining = (found.run.get("forecast") or {}).get("remaining_s")
    estimate, source = (
        (spec.expected_duration_s, "expected_duration")
        if spec.expected_duration_s
        else (float(remaining), "its last attempt's forecast")
        if isinstance(remaining, (int, float))
        else (None, "")
    )
    now = time.time()
    hold = freeze_hold(window, now, estimate, source)
    if hold:
        return [("window", _HOLD, hold)]
    if window.is_frozen(now):
        return [
            (
                "window",
                _PASS,
                f"inside the freeze, but {source} {minutes(estimate or 0)} ends before the final checkpoint",
            )
        ]
    return [
        (
            "window",
            _PASS,
            f"freezes at {iso_utc(window.freeze_at)}, final checkpoint at {iso_utc(window.final_checkpoint_at)}",
        )
    ]


def _ok_words(req: Request, running: list[Holding], machine, limits: Limits) -> dict[str, str]:
    disk = machine.disks.get(str(req.disk_path))
    battery = machine.battery
    on_battery = bool(battery and battery.get("power_plugged") is False)
    return {
        "pause": "no pause.flag",
        "pool": f"pool {req.pool} not paused",
        "max_concurrent": (
            f"{len(running)} running of max_concurrent {limits.max_concurrent}"
            if limits.pools is None
            else f"{sum(h.pool == req.pool for h in running)} running of pool {req.pool}'s "
            f"max_concurrent {limits.pool_limit(req.pool)}"
        ),
        "ram": f"{machine.ram_available_gb:.1f} GB RAM free, job needs {req.ram_gb:g} GB",
        "disk": (f"{disk[1]:.1f} GB free on {req.disk_path}, job needs {req.disk_gb:g} GB" if disk else "not checked"),
        "battery": (
            "on battery, and resources.allow_battery is true"
            if on_battery
            else "on mains power"
            if battery
            else "no battery"
        ),
        "gpus": (
            f"needs {req.gpus} GPU(s); enough are free"
            if req.gpus
            else "needs no GPU"
            if req.gpus == 0 or not machine.gpus
            else "needs 1 GPU (the default); one is free"
        ),
    }


def _running_holdings(root: Path) -> list[Holding]:
    holdings = []
    try:
        entries = sorted(e.name for e in os.scandir(root / "running") if not e.name.startswith("."))
    except FileNotFoundError:
        return []
    for job_id in entries:
        path = root / "running" / job_id
        spec = _spec(path / "job.yaml")
        run = read_json(JobPaths(path).run) or {}
        res = spec.resources if spec else None
        holdings.append(
            Holding(
                job_id,
                tuple(run.get("gpus") or ()),
                res.ram_gb if res else 0.0,
                res.disk_gb if res else 0.0,
                disk_path=root.resolve(),
                pool=spec.pool if spec else "default",
            )
        )
    return holdings


def _ahead(root: Path, found: Found) -> str | None:
    """How many pending jobs start before this one (priority, then acceptance order)."""
    status = read_json(root / "status.json") or {}
    counts = status.get("counts") or {}
    pending = [j for j in status.get("jobs") or () if j.get("state") == "pending"]
    ids = [j.get("id") for j in pending]
    if found.job_id not in ids:
        return f"{counts.get('pending', '?')} job(s) pending in all" if counts.get("pending") else None
    i = ids.index(found.job_id)
    return f"{_ordinal(i + 1)} of {counts.get('pending', len(ids))} pending in start order" + (
        f" (before it: {', '.join(ids[: min(i, 5)])}{' ...' if i > 5 else ''})" if i else ""
    )


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _ago(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m {int(seconds % 60)}s"
    return f"{int(seconds // 3600)}h {int(seconds % 3600 // 60)}m"
