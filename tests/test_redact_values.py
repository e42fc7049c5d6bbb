"""Issue 36, item 6: secrets are redacted by value as well as by name, wherever records are written.

Before this change only names matching TOKEN/SECRET/... were redacted: a token under HF_TKN, GH_PAT,
WANDB_KEY or a password inside a URL reached snapshot/config.json and snapshot/environment.json (7 of
the issue's 8). Here 20 credential shapes under unusual names go into a real job's env and command
line; none may appear in any record the job folder holds, while the hashes the records are made of
(code.json's commit, sources.json's sha256, the job id) and ordinary values survive.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
from pathlib import Path

import yaml
from conftest import PY, drop, tick_until

from trainq.watcher.spec.text import REDACTED, is_token, redact_env, redact_text, redact_value

#: name -> a value of a real credential's shape (random-looking, not real keys)
SHAPES = {
    "HF_TKN": "hf_" + "aB3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3z",
    "GH_PAT": "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8",
    "GH_FINE": "github_pat_11ABCDEFG0" + "a1B2c3D4e5F6g7H8i9J0_k1L2m3N4o5P6q7R8s9T0u1V2w3X4y5Z6a7B8c9D0e1F2",
    "OAI": "sk-" + "Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0FeDcBa9876543210",
    "OAI_PROJ": "sk-proj-" + "Q1w2E3r4T5y6U7i8O9p0A1s2D3f4G5h6J7k8L9z0X1c2V3b4",
    "CLAUDE_K": "sk-ant-api03-" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8s9T0",
    "AWS_ID": "AKIA" + "IOSFODNN7EXAMPLE",
    "AWS_SAK": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "SLACK_BOT": "xoxb-" + "123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
    "SLACK_USR": "xoxp-" + "123456789012-123456789012-123456789012-abcdef0123456789",
    "ID_JWT": "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
    "DB_URL": "postgres://trainer:Hunter2Pass99@db.example:5432/runs",
    "GIT_REMOTE": "https://oauth2:S3cr3tPassw0rdInUrl@gitlab.example.com/team/x.git",
    "WANDB_KEY": "0123456789abcdef0123456789abcdef01234567",
    "COMET_K": "fedcba9876543210fedcba9876543210",
    "MLFLOW_B64": base64.b64encode(bytes(range(7, 40))).decode(),
    "GITLAB_P": "glpat-" + "Ab1Cd2Ef3Gh4Ij5Kl6Mn7Op",
    "GCP_K": "AIza" + "SyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q",
    "NPM_PUB": "npm_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8",
    "STRIPE_L": "sk_live_" + "51H8aB2cD3eF4gH5iJ6kL7mN",
}
#: ordinary values that must survive
PLAIN = {
    "OMP_NUM_THREADS": "4",
    "LANG": "C.UTF-8",
    "RUN_NAME": "runs/Experiment_2024_12_03_LoRA_r16_alpha32",
    "MODEL": "/cache/models--org--tiny/snapshots/9f8e7d6c5b4a39281706f5e4d3c2b1a098765432/model",
}


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


def _needle(value: str) -> str:
    """What must not appear: the value, or a URL's password."""
    return value.split("://")[1].split("@")[0].split(":")[1] if "://" in value else value


