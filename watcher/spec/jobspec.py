"""Read a job file, check it against schemas/job.schema.json, and return a frozen ``JobSpec``.

No other module parses job files. Every failure is raised as ``InvalidJobSpec`` carrying
every problem found, each naming the field and what was expected. The file reading here and
the schema-error wording (schema_errors.py) are shared with watcher.yaml (config.py), which is
"validated like a job file".
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import cast

from trainq.watcher.spec.capacity import rank_problems
from trainq.watcher.spec.contract import EXIT_CHECKPOINT
from trainq.watcher.spec.errors import InvalidJobSpec, Problem
from trainq.watcher.spec.interpreter import safe_module_argv
from trainq.watcher.spec.schema_errors import field_name, schema_problems, schema_validator, shown, sort_problems
from trainq.watcher.spec.sweeps import workflow_problems
from trainq.watcher.spec.units import DURATION_PATTERN, MAX_DURATION_TEXT, is_zero_duration, parse_duration_s
from trainq.watcher.spec.wall import Deadline, job_wall_problems, submission_problems
from trainq.watcher.spec.yaml12 import MAX_INT_DIGITS, HugeInt, YamlError, load_yaml12

logger = logging.getLogger(__name__)

#: the repo's schemas/ folder (job, train, watcher, status schemas)
SCHEMAS_DIR = Path(__file__).resolve().parent.parent.parent / "schemas"

#: largest job file accepted, in bytes (docs/contract.md, the inbox)
MAX_JOB_FILE_BYTES = 1024 * 1024
#: every kind a failure's diagnosis can carry, in the order of run.json's and status.json's schemas (docs/contract.md,
#: statuses and diagnoses); daemon/diagnosis.py gives each its advice
DIAGNOSIS_KINDS = (
    "oom",
    "nan",
    "killed",
    "data",
    "timeout",
    "stalled",
    "preempted",
    "unsatisfiable",
    "dependency",
    "schedule",
    "no_checkpoint",
    "startup",
    "config",
    "unknown",
)
#: the kinds retries.on may name: all but dependency (a job this one runs after ended other than done: that job is the
#: one to retry)
RETRYABLE_KINDS = tuple(k for k in DIAGNOSIS_KINDS if k != "dependency")
#: retried by default: every kind but nan, data, timeout and schedule (retrying those repeats the same failure)
#: and config (a path or value only editing the file cures: ``trainq edit ID``)
DEFAULT_RETRY_ON = tuple(k for k in RETRYABLE_KINDS if k not in ("nan", "data", "timeout", "schedule", "config"))
#: seconds a stopped job may take to checkpoint and exit before its tree is terminated
DEFAULT_STOP_GRACE_S = 120.0
#: seconds a failed job waits before its retry
DEFAULT_BACKOFF_S = 30.0
#: the pool of a job without pool: (limited by watcher.yaml max_concurrent unless pools: names it)
DEFAULT_POOL = "default"
JOB_SCHEMA = "job.schema.json"
#: most lines plus commas a job file (or watcher.yaml) may have: real ones have tens; it bounds the parse time
MAX_VALUES = 20_000
#: deepest nesting of lists/mappings accepted (real job files use 3 or 4; deeper would exhaust recursion)
MAX_NESTING = 32
#: largest magnitude of any integer in a job file or watcher.yaml (fits a C long; schemas bound fields further)
MAX_INT = 2**63 - 1
#: most retries a job may ask for (job.schema.json says the same): run.json holds one record per attempt
MAX_RETRIES = 100
#: shortest retry backoff, in seconds: a job failing at once must not spin the loop
MIN_BACKOFF_S = 1.0
#: the job file's durations (schema-checked for form; their size is checked here)
DURATION_FIELDS = (("timeout",), ("stop_grace",), ("stall_after",), ("retries", "backoff"), ("expected_duration",))
#: C0 controls and DEL: never in a command, an env entry, a cwd or a name (a NUL kills the exec; ESC forges logs)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: the " (got VALUE)" part of a message, which quotes the file
_GOT = re.compile(r" \(got .*$", re.S)
#: the control characters argv items and env values may hold: a ``python -c`` script spans lines
_LINE_BREAKS = "\t\n\r"

_PLACEHOLDER = re.compile(r"\{(job_dir|job_id|attempt|resume_from|after:[A-Za-z0-9._-]+)\}")
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)
_FOREIGN_NAMES = MappingProxyType(
    {"bytes": "binary data (!!binary)", "datetime": "a timestamp", "date": "a date", "set": "a set"}
)
_TOP_LEVEL_NAMES = MappingProxyType(
    {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
)


def expand_placeholders(template: str, values: dict[str, str]) -> str:
    """Replace ``{job_dir}``, ``{job_id}``, ``{attempt}``, ``{resume_from}``, ``{after:ID}``; a missing value becomes ""."""
    if "{" not in template:
        return template
    return _PLACEHOLDER.sub(lambda m: str(values.get(m.group(1), "")), template)


def _argv_item(value: object) -> str:
    """Numbers in argv lists are passed in their string form."""
    return value if isinstance(value, str) else str(value)


def _env_value(value: object) -> str:
    """Booleans keep their YAML spelling (true/false), not Python's."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return _argv_item(value)


