"""``trainq submit [--name N] [--priority P] [--after ID] [--gpus G] [--ram 8G] [--timeout 2h] [--pool P]
[--cwd DIR] [--env K=V]... [--parsable] -- CMD ARGS...``

The bare-command submit pueue (``pueue add -- cmd``), nq, task-spooler and Slurm (``sbatch --wrap``) users
expect: the job runs in the directory it was submitted from (``--cwd DIR`` for another), the options and the
command become a YAML job file (``approved: true``, ``cwd``, ``submitted_from``), validated and checked
exactly as the watcher will (docs/contract.md), written into the inbox under a hidden name and renamed in,
and the job id is printed (``--parsable``: the id alone). A job the watcher refuses on arrival exits 2. The
file stays the interface: ``inbox/N.yaml`` is what a user could have written by hand.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from trainq.watcher.spec.errors import InvalidJobSpec, Problem

#: exit statuses (as main.py's)
EXIT_OK, EXIT_INVALID = 0, 2
#: --ram: a number with an optional unit (G is the default; M and T too; a trailing B or iB is allowed)
_RAM = re.compile(r"^\s*(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>[MGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_RAM_UNITS_GB = {"": 1.0, "M": 1 / 1024, "G": 1.0, "T": 1024.0}


def split_submit_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``[..., submit, opts, --, CMD, ARGS]`` → (the part argparse reads, the command); (argv, None) otherwise."""
    if "--" not in argv:
        return argv, None
    cut = argv.index("--")
    if "submit" not in argv[:cut]:
        return argv, None
    return argv[:cut], argv[cut + 1 :]


def add_command_options(p: argparse.ArgumentParser) -> None:
    """The options of ``submit -- CMD`` (a FILE submit ignores them, and says so)."""
    p.add_argument("--name", metavar="N", help="the job's name; its id too when free (default: the program's name)")
    p.add_argument("--priority", type=int, metavar="P", help="higher starts first (default 0)")
    p.add_argument(
        "--after", action="append", default=[], metavar="ID", help="start only after job ID ended (repeatable)"
    )
    p.add_argument("--gpus", type=int, metavar="G", help="GPUs the job needs (default 1 where the machine has GPUs)")
    p.add_argument("--ram", metavar="SIZE", help="RAM the job needs: 8G, 512M (G when no unit)")
    p.add_argument("--timeout", metavar="AGE", help="stop it after this long: 90s, 10m, 2h")
    from trainq.watcher.cli.manage_commands import pool_names

    p.add_argument("--pool", metavar="P", help="the pool it runs in (watcher.yaml pools:)").completer = pool_names  # type: ignore[attr-defined]
    p.add_argument("--cwd", metavar="DIR", help="run it in DIR (default: the directory you submit from)")
    p.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="set an environment variable for it (repeatable)"
    )
    p.add_argument(
        "--parsable",
        action="store_true",
        help="print only the job id (for scripts: id=$(trainq submit --parsable ...))",
    )


def command_job(argv: list[str], args: argparse.Namespace, here: str) -> dict:
    """The job mapping ``submit -- CMD`` writes, run in ``here`` (or --cwd, resolved against it); InvalidJobSpec
    naming the option when one is wrong."""
    data: dict = {"approved": True}
    if args.name:
        data["name"] = args.name
    if args.priority is not None:
        data["priority"] = args.priority
    data["command"] = list(argv)
    data["cwd"] = os.path.normpath(os.path.join(here, os.path.expanduser(args.cwd))) if args.cwd else here
    env = env_pairs(args.env or [])
    if env:
        data["env"] = env
    if args.after:
        data["after"] = list(args.after)
    resources = {}
    if args.gpus is not None:
        resources["gpus"] = args.gpus
    if args.ram is not None:
        resources["ram_gb"] = ram_gb(args.ram)
    if resources:
        data["resources"] = resources
    if args.timeout is not None:
        data["timeout"] = args.timeout
    if args.pool is not None:
        data["pool"] = args.pool
    data["submitted_from"] = here
    return data


