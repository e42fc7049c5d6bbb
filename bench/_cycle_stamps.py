"""Timing stamps for ``probe_cycle.py``, loaded into the watcher and its spawner by a ``sitecustomize`` on
PYTHONPATH (nothing in trainq imports this). With ``CYCLE_STAMPS=<folder>`` set, it wraps a fixed list of the
loop's and the supervisor's steps; each call appends ``step start end cpu`` (``time.perf_counter``, a clock every
process on the machine shares, and the thread's CPU seconds) to ``<folder>/<pid>.stamps``. The watcher writes its
stamps when it exits, a supervisor after each attempt. A wrapper costs a few microseconds a call. With
``CYCLE_STAMPS_FINE=1`` it also wraps the steps inside those (``FINE_WATCHER_STEPS``, ``FINE_SUPERVISOR_STEPS``):
each then costs its parent's wall a few microseconds more.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import os
import sys
import time
from collections.abc import Callable

#: (module, attribute path, step name) wrapped in the watcher process
WATCHER_STEPS = (
    ("trainq.watcher.daemon.daemon", "Watcher.tick", "pass"),
    ("trainq.watcher.daemon.daemon", "Watcher._wait", "wait"),
    ("trainq.watcher.daemon.finishing", "Finishing.reap_finished", "reap_finished"),
    ("trainq.watcher.daemon.intake", "Intake.admit_inbox", "admit"),
    ("trainq.watcher.daemon.starting", "Starting.start_pending", "start_pending"),
    ("trainq.watcher.daemon.starting", "Starting._launch", "launch"),
    ("trainq.watcher.supervisor.spawner", "Spawner._launch_direct", "hand_over"),
    ("trainq.watcher.daemon.finishing", "Finishing.retire_concluded", "retire"),
    ("trainq.watcher.daemon.daemon", "Watcher.write_status", "status"),
)

#: the same in the spawner helper and the pooled supervisors it forks
SUPERVISOR_STEPS = (
    ("trainq.watcher.supervisor.pool", "_await_job", "await"),
    ("trainq.watcher.supervisor.pool", "take_direct", "take"),
    ("trainq.watcher.supervisor.pool", "_supervise", "supervise"),
    ("trainq.watcher.supervisor.story", "read_snapshot", "snapshot_read"),
    ("trainq.watcher.supervisor.attempt", "_spawn_contained", "spawn"),
    ("trainq.watcher.supervisor.story", "write_snapshot", "snapshot_write"),
    ("trainq.watcher.supervisor.attempt", "_write_started", "start_record"),
    ("trainq.watcher.supervisor.story", "started", "started_event"),
    ("trainq.watcher.supervisor.attempt", "_watch", "watch"),
    ("trainq.watcher.supervisor.attempt", "_write_exit", "exit_record"),
    ("trainq.watcher.supervisor.pool", "_end_attempt", "notify"),
)

#: inside the watcher's steps: intake's reading, validation and claim; planning; the launch's parts; retiring
FINE_WATCHER_STEPS = (
    ("trainq.watcher.daemon.inbox", "Inbox.scan", "intake: scan inbox/"),
    ("trainq.watcher.daemon.intake", "Intake._take_unguarded", "intake: take one file"),
    ("trainq.watcher.daemon.intake", "Intake._validate", "intake: validate"),
    ("trainq.watcher.spec.jobspec", "read_spec_text", "intake: read the file"),
    ("trainq.watcher.spec.jobspec", "parse_job_text", "intake: parse + schema + checks"),
    ("trainq.watcher.daemon.state", "LoopState.check_allowed", "intake: allowed commands"),
    ("trainq.watcher.daemon.state", "LoopState.check_pool", "intake: pool"),
    ("trainq.watcher.daemon.intake", "new_run", "intake: new run.json"),
    ("trainq.watcher.spec.folders", "Folders.claim", "intake: claim into pending/"),
    ("trainq.watcher.daemon.intake", "Intake._accepted", "intake: accepted"),
    ("trainq.watcher.daemon.records", "accepted", "intake: accepted event"),
    ("trainq.watcher.spec.folders", "Folders.start", "launch: move into running/"),
    ("trainq.watcher.daemon.starting", "check_command_allowed", "launch: command allowed"),
    ("trainq.watcher.daemon.starting", "Starting._job_env", "launch: environment"),
    ("trainq.watcher.daemon.resources", "ResourceProbe.sample", "plan: the machine sampled"),
    ("trainq.watcher.daemon.starting", "Starting._plan", "plan: admission"),
    ("trainq.watcher.daemon.starting", "Starting._snapshot_request", "launch: snapshot request"),
    ("trainq.watcher.daemon.executor", "LocalExecutor.launch", "launch: the executor's launch"),
    ("trainq.watcher.daemon.jobs", "Job.save", "retire: run.json written"),
    ("trainq.watcher.spec.folders", "Folders.finish", "retire: move into done/"),
    ("trainq.watcher.daemon.records", "finished", "retire: finished event"),
    ("trainq.watcher.daemon.report", "Report.finished", "retire: report's entry"),
    ("trainq.watcher.daemon.report", "_last_look", "retire: report's last look at output.log"),
    ("trainq.watcher.daemon.report", "Report._record_history", "retire: history line"),
)

#: inside the pooled supervisor's take and the steps before the spawn
FINE_SUPERVISOR_STEPS = (
    ("trainq.watcher.supervisor.attempt_io", "LaunchSpec.from_dict", "take: decode the request"),
    ("trainq.watcher.supervisor.pool", "_take_lock", "take: lock"),
    ("trainq.watcher.supervisor.pool", "_clear_records", "take: clear records"),
    ("trainq.watcher.supervisor.pool", "_open_log", "take: open output.log"),
    ("trainq.watcher.supervisor.pool", "_send_quietly", "take: answer"),
    ("trainq.watcher.supervisor.attempt", "_install_stop_handlers", "prepare: stop handlers"),
    ("trainq.watcher.supervisor.attempt", "_become_subreaper", "prepare: subreaper"),
    ("trainq.watcher.supervisor.attempt", "_write_line", "prepare: banner"),
    ("trainq.watcher.supervisor.attempt", "_job_env", "prepare: environment"),
    ("trainq.watcher.supervisor.story", "CheckpointWatch.from_now", "prepare: checkpoint watch"),
    ("trainq.watcher.supervisor.cgroups", "Containment.group_for", "prepare: make the cgroup"),
    ("trainq.watcher.supervisor.cgroups", "enter", "spawn: enter the cgroup"),
    ("trainq.watcher.supervisor.attempt", "_spawn", "spawn: Popen (vfork + exec)"),
    ("trainq.watcher.supervisor.attempt", "_clone_into_group", "spawn: cloned into the cgroup (clone3 + exec)"),
    ("trainq.watcher.supervisor.attempt", "_keep_moves_quick", "after the start: the cgroup lock kept quick"),
    ("trainq.watcher.supervisor.cgroups", "leave", "spawn: leave the cgroup"),
)

_lines: list[str] = []


def _flush(folder: str) -> None:
    if _lines:
        with open(os.path.join(folder, f"{os.getpid()}.stamps"), "a", encoding="ascii") as f:
            f.write("".join(_lines))
        _lines.clear()


def _wrap(module: str, path: str, step: str, after: Callable[[], None] | None = None) -> None:
    owner = importlib.import_module(module)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    original = getattr(owner, name)

    @functools.wraps(original)
    def stamped(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            _lines.append(f"{step} {start:.6f} {time.perf_counter():.6f} {time.thread_time() - cpu:.6f}\n")
            if after is not None:
                after()

    setattr(owner, name, stamped)


def install(folder: str, argv: list[str]) -> None:
    """Wrap the steps of the process ``argv`` names (the watcher's loop, or the spawner helper's tree)."""
    words = " ".join(argv)
    fine = os.environ.get("CYCLE_STAMPS_FINE") == "1"
    if "trainq.watcher.supervisor.spawner" in words:
        for module, path, step in SUPERVISOR_STEPS + (FINE_SUPERVISOR_STEPS if fine else ()):
            _wrap(module, path, step, functools.partial(_flush, folder) if step == "supervise" else None)
    elif "trainq.watcher" in words and " watch" in words:
        for module, path, step in WATCHER_STEPS + (FINE_WATCHER_STEPS if fine else ()):
            _wrap(module, path, step)
        atexit.register(_flush, folder)


if os.environ.get("CYCLE_STAMPS"):
    install(os.environ["CYCLE_STAMPS"], list(getattr(sys, "orig_argv", sys.argv)))