def test_twenty_shapes_under_unusual_names_never_reach_a_record(queue_dir, watcher, tmp_path):
    assert len(SHAPES) == 20
    repo = tmp_path / "code"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "train.py").write_text("import sys\nprint('args', len(sys.argv))\nsys.exit(3)\n")
    (repo / "data.txt").write_text("rows\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "one")
    commit = git(repo, "rev-parse", "HEAD").strip()
    args = [f"--{name.lower()}={value}" for name, value in list(SHAPES.items())[:10]]
    args += [value for value in list(SHAPES.values())[10:]]
    job = {
        "approved": True,
        "command": [PY, "train.py", "data.txt", *args],
        "cwd": str(repo),
        "env": {**SHAPES, **PLAIN},
        "deliver": {"to": "rsync://mirror:" + "Pa55w0rdInTarget" + "@backup.example/results"},
        "retries": {"max": 0},
    }
    w = watcher()
    drop(queue_dir, "leaky.yaml", yaml.safe_dump(job, sort_keys=False))
    tick_until(w, lambda: (queue_dir / "failed" / "leaky" / "snapshot" / "config.json").exists(), 60)
    folder = queue_dir / "failed" / "leaky"
    records = {
        p.relative_to(folder).as_posix(): p.read_text(errors="replace")
        for p in folder.rglob("*")
        if p.is_file() and p.name not in ("job.yaml", "output.log") and p.suffix in (".json", ".jsonl")
    }
    assert {"run.json", "events.jsonl", "snapshot/config.json", "snapshot/environment.json"} <= set(records)
    leaks = [
        (where, name)
        for name, value in {**SHAPES, "target": "Pa55w0rdInTarget"}.items()
        for where, text in records.items()
        if _needle(value) in text
    ]
    assert not leaks, leaks
    config = json.loads(records["snapshot/config.json"])
    environment = json.loads(records["snapshot/environment.json"])
    for name, value in PLAIN.items():
        assert config["env"][name] == value and environment["env"][name] == value, name
    assert config["env"]["DB_URL"] == f"postgres://trainer:{REDACTED}@db.example:5432/runs"
    assert config["command"][:3] == [PY, "train.py", "data.txt"]
    code = json.loads(records["snapshot/code.json"])
    assert code["git"]["commit"] == commit
    sources = json.loads(records["snapshot/sources.json"])
    data = next(s for s in sources if s["path"].endswith("data.txt"))
    assert data["sha256"] == hashlib.sha256(b"rows\n").hexdigest()
    started = [json.loads(line) for line in records["events.jsonl"].splitlines() if '"started"' in line]
    assert started and started[0]["code"]["commit"] == commit
    assert json.loads(records["run.json"])["id"] == "leaky"


def test_the_rules_one_by_one():
    for name, value in SHAPES.items():
        assert value not in json.dumps(redact_env({name: value})), name
        assert value not in redact_value(f"--{name.lower()}={value}"), name
    for name, value in PLAIN.items():
        assert redact_env({name: value}) == {name: value}
    sha = hashlib.sha256(b"x").hexdigest()
    assert redact_text(f"sha256 {sha} commit {'ab' * 20} id grid-3 step-000400") == (
        f"sha256 {sha} commit {'ab' * 20} id grid-3 step-000400"
    )
    assert is_token(sha) and redact_text(sha) == sha  # a whole hex value: env and argv only, never records
    assert (
        redact_text("see https://user:pw@host/x and ssh://git@host")
        == f"see https://user:{REDACTED}@host/x and ssh://git@host"
    )
    assert redact_env({"MY_API_KEY": "short"}) == {"MY_API_KEY": REDACTED}  # by name, as before


def test_a_value_quoted_in_a_rejection_is_redacted_in_run_json_and_events(queue_dir, watcher):
    """Validation quotes what it got; run.json's error and the ``finished`` event carry that line."""
    w = watcher()
    job = {"approved": True, "command": ["true"], "timeout": SHAPES["HF_TKN"], "priority": SHAPES["DB_URL"]}
    drop(queue_dir, "quoted.yaml", yaml.safe_dump(job))
    tick_until(w, lambda: (queue_dir / "failed" / "quoted" / "events.jsonl").exists())
    folder = queue_dir / "failed" / "quoted"
    run = json.loads((folder / "run.json").read_text())
    assert run["status"] == "rejected" and {e["path"] for e in run["errors"]} == {"timeout", "priority"}, run
    for name in ("run.json", "events.jsonl"):
        text = (folder / name).read_text()
        assert SHAPES["HF_TKN"] not in text and "Hunter2Pass99" not in text, (name, text)
        assert REDACTED in text, name
