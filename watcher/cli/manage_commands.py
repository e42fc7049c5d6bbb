"""The argparse side of the management commands (``rm``, ``edit``, ``priority``, ``pause``, ``resume``,
``clean``, ``wait``, ``show``, ``train``, ``tiny``, ``schema``), global options and shell completion.

main.py keeps the original commands; this module adds the rest so each stays small. What each
command does lives in manage.py and show.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from trainq.watcher.cli import manage

#: options every sub-command also accepts after its name (``trainq status --root X``)
GLOBAL_OPTIONS = ("--root",)


def version() -> str:
    """The installed distribution's version (importlib.metadata), else the package's own."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("trainq")
    except PackageNotFoundError:
        from trainq.watcher import __version__

        return __version__


class _Version(argparse.Action):
    """``--version``: looked up only when asked, so ``trainq --help`` does not pay for it."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"trainq {version()}")
        parser.exit()


def add_global_options(parser: argparse.ArgumentParser, sub: argparse._SubParsersAction) -> None:
    """``--version`` on the main parser; ``--root`` accepted after every command too (added last, so commands
    registered by other modules get it as well)."""
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    for command in set(sub.choices.values()):
        if "--root" not in command._option_string_actions:
            command.add_argument("--root", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def job_ids(prefix: str, parsed_args: argparse.Namespace, **_kw) -> list[str]:
    """Shell completion for job ids: the folder names in the queue root."""
    try:
        root = manage_root(parsed_args)
    except Exception:  # completion must never print a traceback into the shell
        return []
    ids = []
    for state in manage.STATES:
        try:
            ids += [n for n in os.listdir(root / state) if n.startswith(prefix) and not n.startswith(".")]
        except OSError:
            pass
    return sorted(set(ids))


def pool_names(prefix: str, parsed_args: argparse.Namespace, **_kw) -> list[str]:
    """Shell completion for pool names: ``default`` and the pools ROOT/watcher.yaml names now."""
    try:
        from trainq.watcher.cli.submit import pools_now

        pools = pools_now(manage_root(parsed_args)) or {"default": 1}
    except Exception:  # completion must never print a traceback into the shell
        return []
    return sorted(name for name in pools if name.startswith(prefix))


def manage_root(args: argparse.Namespace) -> Path:
    from trainq.watcher.cli.locate import locate_root

    return locate_root(getattr(args, "root", None)).path


def enable_completion(parser: argparse.ArgumentParser) -> None:
    """argcomplete answers the shell's completion request and exits; otherwise (the usual case) nothing happens."""
    if "_ARGCOMPLETE" not in os.environ:
        return  # don't import argcomplete on every command
    import argcomplete

    argcomplete.autocomplete(parser)


def _ids(p: argparse.ArgumentParser, nargs: str | None = None, help: str = "job id") -> None:
    action = p.add_argument("ids" if nargs else "id", nargs=nargs, metavar="ID", help=help)
    action.completer = job_ids  # type: ignore[attr-defined]


