"""The spawner helper: supervisors forked from a small process, with a fallback when it is gone."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

from conftest import wait_until
from watcher.contract import JobPaths
from watcher.spawner import SpawningSupervisor
from watcher.supervisor import LaunchSpec


def spec_for(tmp_path: Path, name: str, argv: tuple[str, ...]) -> LaunchSpec:
    job_dir = tmp_path / name
    job_dir.mkdir()
    return LaunchSpec(job_dir=str(job_dir), argv=argv, env=dict(os.environ), cwd=str(job_dir), attempt=1,
                      stop_grace_s=0.5, kill_after_s=0.5)


def test_launches_go_through_the_helper_and_exits_are_reported(tmp_path):
    sup = SpawningSupervisor()
    try:
        spec = spec_for(tmp_path, "a", ("sh", "-c", "echo through-the-helper"))
        pid = sup.launch(spec)
        helper = sup._spawner._proc.pid
        assert helper != os.getpid() and pid not in sup.forked_pids  # not forked by this (watcher) process
        assert sup.wake_fds(), "the loop must be able to wait on the helper"
        paths = JobPaths(Path(spec.job_dir))
        wait_until(lambda: sup.read_exit(paths), 10)
        assert "through-the-helper" in paths.log.read_text()
        reaped = []
        wait_until(lambda: reaped.extend(sup.reap()) or pid in reaped, 10, what="the helper's exit notice")
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
        wait_until(lambda: not sup.forked_pids or sup.reap() and not sup.forked_pids, 10)
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
