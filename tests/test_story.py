"""One story per job (docs/contract.md, why a job stopped): every way a job stops, told in the same words by every face.

Real jobs under a real watcher process are stopped every way there is (stop.flag, `trainq stop`,
`trainq stop --now`, their deadline, the window's final-checkpoint mark, the stall detector, their
timeout, rm -rf of the running folder, a schedule deviation) or fail by themselves (a real MemoryError);
then run.json, status.json, status.html, the `trainq serve` page, history.jsonl, events.jsonl and the
output of `trainq status`, `show`, `why`, `history` and `events` are read, and each must carry the
reason word and the story's words, and no face may say another reason's words.
"""

from __future__ import annotations

import html
import io
import json
import math
import os
import re
import shutil
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml
from conftest import FAKE, PY, drop, run_json, tick_until, wait_until

from trainq.watcher.cli.main import main as trainq_main
from trainq.watcher.spec.contract import REASON_PHRASES
from trainq.watcher.spec.units import iso_utc

SLOW = str(FAKE / "slow_steps.py")
#: a plain loop that writes step records and honours stop.flag: stopped by hand, at a wall or by the timeout
STEPS = [PY, SLOW, "100000", "0.05", "20"]
#: the words each way's story starts with (the status.json headline begins so), and its reason word
WAYS = {
    "flag": ("user", "stopped on request"),
    "cli": ("user", "stopped on request"),
    "now": ("user", "stopped on request"),
    "dl": ("deadline", "stopped at its deadline"),
    "stall": ("stalled", "stalled: "),
    "to": ("timeout", "timeout: "),
    "sched": ("watcher", "schedule: "),
    "oom": (None, "oom: "),
}
#: words that belong to one reason only: no face may say them of a job stopped for another
OWN_WORDS = {f"stopped {phrase}": reason for reason, phrase in REASON_PHRASES.items()} | {
    "stop.flag": "user",
    "stop_flag": "user",
}


def _job(root: Path, job_id: str, **fields) -> None:
    fields.setdefault("approved", True)
    fields.setdefault("stop_grace", "2s")
    drop(root, f"{job_id}.yaml", yaml.safe_dump(fields, sort_keys=False))


