"""Issue #8 acceptance: status.html in a real headless Chromium and `trainq status --follow` in a real tmux,
both watching a real train job (tiny model, CPU) under a real watcher process with a simulated GPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import pytest
from browser_util import Browser
from conftest import PY, drop, wait_until
from test_train_queue import job_entry, tiny, train_job  # noqa: F401  (tiny is a module fixture)

from trainq.watcher.faces.html import CurveStore, render_curve, render_html
from trainq.watcher.spec.fsutil import atomic_write

TMUX = shutil.which("tmux")
#: the installed `trainq` script beside the venv's python; `python -m trainq.watcher` is the same program
TRAINQ = [str(Path(PY).with_name("trainq"))] if Path(PY).with_name("trainq").exists() else [PY, "-m", "trainq.watcher"]
#: steps of the observed job: with 0.3 s of sleep per step it runs long enough to watch it move (~10-30 s)
STEPS = 24
SIM_GPU = [
    {
        "index": 0,
        "name": "Sim 6GB",
        "memory_total_mb": 6144,
        "memory_used_mb": 512,
        "utilization_pct": 37,
        "processes": [],
    }
]
#: a console.error the test sends itself, to prove the console listener is live
PROBE = "trainq-console-probe"


def _start_watcher_and_job(queue_dir: Path, watcher_process, tiny: Path, job_id: str) -> None:
    """A real watcher seeing one simulated GPU, and a slow real LoRA job dropped into its inbox."""
    gpus = queue_dir.parent / "gpus.json"
    gpus.write_text(json.dumps(SIM_GPU))
    watcher_process(env={"TRAINQ_SIMULATE_GPUS": str(gpus)})
    train = {"max_steps": STEPS, "eval_every": 6, "checkpoint": {"every_steps": STEPS, "keep": 1}}
    drop(queue_dir, f"{job_id}.yaml", train_job(tiny, faults="sleep_per_step=0.3", train=train))


def _step(queue_dir: Path, job_id: str) -> int:
    return ((job_entry(queue_dir, job_id).get("progress") or {}).get("step")) or 0


def _wait_done(queue_dir: Path, job_id: str) -> Path:
    done, failed = queue_dir / "done" / job_id, queue_dir / "failed" / job_id
    wait_until(lambda: done.exists() or failed.exists(), 180, 0.2, f"{job_id} finished")
    assert done.exists(), (failed / "output.log").read_text()[-2000:]
    wait_until(lambda: job_entry(queue_dir, job_id).get("state") == "done", 15, 0.1, "status.json says done")
    return done


#: what the test reads from the live DOM in one evaluation
DOM_FACTS = """JSON.stringify({
  progress: [...document.querySelectorAll('progress[value]')].map(p => [p.value, p.max]),
  lines: [...document.querySelectorAll('svg.curve polyline')].map(l => [l.getAttribute('class'), l.points.numberOfItems]),
  text: document.body.innerText,
  links: [...document.querySelectorAll('a')].map(a => a.getAttribute('href')),
  stale: !document.getElementById('stale').hidden,
  overflow: document.documentElement.scrollWidth - window.innerWidth,
  loaded: document.readyState === 'complete'})"""


def _dom(browser: Browser) -> dict | None:
    facts = browser.evaluate(DOM_FACTS)
    return json.loads(facts) if isinstance(facts, str) else None


def _dom_where(browser: Browser, pred, timeout_s: float, what: str) -> dict:
    """Poll the page (which reloads itself) until ``pred(facts)`` holds."""
    seen: list[dict] = []

    def check() -> dict | None:
        facts = _dom(browser)
        if facts and facts["loaded"]:
            seen.append(facts)
            return facts if pred(facts) else None
        return None

    try:
        return wait_until(check, timeout_s, 0.25, what)
    except pytest.fail.Exception:
        last = seen[-1] if seen else {}
        pytest.fail(
            f"{what}: last DOM {json.dumps({k: v for k, v in last.items() if k != 'text'})}\n"
            f"{last.get('text', '')[:1500]}"
        )


def test_status_html_in_chromium_follows_a_real_train_job(queue_dir, watcher_process, tiny, browser, tmp_path):
    _start_watcher_and_job(queue_dir, watcher_process, tiny, "lora")
    page = queue_dir / "status.html"
    wait_until(lambda: _step(queue_dir, "lora") >= 1, 120, 0.1, "job past step 1")
    browser.call("Page.navigate", {"url": page.as_uri()}, session=True)

    first = _dom_where(
        browser,
        lambda f: f["progress"] and any(n >= 2 for _, n in f["lines"]),
        30,
        "a progress bar and a curve with points",
    )
    step0, total = first["progress"][0]
    assert total == STEPS and 0 < step0 < STEPS
    assert {cls for cls, _ in first["lines"]} >= {"loss"}
    text = first["text"]
    for needle in (
        "Running",
        "lora",
        "ETA",
        "tokens/s",
        "GPU 0 · Sim 6GB",
        "simulated",
        "held by",
        "Pending",
        "Recently finished",
        "heartbeat",
    ):
        assert needle in text, needle
    assert re.search(r"held by\s+lora", text), text
    assert not first["stale"] and first["overflow"] <= 0

    # never navigated again: only the page's own refresh can move the bar
    later = _dom_where(
        browser,
        lambda f: f["progress"] and f["progress"][0][0] > step0 and "eval_loss" in {cls for cls, _ in f["lines"]},
        60,
        "progress rose and an eval point drawn",
    )
    assert later["progress"][0][0] > step0 and later["progress"][0][1] == STEPS
    browser.screenshot(tmp_path / "running.png")
    assert (tmp_path / "running.png").stat().st_size > 20_000

    _wait_done(queue_dir, "lora")
    finished = _dom_where(browser, lambda f: "done/lora/loss.png" in f["links"], 30, "loss.png link after done")
    assert not finished["progress"] and "No job is running." in finished["text"]
    assert re.search(r"held by\s+nobody \(free\)", finished["text"])  # the GPU went back
    browser.screenshot(tmp_path / "finished.png")

    assert browser.console_problems() == []
    urls = browser.requested_urls()
    assert len(urls) >= 3 and set(urls) == {page.as_uri()}, urls  # the page and its reloads, nothing else
    # the listener is live: an error the test raises itself is seen
    browser.evaluate(f"console.error('{PROBE}')")
    wait_until(lambda: any(PROBE in p for p in browser.console_problems()), 5, 0.05, "probe console error seen")


# -- the terminal twin in tmux ---------------------------------------------------------------------------------


class Tmux:
    """One tmux server on its own socket, one window (80x40 unless told) running a command."""

    def __init__(self, socket: Path, command: list[str], env: dict[str, str], size: tuple[int, int] = (80, 40)) -> None:
        self.socket = socket
        self.status_file = socket.with_name("exit-status")
        # the shell records the exit status in a file: tmux 3.3a sometimes leaves a dead pane's process
        # unreaped (a zombie, no pane_dead_status) or blanks the dead pane. The INT trap keeps the shell
        # waiting for the command after Ctrl-C; a trapped (not ignored) signal is reset to default in the
        # command, which handles it itself.
        line = (
            f"trap true INT; {' '.join(map(_sh_quote, command))}; "
            f"echo $? > {_sh_quote(str(self.status_file))}.tmp; mv {_sh_quote(str(self.status_file))}.tmp "
            f"{_sh_quote(str(self.status_file))}"
        )
        self.tmux("new-session", "-d", "-s", "faces", "-x", str(size[0]), "-y", str(size[1]), line, env=env)
        # keep the pane, and what it shows, after the shell exits
        self.tmux("set-option", "-t", "faces", "remain-on-exit", "on")

    def tmux(self, *args: str, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(
            [TMUX, "-S", str(self.socket), "-f", "/dev/null", *args],
            capture_output=True,
            text=True,
            timeout=20,
            env=env,
        )
        assert done.returncode == 0, f"tmux {' '.join(args)}: {done.stderr}"
        return done.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "faces")

    def exit_status(self) -> int | None:
        """The command's exit status once it has ended."""
        try:
            return int(self.status_file.read_text())
        except FileNotFoundError:
            return None

    def pane(self, field: str) -> str:
        return self.tmux("display-message", "-p", "-t", "faces", f"#{{{field}}}").strip()

    def close(self) -> None:
        subprocess.run([TMUX, "-S", str(self.socket), "kill-server"], capture_output=True, timeout=20)


