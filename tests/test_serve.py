"""`trainq serve` as a real process on a loopback ephemeral port, read with a raw HTTP client (the browser
tests are in test_serve_browser.py): refusals, token, ids, read-only, and the streams of real jobs."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, drop, wait_until

pytest.importorskip("starlette", reason="trainq serve needs the serve extra (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="trainq serve needs the serve extra (pip install -e '.[serve]')")
from serve_util import Server, chatty_job

from trainq.watcher.faces.stream import clean

TOKEN = "0123456789abcdef0123"


@pytest.fixture
def serve(queue_dir: Path):
    """Start real `trainq serve` processes; teardown stops them."""
    made: list[Server] = []

    def _start(*args: str, root: Path | None = None, port: int = 0) -> Server:
        server = Server(root or queue_dir, *args, port=port)
        made.append(server)
        return server

    yield _start
    for server in made:
        server.stop()


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def test_a_non_loopback_bind_without_a_token_is_refused_before_binding(queue_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    cases = {
        ("--host", "0.0.0.0"): "--host 0.0.0.0 is not a loopback address",
        ("--host", "::"): "--host :: is not a loopback address",
        ("--host", "192.0.2.7"): "--host 192.0.2.7 is not a loopback address",
        ("--host", "example.com"): "--host example.com is not a loopback address",
        ("--host", "0.0.0.0", "--token", "short"): "--token: the token must be at least 16 characters",
        ("--host", "0.0.0.0", "--token-file", str(empty)): f"--token-file {empty}: the token must be at least",
        ("--host", "0.0.0.0", "--token-file", str(tmp_path / "missing")): "cannot read it",
    }
    procs = {
        args: subprocess.Popen(
            [sys.executable, "-m", "trainq.watcher", "--root", str(queue_dir), "serve", *args, "--port", "0"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in cases
    }
    for args, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and out == "", (args, out, err)
        assert err.startswith("trainq serve: ") and cases[args] in err and err.count("\n") == 1, (args, err)


def test_without_the_serve_extra_it_says_what_to_install(queue_dir: Path) -> None:
    hide = (
        "import sys; sys.modules['uvicorn'] = None; from trainq.watcher.cli.main import main; "
        f"sys.exit(main(['--root', {str(queue_dir)!r}, 'serve', '--port', '0']))"
    )
    done = subprocess.run([sys.executable, "-c", hide], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == "trainq serve: needs the serve extra (uvicorn is missing): pip install 'trainq[serve]'\n"


def test_with_a_token_every_request_must_carry_it(queue_dir: Path, tmp_path: Path, serve) -> None:
    (queue_dir / "status.json").write_text('{"schema_version": 1}\n')
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    server = serve("--token-file", str(token_file))
    for headers, path in (
        ({}, "/status"),
        ({"Authorization": "Bearer wrong-token-000000"}, "/status"),
        ({"Authorization": f"Basic {TOKEN}"}, "/status"),
        ({}, "/events"),
        ({}, "/jobs/a/log"),
        ({}, "/status?token=nope"),
    ):
        status, head, _ = server.get(path, headers, auth=False)
        assert status == 401 and head.get("www-authenticate") == "Bearer", (headers, path, status)
    assert server.token == TOKEN and not (queue_dir / ".trainq-serve.token").exists()
    assert server.get("/status", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    status, head, _ = server.get(f"/status?token={TOKEN}", auth=False)  # for EventSource, which cannot send headers
    assert status == 200 and head["set-cookie"].startswith(f"trainq-serve-{server.port}=")
    cookie = head["set-cookie"].split(";")[0]
    assert TOKEN not in cookie and "HttpOnly" in head["set-cookie"] and "SameSite=Strict" in head["set-cookie"]
    assert server.get("/status", {"Cookie": cookie}, auth=False)[0] == 200  # the page's later requests
    assert server.get("/status", {"Cookie": f"trainq-serve-{server.port}=forged"}, auth=False)[0] == 401
    events = server.stream("/events", {"Authorization": f"Bearer {TOKEN}"})
    assert events.status == 200 and events.next().kind == "snapshot"
    events.close()


#: another local user's client: /usr/bin/python3 and urllib, printing the HTTP status it got
PROBE = """import sys, urllib.error, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=60).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""


