"""The spawner helper: supervisors forked from a small process, with a fallback when it is gone."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import wait_until

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.supervisor import LaunchSpec, Supervisor
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


def _waiting_for_work(pid: int) -> bool:
    """The kernel says ``pid`` sleeps waiting for a request: in select over the helper's pipe and the watcher's
    jobs socket (``/proc/PID/wchan``: poll_schedule_timeout, do_select), or in a pipe read."""
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False
    return any(word in wchan for word in ("skb_wait", "recv", "poll", "select")) or (
        "pipe" in wchan and "read" in wchan
    )


def test_pooled_supervisors_run_one_attempt_after_another(tmp_path):
    sup = SpawningSupervisor()
    runs = []
    try:
        for n in range(4):  # one at a time, each waiting for the last one's exit record
            spec = spec_for(tmp_path, f"job{n}", ("sh", "-c", f"echo run-{n}; exit {n}"))
            pid = sup.launch(spec)
            paths = JobPaths(Path(spec.job_dir))
            wait_until(lambda: sup.read_exit(paths), 10)  # noqa: B023 (used in this iteration only)
            # it writes the exit record, then says "idle" and waits for its next request; a launch before
            # that rightly gets another one (the test flaked so on a loaded machine)
            wait_until(lambda: _waiting_for_work(pid), 10, what="the supervisor to wait for more work")  # noqa: B023
            runs.append((pid, paths))
        pids = [pid for pid, _ in runs]
        # the watcher hands a job to whichever pooled supervisor waits (one kept ahead, plus the one that just
        # finished): two processes at most for four attempts in a row
        assert len(set(pids)) <= 2, f"supervisors were reused: {pids}"
        for n, (pid, paths) in enumerate(runs):
            assert sup.read_started(paths)["supervisor_pid"] == pid
            assert sup.read_exit(paths)["exit_code"] == n
            assert paths.log.read_text().count("run-") == 1 and f"run-{n}" in paths.log.read_text()
        assert all(psutil.Process(pid).is_running() for pid in pids), "they wait for more"
    finally:
        sup.close()
    wait_until(
        lambda: all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids),
        10,
        what="the pooled supervisors to leave with their helper",
    )


def test_the_helper_lets_surplus_supervisors_go_and_keeps_running(tmp_path):
    """The soak's finding (2026-12-07): when more than POOL_IDLE_MAX pooled supervisors said "idle" at once, the
    helper closed the surplus one's pipes and then read them again: EBADF ended the helper (29 times in one soak),
    and every launch until the next watcher fell back to forking in the watcher itself."""
    from trainq.watcher.supervisor.pool import POOL_IDLE_MAX

    gate = tmp_path / "gate"
    sup = SpawningSupervisor()
    try:
        busy = POOL_IDLE_MAX + 2
        specs = [
            spec_for(tmp_path, f"held{n}", ("sh", "-c", f"while [ ! -e '{gate}' ]; do sleep 0.02; done"))
            for n in range(busy)
        ]
        pids = [sup.launch(spec) for spec in specs]
        assert len(set(pids)) == busy and not set(pids) & sup.forked_pids
        for spec in specs:
            wait_until(lambda: sup.read_started(JobPaths(Path(spec.job_dir))), 10)  # noqa: B023
        helper = sup._spawner._proc
        gate.touch()  # every one ends at once and says "idle": the helper keeps POOL_IDLE_MAX, lets the rest go
        for spec in specs:
            wait_until(lambda: sup.read_exit(JobPaths(Path(spec.job_dir))), 10)  # noqa: B023
        wait_until(
            lambda: (
                sum(1 for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie") <= POOL_IDLE_MAX
            ),
            10,
            what="the surplus supervisors to leave",
        )
        time.sleep(0.3)  # the helper's next turns of its loop
        assert helper.poll() is None, "the helper died letting the surplus go"
        after = spec_for(tmp_path, "after", ("sh", "-c", "echo after"))
        pid = sup.launch(after)
        assert pid not in sup.forked_pids, "the launch fell back to forking in this process"
        wait_until(lambda: sup.read_exit(JobPaths(Path(after.job_dir))), 10)
    finally:
        gate.touch()
        sup.close()


def test_a_pooled_supervisor_killed_while_it_waits_is_reaped_and_the_pool_goes_on(tmp_path):
    """The helper waits for its children only when SIGCHLD (or a quiet second) says one ended: a waiting pooled
    supervisor killed from outside still leaves no zombie, and the next launch finds a live one."""
    sup = SpawningSupervisor()
    try:
        first = spec_for(tmp_path, "first", ("sh", "-c", "echo first"))
        pid = sup.launch(first)
        wait_until(lambda: sup.read_exit(JobPaths(Path(first.job_dir))), 10)
        wait_until(lambda: _waiting_for_work(pid), 10, what="the supervisor to wait for more work")
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not psutil.pid_exists(pid), 10, what="the helper to reap the killed supervisor")
        assert sup._spawner._proc.poll() is None, "the helper keeps running"
        after = spec_for(tmp_path, "after", ("sh", "-c", "echo after"))
        assert sup.launch(after) != pid
        wait_until(lambda: sup.read_exit(JobPaths(Path(after.job_dir))), 10)
        assert "after" in JobPaths(Path(after.job_dir)).log.read_text()
    finally:
        sup.close()


def test_a_row_of_jobs_does_not_wake_the_helper(tmp_path):
    """Each pooled supervisor used to tell the helper when it took a job ("taken") and when it waited again ("idle"):
    two wake-ups of the helper a job, for nothing while another supervisor waited. Now a supervisor tells it only
    when its take leaves nobody waiting, so a row of jobs, one at a time, leaves the helper asleep but for its
    select's one-second turns."""
    sup = SpawningSupervisor()
    try:
        first = spec_for(tmp_path, "first", ("true",))
        pid = sup.launch(first)  # the only one waiting took it: the helper hears so and forks the next
        wait_until(lambda: sup.read_exit(JobPaths(Path(first.job_dir))), 10)
        wait_until(lambda: _waiting_for_work(pid), 10, what="the first supervisor to wait again")
        wait_until(lambda: len([p for p in _helper_children(sup) if _waiting_for_work(p)]) >= 2, 10, what="a second")
        helper = psutil.Process(sup._spawner._proc.pid)
        woken, since = helper.num_ctx_switches().voluntary, time.monotonic()
        jobs = 30
        for n in range(jobs):
            spec = spec_for(tmp_path, f"row{n}", ("true",))
            pid = sup.launch(spec)
            wait_until(lambda: sup.read_exit(JobPaths(Path(spec.job_dir))), 10)  # noqa: B023
            wait_until(lambda: _waiting_for_work(pid), 10, what="the supervisor to wait again")  # noqa: B023
        woken = helper.num_ctx_switches().voluntary - woken
        turns = time.monotonic() - since + 2  # its select times out once a second
        assert woken <= turns, f"the helper woke {woken} times for {jobs} jobs in a row ({turns:.0f} turns)"
    finally:
        sup.close()


