"""The README stays true: the job-file reference matches the schemas, and the commands it shows exist."""

from __future__ import annotations

import re
import subprocess

from conftest import PY, REPO


def test_the_reference_page_matches_the_schemas():
    from trainq.watcher.cli.docs import WRITE_COMMAND, reference

    text = (REPO / "docs" / "reference.md").read_text(encoding="utf-8")
    assert text == reference(), f"docs/reference.md is stale: run {WRITE_COMMAND}"


def test_the_reference_page_lists_every_field_of_every_schema():
    """Generated, so nothing can be left out: each property of the three schemas has its row."""
    import json

    text = (REPO / "docs" / "reference.md").read_text(encoding="utf-8")
    for name in ("job", "train", "watcher"):
        schema = json.loads((REPO / "schemas" / f"{name}.schema.json").read_text())
        for field in schema["properties"]:
            assert f"| `{field}` |" in text or f"| `{field}." in text, f"{name}.schema.json: {field} missing"


def test_the_readme_is_the_front_door_and_links_into_the_manual():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 260
    for page in ("contract.md", "reference.md", "cli.md", "trainer.md", "slurm.md", "benchmarks.md"):
        assert f"docs/{page}" in text, page
        assert (REPO / "docs" / page).is_file(), page


def test_readme_two_commands_are_make_targets_and_ci_runs_the_test_one():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Two commands.*?```sh\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_cli_commands_named_in_readme_exist():
    help_text = subprocess.run([PY, "-m", "trainq.watcher", "--help"], capture_output=True, text=True, cwd=REPO).stdout
    for command in ("init", "watch", "validate", "submit", "status", "logs", "stop", "retry", "demo"):
        assert command in help_text


def test_examples_validate_and_carry_the_editor_schema_line():
    from trainq.watcher.spec.jobspec import load_job_file

    examples = sorted((REPO / "queue" / "examples").glob("*.yaml"))
    assert {p.name for p in examples} >= {"lora-cpu.yaml", "qlora-6gb.yaml", "command-resume.yaml"}
    for path in examples:
        # the modeline works in any folder one level below a queue root (`trainq init` writes ROOT/schemas/)
        assert path.read_text().startswith("# yaml-language-server: $schema=../schemas/job.schema.json")
        assert (path.parent / "../schemas/job.schema.json").resolve() == (REPO / "schemas" / "job.schema.json")
        spec = load_job_file(path)
        assert spec.is_train or spec.resume_args