def _sh_quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


def _screen_step(screen: str) -> int | None:
    for line in screen.splitlines():
        parts = line.split()
        for part in parts:
            if part.endswith(f"/{STEPS}") and part.split("/")[0].isdigit():
                return int(part.split("/")[0])
    return None


def _screen_where(term: Tmux, pred, timeout_s: float, what: str) -> str:
    """Capture the pane until ``pred(screen)`` holds; the last screen goes into the failure message."""
    seen = [""]

    def check() -> str | None:
        seen[0] = term.screen()
        return seen[0] if pred(seen[0]) else None

    try:
        return wait_until(check, timeout_s, 0.1, what)
    except pytest.fail.Exception:
        pytest.fail(f"{what}; the screen was:\n{seen[0]}")


@pytest.fixture
def tmux_session(tmp_path: Path):
    if TMUX is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    made: list[Tmux] = []

    def _start(command: list[str], size: tuple[int, int] = (80, 40)) -> Tmux:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TMUX")}
        env.update(LANG="C.UTF-8", LC_ALL="C.UTF-8", SHELL="/bin/sh")
        made.append(Tmux(tmp_path / f"tmux-{len(made)}.sock", command, env, size))
        return made[-1]

    yield _start
    for session in made:
        session.close()


def test_trainq_status_follow_in_tmux_redraws_in_place(queue_dir, watcher_process, tiny, tmux_session, tmp_path):
    _start_watcher_and_job(queue_dir, watcher_process, tiny, "lora")
    wait_until(lambda: _step(queue_dir, "lora") >= 1, 120, 0.1, "job past step 1")
    term = tmux_session([*TRAINQ, "--root", str(queue_dir), "status", "--follow"])

    first = _screen_where(term, lambda s: _screen_step(s) and "ETA" in s, 30, "a step and its ETA on screen")
    for needle in (
        "running 1",
        "lora ",
        "tok/s",
        "ETA",
        "pending 0",
        "done 0",
        "ID ",
        "REASON",
        "GPU 0 Sim 6GB",
        "held by lora",
    ):
        assert needle in first, f"{needle!r} not on screen:\n{first}"
    (tmp_path / "screen-running.txt").write_text(first)  # kept for a person to look at
    history = term.pane("history_size")
    step0 = _screen_step(first)
    second = _screen_where(term, lambda s: (_screen_step(s) or 0) > step0, 30, "the step on screen moved")
    for screen in (first, second):
        assert max(len(line) for line in screen.splitlines()) <= 80, screen
        assert sum(line.startswith("lora ") for line in screen.splitlines()) == 1, screen  # redrawn, not appended
    assert term.pane("history_size") == history, "the view scrolled instead of redrawing in place"

    _wait_done(queue_dir, "lora")
    done = _screen_where(term, lambda s: "loss plot:" in s, 20, "loss plot on screen")
    assert "running 0" in done and "done/lora/loss.png" in done.replace("\n", ""), done

    term.tmux("send-keys", "-t", "faces", "C-c")
    wait_until(lambda: term.exit_status() is not None, 15, 0.05, "trainq status --follow exited on Ctrl-C")
    assert term.exit_status() == 0 and "Traceback" not in term.screen(), term.screen()
    _check_plain_status_shows_loss_png(queue_dir)


