"""What can be known before a run, refused at submit (docs/cli.md, "Submitting").

``trainq validate``, ``trainq submit`` and the watcher's acceptance all call ``check_knowable``: a
missing model, data file, ``init_from``, ``cwd`` or script; an unknown ``pool``; shell syntax in a
command given as one string. Relative paths resolve against ``submitted_from`` (the folder the file was
submitted from, else the queue root). A path that holds a placeholder (``{job_dir}``, ``{after:ID}``, a
sweep's ``{lr}``) is not known before the run and is never refused. Each problem is one line naming the
field; a missing file's line offers the closest name in its folder ("did you mean").
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
from pathlib import Path

from trainq.watcher.spec.config import unknown_pool_words
from trainq.watcher.spec.errors import InvalidJobSpec, Problem
from trainq.watcher.spec.jobspec import JobSpec

#: a placeholder of any kind: the job's own, ``{after:ID}``, or a sweep key
_PLACEHOLDER = re.compile(r"\{[^{}\s]+\}")
#: interpreters whose first plain argument is a script file, by family (the name without a version)
_INTERPRETER = re.compile(r"^(?P<name>python|pypy|bash|sh|dash|zsh|ksh|node|Rscript|perl|ruby)[0-9.]*$")
#: per family: options after which no script follows (code on the command line), options that take a value
_NO_SCRIPT = {
    "python": {"-c", "-m", "-"},
    "pypy": {"-c", "-m", "-"},
    "shell": {"-c", "-s", "-"},
    "node": {"-e", "-p", "--eval", "--print", "-"},
    "Rscript": {"-e"},
    "perl": {"-e", "-E", "-"},
    "ruby": {"-e", "-"},
}
_TAKES_VALUE = {
    "python": {"-W", "-X", "--check-hash-based-pycs"},
    "pypy": {"-W", "-X"},
    "shell": {"-o", "+o", "-O", "+O"},
    "node": {"-r", "--require", "--import", "--loader"},
}
_SHELLS = {"bash", "sh", "dash", "zsh", "ksh"}
#: what a shell would treat specially outside quotes, and (``$``, backtick) inside double quotes
_SHELL_OPERATORS = "|><;&"
_SHELL_EXPANSIONS = "$`"


def check_knowable(
    spec: JobSpec, display: str, base: Path | str, pools: dict[str, int] | None = None, job_dir: str | None = None
) -> None:
    """Raise InvalidJobSpec listing what a run would find wrong and the file already shows.

    ``base``: where relative paths resolve when the file names no ``submitted_from``. ``pools``: the
    pools watcher.yaml names now (None: not checked). ``job_dir``: the job's folder, or where it will be
    (``ROOT/pending/<id>``: its depth is every state's), where a job without ``cwd`` runs and the trainer
    looks last; None when no queue is known.
    """
    problems = knowable_problems(spec, base, pools, job_dir)
    if problems:
        raise InvalidJobSpec(display, problems)


def knowable_problems(
    spec: JobSpec, base: Path | str, pools: dict[str, int] | None = None, job_dir: str | None = None
) -> list[Problem]:
    """Every problem ``check_knowable`` raises, in field order; a sweep's variants are checked one by one."""
    found: list[Problem] = []
    shell = shell_syntax_problem(spec.raw.get("command"))
    if shell is not None:
        found.append(shell)
    if pools is not None:
        words = unknown_pool_words(spec.pool, pools)
        if words is not None:
            found.append(Problem("pool", words + "; fix pool: or add the pool to watcher.yaml pools:"))
    for variant in _variants(spec):
        for problem in path_problems(variant, base, job_dir):
            if problem not in found:
                found.append(problem)
    return found


#: the largest sweep whose jobs are checked one by one (each is validated: ~ms); a bigger one is checked as
#: written, its placeholders unexpanded (never refused)
MAX_VARIANTS_CHECKED = 100


def _variants(spec: JobSpec) -> list[JobSpec]:
    """The spec itself, or each job of its sweep (their dotted keys may change train paths)."""
    if not spec.sweep:
        return [spec]
    from trainq.watcher.spec.sweeps import combinations, expand

    if combinations(spec.sweep) > MAX_VARIANTS_CHECKED:
        return [spec]

    out = []
    for variant in expand(spec.raw):
        try:
            out.append(JobSpec.from_dict(variant.data))
        except InvalidJobSpec:
            continue  # the sweep's own validation reports it
    return out or [spec]


def base_of(spec: JobSpec, default: Path | str) -> str:
    """The folder relative paths resolve against: the file's ``submitted_from``, else ``default``."""
    return spec.submitted_from or os.path.abspath(default)


def path_problems(spec: JobSpec, base: Path | str, job_dir: str | None = None) -> list[Problem]:
    """Missing ``cwd``, script, ``train.model``, data files, ``init_from`` and the trainer's other files."""
    root = base_of(spec, base)
    problems: list[Problem] = []
    cwd = None if _has_placeholder(spec.cwd or "") else _cwd(spec, root)
    if cwd is not None and not os.path.isdir(cwd):
        problems.append(_missing("cwd", spec.cwd or "", cwd, "folder"))
        return problems  # every relative path below would be reported again against a folder that is not there
    if spec.is_train:  # the trainer looks in cwd, then submitted_from, then the job folder (trainer/config.py)
        problems += _train_problems(spec.train or {}, [p for p in (cwd, root, job_dir) if p], job_dir)
    elif spec.command and not _has_placeholder(spec.cwd or ""):
        problem = _script_problem(list(spec.command), cwd or job_dir, spec)
        if problem is not None:
            problems.append(problem)
    return problems


def _cwd(spec: JobSpec, root: str) -> str | None:
    if spec.cwd is None:
        return None
    cwd = os.path.expanduser(spec.cwd)
    return os.path.normpath(os.path.join(root, cwd))


# -- commands --


def script_of(argv: list[str]) -> tuple[int, str] | None:
    """(index, path) of what must exist for ``argv`` to run: a path-like program, or an interpreter's script."""
    if not argv:
        return None
    if "/" in argv[0]:
        return 0, argv[0]
    match = _INTERPRETER.match(os.path.basename(argv[0]))
    if not match:
        return None
    family = "shell" if match["name"] in _SHELLS else match["name"]
    stop, takes = _NO_SCRIPT.get(family, set()), _TAKES_VALUE.get(family, set())
    letters = {o[1] for o in stop if len(o) == 2 and o[0] == "-" and o[1].isalpha()}
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg in stop:
            return None
        if arg.startswith("-") and not arg.startswith("--") and letters & set(arg[1:]):
            return None  # a cluster such as bash -lc or python -uc: code, not a script (never refuse on a guess)
        if arg == "--":
            return (i + 1, argv[i + 1]) if i + 1 < len(argv) else None
        if arg.startswith(("-", "+")) and len(arg) > 1:
            i += 2 if arg in takes else 1
            continue
        return i, arg
    return None


def _script_problem(argv: list[str], run_dir: str | None, spec: JobSpec) -> Problem | None:
    found = script_of(argv)
    if found is None:
        return None
    index, script = found
    if _has_placeholder(script):
        return None
    field = f"command[{index}]" if isinstance(spec.raw.get("command"), list) else "command"
    path = os.path.expanduser(script)
    if os.path.isabs(path):
        return None if os.path.exists(path) else _missing(field, script, path, "file")
    if index > 0 and "/" not in script and os.path.basename(argv[0]) in _SHELLS and shutil.which(script):
        return None  # a shell looks a bare script name up on PATH too
    full = os.path.normpath(os.path.join(run_dir, path)) if run_dir is not None else None
    if spec.cwd is None and (full is None or full.startswith(os.path.join(run_dir or "", ""))):
        return Problem(
            field,
            f"{script}: a relative path, and the job sets no cwd, so it would run in its own new job folder, "
            "which holds no such file; set cwd: to the folder that holds it (or give an absolute path)",
        )
    return None if full is None or os.path.exists(full) else _missing(field, script, full, "file")


def shell_syntax_problem(command: object) -> Problem | None:
    """A command given as one string that holds shell syntax: trainq runs no shell, so say how to ask for one."""
    if not isinstance(command, str):
        return None
    found = shell_syntax(command)
    if not found:
        return None
    shown = json.dumps(command, ensure_ascii=False)
    return Problem(
        "command",
        f"{shown} holds shell syntax ({' '.join(found)}), but trainq runs a command without a shell, so "
        f"{found[0]} would reach the program as a plain argument; to run it through a shell write "
        f"command: [sh, -c, {shown}]",
    )


def shell_syntax(text: str) -> list[str]:
    """The shell operators and expansions ``text`` uses outside single quotes, in order, each once."""
    found: list[str] = []
    quote = None
    i = 0
    while i < len(text):
        ch = text[i]
        if quote == "'":
            quote = None if ch == "'" else quote
        elif ch == "\\":
            i += 1  # the next character is literal (outside quotes and inside double quotes alike)
        elif quote == '"':
            if ch == '"':
                quote = None
            elif ch in _SHELL_EXPANSIONS:
                _note(found, "`" if ch == "`" else "$")
        elif ch in "'\"":
            quote = ch
        elif ch in _SHELL_EXPANSIONS:
            _note(found, "`" if ch == "`" else "$")
        elif ch in _SHELL_OPERATORS:
            op = text[i : i + 2] if text[i : i + 2] in ("&&", "||", ">>", "<<") else ch
            _note(found, op)
            i += len(op) - 1
        i += 1
    return found


def _note(found: list[str], word: str) -> None:
    if word not in found:
        found.append(word)


# -- train jobs --


def _train_problems(train: dict, bases: list[str], job_dir: str | None) -> list[Problem]:
    problems = []
    for field, value, kind in _train_paths(train):
        if not isinstance(value, str) or _has_placeholder(value):
            continue
        problem = _resolved_problem(field, value, bases, kind, job_dir)
        if problem is not None:
            problems.append(problem)
    return problems


def _train_paths(train: dict) -> list[tuple[str, object, str]]:
    """(field, path, "file"|"folder") of every local path the trainer opens."""
    paths: list[tuple[str, object, str]] = [("train.model", train.get("model"), "folder")]
    data = train.get("data")
    if isinstance(data, dict):
        sources = data.get("train")
        items = sources if isinstance(sources, list) else [sources]
        for i, item in enumerate(items):
            path = item.get("path") if isinstance(item, dict) else item
            field = f"train.data.train[{i}]" if isinstance(sources, list) else "train.data.train"
            paths.append((field + (".path" if isinstance(item, dict) else ""), path, "file"))
        paths.append(("train.data.eval", data.get("eval"), "file"))
    else:
        paths.append(("train.data", data, "file"))
    paths.append(("train.init_from", train.get("init_from"), "folder"))
    paths.append(("train.chat_template", train.get("chat_template"), "file"))
    samples = train.get("eval_samples")
    if isinstance(samples, dict):
        paths.append(("train.eval_samples.prompts", samples.get("prompts"), "file"))
    return paths


def _resolved_problem(
    field: str, value: str, bases: list[str], kind: str, job_dir: str | None = None
) -> Problem | None:
    """None when ``value`` (absolute, or relative to the first base that holds it) exists as a ``kind``.

    Against the job folder only paths that leave it count (``../../demo/model``): nothing is inside it yet.
    """
    path = os.path.expanduser(value)
    candidates = [path] if os.path.isabs(path) else [os.path.normpath(os.path.join(b, path)) for b in bases]
    inside = os.path.join(job_dir, "") if job_dir else None
    candidates = list(dict.fromkeys(c for c in candidates if not (inside and c.startswith(inside)))) or candidates
    check = os.path.isdir if kind == "folder" else os.path.isfile
    if any(check(c) for c in candidates):
        return None
    if any(os.path.exists(c) for c in candidates):
        other = "a file" if kind == "folder" else "a folder"
        return Problem(field, f"{value}: is {other}, not a {kind} ({candidates[0]})")
    return _missing(field, value, candidates, kind)


def _missing(field: str, value: str, full: str | list[str], kind: str) -> Problem:
    """``FIELD: VALUE: no such file (FULL); did you mean NAME?`` with the nearest name in its folder."""
    looked = [full] if isinstance(full, str) else full
    where = f" ({' nor '.join(looked)})" if looked != [value] else ""
    guess = next((g for g in map(did_you_mean, looked) if g), None)
    hint = f"; did you mean {os.path.join(os.path.dirname(value.rstrip('/')), guess)}?" if guess else ""
    return Problem(field, f"{value}: no such {kind}{where}{hint}")


def did_you_mean(full: str) -> str | None:
    """The name in ``full``'s folder closest to its last part (as it would be written in its place), or None."""
    folder, name = os.path.split(full.rstrip("/"))
    try:
        names = [n for n in os.listdir(folder or ".") if not n.startswith(".")]
    except OSError:
        return None
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return close[0] if close else None


def _has_placeholder(text: str) -> bool:
    return bool(_PLACEHOLDER.search(text))
