"""``on_finish`` hooks, the runner's side: run once per conclusion of a job, durably, contained like a job.

A conclusion's hook is a file before it is anything else: the watcher writes ``hook.json`` with
``state: "due"`` (fsynced) before the job's final run.json, so a crash at any later point leaves the due
hook on disk, and every start-up runs every due hook, however many (hook_launcher.py, the watcher's side).

The runner (``python -m trainq.watcher.supervisor.hooks JOB_DIR``) takes ``hook.lock`` (flock: "lock
held" means "runner alive"), and under it turns ``due`` into ``running`` (fsynced) before it starts the
hook: whoever makes that change runs the hook, every other runner exits at once. So a watcher killed
before the hook runs has it run by the next watcher, and one killed while it runs does not run it again
(the runner lives in its own session and finishes). A retry (retry.flag) waits for the hook to end
(hook_launcher.py, ``unfinished``), then removes ``hook.json``: its next conclusion is a new one.

The hook runs in a cgroup of its own where the machine has one (cgroups.py; ``<job id>.hook``), so
``kill -9 $PPID`` from the hook frees nothing: its processes stay in the group, the watcher sees the
runner gone and still kills the group at HOOK_TIMEOUT_S. Without a cgroup the runner is a child
subreaper and follows the tree, as jobs are followed. ``hook.log`` is opened as output.log is:
never through a symlink, never into a FIFO (O_NOFOLLOW | O_NONBLOCK, then S_ISREG). The outcome goes to
``hook.json``; the runner never touches run.json, so it never changes the job's status.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil

from trainq.watcher.spec import events
from trainq.watcher.spec.allow import hook_executable
from trainq.watcher.spec.config import load_watcher_config
from trainq.watcher.spec.contract import ENV_DIAGNOSIS, ENV_JOB_DIR, ENV_JOB_ID, ENV_STATUS, JobPaths
from trainq.watcher.spec.errors import InvalidJobSpec, Problem
from trainq.watcher.spec.fsutil import atomic_write_json, is_locked, read_json
from trainq.watcher.spec.units import iso_utc
from trainq.watcher.supervisor import cgroups
from trainq.watcher.supervisor.attempt_io import open_job_log

#: longest a hook may run before its processes are killed, seconds (docs/workflows.md)
HOOK_TIMEOUT_S = 60.0
#: env variable that shortens HOOK_TIMEOUT_S (tests)
ENV_HOOK_TIMEOUT = "TRAINQ_HOOK_TIMEOUT_S"
#: after SIGTERM at the timeout, SIGKILL follows this much later, seconds
HOOK_KILL_AFTER_S = 2.0
#: hook runners (one Python process each, ~25 MB) alive at once; later conclusions wait their turn
MAX_HOOK_RUNNERS = 8
#: Linux prctl option: orphaned descendants reparent to the nearest subreaper instead of init
PR_SET_CHILD_SUBREAPER = 36
#: statuses that are conclusions with a hook (a rejected job never ran and has no valid job.yaml)
HOOK_STATUSES = ("done", "failed", "cancelled", "timeout")
#: hook.json states: written by the watcher (due), then by the one runner (running, ended)
DUE, RUNNING, ENDED = "due", "running", "ended"
#: the runner's lock in the job folder (held while it lives)
HOOK_LOCK = "hook.lock"


def hook_timeout_s() -> float:
    """HOOK_TIMEOUT_S, or TRAINQ_HOOK_TIMEOUT_S where set."""
    try:
        return float(os.environ.get(ENV_HOOK_TIMEOUT) or HOOK_TIMEOUT_S)
    except ValueError:
        return HOOK_TIMEOUT_S


def has_hook(spec, status: str | None) -> bool:
    """Whether this conclusion of the job has an on_finish hook to run."""
    return bool(spec is not None and getattr(spec, "on_finish", None) and status in HOOK_STATUSES)


def mark_due(paths: JobPaths, spec, run: dict) -> bool:
    """Write ``hook.json`` ``{"state": "due"}`` (fsynced) for a conclusion with a hook, once per conclusion
    (its attempt and finished_at); called as the final run.json is written, before it, so the hook is on
    disk before the conclusion is. True when one was written."""
    status = run.get("status")
    if not has_hook(spec, status):
        return False
    record = read_json(paths.hook_record)
    if record is not None and _same_conclusion(record, run):
        return False  # this conclusion's hook is due, running or ended already
    atomic_write_json(
        paths.hook_record,
        {"state": DUE, "status": status, "attempt": run.get("attempt"), "finished_at": run.get("finished_at")},
    )
    return True


def _same_conclusion(record: dict, run: dict) -> bool:
    if record.get("attempt") != run.get("attempt"):
        return False
    # a hook.json written before finished_at was recorded in it belongs to the attempt's one conclusion
    return "finished_at" not in record or record.get("finished_at") == run.get("finished_at")


def hook_due(paths: JobPaths, spec, status: str | None) -> bool:
    """A concluded job whose hook no runner has taken: hook.json says due, or (a folder concluded before
    hook.json was written first) there is none yet."""
    if not has_hook(spec, status):
        return False
    record = read_json(paths.hook_record)
    if record is None:
        return not os.path.lexists(paths.hook_record)
    return record.get("state") == DUE


def lock_path(paths: JobPaths) -> Path:
    return paths.dir / HOOK_LOCK


def runner_alive(paths: JobPaths) -> bool:
    """True while a runner holds the job's hook.lock."""
    return is_locked(lock_path(paths))


