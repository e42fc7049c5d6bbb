# PYTHON_ARGCOMPLETE_OK  (argcomplete: `eval "$(register-python-argcomplete trainq)"` turns on completion)
"""``trainq``: a thin command line over the queue's files (argparse, logging set-up, env, exit codes).

Every command does what a user could do by hand with an editor, ``cp``, ``touch`` and ``cat``;
there is no second path into the queue. Heavy modules are imported inside the commands so
``trainq --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from trainq.watcher.cli.job_commands import add_job_commands
from trainq.watcher.cli.locate import BadUserConfig, RootNotFound, locate_root
from trainq.watcher.cli.manage import UsageError
from trainq.watcher.cli.manage_commands import add_commands, add_global_options, enable_completion, run_trainer_command
from trainq.watcher.cli.records import add_record_commands
from trainq.watcher.cli.serve import add_serve_command
from trainq.watcher.cli.submit_command import add_command_options, split_submit_command
from trainq.watcher.spec.text import PrintableFormatter

#: exit status for success, for invalid input (a bad job file, an unknown id), and for anything else
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INVALID = 2

logger = logging.getLogger("trainq.watcher")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``trainq`` console script and ``python -m trainq.watcher``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passed = run_trainer_command(argv)
    if passed is not None:
        return passed
    parser = _parser()
    enable_completion(parser)
    argv, command_argv = split_submit_command(argv)
    args = parser.parse_args(argv)
    args.command_argv = command_argv
    if not getattr(args, "func", None):
        _parser().print_help()
        return EXIT_INVALID
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return EXIT_ERROR
    except BrokenPipeError:
        return EXIT_OK
    except (RootNotFound, BadUserConfig, UsageError) as exc:  # UsageError: e.g. a name several jobs carry
        return _fail(str(exc), EXIT_INVALID)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainq",
        description="A training-job queue driven by files. Drop job YAML files into QUEUE/inbox/; "
        "read QUEUE/status.json. Every command here is a convenience over those files.",
    )
    parser.add_argument(
        "--root",
        help="queue root (default: $TRAINQ_ROOT, else ./queue, else root: in "
        "~/.config/trainq/config.yaml); accepted after the command too",
    )
    sub = parser.add_subparsers(metavar="COMMAND")

    p = sub.add_parser("init", help="create a queue root with its five folders")
    p.add_argument("dir", nargs="?", help="where (default: the --root, $TRAINQ_ROOT or ./queue)")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("watch", help="run the watcher on the queue root (foreground)")
    p.add_argument("--once", action="store_true", help="run one pass (tick) and exit")
    p.add_argument(
        "--until-idle",
        action="store_true",
        help="exit once nothing is pending, running or waiting in the inbox (demos, scripts)",
    )
    p.add_argument("--polling", action="store_true", help="poll instead of inotify (network filesystems)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("-q", "--quiet", action="store_true", help="log only to watcher.log")
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("demo", help="build a tiny model, run the example LoRA job through the queue, show the results")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("validate", help="check job files; print every problem (exit 2 if any)")
    p.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="job files; relative paths in each resolve against its folder, as trainq submit FILE would",
    )
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "submit",
        help="validate a job file and drop a copy into the inbox atomically; "
        "or `submit [OPTIONS] -- CMD ARGS...`: a command job written for you",
        usage="trainq submit FILE [--approve] [--debug] [--parsable]\n"
        "       trainq submit [--name N] [--priority P] [--after ID] [--gpus G] [--ram 8G] "
        "[--timeout 2h] [--pool P] [--cwd DIR] [--env K=V]... [--parsable] -- CMD ARGS...",
    )
    p.add_argument(
        "file",
        metavar="FILE",
        nargs="?",
        help="a job file (its relative paths resolve against its folder); or give a command after --",
    )
    add_command_options(p)
    p.add_argument("--approve", action="store_true", help="submit it with approved: true")
    p.add_argument(
        "--debug",
        action="store_true",
        help="submit a train job with debug: true added (a short smoke run before the real one)",
    )
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="show the queue (from status.json), one line a job")
    p.add_argument("pattern", nargs="?", metavar="GLOB", help="only jobs whose id or name matches (e.g. 'lora-*')")
    p.add_argument("--json", action="store_true", help="print status.json as it is")
    p.add_argument("--follow", "-f", action="store_true", help="redraw until Ctrl-C, fitted to the terminal")
    p.add_argument("--wide", "-w", action="store_true", help="every column, with advice and full evidence")
    p.add_argument(
        "--state",
        metavar="STATE[,STATE]",
        help="only these states or statuses (running, pending, "
        "awaiting, done, failed, cancelled, timeout, rejected, stopping)",
    )
    p.add_argument("--sweep", metavar="ID", help="only the jobs of this sweep")
    p.set_defaults(func=cmd_status)
    add_job_commands(sub, _root, _id_argument)

    p = sub.add_parser("why", help="say where a job is and why: every gate that holds it, or how it failed")
    _id_argument(p)
    p.add_argument(
        "--stack",
        action="store_true",
        help="a running job: record its processes' Python stacks (py-spy) into stacks/ and show the main thread",
    )
    p.set_defaults(func=cmd_why)

    p = sub.add_parser("fork", help="write a new job file into the inbox: ID's job.yaml with changes and fork_of: ID")
    _id_argument(p)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change a field (train.lr=2e-4)")
    p.add_argument("--from-checkpoint", action="store_true", help="start from ID's latest checkpoint (command jobs)")
    p.set_defaults(func=cmd_fork)
    p = sub.add_parser("history", help="every finished job (history.jsonl, kept by the watcher), oldest first")
    p.add_argument("pattern", nargs="?", metavar="GLOB", help="only jobs whose id or name matches (e.g. 'lora-*')")
    p.add_argument("--state", metavar="S[,S]", help="only these: done, failed, cancelled, timeout, rejected, removed")
    p.add_argument("--since", metavar="T", help="only jobs finished since T: an ISO date/time or an age (12h, 7d)")
    p.add_argument("--kind", metavar="K", help="only this job type (train, command) or diagnosis kind (oom, nan, ...)")
    p.add_argument("--sweep", metavar="ID", help="only the jobs of this sweep")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", dest="fmt", action="store_const", const="json", help="a JSON list of records")
    fmt.add_argument("--csv", dest="fmt", action="store_const", const="csv", help="CSV with a header line")
    p.set_defaults(func=cmd_history, fmt="table")
    p = sub.add_parser("plot", help="one PNG of several jobs' loss curves overlaid (a sweep id: its jobs)")
    p.add_argument("ids", nargs="+", metavar="ID", help="job ids (or names), or a sweep id")
    p.add_argument("-o", "--output", type=Path, metavar="FILE", help="where to write it (default: ID-loss.png here)")
    p.set_defaults(func=cmd_plot)
    add_commands(sub, _root)
    add_serve_command(sub, _root)
    add_record_commands(sub, _root)
    add_global_options(parser, sub)
    return parser


def _id_argument(p: argparse.ArgumentParser, help: str = "a job id (or a job's name, when one job has it)") -> None:
    """The ID argument of a command, with shell completion of the ids in the queue."""
    from trainq.watcher.cli.manage_commands import job_ids

    p.add_argument("id", metavar="ID", help=help).completer = job_ids  # type: ignore[attr-defined]


def _root(args: argparse.Namespace, must_exist: bool = True) -> Path:
    """--root, else $TRAINQ_ROOT, else ./queue, else the user config's root (locate.py); RootNotFound if none."""
    return locate_root(args.root, must_exist=must_exist).path


