"""``on_finish`` hooks, the watcher's side: start runners, a few at a time, and hold every hook to its limit.

The truth is on disk (hooks.py): ``hook.json`` says ``due``, ``running`` or ``ended``, and ``hook.lock``
is held while a runner lives. ``HookLauncher`` starts at most MAX_HOOK_RUNNERS runners at once; later
due hooks wait in memory, and since they are also files, ``recover`` finds every one of them again at
start-up (however many) by listing done/ and failed/.

A hook that killed its runner (``kill -9 $PPID``) is still ``running`` with no lock held: it keeps its
slot, and at its deadline (its start + its timeout) the watcher kills its cgroup and records the end
itself (``runner_lost``). Without a cgroup its leftover processes (found by TRAINQ_JOB_DIR) are killed
at once. A runner still alive well past its deadline (stopped, stuck) is killed with its hook. When the
watcher stops, hooks whose runner is gone are ended now (nobody would hold them to their limit); live
runners finish by themselves within their limit.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import psutil

from trainq.watcher.spec.contract import ENV_JOB_DIR, JobPaths
from trainq.watcher.spec.folders import JobState
from trainq.watcher.spec.fsutil import atomic_write_json, read_json
from trainq.watcher.spec.interpreter import safe_module_argv
from trainq.watcher.spec.units import iso_utc, parse_iso
from trainq.watcher.supervisor import cgroups
from trainq.watcher.supervisor.hooks import (
    DUE,
    ENDED,
    ENV_HOOK_TIMEOUT,
    HOOK_KILL_AFTER_S,
    MAX_HOOK_RUNNERS,
    RUNNING,
    hook_timeout_s,
    runner_alive,
)

logger = logging.getLogger(__name__)
#: a live runner this long past its hook's limit (and the kill that follows it) is stuck: killed (s)
STUCK_AFTER_S = 10.0
#: runners started for a due hook a retry.flag waits on before the retry goes ahead without it
RETRY_LAUNCHES = 3


@dataclass
class _Active:
    job_id: str
    paths: JobPaths
    proc: subprocess.Popen | None  # None: a runner a previous watcher started, or one already gone
    since: float = 0.0  # when this watcher started or found it (time.monotonic())


class HookLauncher:
    """The watcher's side: starts runners (at most MAX_HOOK_RUNNERS at once) and reaps them without ever waiting."""

    def __init__(self, env: dict[str, str]):
        self.timeout_s = hook_timeout_s()
        # the runner reads these itself; env_passthrough must not change how hooks are limited and contained
        extra = {ENV_HOOK_TIMEOUT: str(self.timeout_s)}
        if os.environ.get(cgroups.ENV_CONTAINMENT):
            extra[cgroups.ENV_CONTAINMENT] = os.environ[cgroups.ENV_CONTAINMENT]
        self.env = {**env, **extra}
        self._active: dict[Path, _Active] = {}
        self._waiting: deque[tuple[str, Path]] = deque()
        self._queued: set[Path] = set()
        self._retry_launches: dict[Path, int] = {}  # runners started for a hook a retry waits on

    def launch(self, job_id: str, job_dir: Path) -> None:
        """Start the runner for ``job_dir`` (a concluded job's final folder), or queue it while MAX_HOOK_RUNNERS run."""
        job_dir = Path(job_dir)
        if job_dir in self._active or job_dir in self._queued:
            return
        self.reap()
        if len(self._active) >= MAX_HOOK_RUNNERS:
            self._waiting.append((job_id, job_dir))
            self._queued.add(job_dir)
            return
        self._start(job_id, job_dir)

    def recover(self, root_dir: Path) -> int:
        """At start-up: every due hook in done/ and failed/ is queued, every running one watched again."""
        found = 0
        for state in (JobState.DONE, JobState.FAILED):
            try:
                entries = [e for e in os.scandir(root_dir / state.value) if not e.name.startswith(".")]
            except FileNotFoundError:
                continue
            for entry in sorted(entries, key=lambda e: e.name):
                record = read_json(Path(entry.path) / JobPaths(Path(entry.path)).hook_record.name)
                if record is None:
                    continue
                if record.get("state") == DUE:
                    self.launch(entry.name, Path(entry.path))
                    found += 1
                elif record.get("state") == RUNNING and Path(entry.path) not in self._active:
                    self._active[Path(entry.path)] = _Active(
                        entry.name, JobPaths(Path(entry.path)), None, time.monotonic() - self.timeout_s
                    )
                    found += 1
        if found:
            logger.info("watcher: %d on_finish hook(s) due or running from before this start", found)
        return found

    def _start(self, job_id: str, job_dir: Path) -> None:
        try:
            proc = subprocess.Popen(
                [*safe_module_argv(sys.executable, "trainq.watcher.supervisor.hooks"), str(job_dir)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True,
                env=self.env,
            )
        except OSError as exc:
            logger.warning("job %s: could not start its on_finish hook runner: %s", job_id, exc)
            return
        self._active[job_dir] = _Active(job_id, JobPaths(job_dir), proc, time.monotonic())
        logger.info("job %s: on_finish hook started (runner pid %d)", job_id, proc.pid)

    def reap(self) -> None:
        """Settle runners that ended, hold every hook to its limit, start waiting ones (never blocks)."""
        for job_dir, active in list(self._active.items()):
            if self._settled(active):
                del self._active[job_dir]
        while self._waiting and len(self._active) < MAX_HOOK_RUNNERS:
            job_id, job_dir = self._waiting.popleft()
            self._queued.discard(job_dir)
            record_path = JobPaths(job_dir).hook_record
            due = (read_json(record_path) or {}).get("state") == DUE or not os.path.lexists(record_path)
            if due and job_dir.is_dir():  # not moved on (retried, removed) meanwhile
                self._start(job_id, job_dir)

    def running(self) -> int:
        return len(self._active)

    def unfinished(self, job_id: str, job_dir: Path) -> bool:
        """Whether the hook of ``job_dir``'s conclusion (which has one) has yet to end: a retry waits for it.

        Due and not yet taken: started now (or queued behind the cap), and waited for. Taken (``running``,
        or its lock held by a runner about to take it): waited for; the hook ends within its limit, or the
        watcher ends it (reap). Ended: not waited for. A hook still due after RETRY_LAUNCHES runners started
        here ended without taking it is not waited for: a retry is never held for ever.
        """
        job_dir = Path(job_dir)
        paths = JobPaths(job_dir)
        record = read_json(paths.hook_record)
        if record is None and not os.path.lexists(paths.hook_record):
            record = {"state": DUE}  # none yet: a folder concluded before hook.json came first
        state = (record or {}).get("state")  # unreadable: not waited for
        if state == RUNNING:
            return True
        if state != DUE:
            self._retry_launches.pop(job_dir, None)
            return False
        if runner_alive(paths) or job_dir in self._active or job_dir in self._queued:
            return True
        launches = self._retry_launches.get(job_dir, 0)
        if launches >= RETRY_LAUNCHES:
            del self._retry_launches[job_dir]
            logger.warning(
                "job %s: its on_finish hook is still due after %d runners; its retry goes ahead without it",
                job_id,
                launches,
            )
            return False
        self._retry_launches[job_dir] = launches + 1
        self.launch(job_id, job_dir)
        return True

    def close(self) -> None:
        """The watcher stops: hooks whose runner is gone are ended now; live runners end within their limit."""
        for _job_dir, active in list(self._active.items()):
            if (active.proc is not None and active.proc.poll() is None) or runner_alive(active.paths):
                self._kill_if_stuck(active)
                continue
            record = read_json(active.paths.hook_record) or {}
            if record.get("state") == RUNNING:
                self._end_orphan(active, record, "the watcher stopped")

    # -- one runner ----------------------------------------------------------------------------
    def _settled(self, active: _Active) -> bool:
        """True once this hook needs no more watching."""
        if (active.proc is not None and active.proc.poll() is None) or (
            active.proc is None and runner_alive(active.paths)
        ):
            self._kill_if_stuck(active)
            return False
        record = read_json(active.paths.hook_record)
        if record is None or record.get("state") != RUNNING:
            if record is not None and record.get("state") == DUE and not runner_alive(active.paths):
                logger.warning(
                    "job %s: its hook runner left without running the hook; the next start-up tries again",
                    active.job_id,
                )
            return True  # ended, moved on (retried, removed), or left due
        if runner_alive(active.paths):
            return False  # another runner took it (one from before a restart)
        return self._hold_orphan(active, record)

    def _hold_orphan(self, active: _Active, record: dict) -> bool:
        """The runner died while its hook ran (``kill -9 $PPID``): the hook keeps its limit; True once ended."""
        group, mode = _group_of(active.paths, record)
        if group is not None and cgroups.is_populated(group, mode):
            if time.time() < _deadline(record, self.timeout_s):
                return False
            self._end_orphan(active, record, f"it ran past {record.get('timeout_s', self.timeout_s):g}s")
            return True
        self._end_orphan(active, record, "its runner was killed")
        return True

    def _end_orphan(self, active: _Active, record: dict, why: str) -> None:
        """Kill what is left of a hook whose runner is gone and record its end (never run again)."""
        group, mode = _group_of(active.paths, record)
        if group is not None:
            cgroups.kill(group, mode)
            cgroups.remove(group)
        else:
            _kill_by_job_dir(active.paths.dir)
        timed_out = time.time() >= _deadline(record, self.timeout_s)
        record.update(
            state=ENDED,
            ended_at=iso_utc(time.time()),
            exit_code=None,
            timed_out=timed_out,
            runner_lost=True,
            error=f"the hook's runner was gone ({why}); what was left of the hook was killed",
        )
        try:
            atomic_write_json(active.paths.hook_record, record)
        except FileNotFoundError:
            return
        logger.warning("job %s: on_finish runner gone (%s); the hook was ended", active.job_id, why)

    def _kill_if_stuck(self, active: _Active) -> None:
        """A runner alive well past its hook's limit (stopped, stuck): kill it and its hook, record the end."""
        if time.monotonic() - active.since < self.timeout_s:
            return  # cannot be past its limit yet: no need to read hook.json on every tick
        record = read_json(active.paths.hook_record) or {}
        if record.get("state") != RUNNING:
            return
        if time.time() < _deadline(record, self.timeout_s) + HOOK_KILL_AFTER_S + STUCK_AFTER_S:
            return
        pid = record.get("runner_pid")
        if active.proc is not None:
            active.proc.kill()
            active.proc.wait()
        elif isinstance(pid, int) and runner_alive(active.paths) and _is_runner(pid, active.paths.dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._end_orphan(active, record, "its runner was stuck past the limit")


def _deadline(record: dict, timeout_s: float) -> float:
    started = parse_iso(record.get("started_at")) or time.time()
    limit = record.get("timeout_s")
    return started + (float(limit) if isinstance(limit, (int, float)) else timeout_s)


def _group_of(paths: JobPaths, record: dict) -> tuple[Path | None, str]:
    """The hook's cgroup from hook.json, if it is this job's hook group (the record is the job's to edit)."""
    group, mode = cgroups.mode_of(record)
    if group is None or not cgroups.is_owned(group, paths.dir, "hook"):
        return None, "process-tree"
    return group, mode


def _is_runner(pid: int, job_dir: Path) -> bool:
    try:
        return str(job_dir) in psutil.Process(pid).cmdline()
    except psutil.Error:
        return False


def _kill_by_job_dir(job_dir: Path) -> None:
    """Without a cgroup: SIGKILL the processes whose TRAINQ_JOB_DIR is this (final) folder: the hook's."""
    wanted = {os.path.normpath(str(job_dir)), os.path.realpath(job_dir)}
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and os.path.normpath(proc.environ().get(ENV_JOB_DIR, "") or "/") in wanted:
                proc.kill()
        except (psutil.Error, OSError):
            continue