def _check_plain_status_shows_loss_png(queue_dir: Path) -> None:
    """`trainq status` (once, not following) and `--json` after the job finished."""
    env = dict(os.environ, COLUMNS="80", TERM="dumb")
    shown = subprocess.run(
        [*TRAINQ, "--root", str(queue_dir), "status"], capture_output=True, text=True, timeout=60, env=env
    )
    assert shown.returncode == 0, shown.stderr
    assert "loss plot: done/lora/loss.png" in shown.stdout and " done" in shown.stdout, shown.stdout
    assert max(len(line) for line in shown.stdout.splitlines()) <= 80
    as_json = subprocess.run(
        [*TRAINQ, "--root", str(queue_dir), "status", "--json"], capture_output=True, text=True, timeout=60, env=env
    )
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["counts"]["done"] == 1


# -- small things the screenshots showed ---------------------------------------------------------------------


def test_curve_legend_names_only_the_curves_drawn() -> None:
    assert "eval" not in render_curve({"loss": [(1, 2.0), (2, 1.5)]})
    both = render_curve({"loss": [(1, 2.0), (2, 1.5)], "eval_loss": [(2, 1.7)]})
    assert '<i class="k loss"></i>train' in both and '<i class="k eval_loss"></i>eval' in both
    # the first eval alone would be an invisible one-point line: it is drawn as a dot
    assert '<polyline class="eval_loss" points="2,-1.7 2,-1.7"/>' in both