def _root_or_none(args: argparse.Namespace) -> Path | None:
    """The queue root when there is one (for its watcher.yaml), else None."""
    try:
        return _root(args)
    except (RootNotFound, BadUserConfig):
        return None


def _fail(message: str, code: int = EXIT_ERROR) -> int:
    print(f"trainq: {message}", file=sys.stderr)
    return code


# -- commands --------------------------------------------------------------------------------
def cmd_init(args: argparse.Namespace) -> int:
    from trainq.watcher.cli.manage import write_schemas
    from trainq.watcher.spec.errors import QueueLayoutError
    from trainq.watcher.spec.folders import QueueRoot

    root = QueueRoot(Path(args.dir) if args.dir else _root(args, must_exist=False))
    try:
        created = root.ensure_layout(create=True)
    except QueueLayoutError as exc:
        return _fail(str(exc))
    for folder in root.folders():
        (folder / ".gitkeep").touch(exist_ok=True)
    schemas = write_schemas(root.path)
    print(
        f"{root.path}: queue ready ({len(created)} folder(s) created; JSON Schemas in {schemas}/). "
        f"Drop job files into {root.inbox}/"
    )
    return EXIT_OK


def cmd_watch(args: argparse.Namespace) -> int:
    from trainq.watcher.spec.config import load_watcher_config
    from trainq.watcher.spec.errors import InvalidJobSpec

    root = _root(args)
    if not root.is_dir():
        return _fail(f"{root}: no queue here; create one with `trainq init {root}`")
    try:
        config = load_watcher_config(root, os.environ)
    except InvalidJobSpec as exc:
        for line in exc.lines():
            print(f"trainq: {root / line}" if not line.startswith("/") else f"trainq: {line}", file=sys.stderr)
        return EXIT_INVALID
    close_log = _setup_logging(root / "watcher.log", verbose=args.verbose, quiet=args.quiet)
    try:
        return _watch(root, config, args)
    finally:
        close_log()


