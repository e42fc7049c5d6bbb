"""The interpreter a job gets: the watcher's own ``python`` comes first on every job's PATH.

A job file says ``command: [python, train.py]``; which ``python`` is that? The answer is fixed and
documented: the folder of the interpreter running the watcher (its venv's ``bin/``, which holds
``python``, ``python3`` and ``trainq``) is put first on the job's PATH, so a bare ``python`` is the
one trainq and its training stack are installed in, however the watcher was started
(``.venv/bin/trainq watch &`` without activating the venv included). A job that sets ``PATH`` in
its ``env:`` keeps its own. An absolute path (``/opt/conda/bin/python``) always runs that one.
"""

from __future__ import annotations

import functools
import os
import sys


def interpreter_dir(python: str | None = None) -> str:
    """The folder of the watcher's interpreter (not resolved: a venv's ``bin/`` holds links to the base Python)."""
    return os.path.dirname(os.path.abspath(python or sys.executable))


@functools.lru_cache(maxsize=16)
def job_path(path_env: str | None, python: str | None = None) -> str:
    """The PATH a job gets: the watcher's interpreter folder first, then ``path_env`` (without a repeat of it).

    Kept per (PATH, interpreter): the watcher asks two to four times a launch, with the same PATH every time."""
    first = interpreter_dir(python)
    rest = [p for p in (path_env if path_env is not None else os.defpath).split(os.pathsep) if p and p != first]
    return os.pathsep.join([first, *rest])


def resolved_program(argv0: str, path_env: str, cwd: str) -> str | None:
    """What ``argv0`` runs as, on ``path_env`` (a path with a slash: against ``cwd``); None if not found."""
    if os.sep in argv0:
        return os.path.normpath(os.path.join(cwd, argv0))
    return _which(argv0, path_env)


def _which(name: str, path_env: str) -> str | None:
    """``shutil.which(name, path=path_env)`` on POSIX: the first executable non-folder ``name`` on the PATH. A
    missing candidate costs one ``access``, where ``which`` raised and caught an OSError for each (eight of
    them for ``true`` here, at every launch)."""
    seen = set()
    for folder in path_env.split(os.pathsep) if path_env else ():
        if folder in seen:
            continue
        seen.add(folder)
        candidate = os.path.join(folder, name)
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate
    return None


#: Python 3.10 has no ``-P``: this bootstrap drops the script folder (``''``, the cwd) from sys.path, then runs
#: the module as ``-m`` would
SAFE_BOOT = "import runpy,sys;del sys.path[0];runpy.run_module(sys.argv.pop(1),run_name='__main__',alter_sys=True)"


def safe_module_argv(python: str, module: str) -> list[str]:
    """``python -m module`` without the current folder on sys.path (``-P``; docs/containment.md).

    ``python -m`` puts the cwd first on sys.path, so a job's cwd holding an ``argparse.py`` would run in
    every Python process trainq starts there. ``python`` is the watcher's interpreter (same version).
    """
    if sys.version_info >= (3, 11):
        return [python, "-P", "-m", module]
    return [python, "-c", SAFE_BOOT, module]