def test_gpu_card_without_readings_or_holder() -> None:
    gpu = {
        "index": 0,
        "name": "Sim",
        "memory_total_mb": 6144,
        "memory_used_mb": 0,
        "utilization_pct": None,
        "temperature_c": None,
        "held_by": None,
        "foreign": [],
    }
    page = render_html({"resources": {"gpus": [gpu]}}, {})
    assert "°C" not in page and "nobody (free)" in page and "–%" not in page


# -- what writing status.html costs ------------------------------------------------------------------------


def test_writing_status_html_costs_under_2_percent_of_a_core_with_50_running_jobs(tmp_path: Path) -> None:
    store = CurveStore()
    for i in range(50):
        store.feed(
            f"j{i}", ({"type": "step", "step": s, "loss": 3 / (1 + s / 1000) + i / 100} for s in range(1, 100_001, 7))
        )
        store.feed(
            f"j{i}", ({"type": "eval", "step": s, "eval_loss": 3 / (1 + s / 1000)} for s in range(500, 100_001, 500))
        )
    jobs = [
        {
            "id": f"j{i}",
            "state": "running",
            "status": "running",
            "name": f"job {i}",
            "priority": 0,
            "attempt": 1,
            "pid": 1000 + i,
            "health": "healthy",
            "dir": f"running/j{i}",
            "gpus": [i % 8],
            "started_at": "2026-01-01T00:00:00Z",
            "usage": {"rss_mb": 1234.5},
            "progress": {
                "step": 50_000,
                "total_steps": 100_000,
                "epoch": 0.5,
                "loss": 1.23,
                "eval_loss": 1.3,
                "tokens_per_s": 910.5,
                "eta_s": 3600,
            },
        }
        for i in range(50)
    ]
    gpus = [
        {
            "index": i,
            "name": "Sim 80GB",
            "memory_total_mb": 81920,
            "memory_used_mb": 40000,
            "utilization_pct": 90,
            "temperature_c": 70,
            "held_by": f"j{i}",
            "foreign": [],
            "simulated": True,
        }
        for i in range(8)
    ]
    snapshot = {
        "schema_version": 1,
        "watcher": {
            "pid": 1,
            "host": "h",
            "version": "0.1.0",
            "state": "running",
            "started_at": "2026-01-01T00:00:00Z",
            "heartbeat_at": "2026-01-01T01:00:00Z",
        },
        "counts": {"inbox": 0, "awaiting_approval": 0, "pending": 0, "running": 50, "done": 0, "failed": 0},
        "jobs": jobs,
        "resources": {"ram": {"total_gb": 24, "available_gb": 12}, "disk": {}, "gpus": gpus},
    }
    page = tmp_path / "status.html"
    cpu = []
    for _ in range(20):
        started = time.process_time()
        # what StatusWriter does once a second at most: curves, render, atomic write without fsync
        atomic_write(page, render_html(snapshot, store.curves()), durable=False)
        cpu.append(time.process_time() - started)
    assert page.read_text().count("<polyline") == 100
    # 2% of one core at one write per second is 20 ms of CPU per write
    assert statistics.median(cpu) < 0.020, f"median {statistics.median(cpu) * 1e3:.1f} ms CPU per write"