def _watch(root: Path, config, args: argparse.Namespace) -> int:
    from trainq.watcher.daemon.daemon import Watcher
    from trainq.watcher.spec.errors import WatcherError

    try:
        watcher = Watcher(root, config, polling=args.polling)
        watcher.start()
    except WatcherError as exc:
        logger.error("%s", exc)
        return EXIT_ERROR
    try:
        if args.once:
            watcher.tick(time.time())
        elif args.until_idle:
            _run_until_idle(watcher)
        else:
            watcher.run()
    finally:
        watcher.close()
    return EXIT_OK


def _run_until_idle(watcher) -> None:
    """Tick until no job is pending or running and the inbox holds nothing ready to take."""
    while not watcher._should_exit():
        now = time.time()
        watcher.tick(now)
        if not len(watcher.jobs) and watcher.report.inbox_count == len(watcher.report.awaiting_entries):
            return
        watcher._wait(watcher._next_wait_s())


def _setup_logging(log_file: Path, verbose: bool, quiet: bool) -> Callable[[], None]:
    """watcher.log (and stderr unless quiet), written as each line is logged; returns what closes them.

    No queue and no thread: a 10,000-file burst logs 10,000 lines, and handing each to a writer
    thread cost more (thread wake-ups, the GIL passed back and forth) than the write itself.
    """
    fmt = PrintableFormatter("%(asctime)s %(levelname)s %(message)s")
    # a record needs its time, level and message: no caller's frame walk, thread, process or multiprocessing name
    # (a third of the cost of each of a job's three lines)
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None  # logging's own switch ("set _srcfile to None")
    handlers: list[logging.Handler] = [logging.FileHandler(log_file, encoding="utf-8")]
    if not quiet:
        handlers.append(logging.StreamHandler(sys.stderr))
    watcher_logger = logging.getLogger("trainq.watcher")
    watcher_logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    for handler in handlers:
        handler.setFormatter(fmt)
        watcher_logger.addHandler(handler)

    def close() -> None:
        for handler in handlers:
            watcher_logger.removeHandler(handler)
            handler.close()

    return close


def cmd_demo(args: argparse.Namespace) -> int:
    from trainq.watcher.cli.demo import run_demo

    return run_demo(_root(args, must_exist=False))


def cmd_validate(args: argparse.Namespace) -> int:
    from trainq.watcher.cli.submit import check_before_submit, submit_base
    from trainq.watcher.spec.errors import InvalidJobSpec
    from trainq.watcher.spec.folders import id_from_name
    from trainq.watcher.spec.jobspec import load_job_file

    root = _root_or_none(args)  # its watcher.yaml names the pools; validating needs no queue otherwise
    worst = EXIT_OK
    for name in args.files:
        try:
            spec = load_job_file(Path(name), name)
            check_before_submit(spec, name, submit_base(Path(name)), root, time.time(), id_from_name(Path(name).name))
        except InvalidJobSpec as exc:
            for line in exc.lines():
                print(line)
            worst = EXIT_INVALID
            continue
        except OSError as exc:
            print(f"{name}: cannot read ({exc.strerror})")
            worst = EXIT_INVALID
            continue
        state = (
            "approved" if spec.approved else f"valid, awaiting approval ({spec.approval_hint or 'add approved: true'})"
        )
        if spec.sweep:
            from trainq.watcher.spec.sweeps import combinations

            count = combinations(spec.sweep)
            state += f"; a sweep: it becomes {count} job{'s' if count != 1 else ''} ({', '.join(map(str, spec.sweep))})"
        print(f"{name}: ok, {state}")
    return worst


