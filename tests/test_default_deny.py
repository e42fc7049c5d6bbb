"""Issue 36, items 1 and 2: default-deny under allow_commands (docs/containment.md).

Shaped like test_allow_env.py: each finding first shows the REAL program subverted by the input (a
marker file appears), then drops the same job into a queue whose allow_commands allows that program
and expects it refused, naming the field, with nothing run. On the code before this change every one
of these jobs was accepted, and the train job's planted argparse module ran inside the trainer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml
from conftest import PY, REPO, drop, tick_until
from test_allow_env import marks, needs, refused, subverted  # noqa: F401 (marks is a fixture)

from trainq.watcher.spec.allow import DEFAULT_ALLOW_ENV, LOADER_FAMILIES, is_allowed_env, is_loader_variable
from trainq.watcher.spec.interpreter import SAFE_BOOT, safe_module_argv

PY3 = "/usr/bin/python3"


def script(folder: Path, name: str, body: str) -> Path:
    """An allowed bash script: what a user's job would legitimately run."""
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def evil(folder: Path, name: str) -> Path:
    """A program that only touches $EVIL_MARK: what the attacker wants run."""
    path = folder / name
    path.write_text('#!/bin/sh\ntouch "$EVIL_MARK"\n')
    path.chmod(0o755)
    return path


# -- item 2: four variables the denylist never heard of ------------------------------------------------------


def test_tar_options_runs_a_checkpoint_action(queue_dir, watcher, marks):
    needs("bash", "tar")
    (marks / "data.txt").write_text("x\n")
    backup = script(marks, "backup.sh", f"tar cf {marks / 'out.tar'} -C {marks} data.txt\n")
    env = {"TAR_OPTIONS": f"--checkpoint=1 --checkpoint-action=exec={evil(marks, 'evil.sh')}"}
    assert subverted(["bash", str(backup)], env, marks / "tar")
    refused(queue_dir, watcher, ["bash"], {"tar": (["bash", str(backup)], env)}, marks)


def test_rsync_rsh_runs_as_the_remote_shell(queue_dir, watcher, marks):
    needs("bash", "rsync")
    (marks / "data.txt").write_text("x\n")
    push = script(marks, "push.sh", f"rsync -a {marks / 'data.txt'} backup-host:/srv/x || true\n")
    env = {"RSYNC_RSH": str(evil(marks, "evil.sh"))}
    assert subverted(["bash", str(push)], env, marks / "rsync")
    refused(
        queue_dir,
        watcher,
        ["bash"],
        {"rsync": (["bash", str(push)], env), "connect": (["bash", str(push)], {"RSYNC_CONNECT_PROG": "touch x"})},
        marks,
    )


