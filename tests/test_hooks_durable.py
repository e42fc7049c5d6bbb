"""Issue 23, item 2: on_finish hooks run exactly once, durably, and contained like jobs (real watcher processes).

Before: hooks waiting behind the runner cap lived only in memory (after a crash only the 50 most recently
finished jobs got theirs), a FIFO left as hook.log blocked a runner forever, and a hook that killed its
runner (``kill -9 $PPID``) escaped its 60 s limit.
"""

from __future__ import annotations

import collections
import fcntl
import os
import signal
from pathlib import Path

import psutil
import pytest
from conftest import drop, wait_until

from trainq.watcher.spec.fsutil import read_json


def hook_state(queue_dir: Path, state: str, job: str) -> dict:
    return read_json(queue_dir / state / job / "hook.json") or {}


@pytest.mark.slow  # 200 runners (a Python process each): ~75 s at load 18, about a third of that on a quiet machine
def test_200_due_hooks_all_run_exactly_once_across_a_watcher_sigkill(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text("settle_s: 0.1\nrescan_s: 0.5\nmax_concurrent: 8\n")
    ran = queue_dir / "hooks-ran.txt"
    wp = watcher_process()
    n = 200
    drop(
        queue_dir,
        "many.yaml",
        f"approved: true\ncommand: ['true', '{{i}}']\n"
        f"on_finish: [sh, -c, 'echo $TRAINQ_JOB_ID >> {ran}']\n"
        f"sweep: {{i: {list(range(n))}}}\n",
    )
    ids = [f"many-{i}" for i in range(1, n + 1)]
    wait_until(lambda: all((queue_dir / "done" / j).is_dir() for j in ids), 120, what="all 200 jobs done")
    wp.kill()  # SIGKILL: most hooks are still due, waiting behind the runner cap
    left = sum(1 for j in ids if hook_state(queue_dir, "done", j).get("state") != "ended")
    watcher_process()
    wait_until(
        lambda: all(hook_state(queue_dir, "done", j).get("state") == "ended" for j in ids),
        180,
        what="every hook to end after the restart",
    )
    counts = collections.Counter(ran.read_text().split())
    assert sorted(counts) == sorted(ids), f"{n - len(counts)} hooks never ran ({left} were not ended at the kill)"
    assert set(counts.values()) == {1}, [j for j, c in counts.items() if c > 1]
    assert all(hook_state(queue_dir, "done", j).get("exit_code") == 0 for j in ids)


def test_a_fifo_left_as_hook_log_does_not_block_the_runner(queue_dir, watcher_process):
    """Also a FIFO as hook.lock: the job cannot keep its own hook from running that way either."""
    watcher_process()
    drop(
        queue_dir, "fifo.yaml", "approved: true\ncommand: [mkfifo, hook.log, hook.lock]\non_finish: [echo, hook ran]\n"
    )
    wait_until(lambda: hook_state(queue_dir, "done", "fifo").get("state") == "ended", 60, what="the hook to end")
    log = queue_dir / "done" / "fifo" / "hook.log"
    assert log.is_file() and not log.is_symlink() and "hook ran" in log.read_text()
    assert hook_state(queue_dir, "done", "fifo")["exit_code"] == 0


@pytest.mark.parametrize("mode", ["auto", "process-tree"])
def test_a_hook_that_kills_its_runner_is_still_held_to_its_limit(queue_dir, watcher_process, mode):
    """auto: a cgroup where this machine has one (the watcher kills the group at the limit); process-tree:
    the hook's leftovers are found by TRAINQ_JOB_DIR and killed once the runner is seen gone."""
    watcher_process(env={"TRAINQ_HOOK_TIMEOUT_S": "2", "TRAINQ_CONTAINMENT": mode})
    drop(
        queue_dir,
        "rogue.yaml",
        "approved: true\ncommand: ['true']\n"
        "on_finish: [sh, -c, 'echo $$ > rogue.pid; kill -9 $PPID; exec sleep 600']\n",
    )
    pid_file = queue_dir / "done" / "rogue" / "rogue.pid"
    wait_until(pid_file.exists, 60, what="the hook to start")
    pid = int(wait_until(lambda: pid_file.read_text().strip(), 10))
    try:
        wait_until(
            lambda: hook_state(queue_dir, "done", "rogue").get("state") == "ended",
            60,
            what="the watcher to end the hook whose runner it killed",
        )
        record = hook_state(queue_dir, "done", "rogue")
        assert record["runner_lost"] is True and record["exit_code"] is None, record
        if record["containment"] != "process-tree":
            assert record["timed_out"] is True, record  # its group was held until the limit, then killed
        wait_until(lambda: not _alive(pid), 10, what="the hook's sleep to be killed")
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- a retry.flag and the due hook of the failure it retries (the soak's finding, docs/reliability.md) --------
# Before: retry.flag was honoured at once, so a failure whose hook was still due (waiting behind the runner
# cap, or its runner not yet past hook.lock, as after a watcher SIGKILL on a loaded machine) lost its hook:
# the retry removed hook.json and moved the folder, and the conclusion's on_finish never ran.

#: job f: waits for ``go`` in its folder, fails on its first attempt, succeeds on the retry
FAIL_ONCE = "while [ ! -e go ]; do sleep 0.05; done; if [ -e second ]; then exit 0; fi; touch second; exit 3"


def _fail_once_job(queue_dir: Path, ran: Path) -> None:
    drop(
        queue_dir,
        "f.yaml",
        f"approved: true\ncommand: [sh, -c, '{FAIL_ONCE}']\n"
        f"on_finish: [sh, -c, 'echo \"$TRAINQ_STATUS $TRAINQ_JOB_DIR\" >> {ran}']\n",
    )


def _hooks_ran(ran: Path) -> list[str]:
    return ran.read_text().splitlines() if ran.exists() else []


def _marker_done(queue_dir: Path, name: str) -> None:
    """A job dropped now and seen done: the watcher has since passed over every retry.flag at least once."""
    drop(queue_dir, f"{name}.yaml", "approved: true\ncommand: ['true']\n")
    wait_until(lambda: (queue_dir / "done" / name).is_dir(), 60, what=f"the marker job {name} to end")


def _both_conclusions_hooked(queue_dir: Path, ran: Path) -> None:
    wait_until(
        lambda: hook_state(queue_dir, "done", "f").get("state") == "ended", 120, what="the retried job's hook to end"
    )
    assert _hooks_ran(ran) == [f"failed {queue_dir / 'failed' / 'f'}", f"done {queue_dir / 'done' / 'f'}"], (
        "one hook per conclusion, each with the folder it concluded in"
    )


def test_a_retry_waits_for_the_failures_hook_queued_behind_the_runner_cap(queue_dir, watcher_process):
    """Eight hooks hold every runner slot until ``release`` exists; f's failure hook waits in the queue."""
    (queue_dir / "watcher.yaml").write_text("settle_s: 0.1\nrescan_s: 0.2\nmax_concurrent: 10\n")
    ran, release = queue_dir / "hooks-ran.txt", queue_dir / "release"
    watcher_process()
    drop(
        queue_dir,
        "block.yaml",
        f"approved: true\ncommand: ['true', '{{i}}']\nsweep: {{i: [1, 2, 3, 4, 5, 6, 7, 8]}}\n"
        f"on_finish: [sh, -c, 'while [ ! -e {release} ]; do sleep 0.05; done']\n",
    )
    blockers = [f"block-{i}" for i in range(1, 9)]
    wait_until(
        lambda: all(hook_state(queue_dir, "done", j).get("state") == "running" for j in blockers),
        90,
        what="eight hooks to hold every runner slot",
    )
    _fail_once_job(queue_dir, ran)
    wait_until(lambda: (queue_dir / "running" / "f").is_dir(), 60, what="f to start")
    (queue_dir / "running" / "f" / "go").touch()
    wait_until(lambda: hook_state(queue_dir, "failed", "f").get("state") == "due", 60, what="f to fail, hook due")
    (queue_dir / "failed" / "f" / "retry.flag").touch()
    _marker_done(queue_dir, "marker")
    release.touch()
    _both_conclusions_hooked(queue_dir, ran)


def test_a_retry_after_a_watcher_sigkill_does_not_overtake_the_failures_hook(queue_dir, watcher_process):
    """The soak's case: f failed, its hook due, the watcher SIGKILLed; retry.flag is touched, a watcher starts.

    The test holds f's hook.lock (a runner alive, not yet past it: "lock held" means "runner alive",
    hooks.py) from before f fails until the restarted watcher has passed over retry.flags; so the window
    between "a runner started" and "the hook is running" is as wide as the soak's ~33 s, every time.
    """
    (queue_dir / "watcher.yaml").write_text("settle_s: 0.1\nrescan_s: 0.2\n")
    ran = queue_dir / "hooks-ran.txt"
    wp = watcher_process()
    _fail_once_job(queue_dir, ran)
    wait_until(lambda: (queue_dir / "running" / "f").is_dir(), 60, what="f to start")
    lock_fd = os.open(queue_dir / "running" / "f" / "hook.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # the lock is on the file: it stays held as the folder moves
        (queue_dir / "running" / "f" / "go").touch()
        wait_until(lambda: hook_state(queue_dir, "failed", "f").get("state") == "due", 60, what="f to fail")
        wp.kill()  # SIGKILL
        (queue_dir / "failed" / "f" / "retry.flag").touch()
        watcher_process()
        _marker_done(queue_dir, "marker")
    finally:
        os.close(lock_fd)
    _both_conclusions_hooked(queue_dir, ran)
