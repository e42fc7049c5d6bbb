"""trainq preview JOB_FILE [-n N]: rows as the trainer will see them, each token with its label (trained or masked),
bad rows named; the CLI runs the trainer's module in its own process (the watcher never imports torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from tests.trainer_util import REPO, build_tiny, trainer_env
from trainq.watcher.spec.contract import EXIT_USAGE


def test_preview_shows_labels_per_token_and_skipped_rows(tmp_path):
    build_tiny(tmp_path / "tiny")
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {
                    "messages": [
                        {"role": "human", "content": "colour?"},
                        {"role": "gpt", "content": "red."},
                        {"role": "user", "content": "and?"},
                        {"role": "bot", "content": "blue."},
                    ]
                },
                {"messages": [{"role": "user", "content": "no answer"}]},
                {"prompt": "the cat", "completion": " sits."},
            ]
        )
    )
    job = tmp_path / "inbox" / "job.yaml"
    job.parent.mkdir()
    job.write_text(
        yaml.safe_dump(
            {
                "approved": True,
                "train": {
                    "model": "../tiny/model",
                    "data": "../chat.jsonl",
                    "max_steps": 4,
                    "seq_len": 64,
                    "eval_fraction": 0,
                },
            }
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "trainq.watcher", "preview", str(job), "-n", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=trainer_env(),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith(f"{job}: lora, seq_len 64, train_on assistant, 3 train rows")
    assert "line 1 (messages): " in lines[1] and ", 6 trained" in lines[1]
    tokens = lines[2]
    assert "<|bos|>(-100)" in tokens and "user(-100)" in tokens.replace("use(-100) r(-100)", "user(-100)")
    assert " red(287) .(16) <|eos|>(2)" in tokens and " blue" in tokens and tokens.endswith("<|eos|>(2)")
    assert "line 2 (messages): SKIPPED, a bad row: no assistant turn" in lines[3]
    assert "line 3 (prompt): " in lines[4] and "the(-100)" in lines[5] and "sits(" in lines[5]
    assert "\033[" not in run.stdout, "no colours when stdout is not a terminal"

    job.write_text(
        yaml.safe_dump(
            {
                "approved": True,
                "train": {"model": "../tiny/model", "data": "../chat.jsonl", "max_steps": 4, "seq_len": 2},
            }
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "trainq.watcher", "preview", str(job)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=trainer_env(),
        timeout=300,
    )
    assert run.returncode == EXIT_USAGE and f"{job}: train.seq_len" in run.stderr and "Traceback" not in run.stderr


def test_preview_counts_bad_rows_and_says_whether_the_gate_passes(tmp_path):
    """Issue 37: preview reads and tokenizes every row, as the trainer does, and says what data.max_bad_rows does."""
    build_tiny(tmp_path / "tiny")
    data = tmp_path / "rows.jsonl"
    good = [json.dumps({"prompt": f"q{i}", "completion": " a."}) for i in range(4)]
    no_answer = json.dumps({"messages": [{"role": "user", "content": "hello"}]})  # fails only when tokenizing
    data.write_text("\n".join([*good, "{not json", no_answer]) + "\n")
    job = tmp_path / "job.yaml"

    def preview_with(max_bad_rows: float) -> list[str]:
        train = {"model": str(tmp_path / "tiny" / "model"), "max_steps": 4, "seq_len": 32, "eval_fraction": 0}
        train["data"] = {"train": str(data), "max_bad_rows": max_bad_rows}
        job.write_text(yaml.safe_dump({"approved": True, "train": train}))
        run = subprocess.run(
            [sys.executable, "-m", "trainq.trainer.preview", str(job), "-n", "1"],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=trainer_env(),
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        return run.stdout.splitlines()

    lines = preview_with(0)
    assert lines[-2] == (
        f"bad rows: {data}: 2 of 6 (1 not JSON, 1 no assistant turn); data.max_bad_rows 0 allows 0: over the limit: "
        "REFUSED"
    )
    assert lines[-1].startswith(f"gate: the trainer would refuse this data (exit 65): {data}: 2 bad rows of 6")
    lines = preview_with(2)
    assert lines[-2].endswith("data.max_bad_rows 2 allows 2: within the limit: the trainer skips them")
    assert lines[-1] == "gate: passes; the trainer would train on these rows"