# ---------------------------------------------------------------- the runner process


def run_hook(job_dir: Path, timeout_s: float = HOOK_TIMEOUT_S) -> int:
    """The runner: take the lock, turn due into running (or exit), run the hook, record its outcome."""
    from trainq.watcher.spec.jobspec import load_job_file

    paths = JobPaths(job_dir)
    lock_fd = _take_lock(paths)
    if lock_fd is None:
        return 0  # another runner has this conclusion
    run = read_json(paths.run) or {}
    try:
        spec = load_job_file(paths.spec)
    except (InvalidJobSpec, OSError):
        return 0
    if spec.on_finish is None or not hook_due(paths, spec, run.get("status")):
        return 0
    containment = cgroups.detect()
    group = containment.group_for(paths.dir, "hook")
    due = read_json(paths.hook_record) or {}
    record = {
        "state": RUNNING,
        "status": run.get("status"),
        "attempt": run.get("attempt"),
        "finished_at": due.get("finished_at", run.get("finished_at")),
        "runner_pid": os.getpid(),
        "started_at": iso_utc(time.time()),
        "timeout_s": timeout_s,
        "containment": containment.mode if group else "process-tree",
        "cgroup": str(group) if group else None,
    }
    atomic_write_json(paths.hook_record, record)  # durable: from here on, no runner starts this hook again
    record.update(_run(paths, run, spec.on_finish, timeout_s, group, containment.mode))
    record.update(state=ENDED, ended_at=iso_utc(time.time()))
    try:
        atomic_write_json(paths.hook_record, record)
    except FileNotFoundError:
        pass  # the folder moved on meanwhile (retried, removed)
    events.emit(
        paths,
        "hook",
        status=record.get("status"),
        exit_code=record.get("exit_code"),
        timed_out=record.get("timed_out"),
        error=record.get("error"),
    )
    os.close(lock_fd)
    return 0