@pytest.mark.parametrize("lock", ["memfd", "temporary file"])
def test_the_board_tells_the_second_of_two_takers_that_nobody_waits_and_lets_a_surplus_one_go(lock):
    """The board's rules, with its lock on a memfd and on the temporary file used where there is no memfd."""
    from trainq.watcher.supervisor.pool import POOL_IDLE_MAX, _Board, _temporary_lock_file

    board = _Board(_temporary_lock_file() if lock == "temporary file" else None)
    first, second = board.claim(), board.claim()  # the helper places each supervisor it forks as waiting
    assert first is not None and second is not None and board.waits(first) and board.waits(second)
    child = os.fork()  # the board is shared memory: a supervisor is a process of its own
    if child == 0:
        os._exit(0 if board.take(first) else 1)  # the other one still waits: no word to the helper
    assert os.waitpid(child, 0)[1] == 0 and not board.waits(first)
    assert board.take(second) is False, "nobody waits now: this taker must tell the helper"
    assert not board.anyone_waits()
    assert board.wait_again(first) and board.anyone_waits()
    more = [board.claim() for _ in range(POOL_IDLE_MAX - 1)]
    assert None not in more
    assert board.wait_again(second) is False, "POOL_IDLE_MAX others wait: this one leaves"
    board.free(second)
    assert board.claim() == second, "a reaped supervisor's place is the next one's"