# -- 30 mixed jobs in tmux at 80x24 and 200x50 (issue 15) ---------------------------------------------------


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=["80x24", "200x50"])
def test_thirty_mixed_jobs_fit_the_terminal_in_tmux(tmp_path, tmux_session, size):
    from test_view import mixed_jobs

    root = tmp_path / "q"
    root.mkdir()
    (root / "status.json").write_text(json.dumps(mixed_jobs(time.time())))
    width, height = size
    term = tmux_session([*TRAINQ, "status", "--follow", "--root", str(root)], size=size)
    screen = _screen_where(term, lambda s: "GPU 0 Sim 6GB" in s and "f-oom" in s, 20, "the table on screen")
    (tmp_path / f"screen-{width}x{height}.txt").write_text(screen)  # kept for a person to look at
    lines = screen.rstrip("\n").splitlines()
    assert len(lines) <= height and max(len(line) for line in lines) <= width, screen
    assert "inbox 1 · awaiting 1 · pending 8 · running 3 · done 11 · failed 7" in screen
    rows = [line for line in lines if line.startswith(("lora-run-", "lrs-", "draft", "f-", "done-"))]
    for kind in (
        "oom",
        "unsatisfiable",
        "data",
        "nan",
        "unknown",
        "killed",
        "timeout",
    ):  # every failure and its evidence
        row = next(line for line in rows if line.startswith(f"f-{kind}"[:12]))
        assert f"{kind}: " in row, row
    assert "oom: OutOfMemoryError: CUDA" in screen and "unknown: ValueError: bad lr" in screen
    if height >= 50:
        assert len(rows) == 30 and "hidden" not in screen and "STARTED" in screen
        assert "unsatisfiable: needs 500 GB RAM; this machine has 23.5 GB" in screen
    else:
        hidden = next(line for line in lines if "more row(s) hidden" in line)
        shown_plus_hidden = len(rows) + int(hidden.split()[1])
        assert shown_plus_hidden == 30, (hidden, screen)
    term.tmux("send-keys", "-t", "faces", "C-c")
    wait_until(lambda: term.exit_status() is not None, 15, 0.05, "status --follow exited on Ctrl-C")
    assert term.exit_status() == 0