def add_commands(sub: argparse._SubParsersAction, root_of: Callable[[argparse.Namespace], Path]) -> None:
    """Register the management commands; ``root_of`` resolves the queue root as main.py does."""

    def bind(fn: Callable[..., int]) -> Callable[[argparse.Namespace], int]:
        def run(args: argparse.Namespace) -> int:
            try:
                return fn(args)
            except manage.UsageError as exc:
                print(f"trainq: {exc}", file=sys.stderr)
                return manage.EXIT_INVALID

        return run

    p = sub.add_parser("show", help="a job's run.json in words: attempts, diagnosis with evidence, progress, paths")
    _ids(p)
    p.add_argument("--json", action="store_true", help="print run.json as it is")
    p.set_defaults(func=bind(lambda a: _show(root_of(a), a.id, a.json)))

    p = sub.add_parser(
        "rm", help="remove jobs (or a sweep's jobs): pending or finished at once; running ones are stopped first"
    )
    _ids(p, "+", help="job ids (or names), or a sweep id for every job of that sweep")
    p.add_argument("--now", action="store_true", help="stop running jobs without their stop grace")
    p.add_argument(
        "-f",
        "--force",
        action="store_true",
        help="remove a running job that can resume (train job, resume_args) without asking",
    )
    p.set_defaults(func=bind(lambda a: manage.rm(root_of(a), a.ids, now=a.now, force=a.force)))

    p = sub.add_parser(
        "edit",
        help="edit a job's job.yaml in $EDITOR, validated before it is used: a pending job's "
        "is replaced; a failed/cancelled one runs again under the same id (resuming where it can); "
        "a rejected one is fixed in place and runs under its id",
    )
    _ids(p)
    p.set_defaults(func=bind(lambda a: _edit(root_of(a), a.id)))

    p = sub.add_parser("priority", help="set a pending job's priority (rewrites priority: in its job.yaml)")
    _ids(p)
    p.add_argument("value", type=int, metavar="N", help="higher starts first")
    p.set_defaults(func=bind(lambda a: _edit_with(lambda: _edit_module().priority(root_of(a), a.id, a.value))))

    p = sub.add_parser("pause", help="start no new job (creates pause.flag); running jobs go on")
    pool = p.add_argument(
        "--pool", metavar="P", help="pause only pool P, one watcher.yaml names (creates pause.P.flag)"
    )
    pool.completer = pool_names
    p.set_defaults(func=bind(lambda a: manage.pause(root_of(a), a.pool)))
    p = sub.add_parser("resume", help="start jobs again (removes pause.flag)")
    pool = p.add_argument("--pool", metavar="P", help="resume only pool P (removes pause.P.flag)")
    pool.completer = pool_names
    p.set_defaults(func=bind(lambda a: manage.resume(root_of(a), a.pool)))

    p = sub.add_parser("clean", help="remove finished job folders (done/ and failed/, or only the ids named)")
    _ids(p, "*", help="only these finished jobs (default: every finished job that matches the options)")
    p.add_argument("--done", action="store_true", help="only done/")
    p.add_argument("--failed", action="store_true", help="only failed/ (failed, cancelled, timeout, rejected)")
    p.add_argument("--older-than", metavar="AGE", help="only jobs finished longer ago than AGE (90s, 12h, 7d)")
    p.add_argument("-n", "--dry-run", action="store_true", help="list what would go; remove nothing")
    p.set_defaults(
        func=bind(lambda a: manage.clean(root_of(a), a.done, a.failed, _age_s(a.older_than), a.dry_run, ids=a.ids))
    )

    p = sub.add_parser("wait", help="wait until jobs finish; exit with the first failed job's exit status")
    _ids(p, "+")
    p.add_argument("--timeout", metavar="AGE", help="give up after AGE (exit 124)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    p.set_defaults(func=bind(lambda a: manage.wait(root_of(a), a.ids, _age_s(a.timeout), a.quiet)))

    p = sub.add_parser(
        "train", help="run the built-in trainer on a folder holding a job.yaml (python -m trainq.trainer)"
    )
    p.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        metavar="JOB_DIR [--resume-from DIR]",
        help="the job folder (holding job.yaml) and the trainer's own options",
    )
    p.set_defaults(func=lambda a: manage.run_module("trainq.trainer", a.args))

    p = sub.add_parser(
        "tiny", help="build a tiny model and data in DIR for trying trainq (python -m trainq.trainer.tiny)"
    )
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="DIR", help="where to build the model and data")
    p.set_defaults(func=lambda a: manage.run_module("trainq.trainer.tiny", a.args))

    p = sub.add_parser("schema", help="print the absolute path of a JSON Schema (for an editor's $schema line)")
    p.add_argument(
        "name",
        nargs="?",
        default="job",
        choices=("job", "train", "run", "status", "watcher"),
        help="which schema (default: job)",
    )
    p.add_argument("--path", action="store_true", help="print the path (the default)")
    p.set_defaults(func=lambda a: _schema(a.name))


#: commands that hand every argument after them to a trainer module (``trainq train --help`` is the trainer's help)
TRAINER_COMMANDS = {"train": "trainq.trainer", "tiny": "trainq.trainer.tiny", "preview": "trainq.trainer.preview"}


def run_trainer_command(argv: list[str]) -> int | None:
    """``trainq [--root R] train|tiny|preview ARGS…``: run the trainer module with ARGS (never returns); None otherwise."""
    rest = list(argv)
    while rest and (rest[0] == "--root" or rest[0].startswith("--root=")):
        rest = rest[2:] if rest[0] == "--root" else rest[1:]  # the trainer needs no queue root
    if not rest or rest[0] not in TRAINER_COMMANDS:
        return None
    return manage.run_module(TRAINER_COMMANDS[rest[0]], rest[1:], prog=f"trainq {rest[0]}")


def _age_s(text: str | None) -> float | None:
    """``7d``, ``12h``, ``90s``, ``90`` → seconds (days added to the job file's duration units)."""
    if text is None:
        return None
    from trainq.watcher.spec.units import parse_duration_s

    stripped = text.strip()
    try:
        if stripped.endswith("d"):
            return float(stripped[:-1]) * 86400
        return parse_duration_s(stripped)
    except ValueError:
        raise manage.UsageError(f"{text!r}: expected an age such as 90s, 10m, 12h or 7d") from None


def _show(root: Path, job_id: str, as_json: bool) -> int:
    from trainq.watcher.cli.show import show_lines
    from trainq.watcher.cli.why import removed_lines
    from trainq.watcher.spec.contract import JobPaths

    gone = removed_lines(root, job_id) if manage.find_job(root, job_id) is None else None
    if gone is not None and not as_json:
        print("\n".join(gone))
        return manage.EXIT_OK
    found = manage.require_job(root, job_id)
    if as_json:
        sys.stdout.write(JobPaths(found.path).run.read_text(encoding="utf-8"))
        return manage.EXIT_OK
    from trainq.watcher.spec.text import printable

    print("\n".join(printable(line) for line in show_lines(root, found)))  # evidence is the job's own output
    return manage.EXIT_OK


def _edit_with(action: Callable[[], int]) -> int:
    from trainq.watcher.spec.errors import InvalidJobSpec

    try:
        return action()
    except InvalidJobSpec as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        print("trainq: nothing changed", file=sys.stderr)
        return manage.EXIT_INVALID


def _edit_module():
    from trainq.watcher.cli import edit

    return edit


def _edit(root: Path, job_id: str) -> int:
    return _edit_with(lambda: _edit_module().edit(root, job_id))


def _schema(name: str) -> int:
    from trainq.watcher.spec.jobspec import SCHEMAS_DIR

    print((Path(SCHEMAS_DIR) / f"{name}.schema.json").resolve())
    return manage.EXIT_OK
