"""watcher.yaml: defaults, good and bad files, the TRAINQ_SIMULATE_GPUS override, and allow_commands."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from trainq.watcher.spec.config import WatcherConfig, check_command_allowed, load_watcher_config
from trainq.watcher.spec.errors import InvalidWatcherConfig
from trainq.watcher.spec.jobspec import SCHEMAS_DIR, JobSpec, parse_job_text


def write_settings(root: Path, text: str) -> Path:
    path = root / "watcher.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def config_problems(root: Path, env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    with pytest.raises(InvalidWatcherConfig) as info:
        load_watcher_config(root, env or {})
    assert all(line.startswith("watcher.yaml: ") for line in str(info.value).splitlines())
    return [(p.path, p.message) for p in info.value.problems]


def test_no_file_gives_the_documented_defaults(tmp_path: Path) -> None:
    config = load_watcher_config(tmp_path, {})
    assert config == WatcherConfig()
    assert (config.max_concurrent, config.gpus, config.allow_commands, config.executor) == (1, None, None, "local")
    assert (config.settle_s, config.rescan_s, config.status_s, config.heartbeat_s) == (0.3, 2.0, 1.0, 5.0)
    assert (config.keep_finished, config.kill_after_s, config.simulate_gpus) == (50, 5.0, None)
    assert (config.min_free_ram_gb, config.min_free_disk_gb) == (0.0, 0.0)
    assert config.slurm == {
        "partition": None,
        "sbatch_args": [],
        "poll_s": 2.0,
        "exit_grace_s": 60.0,
        "arrays": True,
        "poll_max_s": 30.0,
        "heartbeat_s": 10.0,
        "array_limit": None,
        "node_env": "clean",
    }


@pytest.mark.parametrize("text", ["", "\n\n", "# all defaults\n"])
def test_empty_file_gives_defaults(tmp_path: Path, text: str) -> None:
    write_settings(tmp_path, text)
    assert load_watcher_config(tmp_path, {}) == WatcherConfig()


def test_good_file(tmp_path: Path) -> None:
    write_settings(
        tmp_path,
        (
            "max_concurrent: 3\ngpus: [0, 2]\nmin_free_ram_gb: 1.5\nmin_free_disk_gb: 10\n"
            "allow_commands: [python, /usr/bin/env]\nsettle_s: 300ms\nrescan_s: 1\nstatus_s: 0.5\nheartbeat_s: 2s\n"
            "kill_after_s: 1m\nkeep_finished: 10\nexecutor: slurm\n"
            "slurm: {partition: debug, sbatch_args: [--qos=low], poll_s: 500ms, exit_grace_s: 2m, arrays: false}\nsimulate_gpus: sim/gpus.json\n"
        ),
    )
    config = load_watcher_config(tmp_path, {})
    assert (config.max_concurrent, config.gpus, config.allow_commands) == (3, (0, 2), ("python", "/usr/bin/env"))
    assert (config.min_free_ram_gb, config.min_free_disk_gb, config.keep_finished) == (1.5, 10.0, 10)
    assert (config.settle_s, config.rescan_s, config.status_s, config.heartbeat_s, config.kill_after_s) == (
        0.3,
        1.0,
        0.5,
        2.0,
        60.0,
    )
    assert config.executor == "slurm"
    assert config.slurm == {
        "partition": "debug",
        "sbatch_args": ["--qos=low"],
        "poll_s": 0.5,
        "exit_grace_s": 120.0,
        "arrays": False,
        "poll_max_s": 30.0,
        "heartbeat_s": 10.0,
        "array_limit": None,
        "node_env": "clean",
    }
    assert config.simulate_gpus == tmp_path.absolute() / "sim" / "gpus.json"


def test_bad_file_reports_every_problem(tmp_path: Path) -> None:
    write_settings(
        tmp_path,
        "max_concurrent: 0\ngpus: [0, 0, -1]\nexecutor: slrum\nsettle_s: soon\nkeep_finished: lots\nstatus_s: 0\n",
    )
    assert config_problems(tmp_path) == [
        ("executor", "must be one of local, slurm (got \"slrum\") (did you mean 'slurm'?)"),
        ("gpus", "must not list the same item twice"),
        ("gpus[2]", "must be an integer >= 0 (got -1)"),
        ("keep_finished", 'must be an integer >= 0 (got "lots")'),
        ("max_concurrent", "must be an integer >= 1 (got 0)"),
        ("settle_s", 'expected a duration like 90, 90s, 10m, 1.5h (got "soon")'),
        ("status_s", "must be a duration greater than 0 (got 0)"),
    ]


def test_unknown_keys_are_errors_with_suggestions(tmp_path: Path) -> None:
    write_settings(tmp_path, "max_concurent: 2\nsettle: 1\nslurm: {partiton: gpu}\n")
    assert config_problems(tmp_path) == [
        ("max_concurent", "unknown key 'max_concurent' (did you mean 'max_concurrent'?)"),
        ("settle", "unknown key 'settle' (did you mean 'settle_s'?)"),
        ("slurm.partiton", "unknown key 'partiton' (did you mean 'partition'?)"),
    ]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("- max_concurrent: 2\n", "expected a mapping of settings at the top level, got a list"),
        ("max_concurrent: [1\n", "YAML syntax error"),
        ("a: &x 1\nb: *x\n", "aliases"),
    ],
)
def test_unreadable_settings(tmp_path: Path, text: str, expected: str) -> None:
    write_settings(tmp_path, text)
    problems = config_problems(tmp_path)
    assert len(problems) == 1 and problems[0][0] == "" and expected in problems[0][1]


def test_directory_named_watcher_yaml(tmp_path: Path) -> None:
    (tmp_path / "watcher.yaml").mkdir()
    assert "is a directory" in config_problems(tmp_path)[0][1]


def test_symlinked_settings_are_followed(tmp_path: Path) -> None:
    real = tmp_path / "dotfiles" / "trainq.yaml"
    real.parent.mkdir()
    real.write_text("max_concurrent: 4\n")
    (tmp_path / "watcher.yaml").symlink_to(real)
    assert load_watcher_config(tmp_path, {}).max_concurrent == 4


def test_env_overrides_simulate_gpus(tmp_path: Path) -> None:
    write_settings(tmp_path, "simulate_gpus: from-file.json\n")
    sim = tmp_path / "env-gpus.json"
    sim.write_text(json.dumps([{"index": 0, "name": "Sim 6GB", "memory_total_mb": 6144}]))
    assert load_watcher_config(tmp_path, {"TRAINQ_SIMULATE_GPUS": str(sim)}).simulate_gpus == sim
    assert load_watcher_config(tmp_path, {"TRAINQ_SIMULATE_GPUS": ""}).simulate_gpus == tmp_path / "from-file.json"
    assert load_watcher_config(tmp_path, {}).simulate_gpus == tmp_path / "from-file.json"


def test_env_simulate_gpus_relative_to_the_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_watcher_config(tmp_path / "queue", {"TRAINQ_SIMULATE_GPUS": "gpus.json"})
    assert config.simulate_gpus == tmp_path / "gpus.json"


def test_round_trip(tmp_path: Path) -> None:
    write_settings(
        tmp_path,
        "max_concurrent: 2\ngpus: []\nallow_commands: [python]\nsettle_s: 1.5s\n"
        "executor: slurm\nslurm: {sbatch_args: [-N1]}\nsimulate_gpus: g.json\n",
    )
    config = load_watcher_config(tmp_path, {})
    assert config.gpus == ()
    again = WatcherConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert WatcherConfig.from_dict(WatcherConfig().to_dict()) == WatcherConfig()


def test_from_dict_validates_with_its_display_name() -> None:
    with pytest.raises(InvalidWatcherConfig) as info:
        WatcherConfig.from_dict({"rescan_s": "2 seconds"}, display="/etc/trainq/watcher.yaml")
    assert str(info.value) == (
        '/etc/trainq/watcher.yaml: rescan_s: expected a duration like 90, 90s, 10m, 1.5h (got "2 seconds")'
    )


# -- allow_commands --


def command_job(command: str) -> JobSpec:
    return parse_job_text(f"approved: true\ncommand: {command}\n", "x")


def test_any_command_allowed_without_a_list() -> None:
    assert check_command_allowed(command_job("rm -rf /tmp/x"), WatcherConfig()) is None


def test_allow_commands_compare_real_paths(tmp_path: Path) -> None:
    tool = tmp_path / "tools" / "run.sh"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    (tmp_path / "link.sh").symlink_to(tool)
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(tool, tmp_path / "elsewhere" / "run.sh")
    config = WatcherConfig(allow_commands=("echo", str(tool)))
    echo = os.path.realpath(shutil.which("echo"))
    assert check_command_allowed(command_job("echo x"), config) is None
    assert check_command_allowed(command_job(f"{echo} x"), config) is None
    assert check_command_allowed(command_job(f"{tool} --fast"), config) is None
    assert check_command_allowed(command_job(f"{tmp_path}/tools/../tools/run.sh"), config) is None
    assert check_command_allowed(command_job(f"{tmp_path}/link.sh"), config) is None  # same real path
    assert check_command_allowed(command_job(f"{tmp_path}/elsewhere/run.sh"), config) is not None
    assert check_command_allowed(command_job("run.sh"), config) is not None  # not on the watcher's PATH


def test_disallowed_command_problem_names_field_and_remedy() -> None:
    problem = check_command_allowed(command_job("bash -c 'echo hi'"), WatcherConfig(allow_commands=("python",)))
    assert problem is not None and problem.path == "command"
    assert problem.message.startswith("'bash' is not in allow_commands of watcher.yaml (allowed: python)")


def test_train_jobs_are_always_allowed() -> None:
    spec = parse_job_text("approved: true\ntrain: {model: /m, data: /d.jsonl, max_steps: 2}\n", "x")
    assert check_command_allowed(spec, WatcherConfig(allow_commands=())) is None


def test_watcher_schema_lists_every_setting() -> None:
    schema = json.loads((SCHEMAS_DIR / "watcher.schema.json").read_text())
    fields = set(WatcherConfig.__dataclass_fields__)
    assert set(schema["properties"]) == fields
    assert set(schema["properties"]["slurm"]["properties"]) == set(WatcherConfig().slurm)
    assert not os.path.isabs(schema["$id"])
