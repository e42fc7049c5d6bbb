"""Issue 23, item 2: on_finish hooks run exactly once, durably, and contained like jobs (real watcher processes).

Before: hooks waiting behind the runner cap lived only in memory (after a crash only the 50 most recently
finished jobs got theirs), a FIFO left as hook.log blocked a runner forever, and a hook that killed its
runner (``kill -9 $PPID``) escaped its 60 s limit.
"""

from __future__ import annotations

import collections
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
