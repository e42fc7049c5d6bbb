"""Issue 25, item 6: liveness is judged without trusting the reader's clock to agree with the watcher's.

A real watcher runs under libfaketime, its clock ten minutes off this one (as a cluster's watcher is
from a login node that reads its queue over a shared filesystem). The real readers are asked: `trainq
status`, `trainq why`, `trainq pause` (the management commands' watcher check), the --follow view's
frames and status.html in a real Chromium. A live watcher must not be called dead, whichever way the
clock is off, and a dead one (frozen with SIGSTOP: its pid still exists; or SIGKILLed) must be.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PY, REPO, wait_until
from rich.console import Console

from trainq.watcher.faces.html import render_html
from trainq.watcher.faces.liveness import (
    ALIVE,
    BY_CLOCK,
    BY_WATCHING,
    CONFIRM_S,
    DEAD,
    STALE_HEARTBEAT_S,
    WATCHING,
    HeartbeatWatch,
    heartbeat_period,
    watch_for,
)
from trainq.watcher.faces.view import Filters, _view, render_status
from trainq.watcher.spec.units import iso_utc, parse_iso

FAKETIME = shutil.which("faketime")
needs_faketime = pytest.mark.skipif(FAKETIME is None, reason="faketime is not installed (apt-get install faketime)")
#: how far the watcher's clock is off this machine's (seconds; negative: the watcher's clock is behind)
SKEW_S = 600
#: each skew test runs with the watcher's clock ten minutes behind this one, then ten minutes ahead
both_ways = pytest.mark.parametrize("offset_s", [-SKEW_S, SKEW_S], ids=["watcher-behind", "watcher-ahead"])


def _faked_clock(offset_s: int) -> dict:
    """The environment that puts a process's clocks ``offset_s`` off this machine's: the library that
    `faketime` preloads (the wrapper itself would stand between the test and the watcher's pid)."""
    preload = subprocess.run(
        [FAKETIME, "-f", "+0", "sh", "-c", 'printf %s "$LD_PRELOAD"'], capture_output=True, text=True, check=True
    ).stdout
    assert "faketime" in preload, preload
    # monotonic is faked too (by the same offset): with it left real, libfaketime breaks watchdog's sleeps
    return {"LD_PRELOAD": preload, "FAKETIME": f"{offset_s:+d}s"}


def _start(queue_dir: Path, watcher_process, write_job, offset_s: int):
    """A watcher whose clock is ``offset_s`` off, holding one pending job (``held``, after a job that never comes)."""
    wp = watcher_process(env=_faked_clock(offset_s))
    wait_until(lambda: (queue_dir / "status.json").exists(), 20, what="status.json written")
    beat = parse_iso(json.loads((queue_dir / "status.json").read_text())["watcher"]["heartbeat_at"])
    assert abs((time.time() - beat) + offset_s) < STALE_HEARTBEAT_S, "libfaketime did not move the watcher's clock"
    write_job("held", after=["never"])
    wait_until(lambda: (queue_dir / "pending" / "held" / "run.json").exists(), 20, what="held is pending")
    return wp


def _readers(root: Path) -> dict[str, str]:
    """`trainq status`, `trainq why held` and `trainq pause`, run at once (each may watch the heartbeat a while)."""
    env = dict(os.environ, COLUMNS="250")  # rich's width off a terminal: no line is cut
    argvs = {"status": ["status"], "why": ["why", "held"], "pause": ["pause"]}
    procs = {
        name: subprocess.Popen(
            [PY, "-m", "trainq.watcher", "--root", str(root), *argv],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, argv in argvs.items()
    }
    out = {name: proc.communicate(timeout=120)[0] for name, proc in procs.items()}
    subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(root), "resume"], cwd=REPO, capture_output=True, check=True
    )
    return out


def _watcher_gate(why: str) -> str:
    return next(line for line in why.splitlines() if line.strip()[4:].strip().startswith("watcher"))


def _says_dead(out: dict[str, str]) -> None:
    assert "watcher not responding" in out["status"], out["status"]
    assert "HOLD" in _watcher_gate(out["why"]) and "no watcher is running" in out["why"], out["why"]
    assert "no watcher is running" in out["pause"], out["pause"]


@needs_faketime
@both_ways
def test_a_watcher_with_another_clock_is_alive_while_it_beats_and_dead_once_frozen(
    queue_dir, watcher_process, write_job, offset_s
):
    wp = _start(queue_dir, watcher_process, write_job, offset_s)
    side = "ahead of" if offset_s < 0 else "behind"

    out = _readers(queue_dir)
    assert "not responding" not in out["status"], out["status"]
    # measured, so within a second or so of the ten minutes: a new heartbeat is seen a poll after it is written
    assert re.search(rf"this machine's clock is (9m 5\ds|10m 0\ds) {side} the watcher's", out["status"]), out["status"]
    gate = _watcher_gate(out["why"])
    assert gate.strip().startswith("ok") and "seen changing" in gate, gate
    assert re.search(rf"(9m 5\ds|10m \ds) {side} the watcher's", gate), gate
    assert "no watcher is running" not in out["pause"], out["pause"]

    os.kill(wp.proc.pid, signal.SIGSTOP)  # hung: its pid is still there, only watching tells
    try:
        out = _readers(queue_dir)
    finally:
        os.kill(wp.proc.pid, signal.SIGCONT)
    _says_dead(out)
    assert re.search(r"heartbeat unchanged for \d+s watched from this machine", out["status"]), out["status"]
    assert "by this machine's clock" in out["status"], out["status"]