def test_the_default_loopback_server_answers_another_local_user_401(queue_dir: Path, serve) -> None:
    """Issue 36, item 3: before, uid 65534 read a running job's output.log through the default loopback server,
    while reading the 0700 folder directly gave "Permission denied"."""
    if not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"):
        pytest.skip("setpriv or /usr/bin/python3 is not installed here")
    job = queue_dir / "running" / "j"
    job.mkdir(parents=True)
    (job / "output.log").write_text("the owner's secret line\n")
    server = serve()
    base = f"http://127.0.0.1:{server.port}"

    def as_nobody(url: str) -> str:
        done = subprocess.run(
            ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/usr/bin/python3", "-c", PROBE, url],
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        )
        return done.stdout.strip() or done.stderr.strip()

    for path in ("/jobs/j/log", "/status", "/", "/events", "/jobs/j/log?token=guess-0123456789abcdef"):
        assert as_nobody(base + path) == "401", path
    token_file = queue_dir / ".trainq-serve.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and token_file.read_text().strip() == server.token
    log = server.stream("/jobs/j/log")  # the owner, with the token the printed URL carries
    assert log.status == 200 and log.next().data == "the owner's secret line"
    log.close()
    assert server.get("/jobs/j/log", auth=False)[0] == 401


def test_ids_are_checked_against_the_folders_and_nothing_changes_the_queue(
    queue_dir: Path, tmp_path: Path, serve
) -> None:
    job = queue_dir / "done" / "a"
    job.mkdir()
    (job / "output.log").write_bytes(b"hello\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "output.log").write_text("secret\n")
    os.symlink(outside, queue_dir / "done" / "linked")
    os.symlink(tmp_path / "outside" / "output.log", queue_dir / "done" / "a" / "metrics.jsonl")
    before = _tree(queue_dir)
    server = serve()
    assert server.get("/status")[0] == 503 and server.get("/")[0] == 503  # no watcher has written them yet
    for path in (
        "/jobs/../log",
        "/jobs/%2e%2e/log",
        "/jobs/..%2F..%2Foutside/log",
        "/jobs/a%2F..%2F..%2Foutside/log",
        "/jobs/linked/log",
        "/jobs/nope/log",
        "/jobs/inbox/log",
        "/jobs/a/../../outside/output.log",
        "/jobs/a/output.log",
        "/jobs/" + "x" * 65 + "/log",
    ):
        status, _, body = server.get(path)
        assert status == 404 and b"secret" not in body, (path, status, body)
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        for path in ("/status", "/jobs/a/log", "/events", "/"):
            assert server.get(path, method=method)[0] == 405, (method, path)
    assert server.get("/status", {"Host": "evil.example:80"})[0] == 400  # DNS rebinding of a loopback server
    assert server.get("/jobs/a/metrics")[0] == 204  # a symlinked metrics file is not followed: nothing to send
    log = server.stream("/jobs/a/log")
    assert next((e.kind, e.id, e.data) for e in log.until(lambda e: e.kind == "end")) == ("message", "6", "hello")
    assert server.get("/jobs/a/log", {"Last-Event-ID": "6"})[0] == 204
    after = _tree(queue_dir)
    after.pop(".trainq-serve.token")  # the files it writes, at start: its token (mode 0600),
    after.pop(".trainq-serve.json")  # and its URL (no token) and pid, so status.html links the page
    assert after == before
    token_file = queue_dir / ".trainq-serve.token"
    assert token_file.read_text() == server.token + "\n" and stat.S_IMODE(token_file.stat().st_mode) == 0o600


@pytest.mark.parametrize("observer", ["inotify", "polling"])
def test_an_idle_stream_keeps_alive_then_follows_the_folder_to_its_end(queue_dir: Path, serve, observer: str) -> None:
    """A folder made by hand stands in for the watcher here: the server reads only files."""
    job = queue_dir / "pending" / "p"
    job.mkdir()
    server = serve("--keepalive-s", "0.2", *(["--polling"] if observer == "polling" else []))
    stream = server.stream("/jobs/p/log")
    assert stream.status == 200 and stream.resp.getheader("content-type").startswith("text/event-stream")
    wait_until(lambda: stream.resp.readline() == b": keepalive\n", 30, 0, "two keepalive comments")
    os.rename(job, queue_dir / "running" / "p")
    with open(queue_dir / "running" / "p" / "output.log", "ab") as log:
        log.write(b"first\nsecond, still being wri")
        log.flush()
        got = stream.until(lambda e: e.data == "first")
        log.write(b"tten\n")
    assert [e.data for e in got] == ["first"]
    assert stream.next().data == "second, still being written"
    (queue_dir / "running" / "p" / "output.log").write_bytes(b"new\n")  # replaced by a shorter file: from its start
    assert (lambda e: (e.id, e.data))(stream.next()) == ("4", "new")
    os.rename(queue_dir / "running" / "p", queue_dir / "done" / "p")
    rest = stream.until(lambda e: e.kind == "end")
    assert [e.kind for e in rest] == ["end"] and json.loads(rest[-1].data) == {
        "id": "p",
        "state": "done",
        "status": "done",
    }
    assert stream.next() is None  # the server closed the stream
    assert server.get("/jobs/p/log", {"Last-Event-ID": "4"})[0] == 204


def _expected_lines(first_attempt: int, second_attempt: int) -> list[str]:
    return [f"line 1-{i} ünï" for i in range(1, first_attempt + 1)] + [
        f"line 2-{i} ünï" for i in range(1, second_attempt + 1)
    ]


def test_a_real_jobs_log_and_metrics_stream_live_and_resume_exactly_at_every_id(
    queue_dir: Path, watcher_process, serve
) -> None:
    watcher = watcher_process()
    server = serve()
    drop(
        queue_dir,
        "chat.yaml",
        chatty_job(
            "--lines",
            "24",
            "--fail-first-after",
            "4",
            "--gates",
            "12",
            "--metrics",
            retries={"max": 1, "on": ["unknown"], "backoff": "1s"},
        ),
    )
    wait_until(lambda: any((queue_dir / s / "chat").is_dir() for s in ("pending", "running")), 60, 0.02, "accepted")
    stream = server.stream("/jobs/chat/log")
    live = stream.until(lambda e: e.data == "line 2-12 ünï")
    gate = queue_dir / "running" / "chat" / "go-12"
    watcher.kill()  # the watcher may come and go: the job and its file go on
    watcher_process()
    gate.touch()
    events = live + stream.until(lambda e: e.kind == "end")
    assert stream.next() is None
    log = (queue_dir / "done" / "chat" / "output.log").read_bytes()

    assert [e.data for e in events if e.data.startswith("line ")] == _expected_lines(4, 24)
    assert [e.kind for e in events if e.data.startswith("line ")] == ["message"] * 28
    banners = [e.data for e in events if e.kind == "attempt"]
    assert [b.split(",")[1] for b in banners] == [" attempt 1", " attempt 2"]
    assert [e.data for e in events if e.kind == "progress"] == ["progress 0%", "progress 50%"] * 2
    assert json.loads(events[-1].data)["status"] == "done"
    ids = [int(e.id) for e in events[:-1]]
    assert ids == sorted(set(ids)) and ids[-1] == len(log)
    for start, end, event in zip([0, *ids], ids, events, strict=False):  # each id is the offset just past its line
        assert clean(log[start:end].rstrip(b"\r\n")).endswith(event.data) and log[start:end].endswith((b"\n", b"\r"))

    for i, event in enumerate(events[:-1]):  # reconnect after every event: exactly the rest, then the end
        rest = server.stream("/jobs/chat/log", {"Last-Event-ID": event.id}).until(lambda e: e.kind == "end")
        assert [(e.kind, e.id, e.data) for e in rest[:-1]] == [(e.kind, e.id, e.data) for e in events[i + 1 : -1]]
    assert server.get("/jobs/chat/log", {"Last-Event-ID": str(len(log))})[0] == 204

    metrics = server.stream("/jobs/chat/metrics").until(lambda e: e.kind == "end")
    records = [json.loads(e.data) for e in metrics[:-1]]
    assert [r["step"] for r in records] == list(range(1, 5)) + list(range(1, 25))
    assert records[-1]["loss"] == pytest.approx(10 / 24) and metrics[-1].kind == "end"
    middle = metrics[10].id
    rest = server.stream("/jobs/chat/metrics", {"Last-Event-ID": middle}).until(lambda e: e.kind == "end")
    assert [e.data for e in rest] == [e.data for e in metrics[11:]]
    assert server.get("/jobs/chat/metrics", {"Last-Event-ID": metrics[-2].id})[0] == 204


def test_events_report_each_state_change_and_resume(queue_dir: Path, watcher_process, serve) -> None:
    watcher_process()
    server = serve()
    wait_until(lambda: (queue_dir / "status.html").exists(), 60, 0.05, "status.html written")
    events = server.stream("/events")
    snapshot = events.next()
    assert snapshot.kind == "snapshot" and json.loads(snapshot.data)["jobs"] == {}
    drop(queue_dir, "e1.yaml", chatty_job("--lines", "1"))
    changes = [
        e
        for e in events.until(lambda e: e.kind == "job" and json.loads(e.data)["change"] == "finished")
        if e.kind == "job"
    ]
    assert [(json.loads(e.data)["change"], json.loads(e.data)["state"]) for e in changes] == [
        ("accepted", "pending"),
        ("started", "running"),
        ("finished", "done"),
    ]
    assert json.loads(changes[-1].data)["status"] == "done"
    heartbeat = events.until(lambda e: e.kind == "watcher")[-1]
    assert json.loads(heartbeat.data)["watcher"]["heartbeat_at"] and "counts" in json.loads(heartbeat.data)

    missed = server.stream("/events", {"Last-Event-ID": changes[0].id}).until(
        lambda e: e.kind == "job" and e.id == changes[-1].id
    )
    assert [e.data for e in missed] == [e.data for e in changes[1:]]
    fresh = server.stream("/events", {"Last-Event-ID": "1-1"}).next()  # another server's id: start from a snapshot
    assert fresh.kind == "snapshot" and json.loads(fresh.data)["jobs"] == {"e1": {"state": "done", "status": "done"}}

    status, head, body = server.get("/status")
    assert status == 200 and head["content-type"] == "application/json" and json.loads(body)["schema_version"] == 1
    status, head, page = server.get("/")
    assert status == 200 and head["content-type"].startswith("text/html")
    assert b'http-equiv="refresh"' not in page and b"new EventSource(url('/events'))" in page
    assert b'http-equiv="refresh"' in (queue_dir / "status.html").read_bytes()  # the file itself stays static


def test_the_job_feed_reports_every_state_a_job_passed_through(queue_dir: Path) -> None:
    """JobFeed on real folders, moved by hand (a job can pass through pending/ faster than a listing sees it)."""
    from trainq.watcher.cli.serve.feed import CLIENT_QUEUE, JobFeed

    feed = JobFeed(queue_dir)
    (queue_dir / "running" / "x").mkdir()

    def changes(arrivals) -> list[tuple[str, str | None, str | None]]:
        return [(d["change"], d["state"], d["status"]) for d in map(json.loads, feed.rescan(arrivals))]

    assert changes([("pending", "x"), ("running", "x")]) == [
        ("accepted", "pending", "pending"),
        ("started", "running", "running"),
    ]
    os.rename(queue_dir / "running" / "x", queue_dir / "failed" / "x")
    (queue_dir / "failed" / "x" / "run.json").write_text('{"status": "timeout"}')
    assert changes([("failed", "x")]) == [("finished", "failed", "timeout")]
    listener, first = feed.subscribe(None)
    assert [kind for kind, _, _ in first] == ["snapshot"]
    seen = feed.event_id(feed.seq)
    os.rename(queue_dir / "failed" / "x", queue_dir / "running" / "x")  # retried: through pending/, unseen
    assert changes([("pending", "x"), ("running", "x")]) == [
        ("requeued", "pending", "pending"),
        ("started", "running", "running"),
    ]
    os.rename(queue_dir / "running" / "x", queue_dir / "running" / ".x.removed")  # how `trainq rm` hides it first
    assert changes([("running", ".x.removed")]) == [("removed", None, None)]
    assert changes([]) == []
    got = [listener.queue.get_nowait() for _ in range(listener.queue.qsize())]
    assert [json.loads(data)["change"] for _, _, data in got] == ["requeued", "started", "removed"]
    assert [data for _, _, data in feed.subscribe(seen)[1]] == [data for _, _, data in got]  # what it missed
    assert [kind for kind, _, _ in feed.subscribe("other-boot-3")[1]] == ["snapshot"]
    for _ in range(CLIENT_QUEUE + 1):  # a listener that does not read is cut off, never a server growing without end
        feed.jobs.pop("y", None)
        (queue_dir / "pending" / "y").mkdir(exist_ok=True)
        feed.rescan([])
        if listener.overflowed:
            break
    assert listener.overflowed


def test_arrivals_handed_over_after_the_listing_saw_the_job_move_on_are_not_news(queue_dir: Path) -> None:
    """inotify's thread may hand an arrival over after a listing already saw the job further on. The suite caught
    it (test_events_report_each_state_change_and_resume, about 1 run in 7 on this VM, on older code too): /events
    said started, then "requeued" and started again for a job that ran once."""
    from trainq.watcher.cli.serve.feed import JobFeed

    feed = JobFeed(queue_dir)

    def changes(arrivals) -> list[tuple[str, str | None, str | None]]:
        return [(d["change"], d["state"], d.get("previous")) for d in map(json.loads, feed.rescan(arrivals))]

    (queue_dir / "running" / "fast").mkdir()  # claimed into pending/ and started before inotify's thread said so
    assert changes([]) == [("accepted", "pending", None), ("started", "running", "pending")]
    assert changes([("pending", "fast"), ("running", "fast")]) == [], "the late arrivals are not a requeue"
    os.rename(queue_dir / "running" / "fast", queue_dir / "done" / "fast")
    assert changes([]) == [("finished", "done", "running")]
    assert changes([("running", "fast"), ("done", "fast")]) == []
    os.rename(queue_dir / "done" / "fast", queue_dir / "failed" / "fast")  # (a state change a listing sees)
    assert changes([]) == [("finished", "failed", "done")]
    # a retry that ran and ended between two looks: back to pending/, through running/, ended again
    assert changes([("pending", "fast"), ("running", "fast"), ("failed", "fast")]) == [
        ("requeued", "pending", "failed"),
        ("started", "running", "pending"),
        ("finished", "failed", "running"),
    ]


def test_the_watcher_and_the_command_line_never_import_the_web_stack() -> None:
    code = (
        "import sys, trainq.watcher.daemon.daemon, trainq.watcher.cli.main; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'uvicorn', 'anyio')))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
