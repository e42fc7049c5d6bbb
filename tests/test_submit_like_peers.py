"""Submit like the peers (issue 35 item 4): pueue, nq, task-spooler and sbatch all run where you submit from.

``trainq submit -- CMD`` runs in the directory it was called from (``--cwd DIR``, ``--env K=V``), writes its
job.yaml as YAML, ``--parsable`` prints the id alone, a job refused on arrival exits 2; ``rerun`` prints the
new id, ``rm`` takes a sweep id, ``pause --pool`` of an unknown pool is refused; ids and pools complete.
"""

from __future__ import annotations

import argparse
import json

from conftest import drop, run_json, tick_until, trainq, wait_until

from trainq.watcher.spec.yaml12 import load_yaml12


def test_submit_dash_dash_runs_where_it_was_called_with_cwd_and_env(queue_dir, watcher_process, tmp_path):
    proj = tmp_path / "proj"
    (proj / "x").mkdir(parents=True)
    (proj / "x" / "hello.py").write_text("import os\nprint('hello', os.getcwd(), os.environ.get('GREETING'))\n")
    (queue_dir / "watcher.yaml").write_text("rescan_s: 0.2\nsettle_s: 0.1\n")
    watcher_process()
    wait_until(lambda: (queue_dir / "status.json").exists(), 30)

    out = trainq(queue_dir, "submit", "--parsable", "--gpus", "0", "--", "python3", "x/hello.py", cwd=proj)
    assert out.returncode == 0 and out.stdout == "hello\n", out.stdout + out.stderr  # the id, and only it
    wait_until(lambda: (queue_dir / "done" / "hello").is_dir(), 30, what="hello done")
    assert f"hello {proj} None" in (queue_dir / "done" / "hello" / "output.log").read_text()
    text = (queue_dir / "done" / "hello" / "job.yaml").read_text()
    assert not text.lstrip("# \n").startswith("{"), text  # YAML, not JSON
    assert "\ncommand:\n- python3\n- x/hello.py\n" in text
    assert load_yaml12(text)["cwd"] == str(proj) and run_json(queue_dir, "hello")["submitted_from"] == str(proj)

    out = trainq(
        queue_dir,
        "submit",
        "--parsable",
        "--name",
        "elsewhere",
        "--gpus",
        "0",
        "--cwd",
        "x",
        "--env",
        "GREETING=hi there",
        "--env",
        "N=1e-4",
        "--",
        "python3",
        "hello.py",
        cwd=proj,
    )
    assert out.returncode == 0 and out.stdout == "elsewhere\n", out.stdout + out.stderr
    wait_until(lambda: (queue_dir / "done" / "elsewhere").is_dir(), 30, what="elsewhere done")
    assert f"hello {proj / 'x'} hi there" in (queue_dir / "done" / "elsewhere" / "output.log").read_text()
    env = load_yaml12((queue_dir / "done" / "elsewhere" / "job.yaml").read_text())["env"]
    assert env == {"GREETING": "hi there", "N": "1e-4"}  # a string that looks like a number stays a string

    bad = trainq(queue_dir, "submit", "--env", "no-equals", "--", "true", cwd=proj)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and ": env: expected NAME=VALUE" in bad.stderr


def test_a_job_refused_on_arrival_exits_2(queue_dir, watcher_process, tmp_path):
    (queue_dir / "watcher.yaml").write_text(f"allow_commands: [python3]\nallow_cwd: [{tmp_path}]\nrescan_s: 0.2\n")
    watcher_process()
    wait_until(lambda: (queue_dir / "status.json").exists(), 30)
    out = trainq(queue_dir, "submit", "--", "true", cwd=tmp_path)  # only the watcher knows its allow list
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "inbox/true.yaml: command: " in out.stderr and "allow_commands" in out.stderr
    assert run_json(queue_dir, "true")["status"] == "rejected"
    parsable = trainq(queue_dir, "submit", "--parsable", "--", "true", cwd=tmp_path)
    assert parsable.returncode == 2 and parsable.stdout == "true-2\n"


def test_rerun_prints_the_new_job_id(queue_dir, watcher_process, tmp_path):
    (queue_dir / "watcher.yaml").write_text("rescan_s: 0.2\nsettle_s: 0.1\n")
    watcher_process()
    wait_until(lambda: (queue_dir / "status.json").exists(), 30)
    drop(queue_dir, "once.yaml", json.dumps({"approved": True, "command": ["true"], "snapshot": False}))
    wait_until(lambda: run_json(queue_dir, "once").get("status") == "done", 30)
    out = trainq(queue_dir, "rerun", "once", "--here")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "job once-rerun (rerun of once)", out.stdout
    wait_until(lambda: run_json(queue_dir, "once-rerun").get("status") == "done", 30)


def test_rm_takes_a_sweep_id_as_stop_does(queue_dir, watcher, tmp_path):
    w = watcher()
    (queue_dir / "pause.flag").touch()
    drop(queue_dir, "grid.yaml", "approved: true\ncommand: [echo, '{v}']\nsweep: {v: [a, b, c]}\n")
    tick_until(w, lambda: all((queue_dir / "pending" / f"grid-{i}").is_dir() for i in (1, 2, 3)))
    drop(queue_dir, "grid-like.yaml", "approved: true\ncommand: ['true']\n")  # not of the sweep: stays
    tick_until(w, lambda: (queue_dir / "pending" / "grid-like").is_dir())
    out = trainq(queue_dir, "rm", "grid")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "sweep grid: 3 job(s) (grid-1 … grid-3)"
    tick_until(w, lambda: not any((queue_dir / "pending" / f"grid-{i}").exists() for i in (1, 2, 3)))
    assert (queue_dir / "pending" / "grid-like").is_dir()
    missing = trainq(queue_dir, "rm", "grid")
    assert missing.returncode == 2 and "no job with id 'grid'" in missing.stderr


def test_pause_of_an_unknown_pool_is_refused(queue_dir):
    out = trainq(queue_dir, "pause", "--pool", "gpu")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert f"{queue_dir / 'watcher.yaml'}: pools: pool 'gpu' is not in watcher.yaml pools" in out.stderr
    assert not (queue_dir / "pause.gpu.flag").exists()
    (queue_dir / "watcher.yaml").write_text("pools: {gpu: {max_concurrent: 1}}\n")
    assert trainq(queue_dir, "pause", "--pool", "gpu").returncode == 0 and (queue_dir / "pause.gpu.flag").exists()
    assert trainq(queue_dir, "pause", "--pool", "default").returncode == 0


def test_completion_covers_diff_rerun_events_and_pools_and_every_positional_has_help(queue_dir):
    from trainq.watcher.cli.main import _parser
    from trainq.watcher.cli.manage_commands import job_ids, pool_names

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    completers = {}
    for name, command in sub.choices.items():
        for action in command._actions:
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"trainq {name}: {action.dest} has no help text"
            completers[(name, action.dest)] = getattr(action, "completer", None)
    for key in (("diff", "a"), ("diff", "b"), ("rerun", "id"), ("events", "id")):
        assert completers[key] is job_ids, key
    for key in (("submit", "pool"), ("pause", "pool"), ("resume", "pool")):
        assert completers[key] is pool_names, key
    (queue_dir / "watcher.yaml").write_text("pools: {gpu: {max_concurrent: 1}, cpu: {max_concurrent: 4}}\n")
    args = argparse.Namespace(root=str(queue_dir))
    assert pool_names("", args) == ["cpu", "default", "gpu"] and pool_names("g", args) == ["gpu"]