@dataclass(frozen=True)
class Resources:
    """What a job needs before it may start; ``gpus`` None means "the machine's default"."""

    gpus: int | None = None
    gpu_memory_gb: float | None = None
    ram_gb: float = 0.0
    disk_gb: float = 0.0
    allow_battery: bool = False
    #: Slurm only: nodes, GPUs per node and srun tasks per node (None: not asked for)
    nodes: int | None = None
    gpus_per_node: int | None = None
    tasks_per_node: int | None = None

    @classmethod
    def from_dict(cls, data: dict) -> Resources:
        """Build from a schema-valid ``resources`` mapping."""
        gpus, mem = data.get("gpus"), data.get("gpu_memory_gb")
        slurm = {key: int(data[key]) for key in ("nodes", "gpus_per_node", "tasks_per_node") if key in data}
        return cls(
            gpus=None if gpus is None else int(gpus),
            gpu_memory_gb=None if mem is None else float(mem),
            ram_gb=float(data.get("ram_gb", 0.0)),
            disk_gb=float(data.get("disk_gb", 0.0)),
            allow_battery=bool(data.get("allow_battery", False)),
            **slurm,
        )

    def to_dict(self) -> dict:
        """The job-file form, leaving out what defaults to the machine."""
        out: dict = {"ram_gb": self.ram_gb, "disk_gb": self.disk_gb, "allow_battery": self.allow_battery}
        for key in ("gpus", "gpu_memory_gb", "nodes", "gpus_per_node", "tasks_per_node"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass(frozen=True)
class Retries:
    """When and how often a failed job runs again."""

    max: int = 0
    on: tuple[str, ...] = DEFAULT_RETRY_ON
    backoff_s: float = DEFAULT_BACKOFF_S

    @classmethod
    def from_dict(cls, data: dict) -> Retries:
        """Build from a schema-valid ``retries`` mapping (duplicate kinds collapse)."""
        on = tuple(dict.fromkeys(data["on"])) if "on" in data else DEFAULT_RETRY_ON
        backoff = parse_duration_s(data["backoff"]) if "backoff" in data else DEFAULT_BACKOFF_S
        return cls(max=int(data.get("max", 0)), on=on, backoff_s=backoff)

    def to_dict(self) -> dict:
        """The job-file form (backoff in seconds)."""
        return {"max": self.max, "on": list(self.on), "backoff": self.backoff_s}


@dataclass(frozen=True)
class JobSpec:
    """A validated job file; ``raw`` is the parsed mapping exactly as written."""

    approved: bool
    name: str | None
    priority: int
    command: tuple[str, ...] | None
    train: dict | None
    cwd: str | None
    env: dict[str, str]
    resources: Resources
    timeout_s: float | None
    stop_grace_s: float
    stall_after_s: float | None
    retries: Retries
    resume_args: tuple[str, ...] | None
    slurm: dict | None
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    after: tuple[str, ...] = ()  # job or sweep ids this job waits for (docs/workflows.md)
    after_policy: str = "ok"
    on_finish: tuple[str, ...] | None = None
    sweep: dict | None = None
    fork_of: str | None = None
    from_checkpoint: str | None = None
    deadline: Deadline | None = None  # docs/wall.md
    expected_duration_s: float | None = None
    deliver: dict | None = None
    rerun_of: str | None = None  # run records (docs/records.md): trainq rerun's lineage
    snapshot: bool = True
    declared_checkpoint_exit_code: int | None = None
    pool: str = "default"  # watcher.yaml pools: (docs/cli.md, pools)
    #: the folder relative paths resolve against (docs/contract.md, "Submitted from"); None: the queue root
    submitted_from: str | None = None

    @classmethod
    def from_dict(cls, data: dict, display: str = "<job>") -> JobSpec:
        """Validate a parsed job mapping and build the spec; InvalidJobSpec lists every problem."""
        problems = _job_problems(data)
        if problems:
            raise InvalidJobSpec(display, problems)
        return _build(data)

    @classmethod
    def from_checked(cls, data: dict) -> JobSpec:
        """The spec of a mapping validated already: a sweep's variant, which the sweep file's validation checked
        one by one (``sweeps.sweep_problems``); checking it again would double a big sweep's admission."""
        return _build(data)

    def to_dict(self) -> dict:
        """A schema-valid job mapping (durations in seconds) that ``from_dict`` turns back into an equal spec."""
        out: dict = {} if "approved" not in self.raw else {"approved": self.raw["approved"]}
        optional = {
            "name": self.name,
            "cwd": self.cwd,
            "timeout": self.timeout_s,
            "stall_after": self.stall_after_s,
            "slurm": self.slurm,
            "train": self.train,
        }
        out.update({k: v for k, v in optional.items() if v is not None})
        if self.command is not None:
            out["command"] = list(self.command)
        if self.resume_args is not None:
            out["resume_args"] = list(self.resume_args)
        records = {
            "rerun_of": self.rerun_of,
            "checkpoint_exit_code": self.declared_checkpoint_exit_code,
            "snapshot": None if self.snapshot else False,
        }
        out.update({k: v for k, v in records.items() if v is not None})
        if self.pool != DEFAULT_POOL:
            out["pool"] = self.pool
        if self.submitted_from is not None:
            out["submitted_from"] = self.submitted_from
        out.update(
            priority=self.priority,
            env=dict(self.env),
            resources=self.resources.to_dict(),
            stop_grace=self.stop_grace_s,
            retries=self.retries.to_dict(),
        )
        return out

    @property
    def is_train(self) -> bool:
        """True for jobs run by the built-in trainer."""
        return self.train is not None

    def options_for(self, executor: str) -> dict | None:
        """The job file's section for that executor (``slurm:`` for ``slurm``), or None."""
        return {"slurm": self.slurm}.get(executor)

    @property
    def has_resume(self) -> bool:
        """Whether a retry can resume: train jobs always, command jobs that declare resume_args or a checkpoint exit."""
        return self.is_train or self.resume_args is not None or self.declared_checkpoint_exit_code is not None

    @property
    def checkpoint_exit_code(self) -> int | None:
        """The exit code that means "saved, run me again": the job's own, or 85 for a time-sliced train job."""
        if self.declared_checkpoint_exit_code is not None:
            return self.declared_checkpoint_exit_code
        if self.is_train and isinstance(self.train, dict) and self.train.get("max_minutes_per_attempt"):
            return EXIT_CHECKPOINT
        return None

    @property
    def approval_hint(self) -> str | None:
        """One line telling the user why a present ``approved`` does not approve, else None."""
        if "approved" not in self.raw or self.raw["approved"] is True:
            return None
        value = self.raw["approved"]
        if isinstance(value, str):
            what = f"the string {shown(value)}"
        elif value is None:
            what = "empty (null)"
        elif value is False:
            what = "false"
        else:
            what = f"{shown(value)}, not a boolean"
        return f"approved is {what}; write approved: true (a YAML boolean) to submit"

    def launch_argv(self, values: dict[str, str], python: str, resume: bool) -> list[str]:
        """The argv to start: the expanded command (+ resume_args when resuming), or the built-in trainer."""
        if self.is_train:
            argv = [*safe_module_argv(python, "trainq.trainer"), values["job_dir"]]
            return argv + (["--resume-from", values["resume_from"]] if resume else [])
        argv = [expand_placeholders(a, values) for a in self.command or ()]
        if resume and self.resume_args:
            argv += [expand_placeholders(a, values) for a in self.resume_args]
        return argv

    def launch_env(self, values: dict[str, str]) -> dict[str, str]:
        """The job's own env entries with placeholders expanded (the daemon adds TRAINQ_* itself)."""
        return {key: expand_placeholders(value, values) for key, value in self.env.items()}

    def launch_cwd(self, values: dict[str, str]) -> str | None:
        """Expanded cwd (~ expanded; a relative one against ``base_dir``); None means the job folder."""
        if self.cwd is None:
            return None
        cwd = os.path.expanduser(expand_placeholders(self.cwd, values))
        base = self.base_dir(values.get("job_dir"))
        if not os.path.isabs(cwd) and base is not None:
            cwd = os.path.join(base, cwd)
        return cwd

    def base_dir(self, job_dir: str | None) -> str | None:
        """Where relative paths resolve (docs/contract.md): ``submitted_from``, else the queue root that
        holds ``job_dir`` (``ROOT/<state>/<id>``); None when neither is known."""
        if self.submitted_from:
            return self.submitted_from
        return os.path.dirname(os.path.dirname(os.path.abspath(job_dir))) if job_dir else None


def _build(data: dict) -> JobSpec:
    """Turn a valid mapping into a JobSpec, applying the documented defaults."""
    command = data.get("command")
    if isinstance(command, str):
        command = shlex.split(command)
    resume_args = data.get("resume_args")
    return JobSpec(
        approved=data.get("approved") is True,
        name=data.get("name"),
        priority=int(data.get("priority", 0)),
        command=None if command is None else tuple(_argv_item(a) for a in command),
        train=data.get("train"),
        cwd=data.get("cwd"),
        env={key: _env_value(value) for key, value in data.get("env", {}).items()},
        resources=Resources.from_dict(data.get("resources", {})),
        timeout_s=_duration_or_none(data, "timeout"),
        stop_grace_s=parse_duration_s(data.get("stop_grace", DEFAULT_STOP_GRACE_S)),
        stall_after_s=_duration_or_none(data, "stall_after"),
        retries=Retries.from_dict(data.get("retries", {})),
        resume_args=None if resume_args is None else tuple(_argv_item(a) for a in resume_args),
        slurm=data.get("slurm"),
        pool=data.get("pool", DEFAULT_POOL),
        submitted_from=data.get("submitted_from"),
        raw=data,
        **_workflow_fields(data),
        **_wall_fields(data),
    )


def _wall_fields(data: dict) -> dict:
    """The fields of docs/wall.md: deadline, expected_duration, deliver."""
    return {
        "deadline": Deadline.parse(data["deadline"]) if "deadline" in data else None,
        "expected_duration_s": _duration_or_none(data, "expected_duration"),
        "deliver": data.get("deliver"),
    }


def check_submission(spec: JobSpec, display: str, now: float) -> None:
    """What holds only when a file is submitted (a deadline in the past); raises InvalidJobSpec."""
    problems = submission_problems(spec.raw, now)
    if problems:
        raise InvalidJobSpec(display, problems)


def _workflow_fields(data: dict) -> dict:
    """The fields of docs/workflows.md: after, after_policy, on_finish, sweep, fork_of, from_checkpoint."""
    after = data.get("after", ())
    hook = data.get("on_finish")
    if isinstance(hook, str):
        hook = shlex.split(hook)
    return {
        "after": tuple(dict.fromkeys([after] if isinstance(after, str) else after)),
        "after_policy": data.get("after_policy", "ok"),
        "on_finish": None if hook is None else tuple(_argv_item(a) for a in hook),
        "sweep": data.get("sweep"),
        "fork_of": data.get("fork_of"),
        "from_checkpoint": data.get("from_checkpoint"),
        "rerun_of": data.get("rerun_of"),
        "snapshot": data.get("snapshot", True) is not False,
        "declared_checkpoint_exit_code": data.get("checkpoint_exit_code"),
    }


def _duration_or_none(data: dict, key: str) -> float | None:
    return None if data.get(key) is None else parse_duration_s(data[key])


# -- validation --


def _job_problems(data: dict) -> list[Problem]:
    """Every problem with a parsed job mapping: foreign values, schema, then cross-field rules."""
    found = foreign_value_problems(data)
    clean, numbers = data, []
    if found:  # without any, every key is a string and every number in range: scrubbing would change nothing
        clean = cast(dict, _scrub_numbers(data, 0))  # a mapping in, a mapping out
        problems = foreign_value_problems(clean)
        numbers = [p for p in found if p not in problems] if clean is not data else []
        if problems:
            return sort_problems(problems + numbers)
    # a number out of every range is reported once, by its path; the rest of the file is still checked
    seen = {p.path for p in numbers}
    problems = schema_problems(schema_validator(SCHEMAS_DIR, JOB_SCHEMA), clean) + _semantic_problems(clean)
    return sort_problems(numbers + [p for p in problems if p.path not in seen])


def _scrub_numbers(value: object, depth: int) -> object:
    """``value`` with integers past MAX_INT and non-finite floats replaced by 0 (itself when it has none)."""
    if depth > MAX_NESTING:
        return value  # foreign_value_problems reports the nesting
    if isinstance(value, dict):
        items = {k: _scrub_numbers(v, depth + 1) for k, v in value.items()}
        return value if all(items[k] is value[k] for k in value) else items
    if isinstance(value, list):
        new = [_scrub_numbers(v, depth + 1) for v in value]
        return value if all(a is b for a, b in zip(new, value, strict=False)) else new
    return 0 if _scalar_problems("", value) and isinstance(value, (HugeInt, int, float)) else value


def _report_to_problems(data: dict) -> list[Problem]:
    """``report_to: [tensorboard]`` without a TensorBoard writer would fail the trainer seconds in: say it now.

    The trainer runs with the watcher's interpreter, so what this one can import is what it will have
    (found by name only: nothing is imported).
    """
    import importlib.util

    train = data.get("train")
    wanted = train.get("report_to") if isinstance(train, dict) else None
    if not isinstance(wanted, list) or "tensorboard" not in wanted:
        return []
    if any(importlib.util.find_spec(m) is not None for m in ("tensorboard", "tensorboardX")):
        return []
    return [
        Problem(
            "train.report_to",
            "tensorboard needs the tensorboard package beside trainq "
            "(pip install 'trainq[tensorboard]'); install it, or remove tensorboard",
        )
    ]


def _semantic_problems(data: dict) -> list[Problem]:
    """Rules JSON Schema cannot say: the command string must split like a shell, resume_args is for commands."""
    problems = _report_to_problems(data)
    command = data.get("command")
    if isinstance(command, str):
        try:
            shlex.split(command)
        except ValueError as exc:
            problems.append(Problem("command", f"cannot be split like a shell would: {exc} (check the quotes)"))
    problems += workflow_problems(data, _job_problems)
    if "train" in data and "resume_args" in data:
        problems.append(
            Problem(
                "resume_args",
                "only applies to command jobs; train jobs resume from their "
                "checkpoints by themselves (remove resume_args)",
            )
        )
    return (
        problems
        + _control_problems(data)
        + duration_problems(data, DURATION_FIELDS)
        + _backoff_problems(data)
        + _zero_limit_problems(data)
        + job_wall_problems(data)
        + rank_problems(data)
    )


def duration_problems(data: dict, fields: tuple[tuple[str, ...], ...]) -> list[Problem]:
    """Well-formed duration strings longer than MAX_DURATION_S (numbers are bounded by the schema)."""
    problems = []
    for keys in fields:
        value = _dig(data, keys)
        if not isinstance(value, str) or len(value) > 64 or not re.search(DURATION_PATTERN, value):
            continue  # absent, a number, or malformed: the schema reports those
        try:
            parse_duration_s(value)
        except ValueError:
            problems.append(Problem(".".join(keys), f"must be at most {MAX_DURATION_TEXT} (got {shown(value)})"))
    return problems


def _backoff_problems(data: dict) -> list[Problem]:
    value = _dig(data, ("retries", "backoff"))
    try:
        too_short = value is not None and parse_duration_s(value) < MIN_BACKOFF_S
    except ValueError:
        return []  # the schema (or duration_problems) says why
    if not too_short:
        return []
    return [
        Problem(
            "retries.backoff",
            f"must be at least {MIN_BACKOFF_S:g}s, so a job that fails at once "
            f"does not spin the queue (got {shown(value)})",
        )
    ]


def _zero_limit_problems(data: dict) -> list[Problem]:
    """``timeout: 0`` or ``stall_after: 0`` would end (or flag) every job at once: say to leave the key out."""
    return [
        Problem(key, f"must be more than 0 (got {shown(data[key])}); leave {key} out for no limit")
        for key in ("timeout", "stall_after")
        if is_zero_duration(data.get(key))
    ]


def _dig(data: object, keys: tuple[str, ...]) -> object:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _control_problems(data: dict) -> list[Problem]:
    """Control characters in what becomes an argv, an environment, a folder name or a log line.

    Argv items and env values may hold tabs and line breaks (``python -c`` scripts span lines);
    names, env keys and cwd may not.
    """
    strings: list[tuple[str, object]] = [
        ("name", data.get("name")),
        ("cwd", data.get("cwd")),
        ("slurm.partition", _dig(data, ("slurm", "partition"))),
    ]
    multiline: list[tuple[str, object]] = [("command", data.get("command")), ("on_finish", data.get("on_finish"))]
    for key in ("command", "resume_args", "on_finish"):
        if isinstance(data.get(key), list):
            multiline += [(f"{key}[{i}]", item) for i, item in enumerate(data[key])]
    if isinstance(_dig(data, ("slurm", "sbatch_args")), list):
        strings += [(f"slurm.sbatch_args[{i}]", a) for i, a in enumerate(data["slurm"]["sbatch_args"])]
    problems: list[Problem] = []
    env = data.get("env")
    if isinstance(env, dict):
        problems += [Problem("env", f"key {shown(k)}: {_control_at(k)}") for k in env if _control_at(k)]
        multiline += [(f"env.{field_name(k)}", v) for k, v in env.items() if not _control_at(k)]
    return problems + control_problems(strings) + control_problems(multiline, allowed=_LINE_BREAKS)


def control_problems(strings: list[tuple[str, object]], allowed: str = "") -> list[Problem]:
    """A Problem for each (field, value) whose string value holds a control character not in ``allowed``."""
    return [
        Problem(path, why) for path, value in strings if isinstance(value, str) and (why := _control_at(value, allowed))
    ]


def _control_at(text: str, allowed: str = "") -> str | None:
    """Why ``text`` is refused for a control character (other than those in ``allowed``), or None."""
    match = _CONTROL.search(text.translate({ord(c): " " for c in allowed}) if allowed else text)
    if match is None:
        return None
    return (
        f"contains a control character (U+{ord(match.group()):04X} at character {match.start() + 1}); "
        "only printable text is allowed here"
    )


def foreign_value_problems(data: object) -> list[Problem]:
    """Keys that are not strings, values JSON cannot hold (``!!binary``, ``.nan``), and absurd nesting.

    Iterative on purpose: a recursive walk (or jsonschema after it) would die of RecursionError on ``[[[[...]]]]``.
    """
    problems: list[Problem] = []
    stack: list[tuple[str, int, object]] = [("", 0, data)]
    while stack:
        path, depth, value = stack.pop()
        if depth > MAX_NESTING:
            problems.append(Problem(path, f"is nested more than {MAX_NESTING} levels deep; job files never need that"))
        elif isinstance(value, dict):
            problems += [
                Problem(path, f"key {shown(k)} must be a string (put it in quotes)")
                for k in value
                if not isinstance(k, str)
            ]
            stack += [
                (f"{path}.{field_name(k)}" if path else field_name(k), depth + 1, v)
                for k, v in value.items()
                if isinstance(k, str)
            ]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", depth + 1, item) for i, item in enumerate(value)]
        else:
            problems += _scalar_problems(path, value)
    return problems


def _scalar_problems(path: str, value: object) -> list[Problem]:
    if isinstance(value, float) and not math.isfinite(value):
        return [Problem(path, f"must be a finite number (got {value})")]
    if isinstance(value, HugeInt) or (isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT):
        digits = value.digits if isinstance(value, HugeInt) else len(str(abs(value)))
        return [
            Problem(
                path,
                f"is an integer of {digits} digits; integers here are at most {MAX_INT_DIGITS} digits "
                f"(at most {MAX_INT})",
            )
        ]
    if value is None or isinstance(value, (str, int, float)):
        return []
    what = _FOREIGN_NAMES.get(type(value).__name__, f"a YAML {type(value).__name__}")
    return [Problem(path, f"{what} is not allowed here; write it as a string or number")]


# -- reading --


def read_spec_text(path: Path, follow_symlinks: bool = False, allow_empty: bool = False) -> str | Problem:
    """The file's text, or the one whole-file Problem that stops it; never blocks and never reads past 1 MiB.

    FileNotFoundError propagates: a file that vanished is not the user's mistake to report.
    """
    try:
        st = os.stat(path) if follow_symlinks else os.lstat(path)
    except NotADirectoryError:
        raise FileNotFoundError(str(path)) from None
    problem = _file_kind_problem(st)
    if problem:
        return problem
    try:
        data = _read_at_most(path, MAX_JOB_FILE_BYTES + 1, follow_symlinks)
    except PermissionError:
        return Problem("", "cannot be read (permission denied); make it readable by the watcher")
    except IsADirectoryError:
        return Problem("", "is a directory, not a job file")
    if isinstance(data, Problem):
        return data
    return decode_spec_bytes(data, allow_empty)


def _file_kind_problem(st: os.stat_result) -> Problem | None:
    """Refuse symlinks, anything that is not a regular file, and files over the size limit, before opening."""
    if stat.S_ISLNK(st.st_mode):
        return Problem("", "is a symlink; copy the file into inbox/ instead")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "not a regular file")
        return Problem("", f"is {kind}, not a regular file; job files must be plain files")
    if st.st_size > MAX_JOB_FILE_BYTES:
        return _too_large(st.st_size)
    return None


