"""The management commands (``rm``, ``pause``, ``resume``, ``clean``, ``wait``, ``train``, ``tiny``, ``schema``).

Each is a thin layer over the files, and the README gives the file way beside each:
``rm`` removes a job folder (a running job is stopped first), ``pause``/``resume`` create/remove
``pause.flag``, ``clean`` removes finished folders, ``wait`` polls where a job's folder is. Also the
job lookup the other commands share (edit.py rewrites job files, show.py puts run.json into words).
Only light modules are imported here: ``trainq --help`` stays fast.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.fsutil import atomic_write, read_json, remove_quietly, touch
from trainq.watcher.spec.interpreter import safe_module_argv
from trainq.watcher.spec.tombstones import prune_tombstones, record_removal

#: the states a job folder can be in, in the order a lookup tries them
STATES = ("running", "pending", "failed", "done")
FINISHED = ("done", "failed")
#: how often ``wait`` and ``rm`` look at where a job's folder is (seconds)
POLL_S = 0.25
#: what a stop.flag holds to skip the stop grace (``trainq stop --now``)
STOP_NOW = "now"
#: exit status of ``wait`` past its --timeout (as timeout(1))
EXIT_WAIT_TIMEOUT = 124

EXIT_OK, EXIT_ERROR, EXIT_INVALID = 0, 1, 2


class UsageError(Exception):
    """Raised when a command cannot do what was asked (unknown id, wrong state); exit status 2."""


@dataclass(frozen=True)
class Found:
    """A job folder and the state its location gives it."""

    state: str
    path: Path

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def run(self) -> dict:
        return read_json(JobPaths(self.path).run) or {}


def say(message: str) -> None:
    print(message, flush=True)


def find_job(root: Path, job_id: str, by_name: bool = True) -> Found | None:
    """Where the job ``job_id`` is now, or None; a word that is no id may be a job's name (names.py)."""
    if not job_id or job_id.startswith(".") or "/" in job_id or job_id in ("..",):
        return None
    for state in STATES:
        path = root / state / job_id
        if path.is_dir():
            return Found(state, path)
    if not by_name or inbox_file_for(root, job_id) is not None:
        return None
    from trainq.watcher.cli.names import AmbiguousName, id_for_name

    try:
        named = id_for_name(root, job_id)
    except AmbiguousName as exc:
        raise UsageError(str(exc)) from None
    return find_job(root, named, by_name=False) if named else None


def require_job(root: Path, job_id: str) -> Found:
    found = find_job(root, job_id)
    if found is None:
        raise UsageError(f"{root}: no job with id {job_id!r}{_inbox_hint(root, job_id)}")
    return found


def inbox_file_for(root: Path, job_id: str) -> Path | None:
    """The inbox file that will become job ``job_id`` once a watcher takes it (same stem), if any."""
    from trainq.watcher.daemon.inbox import is_candidate_name
    from trainq.watcher.spec.folders import id_from_name

    try:
        names = sorted(os.listdir(root / "inbox"))
    except FileNotFoundError:
        return None
    return next((root / "inbox" / n for n in names if is_candidate_name(n) and id_from_name(n) == job_id), None)


def no_such_job(root: Path, job_id: str) -> str:
    """The one line for an id that names no job folder (with where the job may still be)."""
    return f"{root}: no job with id {job_id!r}{_inbox_hint(root, job_id)}"


def wait_for_claim(root: Path, job_id: str, timeout_s: float = 10.0) -> Found | None:
    """A job still in the inbox right after ``trainq watch`` started: wait briefly until a watcher takes it."""
    deadline = time.monotonic() + timeout_s
    while True:
        waiting = inbox_file_for(root, job_id)
        if waiting is None or awaiting_entry(root, waiting) is not None or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
        found = find_job(root, job_id, by_name=False)
        if found is not None:
            return found
    return find_job(root, job_id, by_name=False)


