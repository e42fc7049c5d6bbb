"""Job-file validation: real files (symlinks, FIFOs, directories, huge and binary files), real YAML, real schemas."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainq.watcher.spec.errors import InvalidJobSpec, Problem
from trainq.watcher.spec.interpreter import safe_module_argv
from trainq.watcher.spec.jobspec import (
    DEFAULT_RETRY_ON,
    JOB_SCHEMA,
    MAX_JOB_FILE_BYTES,
    SCHEMAS_DIR,
    JobSpec,
    Resources,
    Retries,
    expand_placeholders,
    load_job_file,
    parse_job_text,
    schema_problems,
    schema_validator,
)
from trainq.watcher.spec.units import DURATION_PATTERN

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "tests" / "data" / "jobs"
CMD = "command: [python, train.py]\n"


def problems_of(text: str) -> list[Problem]:
    """The problems parse_job_text raises for ``text`` (fails the test when it is valid)."""
    with pytest.raises(InvalidJobSpec) as info:
        parse_job_text(text, "inbox/x.yaml")
    return info.value.problems


def file_problems(path: Path) -> list[Problem]:
    with pytest.raises(InvalidJobSpec) as info:
        load_job_file(path, "inbox/x.yaml")
    return info.value.problems


def only_message(problems: list[Problem]) -> str:
    assert len(problems) == 1, problems
    return problems[0].message


# -- whole-file problems --


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_bytes(b"")
    assert only_message(file_problems(path)).startswith("the file is empty")
    path.write_bytes(b"  \n\n")
    assert "empty" in only_message(file_problems(path))


def test_only_comments_is_not_a_job(tmp_path: Path) -> None:
    assert "only comments" in only_message(problems_of("# nothing here\n"))


def test_binary_junk_with_nul_bytes(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_bytes(b"approved: true\n\x00\x01\x02\x03binary")
    problems = file_problems(path)
    assert problems[0].path == ""
    assert "binary" in only_message(problems) and "offset 15" in problems[0].message


def test_binary_junk_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_bytes(bytes(range(128, 256)) * 8)
    assert "not UTF-8" in only_message(file_problems(path))


def test_non_utf8_names_the_byte_offset(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    data = b"approved: true\ncommand: [caf\xe9]\n"
    path.write_bytes(data)
    message = only_message(file_problems(path))
    assert f"invalid byte 0xe9 at byte offset {data.index(0xE9)}, line 2" in message and "not UTF-8" in message


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_bytes(b"\xef\xbb\xbfapproved: true\n" + CMD.encode())
    assert load_job_file(path).approved is True


def test_two_mib_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_bytes(b"approved: true\n" + CMD.encode() + b"# padding\n" * (2 * 1024 * 1024 // 10))
    message = only_message(file_problems(path))
    assert "too large" in message and "1 MiB" in message


def test_huge_sparse_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    with open(path, "wb") as f:
        f.truncate(64 * 1024**3)  # 64 GiB: reading it whole would take minutes and all the RAM
    started = time.monotonic()
    assert "too large" in only_message(file_problems(path))
    assert time.monotonic() - started < 30  # a hang guard (reading 64 GiB takes minutes), not a speed goal


def test_file_of_exactly_the_limit_is_read(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    head = b"approved: true\n" + CMD.encode()
    path.write_bytes(head + b"#" * (MAX_JOB_FILE_BYTES - len(head) - 1) + b"\n")
    assert load_job_file(path).command == ("python", "train.py")


def test_yaml_syntax_error_gives_the_line() -> None:
    message = only_message(problems_of("approved: true\ncommand: [python,\nname: x: y\n"))
    assert "line" in message and "YAML" in message
    message = only_message(problems_of("approved: true\nname: a\n  bad indent: 1\n"))
    assert message.startswith("line 3:") or "line 3" in message, message


def test_two_yaml_documents_are_refused() -> None:
    message = only_message(problems_of("approved: true\n" + CMD + "---\napproved: true\n" + CMD))
    assert "one YAML document" in message and "found 2" in message


def test_alias_bomb_is_refused_promptly() -> None:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        prev, cur = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev}]")
    started = time.monotonic()
    message = only_message(problems_of("\n".join(lines) + "\n"))
    assert "aliases" in message and "line 1" in message
    assert time.monotonic() - started < 30  # a hang guard (the expanded bomb is 10^9 items), not a speed goal


@pytest.mark.parametrize(
    "text,got", [("- a\n- b\n", "a list"), ("just words\n", "a string"), ("42\n", "a number"), ("true\n", "a boolean")]
)
def test_top_level_must_be_a_mapping(text: str, got: str) -> None:
    message = only_message(problems_of(text))
    assert message == f"expected a mapping of job fields at the top level, got {got}"


# -- things in the inbox that are not plain files --


def test_symlink_to_a_file_outside_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / "real.yaml"
    outside.parent.mkdir()
    outside.write_text("approved: true\n" + CMD)
    link = tmp_path / "inbox" / "x.yaml"
    link.parent.mkdir()
    link.symlink_to(outside)
    assert only_message(file_problems(link)) == "is a symlink; copy the file into inbox/ instead"


def test_dangling_symlink_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "x.yaml"
    link.symlink_to(tmp_path / "missing.yaml")
    assert "is a symlink" in only_message(file_problems(link))


def test_directory_named_like_a_job_file(tmp_path: Path) -> None:
    folder = tmp_path / "x.yaml"
    folder.mkdir()
    assert "is a directory" in only_message(file_problems(folder))


def run_python(code: str, timeout_s: float = 20.0) -> str:
    """Run ``code`` in a real child interpreter; a hang fails the test (the child is killed) instead of the suite."""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_fifo_named_like_a_job_file_returns_promptly(tmp_path: Path) -> None:
    fifo = tmp_path / "x.yaml"
    os.mkfifo(fifo)
    out = run_python(
        "from pathlib import Path\nfrom trainq.watcher.spec.errors import InvalidJobSpec\n"
        "from trainq.watcher.spec.jobspec import load_job_file\n"
        f"try:\n    load_job_file(Path({str(fifo)!r}))\nexcept InvalidJobSpec as exc:\n    print(exc)\n"
    )
    assert "a FIFO" in out and "not a regular file" in out


def test_fifo_swapped_in_after_the_check_is_not_read(tmp_path: Path) -> None:
    # the open itself must not block on a FIFO with no writer, and fstat must refuse it
    fifo = tmp_path / "x.yaml"
    os.mkfifo(fifo)
    out = run_python(
        "from pathlib import Path\nfrom trainq.watcher.spec.jobspec import _read_at_most\n"
        f"print(_read_at_most(Path({str(fifo)!r}), 100, False))\n"
    )
    assert "FIFO" in out


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_job_file(tmp_path / "gone.yaml")


# -- schema problems --


def test_unknown_keys_top_level_and_nested_with_suggestions() -> None:
    problems = problems_of("approved: true\n" + CMD + "priorty: 3\nresources: {gpu: 1}\nretries: {max: 1, backof: 5}\n")
    assert [p.to_dict() for p in problems] == [
        {"path": "priorty", "message": "unknown key 'priorty' (did you mean 'priority'?)"},
        {"path": "resources.gpu", "message": "unknown key 'gpu' (did you mean 'gpus'?)"},
        {"path": "retries.backof", "message": "unknown key 'backof' (did you mean 'backoff'?)"},
    ]


def test_unknown_key_that_lives_one_level_down() -> None:
    problems = problems_of("approved: true\n" + CMD + "gpus: 2\noom_ladder: auto\n")
    assert {p.path: p.message for p in problems} == {
        "gpus": "unknown key 'gpus' (did you mean 'resources.gpus'?)",
        "oom_ladder": "unknown key 'oom_ladder' (did you mean 'train.oom_ladder'?)",
    }


def test_unknown_key_without_a_close_match_lists_the_allowed_ones() -> None:
    message = only_message(problems_of("approved: true\n" + CMD + "resources: {zzz: 1}\n"))
    assert message.startswith("unknown key 'zzz'; allowed here: gpus, gpu_memory_gb, ram_gb")


def test_wrong_types_are_all_reported_sorted_by_path() -> None:
    text = (
        "approved: true\npriority: high\ncommand: [python, {a: 1}, 5]\nresources: {gpus: two, ram_gb: -1}\n"
        "env: {A: [1]}\nretries: {max: -1, on: [oom, nann]}\nname: 7\n"
    )
    assert [(p.path, p.message) for p in problems_of(text)] == [
        ("command[1]", "must be a string or a number (got a mapping)"),
        ("env.A", "must be a string, a number or a boolean (true/false) (got a list)"),
        ("name", "must be a string (got 7)"),
        ("priority", 'must be an integer (got "high")'),
        ("resources.gpus", 'must be an integer >= 0 (got "two")'),
        ("resources.ram_gb", "must be a number >= 0 (got -1)"),
        ("retries.max", "must be an integer >= 0 (got -1)"),
        (
            "retries.on[1]",
            "must be one of oom, nan, killed, data, timeout, stalled, preempted, unsatisfiable, "
            "schedule, no_checkpoint, startup, config, unknown (got \"nann\") (did you mean 'nan'?)",
        ),
    ]


def test_error_lines_name_file_field_and_expectation() -> None:
    with pytest.raises(InvalidJobSpec) as info:
        parse_job_text("approved: true\n" + CMD + "resources: {gpus: -4}\n", "inbox/sft-7.yaml")
    assert str(info.value) == "inbox/sft-7.yaml: resources.gpus: must be an integer >= 0 (got -4)"


def test_list_indices_sort_numerically() -> None:
    items = ", ".join(["1"] * 9 + ["{a: 1}", "{b: 2}"])
    paths = [p.path for p in problems_of(f"approved: true\ncommand: [{items}]\n")]
    assert paths == ["command[9]", "command[10]"]


def test_both_command_and_train_is_an_error() -> None:
    problems = problems_of("approved: true\n" + CMD + "train: {model: /m, data: /d.jsonl, max_steps: 5}\n")
    assert [p.to_dict() for p in problems] == [
        {"path": "", "message": "exactly one of 'command' or 'train' is required (found both)"}
    ]


def test_neither_command_nor_train_is_an_error() -> None:
    problems = problems_of("approved: true\nname: x\n")
    assert only_message(problems) == "exactly one of 'command' or 'train' is required (found neither)"


def test_train_block_errors_are_translated_too() -> None:
    problems = problems_of("approved: true\ntrain: {model: /m, method: lorra, max_steps: 0, batch_sise: 2}\n")
    messages = {(p.path, p.message) for p in problems}
    assert ("train", "missing required key 'data'") in messages
    assert ("train.batch_sise", "unknown key 'batch_sise' (did you mean 'batch_size'?)") in messages
    assert any(path == "train.method" and "did you mean 'lora'?" in m for path, m in messages)
    assert ("train.max_steps", "must be an integer >= 1 (got 0)") in messages


def test_empty_and_blank_commands() -> None:
    assert only_message(problems_of("approved: true\ncommand: []\n")) == "must not be empty"
    assert only_message(problems_of("approved: true\ncommand: '   '\n")) == "must not be blank"


def test_values_json_cannot_hold_are_refused() -> None:
    problems = problems_of(
        "approved: true\n" + CMD + "env: {A: !!binary aGVsbG8=}\nresources: {ram_gb: .nan}\n1: one\n"
    )
    assert [(p.path, p.message) for p in problems] == [
        ("", "key 1 must be a string (put it in quotes)"),
        ("env.A", "binary data (!!binary) is not allowed here; write it as a string or number"),
        ("resources.ram_gb", "must be a finite number (got nan)"),
    ]


@pytest.mark.parametrize("depth", [40, 600, 5000])
def test_absurd_nesting_is_a_problem_not_a_crash(depth: int) -> None:
    message = only_message(problems_of("approved: true\n" + CMD + "env: {a: " + "[" * depth + "]" * depth + "}\n"))
    assert "nested" in message or "nesting" in message


def test_resume_args_are_for_command_jobs_only() -> None:
    problems = problems_of("approved: true\ntrain: {model: /m, data: /d, max_steps: 1}\nresume_args: [--resume]\n")
    assert problems[0].path == "resume_args" and "only applies to command jobs" in problems[0].message


def test_many_problems_sample_reports_every_one() -> None:
    with pytest.raises(InvalidJobSpec) as info:
        load_job_file(SAMPLES / "many-problems.yaml", "inbox/many-problems.yaml")
    lines = str(info.value).splitlines()
    assert all(line.startswith("inbox/many-problems.yaml: ") for line in lines)
    paths = [p.path for p in info.value.problems]
    for expected in (
        "",
        "command[1]",
        "priorty",
        "resources.gpu",
        "resources.ram_gb",
        "retries.max",
        "retries.on[1]",
        "timeout",
        "train",
    ):
        assert expected in paths, (expected, lines)
    assert paths == sorted(paths, key=lambda p: p.replace("[", ".["))


# -- approval (YAML 1.2) --


@pytest.mark.parametrize(
    "value,hint",
    [
        ('"true"', 'approved is the string "true"; write approved: true (a YAML boolean) to submit'),
        ("yes", 'approved is the string "yes"; write approved: true (a YAML boolean) to submit'),
        ("on", 'approved is the string "on"; write approved: true (a YAML boolean) to submit'),
        ("1", "approved is 1, not a boolean; write approved: true (a YAML boolean) to submit"),
        ("false", "approved is false; write approved: true (a YAML boolean) to submit"),
        ("", "approved is empty (null); write approved: true (a YAML boolean) to submit"),
    ],
)
def test_approved_other_than_boolean_true_is_valid_but_waits(value: str, hint: str) -> None:
    spec = parse_job_text(f"approved: {value}\n" + CMD, "inbox/x.yaml")
    assert spec.approved is False
    assert spec.approval_hint == hint


def test_approved_true_approves_and_absent_waits_silently() -> None:
    spec = parse_job_text("approved: true\n" + CMD, "x")
    assert spec.approved is True and spec.approval_hint is None
    spec = parse_job_text(CMD, "x")
    assert spec.approved is False and spec.approval_hint is None


def test_on_as_a_key_stays_the_string_on() -> None:
    spec = parse_job_text("approved: true\n" + CMD + "env: {on: yes, off: no, y: n}\n", "x")
    assert spec.env == {"on": "yes", "off": "no", "y": "n"}


# -- durations --


@pytest.mark.parametrize(
    "written,seconds",
    [
        ("90", 90.0),
        ("90s", 90.0),
        ("10m", 600.0),
        ("1.5h", 5400.0),
        ("6h", 21600.0),
        ('"1500ms"', 1.5),
        ("2.5", 2.5),
        ('"120"', 120.0),
    ],
)
def test_durations(written: str, seconds: float) -> None:
    spec = parse_job_text(
        f"approved: true\n{CMD}timeout: {written}\nstop_grace: {written}\nstall_after: {written}\n"
        f"retries: {{backoff: {written}}}\n",
        "x",
    )
    assert (spec.timeout_s, spec.stop_grace_s, spec.stall_after_s, spec.retries.backoff_s) == (seconds,) * 4


@pytest.mark.parametrize(
    "written,got",
    [
        ("ten", '"ten"'),
        ("-5", "-5"),
        ("true", "true"),
        ("5 minutes", '"5 minutes"'),
        ("[1]", "a list"),
        ("1h30m", '"1h30m"'),
    ],
)
def test_bad_durations(written: str, got: str) -> None:
    problems = problems_of(f"approved: true\n{CMD}timeout: {written}\n")
    assert [p.to_dict() for p in problems] == [
        {"path": "timeout", "message": f"expected a duration like 90, 90s, 10m, 1.5h (got {got})"}
    ]


def test_schema_duration_pattern_matches_the_parser() -> None:
    for name in ("job.schema.json", "watcher.schema.json"):
        schema = json.loads((SCHEMAS_DIR / name).read_text())
        assert schema["$defs"]["duration"]["pattern"] == DURATION_PATTERN


# -- commands, placeholders, launching --


def test_command_string_is_split_like_a_shell_never_run_through_one() -> None:
    spec = parse_job_text("approved: true\ncommand: python train.py --name 'my run' --tag=\"a b\" $HOME; ls\n", "x")
    assert spec.command == ("python", "train.py", "--name", "my run", "--tag=a b", "$HOME;", "ls")


def test_command_string_with_an_unclosed_quote() -> None:
    message = only_message(problems_of("approved: true\ncommand: python train.py --name 'my run\n"))
    assert message.startswith("cannot be split like a shell would") and "quotation" in message


def test_numbers_in_command_lists_become_strings() -> None:
    spec = parse_job_text("approved: true\ncommand: [python, x.py, --lr, 1e-4, --n, 5, --f, 0.5, --q, '1e-4']\n", "x")
    assert spec.command == ("python", "x.py", "--lr", "0.0001", "--n", "5", "--f", "0.5", "--q", "1e-4")


def test_expand_placeholders() -> None:
    values = {"job_dir": "/q/running/a", "job_id": "a", "attempt": "2", "resume_from": "/ck/step-4"}
    assert expand_placeholders("{job_dir}/out-{job_id}-{attempt}", values) == "/q/running/a/out-a-2"
    assert expand_placeholders("{resume_from}", values) == "/ck/step-4"
    assert expand_placeholders("{other} {} {job_dir", values) == "{other} {} {job_dir"
    assert expand_placeholders('{"json": {job_id}}', values) == '{"json": a}'
    assert expand_placeholders("--from={resume_from}", {"job_id": "a"}) == "--from="


def test_command_job_launch_with_and_without_resume() -> None:
    spec = load_job_file(SAMPLES / "command-job.yaml")
    values = {"job_dir": "/q/running/sweep", "job_id": "sweep", "attempt": "2", "resume_from": "/q/running/sweep/ck"}
    base = ["python", "train.py", "--lr", "1e-4", "--epochs", "3", "--out", "/q/running/sweep/out"]
    assert spec.launch_argv(values, "/usr/bin/python3", resume=False) == base
    assert spec.launch_argv(values, "/usr/bin/python3", resume=True) == [*base, "--resume", "/q/running/sweep/ck"]
    assert spec.launch_env(values)["RUN_TAG"] == "sweep-a2"
    assert spec.launch_cwd(values) == "/q/work"  # relative to the queue root: the file names no submitted_from
    assert spec.has_resume and not spec.is_train


def test_command_job_without_resume_args_has_no_resume() -> None:
    spec = parse_job_text("approved: true\n" + CMD + "cwd: '~/proj'\n", "x")
    assert not spec.has_resume
    assert spec.launch_argv({"job_dir": "/j"}, "py", resume=True) == ["python", "train.py"]
    assert spec.launch_cwd({"job_dir": "/j"}) == os.path.expanduser("~/proj")
    assert parse_job_text("approved: true\n" + CMD + "resume_args: []\n", "x").has_resume


def test_train_job_launch() -> None:
    spec = load_job_file(SAMPLES / "train-job.yaml")
    values = {"job_dir": "/q/running/t", "job_id": "t", "attempt": "1", "resume_from": "/q/running/t/checkpoints/x"}
    assert spec.is_train and spec.has_resume and spec.command is None
    assert spec.train["max_steps"] == 40
    assert spec.launch_argv(values, "/venv/bin/python", resume=False) == [
        *safe_module_argv("/venv/bin/python", "trainq.trainer"),  # -P: the job's cwd is not on sys.path
        "/q/running/t",
    ]
    assert spec.launch_argv(values, "/venv/bin/python", resume=True)[-2:] == [
        "--resume-from",
        "/q/running/t/checkpoints/x",
    ]
    assert spec.launch_cwd(values) is None and spec.launch_env(values) == {}


# -- defaults and round trip --


def test_defaults() -> None:
    spec = parse_job_text("approved: true\n" + CMD, "x")
    assert spec.priority == 0 and spec.name is None and spec.cwd is None and spec.env == {}
    assert spec.resources == Resources(gpus=None, gpu_memory_gb=None, ram_gb=0.0, disk_gb=0.0, allow_battery=False)
    assert spec.timeout_s is None and spec.stall_after_s is None and spec.stop_grace_s == 120.0
    assert spec.retries == Retries(max=0, on=DEFAULT_RETRY_ON, backoff_s=30.0)
    assert set(DEFAULT_RETRY_ON) == {
        "oom",
        "killed",
        "stalled",
        "preempted",
        "unsatisfiable",
        "no_checkpoint",
        "startup",
        "unknown",
    }
    assert spec.resume_args is None and spec.slurm is None and spec.train is None


def test_sample_command_job_parses_to_these_values() -> None:
    spec = load_job_file(SAMPLES / "command-job.yaml")
    assert (spec.name, spec.priority, spec.cwd) == ("sweep-lr-3", 5, "work")
    assert spec.env == {
        "OMP_NUM_THREADS": "4",
        "WANDB_DISABLED": "true",
        "on": "kept as the string key 'on'",
        "RUN_TAG": "{job_id}-a{attempt}",
    }
    assert spec.resources == Resources(gpus=1, gpu_memory_gb=5.0, ram_gb=5.0, disk_gb=2.0, allow_battery=False)
    assert (spec.timeout_s, spec.stop_grace_s, spec.stall_after_s) == (21600.0, 90.0, 600.0)
    assert spec.retries == Retries(max=2, on=("oom", "killed", "preempted"), backoff_s=90.0)
    assert spec.resume_args == ("--resume", "{resume_from}")
    assert spec.slurm == {"partition": "gpu", "sbatch_args": ["--qos=high"]}


@pytest.mark.parametrize("sample", ["command-job.yaml", "train-job.yaml"])
def test_to_dict_from_dict_round_trip(sample: str) -> None:
    spec = load_job_file(SAMPLES / sample)
    again = JobSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    assert again.to_dict() == spec.to_dict()


def test_round_trip_keeps_the_approval_hint() -> None:
    spec = parse_job_text("approved: 'yes'\n" + CMD, "x")
    again = JobSpec.from_dict(spec.to_dict())
    assert again.approved is False and again.approval_hint == spec.approval_hint


def test_from_dict_validates() -> None:
    with pytest.raises(InvalidJobSpec) as info:
        JobSpec.from_dict({"approved": True, "command": ["x"], "priority": "high"}, "api")
    assert str(info.value) == 'api: priority: must be an integer (got "high")'


# -- the schemas themselves --


def schema_properties(node: object, where: str = "") -> list[tuple[str, dict]]:
    """Every (path, subschema) listed under a ``properties`` anywhere in a schema."""
    found: list[tuple[str, dict]] = []
    if isinstance(node, dict):
        for name, sub in node.get("properties", {}).items():
            found.append((f"{where}.{name}", sub))
        for key, sub in node.items():
            found += schema_properties(sub, f"{where}/{key}")
    elif isinstance(node, list):
        for i, sub in enumerate(node):
            found += schema_properties(sub, f"{where}[{i}]")
    return found


@pytest.mark.parametrize("name", ["job.schema.json", "watcher.schema.json"])
def test_every_property_has_title_and_description(name: str) -> None:
    schema = json.loads((SCHEMAS_DIR / name).read_text())
    assert schema["$id"] == name and schema["$schema"].endswith("2020-12/schema")
    properties = schema_properties(schema)
    assert len(properties) > 10
    missing = [
        path
        for path, sub in properties
        if not (isinstance(sub, dict) and sub.get("title") and len(sub.get("description", "")) > 20)
    ]
    assert missing == []


def test_job_schema_lists_every_jobspec_field() -> None:
    schema = json.loads((SCHEMAS_DIR / JOB_SCHEMA).read_text())
    assert set(schema["properties"]) == {
        "approved",
        "name",
        "priority",
        "command",
        "train",
        "cwd",
        "env",
        "resources",
        "timeout",
        "stop_grace",
        "stall_after",
        "retries",
        "resume_args",
        "slurm",
        "after",
        "after_policy",
        "on_finish",
        "sweep",
        "fork_of",
        "from_checkpoint",
        "deadline",
        "expected_duration",
        "deliver",
        "expected_lr",
        "abort_on_lr_deviation",
        "pool",
        "rerun_of",
        "checkpoint_exit_code",
        "snapshot",
        "submitted_from",  # round four: where relative paths resolve (docs/contract.md)
    }  # run records (issue 29)


def test_missing_referenced_schema_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    schemas = tmp_path / "schemas"
    schemas.mkdir()
    (schemas / JOB_SCHEMA).write_bytes((SCHEMAS_DIR / JOB_SCHEMA).read_bytes())
    problems = schema_problems(schema_validator(schemas, JOB_SCHEMA), {"train": {"model": "/m"}})
    assert len(problems) == 1 and "train.schema.json" in problems[0].message and "reinstall" in problems[0].message


def test_validator_is_built_once_per_process() -> None:
    assert schema_validator(SCHEMAS_DIR, JOB_SCHEMA) is schema_validator(Path(str(SCHEMAS_DIR)), JOB_SCHEMA)


def test_validation_stays_fast(tmp_path: Path) -> None:
    text = (
        "approved: true\nname: job-{i}\npriority: 1\ncommand: [python, train.py, --lr, 1e-4]\n"
        "resources: {{gpus: 1, ram_gb: 2}}\ntimeout: 6h\nretries: {{max: 2, on: [oom, killed], backoff: 30s}}\n"
    )
    paths = [tmp_path / f"j{i}.yaml" for i in range(300)]
    for i, path in enumerate(paths):
        path.write_text(text.format(i=i))
    load_job_file(paths[0])
    costs = []
    for path in paths:
        started = time.perf_counter()
        load_job_file(path)
        costs.append(time.perf_counter() - started)
    # ~0.5 ms here; the bound is loose for a busy 2-core machine but catches a per-file validator rebuild (~20 ms)
    assert statistics.median(costs) < 0.005


def test_the_attempt_records_program_is_what_shutil_which_finds(tmp_path: Path, monkeypatch) -> None:
    """``resolved_program`` walks the PATH itself (issue 38: ``shutil.which`` raised and caught an OSError for every
    folder without the name) and must find what ``which`` finds: the first executable that is not a folder, folders
    listed twice or missing, an empty entry (the cwd), a file without the x bit, a name with no match."""
    import shutil

    from trainq.watcher.spec.interpreter import resolved_program

    folders = {name: tmp_path / name for name in ("a", "b", "c", "d")}
    for folder in folders.values():
        folder.mkdir()
    for folder, name, mode in (
        ("a", "tool", 0o644),  # not executable: skipped
        ("b", "tool", 0o755),
        ("c", "tool", 0o755),
        ("c", "other", 0o700),
        ("d", "here", 0o755),
    ):
        (folders[folder] / name).write_text("#!/bin/sh\n")
        (folders[folder] / name).chmod(mode)
    (folders["a"] / "dir").mkdir()  # a folder of the name: skipped
    (folders["b"] / "dir").write_text("#!/bin/sh\n")
    (folders["b"] / "dir").chmod(0o755)
    monkeypatch.chdir(folders["d"])
    paths = [
        os.pathsep.join(str(folders[n]) for n in ("a", "b", "c")),
        os.pathsep.join([str(folders["a"]), str(tmp_path / "missing"), str(folders["a"]), str(folders["c"])]),
        os.pathsep.join(["", str(folders["a"])]),
        "",
    ]
    for path_env in paths:
        for name in ("tool", "other", "dir", "here", "nothing", "true"):
            assert resolved_program(name, path_env, "/") == shutil.which(name, path=path_env), (name, path_env)
