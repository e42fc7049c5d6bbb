"""The inbox through a real watcher: what is taken, when, under which id, and what bad input does."""

from __future__ import annotations

import functools
import json
import operator
import os
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import drop, tick_until

from trainq.watcher.daemon.inbox import is_candidate_name
from trainq.watcher.spec.folders import id_from_name

GOOD = "approved: true\ncommand: ['true']\n"


def run_json(root: Path, state: str, job_id: str) -> dict:
    return json.loads((root / state / job_id / "run.json").read_text())


def states(root: Path) -> dict[str, list[str]]:
    return {
        s: sorted(p.name for p in (root / s).iterdir() if not p.name.startswith("."))
        for s in ("inbox", "pending", "running", "done", "failed")
    }


@pytest.mark.parametrize(
    "name,taken",
    [
        ("a.yaml", True),
        ("b.YML", True),
        ("c.Yaml", True),
        (".hidden.yaml", False),
        ("#x.yaml", False),
        ("x.yaml~", False),
        (".x.yaml.swp", False),
        ("x.yaml.swx", False),
        ("x.yaml.tmp", False),
        ("x.yaml.part", False),
        ("x.yaml.crdownload", False),
        ("4913", False),
        ("notes.txt", False),
    ],
)
def test_candidate_names(name, taken):
    assert is_candidate_name(name) is taken


@pytest.mark.parametrize(
    "name,expected",
    [
        ("train llama.yaml", "train-llama"),
        ("qué tal.yaml", "qu--tal"),
        ("x" * 300 + ".yaml", "x" * 64),
        ('it\'s "quoted".yml', "it-s--quoted-"),
        ("日本語.yaml", "---"),
    ],
)
def test_ids_from_awkward_names(name, expected):
    assert id_from_name(name) == expected


def test_same_name_twice_gets_suffixed_ids(queue_dir, watcher):
    w = watcher()
    drop(queue_dir, "x.yaml", "approved: true\ncommand: [sleep, '5']\nstop_grace: 0.5\n")
    tick_until(w, lambda: states(queue_dir)["running"] == ["x"] or states(queue_dir)["pending"] == ["x"])
    drop(queue_dir, "x.yaml", GOOD)
    tick_until(w, lambda: "x-2" in functools.reduce(operator.iadd, states(queue_dir).values(), []))
    (queue_dir / "running" / "x" / "stop.flag").touch()
    tick_until(w, lambda: states(queue_dir)["failed"] == ["x"] and states(queue_dir)["done"] == ["x-2"], 20)


def test_long_unicode_name_with_spaces_runs(queue_dir, watcher):
    w = watcher()
    name = "ñandú " + "y" * 240 + ".yaml"  # ext4 allows 255 bytes; 300 characters cannot exist
    drop(queue_dir, name, GOOD)
    expected = id_from_name(name)
    tick_until(w, lambda: states(queue_dir)["done"] == [expected])


BAD_FILES = {
    "empty.yaml": (b"", "empty"),
    "junk.yaml": (os.urandom(64) + b"\x00\xff", "binary"),
    "latin1.yaml": ("approved: true\ncommand: [echo, 'caf\xe9']\n".encode("latin-1"), "UTF-8"),
    "syntax.yaml": (b"approved: true\ncommand: [true\nname: x\n", "line"),
    "two-docs.yaml": (b"approved: true\ncommand: ['true']\n---\nname: b\n", "one YAML document"),
    "bomb.yaml": (
        b"a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n",
        "alias",
    ),
    "list.yaml": (b"- approved: true\n- command: ['true']\n", "mapping"),
    "scalar.yaml": (b"just a string\n", "mapping"),
    "unknown.yaml": (b"approved: true\ncommand: ['true']\nresources: {gpu: 1}\n", "gpus"),
    "types.yaml": (b"approved: true\ncommand: ['true']\npriority: high\nresources: {ram_gb: lots}\n", "priority"),
    "both.yaml": (b"approved: true\ncommand: ['true']\ntrain: {model: m, data: d.jsonl, max_steps: 1}\n", "command"),
    "neither.yaml": (b"approved: true\nname: nothing\n", "command"),
}