@dataclass(frozen=True)
class Claimed:
    """What became of a file ``trainq submit`` (or rerun, fork) put into the inbox."""

    words: str  # the line submit prints
    job_id: str | None = None  # the job's id (or the sweep's), once a watcher took it; else the id it will get
    rejected: str | None = None  # the watcher's error line when it refused the file on arrival
    taken: bool = False  # a watcher took it within the wait


def claimed_id(
    root: Path, inbox_file: Path, ino: int, sweeps_before: dict[str, int] | None = None, timeout_s: float = 10.0
) -> str:
    """``job ID`` once a watcher took ``inbox_file`` (inode ``ino``: a claim hard-links it), else what will happen."""
    return claim_of(root, inbox_file, ino, sweeps_before, timeout_s).words


def claim_of(
    root: Path, inbox_file: Path, ino: int, sweeps_before: dict[str, int] | None = None, timeout_s: float = 10.0
) -> Claimed:
    """Wait (up to ``timeout_s``, 2 s without a live watcher) for a watcher to take ``inbox_file``; say what became of it."""
    from trainq.watcher.spec.folders import id_from_name

    deadline = time.monotonic() + (timeout_s if watcher_alive(root) else min(timeout_s, 2.0))
    base = id_from_name(inbox_file.name)
    while True:
        if not inbox_file.exists():
            job_id = _job_with_inode(root, base, ino)
            if job_id is not None:
                found = find_job(root, job_id, by_name=False)
                error = found.run.get("error") if found is not None and found.run.get("status") == "rejected" else None
                words = f"job {job_id}" + (f" (rejected: {error})" if error else "")
                return Claimed(words, job_id, error or None, taken=True)
            # a sweep file becomes new files ID-1 … ID-N, none with our inode: a sweep not there before is ours
            new_sweeps = () if sweeps_before is None else sweeps_of(root, base).items() - sweeps_before.items()
            if new_sweeps:
                sweep_id, count = min(new_sweeps)
                words = f"sweep {sweep_id}: jobs {sweep_id}-1" + (f" … {sweep_id}-{count}" if count > 1 else "")
                return Claimed(words, sweep_id, taken=True)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    words = (
        f"inbox/{inbox_file.name}: submitted; it becomes job {base} (or {base}-2, … if taken) "
        f"when a watcher takes it ({watcher_words(root)})"
    )
    return Claimed(words, next_free_id(root, base))


def next_free_id(root: Path, base: str) -> str:
    """The id a file of stem ``base`` gets if it is taken now: ``base``, else the first free ``base-N``."""
    from trainq.watcher.spec.folders import _with_suffix

    for n in range(1, 10_000):
        job_id = base if n == 1 else _with_suffix(base, n)
        if not any(os.path.lexists(root / state / job_id) for state in STATES):
            return job_id
    return base


def _folder_names(root: Path) -> Iterator[tuple[str, str]]:
    """(state, name) of each entry in the four job folders, in STATES order; a missing folder has none."""
    for state in STATES:
        try:
            names = os.listdir(root / state)
        except FileNotFoundError:
            continue
        for name in names:
            yield state, name


def sweeps_of(root: Path, base: str) -> dict[str, int]:
    """The sweeps ``base`` or ``base-N`` in the queue (by their first variant's run.json), with their sizes.
    A sweep's id skips every id taken, so ``grid-5`` may follow ``grid``: each ``*-1`` folder is looked at."""
    sweeps: dict[str, int] = {}
    for state, name in _folder_names(root):
        sweep_id = name[:-2]
        if not name.endswith("-1") or not (sweep_id == base or sweep_id.rpartition("-")[0] == base):
            continue
        record = Found(state, root / state / name).run.get("sweep") or {}
        if record.get("id") == sweep_id:
            sweeps[sweep_id] = int(record.get("of") or 1)
    return sweeps


