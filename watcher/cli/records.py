"""The run-records commands (docs/records.md): ``trainq events ID``, ``trainq rerun ID``, ``trainq diff A B``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

#: exit status: success, a failure (a refused rerun), invalid input (an unknown id, a bad job file)
EXIT_OK, EXIT_ERROR, EXIT_INVALID = 0, 1, 2


def add_record_commands(sub: argparse._SubParsersAction, root_of: Callable[[argparse.Namespace], Path]) -> None:
    """Register events, rerun and diff; ``root_of`` resolves the queue root as main.py does."""
    p = sub.add_parser("events", help="print a job's events.jsonl: its story from submission to the end")
    _id(p, "id", "a job id (or a job's name)")
    p.add_argument("--json", action="store_true", help="the records as they are, one JSON object a line")
    p.set_defaults(func=lambda args: cmd_events(root_of(args), args.id, args.json))

    p = sub.add_parser(
        "rerun", help="submit a job again from its snapshot (same config, same code), rerun_of: ID; prints the new id"
    )
    _id(p, "id", "the job to run again (its id, or its name)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--here", action="store_true", help="run today's code even though it differs from the snapshot")
    how.add_argument(
        "--at-snapshot",
        action="store_true",
        help="run the saved commit plus its uncommitted diff, from a scratch worktree",
    )
    p.set_defaults(
        func=lambda args: cmd_rerun(
            root_of(args), args.id, "here" if args.here else "at-snapshot" if args.at_snapshot else None
        )
    )

    p = sub.add_parser("diff", help="what differs between two jobs: params, config, code, data, environment, results")
    _id(p, "a", "the first job's id", metavar="A")
    _id(p, "b", "the second job's id", metavar="B")
    p.add_argument("--json", action="store_true", help="both jobs' records and the differing rows as JSON")
    p.set_defaults(func=lambda args: cmd_diff(root_of(args), args.a, args.b, args.json))


def _id(p: argparse.ArgumentParser, dest: str, help: str, metavar: str = "ID") -> None:
    """A job-id argument with its help and shell completion of the ids in the queue."""
    from trainq.watcher.cli.manage_commands import job_ids

    p.add_argument(dest, metavar=metavar, help=help).completer = job_ids  # type: ignore[attr-defined]


def _fail(message: str, code: int) -> int:
    print(f"trainq: {message}", file=sys.stderr)
    return code


def _job_dir(root: Path, job_id: str) -> Path | None:
    from trainq.watcher.cli.fork import find_job_dir

    return find_job_dir(root, job_id)


def _no_job(root: Path, job_id: str) -> int:
    return _fail(f"{root}: no job with id {job_id!r} (not in pending/, running/, done/ or failed/)", EXIT_INVALID)


def cmd_events(root: Path, job_id: str, as_json: bool) -> int:
    from trainq.watcher.faces.story import event_words
    from trainq.watcher.spec import events
    from trainq.watcher.spec.contract import JobPaths
    from trainq.watcher.spec.text import printable

    job_dir = _job_dir(root, job_id)
    if job_dir is None:
        return _no_job(root, job_id)
    for record in events.read(JobPaths(job_dir)):
        if as_json:
            print(json.dumps(record, ensure_ascii=False))
            continue
        rest = " ".join(f"{k}={_word(v)}" for k, v in record.items() if k not in ("time", "event"))
        said = event_words(record)  # the story's words for a stop's reason (faces/story.py)
        rest += f" ({said})" if said else ""
        print(printable(f"{record.get('time', '?')}  {record['event']:<10} {rest}".rstrip()))
    return EXIT_OK


def _word(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 120 else text[:117] + "..."


def cmd_rerun(root: Path, job_id: str, mode: str | None) -> int:
    from trainq.watcher.cli.rerun import RerunRefused, rerun_data, write_rerun
    from trainq.watcher.spec.errors import InvalidJobSpec

    job_dir = _job_dir(root, job_id)
    if job_dir is None:
        return _no_job(root, job_id)
    try:
        data, notes = rerun_data(root, job_dir, job_id, mode)
    except RerunRefused as exc:
        return _fail(str(exc), EXIT_ERROR)
    except InvalidJobSpec as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        return EXIT_INVALID
    target, ino = write_rerun(root / "inbox", job_id, data)
    for note in notes:
        print(f"trainq: {note}")
    if data.get("approved") is not True:
        print(f"{target}: rerun of {job_id} submitted (awaiting approval)")
        return EXIT_OK
    from trainq.watcher.cli.manage import claim_of

    claim = claim_of(root, target, ino)
    if claim.rejected:
        return _fail(f"job {claim.job_id} (rerun of {job_id}) refused: {claim.rejected}", EXIT_INVALID)
    print(f"{claim.words} (rerun of {job_id})")
    return EXIT_OK


def cmd_diff(root: Path, a: str, b: str, as_json: bool) -> int:
    from trainq.watcher.cli.diff import compare, describe, render
    from trainq.watcher.spec.text import printable

    dir_a, dir_b = _job_dir(root, a), _job_dir(root, b)
    if dir_a is None:
        return _no_job(root, a)
    if dir_b is None:
        return _no_job(root, b)
    da, db = describe(dir_a), describe(dir_b)
    sections = compare(da, db)
    if as_json:
        print(json.dumps({"a": da, "b": db, "differ": sections}, indent=1, ensure_ascii=False, default=str))
        return EXIT_OK
    print("\n".join(printable(line) for line in render(da, db, sections)))
    return EXIT_OK
