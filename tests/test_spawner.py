"""The spawner helper: supervisors forked from a small process, with a fallback when it is gone."""

from __future__ import annotations

import os
import select
import signal
from pathlib import Path

import psutil
from conftest import wait_until

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.supervisor import LaunchSpec
from trainq.watcher.supervisor.spawner import SpawningSupervisor


def spec_for(tmp_path: Path, name: str, argv: tuple[str, ...]) -> LaunchSpec:
    job_dir = tmp_path / name
    job_dir.mkdir()
    return LaunchSpec(
        job_dir=str(job_dir),
        argv=argv,
        env=dict(os.environ),
        cwd=str(job_dir),
        attempt=1,
        stop_grace_s=0.5,
        kill_after_s=0.5,
    )


def test_launches_go_through_the_helper_and_exits_are_announced(tmp_path):
    sup = SpawningSupervisor()
    try:
        spec = spec_for(tmp_path, "a", ("sh", "-c", "echo through-the-helper"))
        pid = sup.launch(spec)
        helper = sup._spawner._proc.pid
        assert helper != os.getpid() and pid not in sup.forked_pids  # not forked by this (watcher) process
        assert psutil.Process(pid).ppid() == helper
        paths = JobPaths(Path(spec.job_dir))
        # the supervisor announces its exit record on a pipe the loop selects on
        wait_until(
            lambda: select.select(sup.wake_fds(), [], [], 0.5)[0] and sup.reap() is not None and sup.read_exit(paths),
            10,
            what="the exit notice",
        )
        assert "through-the-helper" in paths.log.read_text()
        assert not sup.is_alive(paths), "the lock is released once the exit record is there"
    finally:
        sup.close()


def _blocked_reading_a_pipe(pid: int) -> bool:
    """The kernel says ``pid`` sleeps in a pipe read (``/proc/PID/wchan``: pipe_read, anon_pipe_read, ...)."""
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False
    return "pipe" in wchan and "read" in wchan


def test_a_pooled_supervisor_runs_one_attempt_after_another(tmp_path):
    sup = SpawningSupervisor()
    try:
        first = spec_for(tmp_path, "first", ("sh", "-c", "echo one; exit 3"))
        pid = sup.launch(first)
        first_paths = JobPaths(Path(first.job_dir))
        wait_until(lambda: sup.read_exit(first_paths), 10)
        # it writes the exit record, then says "idle" and blocks reading its next request; a launch before
        # that rightly gets a freshly forked supervisor (the test flaked so on a loaded machine)
        wait_until(lambda: _blocked_reading_a_pipe(pid), 10, what="the first supervisor to wait for more work")
        second = spec_for(tmp_path, "second", ("sh", "-c", "echo two"))
        wait_until(lambda: sup.reap() is not None and sup.launch(second), 10, what="the second launch")
        second_paths = JobPaths(Path(second.job_dir))
        wait_until(lambda: sup.read_exit(second_paths), 10)
        assert sup.read_started(second_paths)["supervisor_pid"] == pid, "the same process supervised both"
        assert sup.read_exit(first_paths)["exit_code"] == 3 and sup.read_exit(second_paths)["exit_code"] == 0
        assert "two" not in first_paths.log.read_text() and "one" not in second_paths.log.read_text()
        assert psutil.Process(pid).is_running(), "it waits for a third"
    finally:
        sup.close()
    wait_until(
        lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
        10,
        what="the pooled supervisor to leave with its helper",
    )


def test_a_supervisor_told_to_stop_leaves_after_its_attempt(tmp_path):
    sup = SpawningSupervisor()
    try:
        spec = spec_for(tmp_path, "stopped", ("sleep", "30"))
        pid = sup.launch(spec)
        paths = JobPaths(Path(spec.job_dir))
        wait_until(lambda: sup.read_started(paths), 10)
        os.kill(pid, signal.SIGTERM)
        record = wait_until(lambda: sup.read_exit(paths), 10)
        assert record["stop_reason"] == "sigterm"
        wait_until(
            lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
            10,
            what="the stopped supervisor to leave instead of waiting for another attempt",
        )
    finally:
        sup.close()


def test_a_dead_helper_falls_back_to_forking_in_process(tmp_path):
    sup = SpawningSupervisor()
    try:
        first = spec_for(tmp_path, "first", ("true",))
        sup.launch(first)
        helper = sup._spawner._proc.pid
        os.kill(helper, signal.SIGKILL)
        wait_until(lambda: not sup._spawner.is_running, 10)
        second = spec_for(tmp_path, "second", ("sh", "-c", "echo forked-here"))
        pid = sup.launch(second)
        assert pid in sup.forked_pids  # this process forked it itself
        paths = JobPaths(Path(second.job_dir))
        wait_until(lambda: sup.read_exit(paths), 10)
        assert "forked-here" in paths.log.read_text()
        wait_until(lambda: not sup.forked_pids or (sup.reap() and not sup.forked_pids), 10)
    finally:
        sup.close()


def test_helper_leaves_when_the_watcher_closes_it_and_jobs_live_on(tmp_path):
    sup = SpawningSupervisor()
    spec = spec_for(tmp_path, "long", ("sleep", "30"))
    sup.launch(spec)
    helper = sup._spawner._proc.pid
    sup.close()
    assert not psutil.pid_exists(helper) or psutil.Process(helper).status() == psutil.STATUS_ZOMBIE
    paths = JobPaths(Path(spec.job_dir))
    assert sup.is_alive(paths), "the attempt never depended on the helper"
    (paths.stop_flag).touch()
    wait_until(lambda: sup.read_exit(paths), 15)