@needs_faketime
@both_ways
def test_status_left_by_a_killed_watcher_with_another_clock_says_not_responding(
    queue_dir, watcher_process, write_job, offset_s
):
    """Ahead, its last heartbeat is in this clock's future: compared, it looked fresh for ten minutes."""
    wp = _start(queue_dir, watcher_process, write_job, offset_s)
    wp.kill(signal.SIGKILL)
    out = _readers(queue_dir)
    _says_dead(out)
    assert f"pid {wp.proc.pid} is gone from this host" in out["status"], out["status"]


@needs_faketime
def test_follow_frames_time_the_heartbeat_from_here(queue_dir, watcher_process, write_job):
    """--follow's frames: never "not responding" while the watcher (10 min behind) beats; its offset named."""
    _start(queue_dir, watcher_process, write_job, -SKEW_S)
    status = queue_dir / "status.json"
    console = Console(width=250, height=60, record=True)
    frames: list[str] = []

    def frame() -> str:
        console.print(_view(json.loads(status.read_text()), status, console, False, Filters()))
        frames.append(console.export_text())
        return frames[-1]

    wait_until(lambda: "seen changing from here" in frame(), 20, 0.5, "a frame that saw the heartbeat change")
    assert re.search(r"this machine's clock is (9m 5\ds|10m 0\ds) ahead of the watcher's", frames[-1]), frames[-1]
    assert not [f for f in frames if "not responding" in f], frames
    assert "watching whether it changes" in frames[0] or "seen changing" in frames[0], frames[0]


# -- status.html in a real Chromium: the browser's clock is not the watcher's either ---------------------------

#: what the test reads from the page: the heartbeat's words and the banner (null while the page reloads)
PAGE_FACTS = """JSON.stringify({hb: (document.getElementById('hb') || {}).textContent,
  banner: document.getElementById('stale') && !document.getElementById('stale').hidden
    ? document.getElementById('stale').textContent : null, loaded: document.readyState === 'complete'})"""


def _page_alive_then_frozen(browser, wp, url: str) -> None:
    """Open ``url``: the page, which reloads itself (or is fed by `trainq serve`), must name the offset and
    never say "not responding" while the watcher beats; frozen, it must say so."""
    seen: list[dict] = []

    def facts() -> dict | None:
        value = browser.evaluate(PAGE_FACTS)
        got = json.loads(value) if isinstance(value, str) else None
        if got and got["loaded"] and got["hb"] is not None:
            seen.append(got)
            return got
        return None

    browser.call("Page.navigate", {"url": url}, session=True)
    wait_until(
        lambda: (f := facts()) and "ahead of the watcher's" in f["hb"] and not f["banner"],
        30,
        0.25,
        "the page saw the heartbeat change and named the offset",
    )
    assert not [f for f in seen if "watcher not responding" in (f["banner"] or "")], seen
    os.kill(wp.proc.pid, signal.SIGSTOP)
    try:
        wait_until(
            lambda: (f := facts()) and "watcher not responding" in (f["banner"] or ""),
            30,
            0.25,
            "the frozen watcher's page says it is not responding",
        )
    finally:
        os.kill(wp.proc.pid, signal.SIGCONT)
    assert "timed by this browser" in seen[-1]["banner"], seen[-1]
    assert browser.console_problems() == []


@needs_faketime
def test_status_html_in_chromium_watches_the_heartbeat_change(queue_dir, watcher_process, write_job, browser):
    wp = _start(queue_dir, watcher_process, write_job, -SKEW_S)
    _page_alive_then_frozen(browser, wp, (queue_dir / "status.html").as_uri())


@needs_faketime
def test_served_live_page_watches_the_heartbeat_change(queue_dir, watcher_process, write_job, browser):
    pytest.importorskip("starlette", reason="trainq serve needs the serve extra (pip install -e '.[serve]')")
    pytest.importorskip("uvicorn", reason="trainq serve needs the serve extra (pip install -e '.[serve]')")
    from serve_util import Server

    wp = _start(queue_dir, watcher_process, write_job, -SKEW_S)
    server = Server(queue_dir)  # this machine's clock: only the watcher's is off
    try:
        _page_alive_then_frozen(browser, wp, server.url)
    finally:
        server.stop()


# -- the rules, one reader's observations given by hand ------------------------------------------------------


def _watcher(beat: float, host: str = "elsewhere", state: str = "running") -> dict:
    return {"host": host, "pid": 1, "state": state, "heartbeat_at": iso_utc(beat)}