def _status(root: Path) -> dict:
    try:
        return json.loads((root / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _entry(root: Path, job_id: str) -> dict:
    return next((j for j in _status(root).get("jobs", []) if j["id"] == job_id), {})


def _trainq(root: Path, *args: str) -> str:
    """The output of one trainq command, run in this process (its code is the real one; no process to start)."""
    out = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "250"  # as wide as a wide terminal: rich cuts nothing
    try:
        with redirect_stdout(out), redirect_stderr(out):
            trainq_main(["--root", str(root), *args])
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return out.getvalue()


def _schedule_writer(tmp_path: Path) -> str:
    """A command job whose logged lr leaves its declared cosine schedule at step 7."""
    script = tmp_path / "sched.py"
    script.write_text(
        "import json, math, os, sys, time\n"
        "m = open(os.environ['TRAINQ_METRICS'], 'a', buffering=1)\n"
        "for s in range(1, 4000):\n"
        "    lr = 2e-4 * s / 10 if s < 10 else 2e-4 * 0.5 * (1 + math.cos(math.pi * (s - 10) / 990))\n"
        "    lr = lr * 3 if s >= 7 else lr\n"
        "    m.write(json.dumps({'type': 'step', 'step': s, 'lr': lr, 'loss': 1.0}) + '\\n')\n"
        "    time.sleep(0.05)\n"
        "    if os.path.exists(os.environ['TRAINQ_STOP_FLAG']): sys.exit(0)\n"
    )
    return str(script)


def _running(root: Path, *ids: str) -> None:
    wait_until(lambda: all((root / "running" / i / "metrics.jsonl").exists() for i in ids), 60, what=f"{ids} running")


def _ended(root: Path, job_id: str) -> dict:
    return wait_until(
        lambda: (e := _entry(root, job_id)).get("state") in ("done", "failed") and e,
        90,
        what=f"{job_id} ended and listed in status.json",
    )


def _events(root: Path, job_id: str) -> list[dict]:
    path = root / "failed" / job_id / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _history(root: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (root / "history.jsonl").read_text().splitlines())}


def _says_no_other_reason(text: str, reason: str | None, face: str) -> None:
    for words, owner in OWN_WORDS.items():
        assert owner == reason or words not in text, f"{face} says {words!r} of a job stopped for {reason}:\n{text}"


def _assert_every_face(root: Path, job_id: str, reason: str | None, words: str, serve_page: str | None) -> None:
    """run.json, status.json, status.html, the serve page, history, events, status, show, why: the same story."""
    entry = _ended(root, job_id)
    headline = entry["story"]["headline"]
    assert headline.startswith(words), (job_id, headline)
    assert entry.get("reason") == reason, (job_id, entry)
    run = run_json(root, job_id)
    assert run.get("reason") == reason and ("reason" in run) == (reason is not None), run
    assert _history(root)[job_id].get("reason") == reason
    finished = [e for e in _events(root, job_id) if e["event"] == "finished"]
    assert finished[-1].get("reason") == reason, finished
    stopping = [e for e in _events(root, job_id) if e["event"] == "stopping"]
    if reason is not None:
        assert stopping and {e.get("reason") for e in stopping} == {reason}, stopping
    else:
        assert not stopping, stopping
    rows = [f'<tr class="{state}" id="ended-{job_id}"' for state in ("done", "failed")]
    page = wait_until(  # status.html follows status.json within html_every_s
        lambda: (p := _status_html(root)) and any(r in p for r in rows) and p, 30, what=f"{job_id} in status.html"
    )
    faces = {
        "status.html": page,
        "trainq status --wide": _trainq(root, "status", "--wide", job_id),
        "trainq show": _trainq(root, "show", job_id),
        "trainq why": _trainq(root, "why", job_id),
    }
    if serve_page is not None:
        faces["the serve page"] = serve_page
    for face, text in faces.items():
        assert headline in " ".join(text.split()), f"{face} does not say {headline!r} of {job_id}:\n{text}"
    for face, text in {**faces, "trainq events": _trainq(root, "events", job_id)}.items():
        if face in ("status.html", "the serve page"):
            text = _card(text, job_id)
        _says_no_other_reason(text, reason, f"{face} ({job_id})")
    history_row = next(line for line in _trainq(root, "history").splitlines() if line.startswith(job_id + " "))
    assert (reason or "-") in history_row.split(), history_row
    events_text = _trainq(root, "events", job_id)
    if reason is not None:
        assert f"reason={reason}" in events_text and f"stopped {REASON_PHRASES[reason]}" in events_text


def _card(page: str, job_id: str) -> str:
    """The part of status.html about one job (its row in the finished table)."""
    start = page.find(f'id="ended-{job_id}"')
    assert start >= 0, f"status.html has no row for {job_id}"
    end = page.find("</tr>", start)
    return page[start:end]


def test_every_way_a_job_stops_is_told_the_same_by_every_face(queue_dir: Path, watcher_process, tmp_path) -> None:
    (queue_dir / "watcher.yaml").write_text(
        yaml.safe_dump({"settle_s": 0.1, "rescan_s": 0.2, "status_s": 0.1, "kill_after_s": 1, "max_concurrent": 12})
    )
    watcher_process()
    _job(queue_dir, "flag", command=STEPS, resume_args=[])
    _job(queue_dir, "cli", command=STEPS, resume_args=[])
    _job(queue_dir, "now", command=[PY, str(FAKE / "sleeps.py")], stop_grace="1h")
    _job(queue_dir, "dl", command=STEPS, resume_args=[], deadline="3s")
    _job(queue_dir, "stall", command=[PY, str(FAKE / "sleeps.py")], stall_after="3s", retries={"max": 0})
    _job(queue_dir, "to", command=STEPS, resume_args=[], timeout="3s")
    _job(queue_dir, "rm", command=[PY, str(FAKE / "sleeps.py")])
    _job(queue_dir, "oom", command=[PY, str(FAKE / "oom.py")], retries={"max": 0})
    plan = {"schedule": "cosine", "peak": 2e-4, "warmup_steps": 10, "total_steps": 1000}
    _job(queue_dir, "sched", command=[PY, _schedule_writer(tmp_path)], expected_lr=plan, abort_on_lr_deviation=True)
    wait_until(
        lambda: all((queue_dir / "running" / i / "output.log").exists() for i in ("flag", "cli", "now", "rm")),
        60,
        what="the jobs to stop by hand running",
    )
    (queue_dir / "running/flag/stop.flag").touch()
    assert "stop requested" in _trainq(queue_dir, "stop", "cli")
    wait_until(lambda: "ready" in (queue_dir / "running/now/output.log").read_text(), 30, what="now ready")
    _trainq(queue_dir, "stop", "--now", "now")
    wait_until(lambda: "ready" in (queue_dir / "running/rm/output.log").read_text(), 30, what="rm ready")
    shutil.rmtree(queue_dir / "running/rm")
    server = _serve(queue_dir)
    try:
        for job_id in WAYS:
            _ended(queue_dir, job_id)
        page = wait_until(  # the served page is status.html, which follows status.json within html_every_s
            lambda: (
                (p := html.unescape(server.get("/", {"Authorization": f"Bearer {_TOKEN}"})[2].decode()))
                and all(f'id="ended-{i}"' in p for i in WAYS)
                and p
            ),
            30,
            what="the serve page listing every job as ended",
        )
        for job_id, (reason, words) in WAYS.items():
            _assert_every_face(queue_dir, job_id, reason, words, page)
    finally:
        server.stop()
    _assert_removed(queue_dir, "rm")


def _assert_removed(root: Path, job_id: str) -> None:
    """rm -rf of a running job: run.json and events.jsonl went with the folder; the rest says ``removed``."""
    record = wait_until(lambda: _history(root).get(job_id), 30, what="the removed job's history row")
    assert record["reason"] == "removed", record
    words = f"stopped {REASON_PHRASES['removed']}"
    for face in ("why", "show"):
        text = _trainq(root, face, job_id)
        assert words in " ".join(text.split()), (face, text)
    history_row = next(line for line in _trainq(root, "history").splitlines() if line.startswith(job_id + " "))
    assert "removed" in history_row.split(), history_row
    assert not _entry(root, job_id), "a removed job stays listed in status.json"


def test_the_window_mark_is_its_own_reason(queue_dir: Path, watcher_process) -> None:
    settings = {"settle_s": 0.1, "rescan_s": 0.2, "status_s": 0.1, "kill_after_s": 1}
    (queue_dir / "watcher.yaml").write_text(yaml.safe_dump(settings))
    first = watcher_process()
    _job(queue_dir, "win", command=STEPS, resume_args=[])
    _running(queue_dir, "win")
    first.kill()  # the job runs on; the next watcher, whose window's final mark is in 2 s, adopts it
    before_s = 60.0
    window = {
        "ends_at": iso_utc(time.time() + 2 + before_s),
        "final_checkpoint_before": f"{before_s}s",
        "freeze_before": f"{before_s}s",
    }
    (queue_dir / "watcher.yaml").write_text(yaml.safe_dump({**settings, "window": window}))
    watcher_process()
    _assert_every_face(queue_dir, "win", "window", "stopped at the window's final-checkpoint mark", None)
    assert "stop requested at the window's final-checkpoint mark" in (queue_dir / "failed/win/output.log").read_text()


_TOKEN = "story-test-token-0123456789"


def _serve(root: Path):
    pytest.importorskip("uvicorn", reason="trainq serve needs the serve extra (pip install -e '.[serve]')")
    from serve_util import Server

    token = root.parent / "serve.token"
    token.write_text(_TOKEN + "\n")
    return Server(root, "--token-file", str(token))


def test_the_stall_detector_says_stalled_while_it_stops_the_job(queue_dir: Path, watcher_process) -> None:
    """While the stall detector stops a job, the row says stalled (not stopping), and so do the log and events."""
    (queue_dir / "watcher.yaml").write_text(yaml.safe_dump({"settle_s": 0.1, "rescan_s": 0.2, "status_s": 0.1}))
    watcher_process()
    _job(queue_dir, "zz", command=[PY, str(FAKE / "sleeps.py")], stall_after="2s", stop_grace="1h", retries={"max": 0})
    entry = wait_until(lambda: (e := _entry(queue_dir, "zz")).get("status") == "stopping" and e, 60, what="stopping")
    assert entry["reason"] == "stalled" and entry["story"]["headline"] == "stopping by the stall detector"
    row = _trainq(queue_dir, "status", "zz")
    assert " stalled " in row and "stopping by the stall detector" in row and "stop.flag" not in row, row
    said = "stop requested by the stall detector (stop.flag)"  # the supervisor's line, at its next look
    wait_until(lambda: said in (queue_dir / "running/zz/output.log").read_text(), 30, what="the supervisor's line")
    stopping = wait_until(
        lambda: [
            e
            for e in map(json.loads, (queue_dir / "running/zz/events.jsonl").read_text().splitlines())
            if e["event"] == "stopping"
        ],
        30,
        what="the stopping record",
    )
    assert [e["reason"] for e in stopping] == ["stalled"]
    _trainq(queue_dir, "stop", "--now", "zz")  # ends it now; the stall detector asked first, so it stays stalled
    ended = _ended(queue_dir, "zz")
    assert ended["reason"] == "stalled" and ended["diagnosis"]["kind"] == "stalled", ended


# -- notes end with their cause (issue 35, item 2) ---------------------------------------------------------------
def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    return str(path)


def test_a_health_note_clears_once_the_loss_leaves_the_plateau(queue_dir: Path, watcher, tmp_path: Path) -> None:
    """The trainer's plateau note (step 21: loss sat at ln V) is not shown at step 612 with the loss falling."""
    go = tmp_path / "go"
    script = _script(
        tmp_path,
        "plateau",
        "import json, os, sys, time\n"
        "m = open(os.environ['TRAINQ_METRICS'], 'a', buffering=1)\n"
        "w = lambda r: m.write(json.dumps(dict(r, time=time.time())) + '\\n')\n"
        "for s in range(1, 22):\n"
        "    w({'type': 'step', 'step': s, 'total_steps': 700, 'loss': 6.9})\n"
        "w({'type': 'event', 'event': 'plateau', 'step': 21, 'loss': 6.9, 'uniform_loss': 6.9078,\n"
        "   'message': 'step 21: loss 6.9000 has sat at ln V = 6.9078 (a uniform prediction) for 20 steps: '\n"
        "              'the run is not learning; lower lr or set max_grad_norm'})\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        "for s in range(22, 613):\n"
        "    w({'type': 'step', 'step': s, 'total_steps': 700, 'loss': 6.9 - 4.9 * (s - 21) / 591})\n"
        "time.sleep(3600)\n",
    )
    w = watcher()
    _job(queue_dir, "pl", command=[PY, script])
    entry = tick_until(
        w, lambda: (e := _entry(queue_dir, "pl")).get("story", {}).get("notes") and e, 30, what="the plateau note"
    )
    [note] = entry["story"]["notes"]
    assert note["kind"] == "health" and note["from_step"] == 21 and note["attempt"] == 1, note
    assert "not learning" in _trainq(queue_dir, "status", "pl")
    tick_until(w, lambda: "not learning" in _status_html(queue_dir), 30, what="status.html with the note")
    go.touch()
    entry = tick_until(
        w, lambda: (e := _entry(queue_dir, "pl")).get("progress", {}).get("step") == 612 and e, 30, what="step 612"
    )
    assert "notes" not in entry["story"], entry["story"]
    assert entry["progress"]["loss"] < 2.1
    tick_until(w, lambda: "612 / 700" in _status_html(queue_dir), 30, what="status.html at step 612")
    for face, text in (
        ("status", _trainq(queue_dir, "status", "pl")),
        ("status.html", _status_html(queue_dir)),
        ("show", _trainq(queue_dir, "show", "pl")),
        ("why", _trainq(queue_dir, "why", "pl")),
    ):
        assert "not learning" not in text, (face, text)
    _trainq(queue_dir, "stop", "--now", "pl")
    tick_until(w, lambda: _entry(queue_dir, "pl").get("state") == "failed", 30)


def _status_html(root: Path) -> str:
    return html.unescape((root / "status.html").read_text())


def test_a_running_retry_shows_its_attempt_and_the_previous_end_below(queue_dir: Path, watcher, tmp_path) -> None:
    """While attempt 2 runs, the row is attempt 2's, attempt 1's SIGKILL is one line below, and no face advises a
    flag a running (or pending) job cannot use."""
    script = _script(
        tmp_path,
        "second",
        "import os, signal, time\n"
        "if os.environ['TRAINQ_ATTEMPT'] == '1':\n"
        "    print('about to be killed', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "print('ready', flush=True)\n"
        "time.sleep(3600)\n",
    )
    w = watcher()
    _job(queue_dir, "again", command=[PY, script], retries={"max": 1, "backoff": "1s"})
    _job(queue_dir, "later", command=[PY, script], retries={"max": 1, "backoff": "1h"})
    entry = tick_until(
        w,
        lambda: (e := _entry(queue_dir, "again")).get("attempt") == 2 and e.get("state") == "running" and e,
        30,
        what="attempt 2 running",
    )
    assert entry["story"]["previous"].startswith("attempt 1 ended: killed: "), entry["story"]
    assert not entry["story"]["headline"].startswith("killed"), entry["story"]
    lines = _trainq(queue_dir, "status", "again").splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("again "))
    assert "attempt 2" in lines[row] and "killed" not in lines[row], lines
    assert lines[row + 1].strip().startswith("↳ attempt 1 ended: killed: "), lines
    later = tick_until(w, lambda: (e := _entry(queue_dir, "later")).get("state") == "pending" and e, 30)
    assert later["story"]["previous"].startswith("attempt 1 ended: killed: "), later
    for job_id in ("again", "later"):
        for face in ("show", "why"):
            text = _trainq(queue_dir, face, job_id)
            assert "attempt 1 ended: killed" in text, (face, text)
            for flag in ("retry.flag", "trainq retry"):
                assert flag not in text, (
                    f"trainq {face} {job_id} ({_entry(queue_dir, job_id)['state']}) says {flag}:\n{text}"
                )
    _trainq(queue_dir, "stop", "--now", "again")
    _trainq(queue_dir, "stop", "later")
    tick_until(w, lambda: _entry(queue_dir, "again").get("state") == "failed", 30)