def test_pip_variables_choose_what_pip_builds(queue_dir, watcher, marks):
    needs("bash", PY3)
    if subprocess.run([PY3, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("pip for /usr/bin/python3 is not installed here")
    package = marks / "tqdm-99.0"
    package.mkdir()
    (package / "setup.py").write_text(
        "import os\nopen(os.environ['EVIL_MARK'], 'w').close()\n"
        "from setuptools import setup\nsetup(name='tqdm', version='99.0')\n"
    )
    (marks / "links").mkdir()
    with tarfile.open(marks / "links" / "tqdm-99.0.tar.gz", "w:gz") as tar:
        tar.add(package, arcname="tqdm-99.0")
    fetch = script(marks, "fetch.sh", f"{PY3} -m pip download -q --no-deps -d {marks / 'dl'} tqdm || true\n")
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(marks / "links")}
    assert subverted(["bash", str(fetch)], env, marks / "pip")
    refused(queue_dir, watcher, ["bash"], {"pip": (["bash", str(fetch)], env)}, marks)


def test_shell_is_what_flock_runs(queue_dir, watcher, marks):
    needs("bash", "flock")
    locked = script(marks, "locked.sh", f"flock {marks / 'lock'} -c 'echo one at a time'\n")
    env = {"SHELL": str(evil(marks, "evil.sh"))}
    assert subverted(["bash", str(locked)], env, marks / "shell")
    refused(queue_dir, watcher, ["bash"], {"shell": (["bash", str(locked)], env)}, marks)


def test_the_new_names_stay_refused_even_when_allow_env_lists_everything(queue_dir, watcher):
    """The families are the second layer: allow_env: ['*'] does not reopen them."""
    w = watcher(allow_commands=["true"], allow_env=["*"])
    for name in ("TAR_OPTIONS", "RSYNC_RSH", "PIP_INDEX_URL", "SHELL"):
        drop(queue_dir, f"{name.lower()}.yaml", f"approved: true\ncommand: ['true']\nenv: {{{name}: x}}\n")
    drop(queue_dir, "fine.yaml", "approved: true\ncommand: ['true']\nenv: {ANYTHING_ELSE: /a/path}\n")
    tick_until(w, lambda: (queue_dir / "done" / "fine").exists() and len(list((queue_dir / "failed").iterdir())) == 4)
    for name in ("TAR_OPTIONS", "RSYNC_RSH", "PIP_INDEX_URL", "SHELL"):
        run = json.loads((queue_dir / "failed" / name.lower() / "run.json").read_text())
        assert run["errors"][0]["path"] == f"env.{name}" and "load or run other code" in run["error"], run


# -- item 2: the env is an allowlist under allow_commands ----------------------------------------------------


def test_allow_commands_makes_the_env_an_allowlist_with_a_short_default(queue_dir, watcher):
    w = watcher(allow_commands=["true"])
    ok = {"OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", "LANG": "C.UTF-8", "LC_ALL": "en_US.UTF-8"}
    drop(queue_dir, "ok.yaml", yaml.safe_dump({"approved": True, "command": ["true"], "env": ok}))
    drop(queue_dir, "name.yaml", "approved: true\ncommand: ['true']\nenv: {OMP_NUM_THREADS: 1, MY_FLAG: x}\n")
    drop(queue_dir, "path.yaml", "approved: true\ncommand: ['true']\nenv: {LC_ALL: /tmp/evil-locale}\n")
    tick_until(w, lambda: (queue_dir / "done" / "ok").exists() and len(list((queue_dir / "failed").iterdir())) == 2)
    name = json.loads((queue_dir / "failed" / "name" / "run.json").read_text())
    assert name["errors"][0]["path"] == "env.MY_FLAG", name
    assert "default allow_env" in name["error"] and "OMP_NUM_THREADS" in name["error"]
    path = json.loads((queue_dir / "failed" / "path" / "run.json").read_text())
    assert path["errors"][0]["path"] == "env.LC_ALL" and "value is not plain" in path["error"], path


def test_the_default_list_names_no_loader_variable_and_no_new_family():
    for pattern in DEFAULT_ALLOW_ENV:
        assert not is_loader_variable(pattern.replace("*", "X")), pattern
    for name in LOADER_FAMILIES["tools"]:
        assert not is_allowed_env(name.replace("*", "X"), DEFAULT_ALLOW_ENV), name
    for name in ("HF_HOME", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "TZ", "WANDB_DIR"):
        assert not is_allowed_env(name, DEFAULT_ALLOW_ENV), name


# -- item 2: a cwd in a repository whose .git/config runs a command -------------------------------------------


def test_a_cwd_in_a_repository_with_core_fsmonitor(queue_dir, watcher, marks):
    needs("bash", "git")
    repo = marks / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "config", "core.fsmonitor", str(evil(marks, "evil.sh"))], check=True)
    status = script(marks, "status.sh", "git status --short\n")
    subprocess.run(
        ["bash", str(status)], cwd=repo, env={"PATH": "/usr/bin:/bin", "EVIL_MARK": str(marks / "git")}, check=False
    )
    assert (marks / "git").exists(), "git status did not run core.fsmonitor"
    w = watcher(allow_commands=["bash", "true"])
    job = {"approved": True, "command": ["bash", str(status)], "cwd": str(repo), "env": {"LANG": "C"}}
    drop(queue_dir, "fsmonitor.yaml", yaml.safe_dump(job))
    drop(queue_dir, "escape.yaml", yaml.safe_dump({**job, "cwd": "../../.."}))
    drop(queue_dir, "inside.yaml", yaml.safe_dump({**job, "command": ["true"], "cwd": "{job_dir}"}))
    tick_until(
        w,
        lambda: (
            all((queue_dir / "failed" / n).exists() for n in ("fsmonitor", "escape"))
            and (queue_dir / "done" / "inside").exists()
        ),
    )
    for name in ("fsmonitor", "escape"):
        run = json.loads((queue_dir / "failed" / name / "run.json").read_text())
        assert run["status"] == "rejected" and run["errors"][0]["path"] == "cwd", run
        assert "allow_cwd" in run["error"], run
    assert not (marks / "queue-git").exists()


def test_allow_cwd_admits_a_trusted_folder(queue_dir, watcher, tmp_path):
    project = tmp_path / "projects" / "one"
    project.mkdir(parents=True)
    w = watcher(allow_commands=["true"], allow_cwd=[str(tmp_path / "projects")])
    drop(queue_dir, "in.yaml", yaml.safe_dump({"approved": True, "command": ["true"], "cwd": str(project)}))
    link = tmp_path / "projects" / "out"
    link.symlink_to("/etc")
    drop(queue_dir, "link.yaml", yaml.safe_dump({"approved": True, "command": ["true"], "cwd": str(link)}))
    tick_until(w, lambda: (queue_dir / "done" / "in").exists() and (queue_dir / "failed" / "link").exists())
    run = json.loads((queue_dir / "failed" / "link" / "run.json").read_text())
    assert run["errors"][0]["path"] == "cwd" and "/etc" in run["error"], run