def _job_with_inode(root: Path, base: str, ino: int) -> str | None:
    """Which of ``base``, ``base-2``, … holds the submitted file as its job.yaml (a claim hard-links it)."""
    from trainq.watcher.spec.folders import _with_suffix

    for n in range(1, 1000):
        job_id = base if n == 1 else _with_suffix(base, n)
        found = find_job(root, job_id, by_name=False)
        if found is None:
            if n > 1 and not any((root / s / job_id).exists() for s in STATES):
                return None
            continue
        try:
            if JobPaths(found.path).spec.stat().st_ino == ino:
                return job_id
        except FileNotFoundError:
            continue
    return None


def awaiting_entry(root: Path, inbox_file: Path) -> dict | None:
    """status.json's entry for an inbox file the watcher found valid but not approved."""
    status = read_json(root / "status.json") or {}
    return next(
        (
            j
            for j in status.get("jobs") or ()
            if j.get("state") == "awaiting_approval" and j.get("dir") == f"inbox/{inbox_file.name}"
        ),
        None,
    )


def _inbox_hint(root: Path, job_id: str) -> str:
    waiting = inbox_file_for(root, job_id)
    if waiting is None:
        return ""
    awaiting = awaiting_entry(root, waiting)
    if awaiting is not None:
        return f" yet: inbox/{waiting.name} awaits approval ({awaiting.get('approval_hint') or 'set approved: true'})"
    return f" yet: inbox/{waiting.name} is still waiting to be taken ({watcher_words(root)})"


def watcher_alive(root: Path) -> bool:
    """True when a watcher keeps status.json's heartbeat going (and says it is not stopping).

    "Going" is judged as faces/liveness.py says: by this machine's clock where it agrees with the heartbeat,
    else by watching the heartbeat change (up to liveness.CONFIRM_S, once per process).
    """
    from trainq.watcher.faces.liveness import check

    status = read_json(root / "status.json") or {}
    watcher = status.get("watcher") or {}
    if not isinstance(watcher, dict) or watcher.get("state") in ("stopping", "stopped"):
        return False
    return check(root / "status.json", status)[1].is_alive


def watcher_words(root: Path) -> str:
    return (
        "a watcher is running" if watcher_alive(root) else f"no watcher is running: start `trainq --root {root} watch`"
    )