def _take_lock(paths: JobPaths) -> int | None:
    """hook.lock, a regular file opened without following links or blocking, exclusively flocked; else None.

    A symlink, FIFO or folder the job left as hook.lock is removed and a fresh file made, so a job cannot
    keep its own hook from running.
    """
    for _ in range(3):
        try:
            fd = os.open(lock_path(paths), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                return None
            _remove_any(lock_path(paths))
            continue
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            _remove_any(lock_path(paths))
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None  # another runner holds it
        return fd
    return None


def _remove_any(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    except OSError:
        pass


def _allowed_executable(paths: JobPaths, argv0: str) -> str | Problem | None:
    """allow_commands checked again as the hook runs (job.yaml could have been edited meanwhile)."""
    try:
        allowed = load_watcher_config(paths.dir.parent.parent, {}).allow_commands
    except InvalidJobSpec as exc:
        return Problem("on_finish", f"watcher.yaml is invalid, so allow_commands cannot be checked ({exc})")
    return hook_executable(argv0, str(paths.dir), allowed, os.environ.get("PATH", os.defpath))


def _run(
    paths: JobPaths, run: dict, argv_template: tuple[str, ...], timeout_s: float, group: Path | None, mode: str
) -> dict:
    job_id = run.get("id") or paths.dir.name
    status = str(run.get("status") or "")
    diagnosis = (run.get("diagnosis") or {}).get("kind") or ""
    values = {"job_id": job_id, "status": status}
    argv = [_expand(a, values) for a in argv_template]
    env = dict(
        os.environ, **{ENV_JOB_ID: job_id, ENV_JOB_DIR: str(paths.dir), ENV_STATUS: status, ENV_DIAGNOSIS: diagnosis}
    )
    env.pop(ENV_HOOK_TIMEOUT, None)
    log_fd = open_job_log(paths.hook_log)  # a FIFO or a symlink the job left there is replaced, never waited on
    with os.fdopen(log_fd, "ab") as log:
        log.write(f"===== trainq: on_finish of {job_id} ({status}), started {iso_utc(time.time())} =====\n".encode())
        log.flush()
        executable = _allowed_executable(paths, argv[0])
        if isinstance(executable, Problem):
            log.write(f"trainq: the hook was not run: {executable.message}\n".encode())
            _drop(group)
            return {"exit_code": None, "timed_out": False, "error": f"on_finish: {executable.message}"}
        _become_subreaper()
        try:
            proc = _start(argv, executable, log, paths, env, group)
        except OSError as exc:
            log.write(f"trainq: could not start the hook {argv[0]!r}: {exc.strerror or exc}\n".encode())
            _drop(group)
            return {"exit_code": None, "timed_out": False, "error": f"could not start {argv[0]!r}: {exc}"}
        if proc.group is None and group is not None:
            log.write(b"trainq: the hook could not join its cgroup; contained by its process tree instead\n")
            group = None
        deadline = time.monotonic() + timeout_s
        try:
            code = proc.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and _wait_all_gone(deadline, group, mode):
            _drop(group)
            return {"exit_code": code, "timed_out": False}
        _kill_all(proc.popen, group, mode)
        _drop(group)
        log.write(f"trainq: the hook ran past {timeout_s:g}s and was killed\n".encode())
        return {"exit_code": proc.popen.returncode, "timed_out": True}


class _Started:
    def __init__(self, popen: subprocess.Popen, group: Path | None) -> None:
        self.popen, self.group = popen, group


def _start(argv: list[str], executable: str | None, log, paths: JobPaths, env: dict, group: Path | None) -> _Started:
    """The hook's process, inside ``group`` where it can join it."""

    def popen(preexec=None) -> subprocess.Popen:
        return subprocess.Popen(
            argv,
            executable=executable,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(paths.dir),
            env=env,
            start_new_session=True,
            close_fds=True,
            preexec_fn=preexec,
        )

    if group is None:
        return _Started(popen(), None)
    try:
        procs = os.open(group / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:  # the group is gone or closed to us: the hook still runs, held by its process tree
        return _Started(popen(), None)
    try:
        return _Started(popen(lambda: os.write(procs, b"0")), group)
    except subprocess.SubprocessError:
        pass
    finally:
        os.close(procs)
    return _Started(popen(), None)


def _drop(group: Path | None) -> None:
    if group is not None:
        cgroups.remove(group)


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


def _any_left(group: Path | None, mode: str) -> bool:
    if group is not None and cgroups.is_populated(group, mode):
        return True
    return bool(_live_descendants())


def _wait_all_gone(deadline: float, group: Path | None, mode: str) -> bool:
    """Wait until nothing the hook started still runs (True), or the deadline (False)."""
    while _any_left(group, mode):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _kill_all(proc: subprocess.Popen, group: Path | None, mode: str) -> None:
    """TERM, then KILL, the hook's group, process group and every process it left, wherever they moved."""
    for sig, wait_s in ((signal.SIGTERM, HOOK_KILL_AFTER_S), (signal.SIGKILL, 5.0)):
        if group is not None and sig == signal.SIGKILL:
            cgroups.kill(group, mode)
        elif group is not None:
            cgroups.signal_all(group, sig)
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
        while time.monotonic() < deadline and (proc.poll() is None or _any_left(group, mode)):
            time.sleep(0.05)
        if proc.poll() is not None and not _any_left(group, mode):
            break


def _expand(template: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m trainq.watcher.supervisor.hooks JOB_DIR", file=sys.stderr)
        return 2
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    return run_hook(Path(argv[0]), hook_timeout_s())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