def test_bad_files_are_rejected_one_line_each_and_disturb_nothing(queue_dir, watcher):
    w = watcher()
    drop(queue_dir, "bystander.yaml", "approved: true\ncommand: [sleep, '30']\nstop_grace: 0.5\n")
    # run.json of a started job is written once it has run 50 ms (a trivial job gets one final write)
    tick_until(
        w,
        lambda: (
            "bystander" in states(queue_dir)["running"]
            and run_json(queue_dir, "running", "bystander")["status"] == "running"
        ),
    )
    bystander_run = (queue_dir / "running" / "bystander" / "run.json").read_bytes()
    for name, (data, _) in BAD_FILES.items():
        (queue_dir / ".staging").mkdir(exist_ok=True)
        (queue_dir / ".staging" / name).write_bytes(data)
        os.rename(queue_dir / ".staging" / name, queue_dir / "inbox" / name)
    big = queue_dir / "inbox" / "big.yaml"
    big.write_bytes(b"approved: true\ncommand: ['true']\n# " + b"x" * (2 * 1024 * 1024) + b"\n")
    # a claim makes the folder, then run.json, then links job.yaml in (folders.py); big.yaml, 2 MB, is read
    # off the loop (daemon.py HEAVY_FILE_BYTES), so its folder may be seen before its run.json
    tick_until(
        w,
        lambda: (
            len(states(queue_dir)["failed"]) == len(BAD_FILES) + 1
            and all((queue_dir / "failed" / j / "job.yaml").exists() for j in states(queue_dir)["failed"])
        ),
        20,
    )
    for name, needle in [(n, v[1]) for n, v in BAD_FILES.items()] + [("big.yaml", "1 MiB")]:
        job_id = id_from_name(name)
        run = run_json(queue_dir, "failed", job_id)
        assert run["status"] == "rejected", name
        assert run["errors"], name
        text = json.dumps(run["errors"])
        assert needle.lower() in text.lower(), (name, run["errors"])
        assert (queue_dir / "failed" / job_id / "job.yaml").exists()
    assert states(queue_dir)["inbox"] == []
    assert states(queue_dir)["running"] == ["bystander"]
    assert (queue_dir / "running" / "bystander" / "run.json").read_bytes() == bystander_run
    (queue_dir / "running" / "bystander" / "stop.flag").touch()
    tick_until(w, lambda: "bystander" in states(queue_dir)["failed"], 20)


def test_syntax_error_message_gives_the_line(queue_dir, watcher):
    w = watcher()
    drop(queue_dir, "s.yaml", "approved: true\nname: ok\ncommand: [true\n")
    tick_until(w, lambda: states(queue_dir)["failed"] == ["s"])
    assert "line " in run_json(queue_dir, "failed", "s")["errors"][0]["message"]


def test_unknown_key_error_names_field(queue_dir, watcher):
    w = watcher()
    drop(queue_dir, "u.yaml", "approved: true\ncommand: ['true']\nresources: {gpu: 1}\n")
    tick_until(w, lambda: states(queue_dir)["failed"] == ["u"])
    errors = run_json(queue_dir, "failed", "u")["errors"]
    assert errors[0]["path"].startswith("resources")
    assert "gpu" in errors[0]["message"]


def test_symlinks_are_rejected_and_their_targets_untouched(queue_dir, watcher, tmp_path):
    w = watcher()
    outside = tmp_path / "outside.yaml"
    outside.write_text(GOOD)
    os.symlink(outside, queue_dir / "inbox" / "link.yaml")
    os.symlink(tmp_path / "missing.yaml", queue_dir / "inbox" / "dangling.yaml")
    tick_until(w, lambda: states(queue_dir)["failed"] == ["dangling", "link"])
    assert outside.read_text() == GOOD
    for job_id in ("link", "dangling"):
        assert "symlink" in run_json(queue_dir, "failed", job_id)["errors"][0]["message"]
        assert (queue_dir / "failed" / job_id / "job.yaml").is_symlink()