def _mixed_real_jobs(queue_dir: Path) -> None:
    """30 real job files: 3 running, a waiting sweep, awaiting, rejected, six kinds of failure, done jobs with loss.

    The short jobs are dropped first and have ended before the three long runners arrive: dropped together, a watcher
    that claimed a long runner before the rest landed would start it, and the three would hold every slot for good."""
    from conftest import FAKE

    def job(name: str, command: list[str], **extra: object) -> None:
        fields = {"approved": True, "command": command, **extra}
        drop(queue_dir, f"{name}.yaml", json.dumps(fields))

    def counts() -> dict:
        status = json.loads((queue_dir / "status.json").read_text()) if (queue_dir / "status.json").exists() else {}
        return status.get("counts") or {}

    for name, script in (
        ("oom", "oom.py"),
        ("nan", "nan.py"),
        ("data", "bad_data.py"),
        ("killed", "kills_itself.py"),
        ("unknown", "exits_1.py"),
    ):
        job(f"fail-{name}", [PY, str(FAKE / script)], priority=10)
    job("fail-timeout", ["sleep", "30"], timeout="1s", stop_grace="1s", priority=10)
    job("fail-unsatisfiable", ["true"], resources={"ram_gb": 100000})
    drop(queue_dir, "broken.yaml", "approved: true\ncommand: [echo]\npriority: high\n")
    drop(queue_dir, "draft.yaml", "approved: false\ncommand: [echo]\n")
    loss = "import json,os; open(os.environ['TRAINQ_METRICS'],'a').write(json.dumps({'type':'step','step':5,'total_steps':5,'loss':0.25})+'\\n')"
    for i in range(11):
        job(f"ok-{i}", [PY, "-c", loss], priority=5)
    wait_until(lambda: counts().get("failed") == 8 and counts().get("done") == 11, 90, 0.2, "8 failed, 11 done")
    for i in range(3):
        job(f"train-{i}", [PY, str(FAKE / "metrics_then_sleep.py")], stop_grace="1s")
    job("lrs", ["echo", "{lr}"], sweep={"lr": [f"{i}e-4" for i in range(1, 8)]}, after=["train-0"])


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=["80x24", "200x50"])
def test_thirty_real_jobs_under_a_real_watcher_fit_the_terminal(
    queue_dir, watcher_process, tmux_session, tmp_path, size
):
    (queue_dir / "watcher.yaml").write_text(
        "max_concurrent: 3\nsettle_s: 0.1\ninbox_settle_s: 0.1\nrescan_s: 0.2\nstatus_s: 0.2\n"
    )
    watcher_process()
    _mixed_real_jobs(queue_dir)

    def settled() -> bool:
        status = json.loads((queue_dir / "status.json").read_text()) if (queue_dir / "status.json").exists() else {}
        counts = status.get("counts") or {}
        return (
            counts.get("running") == 3
            and counts.get("failed") == 8
            and counts.get("done") == 11
            and counts.get("pending") == 7
            and counts.get("awaiting_approval") == 1
        )

    wait_until(settled, 90, 0.2, "3 running, 7 pending, 1 awaiting, 8 failed, 11 done")
    width, height = size
    term = tmux_session([*TRAINQ, "status", "--follow", "--root", str(queue_dir)], size=size)
    screen = _screen_where(term, lambda s: "fail-oom" in s and "RAM " in s, 20, "the table on screen")
    (tmp_path / f"real-{width}x{height}.txt").write_text(screen)  # kept for a person to look at
    lines = screen.rstrip("\n").splitlines()
    assert len(lines) <= height and max(len(line) for line in lines) <= width, screen
    for kind in ("oom", "nan", "data", "killed", "unknown", "timeout", "unsatisfiable"):
        row = next((line for line in lines if line.startswith(f"fail-{kind}"[:12])), None)
        assert row is not None and f"{kind}: " in row, (kind, screen)
    assert "MemoryError" in screen and "JSONDecodeError" in screen  # the evidence, not "Read output.log"
    assert sum(line.startswith("train-") and " running " in line for line in lines) == 3
    rows = [line for line in lines if line.startswith(("train-", "lrs-", "draft", "fail-", "ok-", "broken"))]
    if height >= 50:
        assert len(rows) == 30 and "hidden" not in screen, screen
        assert "after train-0 (running)" in screen and "resources.gpus" not in screen
        assert any(line.startswith("ok-") and "0.25" in line and "5/5" in line for line in lines), screen
    else:
        hidden = next(line for line in lines if "more row(s) hidden" in line)
        assert len(rows) + int(hidden.split()[1]) == 30, (hidden, screen)
    term.tmux("send-keys", "-t", "faces", "C-c")
    wait_until(lambda: term.exit_status() is not None, 15, 0.05, "status --follow exited on Ctrl-C")
    for i in range(3):
        (queue_dir / "running" / f"train-{i}" / "stop.flag").write_text("now\n")
    wait_until(lambda: not list((queue_dir / "running").iterdir()), 60, 0.2, "runners stopped")
