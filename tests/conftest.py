"""Shared fixtures: real queue folders, real job files, an in-process watcher and a real watcher process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
FAKE = REPO / "tests" / "fake_trainers"
PY = sys.executable
sys.path.insert(0, str(REPO))
sys.path.append(str(FAKE))  # last: nothing there shadows a real module
from pid_hopper import stamp_out, with_marker  # noqa: E402  (tests/fake_trainers: the hopper's own clean-up)

#: every wait's bound is multiplied by this (TRAINQ_TEST_SLACK, default 3): a bound says "something is wrong
#: if it takes longer", never how fast it must be, so a loaded machine (CI at load 10) only makes waits longer
SLACK = float(os.environ.get("TRAINQ_TEST_SLACK", "3"))


def wait_until(pred: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "") -> object:
    """Poll ``pred`` until it returns something truthy; fail the test after ``timeout_s`` × SLACK."""
    timeout_s *= SLACK
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what or pred}")
        time.sleep(interval_s)


def run_json(root: Path, job_id: str) -> dict:
    """A job's run.json wherever its folder is now (pending, running, done or failed), or {} before it exists."""
    for state in ("pending", "running", "done", "failed"):
        path = root / state / job_id / "run.json"
        if path.exists():
            return json.loads(path.read_text())
    return {}


def trainq(root: str | Path, *args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    """``trainq --root ROOT ARGS`` run as a user runs it (a new process in ``cwd``, no stdin), output captured;
    ``env`` is laid over this process's environment (a PYTHONPATH there replaces the repository's)."""
    return subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(root), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def queue_dir(tmp_path: Path) -> Path:
    """A queue root with its five folders."""
    root = tmp_path / "queue"
    for name in ("inbox", "pending", "running", "done", "failed"):
        (root / name).mkdir(parents=True)
    return root


def drop(root: Path, name: str, text: str) -> Path:
    """Write a job file elsewhere, then rename it into the inbox (as the README tells users to)."""
    staging = root / ".staging"
    staging.mkdir(exist_ok=True)
    tmp = staging / name
    tmp.write_text(text, encoding="utf-8")
    target = root / "inbox" / name
    os.rename(tmp, target)
    return target


@pytest.fixture
def write_job(queue_dir: Path) -> Callable[..., Path]:
    """``write_job("a", command=[...], priority=2)`` drops an approved job file ``a.yaml``."""

    def _write(name: str, **fields: object) -> Path:
        fields.setdefault("approved", True)
        if "command" not in fields and "train" not in fields:
            fields["command"] = ["true"]
        return drop(queue_dir, f"{name}.yaml", yaml.safe_dump(fields, sort_keys=False))

    return _write


@pytest.fixture
def browser(tmp_path: Path):
    """A headless Chromium (browser_util.Browser) for the browser tests; skipped, saying why, without one."""
    from browser_util import CHROMIUM, Browser

    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    opened = Browser(tmp_path / "chromium-profile")
    yield opened
    opened.close()


@pytest.fixture
def watcher_config():
    """Build a WatcherConfig with test-friendly cadences; override fields by keyword."""
    from trainq.watcher.spec.config import WatcherConfig

    def _make(**overrides: object) -> WatcherConfig:
        base = {"settle_s": 0.1, "rescan_s": 0.2, "status_s": 0.1, "kill_after_s": 1.0}
        base.update(overrides)
        return WatcherConfig.from_dict(base)

    return _make


@pytest.fixture
def watcher(queue_dir: Path, watcher_config):
    """An in-process Watcher on ``queue_dir``; tests call ``tick(now)`` (or ``run_until``)."""
    from trainq.watcher.daemon.daemon import Watcher

    made: list[Watcher] = []

    def _make(**overrides: object) -> Watcher:
        w = Watcher(queue_dir, watcher_config(**overrides), env=dict(os.environ))
        w.start(install_signals=False)
        made.append(w)
        return w

    yield _make
    for w in made:
        w.close()


def tick_until(w, pred: Callable[[], object], timeout_s: float = 15.0, what: str = "") -> object:
    """Tick an in-process watcher until ``pred`` holds."""

    def step():
        w.tick(time.time())
        return pred()

    return wait_until(step, timeout_s, interval_s=0.02, what=what)


class WatcherProcess:
    """A real ``python -m trainq.watcher watch`` on a queue root."""

    def __init__(self, root: Path, env: dict | None = None, args: tuple[str, ...] = ()):
        self.root = root
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("PYTHONPATH", str(REPO))
        self.args = args
        self.proc: subprocess.Popen | None = None

    def start(self) -> WatcherProcess:
        self.proc = subprocess.Popen(
            [PY, "-m", "trainq.watcher", "--root", str(self.root), "watch", "-q", *self.args],
            cwd=REPO,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(self.root / "watcher.stderr", "ab"),
        )
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


@pytest.fixture
def watcher_process(queue_dir: Path):
    """Start real watcher processes on ``queue_dir``; teardown terminates them."""
    made: list[WatcherProcess] = []

    def _start(root: Path | None = None, **kw) -> WatcherProcess:
        wp = WatcherProcess(root or queue_dir, **kw).start()
        made.append(wp)
        return wp

    yield _start
    for wp in made:
        wp.stop()


def job_processes(under: Path) -> list[psutil.Process]:
    """Live processes whose TRAINQ_JOB_DIR lies under ``under``."""
    found = []
    prefix = str(under)
    for proc in psutil.process_iter():
        try:
            job_dir = proc.environ().get("TRAINQ_JOB_DIR", "")
        except (psutil.Error, OSError):
            continue
        if job_dir.startswith(prefix) and proc.pid != os.getpid():
            found.append(proc)
    return found


@pytest.fixture(autouse=True)
def no_leaked_job_processes(tmp_path: Path):
    """Fail any test that leaves a job process (or its descendants) running."""
    yield
    deadline = time.monotonic() + 10
    leaked = job_processes(tmp_path)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked = job_processes(tmp_path)
    for proc in leaked:
        try:
            proc.kill()
        except psutil.Error:
            pass
    if leaked:
        pytest.fail(f"test leaked job processes: {[p.pid for p in leaked]}")


@pytest.fixture(scope="module", autouse=True)
def no_escaped_hopper(request):
    """After each test file: no pid hopper of tests/fake_trainers may outlive it. One that escaped would
    burn a core (and its zombies the kernel's time) for the rest of the run; it is ended, and the file
    that let it go fails its last test's teardown, saying so."""
    yield
    if with_marker("hopper-marker-"):
        groups = stamp_out("hopper-marker-")
        pytest.fail(f"{request.module.__name__} left a pid hopper running ({groups} process groups, now killed)")


_timeline = {"file": None, "t0": time.monotonic()}


def pytest_runtest_logstart(nodeid: str, location) -> None:
    """With TRAINQ_TEST_TIMELINE=1 (.ci/pytest sets it), a line as each test file starts: seconds since the
    run began, the load average and the zombie count, so a CI log that ran out of time says where it went."""
    if os.environ.get("TRAINQ_TEST_TIMELINE") != "1":
        return
    path = nodeid.split("::")[0]
    if path == _timeline["file"]:
        return
    _timeline["file"] = path
    zombies = sum(1 for p in psutil.process_iter(["status"]) if p.info["status"] == psutil.STATUS_ZOMBIE)
    elapsed = time.monotonic() - _timeline["t0"]
    sys.stderr.write(f"\n[+{elapsed:5.0f} s, load {os.getloadavg()[0]:.1f}, {zombies} zombies] {path}\n")
