"""Issue 23, item 5: allow_commands covers the environment, and allow_env makes it an allowlist.

Each family has a real allowed program that the variable subverts: the test first shows it (the
program run directly with that env runs our code: a marker file appears), then drops the same job
into a queue whose allow_commands allows that program, and expects it rejected naming ``env.X``
with nothing run. Before this change every one of these jobs was accepted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import drop, tick_until

from trainq.watcher.spec.allow import LOADER_FAMILIES, is_loader_variable

PY3 = "/usr/bin/python3"


def needs(*programs: str) -> None:
    missing = [p for p in programs if not (shutil.which(p) or os.path.exists(p))]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed here")


@pytest.fixture(scope="module")
def evil_so(tmp_path_factory) -> Path:
    """A shared object whose constructor touches $EVIL_MARK: what a loader variable would make a program load."""
    needs("cc")
    folder = tmp_path_factory.mktemp("evil")
    src = folder / "evil.c"
    src.write_text(
        "#include <stdlib.h>\n#include <string.h>\n"
        "__attribute__((constructor)) static void evil(void) {\n"
        '  const char *m = getenv("EVIL_MARK"); char c[4200] = "touch ";\n'
        '  if (m) { strncat(c, m, 4000); unsetenv("EVIL_MARK"); unsetenv("LD_PRELOAD"); system(c); } }\n'
    )
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / "evil.so"), str(src)], check=True)
    return folder / "evil.so"


@pytest.fixture
def marks() -> Iterator[Path]:
    """A folder every user can write (the PS4 case runs bash as nobody, who cannot reach pytest's tmp)."""
    folder = Path(tempfile.mkdtemp(prefix="trainq-marks-"))
    folder.chmod(0o777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def subverted(argv: list[str], env: dict[str, str], mark: Path, user: str | None = None) -> bool:
    """Run the allowed program directly with ``env``: does our code run in it (the marker appears)?"""
    prefix = ["setpriv", "--reuid", user, "--regid", user, "--clear-groups"] if user else []
    subprocess.run(
        prefix + argv,
        env={**os.environ, **env, "EVIL_MARK": str(mark)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=60,
        cwd="/",
    )
    return mark.exists()


def refused(
    queue_dir: Path, watcher, allowed: list[str], jobs: dict[str, tuple[list[str], dict[str, str]]], marks: Path
) -> None:
    """Drop each job (argv, env) under allow_commands: ``allowed``; each is rejected naming env.<its first
    variable>, and none of them runs (their own marker never appears)."""
    w = watcher(allow_commands=allowed)
    for name, (argv, env) in jobs.items():
        job = {"approved": True, "command": argv, "env": {**env, "EVIL_MARK": str(marks / f"queue-{name}")}}
        drop(queue_dir, f"{name}.yaml", yaml.safe_dump(job, sort_keys=False))
    tick_until(w, lambda: all((queue_dir / "failed" / n / "run.json").exists() for n in jobs), what="rejections")
    for name, (_argv, env) in jobs.items():
        run = json.loads((queue_dir / "failed" / name / "run.json").read_text())
        assert run["status"] == "rejected", (name, run)
        assert run["errors"][0]["path"] == f"env.{next(iter(env))}", (name, run["errors"])
        assert "allow_commands" in run["error"]
    for _ in range(5):
        w.tick(__import__("time").time())
    assert not list(marks.glob("queue-*")), "a refused job ran"


def test_bash_functions_start_up_file_and_tracing(queue_dir, watcher, marks):
    needs("bash", "setpriv")
    script = marks / "allowed.sh"
    script.write_text("#!/bin/bash\necho hello\n")
    script.chmod(0o755)
    func = {"BASH_FUNC_echo%%": f"() {{ touch {marks / 'func'}; }}"}
    assert subverted(["bash", str(script)], func, marks / "func")
    (marks / "rc.sh").write_text(f"touch {marks / 'bashenv'}\n")
    assert subverted(["bash", str(script)], {"BASH_ENV": str(marks / "rc.sh")}, marks / "bashenv")
    trace = {"SHELLOPTS": "xtrace", "PS4": f"$(touch {marks / 'ps4'})"}
    assert subverted(["bash", str(script)], trace, marks / "ps4", user="65534")  # bash ignores PS4 as root
    refused(
        queue_dir,
        watcher,
        ["bash"],
        {
            "func": (["bash", str(script)], func),
            "bashenv": (["bash", str(script)], {"BASH_ENV": str(marks / "rc.sh")}),
            "shellopts": (["bash", str(script)], {"SHELLOPTS": "xtrace"}),
            "ps4": (["bash", str(script)], {"PS4": trace["PS4"]}),
            "bashopts": (["bash", str(script)], {"BASHOPTS": "extdebug"}),
            "envfile": (["bash", str(script)], {"ENV": str(marks / "rc.sh")}),
        },
        marks,
    )


def test_openssl_conf_loads_a_shared_object(queue_dir, watcher, marks, evil_so):
    needs("openssl")
    conf = marks / "openssl.cnf"
    conf.write_text(f"openssl_conf = c\n[c]\nproviders = p\n[p]\nevil = e\n[e]\nmodule = {evil_so}\nactivate = 1\n")
    argv = ["openssl", "list", "-providers"]
    assert subverted(argv, {"OPENSSL_CONF": str(conf)}, marks / "ssl")
    refused(
        queue_dir,
        watcher,
        ["openssl"],
        {
            "conf": (argv, {"OPENSSL_CONF": str(conf)}),
            "engines": (argv, {"OPENSSL_ENGINES": str(evil_so.parent)}),
            "modules": (argv, {"OPENSSL_MODULES": str(evil_so.parent)}),
        },
        marks,
    )


def test_glibc_loader_variables(queue_dir, watcher, marks, evil_so):
    needs("iconv")
    gconv = marks / "gconv"
    gconv.mkdir()
    shutil.copy(evil_so, gconv / "EVIL.so")
    (gconv / "gconv-modules").write_text("module EVIL// INTERNAL EVIL 1\nmodule INTERNAL EVIL// EVIL 1\n")
    argv = ["iconv", "-f", "EVIL", "-t", "UTF-8", "/dev/null"]
    assert subverted(argv, {"GCONV_PATH": str(gconv)}, marks / "gconv-ran")
    assert subverted(["true"], {"LD_PRELOAD": str(evil_so)}, marks / "preload")
    refused(
        queue_dir,
        watcher,
        ["iconv"],
        {
            "gconv": (argv, {"GCONV_PATH": str(gconv)}),
            "tunables": (argv, {"GLIBC_TUNABLES": "glibc.malloc.check=3"}),
            "preload": (argv, {"LD_PRELOAD": str(evil_so)}),
            "locpath": (argv, {"LOCPATH": str(gconv)}),
        },
        marks,
    )


def test_python_start_up_and_user_site(queue_dir, watcher, marks):
    needs(PY3)
    site = marks / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os; open(os.environ['EVIL_MARK'], 'w').close()\n")
    argv = [PY3, "-c", "pass"]
    assert subverted(argv, {"PYTHONPATH": str(site)}, marks / "pythonpath")
    user_site = marks / "home" / ".local" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    if (
        subprocess.run(
            [PY3, "-c", f"import sys; sys.exit(sys.version_info[:2] != {sys.version_info[:2]!r})"]
        ).returncode
        == 0
    ):
        (user_site / "site-packages").mkdir(parents=True)
        (user_site / "site-packages" / "evil.pth").write_text("import os; open(os.environ['EVIL_MARK'], 'w').close()\n")
        assert subverted(argv, {"HOME": str(marks / "home")}, marks / "home-ran")
    refused(
        queue_dir,
        watcher,
        ["python3"],
        {
            "pythonpath": (argv, {"PYTHONPATH": str(site)}),
            "home": (argv, {"HOME": str(marks / "home")}),
            "pythonhome": (argv, {"PYTHONHOME": str(site)}),
            "startup": (argv, {"PYTHONSTARTUP": str(site / "sitecustomize.py")}),
            "inspect": (argv, {"PYTHONINSPECT": "1"}),
            "warnings": (argv, {"PYTHONWARNINGS": "ignore::sitecustomize.Warning"}),
            "pycache": (argv, {"PYTHONPYCACHEPREFIX": str(site)}),
            "breakpoint": (argv, {"PYTHONBREAKPOINT": "sitecustomize.x"}),
        },
        marks,
    )


def test_perl_ruby_node_java_start_up(queue_dir, watcher, marks):
    needs("perl", "node")
    lib = marks / "pl"
    lib.mkdir()
    (lib / "evil.pm").write_text('package evil; system("touch", $ENV{EVIL_MARK}); 1;\n')
    assert subverted(["perl", "-e", "1"], {"PERL5OPT": "-Mevil", "PERL5LIB": str(lib)}, marks / "perl")
    (marks / "evil.js").write_text("require('fs').writeFileSync(process.env.EVIL_MARK, 'x')\n")
    assert subverted(["node", "-e", "1"], {"NODE_OPTIONS": f"--require {marks / 'evil.js'}"}, marks / "node")
    refused(
        queue_dir,
        watcher,
        ["perl", "node"],
        {
            "perl5opt": (["perl", "-e", "1"], {"PERL5OPT": "-Mevil"}),
            "perl5lib": (["perl", "-e", "1"], {"PERL5LIB": str(lib)}),
            "node": (["node", "-e", "1"], {"NODE_OPTIONS": f"--require {marks / 'evil.js'}"}),
            "nodepath": (["node", "-e", "1"], {"NODE_PATH": str(marks)}),
            "rubyopt": (["perl", "-e", "1"], {"RUBYOPT": "-revil"}),
            "java": (["perl", "-e", "1"], {"JAVA_TOOL_OPTIONS": "-javaagent:/tmp/evil.jar"}),
            "jdk": (["perl", "-e", "1"], {"JDK_JAVA_OPTIONS": "-javaagent:/tmp/evil.jar"}),
            "classpath": (["perl", "-e", "1"], {"CLASSPATH": str(marks)}),
        },
        marks,
    )


def test_git_command_hooks_and_editors(queue_dir, watcher, marks):
    needs("git")
    repo = marks / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    status = ["git", "-C", str(repo), "status"]
    fsmonitor = {
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": "core.fsmonitor",
        "GIT_CONFIG_VALUE_0": f"touch {marks / 'fsmonitor'}; false",
    }
    assert subverted(status, fsmonitor, marks / "fsmonitor")
    remote = ["git", "ls-remote", "ssh://example.invalid/x"]
    assert subverted(remote, {"GIT_SSH_COMMAND": f"touch {marks / 'ssh'}; false"}, marks / "ssh")
    commit = ["git", "-C", str(repo), "-c", "user.name=a", "-c", "user.email=b", "commit", "--allow-empty"]
    assert subverted(commit, {"EDITOR": f"touch {marks / 'editor'}; false"}, marks / "editor")
    refused(
        queue_dir,
        watcher,
        ["git"],
        {
            "fsmonitor": (status, fsmonitor),
            "ssh": (remote, {"GIT_SSH_COMMAND": "touch x"}),
            "gitssh": (remote, {"GIT_SSH": "/tmp/x"}),
            "execpath": (status, {"GIT_EXEC_PATH": str(marks)}),
            "giteditor": (commit, {"GIT_EDITOR": "touch x"}),
            "pager": (status, {"GIT_PAGER": "touch x"}),
            "askpass": (remote, {"GIT_ASKPASS": "/tmp/x"}),
            "gitdir": (status, {"GIT_DIR": str(repo / ".git")}),
            "editor": (commit, {"EDITOR": "touch x"}),
        },
        marks,
    )


def test_every_family_is_refused_and_harmless_names_are_not():
    for family, names in LOADER_FAMILIES.items():
        for name in names:
            assert is_loader_variable(name.replace("*", "X")), (family, name)
    for harmless in (
        "PYTHONUNBUFFERED",
        "OMP_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
        "HF_HOME",
        "MALLOC_ARENA_MAX",
        "GIT_AUTHOR_NAME",
        "TOKENIZERS_PARALLELISM",
        "LANG",
    ):
        assert not is_loader_variable(harmless), harmless


def test_allow_env_turns_the_env_into_an_allowlist(queue_dir, watcher):
    w = watcher(allow_env=["OMP_NUM_THREADS", "HF_*"])
    drop(queue_dir, "ok.yaml", "approved: true\ncommand: ['true']\nenv: {OMP_NUM_THREADS: 1, HF_HOME: /tmp/hf}\n")
    drop(queue_dir, "bad.yaml", "approved: true\ncommand: ['true']\nenv: {OMP_NUM_THREADS: 1, FOO: bar}\n")
    tick_until(w, lambda: (queue_dir / "done" / "ok").exists() and (queue_dir / "failed" / "bad").exists())
    run = json.loads((queue_dir / "failed" / "bad" / "run.json").read_text())
    assert run["status"] == "rejected" and run["errors"][0]["path"] == "env.FOO"
    assert "allow_env" in run["error"] and "OMP_NUM_THREADS, HF_*" in run["error"]


def test_allow_env_in_watcher_yaml(tmp_path: Path):
    from trainq.watcher.spec.config import InvalidWatcherConfig, load_watcher_config

    (tmp_path / "watcher.yaml").write_text("allow_env: [OMP_NUM_THREADS, 'HF_*']\n")
    config = load_watcher_config(tmp_path, {})
    assert config.allow_env == ("OMP_NUM_THREADS", "HF_*")
    assert type(config).from_dict(config.to_dict()) == config
    (tmp_path / "watcher.yaml").write_text("allow_env: OMP_NUM_THREADS\n")
    with pytest.raises(InvalidWatcherConfig, match="allow_env"):
        load_watcher_config(tmp_path, {})
