"""The job supervisor, with real processes: launch, records, lock, stop escalation, orphans, crashes."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import wait_until

from trainq.watcher.spec.contract import ENV_JOB_DIR, JobPaths
from trainq.watcher.spec.errors import SpawnFailed
from trainq.watcher.supervisor import LaunchSpec, Supervisor
from trainq.watcher.supervisor.signals import install_watcher_signal_handlers

REPO = Path(__file__).resolve().parent.parent
FAKE = Path(__file__).resolve().parent / "fake_trainers"


def py(script: str, *args: str) -> tuple[str, ...]:
    """argv running one of the fake trainers with this interpreter."""
    return (sys.executable, str(FAKE / script), *args)


def is_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (a zombie waiting for a reaper counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def job_processes(job_dir: Path) -> list[int]:
    """Live processes whose TRAINQ_JOB_DIR is ``job_dir``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(ENV_JOB_DIR) == str(job_dir):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def log_text(paths: JobPaths) -> str:
    return paths.log.read_text(errors="replace") if paths.log.exists() else ""


class Jobs:
    """Makes job folders and launches them; teardown kills whatever a failed test left behind."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sup = Supervisor()
        self.made: list[JobPaths] = []

    def folder(self, name: str = "job") -> JobPaths:
        paths = JobPaths(self.root / "running" / name)
        paths.dir.mkdir(parents=True)
        self.made.append(paths)
        return paths

    def spec(self, paths: JobPaths, argv: tuple[str, ...], **overrides: object) -> LaunchSpec:
        fields = dict(
            job_dir=str(paths.dir), argv=argv, env={}, cwd=str(paths.dir), attempt=1, stop_grace_s=0.5, kill_after_s=1.0
        )
        fields.update(overrides)
        return LaunchSpec(**fields)

    def launch(self, argv: tuple[str, ...], name: str = "job", **overrides: object) -> tuple[JobPaths, int]:
        paths = self.folder(name)
        return paths, self.sup.launch(self.spec(paths, argv, **overrides))

    def wait_exit(self, paths: JobPaths, timeout_s: float = 30.0) -> dict:
        return wait_until(lambda: self.sup.read_exit(paths), timeout_s, what=f"the exit record of {paths.dir.name}")

    def wait_ready(self, paths: JobPaths) -> None:
        wait_until(lambda: "ready" in log_text(paths), 30.0, what=f"{paths.dir.name} to print ready")

    def cleanup(self) -> None:
        for paths in self.made:
            started = self.sup.read_started(paths)
            if started and self.sup.is_alive(paths):
                try:
                    os.kill(started["supervisor_pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.sup.kill_leftovers(paths)
        deadline = time.monotonic() + 10
        while self.sup.forked_pids and time.monotonic() < deadline:
            self.sup.reap()
            time.sleep(0.01)


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Jobs]:
    j = Jobs(tmp_path)
    try:
        yield j
    finally:
        j.cleanup()
    assert not j.sup.forked_pids, "a supervisor was left unreaped"


def test_launch_writes_start_and_exit_records_and_the_log(jobs: Jobs) -> None:
    paths, pid = jobs.launch(
        py("succeeds.py"), name="hello", env={"GREETING": "hi there"}, banner="=== trainq: hello attempt 1 ===\nextra"
    )
    record = jobs.wait_exit(paths)
    started = jobs.sup.read_started(paths)
    assert started is not None
    assert started["supervisor_pid"] == pid and started["attempt"] == 1
    assert started["pgid"] == started["job_pid"] == record["job_pid"]
    assert started["job_create_time"] > started["boot_time"] > 0
    assert record["exit_code"] == 0 and record["signal"] is None and record["signal_name"] is None
    assert record["stop_reason"] is None and record["signals_sent"] == [] and record["spawn_error"] is None
    assert record["started_at"] <= record["ended_at"]
    lines = log_text(paths).splitlines()
    assert lines[0] == "=== trainq: hello attempt 1 ===", "banner is one line, first in output.log"
    assert "hello from hello attempt 1" in lines and "hi there" in lines
    wait_until(lambda: not jobs.sup.is_alive(paths), 5, what="the lock to be released")
    wait_until(lambda: pid in jobs.sup.reap() or not jobs.sup.forked_pids, 5, what="the supervisor to be reaped")


def test_the_start_record_s_job_create_time_is_what_proc_says_of_the_job(jobs: Jobs) -> None:
    """The start record's job_create_time is what recovery compares a live pid's start with (pid reuse guard). The
    supervisor takes it from the boot clock around the start when the start fell inside one clock tick, else from
    /proc/PID/stat: either way it must be psutil's number for the job process."""
    from trainq.watcher.supervisor.leftovers import boot_ticks, create_time_of, process_create_time

    for n in range(5):
        paths, _pid = jobs.launch(("sleep", "5"), name=f"born{n}")
        started = wait_until(lambda: jobs.sup.read_started(paths), 10, what="the start record")  # noqa: B023
        assert started["job_create_time"] == process_create_time(started["job_pid"])
        assert started["job_create_time"] == psutil.Process(started["job_pid"]).create_time()
        (paths.dir / "stop.flag").write_text("now")
        jobs.wait_exit(paths)
    seen = 0
    for _ in range(50):  # the clock's side alone: a start inside one tick is the tick /proc gives
        before = boot_ticks()
        child = subprocess.Popen(["true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        after = boot_ticks()
        if before is not None and before == after:
            seen += 1
            assert create_time_of(before) == process_create_time(child.pid)
        child.wait()
    assert seen, "no start fell inside one clock tick in 50 tries"


def test_lock_is_held_while_running_and_a_second_launch_is_refused(jobs: Jobs) -> None:
    paths, _ = jobs.launch(py("sleeps.py"))
    jobs.wait_ready(paths)
    assert jobs.sup.is_alive(paths)
    fd = os.open(paths.lock, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    with pytest.raises(SpawnFailed, match="another supervisor still runs this job"):
        jobs.sup.launch(jobs.spec(paths, py("succeeds.py"), attempt=2))
    paths.stop_flag.touch()
    record = jobs.wait_exit(paths)
    assert record["stop_reason"] == "stop_flag" and record["signal_name"] == "SIGTERM"
    assert record["signals_sent"] == ["SIGTERM"], "sleeps.py dies of SIGTERM, so no SIGKILL is needed"
    wait_until(lambda: not jobs.sup.is_alive(paths), 5, what="is_alive to flip to False")


def test_is_alive_is_false_without_a_lock_file_or_an_unheld_one(jobs: Jobs) -> None:
    paths = jobs.folder()
    assert not jobs.sup.is_alive(paths)
    paths.lock.touch()
    assert not jobs.sup.is_alive(paths)
    assert jobs.sup.read_started(paths) is None and jobs.sup.read_exit(paths) is None


def test_stop_kills_a_sigterm_ignoring_tree_with_a_double_forked_grandchild(jobs: Jobs) -> None:
    paths, _ = jobs.launch(py("ignores_sigterm_with_grandchildren.py"), stop_grace_s=0.5, kill_after_s=1.0)
    jobs.wait_ready(paths)
    pids = [int(p) for p in (paths.dir / "pids.txt").read_text().split()]
    assert sorted(jobs.sup.process_tree(paths)) == sorted(pids), "the grandchild stays in the supervisor's tree"
    paths.stop_flag.touch()
    stopped = time.monotonic()
    record = jobs.wait_exit(paths, timeout_s=0.5 + 10)
    assert time.monotonic() - stopped < 0.5 + 10
    assert record["stop_reason"] == "stop_flag" and record["stop_requested_at"]
    assert record["signals_sent"] == ["SIGTERM", "SIGKILL"] and record["signal_name"] == "SIGKILL"
    assert all(is_gone(pid) for pid in pids), "every process was gone before the exit record"
    assert job_processes(paths.dir) == []
    assert jobs.sup.process_tree(paths) == []
    log = log_text(paths)
    assert "trainq: stop requested" in log and "trainq: sent SIGKILL" in log


def test_cooperative_job_checkpoints_and_exits_zero_without_signals(jobs: Jobs) -> None:
    # polling every 1 ms, these jobs see the flag and exit long before the supervisor's next look:
    # the stop must still be recorded as a stop
    launched = [jobs.launch(py("cooperative.py", "0.001"), name=f"coop{i}", stop_grace_s=5.0) for i in range(3)]
    for paths, _ in launched:
        jobs.wait_ready(paths)
    for paths, _ in launched:
        paths.stop_flag.touch()
    for paths, _ in launched:
        record = jobs.wait_exit(paths)
        assert record["exit_code"] == 0 and record["stop_reason"] == "stop_flag"
        assert record["signals_sent"] == []
        assert (paths.checkpoints / "step-1" / "state.txt").read_text() == "step 1\n"


def test_timeout_creates_the_stop_flag_and_records_timeout(jobs: Jobs) -> None:
    paths, _ = jobs.launch(py("cooperative.py"), timeout_s=0.3, stop_grace_s=5.0)
    record = jobs.wait_exit(paths)
    assert record["stop_reason"] == "timeout" and record["exit_code"] == 0 and record["signals_sent"] == []
    assert (paths.checkpoints / "step-1" / "state.txt").exists(), "the job saw the flag the timeout created"
    assert not paths.stop_flag.exists(), "the supervisor removes the flag it created, so a retry is not stopped"
    assert "trainq: timeout after 0.3 s" in log_text(paths)


def test_trainq_notes_start_on_their_own_line_after_a_progress_bar(jobs: Jobs) -> None:
    """tqdm ends its output with \\r, not a newline: the timeout and SIGTERM notes still start a line."""
    bar = (
        "import sys, time; sys.stdout.write(' 30%|###   | 36/120 [00:18<00:43]\\r'); sys.stdout.flush(); time.sleep(60)"
    )
    paths, _ = jobs.launch((sys.executable, "-c", bar), timeout_s=0.3, stop_grace_s=0.2, kill_after_s=0.5)
    jobs.wait_exit(paths)
    log = paths.log.read_bytes().decode()  # bytes: read_text() would turn the \r into a newline
    assert "[00:18<00:43]\r\ntrainq: timeout after 0.3 s" in log
    assert "\ntrainq: sent SIGTERM to the job's process tree" in log


def test_timeout_escalates_to_kill_when_the_job_ignores_the_flag(jobs: Jobs) -> None:
    paths, _ = jobs.launch(
        py("ignores_sigterm_with_grandchildren.py"), timeout_s=0.2, stop_grace_s=0.2, kill_after_s=0.5
    )
    record = jobs.wait_exit(paths)
    assert record["stop_reason"] == "timeout" and record["signals_sent"] == ["SIGTERM", "SIGKILL"]
    assert job_processes(paths.dir) == []


def test_job_keeps_running_when_the_watcher_side_process_is_sigkilled(jobs: Jobs) -> None:
    paths = jobs.folder()
    spec_file = paths.dir.parent / "spec.json"
    spec_file.write_text(json.dumps(jobs.spec(paths, py("sleeps.py")).to_dict()))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    launcher = subprocess.Popen(
        [sys.executable, str(FAKE / "launcher.py"), str(spec_file)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        supervisor_pid = int(launcher.stdout.readline())
        jobs.wait_ready(paths)
        assert os.getsid(supervisor_pid) == supervisor_pid, "the supervisor leads its own session"
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)  # the watcher and its whole process group (Ctrl-C reaches a group)
        launcher.wait(10)
        launcher.stdout.close()
    job_pid = jobs.sup.read_started(paths)["job_pid"]
    assert jobs.sup.is_alive(paths) and not is_gone(job_pid) and not is_gone(supervisor_pid)
    assert jobs.sup.read_exit(paths) is None
    paths.stop_flag.touch()
    record = jobs.wait_exit(paths)
    assert record["stop_reason"] == "stop_flag" and record["signal_name"] == "SIGTERM"
    wait_until(lambda: not jobs.sup.is_alive(paths), 5, what="the orphaned supervisor to exit")


def test_sigkilled_supervisor_leaves_no_exit_record_and_kill_leftovers_cleans_up(jobs: Jobs) -> None:
    paths, pid = jobs.launch(py("ignores_sigterm_with_grandchildren.py"))
    jobs.wait_ready(paths)
    pids = [int(p) for p in (paths.dir / "pids.txt").read_text().split()]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: pid in jobs.sup.reap(), 5, what="the killed supervisor to be reaped")
    assert not jobs.sup.is_alive(paths), "a dead supervisor's lock is free"
    assert jobs.sup.read_exit(paths) is None
    assert not any(is_gone(p) for p in pids), "the job outlives its killed supervisor"
    assert jobs.sup.kill_leftovers(paths) == 3
    wait_until(lambda: all(is_gone(p) for p in pids), 5, what="the leftovers to die")
    assert job_processes(paths.dir) == []
    assert jobs.sup.kill_leftovers(paths) == 0


def test_daemon_left_behind_by_a_successful_job_is_killed_before_the_exit_record(jobs: Jobs) -> None:
    paths, _ = jobs.launch(py("leaves_daemon.py"), kill_after_s=0.5)
    record = jobs.wait_exit(paths)
    daemon_pid = int((paths.dir / "daemon.pid").read_text())
    assert is_gone(daemon_pid), "the daemon was dead when the exit record appeared"
    assert record["exit_code"] == 0 and record["stop_reason"] is None
    assert record["signals_sent"] == ["SIGTERM", "SIGKILL"], "the daemon ignores SIGTERM"
    assert "left 1 processes running" in log_text(paths)


@pytest.mark.parametrize(
    "case", ["missing_executable", "bad_cwd", "not_executable", "not_executable_on_path", "not_a_program"]
)
def test_spawn_errors_give_an_exit_record_and_a_log_line(jobs: Jobs, case: str) -> None:
    paths = jobs.folder()
    script = paths.dir / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    junk = paths.dir / "junk"
    junk.write_bytes(b"\x00\x01\x02 no interpreter line\n")
    junk.chmod(0o755)
    argv, cwd, code, words = {
        "missing_executable": (("no-such-command-xyz", "--flag"), str(paths.dir), 127, "no-such-command-xyz"),
        "bad_cwd": (("true",), str(paths.dir / "missing"), 127, "working directory"),
        "not_executable": ((str(script),), str(paths.dir), 126, "permission denied"),
        "not_executable_on_path": (("script.sh",), str(paths.dir), 126, "permission denied"),
        "not_a_program": ((str(junk),), str(paths.dir), 126, "Exec format error"),
    }[case]
    env = {"PATH": f"/usr/bin:{paths.dir}"}  # not this process's PATH: the job's own is searched
    jobs.sup.launch(jobs.spec(paths, argv, cwd=cwd, env=env))
    record = jobs.wait_exit(paths)
    assert record["exit_code"] == code and record["signal"] is None
    assert words in record["spawn_error"]
    assert f"trainq: cannot start the job: {record['spawn_error']}" in log_text(paths)
    assert jobs.sup.read_started(paths) is None, "no start record for a job that never started"


@pytest.mark.parametrize("same_path", [True, False])
def test_the_job_s_own_path_finds_its_program(jobs: Jobs, tmp_path: Path, same_path: bool) -> None:
    """A bare command is looked up on the job's PATH (its env), whether or not it is the supervisor's; a relative
    one against the job's cwd."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "only-here").write_text('#!/bin/sh\necho found-on-the-job-path "$PWD"\n')
    (tools / "only-here").chmod(0o755)
    paths = jobs.folder()
    path = os.environ["PATH"] if same_path else f"{tools}:/usr/bin:/bin"
    argv = ("only-here",) if not same_path else (str(tools / "only-here"),)
    jobs.sup.launch(jobs.spec(paths, argv, env={"PATH": path}))
    assert jobs.wait_exit(paths)["exit_code"] == 0
    assert f"found-on-the-job-path {paths.dir}" in log_text(paths)
    rel = jobs.folder("relative")
    (rel.dir / "run.sh").write_text("#!/bin/sh\necho relative-ran\n")
    (rel.dir / "run.sh").chmod(0o755)
    jobs.sup.launch(jobs.spec(rel, ("./run.sh",), env={"PATH": path}))
    assert jobs.wait_exit(rel)["exit_code"] == 0 and "relative-ran" in log_text(rel)


def test_the_foreground_supervisor_passes_no_inherited_fd_to_the_job(tmp_path: Path) -> None:
    """An fd the foreground supervisor inherited without close-on-exec (a Slurm step's) must not reach the job
    (pinned while a posix_spawn start, which closes nothing by itself, was tried: docs/benchmarks.md)."""
    paths = JobPaths(tmp_path / "running" / "fg")
    paths.dir.mkdir(parents=True)
    spec = LaunchSpec(
        job_dir=str(paths.dir),
        argv=py("reports_fds.py"),
        env={},
        cwd=str(paths.dir),
        attempt=1,
        stop_grace_s=0.5,
        kill_after_s=1.0,
    )
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    stray_r, stray_w = os.pipe()
    os.set_inheritable(stray_w, True)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "trainq.watcher.supervisor", str(paths.dir), "--spec", str(spec_file)],
            pass_fds=(stray_w,),
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=REPO,
            timeout=60,
        )
    finally:
        os.close(stray_r)
        os.close(stray_w)
    assert done.returncode == 0
    assert "fds: 0 1 2 3\n" in log_text(paths), "the job holds only stdio (3 is its own listdir)"


def test_standalone_entry_point_runs_in_the_foreground(jobs: Jobs) -> None:
    paths = jobs.folder()
    spec_file = paths.dir.parent / "spec.json"
    spec_file.write_text(json.dumps({"job_dir": "ignored", "argv": list(py("exits_1.py")), "banner": "== hand"}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "trainq.watcher.supervisor", str(paths.dir), "--spec", str(spec_file)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1, done.stderr
    record = jobs.sup.read_exit(paths)
    assert record["exit_code"] == 1 and record["attempt"] == 1
    assert "ValueError: the widget count must be even" in log_text(paths)
    assert log_text(paths).startswith("== hand\n")
    assert not jobs.sup.is_alive(paths)


def test_standalone_supervisor_forwards_its_sigterm_to_the_job(jobs: Jobs) -> None:
    paths = jobs.folder()
    spec_file = paths.dir.parent / "spec.json"
    spec_file.write_text(json.dumps({"job_dir": str(paths.dir), "argv": list(py("sleeps.py"))}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainq.watcher.supervisor", str(paths.dir), "--spec", str(spec_file)], cwd=REPO, env=env
    )
    try:
        jobs.wait_ready(paths)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait(10)
    record = jobs.sup.read_exit(paths)
    assert record["stop_reason"] == "sigterm" and record["signals_sent"] == ["SIGTERM"]
    assert record["signal_name"] == "SIGTERM"


def test_standalone_rejects_a_bad_spec(tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"argv": []}))
    done = subprocess.run(
        [sys.executable, "-m", "trainq.watcher.supervisor", str(tmp_path), "--spec", str(spec_file)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "argv" in done.stderr and str(spec_file) in done.stderr


def test_launch_spec_round_trips_through_json() -> None:
    spec = LaunchSpec(
        job_dir="/q/running/a", argv=("python", "t.py"), env={"A": "1"}, cwd="/q", attempt=2, timeout_s=60.0, banner="b"
    )
    assert LaunchSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ValueError, match="unknown launch spec keys: bogus"):
        LaunchSpec.from_dict({**spec.to_dict(), "bogus": 1})


def test_job_gets_default_signals_and_no_inherited_fds(jobs: Jobs) -> None:
    stray_r, stray_w = os.pipe()
    os.set_inheritable(stray_w, True)  # even an inheritable watcher fd must not reach the supervisor or job
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    try:
        # grep, not python: the interpreter ignores SIGPIPE and SIGXFSZ itself at start-up
        sig_paths, _ = jobs.launch(("grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status"), name="signals")
        fd_paths, pid = jobs.launch(py("reports_fds.py", "--sleep"), name="fds")
        wait_until(lambda: jobs.sup.read_started(fd_paths), 10, what="the start record")
        # then watching (its pidfd open): a supervisor that cloned the job into its cgroup first makes one move
        # that moves nothing, through a cgroup.procs fd it holds meanwhile (attempt.py, _keep_moves_quick)
        supervisor_fds = wait_until(lambda: _watching_fds(pid), 10, what="the supervisor to watch its job")
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR2])
        signal.signal(signal.SIGUSR1, previous)
        os.close(stray_r)
        os.close(stray_w)
    assert jobs.wait_exit(sig_paths)["exit_code"] == 0
    signals = log_text(sig_paths)
    masks = dict(line.split(":\t") for line in signals.splitlines() if line.startswith("Sig"))
    assert not _signals_in(masks["SigBlk"]), signals
    # glibc reserves 32 and 33 (threads, setxid): Python cannot reset them, and whatever loaded
    # before (a threaded library) may have left one ignored; every other signal must be default
    assert not _signals_in(masks["SigIgn"]) & set(signal.valid_signals()), signals
    assert jobs.wait_exit(fd_paths)["exit_code"] == 0
    assert "fds: 0 1 2 3\n" in log_text(fd_paths), "the job holds only stdio (3 is its own listdir)"
    assert supervisor_fds.pop("0") == "/dev/null"
    assert supervisor_fds.pop("1") == supervisor_fds.pop("2") == str(fd_paths.log)
    assert sorted(supervisor_fds.values()) == sorted([str(fd_paths.lock), "anon_inode:[pidfd]"]), (
        "the supervisor holds stdio, the lock and its pidfd only"
    )


def _watching_fds(pid: int) -> dict[str, str] | None:
    """A supervisor's fds (number → what it names) once it holds its job's pidfd; None before."""
    fds = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            return None  # closed while we looked
    return fds if "anon_inode:[pidfd]" in fds.values() else None


def test_fork_is_safe_while_another_thread_logs(jobs: Jobs, tmp_path: Path) -> None:
    log = logging.getLogger("test_supervisor.busy")
    handler = logging.FileHandler(tmp_path / "busy.log")
    log.addHandler(handler)
    log.propagate = False
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            log.warning("busy thread holds the handler lock %s", "often")

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        launched = [jobs.launch(("true",), name=f"t{i}") for i in range(20)]
        from_thread = jobs.folder("from-thread")  # a launch from a non-main thread resets signals too
        launcher = threading.Thread(target=jobs.sup.launch, args=(jobs.spec(from_thread, ("true",)),))
        launcher.start()
        launcher.join()
        records = [jobs.wait_exit(paths) for paths in [p for p, _ in launched] + [from_thread]]
    finally:
        stop.set()
        thread.join()
        log.removeHandler(handler)
        handler.close()
    assert [r["exit_code"] for r in records] == [0] * 21


def test_watcher_signal_handlers_set_a_flag_and_wake_the_pipe(jobs: Jobs) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    state = install_watcher_signal_handlers(wake_w)
    try:
        assert not state.stop_requested
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(lambda: state.stop_requested, 5, what="the SIGTERM flag")
        assert os.read(wake_r, 100)
        paths, pid = jobs.launch(("true",))
        jobs.wait_exit(paths)
        wait_until(lambda: _drain(wake_r), 5, what="a wakeup byte from SIGCHLD")
        wait_until(lambda: pid in jobs.sup.reap(), 5, what="the supervisor to be reaped")
    finally:
        state.restore()
        os.close(wake_r)
        os.close(wake_w)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _drain(fd: int) -> bytes:
    try:
        return os.read(fd, 100)
    except BlockingIOError:
        return b""


def test_launch_into_a_missing_folder_raises_spawn_failed(jobs: Jobs, tmp_path: Path) -> None:
    paths = JobPaths(tmp_path / "running" / "never-made")
    with pytest.raises(SpawnFailed, match=r"never-made.*check that the job folder exists"):
        jobs.sup.launch(jobs.spec(paths, ("true",)))
    assert not jobs.sup.forked_pids


def _signals_in(mask_hex: str) -> set[int]:
    """Signal numbers set in a /proc/PID/status signal mask."""
    mask = int(mask_hex.strip(), 16)
    return {n for n in range(1, 65) if mask & (1 << (n - 1))}


# -- recovery never harms a stranger (issue 12 item 5) ------------------------------------------------
@pytest.fixture
def stranger() -> Iterator[psutil.Process]:
    """A live process group trainq did not start (its own session, no TRAINQ_JOB_DIR)."""
    env = {k: v for k, v in os.environ.items() if k != ENV_JOB_DIR}
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True, env=env)
    try:
        yield psutil.Process(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def fake_start_record(paths: JobPaths, **fields: object) -> None:
    paths.dir.mkdir(parents=True, exist_ok=True)
    paths.started.write_text(json.dumps({"attempt": 1, "supervisor_pid": 999999, "job_pid": fields["pgid"], **fields}))


@pytest.mark.parametrize("boot", ["boot_id", "boot_time"])
def test_kill_leftovers_signals_nothing_for_a_start_record_from_another_boot(tmp_path, stranger, boot) -> None:
    """Was: the recorded pgid matched a stranger's group created after the 'job', and it was SIGKILLed."""
    paths = JobPaths(tmp_path / "running" / "old")
    other_boot = (
        {"boot_id": "00000000-0000-0000-0000-000000000000"}
        if boot == "boot_id"
        else {"boot_time": psutil.boot_time() - 86400}
    )
    fake_start_record(paths, pgid=stranger.pid, job_create_time=stranger.create_time() - 1.0, **other_boot)
    assert Supervisor().kill_leftovers(paths) == 0
    assert stranger.is_running() and stranger.status() != psutil.STATUS_ZOMBIE


def test_kill_leftovers_leaves_a_reused_process_group_alone(tmp_path, stranger) -> None:
    """Same boot, but the group's leader started at another time than the recorded job: the id was reused."""
    from trainq.watcher.supervisor import boot_id

    paths = JobPaths(tmp_path / "running" / "reused")
    fake_start_record(
        paths,
        pgid=stranger.pid,
        job_create_time=stranger.create_time() - 5.0,
        boot_id=boot_id(),
        boot_time=psutil.boot_time(),
    )
    assert Supervisor().kill_leftovers(paths) == 0
    assert stranger.is_running() and stranger.status() != psutil.STATUS_ZOMBIE


def test_start_record_carries_the_boot_id(jobs: Jobs) -> None:
    paths, _ = jobs.launch(py("succeeds.py"))
    jobs.wait_exit(paths)
    assert jobs.sup.read_started(paths)["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