def cmd_submit(args: argparse.Namespace) -> int:
    from trainq.watcher.cli.submit import (
        approve_text,
        check_before_submit,
        debug_text,
        read_job_text,
        submit_base,
        with_submitted_from,
    )
    from trainq.watcher.spec.errors import InvalidJobSpec
    from trainq.watcher.spec.folders import id_from_name
    from trainq.watcher.spec.jobspec import parse_job_text

    if args.command_argv is not None or args.file is None:
        from trainq.watcher.cli.submit_command import submit_command

        return submit_command(args, _root(args))
    given = [
        o
        for o, v in (
            ("--name", args.name),
            ("--priority", args.priority),
            ("--after", args.after),
            ("--gpus", args.gpus),
            ("--ram", args.ram),
            ("--timeout", args.timeout),
            ("--pool", args.pool),
            ("--cwd", args.cwd),
            ("--env", args.env),
        )
        if v not in (None, [])
    ]
    if given:
        return _fail(
            f"submit {args.file}: {', '.join(given)} {'is' if len(given) == 1 else 'are'} for "
            "`trainq submit [OPTIONS] -- CMD ARGS...`; set these fields in the job file instead",
            EXIT_INVALID,
        )
    source = Path(args.file)
    root = _root(args)
    try:
        text = read_job_text(source)
        if args.debug:
            parse_job_text(text, str(source))  # the file's own problems first, as the user wrote it
            text = debug_text(text, str(source))
        if args.approve:
            text = approve_text(text)
        parse_job_text(text, str(source))
        text = with_submitted_from(text, submit_base(source), str(source))
        spec = parse_job_text(text, str(source))
        check_before_submit(spec, str(source), submit_base(source), root, time.time(), id_from_name(source.name))
    except InvalidJobSpec as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        return EXIT_INVALID
    from trainq.watcher.cli.submit_command import drop_and_report

    return drop_and_report(root, source.name, text, spec, args.parsable)


def cmd_status(args: argparse.Namespace) -> int:
    from trainq.watcher.faces.view import Filters, print_status

    filters = Filters(states=args.state, sweep=args.sweep, pattern=args.pattern)
    return (
        print_status(
            _root(args) / "status.json", follow=args.follow, json_out=args.json, wide=args.wide, filters=filters
        )
        or EXIT_OK
    )


def cmd_why(args: argparse.Namespace) -> int:
    from trainq.watcher.cli.names import AmbiguousName
    from trainq.watcher.cli.why import explain
    from trainq.watcher.spec.text import printable

    try:
        lines = explain(_root(args), args.id)
    except AmbiguousName as exc:
        return _fail(str(exc), EXIT_INVALID)
    if lines is None:
        from trainq.watcher.cli.why import removed_lines

        lines = removed_lines(_root(args), args.id)
    if lines is None:
        return _fail(
            f"{_root(args)}: no job with id {args.id!r} (not in inbox/, pending/, running/, done/ or failed/)",
            EXIT_INVALID,
        )
    if getattr(args, "stack", False):
        from trainq.watcher.cli.why import stack_lines

        lines += stack_lines(_root(args), args.id)
    print("\n".join(printable(line) for line in lines))  # evidence is the job's own output
    return EXIT_OK


def cmd_fork(args: argparse.Namespace) -> int:
    from trainq.watcher.cli.fork import find_job_dir, fork_data, fork_words, write_fork
    from trainq.watcher.cli.names import AmbiguousName
    from trainq.watcher.spec.errors import InvalidJobSpec

    root = _root(args).resolve()  # every path the fork carries is absolute, whatever --root was
    try:
        job_dir = find_job_dir(root, args.id)
    except AmbiguousName as exc:
        return _fail(str(exc), EXIT_INVALID)
    if job_dir is None:
        return _fail(f"{root}: no job with id {args.id!r}", EXIT_INVALID)
    try:
        data = fork_data(job_dir, job_dir.name, args.set, args.from_checkpoint)
    except InvalidJobSpec as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        return EXIT_INVALID
    target = write_fork(root / "inbox", job_dir.name, data)
    print(fork_words(root, target, job_dir.name, data))
    return EXIT_OK


def cmd_plot(args: argparse.Namespace) -> int:
    from trainq.watcher.cli.plot import plot

    return plot(_root(args), args.ids, args.output)


def cmd_history(args: argparse.Namespace) -> int:
    from trainq.watcher.cli.history import history

    return history(_root(args), args.state, args.since, args.kind, args.sweep, args.fmt, pattern=args.pattern)