def test_jobs_launched_back_to_back_each_find_a_pooled_supervisor(tmp_path):
    """Each take that leaves nobody waiting tells the helper, which forks the next one: a row of launches with no
    wait between them goes to pooled supervisors (which wait for more work afterwards), not to the helper's one-off
    fallback (which leaves after its attempt)."""
    from trainq.watcher.supervisor.pool import POOL_IDLE_MAX

    gate = tmp_path / "gate"
    sup = SpawningSupervisor()
    try:
        specs = [
            spec_for(tmp_path, f"held{n}", ("sh", "-c", f"while [ ! -e '{gate}' ]; do sleep 0.02; done"))
            for n in range(POOL_IDLE_MAX - 1)  # with the one forked for the next launch, none is surplus after
        ]
        pids = [sup.launch(spec) for spec in specs]
        assert len(set(pids)) == len(specs)
        gate.touch()
        for spec in specs:
            wait_until(lambda: sup.read_exit(JobPaths(Path(spec.job_dir))), 10)  # noqa: B023
        for pid in pids:
            wait_until(lambda: _waiting_for_work(pid), 10, what=f"supervisor {pid} to wait for more work")  # noqa: B023
    finally:
        gate.touch()
        sup.close()


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


def test_a_lost_helper_is_started_again_and_launches_go_through_it(tmp_path):
    """Until 2026-12-07 a helper lost once (killed, or the soak's EBADF) was never started again: every launch for
    the rest of the watcher's life forked in the watcher, ~3 ms more each. Now the loop's reap starts a new one
    after HELPER_RESTART_S; a second loss in a row waits twice as long."""
    from trainq.watcher.supervisor import spawner

    sup = SpawningSupervisor()
    try:
        sup.launch(spec_for(tmp_path, "first", ("true",)))
        old = sup._spawner._proc.pid
        lost_at = time.monotonic()
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: sup._spawner is None or not sup._spawner.is_running, 10)
        sup.reap()  # hears of the loss
        assert sup._spawner is None and sup.restarts == 0
        (line,) = sup.problems()  # status.json's watcher.problems while it is lost
        assert line.startswith("spawner helper lost at ") and "killed by SIGKILL" in line and "next try" in line
        forked = sup.launch(spec_for(tmp_path, "meanwhile", ("true",)))
        assert forked in sup.forked_pids, "until the restart, launches fork here"
        wait_until(lambda: (sup.reap(), sup._spawner)[1] is not None, 10, what="the helper started again")
        assert time.monotonic() - lost_at >= spawner.HELPER_RESTART_S
        assert sup.restarts == 1 and sup._spawner.pid != old and sup.problems() == []
        after = spec_for(tmp_path, "after", ("sh", "-c", "echo through-the-new-helper"))
        pid = sup.launch(after)
        assert pid not in sup.forked_pids, "the launch went through the new helper"
        paths = JobPaths(Path(after.job_dir))
        wait_until(lambda: sup.read_exit(paths), 10)
        assert "through-the-new-helper" in paths.log.read_text()
        lost_again = time.monotonic()
        os.kill(sup._spawner.pid, signal.SIGKILL)
        wait_until(lambda: (sup.reap(), sup._spawner)[1] is None, 10, what="the second loss seen")
        wait_until(lambda: (sup.reap(), sup._spawner)[1] is not None, 15, what="the second restart")
        assert time.monotonic() - lost_again >= 2 * spawner.HELPER_RESTART_S, "a loss in a row waits longer"
        assert sup.restarts == 2
    finally:
        sup.close()
        sup.reap()


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


def _helper_children(sup: SpawningSupervisor) -> list[int]:
    return [p.pid for p in psutil.Process(sup._spawner._proc.pid).children()]