def test_fifo_and_directory_named_yaml_are_ignored_without_hanging(queue_dir, watcher):
    w = watcher()
    os.mkfifo(queue_dir / "inbox" / "x.yaml")
    (queue_dir / "inbox" / "d.yaml").mkdir()
    drop(queue_dir, "after.yaml", GOOD)
    started = time.monotonic()
    tick_until(w, lambda: states(queue_dir)["done"] == ["after"], 10)
    assert time.monotonic() - started < 10
    assert sorted(states(queue_dir)["inbox"]) == ["d.yaml", "x.yaml"]
    assert states(queue_dir)["failed"] == []


def test_editor_temp_files_are_never_touched(queue_dir, watcher):
    w = watcher()
    names = [".x.yaml.swp", "x.yaml~", "4913", ".#x.yaml", "x.yaml.part"]
    for name in names:
        (queue_dir / "inbox" / name).write_text(GOOD)
    drop(queue_dir, "real.yaml", GOOD)
    tick_until(w, lambda: states(queue_dir)["done"] == ["real"])
    w.tick(time.time())
    assert sorted(os.listdir(queue_dir / "inbox")) == sorted(names)
    assert states(queue_dir)["failed"] == []
    for name in names:
        assert (queue_dir / "inbox" / name).read_text() == GOOD


def test_file_written_in_two_halves_is_never_taken_half_written(queue_dir, watcher):
    """The first half alone is a valid approved job; the whole file has a different command."""
    w = watcher()
    first = "approved: true\ncommand: [echo, first-half-only]\n"
    second = "name: whole\n"
    target = queue_dir / "inbox" / "slow.yaml"
    writer_done = threading.Event()

    def write_slowly():
        with open(target, "w") as f:
            f.write(first)
            f.flush()
            time.sleep(1.2)
            f.write(second)
        writer_done.set()

    threading.Thread(target=write_slowly, daemon=True).start()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        w.tick(time.time())
        assert states(queue_dir)["pending"] + states(queue_dir)["running"] + states(queue_dir)["done"] == []
        time.sleep(0.02)
    writer_done.wait(5)
    tick_until(w, lambda: states(queue_dir)["done"] == ["slow"])
    assert run_json(queue_dir, "done", "slow")["name"] == "whole"


#: a job file whose every prefix from line 3 on is a valid approved job: taken at its first valid prefix,
#: it ran as ``command: [sh]`` (sh reads /dev/null and exits 0: recorded done) — issue 36's finding
APPENDED_LINES = [
    "approved: true",
    "command:",
    "  - sh",
    "  - -c",
    '  - echo "whole $0" > "$TRAINQ_JOB_DIR/ran.txt"',
    "  - file",
    "name: appended",
    "priority: 3",
]
#: seconds between two appends, as the finding had them (0.05–0.5 s)
APPEND_GAPS_S = [0.05, 0.5, 0.2, 0.05, 0.4, 0.1, 0.3]