def env_pairs(items: list[str]) -> dict[str, str]:
    """``--env K=V`` options as a mapping (a later K wins); InvalidJobSpec for one without ``=`` or a name."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise InvalidJobSpec(
                "trainq submit --env", [Problem("env", f"expected NAME=VALUE with a variable name (got {item!r})")]
            )
        env[key] = value
    return env


def ram_gb(text: str) -> float:
    """``8G`` → 8.0, ``512M`` → 0.5; InvalidJobSpec for anything else."""
    match = _RAM.match(text)
    if not match:
        raise InvalidJobSpec(
            "trainq submit --ram", [Problem("resources.ram_gb", f"expected a size such as 8G or 512M (got {text!r})")]
        )
    return round(float(match["n"]) * _RAM_UNITS_GB[match["unit"].upper()], 6)


def file_stem(argv: list[str], name: str | None) -> str:
    """The inbox file's stem: --name, else the program's (``python train.py`` → ``train``)."""
    from trainq.watcher.spec.folders import id_from_name

    if name:
        return id_from_name(f"{name}.yaml")
    program = os.path.basename(argv[0]) if argv else "job"
    if re.match(r"^(python[0-9.]*|bash|sh|uv|node|Rscript)$", program):
        program = _script_of(argv[1:]) or program  # the script is the more telling name
    stem = program.rsplit(".", 1)[0] if "." in program[1:] else program
    return id_from_name(f"{stem or 'job'}.yaml")


def _script_of(args: list[str]) -> str | None:
    """``-m pkg.mod`` → ``mod``; the first argument that looks like a file (``train.py``) → its name; else None."""
    if args[:1] == ["-m"] and len(args) > 1:
        return args[1].rsplit(".", 1)[-1]
    if "-c" in args:
        return None
    first = next((a for a in args if not a.startswith("-")), None)
    return os.path.basename(first) if first and re.match(r"^[\w./-]+$", first) else None


def submit_command(args: argparse.Namespace, root: Path) -> int:
    """Write the job file for ``submit -- CMD`` into ``root``'s inbox and print the job id."""
    from trainq.watcher.cli.submit import check_before_submit
    from trainq.watcher.spec.jobspec import parse_job_text
    from trainq.watcher.spec.yaml12 import dump_yaml12

    argv = args.command_argv
    if not argv:
        print(
            "trainq: submit: give a job FILE, or a command after `--` (trainq submit --name N -- python train.py)",
            file=sys.stderr,
        )
        return EXIT_INVALID
    if args.file is not None:
        print(
            f"trainq: submit: give either a job FILE ({args.file}) or a command after `--`, not both", file=sys.stderr
        )
        return EXIT_INVALID
    try:
        here = os.getcwd()
    except FileNotFoundError:
        print("trainq: submit: the current directory was removed; cd somewhere that exists", file=sys.stderr)
        return EXIT_INVALID
    stem = file_stem(argv, args.name)
    display = f"trainq submit -- {argv[0]}"
    try:
        data = command_job(argv, args, here)
        text = f"# written by trainq submit -- CMD, from {here}\n" + dump_yaml12(data)
        spec = parse_job_text(text, display)  # the watcher's own validation, before anything is written
        check_before_submit(spec, display, Path(here), root, time.time(), stem)
    except InvalidJobSpec as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        return EXIT_INVALID
    return drop_and_report(root, f"{stem}.yaml", text, spec, args.parsable)


def drop_and_report(root: Path, file_name: str, text: str, spec, parsable: bool) -> int:
    """Write ``text`` into the inbox (hidden temp name, then rename), wait for a watcher to take it, say the id.

    Exit 2 when the watcher refuses it on arrival (its one line goes to stderr); ``parsable``: stdout holds only
    the job id (the sweep id for a sweep; the id it will get when no watcher took it yet).
    """
    from trainq.watcher.cli.manage import claim_of, next_free_id, sweeps_of
    from trainq.watcher.cli.submit import inbox_name
    from trainq.watcher.spec.folders import id_from_name
    from trainq.watcher.spec.fsutil import atomic_write

    inbox = root / "inbox"
    if not inbox.is_dir():
        print(f"trainq: {inbox}: no inbox; create the queue with `trainq init {root}`", file=sys.stderr)
        return EXIT_INVALID
    target = inbox_name(inbox, file_name)
    tmp = inbox / f".{target.name}.tmp"  # hidden: the watcher ignores it until the rename
    atomic_write(tmp, text)
    ino = os.stat(tmp).st_ino  # before the rename: a watcher may take it at once
    sweeps_before = sweeps_of(root, id_from_name(target.name)) if spec.raw.get("sweep") else None
    os.replace(tmp, target)
    if not spec.approved:
        if parsable:
            print(next_free_id(root, id_from_name(target.name)))
        else:
            print(f"{target}: submitted, awaiting approval (set approved: true in it to start it)")
        return EXIT_OK
    claim = claim_of(root, target, ino, sweeps_before)
    if claim.rejected:
        if parsable:
            print(claim.job_id)
        print(f"trainq: job {claim.job_id} refused: {claim.rejected}", file=sys.stderr)
        return EXIT_INVALID
    print(claim.job_id if parsable else claim.words)
    return EXIT_OK