def _with_a_waiting_pool() -> tuple[SpawningSupervisor, list[int]]:
    """A started helper and the pooled supervisors already waiting for work (at least one)."""
    sup = SpawningSupervisor()
    sup.start_spawner()
    return sup, wait_until(lambda: [p for p in _helper_children(sup) if _waiting_for_work(p)], 20, what="a pooled one")


def _launch_in_background(sup: SpawningSupervisor, spec: LaunchSpec) -> tuple[threading.Thread, dict]:
    """``sup.launch(spec)`` on a thread of its own (started); the pid lands in the dict under "pid"."""
    result: dict = {}
    launcher = threading.Thread(target=lambda: result.update(pid=sup.launch(spec)), daemon=True)
    launcher.start()
    return launcher, result


def test_a_waiting_pooled_supervisor_takes_the_job_from_the_watcher_without_the_helper(tmp_path):
    sup, waiting = _with_a_waiting_pool()
    helper = sup._spawner._proc.pid
    os.kill(helper, signal.SIGSTOP)  # the helper cannot relay anything now
    try:
        spec = spec_for(tmp_path, "direct", ("sh", "-c", "echo handed-over"))
        pid = sup.launch(spec)
        assert pid in waiting, "the supervisor that waited took the job itself"
        paths = JobPaths(Path(spec.job_dir))
        wait_until(lambda: sup.read_exit(paths), 10, what="the exit record")
        assert "handed-over" in paths.log.read_text()
    finally:
        os.kill(helper, signal.SIGCONT)
        sup.close()


def test_a_request_taken_after_its_deadline_is_refused_once_the_lock_is_held(tmp_path):
    from trainq.watcher.supervisor.pool import take_direct

    spec = spec_for(tmp_path, "late", ("sh", "-c", "echo must-not-run"))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        ours.send(json.dumps({"spec": spec.to_dict(), "deadline": time.monotonic() - 0.001}).encode())
        assert take_direct(theirs) is None
        answer = json.loads(ours.recv(65536))
    assert answer["late"] is True and "stale" in answer["error"]
    assert (answer["job_dir"], answer["attempt"]) == (spec.job_dir, 1)
    paths = JobPaths(Path(spec.job_dir))
    assert not paths.log.exists() and not Supervisor.is_alive(paths), "nothing started, the lock was let go"


def test_when_no_pooled_supervisor_answers_in_time_the_helper_forks_one_and_the_job_runs_once(tmp_path):
    sup, waiting = _with_a_waiting_pool()
    for pid in waiting:
        os.kill(pid, signal.SIGSTOP)  # it cannot take the request before the deadline
    try:
        spec = spec_for(tmp_path, "fallback", ("sh", "-c", "echo ran-once"))
        pid = sup.launch(spec)
        assert pid not in waiting, "a supervisor forked for this launch took it"
        paths = JobPaths(Path(spec.job_dir))
        wait_until(lambda: sup.read_exit(paths), 10, what="the exit record")
    finally:
        for stopped in waiting:
            os.kill(stopped, signal.SIGCONT)  # each reads the stale request now and refuses it
    try:
        wait_until(lambda: all(_waiting_for_work(p) for p in waiting), 10, what="the stopped ones to wait again")
        time.sleep(0.2)
        assert paths.log.read_text().count("ran-once") == 1, "the stale request was not run again"
        assert sup.read_started(paths)["supervisor_pid"] == pid
    finally:
        sup.close()