def test_a_file_appended_line_by_line_in_place_runs_whole(queue_dir, watcher):
    """Real shell processes append with ``>>`` (each opens, writes and closes the file); the job that runs is
    the whole file, and no file written in place is taken before it stood unchanged for inbox_settle_s."""
    settle_s = 2.0  # 4x the longest gap, so a loaded machine's late sleep does not cut the file for real
    w = watcher(inbox_settle_s=settle_s)
    target = queue_dir / "inbox" / "app.yaml"
    script = "".join(
        f"printf '%s\\n' {shlex.quote(line)} >> {shlex.quote(str(target))}\n" + (f"sleep {gap}\n" if gap else "")
        for line, gap in zip(APPENDED_LINES, [*APPEND_GAPS_S, 0], strict=True)
    )
    writer = subprocess.Popen(["sh", "-c", script])
    try:
        while writer.poll() is None or target.exists():
            w.tick(time.time())
            if target.exists():
                last_write = target.stat().st_mtime
            elif writer.poll() is None:
                pytest.fail("the inbox took app.yaml while its writer was still appending")
            else:
                assert time.time() - last_write >= settle_s  # taken only once unchanged for inbox_settle_s
            time.sleep(0.02)
    finally:
        writer.wait(30)
    assert writer.returncode == 0
    tick_until(w, lambda: states(queue_dir)["done"] == ["app"], 30, "the whole job to run")
    done = queue_dir / "done" / "app"
    assert (done / "job.yaml").read_text() == "".join(f"{line}\n" for line in APPENDED_LINES)
    assert (done / "ran.txt").read_text() == "whole file\n"
    assert run_json(queue_dir, "done", "app")["name"] == "appended"
    assert states(queue_dir)["failed"] == [] and states(queue_dir)["pending"] == []


def test_inbox_settle_s_defaults_to_one_second():
    from trainq.watcher.spec.config import WatcherConfig

    assert WatcherConfig().inbox_settle_s == 1.0 == WatcherConfig.from_dict({}).inbox_settle_s
    assert WatcherConfig.from_dict({"inbox_settle_s": "500ms"}).inbox_settle_s == 0.5


def test_file_present_at_startup_still_open_for_writing_waits(queue_dir, watcher):
    target = queue_dir / "inbox" / "early.yaml"
    holder = open(target, "w")
    holder.write(GOOD)
    holder.flush()
    try:
        w = watcher(settle_s=0.1)
        end = time.monotonic() + 0.8
        while time.monotonic() < end:
            w.tick(time.time())
            time.sleep(0.05)
        assert states(queue_dir)["inbox"] == ["early.yaml"]
    finally:
        holder.close()
    tick_until(w, lambda: states(queue_dir)["done"] == ["early"])


@pytest.mark.skipif(not shutil.which("vim.tiny"), reason="vim.tiny (Debian vim-tiny) not installed")
def test_file_saved_by_a_real_editor(queue_dir, watcher):
    w = watcher()
    path = queue_dir / "inbox" / "edited.yaml"
    subprocess.run(
        ["vim.tiny", "-u", "NONE", "-N", "-es", str(path)],
        input="a\napproved: false\ncommand: [echo, hi]\n.\nwq\n",
        text=True,
        timeout=20,
        check=False,
    )
    tick_until(w, lambda: w.report.awaiting_entries, 10, "awaiting approval")
    assert states(queue_dir)["pending"] + states(queue_dir)["done"] == []
    subprocess.run(
        ["vim.tiny", "-u", "NONE", "-N", "-es", str(path)],
        input="%s/false/true/\nwq\n",
        text=True,
        timeout=20,
        check=False,
    )
    tick_until(w, lambda: states(queue_dir)["done"] == ["edited"], 10)
    assert not [n for n in os.listdir(queue_dir / "inbox") if n.endswith((".swp", ".swx"))]


def test_approval_rules_yaml_12(queue_dir, watcher):
    w = watcher()
    drop(queue_dir, "str.yaml", 'approved: "true"\ncommand: ["true"]\n')
    drop(queue_dir, "yes.yaml", "approved: yes\ncommand: ['true']\n")
    drop(queue_dir, "none.yaml", "command: ['true']\n")
    tick_until(w, lambda: len(w.report.awaiting_entries) == 3)
    w.report.write(w, time.time(), force=True)
    status = json.loads((queue_dir / "status.json").read_text())
    assert status["counts"]["awaiting_approval"] == 3 and status["counts"]["inbox"] == 3
    hints = {j["id"]: j["approval_hint"] for j in status["jobs"] if j["state"] == "awaiting_approval"}
    assert "string" in (hints["str.yaml"] or "")
    assert states(queue_dir)["pending"] == [] and states(queue_dir)["failed"] == []
    # editing in place to the boolean submits it
    path = queue_dir / "inbox" / "yes.yaml"
    path.write_text("approved: true\ncommand: ['true']\n")
    tick_until(w, lambda: states(queue_dir)["done"] == ["yes"])


