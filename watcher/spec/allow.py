"""``allow_commands`` as a boundary (docs/settings.md): what a command job may start, default-deny.

After placeholders expand, a command's executable is resolved the way exec would find it (a
path with a slash against the job's cwd; a bare name on the *watcher's* PATH) to a real path,
which must be the real path of an allowed entry (resolved the same way). While the list is set:

- a job's ``env`` is an allowlist: ``allow_env`` (watcher.yaml) or, when that is absent,
  DEFAULT_ALLOW_ENV, a short list of knobs that load nothing, whose values must be plain
  (PLAIN_VALUE: no path can hide in them);
- the variables that make an allowed program load or run other code (LOADER_FAMILIES: the search
  path, the dynamic loader, shells' start-up and tracing hooks, the interpreters' start-up options,
  OpenSSL's config, git's command hooks, tar/rsync/pip's options, $SHELL, ...) stay refused even
  when allow_env lists them: a second layer, so a generous allow_env cannot reopen them;
- a job's ``cwd`` must lie, real path against real path, inside the job folder or a folder of
  ``allow_cwd``: a cwd is code too (git reads ``.git/config`` there, and ``core.fsmonitor`` runs a
  command on ``git status``; interpreters import from it).

So the program checked is the program started and nothing else runs in it. The checks run at
acceptance and again at start, where the checked real path is what the supervisor execs
(``LaunchSpec.executable``). ``allow_env`` set without ``allow_commands`` is an allowlist too.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
from collections.abc import Mapping, Sequence

from trainq.watcher.spec.errors import Problem
from trainq.watcher.spec.jobspec import JobSpec, expand_placeholders
from trainq.watcher.spec.schema_errors import field_name

#: env names a job may not set while allow_commands is set, by family (globs; case matters). Each makes
#: an allowed program load or run code other than itself. The watcher's own environment still passes
#: them through (env_passthrough) for the operator. docs/containment.md says why each is here, and why
#: the allocator's MALLOC_* and the like are not (they tune behaviour but load nothing).
LOADER_FAMILIES: dict[str, tuple[str, ...]] = {
    # which program a bare name is, and the dynamic loader: preload, audit and library paths
    "loader": ("PATH", "LD_*", "DYLD_*", "GCONV_PATH", "GLIBC_TUNABLES", "LOCPATH", "NLSPATH", "HOSTALIASES"),
    # shells: exported functions, start-up files, options that turn tracing on and the prompts it expands
    "shell": (
        "BASH_FUNC_*",
        "BASH_ENV",
        "ENV",
        "SHELLOPTS",
        "BASHOPTS",
        "PS0",
        "PS1",
        "PS2",
        "PS3",
        "PS4",
        "PROMPT_COMMAND",
        "BASH_LOADABLES_PATH",
        "ZDOTDIR",
    ),
    # whose start-up files and user site-packages programs read: python's user site (.pth files run
    # code), ~/.gitconfig, ~/.curlrc, ~/.zshenv, ...
    "home": ("HOME", "XDG_CONFIG_HOME", "CURL_HOME", "WGETRC"),
    # OpenSSL loads engines and providers (shared objects) named in its config
    "openssl": ("OPENSSL_CONF", "OPENSSL_CONF_INCLUDE", "OPENSSL_ENGINES", "OPENSSL_MODULES"),
    "python": (
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "PYTHONINSPECT",
        "PYTHONUSERBASE",
        "PYTHONEXECUTABLE",
        "PYTHONPLATLIBDIR",
        "PYTHONBREAKPOINT",
        "PYTHONWARNINGS",
        "PYTHONPYCACHEPREFIX",
    ),
    "perl": ("PERL5OPT", "PERL5LIB", "PERLLIB", "PERL5DB", "PERLIO"),
    "ruby": ("RUBYOPT", "RUBYLIB", "GEM_HOME", "GEM_PATH"),
    "node": ("NODE_OPTIONS", "NODE_PATH", "NODE_REPL_EXTERNAL_MODULE"),
    "java": ("JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "CLASSPATH", "JAVA_HOME"),
    "other interpreters": (
        "LUA_INIT*",
        "LUA_PATH*",
        "LUA_CPATH*",
        "R_PROFILE*",
        "R_ENVIRON*",
        "PHPRC",
        "PHP_INI_SCAN_DIR",
        "JULIA_DEPOT_PATH",
        "JULIA_LOAD_PATH",
        "TCLLIBPATH",
    ),
    # git runs these as commands (ssh, editor, pager, askpass), or reads config/repos that do (core.fsmonitor)
    "git": (
        "GIT_SSH",
        "GIT_SSH_COMMAND",
        "GIT_EXEC_PATH",
        "GIT_EDITOR",
        "GIT_SEQUENCE_EDITOR",
        "GIT_PAGER",
        "GIT_ASKPASS",
        "SSH_ASKPASS",
        "GIT_CONFIG",
        "GIT_CONFIG_*",
        "GIT_DIR",
        "GIT_WORK_TREE",
        "GIT_COMMON_DIR",
        "GIT_TEMPLATE_DIR",
        "GIT_PROXY_COMMAND",
        "GIT_EXTERNAL_DIFF",
    ),
    # commands other programs start: editors, pagers (less runs LESSOPEN), browsers, make's extra makefiles
    "commands": (
        "EDITOR",
        "VISUAL",
        "PAGER",
        "MANPAGER",
        "LESSOPEN",
        "LESSCLOSE",
        "BROWSER",
        "MAKEFLAGS",
        "MFLAGS",
        "GNUMAKEFLAGS",
        "MAKEFILES",
    ),
    # plug-ins loaded as shared objects: CUDA/NVTX injection, MPI components, GL/Vulkan drivers, Kerberos
    "plugins": (
        "CUDA_INJECTION*_PATH",
        "NVTX_INJECTION*_PATH",
        "OMPI_MCA_mca_base_component_path",
        "OMPI_MCA_plm_rsh_agent",
        "LIBGL_DRIVERS_PATH",
        "__EGL_VENDOR_LIBRARY_*",
        "__GLX_VENDOR_LIBRARY_NAME",
        "VK_ICD_FILENAMES",
        "VK_DRIVER_FILES",
        "VK_LAYER_PATH",
        "VK_ADD_LAYER_PATH",
        "GST_PLUGIN_PATH*",
        "GTK_MODULES",
        "GTK_PATH",
        "QT_PLUGIN_PATH",
        "GIO_EXTRA_MODULES",
        "KRB5_CONFIG",
        "SASL_PATH",
    ),
    # programs a script calls that take commands or options from the environment: tar runs
    # --checkpoint-action=exec=CMD from TAR_OPTIONS, rsync runs RSYNC_RSH / RSYNC_CONNECT_PROG, pip reads
    # any option from PIP_* (an index, find-links or a config file: code it then builds), and flock -c,
    # script -c, make's $(shell) and many others run $SHELL
    "tools": ("TAR_OPTIONS", "RSYNC_RSH", "RSYNC_CONNECT_PROG", "PIP_*", "UV_*", "SHELL"),
}
#: every family's names in one tuple
LOADER_VARIABLES = tuple(name for names in LOADER_FAMILIES.values() for name in names)


#: what a job's env may set under allow_commands when watcher.yaml has no allow_env: knobs a training job
#: sets that load nothing and name no file (docs/containment.md says why each is safe, and why HF_HOME,
#: WANDB_DIR, TZ and the like are not here: each is a path some library reads code or config from)
DEFAULT_ALLOW_ENV: tuple[str, ...] = (
    "OMP_NUM_THREADS",  # thread-pool sizes (numbers)
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",  # true/false
    "PYTHONUNBUFFERED",  # interpreter flags read as booleans or numbers; they import nothing
    "PYTHONHASHSEED",
    "PYTHONFAULTHANDLER",
    "HF_HUB_OFFLINE",  # booleans that only forbid network access
    "TRANSFORMERS_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "WANDB_MODE",  # online/offline/disabled
    "CUBLAS_WORKSPACE_CONFIG",  # :4096:8 for deterministic cuBLAS
    "PYTORCH_CUDA_ALLOC_CONF",  # the caching allocator's knobs (expandable_segments:True, ...)
    "LANG",  # locale names (glibc loads a locale from a path when the name starts with '/': PLAIN_VALUE)
    "LANGUAGE",
    "LC_*",
)
#: the values DEFAULT_ALLOW_ENV's names may take: plain words, numbers and lists, no '/' (so no path)
PLAIN_VALUE = re.compile(r"[A-Za-z0-9_.,:@=+-]*")


def effective_allow_env(
    allow_commands: Sequence[str] | None, allow_env: Sequence[str] | None
) -> tuple[str, ...] | None:
    """The env allowlist in force: ``allow_env`` when set, else DEFAULT_ALLOW_ENV under allow_commands, else None."""
    if allow_env is not None:
        return tuple(allow_env)
    return DEFAULT_ALLOW_ENV if allow_commands is not None else None


def is_loader_variable(name: str) -> bool:
    """True for a name in LOADER_VARIABLES (``*`` globs, matched case-sensitively)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in LOADER_VARIABLES)