def _too_large(size: int) -> Problem:
    limit = f"1 MiB ({MAX_JOB_FILE_BYTES} bytes)"
    return Problem("", f"is too large ({size} bytes or more); job files are limited to {limit}")


def _read_at_most(path: Path, limit: int, follow_symlinks: bool) -> bytes | Problem:
    """Read up to ``limit`` bytes; O_NONBLOCK + fstat guard against a FIFO swapped in after lstat."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a symlink between lstat and open
            return Problem("", "is a symlink; copy the file into inbox/ instead")
        raise
    try:
        problem = _file_kind_problem(os.fstat(fd))
        return problem if problem else _read_fd(fd, limit)
    finally:
        os.close(fd)


def _read_fd(fd: int, limit: int) -> bytes | Problem:
    chunks: list[bytes] = []
    total = 0
    while total < limit:
        chunk = os.read(fd, limit - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return _too_large(total) if total > MAX_JOB_FILE_BYTES else b"".join(chunks)


def decode_spec_bytes(data: bytes, allow_empty: bool = False) -> str | Problem:
    """UTF-8 text without NUL bytes, or the Problem saying why not (with the byte offset)."""
    if not data.strip() and not allow_empty:
        return Problem("", "the file is empty; write the job's fields (see schemas/job.schema.json)")
    nul = data.find(b"\x00")
    if nul >= 0:
        return Problem("", f"looks like a binary file, not YAML text (NUL byte at byte offset {nul})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = data[exc.start : exc.start + 1].hex()
        line = data.count(b"\n", 0, exc.start) + 1
        return Problem(
            "", f"is not UTF-8 text (invalid byte 0x{bad} at byte offset {exc.start}, line {line}); save it as UTF-8"
        )
    return text[1:] if text.startswith("\ufeff") else text


def parse_mapping(text: str, what: str = "job fields", allow_empty: bool = False) -> dict | Problem:
    """Parse one YAML 1.2 document that must be a mapping, or return the Problem (with the line)."""
    if not text.strip() and allow_empty:
        return {}
    if not text.strip():
        return Problem("", "the file is empty; write the job's fields (see schemas/job.schema.json)")
    values = text.count("\n") + text.count(",")
    if values > MAX_VALUES:  # counted before parsing: building 200,000 YAML nodes takes seconds
        return Problem("", f"has {values} lines and list items; files here have at most {MAX_VALUES}")
    try:
        data = load_yaml12(text)
    except YamlError as exc:
        return Problem("", str(exc))
    if data is None and allow_empty:
        return {}
    if data is None:
        return Problem("", f"has no {what} (only comments or blank lines)")
    if not isinstance(data, dict):
        got = _TOP_LEVEL_NAMES.get(type(data), f"a {type(data).__name__}")
        return Problem("", f"expected a mapping of {what} at the top level, got {got}")
    return data


def parse_job_text(text: str, display: str) -> JobSpec:
    """Parse and validate a job file's text; InvalidJobSpec(display, problems) on any problem."""
    if "\x00" in text:
        raise InvalidJobSpec(display, [Problem("", "looks like a binary file, not YAML text (it contains NUL)")])
    data = parse_mapping(text)
    if isinstance(data, Problem):
        raise InvalidJobSpec(display, [data])
    return JobSpec.from_dict(data, display)