def test_ten_thousand_files_at_once(queue_dir, watcher):
    (queue_dir / "pause.flag").touch()
    w = watcher()
    staging = queue_dir / ".staging"
    staging.mkdir()
    for i in range(10_000):
        (staging / f"j{i:05d}.yaml").write_text(GOOD)
    for i in range(10_000):
        os.rename(staging / f"j{i:05d}.yaml", queue_dir / "inbox" / f"j{i:05d}.yaml")
    started = time.monotonic()
    tick_until(w, lambda: len(os.listdir(queue_dir / "pending")) == 10_000, 120)
    elapsed = time.monotonic() - started
    w.report.write(w, time.time(), force=True)
    size = (queue_dir / "status.json").stat().st_size
    status = json.loads((queue_dir / "status.json").read_text())
    assert status["counts"]["pending"] == 10_000
    assert size < 200_000, size
    assert os.listdir(queue_dir / "inbox") == []
    print(f"10,000 files accepted in {elapsed:.1f}s; status.json {size} bytes")


def test_the_loop_reads_the_inbox_s_inotify_itself_and_its_own_root_writes_do_not_wake_it(queue_dir, watcher, tmp_path):
    """Issue 38: watchdog's observer passed each event across four threads (0.7 ms from a rename into the inbox to
    the loop's wake-up on the bench VM); the loop now waits on the inotify fd itself. A rename into the inbox ends
    its wait with the file's hint set; the watcher's own status.json writes in the root do not end it."""
    w = watcher()
    assert w._loop_watch is not None and w._observer is None
    staged = tmp_path / "later.yaml"
    staged.write_text("approved: true\ncommand: ['true']\n")
    timer = threading.Timer(0.3, os.rename, (staged, queue_dir / "inbox" / "later.yaml"))
    started = time.monotonic()
    timer.start()
    w._wait(30.0)
    timer.join()
    assert time.monotonic() - started < 25.0  # woken by the rename, not by the end of the wait
    assert w.intake.inbox.events.hints() == {"later.yaml": "moved_in"}

    w.write_status(time.time(), force=True)  # our own write in the root: an event the wait must not end on
    started = time.monotonic()
    w._wait(0.5)
    assert time.monotonic() - started >= 0.45


def test_an_inbox_removed_and_made_again_is_watched_again(queue_dir, watcher):
    w = watcher()
    shutil.rmtree(queue_dir / "inbox")
    w.tick(time.time())  # check_layout makes it again and the loop's watch follows
    assert (queue_dir / "inbox").is_dir()
    drop(queue_dir, "again.yaml", "approved: true\ncommand: ['true']\n")
    w._loop_watch.read()
    assert w.intake.inbox.events.hints().get("again.yaml") == "moved_in"


def test_the_loop_takes_more_inotify_events_than_one_read_holds_and_stops_without_waiting(queue_dir, watcher):
    """Issue 38: the loop's inotify read stops once a read comes back with room for another event (no last read
    to fail with EAGAIN). Events past one read's 64 KiB (1,200 names of 200 characters, three events each) are
    all taken in that one call, and a call with nothing waiting returns at once."""
    w = watcher()
    assert w._loop_watch is not None
    w._loop_watch.read()
    names = [f"{i:04d}-{'x' * 190}.yaml" for i in range(1200)]
    for name in names:
        (queue_dir / "inbox" / name).write_text("approved: true\ncommand: ['true']\n")
    assert w._loop_watch.read()
    assert set(w.intake.inbox.events.hints()) == set(names)
    started = time.monotonic()
    assert not w._loop_watch.read()
    assert time.monotonic() - started < 5.0