def test_a_clock_that_agrees_judges_at_once_as_before():
    now = 1_000_000.0
    assert HeartbeatWatch().observe(_watcher(now - 3), now, 50.0).verdict == ALIVE
    live = HeartbeatWatch().observe(_watcher(now - 3), now, 50.0)
    assert live.how == BY_CLOCK and live.clock_age_s == pytest.approx(3, abs=0.01)


def test_a_heartbeat_that_disagrees_is_watched_until_it_changes_or_stands_still():
    now, mono = 1_000_000.0, 50.0
    watch = HeartbeatWatch()
    beat = now - 600  # the watcher's clock ten minutes behind this one
    assert watch.observe(_watcher(beat), now, mono).verdict == WATCHING
    live = watch.observe(_watcher(beat + 5), now + 4, mono + 4)  # a new heartbeat: alive
    assert (live.verdict, live.how) == (ALIVE, BY_WATCHING) and live.offset_s == pytest.approx(599, abs=0.01)
    assert watch.observe(_watcher(beat + 5), now + 4 + STALE_HEARTBEAT_S, mono + 4 + STALE_HEARTBEAT_S).is_alive
    late = watch.observe(_watcher(beat + 5), now + 5 + STALE_HEARTBEAT_S, mono + 5 + STALE_HEARTBEAT_S)
    assert late.verdict == DEAD and late.unchanged_s > STALE_HEARTBEAT_S

    never = HeartbeatWatch()
    assert never.observe(_watcher(beat), now, mono).verdict == WATCHING
    assert never.observe(_watcher(beat), now + CONFIRM_S - 1, mono + CONFIRM_S - 1).verdict == WATCHING
    assert never.observe(_watcher(beat), now + CONFIRM_S, mono + CONFIRM_S).verdict == DEAD


def test_a_watcher_that_beats_every_30_s_is_given_three_beats_by_its_readers_and_its_page(queue_dir):
    """watcher.yaml heartbeat_s: 30: a 20 s old heartbeat is fresh (the fixed 15 s called it dead), watching
    waits 62 s (two beats and 2 s) before "not responding", and status.html carries the same bounds."""
    (queue_dir / "watcher.yaml").write_text("heartbeat_s: 30s\n")
    now, mono = 1_000_000.0, 50.0
    watch = watch_for(queue_dir / "status.json")
    assert (watch.stale_s, watch.confirm_s) == (90.0, 62.0)
    assert watch.observe(_watcher(now - 20), now, mono).verdict == ALIVE
    skewed = HeartbeatWatch(30.0)  # a heartbeat 10 minutes off this clock: watched
    assert skewed.observe(_watcher(now - 600), now, mono).verdict == WATCHING
    assert skewed.observe(_watcher(now - 600), now + 61, mono + 61).verdict == WATCHING
    assert skewed.observe(_watcher(now - 600), now + 62, mono + 62).verdict == DEAD
    assert heartbeat_period(queue_dir.parent) == 5.0  # no watcher.yaml there: the default
    (queue_dir / "watcher.yaml").write_text("heartbeat_s: [not, a, duration]\n")
    assert heartbeat_period(queue_dir) == 5.0
    data = json.loads((Path(__file__).parent / "data" / "status_v1.json").read_text())
    page = render_html(data, {}, heartbeat_s=30.0)
    assert 'data-stale-s="90" data-confirm-s="62"' in page and "more than 90 s old" in page


def test_a_heartbeat_far_in_this_clocks_future_is_not_taken_for_fresh():
    now = 1_000_000.0
    assert HeartbeatWatch().observe(_watcher(now + 600), now, 50.0).verdict == WATCHING
    assert HeartbeatWatch().observe(_watcher(now + 600, state="stopped"), now, 50.0).verdict == DEAD


def test_the_view_says_what_was_measured():
    now, mono = 1_000_000.0, 50.0
    data = json.loads((Path(__file__).parent / "data" / "status_v1.json").read_text())
    watch = HeartbeatWatch()
    data["watcher"].update(_watcher(now - 600))
    first = watch.observe(data["watcher"], now, mono)
    text = _text(render_status(data, 250, now, liveness=first))
    assert "by this machine's clock: watching whether it changes" in text and "not responding" not in text
    data["watcher"]["heartbeat_at"] = iso_utc(now - 597)
    text = _text(render_status(data, 250, now + 2, liveness=watch.observe(data["watcher"], now + 2, mono + 2)))
    assert "heartbeat 0s ago (seen changing from here)" in text
    assert "this machine's clock is 9m 59s ahead of the watcher's (host elsewhere)" in text
    dead = watch.observe(data["watcher"], now + 30, mono + 30)
    text = _text(render_status(data, 250, now + 30, liveness=dead))
    assert "watcher not responding: heartbeat unchanged for 28s watched from this machine" in text, text


def _text(renderable) -> str:
    console = Console(width=250, record=True)
    console.print(renderable)
    return console.export_text()
