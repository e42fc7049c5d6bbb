"""``on_finish`` hooks: run once per conclusion of a job, never blocking the watcher, even across a crash.

The watcher starts a small detached runner (``python -m trainq.watcher.supervisor.hooks JOB_DIR``) for a
concluded job whose job.yaml declares ``on_finish`` and whose folder has no ``hook.json`` yet.
The runner creates ``hook.json`` with O_EXCL before it starts the hook: whoever creates it runs
the hook, every other runner (a restarted watcher's, say) exits at once. So a watcher killed
between the job's end and the hook runs it after restart (``recover()`` starts the runner for
recently finished jobs without ``hook.json``), and a watcher killed while the hook runs does
not run it again (the runner lives in its own session and finishes). A retry (retry.flag)
removes ``hook.json``: its conclusion is a new one.

The runner is a child subreaper and waits for the hook and everything it started; what still runs at
``HOOK_TIMEOUT_S`` (its process group and any orphan, double-forked or not) is killed; its output goes to
``hook.log``; its outcome to ``hook.json``. It never touches run.json, so it never changes the
job's status. (This module imports subprocess and signal besides the supervisor package: the runner is a
process of its own, like the supervisor, and shares nothing with the watcher's supervision.)
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import psutil

from trainq.watcher.spec import events
from trainq.watcher.spec.allow import hook_executable
from trainq.watcher.spec.config import load_watcher_config
from trainq.watcher.spec.contract import ENV_DIAGNOSIS, ENV_JOB_DIR, ENV_JOB_ID, ENV_STATUS, JobPaths
from trainq.watcher.spec.errors import InvalidJobSpec, Problem
from trainq.watcher.spec.fsutil import atomic_write_json, read_json
from trainq.watcher.spec.units import iso_utc

logger = logging.getLogger(__name__)

#: longest a hook may run before its process group is killed, seconds (CONTRACT section 9)
HOOK_TIMEOUT_S = 60.0
#: after SIGTERM at the timeout, SIGKILL follows this much later, seconds
HOOK_KILL_AFTER_S = 2.0
#: hook runners (one Python process each, ~25 MB) alive at once; later conclusions wait their turn
MAX_HOOK_RUNNERS = 8
#: Linux prctl option: orphaned descendants reparent to the nearest subreaper instead of init
PR_SET_CHILD_SUBREAPER = 36
#: statuses that are conclusions with a hook (a rejected job never ran and has no valid job.yaml)
HOOK_STATUSES = ("done", "failed", "cancelled", "timeout")


def hook_due(paths: JobPaths, spec, status: str | None) -> bool:
    """A concluded job with an on_finish hook that no runner has taken yet."""
    return bool(spec is not None and spec.on_finish and status in HOOK_STATUSES and not paths.hook_record.exists())


class HookLauncher:
    """The watcher's side: starts runners (at most MAX_HOOK_RUNNERS at once) and reaps them without ever waiting."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self._runners: list[subprocess.Popen] = []
        self._waiting: deque[tuple[str, Path]] = deque()

    def launch(self, job_id: str, job_dir: Path) -> None:
        """Start the runner for ``job_dir`` (a concluded job's final folder), or queue it while MAX_HOOK_RUNNERS run."""
        self.reap()
        if len(self._runners) >= MAX_HOOK_RUNNERS:
            self._waiting.append((job_id, job_dir))
            return
        self._start(job_id, job_dir)

    def _start(self, job_id: str, job_dir: Path) -> None:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trainq.watcher.supervisor.hooks", str(job_dir)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                close_fds=True, start_new_session=True, env=self.env,
            )
        except OSError as exc:
            logger.warning("job %s: could not start its on_finish hook runner: %s", job_id, exc)
            return
        self._runners.append(proc)
        logger.info("job %s: on_finish hook started (runner pid %d)", job_id, proc.pid)

    def reap(self) -> None:
        """Collect runners that exited and start waiting ones in their place (never blocks)."""
        if self._runners:
            self._runners = [p for p in self._runners if p.poll() is None]
        while self._waiting and len(self._runners) < MAX_HOOK_RUNNERS:
            job_id, job_dir = self._waiting.popleft()
            if job_dir.is_dir() and not JobPaths(job_dir).hook_record.exists():  # not moved on (retried, removed)
                self._start(job_id, job_dir)

    def running(self) -> int:
        return len(self._runners)