def test_a_job_resumed_at_its_end_shows_n_of_n(queue_dir: Path, watcher, tmp_path: Path) -> None:
    """Killed after its last checkpoint, resumed: the Trainer's bar starts at 0/300 again, the job is done 300/300."""
    script = _script(
        tmp_path,
        "bar",
        "import json, os, signal, sys, time\n"
        "total = 300\n"
        "if os.environ.get('TRAINQ_RESUME_FROM'):\n"
        "    sys.stdout.write('  0%|          | 0/300 [00:00<?, ?it/s]\\r')\n"
        "    print(\"{'train_runtime': 0.01, 'train_samples_per_second': 0.0, 'epoch': 3.0}\", flush=True)\n"
        "    sys.exit(0)\n"
        "for n in range(0, total + 1, 50):\n"
        "    sys.stdout.write(f' {n * 100 // total:>2}%|#####     | {n}/{total} [00:0{n // 100}<00:01, 95.2it/s]\\r')\n"
        "    sys.stdout.flush()\n"
        "    time.sleep(0.05)\n"
        "ckpt = os.path.join(os.environ['TRAINQ_JOB_DIR'], 'checkpoint-300')\n"
        "os.makedirs(ckpt)\n"
        "open(os.path.join(ckpt, 'trainer_state.json'), 'w').write('{}')\n"
        "print(flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n",
    )
    w = watcher()
    _job(queue_dir, "nn", command=[PY, script], resume_args=[], retries={"max": 1, "backoff": "1s"})
    entry = tick_until(w, lambda: (e := _entry(queue_dir, "nn")).get("state") == "done" and e, 60, what="done")
    assert run_json(queue_dir, "nn")["attempts"][-1]["resumed_from"].endswith("checkpoint-300")
    assert (entry["progress"]["step"], entry["progress"]["total_steps"]) == (300, 300), entry["progress"]
    assert "300/300" in _trainq(queue_dir, "status", "nn")


