"""Every job attempt runs under its own small supervisor process, so the watcher can die or restart freely.

A supervisor detaches (own session, no inherited fds, default signal dispositions), becomes a child
subreaper, takes the job's lock, starts the job with its output going straight to ``output.log``,
writes the start record, watches stop.flag / timeout / its own SIGTERM, escalates stop → SIGTERM →
SIGKILL over its whole process tree, and writes the exit record only once every process of the
attempt is gone; then it releases the lock. "Lock held" means "attempt alive".

``Supervisor.launch`` either forks one on the spot (taking the lock before the fork) or, with
``keep_warm`` (the spawner helper), hands the job to a ``SupervisorPool`` member forked and detached
ahead of time, which answers once it holds the lock. A pooled supervisor runs one attempt at a time
and then waits for the next instead of exiting: a trivial attempt then costs no fork, no detaching
and no process teardown.

Where things are:

- ``attempt.py``: one attempt's supervision: the supervise / watch / stop / escalate loop and the start
  record. ``attempt_io.py``: what an attempt is handed and leaves behind: ``LaunchSpec``, taking the
  job's lock, output.log and its notes, the exit record and how it is published. ``foreground.py``:
  ``run_in_foreground`` with the ``python -m trainq.watcher.supervisor`` entry point (``main``).
- ``pool.py``: ``Supervisor`` (the watcher's handle: launch, reap, query) and ``SupervisorPool`` with
  its pooled members; forking and detaching a supervisor.
- ``leftovers.py``: liveness (``is_alive``, ``lock_state``), the process tree, the boot id, and
  ``kill_leftovers`` for a job whose supervisor died.
- ``cgroups.py``: containment by the kernel: which mode this machine allows (cgroup-v2, cgroup-v1,
  process-tree), a cgroup per attempt and per hook, and ending a whole group at once.
- ``hooks.py`` (the on_finish runner, a process of its own) and ``hook_launcher.py`` (the watcher's
  side): due hooks on disk, run exactly once, contained like jobs.
- ``signals.py``: the watcher's own signal handlers (the daemon installs them; a supervisor drops them).
- ``spawner.py``: the helper process that forks supervisors, so launching never forks the big watcher.
- ``snapshot.py`` and ``story.py``: what an attempt records (``snapshot/``, its events in events.jsonl);
  ``stacks.py``: a stalled job's Python stacks (py-spy); ``deliver.py``: copying results off the box.

This package starts and signals the jobs' processes, so it imports ``subprocess`` and ``signal``.
Elsewhere in the watcher ``signal`` is not imported at all; ``subprocess`` is, by the Slurm wing
(watcher/slurm/: ``state.py``, ``polling.py``, ``submit.py``, ``submitting.py`` run Slurm's commands),
watcher/daemon/vitals.py (starting the stacks runner) and watcher/cli/ (``demo.py``, ``edit.py``,
``rerun.py``).
"""

from trainq.watcher.supervisor.attempt_io import LaunchSpec, open_job_log
from trainq.watcher.supervisor.foreground import main, run_in_foreground, shell_status
from trainq.watcher.supervisor.leftovers import (
    boot_id,
    is_alive,
    is_this_boot,
    kill_leftovers,
    lock_state,
    process_tree,
)
from trainq.watcher.supervisor.pool import Supervisor, SupervisorPool

__all__ = [
    "LaunchSpec",
    "Supervisor",
    "SupervisorPool",
    "boot_id",
    "is_alive",
    "is_this_boot",
    "kill_leftovers",
    "lock_state",
    "main",
    "open_job_log",
    "process_tree",
    "run_in_foreground",
    "shell_status",
]
