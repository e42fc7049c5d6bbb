"""Refused at submit what can be known (issue 35 item 3, docs/cli.md "Submitting").

A missing model, data file, init_from, cwd or script; an unknown pool; shell syntax in a one-string command:
``trainq validate``, ``trainq submit`` and the watcher's acceptance all refuse them, one line naming the file
and the field, and nothing else in the queue changes. Relative paths resolve against ``submitted_from``. A
path that vanishes after submit fails the run as ``config``, advised ``trainq edit ID``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from conftest import PY, drop, run_json, tick_until, trainq

from trainq.watcher.daemon.diagnosis import diagnose


def queue_listing(root: Path) -> dict[str, list[str]]:
    """Every visible entry of the five folders: what "nothing else changed" is checked against."""
    return {d: sorted(n for n in os.listdir(root / d) if not n.startswith(".")) for d in ("inbox", "pending", "failed")}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project folder: a model folder, train.jsonl, a script in x/."""
    proj = tmp_path / "proj"
    (proj / "model").mkdir(parents=True)
    (proj / "model" / "config.json").write_text("{}")
    (proj / "train.jsonl").write_text('{"text": "hi"}\n')
    (proj / "x").mkdir()
    (proj / "x" / "hello.py").write_text("print('hello from x')\n")
    return proj


def test_validate_refuses_each_missing_path_by_field_with_did_you_mean(queue_dir, project):
    (project / "job.yaml").write_text(
        "approved: true\ntrain:\n  model: model\n  data: trian.jsonl\n  init_from: adapters/a\n  max_steps: 3\n"
    )
    out = trainq(queue_dir, "validate", str(project / "job.yaml"))
    assert out.returncode == 2, out.stdout
    lines = out.stdout.splitlines()
    assert len(lines) == 2, lines  # one line a problem; model resolves against the file's folder and exists
    data_line = next(line for line in lines if "train.data" in line)
    assert data_line.startswith(f"{project / 'job.yaml'}: train.data: trian.jsonl: no such file")
    assert "did you mean train.jsonl?" in data_line
    assert any(line.endswith("no such folder (" + str(project / "adapters/a") + ")") for line in lines), lines

    (project / "cmd.yaml").write_text("approved: true\ncwd: .\ncommand: [python3, x/hellp.py]\n")
    (project / "cwd.yaml").write_text("approved: true\ncwd: nowhere\ncommand: [python3, x/hello.py]\n")
    (project / "bin.yaml").write_text("approved: true\ncwd: .\ncommand: [./run.sh, --fast]\n")
    (project / "bare.yaml").write_text("approved: true\ncommand: [python3, x/hello.py]\n")
    out = trainq(queue_dir, "validate", *(str(project / n) for n in ("cmd.yaml", "cwd.yaml", "bin.yaml", "bare.yaml")))
    assert out.returncode == 2
    got = {line.split(": ", 1)[0]: line for line in out.stdout.splitlines()}  # file -> its one line
    assert got[str(project / "cmd.yaml")].startswith(f"{project / 'cmd.yaml'}: command[1]: x/hellp.py: no such file")
    assert got[str(project / "cmd.yaml")].endswith("did you mean x/hello.py?")
    assert got[str(project / "cwd.yaml")].startswith(f"{project / 'cwd.yaml'}: cwd: ")
    assert got[str(project / "bin.yaml")].startswith(f"{project / 'bin.yaml'}: command[0]: ")
    assert f"nowhere: no such folder ({project / 'nowhere'})" in out.stdout
    assert "./run.sh: no such file" in out.stdout
    assert "sets no cwd, so it would run in its own new job folder" in out.stdout  # bare.yaml: no cwd
    assert len(out.stdout.splitlines()) == 4

    (project / "ok.yaml").write_text("approved: true\ncwd: .\ncommand: [python3, -u, x/hello.py]\n")
    ok = trainq(queue_dir, "validate", str(project / "ok.yaml"))
    assert ok.returncode == 0 and "ok, approved" in ok.stdout, ok.stdout