def test_a_job_over_before_it_was_looked_at_shows_its_last_bar_even_after_a_long_log(
    queue_dir: Path, watcher, tmp_path: Path
) -> None:
    """A script that prints 200 KB and then its bar, and is gone at once: the finished entry still has 7/7 (the
    watcher reads the end of output.log once the job is over, not only while it runs)."""
    script = _script(
        tmp_path,
        "quick",
        "import sys\n"
        "for i in range(2000):\n"
        "    print('x' * 99)\n"
        "for n in range(8):\n"
        "    sys.stdout.write(f'{n * 100 // 7:>3}%|#####     | {n}/7 [00:00<00:00, 99.0it/s]\\r')\n"
        "print(flush=True)\n",
    )
    w = watcher()
    _job(queue_dir, "quick", command=[PY, script])
    entry = tick_until(w, lambda: (e := _entry(queue_dir, "quick")).get("state") == "done" and e, 60, what="done")
    assert entry["progress"] is not None, entry
    assert (entry["progress"]["step"], entry["progress"]["total_steps"]) == (7, 7), entry["progress"]


# -- the faces people look at (issue 35, item 6) -----------------------------------------------------------------
def _quick(root: Path, job_id: str, steps: int, **fields) -> None:
    _job(root, job_id, command=[PY, SLOW, str(steps), "0.01", "5"], resume_args=[], **fields)


