"""`trainq serve` in a real headless Chromium: EventSource on a running job (every line, in order, across a
dropped connection and restarts of both the server and the watcher), the live status page, and the token."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="trainq serve needs the serve extra (pip install -e '.[serve]')")
pytest.importorskip("uvicorn", reason="trainq serve needs the serve extra (pip install -e '.[serve]')")

from browser_util import Browser
from conftest import drop, wait_until
from serve_util import Server, chatty_job

TOKEN = "f00dfeedcafe0123456789"


@pytest.fixture
def serve(queue_dir: Path):
    made: list[Server] = []

    def _start(*args: str, port: int = 0) -> Server:
        made.append(Server(queue_dir, *args, port=port))
        return made[-1]

    yield _start
    for server in made:
        server.stop()


def _js(browser: Browser, expression: str) -> object:
    """The value of ``expression`` (JSON-encoded in the page, decoded here)."""
    value = browser.evaluate(f"JSON.stringify({expression})")
    return json.loads(value) if isinstance(value, str) else None


def _open_page(browser: Browser, url: str) -> None:
    browser.call("Page.navigate", {"url": url}, session=True)
    wait_until(lambda: browser.evaluate("document.readyState") == "complete", 30, 0.05, f"{url} loaded")


def _headers(event: dict) -> dict:
    return {
        k.lower(): v
        for k, v in (event["params"].get("headers") or event["params"].get("request", {}).get("headers") or {}).items()
    }


#: an EventSource on the job's log that keeps every event it gets in window.got
LISTEN = """(function(){window.got=[];window.opened=0;
window.es=new EventSource('/jobs/chat/log');es.onopen=function(){opened++;};
es.onmessage=function(e){got.push(['message',e.lastEventId,e.data]);};
['attempt','progress','end'].forEach(function(k){es.addEventListener(k,function(e){got.push([k,e.lastEventId,e.data]);});});
return true;})()"""


def test_eventsource_gets_every_line_in_order_across_a_drop_and_restarts(
    queue_dir: Path, tmp_path: Path, watcher_process, serve, browser: Browser
) -> None:
    watcher = watcher_process()
    token_file = tmp_path / "token"  # the same token after the restart: the browser's cookie stays good
    token_file.write_text(TOKEN + "\n")
    server = serve("--token-file", str(token_file))
    port = server.port
    _open_page(browser, f"http://127.0.0.1:{port}/status?token={TOKEN}")  # sets the cookie EventSource then sends
    drop(
        queue_dir,
        "chat.yaml",
        chatty_job(
            "--lines",
            "30",
            "--fail-first-after",
            "4",
            "--gates",
            "12",
            retries={"max": 1, "on": ["unknown"], "backoff": "1s"},
        ),
    )
    wait_until(lambda: any((queue_dir / s / "chat").is_dir() for s in ("pending", "running")), 60, 0.02, "accepted")
    assert browser.evaluate(LISTEN) is True
    wait_until(
        lambda: "line 2-12 ünï" in (_js(browser, "got.map(function(g){return g[2];})") or []),
        60,
        0.05,
        "attempt 2 at its gate, seen in the browser",
    )
    before_drop = _js(browser, "got")

    server.stop(signal.SIGKILL)  # the connection drops mid-run; the browser keeps reconnecting
    watcher.kill()
    wait_until(lambda: _js(browser, "es.readyState") == 0, 30, 0.05, "EventSource reconnecting")
    watcher_process()
    serve("--token-file", str(token_file), port=port)
    (queue_dir / "running" / "chat" / "go-12").touch()
    wait_until(lambda: _js(browser, "es.readyState") == 2, 90, 0.1, "the stream ended and the reconnect got 204")

    got = _js(browser, "got")
    assert got[: len(before_drop)] == before_drop and _js(browser, "opened") >= 2
    lines = [data for kind, _, data in got if kind == "message" and data.startswith("line ")]
    assert lines == [f"line 1-{i} ünï" for i in range(1, 5)] + [f"line 2-{i} ünï" for i in range(1, 31)]
    assert [data.split(",")[1] for kind, _, data in got if kind == "attempt"] == [" attempt 1", " attempt 2"]
    assert got[-1][0] == "end" and json.loads(got[-1][2])["status"] == "done"
    ids = [int(event_id) for kind, event_id, _ in got if kind != "end"]
    assert ids == sorted(set(ids)) and ids[-1] == (queue_dir / "done" / "chat" / "output.log").stat().st_size

    # what went over the wire: a reconnect that carried the last id seen before the drop, and a final 204
    browser.drain()
    sent = [
        e
        for e in browser.events
        if e.get("method") in ("Network.requestWillBeSent", "Network.requestWillBeSentExtraInfo")
    ]
    resumed = {_headers(e).get("last-event-id") for e in sent}
    assert before_drop[-1][1] in resumed, resumed
    statuses = [
        e["params"]["response"]["status"]
        for e in browser.events
        if e.get("method") == "Network.responseReceived" and "/jobs/chat/log" in e["params"]["response"]["url"]
    ]
    assert statuses[-1] == 204 and statuses.count(204) == 1, statuses


#: what the test reads from the live page in one evaluation
PAGE = """{marker: window.marker || null, refresh: !!document.querySelector('meta[http-equiv=refresh]'),
 live: !!window.trainqLive, progress: [...document.querySelectorAll('#job-live progress')].map(p => [p.value, p.max]),
 log: (document.querySelector('#job-live pre.live-log') || {}).textContent || '',
 points: (document.querySelector('#job-live polyline.loss') || {points: {numberOfItems: 0}}).points.numberOfItems,
 loss: [...document.querySelectorAll('#job-live dt')].filter(d => d.textContent === 'loss').map(d => d.nextSibling.textContent),
 card: !!document.querySelector('#job-live'), text: document.body.innerText, badge: (document.getElementById('live') || {}).textContent}"""


def _page_where(browser: Browser, pred, what: str) -> dict:
    seen: list = [None]

    def check():
        seen[0] = _js(browser, PAGE)
        return seen[0] if seen[0] and pred(seen[0]) else None

    try:
        return wait_until(check, 90, 0.1, what)
    except pytest.fail.Exception:
        pytest.fail(f"{what}; the page was: {json.dumps({k: v for k, v in (seen[0] or {}).items() if k != 'text'})}")


def _status_step(queue_dir: Path, job_id: str) -> int:
    try:
        status = json.loads((queue_dir / "status.json").read_text())
    except (OSError, ValueError):
        return 0
    entry = next((j for j in status.get("jobs", ()) if j.get("id") == job_id and j.get("state") == "running"), {})
    return (entry.get("progress") or {}).get("step") or 0


def test_the_served_status_page_follows_the_streams_instead_of_reloading(
    queue_dir: Path, watcher_process, serve, browser: Browser
) -> None:
    watcher_process()
    server = serve()
    drop(queue_dir, "live.yaml", chatty_job("--lines", "20", "--gates", "10,20", "--metrics"))
    wait_until(
        lambda: _status_step(queue_dir, "live") == 10 and 'id="job-live"' in (queue_dir / "status.html").read_text(),
        90,
        0.05,
        "the job at its first gate, in status.html",
    )
    _open_page(browser, server.url.replace("/?", "/status?"))  # the printed URL's token: a cookie from now on
    _open_page(browser, f"http://127.0.0.1:{server.port}/")
    browser.evaluate("window.marker = 'first load'")
    first = _page_where(
        browser,
        lambda p: "line 1-10 ünï" in p["log"] and p["badge"] == "\u25cf live",
        "the log tail under the card, the stream up",
    )
    assert not first["refresh"] and first["live"] and first["progress"] == [[10, 20]]

    (queue_dir / "running" / "live" / "go-10").touch()
    moved = _page_where(
        browser,
        lambda p: p["progress"] == [[20, 20]] and "line 1-20 ünï" in p["log"],
        "progress and log moved by the streams",
    )
    assert moved["marker"] == "first load"  # the same page: no reload, no navigation
    assert moved["loss"] == ["0.5"] and moved["points"] >= first["points"] + 10
    assert "line 1-8 ünï" not in moved["log"]  # a tail: the last lines only

    (queue_dir / "running" / "live" / "go-20").touch()
    done = _page_where(
        browser,
        lambda p: not p["card"] and "live" in p["text"].split("Recently finished")[-1],
        "the finished job moved to its table",
    )
    assert done["marker"] == "first load" and not done["refresh"]
    assert browser.console_problems() == []
    urls = browser.requested_urls()
    base = f"http://127.0.0.1:{server.port}"
    assert urls.count(f"{base}/") >= 2 and f"{base}/events" in urls  # the page, then fetches of its body
    assert f"{base}/jobs/live/metrics?from=end" in urls and f"{base}/jobs/live/log?tail=12" in urls
    assert all(url.startswith(base) for url in urls), urls


def test_a_request_without_the_token_is_refused(queue_dir: Path, serve, browser: Browser) -> None:
    (queue_dir / "status.json").write_text('{"schema_version": 1}\n')
    server = serve("--token", TOKEN)
    base = f"http://127.0.0.1:{server.port}"
    _open_page(browser, f"{base}/status")
    assert "missing or wrong token" in browser.evaluate("document.body.innerText")
    # one after another: the token in a query sets a cookie, which the later bare fetch then carries
    browser.evaluate(f"""(function(){{window.r={{}};
      fetch('/status').then(function(x){{r.bare=x.status;
        fetch('/status',{{headers:{{Authorization:'Bearer {TOKEN}'}}}}).then(function(x){{r.bearer=x.status;}});
        var a=new EventSource('/events');a.onerror=function(){{r.es_bare=a.readyState;a.close();
          var b=new EventSource('/events?token={TOKEN}');b.addEventListener('snapshot',function(){{
            r.es_token='snapshot';b.close();fetch('/status').then(function(x){{r.cookie=x.status;}});}});}};}});
    }})()""")
    wait_until(lambda: len(_js(browser, "r") or {}) == 5, 30, 0.05, "five answers")
    assert _js(browser, "r") == {"bare": 401, "bearer": 200, "es_bare": 2, "es_token": "snapshot", "cookie": 200}
