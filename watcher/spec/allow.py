"""``allow_commands`` as a boundary (CONTRACT section 7): what a command job may start.

After placeholders expand, a command's executable is resolved the way exec would find it (a
path with a slash against the job's cwd; a bare name on the *watcher's* PATH) to a real path,
which must be the real path of an allowed entry (resolved the same way). While the list is set
a job's env may not set the variables that choose what actually runs (LOADER_VARIABLES), so the
program checked is the program started. The check runs at acceptance and again at start, where
the checked real path is what the supervisor execs (``LaunchSpec.executable``).
"""
from __future__ import annotations

import fnmatch
import os
import shutil
from collections.abc import Mapping, Sequence

from trainq.watcher.spec.errors import Problem
from trainq.watcher.spec.jobspec import JobSpec, expand_placeholders
from trainq.watcher.spec.schema_errors import field_name

#: env names a job may not set while allow_commands is set: the executable search path, the dynamic
#: loader's (LD_*, DYLD_*) and the start-up hooks of the usual interpreters, each of which runs code
#: other than the allowed program. PYTHONPATH is among them: it loads sitecustomize.py from anywhere.
#: The watcher's own environment still passes them through (env_passthrough) for the operator.
LOADER_VARIABLES = (
    "PATH", "LD_*", "DYLD_*", "GCONV_PATH", "HOSTALIASES", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP",
    "PYTHONUSERBASE", "PYTHONEXECUTABLE", "BASH_ENV", "ENV", "PERL5LIB", "PERL5OPT", "PERLLIB", "RUBYLIB",
    "RUBYOPT", "NODE_OPTIONS", "NODE_PATH",
)


def is_loader_variable(name: str) -> bool:
    """True for a name in LOADER_VARIABLES (``*`` globs, matched case-sensitively)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in LOADER_VARIABLES)


def resolve_executable(argv0: str, cwd: str, path_env: str | None) -> str | None:
    """The real path exec would run for ``argv0`` (None when nothing executable is found)."""
    if "/" in argv0:
        candidate: str | None = os.path.join(cwd, os.path.expanduser(argv0))
    else:
        candidate = shutil.which(argv0, path=path_env if path_env is not None else os.defpath)
    if not candidate:
        return None
    real = os.path.realpath(candidate)
    return real if os.path.isfile(real) and os.access(real, os.X_OK) else None


def allowed_real_paths(allowed: Sequence[str], path_env: str | None) -> dict[str, str]:
    """Each allowed entry's real path → the entry, resolved on the watcher's PATH (missing ones drop out)."""
    found = {}
    for entry in allowed:
        real = resolve_executable(entry, "/", path_env) if "/" not in entry or os.path.isabs(
            os.path.expanduser(entry)) else None
        if real is not None:
            found.setdefault(real, entry)
    return found


def command_problem(spec: JobSpec, allowed: Sequence[str] | None, values: Mapping[str, str],
                    path_env: str | None) -> Problem | None:
    """Why ``spec`` may not start under ``allowed`` (None: it may).

    Train jobs are always allowed, but their env is held to the same rule (the trainer is python, and
    PYTHONPATH or LD_PRELOAD would run other code in it); an ``on_finish`` hook is held to the list
    like a command (it runs in the job folder).
    """
    if allowed is None:
        return None
    problem = _env_problem(spec)
    if problem is not None:
        return problem
    if spec.command and not spec.is_train:
        problem = _first_word_problem(
            "command", spec.command[0], executable_for(spec, values, path_env), allowed, values, path_env)
        if problem is not None:
            return problem
    hook = getattr(spec, "on_finish", None)
    if hook:
        cwd = values.get("job_dir") or "/"
        real = resolve_executable(expand_placeholders(hook[0], dict(values)), cwd, path_env)
        return _first_word_problem("on_finish", hook[0], real, allowed, values, path_env)
    return None


def hook_executable(argv0: str, job_dir: str, allowed: Sequence[str] | None,
                    path_env: str | None) -> str | Problem | None:
    """For the hook runner, as a hook runs: the checked real path to exec, why it may not run, or None (no list)."""
    if allowed is None:
        return None
    real = resolve_executable(argv0, job_dir, path_env)
    return _first_word_problem("on_finish", argv0, real, allowed, {}, path_env) or real


def _first_word_problem(field: str, written: str, executable: str | None, allowed: Sequence[str],
                        values: Mapping[str, str], path_env: str | None) -> Problem | None:
    if executable is not None and executable in allowed_real_paths(allowed, path_env):
        return None
    argv0 = expand_placeholders(written, dict(values))
    listed = ", ".join(allowed) or "nothing"
    where = f"it resolves to {executable}" if executable else "no such executable was found"
    return Problem(field, f"'{field_name(argv0)}' is not in allow_commands of watcher.yaml (allowed: {listed}); "
                          f"{where}; ask whoever runs the queue to add it, or use an allowed program")


def executable_for(spec: JobSpec, values: Mapping[str, str], path_env: str | None) -> str | None:
    """The real path a command job's first word resolves to, with placeholders and cwd applied."""
    if not spec.command:
        return None
    values = dict(values)
    argv0 = expand_placeholders(spec.command[0], values)
    cwd = spec.launch_cwd(values) or values.get("job_dir") or "/"
    return resolve_executable(argv0, cwd, path_env)


def _env_problem(spec: JobSpec) -> Problem | None:
    refused = [name for name in spec.env if is_loader_variable(name)]
    if not refused:
        return None
    names = ", ".join(field_name(n) for n in refused)
    return Problem(f"env.{field_name(refused[0])}",
                   f"{names} may not be set while watcher.yaml sets allow_commands: they change which program "
                   "runs; set them in the watcher's own environment instead")