def test_history_has_duration_losses_reason_and_a_glob(queue_dir: Path, watcher) -> None:
    w = watcher()
    _quick(queue_dir, "lr-a", 20)
    _quick(queue_dir, "lr-b", 20, name="second")
    _job(queue_dir, "other", command=[PY, str(FAKE / "sleeps.py")])
    tick_until(w, lambda: all(_entry(queue_dir, i).get("state") == "done" for i in ("lr-a", "lr-b")), 60)
    tick_until(w, lambda: _entry(queue_dir, "other").get("state") == "running", 30)
    _trainq(queue_dir, "stop", "--now", "other")
    tick_until(w, lambda: _entry(queue_dir, "other").get("state") == "failed", 30)
    table = _trainq(queue_dir, "history").splitlines()
    assert table[0].split() == ["ID", "STATUS", "REASON", "TOOK", "LOSS", "EVAL", "FINISHED", "ATT", "NAME"], table[0]
    rows = {line.split()[0]: line.split() for line in table[1:-1]}
    assert rows["lr-a"][2] == "-" and rows["lr-a"][4] == "0.05" and rows["lr-a"][3].endswith("s"), rows["lr-a"]
    assert rows["other"][:3] == ["other", "cancelled", "user"] and rows["other"][4] == "-", rows["other"]
    assert rows["lr-a"][6] == "UTC" or "UTC" in table[1], table[1]  # the end time says its zone
    records = {r["id"]: r for r in _history_records(queue_dir)}
    assert records["lr-a"]["final_loss"] == 0.05 and records["lr-a"]["duration_s"] > 0
    assert "reason" not in records["lr-a"] and records["other"]["reason"] == "user"
    only = _trainq(queue_dir, "history", "lr-*").splitlines()
    assert [line.split()[0] for line in only[1:-1]] == ["lr-a", "lr-b"], only
    assert [line.split()[0] for line in _trainq(queue_dir, "history", "sec*").splitlines()[1:-1]] == ["lr-b"]
    assert _trainq(queue_dir, "history", "nothing-*").startswith("no finished job matches")


