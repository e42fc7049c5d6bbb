"""A job cloned straight into its cgroup v2 group (clone_into.py) is born there and cannot tell how it started.

After a quiet spell a supervisor no longer steps into the attempt's group to start the job (that move then waits
for an RCU grace period: docs/benchmarks.md, round four, tenth pass); it clones the job into the group. Each test
here runs real programs both ways, the supervisor's Popen (``attempt._spawn``) and ``clone_into.spawn``, from the
same process, and compares what they saw or how they failed. The tests that need a group skip, naming why, where
this process cannot make a cgroup v2 group.
"""

from __future__ import annotations

import errno
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainq.watcher.supervisor import LaunchSpec, cgroups, clone_into
from trainq.watcher.supervisor.attempt import _spawn

#: what a job sees of how it was started: its session and group, its fds, stdin, cwd, argv and the environment
#: (one line each; the same shell runs it both ways). Its signals are read by grep: sh resets its own mask
PROBE = r"""
echo "argv0 $0 $1"
echo "ids $(cut -d' ' -f1,5,6 /proc/$$/stat) pid $$"
echo "fds $(ls /proc/$$/fd | sort -n | tr '\n' ' ')"
echo "stdin $(readlink /proc/$$/fd/0)"
echo "cwd $(pwd)"
echo "env X=$X PATH=$PATH"
"""


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Path]:
    """A fresh cgroup v2 group of this queue's kind (removed after the test)."""
    found = cgroups.detect("cgroup-v2")
    if found.mode != "cgroup-v2" or found.base is None:
        pytest.skip(f"no usable cgroup-v2 here: {found.why}")
    made = found.base / f"test-clone-{os.getpid()}-{tmp_path.name}"
    made.mkdir()
    yield made
    made.rmdir()


def _spec(argv: list[str], cwd: Path, tmp_path: Path) -> LaunchSpec:
    return LaunchSpec(job_dir=str(tmp_path), argv=tuple(argv), env={}, cwd=str(cwd), attempt=1)


def _run_both(argv: list[str], cwd: Path, env: dict[str, str], group: Path, tmp_path: Path) -> tuple[str, str]:
    """The job's output.log text started by Popen, then by a clone into ``group``; both waited for."""
    tmp_path.mkdir(exist_ok=True)
    outputs = []
    for way in ("popen", "clone"):
        log = tmp_path / f"{way}.log"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            if way == "popen":
                assert _spawn(_spec(argv, cwd, tmp_path), env, fd).wait() == 0
            else:
                pid = clone_into.spawn(argv, None, str(cwd), env, fd, group)
                assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        finally:
            os.close(fd)
        outputs.append(log.read_text())
    return outputs[0], outputs[1]


def _normalised(text: str) -> list[str]:
    """The probe's lines with the pids (which differ between two jobs) put in words."""
    lines = []
    for line in text.splitlines():
        if line.startswith("ids "):
            pid, pgrp, session, _, own = line.split()[1:]
            line = f"ids own pid {pid == own}, group leader {pgrp == own}, session leader {session == own}"
        lines.append(line)
    return lines


def test_a_cloned_job_is_born_in_its_group(group: Path, tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        pid = clone_into.spawn(["cat", "/proc/self/cgroup"], None, str(tmp_path), dict(os.environ), fd, group)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        os.close(fd)
    unified = next(line for line in log.read_text().splitlines() if line.startswith("0::"))
    assert str(group).endswith(unified[3:]), (unified, group)
    assert group.name not in Path("/proc/self/cgroup").read_text()


def test_a_cloned_job_sees_what_a_popen_job_sees(group: Path, tmp_path: Path) -> None:
    """Session and group leader, only fds 0-2 (stdin /dev/null, output.log on 1 and 2), the caller's signal mask,
    SIGPIPE and SIGXFSZ back to default, no handler of the caller's, the cwd, argv and only the given
    environment, though the caller holds an inheritable fd, blocks SIGUSR2 and handles SIGTERM."""
    stray = os.open(os.devnull, os.O_RDONLY)  # inheritable: close_fds must keep it from the job
    os.set_inheritable(stray, True)
    old_handler = signal.signal(signal.SIGTERM, lambda *_: None)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    work = tmp_path / "work dir"
    work.mkdir()
    env = {"X": "ünïcode value", "PATH": os.environ.get("PATH", os.defpath)}
    try:
        popen, cloned = _run_both(["sh", "-c", PROBE, "probe", "arg one"], work, env, group, tmp_path)
        signals = ["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"]
        signals_popen, signals_cloned = _run_both(signals, work, env, group, tmp_path / "signals")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGTERM, old_handler)
        os.close(stray)
    assert _normalised(cloned) == _normalised(popen)
    said = dict(line.split(" ", 1) for line in _normalised(cloned))
    assert said["argv0"] == "probe arg one"
    assert said["ids"] == "own pid True, group leader True, session leader True"
    assert said["stdin"] == "/dev/null"
    assert set(said["fds"].split()) <= {"0", "1", "2", "3"}  # 3: the shell's own pipe for $(...)
    assert said["cwd"] == str(work)
    assert said["env"] == f"X=ünïcode value PATH={env['PATH']}"
    assert signals_popen == signals_cloned  # sh resets its mask: the signals are read by grep, exec'd directly
    mask = dict(line.split(":\t") for line in signals_cloned.splitlines())
    assert int(mask["SigBlk"], 16) & (1 << (signal.SIGUSR2 - 1)), "the caller's mask, as Popen keeps it"
    assert not int(mask["SigIgn"], 16) & (1 << (signal.SIGPIPE - 1)), "SIGPIPE back to its default"