def is_allowed_env(name: str, allow_env: Sequence[str]) -> bool:
    """True when ``name`` matches a name or glob of watcher.yaml's ``allow_env`` (case matters)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in allow_env)


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
    found: dict[str, str] = {}
    for entry in allowed:
        real = (
            resolve_executable(entry, "/", path_env)
            if "/" not in entry or os.path.isabs(os.path.expanduser(entry))
            else None
        )
        if real is not None:
            found.setdefault(real, entry)
    return found


def command_problem(
    spec: JobSpec,
    allowed: Sequence[str] | None,
    values: Mapping[str, str],
    path_env: str | None,
    allow_env: Sequence[str] | None = None,
    allow_cwd: Sequence[str] | None = None,
) -> Problem | None:
    """Why ``spec`` may not start under ``allowed``, ``allow_env`` and ``allow_cwd`` (None: it may).

    Train jobs are always allowed, but their env and cwd are held to the same rules (the trainer is
    python, and PYTHONPATH or LD_PRELOAD would run other code in it); an ``on_finish`` hook is held to
    the list like a command (it runs in the job folder).
    """
    problem = _env_problem(spec) if allowed is not None else None
    problem = problem or _allow_env_problem(spec, allow_env, effective_allow_env(allowed, allow_env))
    if allowed is None or problem is not None:
        return problem
    problem = cwd_problem(spec, values, allow_cwd)
    if problem is not None:
        return problem
    if spec.command and not spec.is_train:
        problem = _first_word_problem(
            "command", spec.command[0], executable_for(spec, values, path_env), allowed, values, path_env
        )
        if problem is not None:
            return problem
    hook = getattr(spec, "on_finish", None)
    if hook:
        cwd = values.get("job_dir") or "/"
        real = resolve_executable(expand_placeholders(hook[0], dict(values)), cwd, path_env)
        return _first_word_problem("on_finish", hook[0], real, allowed, values, path_env)
    return None


def hook_executable(
    argv0: str, job_dir: str, allowed: Sequence[str] | None, path_env: str | None
) -> str | Problem | None:
    """For the hook runner, as a hook runs: the checked real path to exec, why it may not run, or None (no list)."""
    if allowed is None:
        return None
    real = resolve_executable(argv0, job_dir, path_env)
    return _first_word_problem("on_finish", argv0, real, allowed, {}, path_env) or real


def _first_word_problem(
    field: str,
    written: str,
    executable: str | None,
    allowed: Sequence[str],
    values: Mapping[str, str],
    path_env: str | None,
) -> Problem | None:
    if executable is not None and executable in allowed_real_paths(allowed, path_env):
        return None
    argv0 = expand_placeholders(written, dict(values))
    listed = ", ".join(allowed) or "nothing"
    where = f"it resolves to {executable}" if executable else "no such executable was found"
    return Problem(
        field,
        f"'{field_name(argv0)}' is not in allow_commands of watcher.yaml (allowed: {listed}); "
        f"{where}; ask whoever runs the queue to add it, or use an allowed program",
    )


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
    return Problem(
        f"env.{field_name(refused[0])}",
        f"{names} may not be set while watcher.yaml sets allow_commands: they make an allowed program "
        "load or run other code; set them in the watcher's own environment instead",
    )


def _allow_env_problem(spec: JobSpec, written: Sequence[str] | None, allow_env: Sequence[str] | None) -> Problem | None:
    """Names outside the allowlist; under the default list, also values that are not plain."""
    if allow_env is None:
        return None
    refused = [name for name in spec.env if not is_allowed_env(name, allow_env)]
    listed = ", ".join(allow_env) or "nothing"
    if refused:
        names = ", ".join(field_name(n) for n in refused)
        whose = "watcher.yaml's allow_env lists" if written is not None else "allow_commands' default allow_env lists"
        return Problem(
            f"env.{field_name(refused[0])}",
            f"{names} may not be set: {whose} the only variables a job may set "
            f"(allowed: {listed}); ask whoever runs the queue to add it to allow_env, or drop it from env",
        )
    if written is not None:
        return None
    bent = [name for name, value in spec.env.items() if not PLAIN_VALUE.fullmatch(value)]
    if not bent:
        return None
    return Problem(
        f"env.{field_name(bent[0])}",
        "its value is not plain (letters, digits and _.,:@=+- only, no '/'): "
        "allow_commands' default allow_env takes no paths; ask whoever runs the queue to list it in allow_env",
    )


def cwd_problem(spec: JobSpec, values: Mapping[str, str], allow_cwd: Sequence[str] | None) -> Problem | None:
    """A ``cwd`` whose real path lies outside the job folder and every folder of ``allow_cwd`` (None: inside)."""
    if spec.cwd is None or "job_dir" not in values:
        return None
    cwd = os.path.realpath(spec.launch_cwd(dict(values)) or values["job_dir"])
    folders = [values["job_dir"], *(allow_cwd or ())]
    if any(_is_within(cwd, os.path.realpath(os.path.expanduser(f))) for f in folders):
        return None
    listed = ", ".join(allow_cwd or ()) or "none but the job folder"
    return Problem(
        "cwd",
        f"{field_name(spec.cwd)} resolves to {cwd}, outside the job folder and allow_cwd of watcher.yaml "
        f"(allowed: {listed}): while allow_commands is set a job runs only in folders the queue trusts; "
        "ask whoever runs the queue to add it to allow_cwd, or drop cwd",
    )


def _is_within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")