def _history_records(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "history.jsonl").read_text().splitlines()]


def test_status_html_shows_final_loss_duration_zone_and_titles_by_id(queue_dir: Path, watcher) -> None:
    w = watcher()
    _quick(queue_dir, "fin", 20, name="a longer name")
    _job(queue_dir, "boom", command=[PY, str(FAKE / "oom.py")], retries={"max": 0})
    tick_until(w, lambda: all(_entry(queue_dir, i).get("state") in ("done", "failed") for i in ("fin", "boom")), 60)
    page = tick_until(w, lambda: (p := _status_html(queue_dir)) and 'id="ended-boom"' in p and p, 30)
    row = _card(page, "fin")
    assert '<td class="n">0.05</td>' in row, row  # final loss
    assert re.search(r'<td class="t">\d+(\.\d)?s</td>', row), row  # how long it took
    assert re.search(r">\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</time>", row), row  # times with their zone
    assert row.index(">fin <span") < row.index("a longer name")  # titled by id, the name beside it
    boom = _card(page, "boom")
    headline = _entry(queue_dir, "boom")["story"]["headline"]
    assert headline.startswith("oom: ") and boom.count("MemoryError") == 1, boom  # the evidence once


def test_status_html_does_not_overflow_420_px_and_links_the_serve_page(queue_dir: Path, watcher, browser) -> None:
    w = watcher(max_concurrent=4)
    long = "x" * 190
    _quick(queue_dir, "narrow-" + "n" * 40, 10, name=long)
    _job(queue_dir, "run", command=[PY, SLOW, "100000", "0.05", "20"], resume_args=[])
    _job(queue_dir, "bad", command=[PY, "-c", f"import sys; print('{long}'); sys.exit(3)"], retries={"max": 0})
    tick_until(w, lambda: _entry(queue_dir, "bad").get("state") == "failed", 60)
    tick_until(w, lambda: (_entry(queue_dir, "run").get("progress") or {}).get("step"), 60)
    server = _serve(queue_dir)
    try:
        url = tick_until(w, lambda: re.search(r'live page: <a href="([^"]+)"', _status_html(queue_dir)), 30)[1]
        assert url == f"http://127.0.0.1:{server.port}/" and _TOKEN not in _status_html(queue_dir)
        browser.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": 420, "height": 900, "deviceScaleFactor": 1, "mobile": True},
            session=True,
        )
        browser.call("Page.navigate", {"url": (queue_dir / "status.html").as_uri()}, session=True)
        wait_until(lambda: browser.evaluate("document.readyState") == "complete", 30, 0.05, "status.html loaded")
        width = browser.evaluate("document.documentElement.scrollWidth")
        assert width <= 420, f"status.html is {width} px wide in a 420 px window"
    finally:
        server.stop()
    tick_until(w, lambda: "live page:" not in _status_html(queue_dir), 30, what="the link gone with the server")
    _trainq(queue_dir, "stop", "--now", "run")
    tick_until(w, lambda: _entry(queue_dir, "run").get("state") == "failed", 30)