def test_a_bare_command_is_looked_up_on_the_job_s_path(group: Path, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "only-here"
    tool.write_text("#!/bin/sh\necho found me in $0\n")
    tool.chmod(0o755)
    env = {"PATH": f"{tmp_path / 'missing'}:{bin_dir}"}
    popen, cloned = _run_both(["only-here"], tmp_path, env, group, tmp_path)
    assert cloned == popen == f"found me in {tool}\n"


def _failure(way: str, argv: list[str], cwd: Path, group: Path, tmp_path: Path) -> OSError:
    env = {"PATH": f"{tmp_path / 'plain'}:{os.environ.get('PATH', os.defpath)}"}
    fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if way == "popen":
            _spawn(_spec(argv, cwd, tmp_path), env, fd).wait()
        else:
            clone_into.spawn(argv, None, str(cwd), env, fd, group)
    except OSError as exc:
        return exc
    finally:
        os.close(fd)
    raise AssertionError(f"{way}: {argv} started")


CASES = ["not found", "not executable", "not executable on PATH", "no interpreter line", "no such cwd", "a folder"]


@pytest.mark.parametrize("case", CASES)
def test_a_job_that_cannot_start_fails_as_popen_s_does(case: str, group: Path, tmp_path: Path) -> None:
    """The same OSError subclass, errno and filename: the supervisor's spawn error (127/126 and its line in
    output.log) reads them, so it says the same whichever way the job was started."""
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x00\x01\x02 no interpreter line\n")
    junk.chmod(0o755)
    (tmp_path / "plain").mkdir()  # first on PATH: its tool is not executable; the error is that one, not "not found"
    (tmp_path / "plain" / "tool-here").write_text("#!/bin/sh\n")
    argv, cwd, expected = {
        "not found": (["no-such-command-here"], tmp_path, errno.ENOENT),
        "not executable": ([str(script)], tmp_path, errno.EACCES),
        "not executable on PATH": (["tool-here"], tmp_path, errno.EACCES),
        "no interpreter line": ([str(junk)], tmp_path, errno.ENOEXEC),
        "no such cwd": (["true"], tmp_path / "gone", errno.ENOENT),
        "a folder": ([str(tmp_path)], tmp_path, errno.EACCES),
    }[case]
    popen = _failure("popen", argv, cwd, group, tmp_path)
    cloned = _failure("clone", argv, cwd, group, tmp_path)
    assert (type(cloned), cloned.errno, cloned.filename) == (type(popen), popen.errno, popen.filename)
    assert cloned.errno == expected
    assert not cgroups.is_populated(group, "cgroup-v2"), "a child that could not exec is gone"


def test_a_folder_that_is_not_a_group_is_refused_and_the_old_way_stays_open(tmp_path: Path) -> None:
    """clone3 with a plain folder's fd fails; spawn says Unsupported (the supervisor then steps into the group the
    old way, which names the problem), closes what it opened, and the next start may still try a clone."""
    if not sys.platform.startswith("linux"):
        pytest.skip("clone3 is Linux's")
    fds_before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(clone_into.Unsupported):
        clone_into.spawn(["true"], None, str(tmp_path), {}, 1, tmp_path)
    assert clone_into.available()
    assert sorted(os.listdir("/proc/self/fd")) == fds_before, "a refused clone leaves no fd behind"


def _start_after_a_quiet_spell(group: Path, tmp_path: Path, containment: cgroups.Containment):
    from trainq.watcher.supervisor import attempt

    time.sleep(2 * attempt.MOVES_WARM_S)  # quiet, as far as this process and its forks know
    assert attempt._Moves.quiet_for() > attempt.MOVES_WARM_S
    fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        job, used = attempt._spawn_contained(_spec(["true"], tmp_path, tmp_path), {}, fd, group, containment)
    finally:
        os.close(fd)
    assert used == group
    assert os.waitstatus_to_exitcode(os.waitpid(job.pid, 0)[1]) == 0
    return job


def test_where_a_quiet_move_is_dear_the_supervisor_clones_and_then_keeps_moves_quick(
    group: Path, tmp_path: Path
) -> None:
    """``_spawn_contained``: with no move between cgroups for a while, on a machine where the last move after a
    quiet spell was dear, the job is cloned into its group; once it runs, a move that moves nothing (timed, so
    the next choice follows what it cost) makes the next start's step in quick."""
    from trainq.watcher.supervisor import attempt

    containment = cgroups.detect("cgroup-v2")
    attempt._Moves.moved(quiet_move_took=0.050)  # as this project's VM measured one day: 16 ms and more
    job = _start_after_a_quiet_spell(group, tmp_path, containment)
    assert isinstance(job, attempt._Cloned)
    attempt._keep_moves_quick(containment)
    assert attempt._Moves.quiet_for() < 5.0  # it counted as a move (generous: a loaded machine)
    took = struct.unpack_from("d", attempt._Moves._page, 8)[0]
    assert 0 < took < 5.0 and took != 0.050, "the move that moves nothing was timed"
    assert group.name not in Path("/proc/self/cgroup").read_text(), "it moved nobody"


def test_where_a_quiet_move_is_cheap_the_supervisor_steps_in_and_times_it(group: Path, tmp_path: Path) -> None:
    """Where the last move after a quiet spell was quick (another machine's kernel), stepping in stays the way
    after a quiet spell too (a clone is a fork, dearer), and this move's time replaces the last."""
    from trainq.watcher.supervisor import attempt

    containment = cgroups.detect("cgroup-v2")
    attempt._Moves.moved(quiet_move_took=1e-6)
    job = _start_after_a_quiet_spell(group, tmp_path, containment)
    assert not isinstance(job, attempt._Cloned)
    took = struct.unpack_from("d", attempt._Moves._page, 8)[0]
    assert took != 1e-6, "the step in after a quiet spell was timed"
    assert group.name not in Path("/proc/self/cgroup").read_text(), "and the supervisor stepped out"


def test_the_time_of_the_last_move_is_shared_with_processes_forked_later() -> None:
    """The pool's supervisors are forks of one helper: a move by one of them counts for all."""
    from trainq.watcher.supervisor import attempt

    struct.pack_into("dd", attempt._Moves._page, 0, 0.0, 0.0)  # never moved
    assert attempt._Moves.quiet_for() > 60
    pid = os.fork()
    if pid == 0:
        attempt._Moves.moved()
        os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert attempt._Moves.quiet_for() < 5.0


def test_a_caller_with_its_stdio_closed_still_gives_the_job_dev_null_and_the_log(group: Path, tmp_path: Path) -> None:
    """The log and the fds the clone needs (the group's, its /dev/null, its report pipe) take the free numbers 0-2
    of a caller that closed them; the job must still get /dev/null on stdin and the log on 1 and 2 (a real caller
    process: the log is its fd 0)."""
    caller = (
        "import os, sys\n"
        "from trainq.watcher.supervisor import clone_into\n"
        "for fd in (0, 1, 2):\n"
        "    os.close(fd)\n"
        "log = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)  # fd 0\n"
        "pid = clone_into.spawn(['sh', '-c', 'readlink /proc/$$/fd/0; echo done >&2'], None, '/', {}, log, sys.argv[1])\n"
        "sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    log = tmp_path / "output.log"
    done = subprocess.run([sys.executable, "-c", caller, str(group), str(log)], timeout=60, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == ["/dev/null", "done"]


@pytest.mark.parametrize(
    "argv, env",
    [(["echo", "a\0b"], {}), (["true"], {"A=B": "1"}), (["true"], {"A": "x\0y"})],
    ids=["a NUL in argv", "a name with =", "a NUL in a value"],
)
def test_what_popen_refuses_before_starting_is_refused_the_same_way(
    argv: list[str], env: dict[str, str], group: Path, tmp_path: Path
) -> None:
    """A ValueError in the caller, as Popen raises it, and no child: not a child that dies before its exec."""
    fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        with pytest.raises(ValueError) as popen:
            _spawn(_spec(argv, tmp_path, tmp_path), env, fd)
        with pytest.raises(ValueError) as cloned:
            clone_into.spawn(argv, None, str(tmp_path), env, fd, group)
    finally:
        os.close(fd)
    assert str(cloned.value) == str(popen.value)
    assert not cgroups.is_populated(group, "cgroup-v2")