def run_hook(job_dir: Path, timeout_s: float = HOOK_TIMEOUT_S) -> int:
    """The runner: take the conclusion's hook.json (O_EXCL) or exit, run the hook, record its outcome."""
    from trainq.watcher.spec.errors import InvalidJobSpec
    from trainq.watcher.spec.jobspec import load_job_file

    paths = JobPaths(job_dir)
    run = read_json(paths.run) or {}
    try:
        spec = load_job_file(paths.spec)
    except (InvalidJobSpec, OSError):
        return 0
    if not spec.on_finish:
        return 0
    started = time.time()
    record = {"state": "running", "runner_pid": os.getpid(), "status": run.get("status"),
              "attempt": run.get("attempt"), "started_at": iso_utc(started)}
    try:
        fd = os.open(paths.hook_record, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return 0  # another runner took this conclusion
    with os.fdopen(fd, "w") as f:  # readers use read_json, which takes a half-written file for absent
        f.write(json.dumps(record))
    record.update(_run(paths, run, spec.on_finish, timeout_s))
    record.update(state="ended", ended_at=iso_utc(time.time()))
    atomic_write_json(paths.hook_record, record)
    events.emit(paths, "hook", status=record.get("status"), exit_code=record.get("exit_code"),
                timed_out=record.get("timed_out"), error=record.get("error"))
    return 0


def _allowed_executable(paths: JobPaths, argv0: str) -> str | Problem | None:
    """allow_commands checked again as the hook runs (job.yaml could have been edited meanwhile)."""
    try:
        allowed = load_watcher_config(paths.dir.parent.parent, {}).allow_commands
    except InvalidJobSpec as exc:
        return Problem("on_finish", f"watcher.yaml is invalid, so allow_commands cannot be checked ({exc})")
    return hook_executable(argv0, str(paths.dir), allowed, os.environ.get("PATH", os.defpath))


def _run(paths: JobPaths, run: dict, argv_template: tuple[str, ...], timeout_s: float) -> dict:
    job_id = run.get("id") or paths.dir.name
    status = str(run.get("status") or "")
    diagnosis = (run.get("diagnosis") or {}).get("kind") or ""
    values = {"job_id": job_id, "status": status}
    argv = [_expand(a, values) for a in argv_template]
    env = dict(os.environ, **{ENV_JOB_ID: job_id, ENV_JOB_DIR: str(paths.dir), ENV_STATUS: status,
                              ENV_DIAGNOSIS: diagnosis})
    with open(paths.hook_log, "ab") as log:
        log.write(f"===== trainq: on_finish of {job_id} ({status}), started {iso_utc(time.time())} =====\n".encode())
        log.flush()
        executable = _allowed_executable(paths, argv[0])
        if isinstance(executable, Problem):
            log.write(f"trainq: the hook was not run: {executable.message}\n".encode())
            return {"exit_code": None, "timed_out": False, "error": f"on_finish: {executable.message}"}
        try:
            _become_subreaper()
            proc = subprocess.Popen(argv, executable=executable, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=str(paths.dir), env=env, start_new_session=True,
                                    close_fds=True)
        except OSError as exc:
            log.write(f"trainq: could not start the hook {argv[0]!r}: {exc.strerror or exc}\n".encode())
            return {"exit_code": None, "timed_out": False, "error": f"could not start {argv[0]!r}: {exc}"}
        deadline = time.monotonic() + timeout_s
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and _wait_descendants(deadline):
            return {"exit_code": code, "timed_out": False}
        _kill_tree(proc)
        log.write(f"trainq: the hook ran past {timeout_s:g}s and was killed\n".encode())
        return {"exit_code": proc.returncode, "timed_out": True}


def _become_subreaper() -> None:
    """Orphans of the hook (double-forked, new sessions) reparent to the runner, so the limit reaches them."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the hook's process group is still killed
        pass


def _live_descendants() -> list[psutil.Process]:
    """The runner's descendants still running; exited orphans (zombies) are reaped."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    try:
        kids = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    live = []
    for kid in kids:
        try:
            if kid.status() != psutil.STATUS_ZOMBIE:
                live.append(kid)
        except psutil.Error:
            continue
    return live


def _wait_descendants(deadline: float) -> bool:
    """Wait until nothing the hook started still runs (True), or the deadline (False)."""
    while _live_descendants():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _kill_tree(proc: subprocess.Popen) -> None:
    """TERM, then KILL, the hook's process group and every process it left, wherever they moved."""
    for sig, wait_s in ((signal.SIGTERM, HOOK_KILL_AFTER_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for kid in _live_descendants():
            try:
                kid.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and (proc.poll() is None or _live_descendants()):
            time.sleep(0.05)
        if proc.poll() is not None and not _live_descendants():
            break


def _expand(template: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m trainq.watcher.supervisor.hooks JOB_DIR", file=sys.stderr)
        return 2
    timeout_s = float(os.environ.get("TRAINQ_HOOK_TIMEOUT_S") or HOOK_TIMEOUT_S)
    return run_hook(Path(argv[0]), timeout_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