def test_shell_syntax_in_a_one_string_command_is_refused_showing_the_sh_c_form(queue_dir, watcher, tmp_path):
    command = "python3 -c 'print(1)' | tee out.txt"
    job = tmp_path / "pipe.yaml"
    job.write_text(yaml.safe_dump({"approved": True, "command": command}))
    before = queue_listing(queue_dir)
    for args in (("validate", str(job)), ("submit", str(job))):
        out = trainq(queue_dir, *args)
        assert out.returncode == 2
        text = out.stdout + out.stderr
        assert text.count("\n") == 1 and f"{job}: command: " in text
        assert f"command: [sh, -c, {json.dumps(command)}]" in text and "(|)" in text
    assert queue_listing(queue_dir) == before  # nothing else in the queue changed
    # the form the message shows is valid and runs the pipe through a shell
    fixed = yaml.safe_load(f"command: [sh, -c, {json.dumps(command)}]")["command"]
    for word in ("a 'quoted $HOME' arg", r"escaped \| bar", "python3 -m http.server"):
        job.write_text(yaml.safe_dump({"approved": True, "command": word}))
        assert trainq(queue_dir, "validate", str(job)).returncode == 0, word  # no shell syntax a shell would act on

    w = watcher()  # dropped straight into the inbox: acceptance refuses it too, and it never runs
    drop(queue_dir, "pipe.yaml", yaml.safe_dump({"approved": True, "command": command}))
    tick_until(w, lambda: run_json(queue_dir, "pipe").get("status") == "rejected")
    errors = run_json(queue_dir, "pipe")["errors"]
    assert [e["path"] for e in errors] == ["command"] and "[sh, -c," in errors[0]["message"]
    assert not (queue_dir / "failed" / "pipe" / "out.txt").exists()
    drop(queue_dir, "piped.yaml", yaml.safe_dump({"approved": True, "command": fixed, "cwd": str(tmp_path)}))
    tick_until(w, lambda: run_json(queue_dir, "piped").get("status") == "done")
    assert (tmp_path / "out.txt").read_text() == "1\n"


def test_placeholders_and_sweep_values_in_paths_are_never_refused(queue_dir, project):
    files = {
        "ph.yaml": "approved: true\ncommand: [python3, '{job_dir}/gen.py']\n",
        "after.yaml": "approved: true\nafter: [prep]\ntrain: {model: model, data: train.jsonl, "
        "init_from: '{after:prep}/adapter', max_steps: 2}\n",
        "cwdph.yaml": "approved: true\ncwd: '{job_dir}/work'\ncommand: [python3, run.py]\n",
        "sweep.yaml": "approved: true\ncwd: .\ncommand: [python3, 'x/{name}.py']\nsweep: {name: [hello, other]}\n",
    }
    for name, text in files.items():
        (project / name).write_text(text)
    out = trainq(queue_dir, "validate", *(str(project / n) for n in files))
    assert out.returncode == 2 and out.stdout.count("\n") == 4, out.stdout
    # a sweep key is expanded: each variant's script is a real path, and x/other.py is missing
    assert "sweep.yaml: command[1]: x/other.py: no such file" in out.stdout
    (project / "x" / "other.py").write_text("print('other')\n")
    out = trainq(queue_dir, "validate", *(str(project / n) for n in files))
    assert out.returncode == 0, out.stdout
    # a sweep's dotted key that names a missing file is refused, by the variant's field
    (project / "grid.yaml").write_text(
        "approved: true\ntrain: {model: model, data: train.jsonl, max_steps: 2}\n"
        "sweep: {train.data: [train.jsonl, trian.jsonl]}\n"
    )
    out = trainq(queue_dir, "validate", str(project / "grid.yaml"))
    assert out.returncode == 2 and out.stdout.count("\n") == 1 and "train.data: trian.jsonl: no such file" in out.stdout


def test_unknown_pool_is_refused_at_submit_from_watcher_yaml_as_it_is_now(queue_dir, tmp_path):
    job = tmp_path / "p.yaml"
    job.write_text('approved: true\npool: gpu\ncommand: ["true"]\n')
    for args in (("validate", str(job)), ("submit", str(job)), ("submit", "--pool", "gpu", "--", "true")):
        out = trainq(queue_dir, *args)
        assert out.returncode == 2 and "pool: pool 'gpu' is not in watcher.yaml pools (known: default)" in (
            out.stdout + out.stderr
        ), args
    assert queue_listing(queue_dir)["inbox"] == []
    (queue_dir / "watcher.yaml").write_text("pools: {gpu: {max_concurrent: 1}}\n")
    assert trainq(queue_dir, "validate", str(job)).returncode == 0