def test_a_sweep_draws_its_jobs_loss_curves_overlaid(queue_dir: Path) -> None:
    from trainq.watcher.faces.html import CurveStore, render_html

    store = CurveStore()
    jobs = []
    for i, rate in enumerate((30.0, 60.0, 90.0), start=1):
        store.feed(f"sw-{i}", ({"type": "step", "step": s, "loss": 3 * math.exp(-s / rate) + 1} for s in range(1, 80)))
        jobs.append({"id": f"sw-{i}", "state": "running", "status": "running", "sweep": "sw", "params": {"lr": i}})
    page = render_html({"watcher": {}, "counts": {}, "jobs": jobs}, store.curves())
    overlay = page[page.index('<section class="sweep-curves">') :]
    assert overlay.count('<polyline class="overlay"') == 3 and all(f">sw-{i}</span>" in overlay for i in (1, 2, 3))
    assert "Sweep sw: loss by step" in overlay


# -- the derivation itself, on run.json as old and new watchers wrote it ----------------------------------------
def test_the_story_of_a_run_json_without_reasons_and_with_them() -> None:
    from trainq.watcher.faces.story import derive, reason_for

    legacy = {"status": "cancelled", "attempts": [{"n": 1, "ended_at": "x", "stop_reason": "stop_flag"}]}
    assert derive("a", "failed", legacy).reason == "user"  # before the reason words: the mechanism says it
    by_slurm = {"status": "cancelled", "attempts": [{"n": 1, "stop_reason": "cancelled", "reason": None}]}
    assert derive("b", "failed", by_slurm).reason is None  # concluded with no word: no face invents one
    assert reason_for({"stop_requested_by": "stalled"}, {"stop_reason": "stop_flag", "reason": "stalled"}) == "stalled"
    assert reason_for({"stop_requested_by": "stalled"}, {"stop_reason": "timeout"}) == "timeout"  # it stopped first
    assert reason_for({}, {"stop_reason": "sigterm"}) is None  # preempted: nobody in trainq stopped it
    assert reason_for({"stop_requested_by": "schedule"}, {"stop_reason": "stop_flag"}) == "watcher"
    failed = {
        "status": "failed",
        "attempt": 1,
        "diagnosis": {
            "kind": "killed",
            "evidence": "x",
            "advice": "Check dmesg. Then touch retry.flag (trainq retry ID).",
        },
    }
    assert "retry.flag" in derive("c", "failed", failed).advice
    pending = dict(failed, status="pending", attempts=[{"n": 1, "ended_at": "x", "diagnosis": failed["diagnosis"]}])
    story = derive("c", "pending", pending)
    assert story.advice is None and story.diagnosis is None and story.previous == "attempt 1 ended: killed: x"
