"""executor: slurm against a real single-node Slurm (tests/slurm/start.sh: 8 CPUs, 2 fake GPUs).

Every test drives the real watcher (in-process ``tick`` or a real ``python -m trainq.watcher`` process) with
``executor: slurm``; jobs are real batch jobs run by slurmd under the real supervisor.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import FAKE, PY, REPO, drop, tick_until, wait_until

from trainq.watcher.slurm.batch import EARLY_WARNING_ENV, sbatch_env
from trainq.watcher.slurm.executor import EXIT_NOT_SHARED, SlurmExecutor, batch_env, batch_script, time_limit_min
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.supervisor import LaunchSpec

pytestmark = pytest.mark.slurm

SLURM_DIR = REPO / "tests" / "slurm"
#: where tests/slurm/start.sh keeps the cluster (config, state, pid files); never /etc/slurm
CLUSTER_DIR = Path(os.environ.get("TRAINQ_SLURM_DIR", "/run/trainq-test-slurm"))
CTLD_PID = CLUSTER_DIR / "slurmctld.pid"
#: Slurm settings for the in-process watcher: a fast poll, room for several batch jobs at once
SLURM = {"executor": "slurm", "slurm": {"poll_s": 0.2}, "max_concurrent": 4}
#: tests/slurm/start.sh's exit status when Slurm's Debian packages are not installed
EXIT_NOT_INSTALLED = 3


def _sh(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """tests/slurm/``script`` (``env``: variables over this process's environment)."""
    return subprocess.run(
        ["bash", str(SLURM_DIR / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


#: the cluster a module gets unless its fixture asks for another: one node, no accounting (a module that asked for
#: more switched the cluster; the next one's start.sh switches it back)
DEFAULT_CLUSTER = {"TRAINQ_SLURM_NODES": "1", "TRAINQ_SLURM_ACCOUNTING": "0"}


def use_cluster(env: dict[str, str] | None = None):
    """Bring up the repository's cluster (``env``: variables for start.sh over DEFAULT_CLUSTER, such as
    ``TRAINQ_SLURM_NODES`` or ``TRAINQ_SLURM_ACCOUNTING``) for a module, as a generator for its fixture; skip,
    saying why, when it cannot be.

    Several test runs on one machine share the cluster: each holds a shared flock on users.lock while it runs,
    and the last one out (the one that gets it exclusively) stops the daemons. A module that needs another cluster
    (a switch restarts Slurm, ending every job on it) first waits until no other run uses the current one.
    """
    if os.geteuid() != 0:
        pytest.skip("the Slurm of tests/slurm/start.sh needs root")
    wanted = {**DEFAULT_CLUSTER, **(env or {})}
    mode = " ".join(f"{k}={v}" for k, v in sorted(wanted.items()))
    CLUSTER_DIR.mkdir(parents=True, exist_ok=True)
    users = open(CLUSTER_DIR / "users.lock", "a")
    mode_file = CLUSTER_DIR / "mode"
    if not mode_file.exists() or mode_file.read_text() != mode:
        fcntl.flock(users, fcntl.LOCK_EX)  # blocks while another test run uses the cluster as it is
    started = _sh("start.sh", env=wanted)
    if started.returncode == EXIT_NOT_INSTALLED:
        users.close()
        pytest.skip(started.stderr.strip().splitlines()[-1])
    if started.returncode != 0:
        users.close()
    assert started.returncode == 0, f"tests/slurm/start.sh failed:\n{started.stderr[-3000:]}"
    mode_file.write_text(mode)
    fcntl.flock(users, fcntl.LOCK_SH)
    conf = started.stdout.strip().splitlines()[-1].partition("=")[2]
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf  # sbatch, squeue, the watcher and its batch jobs all read it
    yield
    try:
        fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _sh("stop.sh")
    except BlockingIOError:
        pass  # another test run still uses the cluster
    finally:
        users.close()
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster():
    """The one-node cluster, as tests/slurm/start.sh sets it up by default, for this module."""
    yield from use_cluster()


def _live_slurm_ids(prefix: str = "") -> list[str]:
    """Queued or running Slurm jobs of this user whose comment starts with ``prefix``."""
    out = subprocess.run(["squeue", "-h", "--me", "-o", "%i|%k"], capture_output=True, text=True, timeout=60).stdout
    return [line.split("|")[0] for line in out.splitlines() if line.partition("|")[2].startswith(prefix)]


@pytest.fixture(autouse=True)
def no_leftover_slurm_jobs(queue_dir):
    """Cancel whatever the test's queue left queued or running (its tag names the queue; other runs keep theirs)."""
    from trainq.watcher.slurm.state import queue_key

    yield
    prefix = f"trainq:{queue_key(queue_dir)}:"
    ids = _live_slurm_ids(prefix)
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=60)
        wait_until(lambda: not _live_slurm_ids(prefix), 30, 0.1, "leftover Slurm jobs to end")


def slurm_state(slurm_id: str) -> str:
    """Slurm's final state for the job (waits out COMPLETING)."""

    def ended() -> str:
        out = subprocess.run(
            ["squeue", "-h", "-t", "all", "-o", "%T", "-j", slurm_id], capture_output=True, text=True, timeout=60
        ).stdout.strip()
        return "" if out in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING") else out

    return wait_until(ended, 30, 0.1, f"slurm job {slurm_id} to end")


def run_json(job_dir: Path) -> dict:
    return json.loads((job_dir / "run.json").read_text())


def job_file(**fields: object) -> str:
    fields.setdefault("approved", True)
    return yaml.safe_dump(fields, sort_keys=False)


def finished(queue_dir: Path, job_id: str) -> Path | None:
    for state in ("done", "failed"):
        path = queue_dir / state / job_id
        if (path / "run.json").exists():
            return path
    return None


def _counting(tmp_path: Path, monkeypatch, command: str) -> Path:
    """A wrapper for Slurm's ``command`` first on PATH, appending each call's arguments to a file it returns."""
    calls = tmp_path / f"{command}-calls"
    calls.touch()
    wrapper = tmp_path / "bin" / command
    wrapper.parent.mkdir(exist_ok=True)
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {shutil.which(command)} "$@"\n')
    wrapper.chmod(0o755)
    if str(wrapper.parent) not in os.environ["PATH"].split(":"):
        monkeypatch.setenv("PATH", f"{wrapper.parent}:{os.environ['PATH']}")
    return calls


def status_job(queue_dir: Path, job_id: str) -> dict | None:
    try:
        status = json.loads((queue_dir / "status.json").read_text())
    except (OSError, ValueError):
        return None
    return next((j for j in status["jobs"] if j["id"] == job_id), None)


# -- pure parts ------------------------------------------------------------------------------------


def test_time_limit_rounds_up_to_minutes_and_leaves_room_for_trainqs_own_timeout():
    assert time_limit_min(None, 120, 5) is None
    assert time_limit_min(1, 0, 0) == 2  # 1 s + 60 s margin
    assert time_limit_min(3600, 120, 5) == 64
    assert time_limit_min(0, 0, 0) == 1


def test_batch_env_passes_only_the_jobs_own_variables_and_never_the_nodes():
    env = {
        "CUDA_VISIBLE_DEVICES": "0",
        "SLURM_JOB_ID": "9",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "A": "b",
        "SECRET_TOKEN": "x",
        "TMPDIR": "/watcher/tmp",
        "GPU_DEVICE_ORDINAL": "1",
        "TRAINQ_JOB_ID": "j",
        "PATH": "/venv/bin:/usr/bin",
        "LC_ALL": "C.UTF-8",
        "HOME": "/home/w",
    }
    assert batch_env(env, node_env="login") == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "TRAINQ_JOB_ID": "j"}
    # clean: the base a local job gets too (PATH with the watcher's Python first, the locale); HOME comes with sbatch
    assert batch_env(env) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "TRAINQ_JOB_ID": "j",
        "PATH": "/venv/bin:/usr/bin",
        "LC_ALL": "C.UTF-8",
    }
    # the job's own env (or env_passthrough) names what passes; Slurm's allocation still wins on the node
    assert batch_env(env, {"A", "TMPDIR", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID"}, "login") == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "TRAINQ_JOB_ID": "j",
        "A": "b",
        "TMPDIR": "/watcher/tmp",
    }


def test_sbatch_runs_with_the_base_only_when_its_environment_is_the_batch_jobs():
    watcher_env = {
        "PATH": "/usr/bin",
        "HOME": "/home/w",
        "USER": "w",
        "LANG": "C.UTF-8",
        "LC_TIME": "C",
        "SLURM_CONF": "/etc/slurm/x.conf",
        "SBATCH_PARTITION": "gpu",
        "SLURM_JOB_ID": "77",
        "AWS_SECRET_ACCESS_KEY": "s",
        "TMPDIR": "/w/tmp",
        "CUDA_VISIBLE_DEVICES": "3",
        "PYTHONPATH": "/w",
    }
    assert sbatch_env(watcher_env) == {
        "PATH": "/usr/bin",
        "HOME": "/home/w",
        "USER": "w",
        "LANG": "C.UTF-8",
        "LC_TIME": "C",
        "SLURM_CONF": "/etc/slurm/x.conf",
        "SBATCH_PARTITION": "gpu",
    }
    assert sbatch_env(watcher_env, "login") == watcher_env  # --export=NONE: none of it reaches the node
    from trainq.watcher.spec.config import WatcherConfig

    script = Path("/q/running/j/slurm.sh")
    for node_env, export in (({}, "--export=ALL"), ({"node_env": "login"}, "--export=NONE")):
        ex = SlurmExecutor(WatcherConfig.from_dict({"executor": "slurm", "slurm": node_env}), Path("/q"))
        spec = LaunchSpec(job_dir="/q/running/j", argv=("true",), env={}, cwd="/q/running/j", attempt=1)
        assert export in ex.options_for(spec, "j", {}, {}).argv(script)
        ex.close()


def test_the_batch_scripts_first_line_catches_the_time_limit_warning_and_hands_it_on(tmp_path):
    """A USR1 that comes while slurm.sh runs is caught by its first line, not fatal; the node side then stops the
    job as a timeout at once (the warning may come the moment Slurm starts the job)."""
    first = batch_script(JobPaths(tmp_path), 1, ["sbatch"], sys.executable, str(REPO)).splitlines()[1]
    caught = subprocess.run(
        ["sh", "-c", f'{first}\nkill -USR1 $$\necho "warned at ${{{EARLY_WARNING_ENV}:-never}}"'],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert caught.returncode == 0 and caught.stdout.startswith("warned at 1"), caught
    job = tmp_path / "job"
    job.mkdir()
    spec = LaunchSpec(job_dir=str(job), argv=(PY, str(FAKE / "cooperative.py")), env={}, cwd=str(job), attempt=1)
    (job / "launch.json").write_text(json.dumps(spec.to_dict()))
    env = {**os.environ, EARLY_WARNING_ENV: f"{time.time() - 0.5:.6f}", "SLURM_JOB_ID": "4242", "PYTHONPATH": str(REPO)}
    node = subprocess.run(
        [sys.executable, "-m", "trainq.watcher.slurm.node", str(job), "--attempt", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    record = json.loads((job / "exit.json").read_text())
    log = (job / "output.log").read_text()
    assert node.returncode == 0 and record["stop_reason"] == "timeout" and record["time_limit_warned_at"], (node, log)
    assert "its warning (SIGUSR1) came" in log and "before the job started" in log and "checkpoint written" in log


def test_batch_script_refuses_a_job_folder_it_cannot_see(tmp_path):
    paths = JobPaths(tmp_path / "not there")
    script = tmp_path / "slurm.sh"
    script.write_text(batch_script(paths, 1, ["sbatch", "x"], sys.executable, str(REPO)))
    done = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == EXIT_NOT_SHARED
    assert "not visible on Slurm node" in done.stderr and "shared" in done.stderr and str(paths.dir) in done.stderr


@pytest.mark.parametrize(
    "state, status, kind",
    [
        ("NODE_FAIL", "failed", "preempted"),
        ("OUT_OF_MEMORY", "failed", "oom"),
        ("PREEMPTED", "failed", "preempted"),
        ("CANCELLED", "cancelled", "killed"),
        ("TIMEOUT", "timeout", "timeout"),
        ("BOOT_FAIL", "failed", "preempted"),
        ("GONE", "failed", "unknown"),
    ],
)
def test_slurm_ending_a_job_itself_gets_an_exit_record_and_diagnosis(tmp_path, state, status, kind):
    """Each way Slurm ends a job without the supervisor's record: a node failure is preempted (retried), a scancel
    from outside trainq is cancelled (never retried by itself), a job Slurm forgot says so."""
    from trainq.watcher.daemon.jobs import judge_exit
    from trainq.watcher.slurm.executor import SlurmJob
    from trainq.watcher.spec.config import WatcherConfig

    paths = JobPaths(tmp_path / "job")
    paths.dir.mkdir()
    paths.started.write_text(json.dumps({"attempt": 1, "job_pid": 4242, "started_at": "2026-01-01T00:00:00Z"}))
    ex = SlurmExecutor(WatcherConfig.from_dict({"executor": "slurm"}), tmp_path)
    record = ex._synthesize(paths, {"n": 1}, "424242", SlurmJob(state, "None", "node7"))
    assert json.loads(paths.exit_record.read_text()) == record and record["attempt"] == 1
    outcome = judge_exit({"status": "running"}, record, paths)
    assert (outcome.status, outcome.diagnosis.kind) == (status, kind)
    assert (state if state != "GONE" else "no longer known to Slurm") in paths.log.read_text()
    assert "node7" in paths.log.read_text() or state == "GONE"


# -- through Slurm -----------------------------------------------------------------------------------


def test_command_job_reaches_done_through_slurm(queue_dir, watcher):
    w = watcher(**SLURM)
    drop(
        queue_dir,
        "hello.yaml",
        job_file(
            name="hello job",
            command=["sh", "-c", "echo hi from $TRAINQ_JOB_ID; pwd"],
            resources={"ram_gb": 1},
            timeout="5m",
        ),
    )
    done = tick_until(w, lambda: finished(queue_dir, "hello"), 30, "hello to finish")
    assert done.parent.name == "done"
    run = run_json(done)
    slurm_id = run["attempts"][-1]["slurm_job_id"]
    assert run["status"] == "done" and run["executor"] == "slurm" and run["slurm_job_id"] == slurm_id
    assert run["attempts"][-1]["exit_code"] == 0
    assert "hi from hello" in (done / "output.log").read_text()
    sbatch = json.loads((done / "slurm.json").read_text())["sbatch"]
    assert "--job-name=hello job" in sbatch and "--mem=1024M" in sbatch and "--time=9" in sbatch
    assert (done / f"slurm-{slurm_id}.out").exists()
    assert slurm_state(slurm_id) == "COMPLETED"


def test_exit_codes_and_diagnoses_come_back_from_the_node(queue_dir, watcher):
    w = watcher(**SLURM)
    drop(queue_dir, "three.yaml", job_file(command=["sh", "-c", "echo boom; exit 3"]))
    drop(queue_dir, "oom.yaml", job_file(command=["sh", "-c", "echo 'CUDA out of memory'; exit 67"]))
    tick_until(w, lambda: finished(queue_dir, "three") and finished(queue_dir, "oom"), 30, "both to fail")
    three, oom = run_json(queue_dir / "failed" / "three"), run_json(queue_dir / "failed" / "oom")
    assert three["attempts"][-1]["exit_code"] == 3 and three["diagnosis"]["kind"] == "unknown"
    assert "boom" in three["diagnosis"]["evidence"]
    assert oom["attempts"][-1]["exit_code"] == 67 and oom["diagnosis"]["kind"] == "oom"


def test_two_gpu_jobs_get_different_devices_and_a_third_waits_for_slurm(queue_dir, watcher, tmp_path):
    # the watcher's own machine shows GPUs too: its choice must not reach the batch jobs, Slurm's must
    local_gpus = tmp_path / "gpus.json"
    local_gpus.write_text(
        json.dumps(
            [
                {
                    "index": i,
                    "name": "Sim",
                    "memory_total_mb": 6144,
                    "memory_used_mb": 0,
                    "utilization_pct": 0,
                    "processes": [],
                }
                for i in (0, 1)
            ]
        )
    )
    w = watcher(**SLURM, simulate_gpus=str(local_gpus))
    cmd = ["sh", "-c", "echo CVD=$CUDA_VISIBLE_DEVICES; while [ ! -e $TRAINQ_STOP_FLAG ]; do sleep 0.05; done"]
    for name in ("g1", "g2", "g3"):
        drop(queue_dir, f"{name}.yaml", job_file(command=cmd, resources={"gpus": 1}, stop_grace="5s"))
    logs = [queue_dir / "running" / n / "output.log" for n in ("g1", "g2")]
    tick_until(w, lambda: all("CVD=" in (p.read_text() if p.exists() else "") for p in logs), 30, "two to start")
    seen = sorted(line for p in logs for line in p.read_text().splitlines() if line.startswith("CVD="))
    assert seen == ["CVD=0", "CVD=1"]
    tick_until(w, lambda: (w.jobs["g3"].run.get("waiting_for") or "").startswith("Slurm: "), 10, "g3 to wait")
    # Slurm says Resources, or Priority for a moment when it has not re-scheduled yet
    assert w.jobs["g3"].run["waiting_for"] in ("Slurm: Resources", "Slurm: Priority")
    assert status_job(queue_dir, "g3") is not None
    for name in ("g1", "g2"):
        (queue_dir / "running" / name / "stop.flag").touch()
    log3 = queue_dir / "running" / "g3" / "output.log"
    tick_until(w, lambda: log3.exists() and "CVD=" in log3.read_text(), 30, "g3 to start")
    (queue_dir / "running" / "g3" / "stop.flag").touch()
    tick_until(w, lambda: all(finished(queue_dir, n) for n in ("g1", "g2", "g3")), 30, "all to stop")
    assert {run_json(queue_dir / "failed" / n)["status"] for n in ("g1", "g2", "g3")} == {"cancelled"}


def test_stop_flag_reaches_the_job_on_the_node(queue_dir, watcher):
    w = watcher(**SLURM)
    drop(queue_dir, "coop.yaml", job_file(command=[PY, str(FAKE / "cooperative.py")], resume_args=["--resume"]))
    log = queue_dir / "running" / "coop" / "output.log"
    tick_until(w, lambda: log.exists() and "ready" in log.read_text(), 30, "coop to start")
    (queue_dir / "running" / "coop" / "stop.flag").touch()
    done = tick_until(w, lambda: finished(queue_dir, "coop"), 20, "coop to stop")
    run = run_json(done)
    assert run["status"] == "cancelled" and run["attempts"][-1]["exit_code"] == 0
    assert (done / "checkpoints" / "step-1" / "state.txt").exists()
    assert slurm_state(run["slurm_job_id"]) == "COMPLETED"


def test_scancel_fallback_when_the_supervisor_cannot_stop_the_job(queue_dir, watcher):
    w = watcher(**SLURM)
    w.executor.scancel_margin_s = 0.5  # the real margin is 10 s; only the wait shrinks here
    drop(
        queue_dir,
        "stuck.yaml",
        job_file(command=[PY, str(FAKE / "ignores_sigterm_with_grandchildren.py")], stop_grace="1s"),
    )
    started = queue_dir / "running" / "stuck" / "supervisor.json"
    tick_until(
        w, lambda: started.exists() and (queue_dir / "running" / "stuck" / "pids.txt").exists(), 30, "stuck to start"
    )
    supervisor_pid = json.loads(started.read_text())["supervisor_pid"]
    os.kill(supervisor_pid, signal.SIGSTOP)  # a hung supervisor (or an unreachable node) cannot escalate
    (queue_dir / "running" / "stuck" / "stop.flag").touch()
    done = tick_until(w, lambda: finished(queue_dir, "stuck"), 40, "scancel to end stuck")
    run = run_json(done)
    assert run["status"] == "cancelled"
    assert slurm_state(run["slurm_job_id"]) == "CANCELLED"
    pids = [int(p) for p in (done / "pids.txt").read_text().split()]
    wait_until(lambda: not any(_alive(p) for p in pids), 15, what="the job's processes to be gone")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def test_stop_while_queued_in_slurm_cancels_at_once(queue_dir, watcher):
    w = watcher(**SLURM)
    drop(queue_dir, "later.yaml", job_file(command=["true"], slurm={"sbatch_args": ["--begin=now+1hour"]}))
    tick_until(
        w,
        lambda: "later" in w.jobs and w.jobs["later"].run.get("waiting_for") == "Slurm: BeginTime",
        15,
        "later to wait in Slurm",
    )
    assert (queue_dir / "running" / "later").is_dir()
    (queue_dir / "running" / "later" / "stop.flag").touch()
    done = tick_until(w, lambda: finished(queue_dir, "later"), 15, "later to be cancelled")
    run = run_json(done)
    assert run["status"] == "cancelled" and slurm_state(run["slurm_job_id"]) == "CANCELLED"
    assert not (done / "supervisor.json").exists()


def test_trainqs_own_timeout_fires_before_slurms_limit(queue_dir, watcher):
    w = watcher(**SLURM)
    drop(queue_dir, "slow.yaml", job_file(command=[PY, str(FAKE / "sleeps.py")], timeout="2s", stop_grace="1s"))
    done = tick_until(w, lambda: finished(queue_dir, "slow"), 30, "slow to time out")
    run = run_json(done)
    assert run["status"] == "timeout" and run["diagnosis"]["kind"] == "timeout"
    assert "--time=2" in json.loads((done / "slurm.json").read_text())["sbatch"]
    assert slurm_state(run["slurm_job_id"]) == "FAILED"  # the supervisor ended it (143), not Slurm's TIMEOUT


def test_slurm_refusing_the_job_rejects_it_with_slurms_words_and_never_retries(
    queue_dir, watcher, tmp_path, monkeypatch
):
    """A bad partition will not change: status rejected with sbatch's own words, one sbatch, no retry."""
    sbatch = _counting(tmp_path, monkeypatch, "sbatch")
    w = watcher(**SLURM)
    drop(
        queue_dir,
        "nopart.yaml",
        job_file(
            command=["true"],
            slurm={"partition": "no-such-partition"},
            retries={"max": 2, "on": ["unknown"], "backoff": "1s"},
        ),
    )
    done = tick_until(w, lambda: finished(queue_dir, "nopart"), 15, "nopart to be rejected")
    run = run_json(done)
    assert done.parent.name == "failed" and run["status"] == "rejected", run
    assert "Slurm refused the job" in run["error"] and "Invalid partition name specified" in run["error"]
    assert len(run["attempts"]) == 1 and len(sbatch.read_text().splitlines()) == 1
    assert "running/" not in run["error"] and "running/" not in run["diagnosis"]["evidence"]  # it is in failed/ now


def test_a_job_asking_for_more_gpus_than_a_node_has_is_told_to_lower_resources_gpus(queue_dir, watcher):
    """The test cluster's node has 2 (fake) GPUs: --gres=gpu:3 is refused, and the advice names the job's own field."""
    w = watcher(**SLURM)
    drop(queue_dir, "greedy.yaml", job_file(command=["true"], resources={"gpus": 3}))
    done = tick_until(w, lambda: finished(queue_dir, "greedy"), 60, "greedy to be rejected")
    run = run_json(done)
    assert run["status"] == "rejected" and "Requested node configuration is not available" in run["error"], run
    assert "resources.gpus" in run["diagnosis"]["advice"] and "sbatch_args" not in run["diagnosis"]["advice"], run


def test_job_folder_the_node_cannot_see_is_diagnosed(queue_dir, watcher):
    """A job run as a user who cannot enter the queue folder is what a node without the shared filesystem sees."""
    w = watcher(**SLURM)
    os.chmod(queue_dir.parent, 0o700)
    drop(queue_dir, "hidden.yaml", job_file(command=["true"], slurm={"sbatch_args": ["--uid=nobody"]}))
    done = tick_until(w, lambda: finished(queue_dir, "hidden"), 30, "hidden to fail")
    run = run_json(done)
    assert run["status"] == "failed"
    assert "shared filesystem" in run["diagnosis"]["evidence"]
    assert "mount" in run["diagnosis"]["advice"] and "same path" in run["diagnosis"]["advice"]
    assert "without an exit record" in (done / "output.log").read_text()


def test_a_scancel_from_outside_is_cancelled_and_retry_flag_resumes_it(queue_dir, watcher):
    """scancel by someone else: status cancelled, not retried although retries.on lists preempted; retry.flag
    (the way to ask) runs attempt 2, resumed from the checkpoint."""
    w = watcher(**SLURM)
    cmd = [
        "sh",
        "-c",
        'echo attempt $TRAINQ_ATTEMPT args "$*"; [ -n "$1" ] && exit 0; '
        "mkdir -p checkpoints/ckpt_latest; exec " + f"{PY} {FAKE / 'preempted.py'}",
        "sh",
    ]
    drop(
        queue_dir,
        "pre.yaml",
        job_file(
            command=cmd,
            resume_args=["--resume", "{resume_from}"],
            retries={"max": 1, "on": ["preempted"], "backoff": "1s"},
        ),
    )
    log = queue_dir / "running" / "pre" / "output.log"
    tick_until(w, lambda: log.exists() and "ready" in log.read_text(), 30, "pre to start")
    slurm_id = w.jobs["pre"].run["slurm_job_id"]
    subprocess.run(["scancel", slurm_id], check=True, timeout=60)
    cancelled = tick_until(w, lambda: finished(queue_dir, "pre"), 30, "pre to be cancelled")
    run = run_json(cancelled)
    assert run["status"] == "cancelled" and len(run["attempts"]) == 1, run
    assert "cancelled from outside trainq" in run["diagnosis"]["evidence"]
    (cancelled / "retry.flag").touch()
    done = tick_until(
        w,
        lambda: (queue_dir / "done" / "pre" / "run.json").exists() and queue_dir / "done" / "pre",
        30,
        "the retry to finish",
    )
    run = run_json(done)
    assert run["status"] == "done" and len(run["attempts"]) == 2
    assert run["attempts"][1]["slurm_job_id"] != slurm_id
    assert "attempt 2 args --resume" in (done / "output.log").read_text()


def test_watcher_restart_readopts_the_slurm_job(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text(yaml.safe_dump({**SLURM, "settle_s": 0.1}))
    first = watcher_process()
    drop(queue_dir, "long.yaml", job_file(command=[PY, str(FAKE / "cooperative.py")]))
    started = queue_dir / "running" / "long" / "supervisor.json"
    wait_until(lambda: started.exists(), 30, what="long to start")
    slurm_id = run_json(queue_dir / "running" / "long")["slurm_job_id"]
    first.kill()
    second = watcher_process()
    wait_until(
        lambda: (
            (status_job(queue_dir, "long") or {}).get("status") == "running"
            and json.loads((queue_dir / "status.json").read_text())["watcher"]["pid"] == second.proc.pid
        ),
        15,
        what="the new watcher to adopt long",
    )
    (queue_dir / "running" / "long" / "stop.flag").touch()
    wait_until(lambda: finished(queue_dir, "long"), 20, what="long to stop under the new watcher")
    run = run_json(queue_dir / "failed" / "long")
    assert run["status"] == "cancelled" and len(run["attempts"]) == 1
    assert run["attempts"][0]["slurm_job_id"] == slurm_id


def test_watcher_dying_right_after_sbatch_does_not_submit_the_job_twice(queue_dir, watcher, tmp_path):
    """run.json never learnt the Slurm id, the job is still queued in Slurm: slurm.json keeps it from a resubmit."""
    w = watcher(**SLURM)
    name = f"once-{os.getpid()}-{time.time_ns()}"
    drop(queue_dir, "once.yaml", job_file(name=name, command=["true"], slurm={"sbatch_args": ["--begin=now+1hour"]}))
    running = queue_dir / "running" / "once"
    tick_until(
        w,
        lambda: "once" in w.jobs and w.jobs["once"].run.get("waiting_for") == "Slurm: BeginTime",
        15,
        "once to wait in Slurm",
    )
    w.close()
    run = run_json(running)  # as if the watcher died between sbatch and writing run.json
    run.update(attempt=0, attempts=[], slurm_job_id=None, status="pending")
    (running / "run.json").write_text(json.dumps(run))
    w2 = watcher(**SLURM)
    assert w2.jobs["once"].state.value == "running"  # adopted, not put back to pending
    assert w2.jobs["once"].attempt == 1
    (running / "stop.flag").touch()
    done = tick_until(w2, lambda: finished(queue_dir, "once"), 20, "once to end")
    assert run_json(done)["status"] == "cancelled" and len(run_json(done)["attempts"]) == 1
    submitted = subprocess.run(
        ["squeue", "-h", "-t", "all", "-n", name, "-o", "%i|%T"], capture_output=True, text=True, timeout=60
    ).stdout.split()
    assert len(submitted) == 1 and submitted[0].endswith("|CANCELLED")


def test_slurm_down_jobs_wait_and_run_once_it_is_back(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text(yaml.safe_dump({**SLURM, "settle_s": 0.1}))
    watcher_process()
    drop(
        queue_dir,
        "before.yaml",
        job_file(command=["sh", "-c", "while [ ! -e $TRAINQ_STOP_FLAG ]; do sleep 0.05; done; echo finished"]),
    )
    wait_until(lambda: (queue_dir / "running" / "before" / "supervisor.json").exists(), 30, what="before to start")
    ctld = int(CTLD_PID.read_text())
    try:
        os.kill(ctld, signal.SIGTERM)
        drop(queue_dir, "during.yaml", job_file(command=["echo", "ran after all"]))
        wait_until(
            lambda: ((status_job(queue_dir, "during") or {}).get("waiting_for") or "").startswith(
                "Slurm is not reachable: "
            ),
            40,
            what="during to wait for Slurm",
        )
        (queue_dir / "running" / "before" / "stop.flag").touch()  # a running job ends fine without the controller
        wait_until(lambda: finished(queue_dir, "before"), 20, what="before to finish while Slurm is down")
        assert (queue_dir / "pending" / "during").is_dir()
    finally:
        _restart_controller(ctld)
    done = wait_until(lambda: finished(queue_dir, "during"), 60, what="during to run once Slurm is back")
    assert done.parent.name == "done" and "ran after all" in (done / "output.log").read_text()
    assert run_json(queue_dir / "failed" / "before")["status"] == "cancelled"


def _restart_controller(old_pid: int) -> None:
    """Wait for the stopped slurmctld to be gone (SIGKILL after 60 s), then bring the cluster back."""

    def gone() -> bool:
        try:
            with open(f"/proc/{old_pid}/stat") as f:
                return f.read().split(") ")[-1][0] == "Z"
        except OSError:
            return True

    deadline = time.monotonic() + 60
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    if not gone():
        os.kill(old_pid, signal.SIGKILL)
        wait_until(gone, 10, 0.1, "the old slurmctld to die")
    restarted = _sh("start.sh")
    assert restarted.returncode == 0, (restarted.stdout + restarted.stderr)[-2000:]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny model and data, built by ``python -m trainq.trainer.tiny DIR``."""
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run(
        [PY, "-m", "trainq.trainer.tiny", str(out)],
        check=True,
        cwd=REPO,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
    )
    return out


def test_tiny_train_job_reaches_done_through_slurm(queue_dir, watcher, tiny):
    w = watcher(**SLURM)
    train = {
        "model": str(tiny / "model"),
        "data": {"train": str(tiny / "train.jsonl")},
        "method": "lora",
        "max_steps": 6,
        "batch_size": 2,
        "seq_len": 32,
        "checkpoint": {"every_steps": 3, "keep": 1},
    }
    drop(queue_dir, "tiny.yaml", job_file(train=train, env={"OMP_NUM_THREADS": "1"}, resources={"ram_gb": 2}))
    done = tick_until(w, lambda: finished(queue_dir, "tiny"), 150, "the train job to finish")
    assert done.parent.name == "done", (done / "output.log").read_text()[-2000:]
    assert (done / "summary.json").exists() and (done / "metrics.jsonl").exists()
    assert run_json(done)["attempts"][-1]["slurm_job_id"]


def test_executor_needs_no_slurm_to_be_built(tmp_path):
    """Constructing the executor runs nothing; only launch and the polls talk to Slurm."""
    from trainq.watcher.spec.config import WatcherConfig

    ex = SlurmExecutor(WatcherConfig.from_dict({"executor": "slurm"}), tmp_path)
    assert ex.process_tree(JobPaths(tmp_path)) == [] and ex.waiting_for(JobPaths(tmp_path), {}) is None
    ex.close()


# -- liveness without flock ----------------------------------------------------------------------------

NO_FLOCK_C = r"""
#include <errno.h>
#include <sys/file.h>
/* flock() as on Lustre mounted without -o flock, or NFS without a lock manager: every call fails ENOLCK */
int flock(int fd, int operation) { (void)fd; (void)operation; errno = ENOLCK; return -1; }
"""


@pytest.fixture
def no_flock(tmp_path) -> Path:
    """A shared object that makes every flock() fail with ENOLCK when LD_PRELOADed (built with the system cc)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc/gcc) to build the flock shim")
    source, shim = tmp_path / "no_flock.c", tmp_path / "no_flock.so"
    source.write_text(NO_FLOCK_C)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(shim), str(source)], check=True, timeout=120)
    probe = subprocess.run(
        [PY, "-c", "import fcntl, sys; fcntl.flock(sys.stdin.fileno(), fcntl.LOCK_EX)"],
        env=dict(os.environ, LD_PRELOAD=str(shim)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode != 0 and "No locks available" in probe.stderr, probe.stderr  # the shim works
    return shim


def test_without_flock_the_job_runs_once_and_the_watcher_stays_up(queue_dir, watcher_process, no_flock, tmp_path):
    """flock fails everywhere (watcher and node): Slurm's state and the heartbeat carry liveness, nothing crashes."""
    counter = tmp_path / "runs.txt"
    (queue_dir / "watcher.yaml").write_text(yaml.safe_dump({**SLURM, "settle_s": 0.1}))
    w = watcher_process(env={"LD_PRELOAD": str(no_flock)})
    # the batch job's own environment gets the shim too, so the node-side supervisor cannot flock either
    sbatch = [f"--export=ALL,LD_PRELOAD={no_flock}"]
    drop(
        queue_dir,
        "nolock.yaml",
        job_file(command=["sh", "-c", f"echo run >> {counter}; sleep 4; echo finished"], slurm={"sbatch_args": sbatch}),
    )
    done = wait_until(lambda: finished(queue_dir, "nolock"), 60, what="nolock to finish")
    run = run_json(done)
    assert done.parent.name == "done", (done / "output.log").read_text()
    assert len(run["attempts"]) == 1 and counter.read_text() == "run\n"
    log = (done / "output.log").read_text()
    assert "finished" in log and "flock" in log  # the supervisor says it runs without the lock
    assert (done / "heartbeat.json").exists()
    assert w.proc.poll() is None, (queue_dir / "watcher.stderr").read_text()[-2000:]
    # the watcher keeps working: a second job runs too
    drop(queue_dir, "second.yaml", job_file(command=["true"], slurm={"sbatch_args": sbatch}))
    assert wait_until(lambda: finished(queue_dir, "second"), 60, what="second to finish").parent.name == "done"
    assert w.proc.poll() is None


# -- submissions that cannot double ----------------------------------------------------------------


def _tagged(queue_dir: Path, job_id: str) -> list[tuple[str, str]]:
    """(Slurm id, state) of every Slurm job whose trainq tag names ``job_id`` of this queue."""
    from trainq.watcher.slurm.state import queue_key

    out = subprocess.run(
        ["squeue", "--me", "-h", "-t", "all", "-o", "%i|%T|%k"], capture_output=True, text=True, timeout=60
    ).stdout
    rows = [line.split("|", 2) for line in out.splitlines() if line.count("|") >= 2]
    return sorted((i, state) for i, state, tag in rows if tag.startswith(f"trainq:{queue_key(queue_dir)}:{job_id}:"))


def test_a_hung_controller_across_sbatch_gives_exactly_one_slurm_job(queue_dir, watcher, tmp_path):
    """slurmctld SIGSTOPped: sbatch times out although the controller will create the job; it is adopted by tag."""
    w = watcher(**SLURM)
    counter = tmp_path / "runs.txt"
    ctld = int(CTLD_PID.read_text())
    os.kill(ctld, signal.SIGSTOP)
    try:
        drop(queue_dir, "hung.yaml", job_file(command=["sh", "-c", f"echo run >> {counter}"]))
        tick_until(
            w,
            lambda: "hung" in w.jobs and "not confirmed" in (w.jobs["hung"].run.get("waiting_for") or ""),
            60,
            "sbatch to time out against the stopped controller",
        )
        assert json.loads((queue_dir / "running" / "hung" / "slurm.json").read_text())["slurm_job_id"] is None
    finally:
        os.kill(ctld, signal.SIGCONT)
    done = tick_until(w, lambda: finished(queue_dir, "hung"), 90, "hung to run once the controller is back")
    run = run_json(done)
    assert done.parent.name == "done" and len(run["attempts"]) == 1
    assert counter.read_text() == "run\n"
    ran = [(i, state) for i, state in _tagged(queue_dir, "hung") if state != "CANCELLED"]
    assert len(ran) == 1, _tagged(queue_dir, "hung")
    assert run["attempts"][0]["slurm_job_id"] == ran[0][0]
    assert json.loads((done / "slurm.json").read_text())["slurm_job_id"] == ran[0][0]


def test_a_duplicate_submission_runs_nothing(queue_dir, watcher, tmp_path):
    """A second Slurm job for the same attempt (submitted by hand from slurm.sh) finds the claim and exits."""
    w = watcher(**SLURM)
    drop(queue_dir, "dup.yaml", job_file(command=["sh", "-c", f"echo run >> {tmp_path / 'runs.txt'}; sleep 3"]))
    folder = queue_dir / "running" / "dup"
    tick_until(w, lambda: (folder / "slurm-attempt-1.claim").exists(), 30, "dup to claim attempt 1")
    again = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path}/dup-%j.out", str(folder / "slurm.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert slurm_state(again) == "FAILED"  # exit 75 (EX_TEMPFAIL): it ran nothing
    assert "already runs as Slurm job" in (tmp_path / f"dup-{again}.out").read_text()
    done = tick_until(w, lambda: finished(queue_dir, "dup"), 30, "dup to finish")
    assert done.parent.name == "done" and (tmp_path / "runs.txt").read_text() == "run\n"


# -- polling that scales ---------------------------------------------------------------------------


def test_one_squeue_per_poll_with_a_retried_job_queued_and_many_jobs(
    queue_dir, watcher, tmp_path, monkeypatch, request
):
    """Counts real squeue runs through a wrapper on PATH while a retried attempt and 6 other jobs wait in Slurm."""
    calls = _counting(tmp_path, monkeypatch, "squeue")
    poll_s = 0.5
    w = watcher(executor="slurm", slurm={"poll_s": poll_s}, max_concurrent=10)
    drop(
        queue_dir,
        "retried.yaml",
        job_file(command=["sh", "-c", "exit 3"], retries={"max": 1, "on": ["unknown"], "backoff": "3s"}),
    )
    tick_until(
        w,
        lambda: (
            "retried" in w.jobs
            and w.jobs["retried"].run["attempts"]
            and w.jobs["retried"].run["attempts"][0].get("ended_at")
        ),
        30,
        "attempt 1 to fail",
    )
    # fill the node so attempt 2 waits in Slurm's queue, then hold 6 more jobs there
    blocker = subprocess.run(
        ["sbatch", "--parsable", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 300"],
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    ).stdout.strip()
    request.addfinalizer(lambda: subprocess.run(["scancel", blocker], capture_output=True, timeout=60))
    for i in range(6):
        drop(queue_dir, f"held{i}.yaml", job_file(command=["true"], slurm={"sbatch_args": ["--hold"]}))
    tick_until(
        w,
        lambda: (
            w.jobs["retried"].run.get("attempt") == 2
            and w.jobs["retried"].run.get("waiting_for") in ("Slurm: Resources", "Slurm: Priority")
            and all(
                ((w.jobs.get(f"held{i}") and w.jobs[f"held{i}"].run.get("waiting_for")) or "").startswith("Slurm: ")
                for i in range(6)
            )
        ),
        30,
        "everything to wait in Slurm",
    )
    assert (queue_dir / "running" / "retried" / "exit.json").exists()  # attempt 1's record is still there
    calls.write_text("")
    start = time.monotonic()
    while time.monotonic() - start < 5:
        w.tick(time.time())
        time.sleep(0.01)
    elapsed = time.monotonic() - start
    count = len(calls.read_text().splitlines())
    assert 1 <= count <= elapsed / poll_s + 1, f"{count} squeue calls in {elapsed:.1f} s"
    assert w.jobs["retried"].run.get("attempt") == 2 and not (queue_dir / "done" / "retried").exists()


# -- Slurm's own signals -----------------------------------------------------------------------------


def test_slurms_time_limit_warning_checkpoints_and_ends_as_timeout(queue_dir, watcher):
    """--time=1 (Slurm's least): --signal=B:USR1 reaches the supervisor first, the job checkpoints, status timeout."""
    w = watcher(**SLURM)
    drop(
        queue_dir,
        "limit.yaml",
        job_file(command=[PY, str(FAKE / "cooperative.py")], stop_grace="30s", slurm={"sbatch_args": ["--time=1"]}),
    )
    done = tick_until(w, lambda: finished(queue_dir, "limit"), 150, "Slurm's time limit warning to stop limit")
    run = run_json(done)
    sbatch = json.loads((done / "slurm.json").read_text())["sbatch"]
    assert "--signal=B:USR1@30" in sbatch and "--time=1" in sbatch  # the lead: at most half of a short limit
    log = (done / "output.log").read_text()
    assert "time limit is near: its warning (SIGUSR1) came" in log and "checkpoint written" in log
    assert run["status"] == "timeout" and run["diagnosis"]["kind"] == "timeout", run
    assert "may be stopped as a timeout at once; ask for at least --time=2" in log  # warned at submit
    # the limit is Slurm's --time, and the evidence says where it came from (not "raise timeout in the job file")
    assert "--time=1 from the job file's slurm.sbatch_args" in run["diagnosis"]["evidence"], run["diagnosis"]
    assert "raise --time" in run["diagnosis"]["advice"] and "timeout in the job file" not in run["diagnosis"]["advice"]
    assert (done / "checkpoints" / "step-1" / "state.txt").exists()
    assert not (done / "stop.flag").exists()  # the supervisor's own flag, removed so a retry does not start stopped
    assert slurm_state(run["slurm_job_id"]) == "COMPLETED"  # ended by trainq before Slurm's kill


def test_a_time_limit_warning_sent_the_moment_the_job_runs_is_held_until_the_supervisor_handles_it(queue_dir, watcher):
    """Slurm may send --signal's warning up to 60 s early, so at once: USR1 the moment squeue says RUNNING (before
    the node side exists) must neither kill the batch job (FAILED/JobLaunchFailure) nor be lost."""
    w = watcher(**SLURM)
    drop(
        queue_dir,
        "early.yaml",
        job_file(command=[PY, str(FAKE / "cooperative.py")], stop_grace="30s", slurm={"sbatch_args": ["--time=10"]}),
    )
    tick_until(w, lambda: "early" in w.jobs and w.jobs["early"].run.get("slurm_job_id"), 60, "early to be submitted")
    slurm_id = w.jobs["early"].run["slurm_job_id"]

    def running() -> bool:
        state = subprocess.run(["squeue", "-h", "-j", slurm_id, "-o", "%T"], capture_output=True, text=True, timeout=60)
        return state.stdout.strip() == "RUNNING"

    wait_until(running, 60, 0.005, f"Slurm job {slurm_id} to run")
    subprocess.run(["scancel", "-s", "USR1", "-b", slurm_id], check=True, timeout=60)
    folder = queue_dir / "running" / "early"
    try:
        done = tick_until(w, lambda: finished(queue_dir, "early"), 20, "the early warning to stop early")
    except pytest.fail.Exception:
        # Slurm itself drops a signal that reaches slurmd before the batch step's slurmstepd exists (measured:
        # REQUEST_KILL_JOB 9 ms after "Launching batch job", nothing delivered, the job ran on): then nothing of
        # the job saw it. The running supervisor must still be stopped by the next one.
        assert (folder / "supervisor.json").exists() and not (folder / "stop.flag").exists()
        subprocess.run(["scancel", "-s", "USR1", "-b", slurm_id], check=True, timeout=60)
        done = tick_until(w, lambda: finished(queue_dir, "early"), 120, "the early warning to stop early")
    run = run_json(done)
    log = (done / "output.log").read_text()
    assert run["status"] == "timeout" and run["diagnosis"]["kind"] == "timeout", (run, log)
    evidence = run["diagnosis"]["evidence"]
    assert "--time=10 from the job file's slurm.sbatch_args" in evidence and "warning (USR1) came" in evidence, evidence
    record = json.loads((done / "exit.json").read_text())
    if record.get("written_by") == "watcher":
        # it came while slurmstepd still launched the script, before its first line: nothing of trainq ran, and
        # the watcher says so at once (no exit grace: no supervisor can have a record on its way)
        assert slurm_state(slurm_id) == "FAILED" and record["signal"] == 10, record
        assert "while Slurm was still starting the batch script" in evidence, evidence
    else:  # held by slurm.sh's first line or blocked for Python: the supervisor stopped the job as a timeout
        assert "time limit is near: its warning (SIGUSR1) came" in log and "checkpoint written" in log, log
        assert record["time_limit_warned_at"]
        assert slurm_state(slurm_id) == "COMPLETED"


# -- multi-node (srun) -------------------------------------------------------------------------------


def test_a_two_task_job_runs_under_srun_with_its_rank_variables(queue_dir, watcher):
    w = watcher(**SLURM)
    show = "echo rank=$RANK/$WORLD_SIZE local=$LOCAL_RANK node=$NODE_RANK/$NNODES master=$MASTER_ADDR:$MASTER_PORT"
    drop(
        queue_dir,
        "ranks.yaml",
        job_file(command=["sh", "-c", show], resources={"nodes": 1, "tasks_per_node": 2}, env={"FROM_JOB": "yes"}),
    )
    done = tick_until(w, lambda: finished(queue_dir, "ranks"), 60, "ranks to finish")
    assert done.parent.name == "done", (done / "output.log").read_text()
    lines = sorted(line for line in (done / "output.log").read_text().splitlines() if line.startswith("rank="))
    slurm_id = run_json(done)["slurm_job_id"]
    port = 20000 + int(slurm_id) % 20000
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    assert lines == [
        f"rank=0/2 local=0 node=0/1 master={host}:{port}",
        f"rank=1/2 local=1 node=0/1 master={host}:{port}",
    ]
    sbatch = json.loads((done / "slurm.json").read_text())["sbatch"]
    assert "--nodes=1" in sbatch and "--ntasks-per-node=2" in sbatch
    assert json.loads((done / "launch.json").read_text())["argv"][:4] == [
        "srun",
        "--export=ALL",
        "--ntasks=2",
        "--kill-on-bad-exit=1",
    ]


# -- environment hygiene --------------------------------------------------------------------------------


def test_the_node_keeps_slurms_variables_and_gets_only_the_jobs_env(queue_dir, watcher, monkeypatch):
    monkeypatch.setenv("WATCHER_SECRET", "do-not-leak")
    monkeypatch.setenv("GPU_DEVICE_ORDINAL", "7")
    monkeypatch.setenv("TMPDIR", "/watcher-only-tmp")
    w = watcher(**SLURM)
    show = (
        "echo secret=${WATCHER_SECRET:-none} ordinal=${GPU_DEVICE_ORDINAL:-unset} tmp=$TMPDIR mine=$MINE "
        "id=$SLURM_JOB_ID"
    )
    drop(queue_dir, "envy.yaml", job_file(command=["sh", "-c", show], env={"MINE": "from-job"}))
    done = tick_until(w, lambda: finished(queue_dir, "envy"), 30, "envy to finish")
    line = next(x for x in (done / "output.log").read_text().splitlines() if x.startswith("secret="))
    slurm_id = run_json(done)["slurm_job_id"]
    assert line == f"secret=none ordinal=unset tmp=/tmp mine=from-job id={slurm_id}"
    assert (done / "launch.json").stat().st_mode & 0o777 == 0o600
    assert "do-not-leak" not in (done / "launch.json").read_text()
    assert "--export=ALL" in json.loads((done / "slurm.json").read_text())["sbatch"]


def test_node_env_clean_starts_from_the_watchers_base_and_login_from_the_nodes_login_shell(
    queue_dir, watcher, monkeypatch
):
    """clean (the default): PATH (the watcher's Python first, as for a local job) and the locale come from the
    watcher, and Slurm loads no login environment; login: Slurm loads it (``--export=NONE``, SLURM_GET_USER_ENV)."""
    monkeypatch.setenv("LC_TIME", "C.UTF-8")
    monkeypatch.setenv("WATCHER_SECRET", "do-not-leak")
    show = (
        "echo env: get_user_env=${SLURM_GET_USER_ENV:-0} lc=${LC_TIME:-unset} secret=${WATCHER_SECRET:-none} path=$PATH"
    )
    lines = {}
    for mode in ("clean", "login"):
        w = watcher(executor="slurm", slurm={"poll_s": 0.2, "node_env": mode}, max_concurrent=4)
        drop(queue_dir, f"{mode}.yaml", job_file(command=["sh", "-c", show]))
        done = tick_until(w, lambda m=mode: finished(queue_dir, m), 60, f"the {mode} job to finish")
        assert run_json(done)["status"] == "done", (done / "output.log").read_text()
        lines[mode] = next(x for x in (done / "output.log").read_text().splitlines() if x.startswith("env: "))
        w.close()
    assert "get_user_env=0 lc=C.UTF-8 secret=none" in lines["clean"]
    assert lines["clean"].split("path=")[1].split(":")[0] == str(Path(sys.executable).parent)
    assert "get_user_env=1" in lines["login"] and "secret=none" in lines["login"]


def test_a_sigkill_the_supervisor_saw_is_an_oom_when_slurms_record_says_out_of_memory(tmp_path):
    """The node's cgroup OOM kill: the supervisor records SIGKILL; Slurm's OUT_OF_MEMORY decides, not this host's dmesg."""
    from trainq.watcher.daemon.jobs import judge_exit
    from trainq.watcher.slurm.records import with_slurm_view as _with_slurm_view
    from trainq.watcher.slurm.state import SlurmJob

    paths = JobPaths(tmp_path / "job")
    paths.dir.mkdir()
    paths.log.write_text("step 1\n")
    record = {"attempt": 1, "exit_code": None, "signal": 9, "signal_name": "SIGKILL", "stop_reason": None}
    seen = _with_slurm_view(record, "77", SlurmJob("OUT_OF_MEMORY", "OutOfMemory", "node3"), paths)
    assert seen["slurm_job_id"] == "77" and seen["slurm_state"] == "OUT_OF_MEMORY"
    outcome = judge_exit({"status": "running"}, seen, paths)
    assert (outcome.status, outcome.diagnosis.kind) == ("failed", "oom")
    assert "node3" in outcome.diagnosis.evidence
    plain = judge_exit({"status": "running"}, _with_slurm_view(record, "78", SlurmJob("FAILED"), paths), paths)
    assert plain.diagnosis.kind == "killed"  # no OOM evidence from Slurm, and this host's kernel log is not asked
    # without cgroups Slurm's OverMemoryKill ends the job FAILED; only its output file says it was the memory
    (paths.dir / "slurm-79.out").write_text(
        "slurmstepd-n1: error: StepId=79.batch exceeded memory limit (644571136 > 104857600), being killed\n"
    )
    killed = judge_exit({"status": "running"}, _with_slurm_view(record, "79", SlurmJob("FAILED"), paths), paths)
    assert killed.diagnosis.kind == "oom" and "exceeded memory limit" in killed.diagnosis.evidence


def test_a_job_over_its_memory_is_killed_by_slurm_and_diagnosed_oom(queue_dir, watcher):
    """A real Slurm memory kill: resources.ram_gb 0.1 (--mem=103M), the job touches 600 MB; the test cluster
    enforces --mem with JobAcctGatherParams=OverMemoryKill (no cgroups here), which ends the job FAILED."""
    w = watcher(**SLURM)
    hog = "x = bytearray(600 << 20); x[::4096] = b'1' * len(x[::4096]); import time; time.sleep(30)"
    drop(queue_dir, "hog.yaml", job_file(command=[PY, "-c", hog], resources={"ram_gb": 0.1}))
    done = tick_until(w, lambda: finished(queue_dir, "hog"), 90, "Slurm to kill hog for its memory")
    run = run_json(done)
    assert "--mem=103M" in json.loads((done / "slurm.json").read_text())["sbatch"]
    assert run["status"] == "failed" and run["diagnosis"]["kind"] == "oom", run
    assert "memory limit" in run["diagnosis"]["evidence"].lower() and "--mem" in run["diagnosis"]["evidence"]


def test_a_node_supervisor_killed_outright_ends_the_job_once_its_heartbeat_stops(queue_dir, watcher):
    """kill -9 of the node side: Slurm ends the batch job, no exit record, the heartbeat stops moving -> killed."""
    w = watcher(**{**SLURM, "slurm": {"poll_s": 0.2, "exit_grace_s": 1}})
    w.executor.heartbeat_stale_s = 3.0  # the real staleness is 3 heartbeats (30 s); only the wait shrinks here
    drop(queue_dir, "victim.yaml", job_file(command=["sh", "-c", "echo up; sleep 600"]))
    folder = queue_dir / "running" / "victim"
    tick_until(
        w, lambda: (folder / "supervisor.json").exists() and (folder / "heartbeat.json").exists(), 30, "victim to start"
    )
    beat = json.loads((folder / "heartbeat.json").read_text())
    assert beat["attempt"] == 1 and beat["slurm_job_id"] == w.jobs["victim"].run["slurm_job_id"]
    started = json.loads((folder / "supervisor.json").read_text())
    os.kill(started["supervisor_pid"], signal.SIGKILL)  # as a node crash would: supervisor and job at once
    os.killpg(started["pgid"], signal.SIGKILL)  # (this cluster's proctrack/linuxproc loses reparented processes)
    done = tick_until(w, lambda: finished(queue_dir, "victim"), 60, "victim to be found dead")
    run = run_json(done)
    assert run["status"] == "failed" and len(run["attempts"]) == 1
    assert run["diagnosis"]["kind"] == "killed", run["diagnosis"]
    assert "without an exit record" in (done / "output.log").read_text()


def test_slurms_requeue_is_the_retry_when_the_job_opts_in(queue_dir, watcher, tmp_path):
    """slurm: {requeue: true}: Slurm requeues the running job; it runs again as the same attempt, never twice at once."""
    w = watcher(**SLURM)
    runs = tmp_path / "runs.txt"
    cmd = (
        f'echo run ${{SLURM_RESTART_COUNT:-0}} >> {runs}; [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ] && exit 0; sleep 600'
    )
    drop(queue_dir, "again.yaml", job_file(command=["sh", "-c", cmd], slurm={"requeue": True}))
    tick_until(w, lambda: runs.exists() and runs.read_text() == "run 0\n", 30, "the first run to start")
    slurm_id = w.jobs["again"].run["slurm_job_id"]
    assert "--requeue" in json.loads((queue_dir / "running" / "again" / "slurm.json").read_text())["sbatch"]
    subprocess.run(["scontrol", "requeue", slurm_id], check=True, timeout=60, capture_output=True)
    tick_until(
        w,
        lambda: (w.jobs["again"].run.get("waiting_for") or "") == "Slurm: BeginTime",
        30,
        "Slurm to hold the requeued job",
    )
    assert w.jobs["again"].state.value == "running" and w.jobs["again"].attempt == 1  # no retry of trainq's own
    subprocess.run(
        ["scontrol", "update", f"jobid={slurm_id}", "StartTime=now"], check=True, timeout=60, capture_output=True
    )  # Slurm would wait 2 minutes before running it again
    done = tick_until(w, lambda: finished(queue_dir, "again"), 60, "the requeued run to finish")
    run = run_json(done)
    assert done.parent.name == "done" and len(run["attempts"]) == 1 and run["slurm_job_id"] == slurm_id
    assert runs.read_text() == "run 0\nrun 1\n"


def test_a_job_waiting_in_slurms_queue_is_never_stalled(queue_dir, watcher):
    """stall_after counts from the start on a node, not from the submission: a held job waits without a stall."""
    w = watcher(**SLURM)
    drop(queue_dir, "patient.yaml", job_file(command=["true"], stall_after="2s", slurm={"sbatch_args": ["--hold"]}))
    tick_until(
        w,
        lambda: "patient" in w.jobs and w.jobs["patient"].run.get("waiting_for") == "Slurm: JobHeldUser",
        15,
        "patient to be held in Slurm",
    )
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        w.tick(time.time())
        time.sleep(0.05)
    assert w.jobs["patient"].health == "healthy" and not (queue_dir / "running" / "patient" / "stop.flag").exists()
    subprocess.run(
        ["scontrol", "release", w.jobs["patient"].run["slurm_job_id"]], check=True, timeout=60, capture_output=True
    )
    done = tick_until(w, lambda: finished(queue_dir, "patient"), 30, "patient to run once released")
    assert done.parent.name == "done"


# -- job arrays for sweeps -----------------------------------------------------------------------------


def test_array_spec_ids_and_tags_of_job_arrays():
    from trainq.watcher.slurm.node import own_slurm_id
    from trainq.watcher.slurm.state import array_index, array_spec, duplicate_key, id_order, make_array_tag, make_tag

    assert array_spec([3, 1, 2, 5, 7, 8, 8]) == "1-3,5,7-8" and array_spec([4]) == "4"
    assert (array_index("123_4"), array_index("123"), array_index("x_1")) == (4, None, None)
    assert sorted(["12_10", "12_9", "11", "13"], key=id_order) == ["11", "12_9", "12_10", "13"]
    tag = make_array_tag("k", "grid", "t0")
    assert duplicate_key("12_3", tag, "k") == f"{tag}#3" != duplicate_key("12_4", tag, "k")
    assert (
        duplicate_key("12", make_tag("k", "j", 2, "t1"), "k")
        == "j:2"
        == duplicate_key("13", make_tag("k", "j", 2, "t2"), "k")
    )
    assert duplicate_key("12_3", tag, "other queue") is None
    assert own_slurm_id({"SLURM_JOB_ID": "125", "SLURM_ARRAY_JOB_ID": "123", "SLURM_ARRAY_TASK_ID": "4"}) == "123_4"
    assert own_slurm_id({"SLURM_JOB_ID": "125"}) == "125"


def test_array_script_runs_the_task_of_its_index_and_refuses_a_folder_it_cannot_see(tmp_path):
    from trainq.watcher.slurm.executor import array_script

    script = tmp_path / "slurm.sh"
    script.write_text(array_script(tmp_path / "running", "grid", 2, ["sbatch", "x"], sys.executable, str(REPO)))
    done = subprocess.run(
        ["sh", str(script)], capture_output=True, text=True, timeout=30, env=dict(os.environ, SLURM_ARRAY_TASK_ID="7")
    )
    assert done.returncode == EXIT_NOT_SHARED and f"{tmp_path}/running/grid-7 is not visible" in done.stderr


def test_a_sweep_is_one_sbatch_array_and_a_retried_job_goes_alone(queue_dir, watcher, tmp_path, monkeypatch):
    """A 4-job sweep: one ``sbatch --array=1-4``, task i runs job grid-i; its job 2 fails once and its retry is a
    plain sbatch of its own."""
    sbatch = _counting(tmp_path, monkeypatch, "sbatch")
    w = watcher(executor="slurm", slurm={"poll_s": 0.2}, max_concurrent=8)
    marker = tmp_path / "failed-once"
    drop(
        queue_dir,
        "grid.yaml",
        job_file(
            command=[
                "sh",
                "-c",
                f"echo x={{x}} task=$SLURM_ARRAY_TASK_ID; [ {{x}} != 2 ] || [ -e {marker} ] "
                f"|| {{ touch {marker}; exit 3; }}",
            ],
            sweep={"x": [1, 2, 3, 4]},
            retries={"max": 1, "on": ["unknown"], "backoff": "1s"},
        ),
    )
    tick_until(w, lambda: all(finished(queue_dir, f"grid-{i}") for i in range(1, 5)), 90, "the sweep to finish")
    calls = sbatch.read_text().splitlines()
    assert len(calls) == 2 and "--array=1-4" in calls[0] and "--array" not in calls[1], calls
    first = [json.loads((finished(queue_dir, f"grid-{i}") / "slurm.json").read_text()) for i in range(1, 5)]
    array_id = json.loads((finished(queue_dir, "grid-1") / "run.json").read_text())["attempts"][0]["slurm_job_id"]
    array_id = array_id.partition("_")[0]
    for i in range(1, 5):
        done = finished(queue_dir, f"grid-{i}")
        run = run_json(done)
        assert done.parent.name == "done" and run["status"] == "done", run
        assert run["attempts"][0]["slurm_job_id"] == f"{array_id}_{i}"
        log = (done / "output.log").read_text()
        assert f"x={i} task={i}" in log
    retried = run_json(finished(queue_dir, "grid-2"))
    assert len(retried["attempts"]) == 2 and retried["attempts"][1]["slurm_job_id"].isdigit()
    assert "x=2 task=\n" in (finished(queue_dir, "grid-2") / "output.log").read_text()  # attempt 2: no array
    assert all(r["tag"].endswith(first[0]["tag"].rpartition(":")[2]) for r in (first[0], first[2], first[3]))
    assert [r.get("array_index") for r in (first[0], first[2], first[3])] == [1, 3, 4]
    assert slurm_state(f"{array_id}_4") == "COMPLETED"


def test_stopping_a_sweep_queued_in_slurm_is_one_scancel(queue_dir, watcher, tmp_path, monkeypatch):
    """Six jobs of a sweep wait in Slurm as one array; stop.flag in each: one scancel for all, all cancelled."""
    scancel = _counting(tmp_path, monkeypatch, "scancel")
    w = watcher(executor="slurm", slurm={"poll_s": 0.2}, max_concurrent=8)
    drop(
        queue_dir,
        "later.yaml",
        job_file(command=["echo", "{x}"], sweep={"x": list(range(6))}, slurm={"sbatch_args": ["--begin=now+1hour"]}),
    )
    ids = [f"later-{i}" for i in range(1, 7)]
    tick_until(
        w,
        lambda: all(i in w.jobs and w.jobs[i].run.get("waiting_for") == "Slurm: BeginTime" for i in ids),
        20,
        "the sweep to wait in Slurm",
    )
    # status.json, `trainq status` and `trainq why` say why a launched job has not started: Slurm's reason
    tick_until(
        w,
        lambda: (status_job(queue_dir, "later-3") or {}).get("waiting_for") == "Slurm: BeginTime",
        10,
        "status.json to show Slurm's reason",
    )
    for command in ("status", "why"):
        shown = subprocess.run(
            [PY, "-m", "trainq.watcher", "--root", str(queue_dir), command] + (["later-3"] if command == "why" else []),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "Slurm: BeginTime" in shown.stdout, shown.stdout
    for job_id in ids:
        (queue_dir / "running" / job_id / "stop.flag").touch()
    tick_until(w, lambda: all(finished(queue_dir, i) for i in ids), 20, "the sweep to be cancelled")
    assert all(run_json(finished(queue_dir, i))["status"] == "cancelled" for i in ids)
    calls = scancel.read_text().splitlines()
    assert len(calls) == 1 and len(calls[0].split()) == 6, calls
    assert not [line for line in _live_slurm_ids() if line.partition("_")[0] == calls[0].split()[0].partition("_")[0]]


def test_a_hung_controller_across_an_array_sbatch_gives_exactly_one_array(queue_dir, watcher, tmp_path):
    """slurmctld SIGSTOPped while a sweep's array is submitted: the array is adopted by its tag, never doubled."""
    w = watcher(executor="slurm", slurm={"poll_s": 0.2}, max_concurrent=8)
    counter = tmp_path / "runs.txt"
    ctld = int(CTLD_PID.read_text())
    os.kill(ctld, signal.SIGSTOP)
    try:
        drop(
            queue_dir,
            "hung.yaml",
            job_file(command=["sh", "-c", f"echo run {{x}} >> {counter}"], sweep={"x": [1, 2, 3]}),
        )
        tick_until(
            w,
            lambda: all(
                f"hung-{i}" in w.jobs and "not confirmed" in (w.jobs[f"hung-{i}"].run.get("waiting_for") or "")
                for i in (1, 2, 3)
            ),
            60,
            "sbatch to time out against the stopped controller",
        )
    finally:
        os.kill(ctld, signal.SIGCONT)
    tick_until(w, lambda: all(finished(queue_dir, f"hung-{i}") for i in (1, 2, 3)), 120, "the sweep to run")
    assert sorted(counter.read_text().splitlines()) == ["run 1", "run 2", "run 3"]
    tasks = [(i, state) for i, state in _tagged(queue_dir, "hung") if state != "CANCELLED"]
    assert sorted(i.partition("_")[2] for i, _ in tasks) == ["1", "2", "3"], _tagged(queue_dir, "hung")
    assert len({i.partition("_")[0] for i, _ in tasks}) == 1
    for i in (1, 2, 3):
        run = run_json(finished(queue_dir, f"hung-{i}"))
        assert run["status"] == "done" and len(run["attempts"]) == 1
        assert run["attempts"][0]["slurm_job_id"] in {i for i, _ in tasks}


def test_an_array_that_never_reached_slurm_is_submitted_again_once_for_all_its_jobs(
    queue_dir, watcher, tmp_path, monkeypatch
):
    """The first sbatch answers "Socket timed out" and creates nothing (an sbatch wrapper on PATH): after the tag
    lookup finds nothing, the array is submitted again ONE time, not once per job, and each job runs once."""
    calls, lost = tmp_path / "sbatch-calls", tmp_path / "lost-once"
    wrapper = tmp_path / "bin" / "sbatch"
    wrapper.parent.mkdir()
    wrapper.write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\nif [ ! -e {lost} ]; then touch {lost}; echo \'sbatch: '
        "error: Batch job submission failed: Socket timed out on send/recv operation' >&2; exit 1; fi\n"
        f'exec {shutil.which("sbatch")} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}:{os.environ['PATH']}")
    counter = tmp_path / "runs.txt"
    w = watcher(executor="slurm", slurm={"poll_s": 0.2}, max_concurrent=8)
    drop(queue_dir, "lost.yaml", job_file(command=["sh", "-c", f"echo run {{x}} >> {counter}"], sweep={"x": [1, 2, 3]}))
    tick_until(w, lambda: all(finished(queue_dir, f"lost-{i}") for i in (1, 2, 3)), 60, "the sweep to run")
    submitted = calls.read_text().splitlines()
    assert len(submitted) == 2 and all("--array=1-3" in line for line in submitted), submitted
    assert sorted(counter.read_text().splitlines()) == ["run 1", "run 2", "run 3"]
    ids = [run_json(finished(queue_dir, f"lost-{i}"))["attempts"][0]["slurm_job_id"] for i in (1, 2, 3)]
    assert len({i.partition("_")[0] for i in ids}) == 1 and [i.partition("_")[2] for i in ids] == ["1", "2", "3"]


def test_a_watcher_killed_while_a_sweeps_array_waits_readopts_every_task(queue_dir, watcher_process):
    """SIGKILL the watcher while a 3-job array waits in Slurm: the next watcher adopts each task by its id
    <array>_<i>, submits nothing again, and `trainq stop SWEEP` cancels all three."""
    (queue_dir / "watcher.yaml").write_text(yaml.safe_dump({**SLURM, "settle_s": 0.1}))
    first = watcher_process()
    drop(
        queue_dir,
        "held.yaml",
        job_file(command=["echo", "{x}"], sweep={"x": [1, 2, 3]}, slurm={"sbatch_args": ["--begin=now+1hour"]}),
    )
    ids = [f"held-{i}" for i in (1, 2, 3)]
    wait_until(
        lambda: all((status_job(queue_dir, i) or {}).get("waiting_for") == "Slurm: BeginTime" for i in ids),
        30,
        what="the sweep's array to wait in Slurm",
    )
    tasks = [json.loads((queue_dir / "running" / i / "slurm.json").read_text())["slurm_job_id"] for i in ids]
    first.kill()
    second = watcher_process()
    wait_until(
        lambda: (
            json.loads((queue_dir / "status.json").read_text())["watcher"]["pid"] == second.proc.pid
            and all((status_job(queue_dir, i) or {}).get("waiting_for") == "Slurm: BeginTime" for i in ids)
        ),
        20,
        what="the new watcher to adopt the three tasks",
    )
    stopped = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "stop", "held"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "sweep held: stop requested for 3 job(s)" in stopped.stdout, stopped.stderr
    wait_until(lambda: all(finished(queue_dir, i) for i in ids), 30, what="the sweep to be cancelled")
    for job_id, task in zip(ids, tasks, strict=False):
        run = run_json(finished(queue_dir, job_id))
        assert run["status"] == "cancelled" and [a["slurm_job_id"] for a in run["attempts"]] == [task]
    # one array, nothing submitted twice (Slurm shows a cancelled never-started array as its id alone)
    assert {i.partition("_")[0] for i, _ in _tagged(queue_dir, "held")} == {tasks[0].partition("_")[0]}