def test_relative_paths_resolve_against_submitted_from(queue_dir, watcher, project):
    (project / "job.yaml").write_text("approved: true\ncwd: x\ncommand: [python3, hello.py]\n")
    w = watcher()
    out = trainq(queue_dir, "submit", "job.yaml", cwd=project)
    assert out.returncode == 0, out.stderr
    taken = (queue_dir / "inbox" / "job.yaml").read_text()
    assert f"submitted_from: {json.dumps(str(project))}" in taken  # the one line submit adds
    tick_until(w, lambda: run_json(queue_dir, "job").get("status") == "done")
    assert run_json(queue_dir, "job")["submitted_from"] == str(project)
    assert "hello from x" in (queue_dir / "done" / "job" / "output.log").read_text()
    # dropped straight into the inbox: the queue root is where relative paths start
    (queue_dir / "tools").mkdir()
    (queue_dir / "tools" / "t.py").write_text("print('from the root')\n")
    drop(queue_dir, "rooted.yaml", "approved: true\ncwd: tools\ncommand: [python3, t.py]\n")
    tick_until(w, lambda: run_json(queue_dir, "rooted").get("status") == "done")
    assert run_json(queue_dir, "rooted")["submitted_from"] == str(queue_dir.resolve())
    assert "from the root" in (queue_dir / "done" / "rooted" / "output.log").read_text()


@pytest.mark.parametrize("what", ["script", "cwd"])
def test_a_path_gone_after_submit_fails_as_config_advising_trainq_edit(queue_dir, watcher, project, what):
    w = watcher()
    (queue_dir / "pause.flag").touch()
    text = f"approved: true\ncwd: x\ncommand: [{PY}, hello.py]\nsubmitted_from: {json.dumps(str(project))}\n"
    drop(queue_dir, "gone.yaml", text)
    tick_until(w, lambda: (queue_dir / "pending" / "gone" / "run.json").exists())
    if what == "script":
        (project / "x" / "hello.py").unlink()
    else:
        (project / "x" / "hello.py").unlink()
        (project / "x").rmdir()
    (queue_dir / "pause.flag").unlink()
    tick_until(w, lambda: run_json(queue_dir, "gone").get("status") == "failed", what="the job failed")
    diagnosis = run_json(queue_dir, "gone")["diagnosis"]
    assert diagnosis["kind"] == "config", diagnosis
    assert "trainq edit ID" in diagnosis["advice"] and "retry.flag" not in diagnosis["advice"]
    assert ("hello.py" if what == "script" else str(project / "x")) in diagnosis["evidence"]
    why = trainq(queue_dir, "why", "gone").stdout
    assert "trainq edit gone" in why and "trainq retry gone" not in why and "retry.flag" not in why, why


def test_the_trainers_config_error_line_is_diagnosed_config():
    line = "trainq: /q/running/a/job.yaml: train.data: /home/u/trian.jsonl does not exist"
    d = diagnose({"exit_code": 2, "signal": None, "stop_reason": None}, line + "\n")
    assert d is not None and d.kind == "config" and d.evidence == line and "trainq edit ID" in d.advice
    shell = diagnose({"exit_code": 127, "signal": None, "stop_reason": None}, "bash: run.sh: No such file or directory")
    assert shell is not None and shell.kind == "config"
    data = diagnose({"exit_code": 1, "signal": None, "stop_reason": None}, "json.decoder.JSONDecodeError: Expecting")
    assert data is not None and data.kind == "data"  # a bad row stays data: editing the job file does not cure it


def test_the_trainer_resolves_relative_paths_against_submitted_from(tmp_path, project):
    """What acceptance checked is what the trainer opens: run.json's submitted_from, then the job folder."""
    from trainq.trainer.config import load_config

    job = tmp_path / "queue" / "running" / "t"
    job.mkdir(parents=True)
    (job / "job.yaml").write_text("approved: true\ntrain: {model: model, data: train.jsonl, max_steps: 2}\n")
    (job / "run.json").write_text(json.dumps({"submitted_from": str(project)}))
    config = load_config(job)
    assert config.model == str(project / "model") and config.train_sources[0][0] == str(project / "train.jsonl")
    (job / "run.json").write_text("{}")  # dropped into inbox/ by hand: the queue root
    (tmp_path / "queue" / "model").mkdir()
    (tmp_path / "queue" / "model" / "config.json").write_text("{}")
    (tmp_path / "queue" / "train.jsonl").write_text('{"text": "x"}\n')
    assert load_config(job).model == str(tmp_path / "queue" / "model")
