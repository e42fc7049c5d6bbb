"""The trainq command line: a thin layer over the files, with exit codes 0 / 2 (invalid input) / 1."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from conftest import PY, REPO, drop, tick_until, wait_until

from trainq.watcher.spec.folders import JobState


def trainq(*args: str, root: Path | None = None, check_rc: int | None = None) -> subprocess.CompletedProcess:
    cmd = [PY, "-m", "trainq.watcher"] + (["--root", str(root)] if root else []) + list(args)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stdout + proc.stderr
    return proc


def test_init_creates_the_five_folders(tmp_path):
    root = tmp_path / "q"
    out = trainq("init", str(root), check_rc=0)
    assert {p.name for p in root.iterdir()} == {"inbox", "pending", "running", "done", "failed", "schemas"}
    assert str(root) in out.stdout


def test_validate_lists_every_problem_with_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("approved: true\ncommand: [echo]\npriority: high\nresources: {gpus: -1, gpu: 2}\ntimeout: soon\n")
    good = tmp_path / "good.yaml"
    good.write_text("command: [echo, hi]\n")
    out = trainq("validate", str(good), str(bad), check_rc=2)
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith(f"{good}: ok, valid, awaiting approval")
    problems = [line for line in lines[1:]]
    assert len(problems) == 4, problems
    assert all(line.startswith(f"{bad}: ") for line in problems)
    for field in ("priority", "resources.gpus", "resources.gpu", "timeout"):
        assert any(f": {field}: " in line for line in problems), (field, problems)
    trainq("validate", str(good), check_rc=0)


def test_submit_approve_renames_in_atomically_and_never_clobbers(queue_dir, tmp_path):
    src = tmp_path / "job.yaml"
    src.write_text("# mine\napproved: false\ncommand: [echo, hi]\n")
    trainq("submit", str(src), "--approve", root=queue_dir, check_rc=0)
    trainq("submit", str(src), root=queue_dir, check_rc=0)
    inbox = sorted(p.name for p in (queue_dir / "inbox").iterdir())
    assert inbox == ["job-2.yaml", "job.yaml"]
    # every byte kept; added: approved, and the folder relative paths resolve against (docs/contract.md)
    added = f"submitted_from: {json.dumps(str(tmp_path))}\n"
    assert (queue_dir / "inbox" / "job.yaml").read_text() == "# mine\napproved: true\ncommand: [echo, hi]\n" + added
    assert "approved: false" in (queue_dir / "inbox" / "job-2.yaml").read_text()
    assert src.read_text().startswith("# mine\napproved: false")  # the user's file is untouched


def test_submit_debug_adds_train_debug_and_keeps_every_other_byte(queue_dir, tmp_path):
    from trainq.watcher.spec.jobspec import parse_job_text

    (tmp_path / "m").mkdir()  # the model and data exist: submit refuses missing paths (docs/contract.md)
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    block = (
        f"# mine\napproved: false  # not yet\ntrain:\n    # the base\n    model: {tmp_path}/m\n"
        "    max_steps: 3\n    data: {train: d.jsonl}\nname: sft\n"
    )
    flow = f"train: {{model: {tmp_path}/m, max_steps: 3, data: {{train: d.jsonl}}, debug: false}}\n"
    added = f"submitted_from: {json.dumps(str(tmp_path))}\n"
    (tmp_path / "block.yaml").write_text(block)
    (tmp_path / "flow.yaml").write_text(flow)
    trainq("submit", "--debug", str(tmp_path / "block.yaml"), root=queue_dir, check_rc=0)
    trainq("submit", "--debug", str(tmp_path / "flow.yaml"), root=queue_dir, check_rc=0)
    inbox = queue_dir / "inbox"
    assert sorted(p.name for p in inbox.iterdir()) == ["block.yaml", "flow.yaml"]  # no temp file left behind
    got = (inbox / "block.yaml").read_text()
    assert got == block.replace("    model:", "    debug: true\n    model:") + added
    assert (inbox / "flow.yaml").read_text() == flow.replace("debug: false", "debug: true") + added
    for name in ("block.yaml", "flow.yaml"):
        spec = parse_job_text((inbox / name).read_text(), name)
        assert spec.is_train and spec.train["debug"] is True and not spec.approved
    assert (tmp_path / "block.yaml").read_text() == block  # the user's file is untouched

    (tmp_path / "cmd.yaml").write_text("command: [echo, hi]\n")
    out = trainq("submit", "--debug", str(tmp_path / "cmd.yaml"), root=queue_dir, check_rc=2)
    assert len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith(f"{tmp_path / 'cmd.yaml'}: command: --debug") and "train jobs only" in out.stderr
    assert sorted(p.name for p in inbox.iterdir()) == ["block.yaml", "flow.yaml"]


def test_submit_of_a_sweep_prints_its_jobs_at_once(queue_dir, watcher_process):
    """A sweep file becomes new job files (ID-1 … ID-N), so its inode is in none of them: submit names the
    sweep as soon as the watcher expanded it, instead of waiting out its 10 s and printing a guess."""
    (queue_dir / "watcher.yaml").write_text(FAST)
    watcher_process()
    wait_until(lambda: (queue_dir / "status.json").exists(), 30)  # else submit waits 2 s, not 10, at load 15
    src = _job(queue_dir, "grid", "echo {lr}", 'sweep: {lr: ["1e-4", "2e-4", "3e-4"]}\n')
    started = time.monotonic()
    out = trainq("submit", str(src), root=queue_dir, check_rc=0).stdout.strip()
    assert out == "sweep grid: jobs grid-1 … grid-3"
    assert time.monotonic() - started < 8
    again = trainq("submit", str(src), root=queue_dir, check_rc=0).stdout.strip()  # ids grid-2, grid-3 are taken
    assert again == "sweep grid-4: jobs grid-4-1 … grid-4-3"


def test_submit_refuses_an_invalid_file_with_exit_2(queue_dir, tmp_path):
    src = tmp_path / "bad.yaml"
    src.write_text("approved: true\n")
    out = trainq("submit", str(src), root=queue_dir, check_rc=2)
    assert "command" in out.stderr and str(src) in out.stderr
    assert list((queue_dir / "inbox").iterdir()) == []


def test_status_logs_stop_retry_over_the_files(queue_dir, watcher, write_job):
    w = watcher()
    write_job("hello", command=["sh", "-c", "echo hello-from-job; exit 3"])
    tick_until(w, lambda: (queue_dir / "failed" / "hello").exists())
    w.report.write(w, time.time(), force=True)
    status = json.loads(trainq("status", "--json", root=queue_dir, check_rc=0).stdout)
    assert status["counts"]["failed"] == 1
    assert "hello-from-job" in trainq("logs", "hello", root=queue_dir, check_rc=0).stdout
    assert "only for jobs in pending/ or running/" in trainq("stop", "hello", root=queue_dir, check_rc=2).stderr
    trainq("retry", "hello", root=queue_dir, check_rc=0)
    assert (queue_dir / "failed" / "hello" / "retry.flag").exists()
    trainq("stop", "nope", root=queue_dir, check_rc=2)
    text = trainq("status", root=queue_dir, check_rc=0).stdout
    assert "hello" in text


def test_help_is_fast():
    started = time.monotonic()
    trainq("--help", check_rc=0)
    assert time.monotonic() - started < 5  # the benchmark holds the real figure (<= 300 ms)


# -- finding the queue, global options, version ------------------------------------------------------------


def _trainq_in(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRAINQ_ROOT"}
    full_env.update(env or {})
    return subprocess.run(
        [PY, "-m", "trainq.watcher", *args], cwd=cwd, capture_output=True, text=True, timeout=60, env=full_env
    )


def test_root_after_the_command_and_version(queue_dir):
    (queue_dir / "status.json").write_text(json.dumps({"schema_version": 1, "counts": {"done": 3}}))
    out = trainq("status", "--json", "--root", str(queue_dir), check_rc=0)  # --root after the command
    assert json.loads(out.stdout)["counts"]["done"] == 3
    from importlib.metadata import version

    assert trainq("--version", check_rc=0).stdout.strip() == f"trainq {version('trainq')}"


def test_queue_is_found_by_env_then_dot_queue_then_user_config(tmp_path):
    config_home = tmp_path / "config"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # nothing names a queue: the error lists every place it looked
    out = _trainq_in(elsewhere, "pause", env={"XDG_CONFIG_HOME": str(config_home)})
    assert out.returncode == 2, out.stderr
    for place in ("--root", "$TRAINQ_ROOT", str(elsewhere / "queue"), str(config_home / "trainq" / "config.yaml")):
        assert place in out.stderr, (place, out.stderr)
    # the user config names the default root
    served = tmp_path / "srv" / "queue"
    _trainq_in(tmp_path, "init", str(served))
    (config_home / "trainq").mkdir(parents=True)
    (config_home / "trainq" / "config.yaml").write_text(f"root: {served}\n")
    _trainq_in(elsewhere, "pause", env={"XDG_CONFIG_HOME": str(config_home)})
    assert (served / "pause.flag").exists()
    # ./queue wins over the config file, TRAINQ_ROOT over ./queue
    _trainq_in(elsewhere, "init", "queue")
    _trainq_in(elsewhere, "pause", env={"XDG_CONFIG_HOME": str(config_home)})
    assert (elsewhere / "queue" / "pause.flag").exists()
    other = tmp_path / "other"
    _trainq_in(tmp_path, "init", str(other))
    _trainq_in(elsewhere, "pause", env={"XDG_CONFIG_HOME": str(config_home), "TRAINQ_ROOT": str(other)})
    assert (other / "pause.flag").exists()
    # a wrong config file is one line naming the file and the key
    (config_home / "trainq" / "config.yaml").write_text("queue: /x\n")
    out = _trainq_in(config_home, "status", env={"XDG_CONFIG_HOME": str(config_home)})
    assert out.returncode == 2 and "config.yaml: root:" in out.stderr, out.stderr


def test_init_writes_the_schemas_and_schema_prints_an_absolute_path(tmp_path):
    root = tmp_path / "q"
    trainq("init", str(root), check_rc=0)
    assert (root / "schemas" / "job.schema.json").read_text() == (REPO / "schemas" / "job.schema.json").read_text()
    assert (root / "schemas" / "train.schema.json").exists()  # job.schema.json refers to it
    path = Path(trainq("schema", "--path", check_rc=0).stdout.strip())
    assert path.is_absolute() and path.name == "job.schema.json" and json.loads(path.read_text())["$schema"]


# -- the management commands against a real watcher ----------------------------------------------------------

FAST = "settle_s: 0.1\nrescan_s: 0.2\nstatus_s: 0.1\n"


def _job(queue_dir: Path, name: str, command: str, extra: str = "") -> Path:
    src = queue_dir.parent / f"{name}.yaml"
    src.write_text(f"approved: true\ncommand: [sh, -c, {json.dumps(command)}]\n{extra}")
    return src


def _where(queue_dir: Path, job_id: str) -> str | None:
    return next((s for s in ("pending", "running", "done", "failed") if (queue_dir / s / job_id).is_dir()), None)


def _listed(queue_dir: Path) -> set[str]:
    status = json.loads((queue_dir / "status.json").read_text())
    return {j["id"] for j in status["jobs"]}


def test_stop_with_a_sweep_id_stops_every_pending_and_running_job_of_the_sweep(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text(FAST + "max_concurrent: 2\n")
    watcher_process()
    wait_until(lambda: (queue_dir / "status.json").exists(), 30)  # else submit waits 2 s, not 10
    grid = _job(queue_dir, "grid", "echo {x}; sleep 60", "sweep: {x: [1, 2, 3, 4]}\n")
    assert trainq("submit", str(grid), root=queue_dir, check_rc=0).stdout.strip() == "sweep grid: jobs grid-1 … grid-4"
    wait_until(lambda: _where(queue_dir, "grid-2") == "running", 30, what="two of the sweep running")
    out = trainq("stop", "--now", "grid", root=queue_dir, check_rc=0)
    assert out.stdout.strip() == "sweep grid: stop requested for 4 job(s) (grid-1 … grid-4), without the grace"
    wait_until(lambda: all(_where(queue_dir, f"grid-{i}") == "failed" for i in range(1, 5)), 30, what="all stopped")
    statuses = {
        json.loads((queue_dir / "failed" / f"grid-{i}" / "run.json").read_text())["status"] for i in range(1, 5)
    }
    assert statuses == {"cancelled"}
    assert "none of its 4 job(s) is pending or running" in trainq("stop", "grid", root=queue_dir, check_rc=2).stderr


def test_submit_prints_the_job_id_and_rm_removes_pending_running_and_finished(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text(FAST + "max_concurrent: 1\n")
    watcher_process()
    wait_until(lambda: (queue_dir / "status.json").exists(), 30)  # else submit waits 2 s, not 10, at load 15
    long = _job(queue_dir, "long", "echo started; sleep 60", "stop_grace: 60s\n")
    assert trainq("submit", str(long), root=queue_dir, check_rc=0).stdout.strip() == "job long"
    assert trainq("submit", str(long), root=queue_dir, check_rc=0).stdout.strip() == "job long-2"
    quick = _job(queue_dir, "quick", "exit 0")
    assert trainq("submit", str(quick), root=queue_dir, check_rc=0).stdout.strip() == "job quick"
    wait_until(lambda: _where(queue_dir, "long") == "running", 30, what="long running")
    # pending: gone at once, and the watcher forgets it
    out = trainq("rm", "long-2", root=queue_dir, check_rc=0)
    assert "removed (pending/long-2)" in out.stdout and _where(queue_dir, "long-2") is None
    # running: stopped (--now skips its 60 s grace), then removed
    started = time.monotonic()
    out = trainq("rm", "--now", "long", root=queue_dir, check_rc=0)
    assert "stopping now" in out.stdout and "removed (failed/long)" in out.stdout
    assert time.monotonic() - started < 30
    # finished: removed, and status.json stops listing it
    wait_until(
        lambda: _where(queue_dir, "quick") == "done",
        30,
        what=f"quick done ({_where(queue_dir, 'quick')}; {(queue_dir / 'watcher.log').read_text()})",
    )
    trainq("rm", "quick", root=queue_dir, check_rc=0)
    wait_until(lambda: not _listed(queue_dir) & {"long", "long-2", "quick"}, 15, what="status.json forgot them")
    assert "no job with id 'nope'" in trainq("rm", "nope", root=queue_dir, check_rc=2).stderr
    assert "Traceback" not in (queue_dir / "watcher.stderr").read_text()


def test_edited_pending_job_is_reread_or_rejected_and_a_removed_one_forgotten(queue_dir, watcher, write_job):
    w = watcher(max_concurrent=1, rescan_s=0.05, settle_s=0.05)
    write_job("blocker", command=["sleep", "30"])
    tick_until(w, lambda: (queue_dir / "running" / "blocker").exists())
    for name in ("a", "b", "c"):
        write_job(name, command=["echo", name])
    tick_until(w, lambda: w.jobs.count(JobState.PENDING) == 3)
    assert [j.id for j in w.jobs.pending_head(3)] == ["a", "b", "c"]
    # priority by the CLI (rewrites the priority: line), an edit by hand (new command), a broken edit, an rm -r
    trainq("priority", "c", "5", root=queue_dir, check_rc=0)
    spec = queue_dir / "pending" / "b" / "job.yaml"
    spec.write_text(spec.read_text().replace("- b", "- edited"))
    (queue_dir / "pending" / "a" / "job.yaml").write_text("approved: true\ncommand: [echo]\nresources: {gpus: -1}\n")
    tick_until(
        w,
        lambda: w.jobs.get("c") and w.jobs["c"].priority == 5 and w.jobs["b"].spec.command[-1] == "edited",
        what="edits re-read",
    )
    assert [j.id for j in w.jobs.pending_head(2)] == ["c", "b"]
    assert json.loads((queue_dir / "pending" / "c" / "run.json").read_text())["priority"] == 5
    tick_until(w, lambda: (queue_dir / "failed" / "a").exists(), what="broken edit rejected")
    run = json.loads((queue_dir / "failed" / "a" / "run.json").read_text())
    assert run["status"] == "rejected" and run["errors"][0]["path"] == "resources.gpus", run
    assert "pending/a/job.yaml: resources.gpus" in run["error"]
    import shutil

    shutil.rmtree(queue_dir / "pending" / "b")
    tick_until(w, lambda: "b" not in w.jobs, what="removed pending job forgotten")
    (queue_dir / "running" / "blocker" / "stop.flag").write_text("now\n")
    tick_until(w, lambda: (queue_dir / "failed" / "blocker").exists(), 30, what="blocker stopped")
    tick_until(w, lambda: (queue_dir / "done" / "c").exists(), 30, what="c ran")
    assert "edited" not in (queue_dir / "done" / "c" / "output.log").read_text()


def test_priority_and_edit_refuse_a_bad_file_and_leave_the_job_as_it_was(queue_dir, tmp_path):
    job = queue_dir / "pending" / "j"
    job.mkdir()
    original = "# keep me\napproved: true\ncommand: [echo, hi]\npriority: 1\n"
    (job / "job.yaml").write_text(original)
    (job / "run.json").write_text(json.dumps({"schema_version": 1, "status": "pending", "attempts": []}))
    editor = tmp_path / "editor.sh"
    editor.write_text("#!/bin/sh\nsed -i 's/priority: 1/priority: high/' \"$1\"\n")
    editor.chmod(0o755)
    out = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "edit", "j"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, EDITOR=str(editor)),
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 2 and "pending/j/job.yaml: priority:" in out.stderr, out.stderr
    assert (job / "job.yaml").read_text() == original
    assert not list(tmp_path.glob("*.edited.yaml"))  # nothing left in the caller's folder ...
    assert (job / ".edit-draft.yaml").read_text() == original.replace("priority: 1", "priority: high")
    assert "`trainq edit j` opens it again" in out.stderr  # ... the next edit opens the kept draft
    editor.write_text("#!/bin/sh\nsed -i 's/priority: high/priority: 1/; s/echo, hi/echo, there/' \"$1\"\n")
    again = subprocess.run(
        [PY, "-m", "trainq.watcher", "--root", str(queue_dir), "edit", "j"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, EDITOR=str(editor)),
    )
    assert "opening your earlier edit of job j" in again.stderr
    assert (job / "job.yaml").read_text() == original.replace("hi", "there")
    assert not (job / ".edit-draft.yaml").exists()
    trainq("priority", "j", "-3", root=queue_dir, check_rc=0)
    assert (job / "job.yaml").read_text() == "# keep me\napproved: true\ncommand: [echo, there]\npriority: -3\n"
    done = queue_dir / "done" / "k"
    done.mkdir()
    assert "not pending/" in trainq("priority", "k", "1", root=queue_dir, check_rc=2).stderr


def test_pause_resume_wait_show_clean_and_the_messages(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text(FAST)
    trainq("pause", root=queue_dir, check_rc=0)
    assert (queue_dir / "pause.flag").exists()
    # logs and status right after starting a watcher wait for it instead of failing
    drop_dir = queue_dir.parent
    _job(
        queue_dir,
        "ok",
        'echo fine; printf \'{"type": "step", "step": 3, "total_steps": 3, "loss": 0.5}\\n\' >> $TRAINQ_METRICS',
    )
    _job(queue_dir, "bad", f"echo about to fail; {PY} -c \"open('/nowhere/train.jsonl')\"")
    (drop_dir / "broken.yaml").write_text("approved: true\ncommand: [echo]\npriority: high\n")
    for name in ("ok", "bad", "broken"):
        os.rename(drop_dir / f"{name}.yaml", queue_dir / "inbox" / f"{name}.yaml")
    watcher_process()
    wait_until(lambda: (queue_dir / "status.json").exists(), 30)  # else submit waits 2 s, not 10
    out = trainq("logs", "ok", root=queue_dir, check_rc=0)
    assert "pending: it has not started" in out.stdout and "paused" in out.stdout, out.stdout
    assert "ok" in trainq("status", root=queue_dir, check_rc=0).stdout
    drop(queue_dir, "draft.yaml", "approved: false\ncommand: [echo]\n")
    wait_until(lambda: '"awaiting_approval": 1' in (queue_dir / "status.json").read_text(), 15, what="draft awaiting")
    assert "inbox/draft.yaml awaits approval" in trainq("logs", "draft", root=queue_dir, check_rc=2).stderr
    rejected = trainq("logs", "broken", root=queue_dir, check_rc=0).stdout
    assert "rejected" in rejected and "priority:" in rejected, rejected
    refused = trainq("retry", "broken", root=queue_dir, check_rc=2).stderr
    assert "cannot run again" in refused and "trainq edit broken" in refused
    assert not (queue_dir / "failed" / "broken" / "retry.flag").exists()
    trainq("resume", root=queue_dir, check_rc=0)
    assert not (queue_dir / "pause.flag").exists()
    assert trainq("wait", "ok", root=queue_dir).returncode == 0
    waited = trainq("wait", "ok", "bad", root=queue_dir)
    assert waited.returncode == 1 and "job bad: failed" in waited.stdout, waited.stdout
    shown = trainq("show", "bad", root=queue_dir, check_rc=0).stdout
    for needle in (
        "job bad: failed, exit status 1",
        "attempts (1):",
        "exit 1",
        "evidence:",
        "/nowhere/train.jsonl",
        "advice:",
        "output.log",
        str(queue_dir / "failed" / "bad"),
    ):
        assert needle in shown, (needle, shown)
    assert "progress: step 3/3 · loss 0.5" in trainq("show", "ok", root=queue_dir, check_rc=0).stdout
    # a finished job's row keeps its final loss and its times
    wait_until(
        lambda: any(
            j["id"] == "ok" and j["state"] == "done"
            for j in json.loads((queue_dir / "status.json").read_text())["jobs"]
        ),
        15,
        what="status.json lists ok as done",
    )
    row = next(
        line
        for line in trainq("status", "--state", "done", root=queue_dir, check_rc=0).stdout.splitlines()
        if line.startswith("ok ")
    )
    assert "done" in row and "3/3" in row and "0.5" in row, row
    # a command job's missing file is not "training data"
    assert "diagnosis: data" in shown and "training data" not in shown and "A file the command reads" in shown
    listed = trainq("clean", "--failed", "--dry-run", root=queue_dir, check_rc=0).stdout
    assert "would remove 2" in listed and (queue_dir / "failed" / "bad").exists()
    assert "removed 0" in trainq("clean", "--older-than", "7d", root=queue_dir, check_rc=0).stdout
    assert "removed 3" in trainq("clean", root=queue_dir, check_rc=0).stdout
    assert not [p for s in ("done", "failed") for p in (queue_dir / s).iterdir()]
    assert trainq("wait", "gone", root=queue_dir).returncode == 2


def test_ignored_inbox_entries_are_listed_with_the_reason(queue_dir, watcher):
    (queue_dir / "inbox" / "notes.txt").write_text("x")
    (queue_dir / "inbox" / "drafts").mkdir()
    (queue_dir / "inbox" / "job.json").write_text("{}")
    (queue_dir / "inbox" / "odd.yaml").mkdir()
    (queue_dir / "inbox" / ".hidden.yaml").write_text("x")
    (queue_dir / "inbox" / "edit.yaml.swp").write_text("x")
    os.mkdir(os.path.join(os.fsencode(queue_dir / "inbox"), b"bad-\xff-name"))  # not UTF-8
    (queue_dir / "inbox" / "esc\x1b[31m.txt").write_text("x")  # a terminal escape in the name
    w = watcher()
    w.tick(time.time())
    w.report.write(w, time.time(), force=True)
    status = json.loads((queue_dir / "status.json").read_text())
    ignored = {e["name"]: e["reason"] for e in status["ignored"]}
    assert set(ignored) == {"notes.txt", "drafts", "job.json", "odd.yaml", "bad-\ufffd-name", "esc\\x1b[31m.txt"}, (
        ignored
    )
    assert "folder" in ignored["drafts"] and "*.yaml" in ignored["job.json"]
    import jsonschema

    jsonschema.validate(status, json.loads((REPO / "schemas" / "status.schema.json").read_text()))
    assert "Ignored in inbox" in (queue_dir / "status.html").read_text()
    shown = trainq("status", root=queue_dir, check_rc=0).stdout
    assert "inbox ignores 6 (not job files): bad-\ufffd-name/, drafts/, esc\\x1b[31m.txt" in shown, shown
    assert "\x1b" not in shown


def test_train_and_tiny_run_the_trainer_modules():
    out = trainq("train", "--help", check_rc=0)
    assert "usage: trainq train " in out.stdout and "job_dir" in out.stdout  # named as the user typed it
    assert "usage: trainq tiny" in trainq("tiny", "--help", check_rc=0).stdout


def test_shell_completion_offers_commands_and_job_ids(queue_dir):
    for state, job_id in (("pending", "lora-a"), ("done", "lora-b"), ("failed", "other")):
        (queue_dir / state / job_id).mkdir()

    def complete(line: str) -> list[str]:
        env = dict(os.environ, _ARGCOMPLETE="1", COMP_LINE=line, COMP_POINT=str(len(line)), _ARGCOMPLETE_IFS="\n")
        script = Path(PY).with_name("trainq")
        # argcomplete answers on fd 8 (what bash's completion hook reads) and exits
        done = subprocess.run(
            ["sh", "-c", f"'{script}' 8>&1 9>/dev/null"], env=env, capture_output=True, text=True, timeout=60
        )
        return done.stdout.split()

    assert "priority" in complete("trainq pri")
    assert complete(f"trainq --root {queue_dir} show lora") == ["lora-a", "lora-b"]
    assert "--older-than" in complete("trainq clean --o")


def test_an_edited_after_holds_and_releases_a_pending_job(queue_dir, watcher, write_job):
    w = watcher(rescan_s=0.05, settle_s=0.05, max_concurrent=2)
    write_job("slow", command=["sleep", "30"])
    tick_until(w, lambda: (queue_dir / "running" / "slow").exists())
    (queue_dir / "pause.flag").touch()  # next stays pending while its file is edited
    write_job("next", command=["echo", "next"])
    tick_until(w, lambda: "next" in w.jobs)
    spec = queue_dir / "pending" / "next" / "job.yaml"
    spec.write_text(spec.read_text() + "after: [slow]\n")
    tick_until(
        w,
        lambda: w.jobs["next"].held and "after slow (running)" in (w.jobs["next"].run["waiting_for"] or ""),
        what="held on the new dependency",
    )
    spec.write_text(spec.read_text().replace("after: [slow]\n", ""))
    tick_until(
        w, lambda: not w.jobs["next"].held and "after" not in (w.jobs["next"].run["waiting_for"] or ""), what="released"
    )
    (queue_dir / "pause.flag").unlink()
    tick_until(w, lambda: (queue_dir / "done" / "next").exists(), what="next ran without waiting for slow")
    assert (queue_dir / "running" / "slow").exists()
    (queue_dir / "running" / "slow" / "stop.flag").write_text("now\n")
    tick_until(w, lambda: (queue_dir / "failed" / "slow").exists(), 30, what="slow stopped")


def test_stop_now_on_a_job_already_stopping_skips_the_rest_of_the_grace(queue_dir, watcher_process):
    (queue_dir / "watcher.yaml").write_text(FAST)
    watcher_process()
    wait_until(lambda: (queue_dir / "status.json").exists(), 30)  # else submit waits 2 s, not 10
    src = _job(queue_dir, "stubborn", "trap '' TERM; echo up; sleep 120", "stop_grace: 120s\n")
    assert trainq("submit", str(src), root=queue_dir, check_rc=0).stdout.strip() == "job stubborn"
    wait_until(lambda: _where(queue_dir, "stubborn") == "running", 30, what="running")
    trainq("stop", "stubborn", root=queue_dir, check_rc=0)  # a plain stop: 120 s of grace
    wait_until(
        lambda: "SIGTERM in 120 s" in (queue_dir / "running" / "stubborn" / "output.log").read_text(),
        15,
        what="the supervisor saw the plain stop",
    )
    started = time.monotonic()
    trainq("stop", "--now", "stubborn", root=queue_dir, check_rc=0)
    wait_until(lambda: _where(queue_dir, "stubborn") == "failed", 60, what="stopped without the grace")
    assert time.monotonic() - started < 60
    assert json.loads((queue_dir / "failed" / "stubborn" / "run.json").read_text())["status"] == "cancelled"