def test_a_request_whose_watcher_died_is_left_alone_for_the_next_watcher_s_recovery(tmp_path):
    """The soak found it (2 of 2,000 jobs): a watcher SIGKILLed just after handing a retry's attempt 2 to the
    jobs socket, no pooled supervisor free; one took it 1.3 s later, as the next watcher's recovery looked at the
    folder, and cleared attempt 1's exit record under it: recovery called attempt 1 killed, the retry never ran.
    A request whose sender has closed its end is refused before anything in the folder changes."""
    from trainq.watcher.supervisor.pool import take_direct

    spec = spec_for(tmp_path, "orphaned", ("sh", "-c", "echo must-not-run"))
    paths = JobPaths(Path(spec.job_dir))
    paths.exit_record.write_text('{"attempt": 1, "exit_code": 3}\n')  # attempt 1's, which recovery reads
    paths.started.write_text('{"attempt": 1, "supervisor_pid": 1}\n')
    spec = dataclasses.replace(spec, attempt=2)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with theirs:
        ours.send(json.dumps({"spec": spec.to_dict(), "deadline": time.monotonic() + 60}).encode())
        ours.close()  # the watcher is gone; its request is still queued
        assert take_direct(theirs) is None
        with pytest.raises(EOFError):
            take_direct(theirs)  # then the end of file
    assert json.loads(paths.exit_record.read_text())["attempt"] == 1, "attempt 1's exit record is untouched"
    assert paths.started.exists() and not paths.log.exists() and not Supervisor.is_alive(paths)


def test_a_launch_waiting_on_the_socket_when_the_helper_and_its_pool_die_falls_back_to_forking_here(tmp_path):
    """Once every other holder of the jobs socket is gone, a read there is end of file at once: the launch must
    give up on the helper (and fork here), not read that end of file again and again."""
    sup, pool = _with_a_waiting_pool()
    helper = sup._spawner._proc.pid
    for pid in pool:
        os.kill(pid, signal.SIGSTOP)  # the request waits on the socket, untaken
    spec = spec_for(tmp_path, "orphaned-launch", ("sh", "-c", "echo forked-here-after-all"))
    try:
        launcher, result = _launch_in_background(sup, spec)
        time.sleep(0.3)
        for pid in [*_helper_children(sup), helper]:
            os.kill(pid, signal.SIGKILL)
        launcher.join(30)
        assert not launcher.is_alive(), "the launch returned"
        assert result["pid"] in sup.forked_pids, "this process forked the supervisor itself"
        paths = JobPaths(Path(spec.job_dir))
        wait_until(lambda: sup.read_exit(paths), 10, what="the exit record")
        assert paths.log.read_text().count("forked-here-after-all") == 1
    finally:
        sup.close()


def test_a_full_jobs_socket_never_blocks_a_launch(tmp_path):
    """Requests nobody reads (every pooled supervisor stuck) fill the socket; the next launch goes through the
    helper at once instead of blocking the watcher's loop in send."""
    sup, pool = _with_a_waiting_pool()
    for pid in pool:
        os.kill(pid, signal.SIGSTOP)
    try:
        junk = json.dumps({"junk": "x" * 4000}).encode()
        with contextlib.suppress(BlockingIOError):
            while True:
                sup._spawner._jobs.send(junk, socket.MSG_DONTWAIT)
        spec = spec_for(tmp_path, "full", ("sh", "-c", "echo went-through-the-helper"))
        launcher, result = _launch_in_background(sup, spec)
        launcher.join(20)
        assert not launcher.is_alive(), "the launch did not block on the full socket"
        assert result["pid"] not in pool
        wait_until(lambda: sup.read_exit(JobPaths(Path(spec.job_dir))), 10, what="the exit record")
    finally:
        for pid in pool:
            os.kill(pid, signal.SIGCONT)  # they read the junk and answer it with errors nobody waits for
        sup.close()


def test_a_launch_too_big_for_the_jobs_socket_goes_through_the_helper(tmp_path):
    from trainq.watcher.supervisor.pool import DIRECT_MAX_BYTES

    sup = SpawningSupervisor()
    try:
        spec = spec_for(tmp_path, "big-env", ("sh", "-c", 'echo "length ${#BIG}"'))
        spec = dataclasses.replace(spec, env={**spec.env, "BIG": "x" * (DIRECT_MAX_BYTES + 10_000)})
        sup.launch(spec)
        paths = JobPaths(Path(spec.job_dir))
        wait_until(lambda: sup.read_exit(paths), 10, what="the exit record")
        assert f"length {DIRECT_MAX_BYTES + 10_000}" in paths.log.read_text()
    finally:
        sup.close()