def load_job_file(path: Path, display: str | None = None) -> JobSpec:
    """Read, parse and validate one job file; InvalidJobSpec lists every problem, FileNotFoundError if gone."""
    path = path if isinstance(path, Path) else Path(path)  # Path(a Path) parses it again
    display = display or str(path)
    text = read_spec_text(path)
    if isinstance(text, Problem):
        raise InvalidJobSpec(display, [text])
    try:
        spec = parse_job_text(text, display)
    except InvalidJobSpec as exc:
        if not is_confidential(path):
            raise
        raise InvalidJobSpec(display, [_withheld(p) for p in exc.problems]) from None
    logger.debug("job file %s: valid (approved=%s)", display, spec.approved)
    return spec


def is_confidential(path: Path) -> bool:
    """A file others may not read that someone else may have put here: its errors quote nothing of it.

    That is a file owned by someone other than the watcher, or one with a second hard link (a
    watcher run as root owns /etc/shadow too). A hard link to such a file in the inbox must not
    turn the watcher into a reader of it; a user's own submission (one link) keeps its quotes.
    """
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return not st.st_mode & stat.S_IROTH and (st.st_uid != os.geteuid() or st.st_nlink > 1)


_NOT_SHOWN = "not shown: the file is not readable by everyone"
#: an unknown key still named in a confidential file's errors: a plain name, not a line's content
_NAME_LIKE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,39}")


def _withheld(problem: Problem) -> Problem:
    """The problem without any text of the file: values, and unknown keys (a line such as
    ``root:$6$...`` parses as one key)."""
    if problem.message.startswith("unknown key '"):
        for start in range(len(problem.path) + 1):  # the key is the path's tail and is quoted first
            key = problem.path[start:]
            if problem.message.startswith(f"unknown key '{key}'"):
                if _NAME_LIKE.fullmatch(key):  # a name such as 'executor' says nothing of the file
                    break
                return Problem(problem.path[:start].rstrip("."), f"an unknown key ({_NOT_SHOWN})")
    message = _GOT.sub(f" (value {_NOT_SHOWN})", problem.message)
    return Problem(problem.path, message)