def test_allow_cwd_in_watcher_yaml(tmp_path: Path):
    from trainq.watcher.spec.config import InvalidWatcherConfig, load_watcher_config

    (tmp_path / "watcher.yaml").write_text("allow_cwd: [/srv/projects, shared]\n")
    config = load_watcher_config(tmp_path, {})
    assert config.allow_cwd == ("/srv/projects", str(tmp_path / "shared"))
    assert type(config).from_dict(config.to_dict()) == config
    (tmp_path / "watcher.yaml").write_text("allow_cwd: /srv\n")
    with pytest.raises(InvalidWatcherConfig, match="allow_cwd"):
        load_watcher_config(tmp_path, {})


# -- item 1: no Python process trainq starts has the job's cwd on sys.path -----------------------------------


def plant_argparse(folder: Path, mark: Path) -> None:
    """An argparse.py that marks, then hands over to the real one (so a process that imports it still works)."""
    (folder / "argparse.py").write_text(
        f"open({str(mark)!r}, 'a').close()\n"
        "import sys\nfrom importlib.machinery import PathFinder\n"
        "_here = __file__.rsplit('/', 1)[0]\n"
        "_spec = PathFinder.find_spec('argparse', [p for p in sys.path if p not in ('', _here)])\n"
        "_real = _spec.loader.load_module('argparse')\n"
        "globals().update(vars(_real))\n"
    )


#: every Python process trainq starts, by module
MODULES = (
    "trainq.trainer",
    "trainq.watcher.supervisor.spawner",
    "trainq.watcher.supervisor.hooks",
    "trainq.watcher.supervisor.deliver",
    "trainq.watcher.supervisor.stacks",
    "trainq.watcher.slurm.node",
)


@pytest.mark.parametrize("module", MODULES)
def test_python_m_puts_the_cwd_first_and_safe_module_argv_does_not(tmp_path, module):
    """A ``trainq/`` package planted in the cwd shadows the real one under ``python -m``: every module runs it."""
    planted = tmp_path / "planted"
    (planted / "trainq").mkdir(parents=True)
    (planted / "trainq" / "__init__.py").write_text("import os\nopen(os.environ['EVIL_MARK'], 'a').close()\n")

    def run(argv: list[str], mark: Path) -> bool:
        env = {**os.environ, "EVIL_MARK": str(mark)}
        subprocess.run(
            [*argv, "--help"], cwd=planted, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=300
        )
        return mark.exists()

    assert run([PY, "-m", module], tmp_path / "old"), "python -m did not import the cwd's trainq/"
    assert not run(safe_module_argv(PY, module), tmp_path / "new"), f"{module} imported the cwd's trainq/"


def _python_3_10() -> str | None:
    """A Python 3.10 on this machine (PATH, or pyenv's folder), for the bootstrap 3.10 gets instead of -P."""
    found = shutil.which("python3.10")
    if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
        return found
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    return next((str(p) for p in sorted(pyenv.glob("3.10*/bin/python3.10")) if p.exists()), None)


def test_python_3_10_gets_a_bootstrap_that_drops_the_cwd_as_minus_p_does(tmp_path):
    """Python 3.10 has no -P: trainq runs its modules through ``-c SAFE_BOOT module``; a planted argparse.py in the
    cwd hijacks ``python3.10 -m json.tool`` and not the bootstrap, which still runs the module with its arguments."""
    python = _python_3_10()
    if python is None:
        pytest.skip("no Python 3.10 on this machine (PATH or ~/.pyenv/versions/3.10*)")
    (tmp_path / "argparse.py").write_text("print('HIJACKED')\nraise SystemExit(9)\n")
    (tmp_path / "x.json").write_text('{"a": 1}')

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    plain = run([python, "-m", "json.tool", "x.json"])
    assert (plain.returncode, plain.stdout.strip()) == (9, "HIJACKED"), plain
    safe = run([python, "-c", SAFE_BOOT, "json.tool", "x.json"])
    assert safe.returncode == 0 and json.loads(safe.stdout) == {"a": 1}, safe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    pytest.importorskip("torch", reason="the training stack (pip install -e '.[train]') is not installed")
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run([PY, "-m", "trainq.trainer.tiny", str(out)], check=True, cwd=REPO, capture_output=True, timeout=300)
    return out


def test_a_train_jobs_cwd_never_reaches_the_trainers_imports(queue_dir, watcher, tmp_path, tiny):
    project = tmp_path / "project"
    project.mkdir()
    plant_argparse(project, tmp_path / "planted-ran")
    train = {
        "model": str(tiny / "model"),
        "data": str(tiny / "train.jsonl"),
        "method": "lora",
        "max_steps": 2,
        "batch_size": 2,
        "seq_len": 32,
    }
    job = {"approved": True, "cwd": str(project), "train": train}
    w = watcher(allow_commands=["true"], allow_cwd=[str(project)])
    drop(queue_dir, "train.yaml", yaml.safe_dump(job))
    tick_until(w, lambda: (queue_dir / "done" / "train").exists() or (queue_dir / "failed" / "train").exists(), 600)
    log = next(queue_dir.glob("*/train/output.log")).read_text()
    assert (queue_dir / "done" / "train").exists(), log[-3000:]
    assert not (tmp_path / "planted-ran").exists(), "the trainer imported the job cwd's argparse.py"