def _watcher_problems(root: Path) -> list[str]:
    try:
        return json.loads((root / "status.json").read_text())["watcher"].get("problems") or []
    except (OSError, ValueError, KeyError):
        return ["status.json unreadable"]


def _helpers_of(watcher_pid: int) -> list[psutil.Process]:
    """The watcher's live spawner helpers (a killed one is a zombie until the watcher reaps it)."""
    found = []
    for p in psutil.Process(watcher_pid).children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "trainq.watcher.supervisor.spawner" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue  # gone, or a zombie, between the listing and the look
    return found


def test_a_watcher_whose_helper_was_killed_runs_jobs_and_starts_a_new_one(queue_dir, watcher_process):
    """The same from the outside: a running watcher, its helper SIGKILLed. Jobs dropped meanwhile still run, a new
    helper appears, and watcher.log says both."""
    from conftest import drop

    w = watcher_process()
    old = wait_until(lambda: _helpers_of(w.proc.pid), 30, what="the first helper")[0].pid
    os.kill(old, signal.SIGKILL)
    drop(queue_dir, "during.yaml", "approved: true\ncommand: [sh, -c, 'echo ran-during']\n")
    wait_until(lambda: (queue_dir / "done" / "during").is_dir(), 30, what="the job dropped meanwhile done")
    new = wait_until(lambda: [p for p in _helpers_of(w.proc.pid) if p.pid != old], 30, what="a new helper")[0]
    drop(queue_dir, "after.yaml", "approved: true\ncommand: [sh, -c, 'echo ran-after']\n")
    wait_until(lambda: (queue_dir / "done" / "after").is_dir(), 30, what="the job dropped after done")
    assert "ran-after" in (queue_dir / "done" / "after" / "output.log").read_text()
    started = wait_until(lambda: json.loads((queue_dir / "done" / "after" / "supervisor.json").read_text()), 5)
    try:
        parent = psutil.Process(started["supervisor_pid"]).ppid()  # a pooled one waits for the next job
    except psutil.NoSuchProcess:
        parent = None  # it left (a surplus pooled one): nothing more to see
    assert parent in (new.pid, None), "the watcher forked it itself: the new helper was not used"
    log = (queue_dir / "watcher.log").read_text()
    assert "spawner helper lost" in log and "spawner helper started again" in log


def test_status_json_says_the_helper_is_lost_until_it_runs_again(watcher, queue_dir):
    """While a lost helper is not running again, status.json's watcher.problems says so (launches are slower, and
    a helper that keeps dying backs off to minutes); once it runs, the line goes."""
    from conftest import tick_until

    w = watcher(status_s=30.0)  # the line is written at once, not when a write is next due
    sup = w.executor.supervisor
    helper = wait_until(lambda: sup._spawner and sup._spawner.pid, 10)
    tick_until(w, lambda: (queue_dir / "status.json").exists(), what="a first status.json")  # the next is 5 s away
    os.kill(helper, signal.SIGKILL)
    line = tick_until(
        w, lambda: [p for p in _watcher_problems(queue_dir) if p.startswith("spawner helper lost")], what="the line"
    )[0]
    assert "killed by SIGKILL" in line and "next try" in line
    tick_until(w, lambda: sup.restarts == 1 and not _watcher_problems(queue_dir), what="the line gone")


def test_drain_empties_a_pipe_of_any_size_and_tells_its_end() -> None:
    """``drain`` stops at a short read (issue 38: no last read to fail with EAGAIN) yet leaves nothing behind, and
    says True only at the end of file."""
    from trainq.watcher.spec.fsutil import drain

    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        os.write(w, b"e" * 10_000)
        assert drain(r) is False
        with pytest.raises(BlockingIOError):
            os.read(r, 1)  # nothing left
        os.write(w, b"e" * 4096)  # exactly one read's worth: the next read finds the pipe empty
        assert drain(r) is False
        assert drain(r) is False  # nothing waiting
        os.write(w, b"e")
        os.close(w)
        w = -1
        assert drain(r) in (False, True)  # the byte, and perhaps the end in the same call
        assert drain(r) is True
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
