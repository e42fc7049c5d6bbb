"""A hostile user against a real watcher process (the audit of issues 12 and 14): each test is a
hole found from the outside with real files and processes, kept as its repro."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import PY, REPO, drop, wait_until

from trainq.watcher.spec.fsutil import read_json


def _run(queue_dir: Path, state: str, job: str) -> dict:
    return json.loads((queue_dir / state / job / "run.json").read_text())


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_train_job_cannot_load_code_through_its_env_under_allow_commands(queue_dir, watcher_process, tmp_path):
    """Train jobs run python: PYTHONPATH (sitecustomize.py) in their env ran any code despite allow_commands."""
    evil = tmp_path / "evil"
    evil.mkdir()
    marker = tmp_path / "RAN"
    (evil / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (queue_dir / "watcher.yaml").write_text("settle_s: 0.1\nrescan_s: 0.5\nallow_commands: [echo]\n")
    watcher_process()
    drop(
        queue_dir,
        "t.yaml",
        "approved: true\n"
        f"train: {{model: {tmp_path}/no-model, data: {tmp_path}/no.jsonl, max_steps: 1}}\n"
        f"env: {{PYTHONPATH: {evil}}}\n",
    )
    wait_until(lambda: marker.exists() or (queue_dir / "failed" / "t" / "run.json").exists(), 60, what="t ends")
    assert not marker.exists(), "the train job's PYTHONPATH ran code allow_commands does not allow"
    run = _run(queue_dir, "failed", "t")
    assert run["status"] == "rejected" and run["errors"][0]["path"] == "env.PYTHONPATH", run


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the watcher must be able to read a root-only file")
def test_a_hard_link_to_a_root_only_file_quotes_none_of_its_lines(queue_dir, watcher_process, tmp_path):
    """A root watcher (the systemd case) rejected a hard link to /etc/shadow quoting each line as an unknown key."""
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$SALTsalt$HASHhashHASHhash:19000:0:99999:7:::\ndaemon:SECRETSECRET:19000:0:99999:7:::\n")
    secret.chmod(0o640)  # root's own file, not for everyone: like /etc/shadow
    watcher_process()
    os.link(secret, queue_dir / "inbox" / "hard.yaml")
    wait_until(lambda: (queue_dir / "failed" / "hard" / "run.json").exists(), 30, what="hard rejected")
    run = _run(queue_dir, "failed", "hard")
    assert run["status"] == "rejected"
    assert any("unknown key" in e["message"] and "not shown" in e["message"] for e in run["errors"]), run["errors"]
    wait_until(lambda: "hard" in (queue_dir / "status.json").read_text(), 10, what="status.json lists hard")
    for name in ("failed/hard/run.json", "status.json", "watcher.log"):
        text = (queue_dir / name).read_text()
        assert "SALT" not in text and "HASH" not in text and "SECRET" not in text, f"{name} quotes the file: {text}"
    # a private file of the watcher's own user with one link (a user's own submission) keeps its quotes
    own = tmp_path / "own.yaml"
    own.write_text('approved: true\ncommand: ["true"]\npriority: high\n')
    own.chmod(0o600)
    os.rename(own, queue_dir / "inbox" / "own.yaml")
    wait_until(lambda: (queue_dir / "failed" / "own" / "run.json").exists(), 30, what="own rejected")
    assert '(got "high")' in _run(queue_dir, "failed", "own")["error"]


HOOK = r"""
import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
same_group = subprocess.Popen(["sleep", "300"], preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
if os.fork() == 0:  # escapes: a new session, then orphaned, with an empty environment
    os.setsid()
    if os.fork() == 0:
        os.execve("/bin/sleep", ["sleep", "301"], {})
    os._exit(0)
os.wait()
open("pids", "w").write(str(same_group.pid))
"""


def test_on_finish_leftovers_are_killed_at_the_limit(queue_dir, watcher_process):
    """A hook that forks and exits left its children running for good (the 60 s limit killed only its group)."""
    watcher_process(env={"TRAINQ_HOOK_TIMEOUT_S": "2"})
    drop(queue_dir, "hk.yaml", f'approved: true\ncommand: ["true"]\non_finish: [{PY}, -c, {json.dumps(HOOK)}]\n')
    pids_file = queue_dir / "done" / "hk" / "pids"
    wait_until(pids_file.exists, 30, what="the hook ran")
    same_group = int(pids_file.read_text())
    escaped = wait_until(
        lambda: [p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "301"]],
        10,
        what="the escaped sleep",
    )
    try:
        wait_until(
            lambda: _gone(same_group) and all(_gone(p) for p in escaped),
            30,
            what="every process the hook left is killed",
        )
        record = wait_until(
            lambda: (
                (read_json(queue_dir / "done" / "hk" / "hook.json") or {}).get("state") == "ended"
                and read_json(queue_dir / "done" / "hk" / "hook.json")
            ),
            10,
            what="hook.json ended",
        )
        assert record["state"] == "ended" and record["timed_out"] is True, record
        assert record["exit_code"] == 0  # the hook itself ended well; what it left ran past the limit
        assert _run(queue_dir, "done", "hk")["status"] == "done"
    finally:
        for pid in [same_group, *escaped]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize(
    "field, text",
    [
        ("command[0]", 'command: [""]\n'),
        ("command[0]", 'command: ["  ", x]\n'),
        ("on_finish[0]", 'command: ["true"]\non_finish: [""]\n'),
    ],
)
def test_an_empty_program_name_is_rejected_at_the_door(queue_dir, watcher_process, field, text):
    """command: [""] passed validation, then failed at start as 'permission denied running ' (kind unknown)."""
    watcher_process()
    drop(queue_dir, "blank.yaml", "approved: true\n" + text)
    wait_until(lambda: (queue_dir / "failed" / "blank" / "run.json").exists(), 30, what="blank ends")
    run = _run(queue_dir, "failed", "blank")
    assert run["status"] == "rejected" and run["errors"][0]["path"] == field, run
    assert "blank" in run["errors"][0]["message"]


def _controls(text: str) -> list[str]:
    return [c for c in text if (ord(c) < 32 and c != "\n") or 127 <= ord(c) < 160]


def test_why_and_show_never_send_a_jobs_terminal_escapes(queue_dir, watcher_process, tmp_path):
    """A job's output is the evidence `trainq why`/`show` print: a C1 CSI (U+009B) in it reached the terminal raw."""
    script = tmp_path / "esc.py"
    script.write_text(
        "import sys\nE, CSI = chr(27), chr(0x9b)\n"
        "print(E + ']0;title' + chr(7) + 'RuntimeError: CUDA out of memory ' + CSI + '2J' + E + '[31m')\n"
        "sys.exit(1)\n"
    )
    watcher_process()
    drop(queue_dir, "esc.yaml", f"approved: true\ncommand: [{PY}, {script}]\n")
    wait_until(lambda: (queue_dir / "failed" / "esc" / "run.json").exists(), 30, what="esc fails")
    for command in ("why", "show"):
        out = subprocess.run(
            [PY, "-m", "trainq.watcher", "--root", str(queue_dir), command, "esc"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert out.returncode == 0 and "out of memory" in out.stdout, out
        assert not _controls(out.stdout), f"trainq {command} printed {_controls(out.stdout)}: {out.stdout!r}"


def test_a_placeholder_sweep_value_must_be_text_or_a_number(queue_dir, watcher_process):
    """{a} with a: [{x: 1}, null] ran `echo "{'x': 1}"` and `echo None` (Python's repr) instead of refusing."""
    watcher_process()
    drop(queue_dir, "sw.yaml", 'approved: true\ncommand: [echo, "{a}"]\nsweep: {a: [ok, {x: 1}, null, [1]]}\n')
    wait_until(lambda: (queue_dir / "failed" / "sw" / "run.json").exists(), 30, what="sw rejected")
    run = _run(queue_dir, "failed", "sw")
    assert run["status"] == "rejected", run
    assert [e["path"] for e in run["errors"]] == ["sweep.a[1]", "sweep.a[2]", "sweep.a[3]"], run["errors"]
    assert all("placeholder" in e["message"] for e in run["errors"])
    assert not any((queue_dir / state / "sw-1").exists() for state in ("pending", "running", "done"))


def _hook_runners(watcher_pid: int) -> int:
    """The watcher's live children that are hook runners (a runner's own children are not counted)."""
    count = 0
    for proc in psutil.Process(watcher_pid).children():
        try:
            if "trainq.watcher.supervisor.hooks" in proc.cmdline():
                count += 1
        except psutil.Error:
            continue
    return count


def test_hooks_of_many_jobs_ending_at_once_run_a_few_at_a_time(queue_dir, watcher_process):
    """A sweep whose jobs all fail at once, with a hook that waits (a webhook to a server that is down), started
    one 25 MB Python runner per job at once: 1000 of them are 25 GB. Now at most MAX_HOOK_RUNNERS run."""
    from trainq.watcher.supervisor.hooks import MAX_HOOK_RUNNERS

    (queue_dir / "watcher.yaml").write_text("settle_s: 0.1\nrescan_s: 0.5\nmax_concurrent: 8\n")
    watcher = watcher_process()
    jobs = 3 * MAX_HOOK_RUNNERS
    drop(
        queue_dir,
        "many.yaml",
        f'approved: true\ncommand: ["false", "{{i}}"]\non_finish: [sleep, "1"]\nsweep: {{i: {list(range(jobs))}}}\n',
    )

    def all_hooks_ended() -> bool:
        records = [read_json(queue_dir / "failed" / f"many-{i}" / "hook.json") or {} for i in range(1, jobs + 1)]
        return all(r.get("state") == "ended" for r in records)

    most = 0
    deadline = time.monotonic() + 120
    while not all_hooks_ended():
        most = max(most, _hook_runners(watcher.proc.pid))
        assert time.monotonic() < deadline, f"hooks not all ended; {most} runners at most"
        time.sleep(0.05)
    assert 1 <= most <= MAX_HOOK_RUNNERS, most
    assert all(
        (read_json(queue_dir / "failed" / f"many-{i}" / "hook.json") or {}).get("exit_code") == 0
        for i in range(1, jobs + 1)
    )


@pytest.mark.parametrize(
    "trap",
    [
        "mkfifo checkpoint-1/trainer_state.json",
        "ln -s /dev/zero checkpoint-1/trainer_state.json",
        "mkfifo last.ckpt",
        "ln -s /dev/zero last.ckpt",
    ],
)
def test_a_checkpoint_that_is_a_fifo_or_dev_zero_never_stalls_the_watcher(queue_dir, watcher_process, trap):
    """The checkpoint walk read trainer_state.json and *.ckpt with a plain open: a FIFO there hung the watcher
    for good (no heartbeat, no other job), /dev/zero read without end."""
    watcher_process()
    drop(
        queue_dir,
        "trap.yaml",
        "approved: true\n"
        f'command: [sh, -c, "mkdir -p checkpoint-1; [ -e checkpoint-1/x ] || {trap}; '
        'touch checkpoint-1/x; exit 1"]\n'
        'resume_args: [--resume, "{resume_from}"]\n'
        "retries: {max: 1, backoff: 1s, on: [unknown]}\n",
    )
    wait_until(lambda: (queue_dir / "failed" / "trap" / "run.json").exists(), 30, what="trap fails after its retry")
    drop(queue_dir, "after.yaml", "approved: true\ncommand: [echo, still here]\n")
    wait_until(lambda: (queue_dir / "done" / "after").exists(), 30, what="a later job still runs")
    attempts = _run(queue_dir, "failed", "trap")["attempts"]
    assert len(attempts) == 2 and attempts[1].get("resumed_from") is None, attempts


def test_a_stop_flag_made_a_fifo_by_the_job_does_not_block_its_supervisor(queue_dir, watcher_process):
    """The supervisor read stop.flag with a plain open: a job that made it a FIFO froze its own supervisor,
    so the stop never came (no grace, no kill) and the job held its slot for good."""
    watcher_process()
    drop(
        queue_dir,
        "ff.yaml",
        'approved: true\ncommand: [sh, -c, "mkfifo \\"$TRAINQ_STOP_FLAG\\"; sleep 120"]\nstop_grace: 1s\n',
    )
    wait_until(lambda: (queue_dir / "failed" / "ff" / "run.json").exists(), 40, what="ff stopped")
    assert _run(queue_dir, "failed", "ff")["status"] == "cancelled"


def test_a_jobs_output_line_never_stalls_the_watcher(queue_dir, watcher_process, tmp_path):
    """The progress-bar pattern began with ``(.*?)\\s*``: one printed line of 60,000 spaces between two letters
    held the watcher at 100% CPU for over a minute (quadratic; a 1 MiB line, hours): no heartbeat, no job."""
    script = tmp_path / "line.py"
    script.write_text(
        "import time\n"
        "print('a' + ' ' * 200000 + 'b', flush=True)\n"
        "print('1%|' + 'x' * 200000 + '|1/1 [1<1' + ' ' * 200000 + 'z', flush=True)\n"
        "print(\"{'loss': \" + '1' * 100000, flush=True)\n"
        "time.sleep(60)\n"
    )
    (queue_dir / "watcher.yaml").write_text("settle_s: 0.1\nrescan_s: 0.5\nmax_concurrent: 2\n")
    watcher_process()
    drop(queue_dir, "line.yaml", f"approved: true\ncommand: [{PY}, {script}]\nstop_grace: 1s\n")
    wait_until(
        lambda: (
            (queue_dir / "running" / "line" / "output.log").exists()
            and "z" in (queue_dir / "running" / "line" / "output.log").read_text()
        ),
        30,
        what="the long lines",
    )
    time.sleep(1)  # the watcher reads them on its next ticks
    drop(queue_dir, "next.yaml", "approved: true\ncommand: [echo, next]\n")
    wait_until(lambda: (queue_dir / "done" / "next").exists(), 20, what="the next job runs meanwhile")
    (queue_dir / "running" / "line" / "stop.flag").touch()
    wait_until(lambda: (queue_dir / "failed" / "line").exists(), 30, what="line stopped")


def test_a_deeply_nested_metrics_line_is_skipped_not_fatal(queue_dir, watcher_process, tmp_path):
    """json.loads of '[' * 200,000 raises RecursionError (not a ValueError): the watcher stopped the job as an
    internal error (failed, unknown) for one line of its metrics.jsonl, which the contract says is skipped."""
    script = tmp_path / "deep.py"
    script.write_text(
        "import json, os, time\n"
        "with open(os.environ['TRAINQ_METRICS'], 'w') as f:\n"
        "    f.write('[' * 200000 + '\\n' + '{' + chr(34) + 'a' + chr(34) + ': ' + '[' * 200000 + '}\\n' + json.dumps({'type': 'step', 'step': 1, 'loss': 2.0}) + '\\n')\n"
        "open('summary.json', 'w').write('{\"a\": ' + '[' * 200000)\n"
        "time.sleep(3)\n"
    )
    watcher_process()
    drop(queue_dir, "deep.yaml", f"approved: true\ncommand: [{PY}, {script}]\n")
    wait_until(
        lambda: any((queue_dir / s / "deep" / "run.json").exists() for s in ("done", "failed")), 40, what="deep ends"
    )
    run = _run(queue_dir, "done", "deep")
    assert run["status"] == "done", run
    assert "Traceback" not in (queue_dir / "watcher.log").read_text()
