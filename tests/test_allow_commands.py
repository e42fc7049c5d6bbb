"""Issue 12, item 6: allow_commands is a boundary (docs/settings.md). One test per bypass that used
to work with ``allow_commands: [echo]``; each is refused and the other program never runs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import drop, tick_until

from trainq.watcher.spec.allow import LOADER_VARIABLES, is_loader_variable, resolve_executable
from trainq.watcher.spec.fsutil import read_json

ECHO = shutil.which("echo")


@pytest.fixture
def evil(queue_dir: Path) -> Path:
    """A folder beside the queue holding another program named ``echo`` that leaves a marker when run."""
    folder = queue_dir.parent / "evil"
    folder.mkdir()
    script = folder / "echo"
    script.write_text(f"#!/bin/sh\ntouch {folder / 'RAN'}\n")
    script.chmod(0o755)
    return folder


def run_json(queue_dir: Path, state: str, job: str) -> dict:
    return json.loads((queue_dir / state / job / "run.json").read_text())


def rejected(queue_dir: Path, w, job: str) -> dict:
    tick_until(w, lambda: (queue_dir / "failed" / job).exists(), what=f"{job} rejected")
    run = run_json(queue_dir, "failed", job)
    assert run["status"] == "rejected", run
    return run


def test_allowed_echo_runs_as_the_real_path_checked(queue_dir, watcher):
    w = watcher(allow_commands=["echo"])
    drop(queue_dir, "ok.yaml", "approved: true\ncommand: [echo, hello]\n")
    drop(queue_dir, "abs.yaml", f"approved: true\ncommand: [{os.path.realpath(ECHO)}, abs]\n")
    tick_until(w, lambda: (queue_dir / "done" / "ok").exists() and (queue_dir / "done" / "abs").exists())
    assert "hello" in (queue_dir / "done" / "ok" / "output.log").read_text()


def test_absolute_path_to_another_echo_is_refused(queue_dir, watcher, evil):
    w = watcher(allow_commands=["echo"])
    drop(queue_dir, "abs.yaml", f"approved: true\ncommand: [{evil / 'echo'}]\n")
    run = rejected(queue_dir, w, "abs")
    assert run["errors"][0]["path"] == "command" and "not in allow_commands" in run["error"]
    assert f"resolves to {evil / 'echo'}" in run["error"]
    assert not (evil / "RAN").exists()


def test_env_path_is_refused(queue_dir, watcher, evil):
    w = watcher(allow_commands=["echo"])
    drop(queue_dir, "path.yaml", f"approved: true\ncommand: [echo]\nenv: {{PATH: {evil}}}\n")
    run = rejected(queue_dir, w, "path")
    assert run["errors"][0]["path"] == "env.PATH" and "allow_commands" in run["error"]
    assert not (evil / "RAN").exists()


def test_relative_echo_with_cwd_is_refused(queue_dir, watcher, evil):
    w = watcher(allow_commands=["echo"], allow_cwd=[str(evil)])  # the cwd is allowed; its ./echo is not
    drop(queue_dir, "rel.yaml", f"approved: true\ncommand: [./echo]\ncwd: {evil}\n")
    run = rejected(queue_dir, w, "rel")
    assert f"resolves to {evil / 'echo'}" in run["error"]
    assert not (evil / "RAN").exists()


def test_job_dir_placeholder_escape_is_refused(queue_dir, watcher, evil):
    w = watcher(allow_commands=["echo"])
    drop(queue_dir, "ph.yaml", "approved: true\ncommand: ['{job_dir}/../../../evil/echo']\n")
    run = rejected(queue_dir, w, "ph")
    assert f"resolves to {evil / 'echo'}" in run["error"]
    assert not (evil / "RAN").exists()


@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "BASH_ENV"])
def test_loader_variables_are_refused(queue_dir, watcher, evil, name):
    w = watcher(allow_commands=["echo"])
    drop(queue_dir, "ld.yaml", f"approved: true\ncommand: [echo]\nenv: {{{name}: {evil}/x}}\n")
    run = rejected(queue_dir, w, "ld")
    assert run["errors"][0]["path"] == f"env.{name}"


def test_folder_written_straight_into_pending_is_checked_at_start(queue_dir, watcher, evil):
    sneaky = queue_dir / "pending" / "sneaky"
    sneaky.mkdir()
    (sneaky / "job.yaml").write_text(f"approved: true\ncommand: [{evil / 'echo'}]\n")
    w = watcher(allow_commands=["echo"])  # start-up recovery adopts it as a pending job
    run = rejected(queue_dir, w, "sneaky")
    assert "not in allow_commands" in run["error"] and run["error"].startswith("sneaky/job.yaml: command: ")
    assert not (evil / "RAN").exists()
    drop(queue_dir, "fine.yaml", "approved: true\ncommand: [echo, still, fine]\n")
    tick_until(w, lambda: (queue_dir / "done" / "fine").exists())


def test_without_a_list_everything_still_runs(queue_dir, watcher, evil):
    w = watcher()
    drop(queue_dir, "any.yaml", f"approved: true\ncommand: [./echo]\ncwd: {evil}\nenv: {{LD_X: 1}}\n")
    tick_until(w, lambda: (queue_dir / "done" / "any").exists())
    assert (evil / "RAN").exists()


def test_resolution_rules(tmp_path: Path) -> None:
    assert resolve_executable("echo", "/", os.environ["PATH"]) == os.path.realpath(ECHO)
    assert resolve_executable("echo", "/", str(tmp_path)) is None  # the watcher's PATH decides, nothing else
    assert resolve_executable("./nothing", str(tmp_path), "") is None
    assert all(is_loader_variable(n) for n in ("PATH", "LD_PRELOAD", "DYLD_INSERT_LIBRARIES", "PYTHONPATH"))
    assert not any(is_loader_variable(n) for n in ("HF_HOME", "CUDA_VISIBLE_DEVICES", "path", "MY_PATH"))
    assert "PATH" in LOADER_VARIABLES


def test_on_finish_hook_is_held_to_the_list(queue_dir, watcher, evil):
    w = watcher(allow_commands=["echo", "true"])
    drop(queue_dir, "hook.yaml", f'approved: true\ncommand: ["true"]\non_finish: [{evil / "echo"}]\n')
    run = rejected(queue_dir, w, "hook")
    assert run["errors"][0]["path"] == "on_finish" and f"resolves to {evil / 'echo'}" in run["error"]


def test_on_finish_edited_after_acceptance_is_refused_when_it_runs(queue_dir, watcher, evil):
    (queue_dir / "watcher.yaml").write_text("allow_commands: [echo, sh]\n")  # what the hook runner reads
    w = watcher(allow_commands=["echo", "sh"])
    wait_for_go = "while [ ! -e go ]; do sleep 0.05; done"  # runs until the test has edited job.yaml
    drop(queue_dir, "late.yaml", f"approved: true\ncommand: [sh, -c, '{wait_for_go}']\non_finish: [echo, hook-ran]\n")
    tick_until(w, lambda: (queue_dir / "running" / "late" / "job.yaml").exists())
    spec = queue_dir / "running" / "late" / "job.yaml"
    spec.write_text(spec.read_text().replace("on_finish: [echo, hook-ran]", f"on_finish: [{evil / 'echo'}]"))
    (queue_dir / "running" / "late" / "go").touch()
    hook = queue_dir / "done" / "late" / "hook.json"
    tick_until(w, lambda: (read_json(hook) or {}).get("state") == "ended", 60)  # it may be half-written
    record = read_json(hook)
    assert "not in allow_commands" in record["error"]
    assert "not run" in (queue_dir / "done" / "late" / "hook.log").read_text()
    assert not (evil / "RAN").exists()