def remove_folder(path: Path) -> None:
    """Remove a job folder: renamed to a hidden name first (one atomic step nobody lists), then deleted."""
    hidden = path.with_name(f".rm-{path.name}-{os.getpid()}")
    os.rename(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


# -- rm ------------------------------------------------------------------------------------------------
def rm(root: Path, ids: list[str], now: bool = False, timeout_s: float | None = None, force: bool = False) -> int:
    """Remove jobs: pending or finished at once; running ones are stopped first (``--now``: no grace).

    A running job that can resume (a train job, or one with resume_args) has checkpoints worth keeping:
    it is removed only with ``--force`` or after a yes on a terminal.
    """
    worst = EXIT_OK
    for job_id in with_sweep_members(root, ids):
        try:
            found = require_job(root, job_id)
            if found.state == "running" and not force and not _confirm_running(found):
                raise UsageError(
                    f"job {found.id} is running and can resume: rm would delete its checkpoints too. "
                    f"`trainq stop {found.id}` keeps them; `trainq rm --force {found.id}` deletes it all"
                )
            _rm_one(root, found.id, now, timeout_s)
        except UsageError as exc:
            print(f"trainq: {exc}", file=sys.stderr)
            worst = max(worst, EXIT_INVALID)
        except TimeoutError as exc:
            print(f"trainq: {exc}", file=sys.stderr)
            worst = max(worst, EXIT_ERROR)
    return worst


def with_sweep_members(root: Path, ids: list[str]) -> list[str]:
    """``ids`` with each sweep id (one that names no job) replaced by the ids of its jobs still in the queue."""
    out: list[str] = []
    for job_id in ids:
        members = sweep_members(root, job_id) if find_job(root, job_id, by_name=False) is None else []
        if members:
            say(
                f"sweep {job_id}: {len(members)} job(s) ({members[0]}{' … ' + members[-1] if len(members) > 1 else ''})"
            )
        out += members or [job_id]
    return list(dict.fromkeys(out))


def sweep_members(root: Path, sweep_id: str) -> list[str]:
    """The jobs of sweep ``sweep_id`` in the queue now (``ID-1`` … by index), by their run.json ``sweep.id``."""
    found: dict[int, str] = {}
    prefix = f"{sweep_id}-"
    for state, name in _folder_names(root):
        if not (name.startswith(prefix) and name[len(prefix) :].isdigit()):
            continue
        record = Found(state, root / state / name).run.get("sweep") or {}
        if record.get("id") == sweep_id:
            found[int(name[len(prefix) :])] = name
    return [found[i] for i in sorted(found)]


def _confirm_running(found: Found) -> bool:
    """True for a running job without resume semantics, or when the user says yes on a terminal."""
    from trainq.watcher.spec.errors import InvalidJobSpec
    from trainq.watcher.spec.jobspec import load_job_file

    try:
        resumable = load_job_file(JobPaths(found.path).spec).has_resume
    except (InvalidJobSpec, OSError):
        resumable = True  # unknown: ask
    if not resumable:
        return True
    if not sys.stdin.isatty():
        return False
    answer = input(f"job {found.id} is running and can resume; delete it with its checkpoints? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def _rm_one(root: Path, job_id: str, now: bool, timeout_s: float | None) -> None:
    found = require_job(root, job_id)
    if found.state == "running":
        found = _stop_and_wait(root, found, now, timeout_s)
    run = read_json(JobPaths(found.path).run) or {}
    record_removal(
        root, job_id, found.state, run.get("status") or found.state, by="trainq rm", sweep=run.get("sweep")
    )  # its dependents count it as ended (removed), across restarts
    try:
        remove_folder(found.path)
    except FileNotFoundError:  # it started meanwhile: stop it, then remove it
        _rm_one(root, job_id, now, timeout_s)
        return
    say(f"job {job_id}: removed ({found.state}/{job_id})")


def _stop_and_wait(root: Path, found: Found, now: bool, timeout_s: float | None) -> Found:
    if not watcher_alive(root):
        raise TimeoutError(
            f"job {found.id} is running and {watcher_words(root)}; it must move the stopped job "
            "out of running/ before the folder can be removed"
        )
    request_stop(found.path, now)
    say(f"job {found.id}: stopping{' now' if now else ' (stop.flag; the job has its stop_grace to checkpoint)'}…")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        current = find_job(root, found.id, by_name=False)
        if current is None:
            raise UsageError(f"job {found.id}: its folder vanished while stopping")
        if current.state in FINISHED:
            return current
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {found.id}: still stopping after {timeout_s:g} s; left in running/")
        time.sleep(POLL_S)


def request_stop(job_dir: Path, now: bool = False) -> Path:
    """Create the job's stop.flag; with ``now`` it holds ``now``, which skips the stop grace."""
    flag = JobPaths(job_dir).stop_flag
    if now:
        atomic_write(flag, f"{STOP_NOW}\n", durable=False)
    else:
        touch(flag)
    return flag


# -- pause / resume ---------------------------------------------------------------------------------------
def pause(root: Path, pool: str | None = None) -> int:
    if pool is not None:
        return _pause_pool(root, pool)
    touch(root / "pause.flag")
    say(
        f"{root}: paused (pause.flag): no new job starts; running jobs go on. `trainq resume` undoes it"
        + ("" if watcher_alive(root) else f"; {watcher_words(root)}")
    )
    return EXIT_OK


def resume(root: Path, pool: str | None = None) -> int:
    if pool is not None:
        from trainq.watcher.spec.config import pool_pause_flag

        flag = pool_pause_flag(root, _pool_name(pool))
        was = remove_quietly(flag)
        say(f"{root}: pool {pool} {'resumed (' + flag.name + ' removed)' if was else 'was not paused'}")
        return EXIT_OK
    was = remove_quietly(root / "pause.flag")
    say(f"{root}: {'resumed (pause.flag removed)' if was else 'was not paused'}")
    return EXIT_OK


def _pool_name(pool: str) -> str:
    from trainq.watcher.spec.config import POOL_NAME

    if not POOL_NAME.match(pool):
        raise UsageError(f"--pool {pool!r}: a pool name is 1-64 letters, digits, '_' or '-'")
    return pool


def _known_pool(root: Path, pool: str) -> None:
    """UsageError when ROOT/watcher.yaml (read now, as the watcher reads it) names no pool ``pool``."""
    from trainq.watcher.cli.submit import pools_now
    from trainq.watcher.spec.config import unknown_pool_words

    pools = pools_now(root)
    words = unknown_pool_words(pool, pools) if pools is not None else None
    if words is not None:
        raise UsageError(f"{root / 'watcher.yaml'}: pools: {words}; nothing paused")


def _pause_pool(root: Path, pool: str) -> int:
    """``pause --pool P``: ROOT/pause.P.flag; only that pool's jobs wait (running ones go on)."""
    from trainq.watcher.spec.config import pool_pause_flag

    _known_pool(root, _pool_name(pool))
    flag = pool_pause_flag(root, pool)
    touch(flag)
    say(
        f"{root}: pool {pool} paused ({flag.name}): none of its jobs starts; running ones go on. "
        f"`trainq resume --pool {pool}` undoes it" + ("" if watcher_alive(root) else f"; {watcher_words(root)}")
    )
    return EXIT_OK


# -- clean -------------------------------------------------------------------------------------------------
def clean(
    root: Path,
    done: bool,
    failed: bool,
    older_than_s: float | None,
    dry_run: bool = False,
    ids: list[str] | None = None,
) -> int:
    """Remove finished job folders (done/ and failed/ unless one is named; only ``ids`` when given),
    optionally only old ones. A named job that has not finished is refused and nothing is removed."""
    from trainq.watcher.spec.units import parse_iso

    states = [s for s, wanted in (("done", done), ("failed", failed)) if wanted] or list(FINISHED)
    cutoff = None if older_than_s is None else time.time() - older_than_s
    named = None
    if ids:
        found = [require_job(root, job_id) for job_id in ids]
        unfinished = [f for f in found if f.state not in FINISHED]
        if unfinished:
            raise UsageError(
                f"job {unfinished[0].id} is in {unfinished[0].state}/: clean removes finished jobs only "
                f"(`trainq rm {unfinished[0].id}` stops and removes it); nothing removed"
            )
        named = {f.path for f in found}
    removed = []
    for state in states:
        for path in sorted(_job_dirs(root / state)):
            if named is not None and path not in named:
                continue
            run = read_json(JobPaths(path).run) or {}
            finished = parse_iso(run.get("finished_at")) or _mtime(path)
            if cutoff is not None and finished > cutoff:
                continue
            if not dry_run:
                record_removal(
                    root, path.name, state, run.get("status") or state, by="trainq clean", sweep=run.get("sweep")
                )  # a dependent submitted later still sees how it ended
                try:
                    remove_folder(path)
                except FileNotFoundError:
                    continue
            removed.append(f"{state}/{path.name}")
    if removed and not dry_run:
        prune_tombstones(root)
    verb = "would remove" if dry_run else "removed"
    say(f"{root}: {verb} {len(removed)} finished job(s)" + (": " + ", ".join(removed) if removed else ""))
    return EXIT_OK


def _job_dirs(folder: Path) -> list[Path]:
    try:
        return [
            Path(e.path) for e in os.scandir(folder) if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")
        ]
    except FileNotFoundError:
        return []


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


# -- wait ------------------------------------------------------------------------------------------------
def wait(root: Path, ids: list[str], timeout_s: float | None = None, quiet: bool = False) -> int:
    """Wait until every job has finished; the exit status is the first non-zero job's (0 when all are done)."""
    named = []
    for job_id in ids:
        found = find_job(root, job_id)
        if found is None and inbox_file_for(root, job_id) is None:
            raise UsageError(f"{root}: no job with id {job_id!r}")
        named.append(found.id if found is not None else job_id)  # a name: its id from here on
    ids = named
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    codes: dict[str, int] = {}
    while len(codes) < len(ids):
        for job_id in ids:
            if job_id in codes:
                continue
            found = find_job(root, job_id, by_name=False)
            if (
                found is not None
                and found.state in FINISHED
                and found.run.get("status") not in (None, "running", "stopping")
            ):
                codes[job_id] = job_exit_status(found)
                if not quiet:
                    say(f"job {job_id}: {describe_end(found)}")
        if len(codes) < len(ids):
            if deadline is not None and time.monotonic() > deadline:
                print(
                    f"trainq: still waiting after {timeout_s:g} s for: " + ", ".join(i for i in ids if i not in codes),
                    file=sys.stderr,
                )
                return EXIT_WAIT_TIMEOUT
            time.sleep(POLL_S)
    return next((codes[i] for i in ids if codes[i] != 0), EXIT_OK)


def job_exit_status(found: Found) -> int:
    """0 for done; the last attempt's exit code (128+signal when killed) for failures; 1 otherwise."""
    run = found.run
    if found.state == "done" and run.get("status") == "done":
        return EXIT_OK
    if run.get("status") in ("cancelled", "rejected"):
        return EXIT_ERROR  # stopped on purpose, or never ran: the SIGTERM of a stop is no exit status of the job's
    attempts = run.get("attempts") or []
    last = attempts[-1] if attempts else {}
    if last.get("exit_code"):
        return int(last["exit_code"]) & 0xFF or EXIT_ERROR
    if last.get("signal"):
        return 128 + int(last["signal"])
    return EXIT_ERROR


def describe_end(found: Found) -> str:
    run = found.run
    status = run.get("status") or found.state
    diagnosis = run.get("diagnosis") or {}
    kind = f" ({diagnosis['kind']})" if diagnosis.get("kind") else ""
    return f"{status}{kind}, exit status {job_exit_status(found)} ({found.state}/{found.id})"


# -- train / tiny -------------------------------------------------------------------------------------------
def run_module(module: str, args: list[str], prog: str | None = None) -> int:
    """Run ``python -m module args`` in place of this process (the trainer imports torch; the CLI never does).

    ``prog`` (``trainq tiny``) is what the module's usage lines call it, through TRAINQ_PROG.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    env = dict(os.environ, TRAINQ_PROG=prog) if prog else os.environ
    os.execve(sys.executable, [*safe_module_argv(sys.executable, module), *args], env)
    return EXIT_ERROR  # not reached


# -- schemas -----------------------------------------------------------------------------------------------
def schema_files() -> list[Path]:
    from trainq.watcher.spec.jobspec import SCHEMAS_DIR

    return sorted(Path(SCHEMAS_DIR).glob("*.schema.json"))


def write_schemas(root: Path) -> Path:
    """Copy the JSON Schemas into ROOT/schemas/ (the examples' ``$schema=../schemas/job.schema.json`` finds them)."""
    target = root / "schemas"
    target.mkdir(parents=True, exist_ok=True)
    for path in schema_files():
        if (target / path.name).exists() and os.path.samefile(target / path.name, path):
            continue  # the repo's own queue/schemas links to the schemas themselves
        atomic_write(target / path.name, path.read_bytes(), durable=False)
    return target
