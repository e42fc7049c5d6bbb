"""The watcher's own settings: ``ROOT/watcher.yaml`` checked against schemas/watcher.schema.json.

Built once (by the ``trainq`` command, watcher/cli/main.py) and passed down; a bad file stops start-up with
one line per problem. While the watcher runs, ``LiveSettings`` re-reads the file when it changes
(docs/settings.md). Pools (docs/cli.md) live here too: watcher.yaml names them, and ``ROOT/pause.POOL.flag``
pauses one.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainq.watcher.spec.allow import command_problem
from trainq.watcher.spec.contract import ENV_SIMULATE_GPUS
from trainq.watcher.spec.errors import InvalidJobSpec, InvalidWatcherConfig, Problem
from trainq.watcher.spec.jobspec import (
    SCHEMAS_DIR,
    JobSpec,
    control_problems,
    duration_problems,
    foreign_value_problems,
    parse_mapping,
    read_spec_text,
)
from trainq.watcher.spec.schema_errors import schema_problems, schema_validator, shown, sort_problems
from trainq.watcher.spec.units import is_zero_duration, iso_utc, parse_duration_s
from trainq.watcher.spec.wall import Cost, Window, watcher_wall_problems

logger = logging.getLogger(__name__)

#: the settings file inside the queue root (docs/settings.md)
WATCHER_FILE = "watcher.yaml"
WATCHER_SCHEMA = "watcher.schema.json"
#: where jobs run
EXECUTORS = ("local", "slurm")
#: settings that are durations and must be > 0 (a zero interval would spin the loop)
_POSITIVE_DURATIONS = ("rescan_s", "status_s", "heartbeat_s")
_DURATIONS = ("settle_s", "inbox_settle_s", "rescan_s", "status_s", "heartbeat_s", "kill_after_s")
#: seconds between Slurm job-state polls
DEFAULT_SLURM_POLL_S = 2.0
#: seconds the watcher waits for a node's exit record after Slurm ended the job (NFS caches attributes 60 s)
DEFAULT_SLURM_EXIT_GRACE_S = 60.0
#: the longest wait between two Slurm polls while nothing changes (s)
DEFAULT_SLURM_POLL_MAX_S = 30.0
#: how often a Slurm job's node side rewrites heartbeat.json (s)
DEFAULT_SLURM_HEARTBEAT_S = 10.0


def _default_slurm() -> dict:
    return {
        "partition": None,
        "sbatch_args": [],
        "poll_s": DEFAULT_SLURM_POLL_S,
        "exit_grace_s": DEFAULT_SLURM_EXIT_GRACE_S,
        "arrays": True,
        "poll_max_s": DEFAULT_SLURM_POLL_MAX_S,
        "heartbeat_s": DEFAULT_SLURM_HEARTBEAT_S,
        "array_limit": None,
        "node_env": "clean",
    }


@dataclass(frozen=True)
class WatcherConfig:
    """Validated watcher settings; durations are seconds, ``simulate_gpus`` is absolute."""

    max_concurrent: int = 1
    gpus: tuple[int, ...] | None = None
    min_free_ram_gb: float = 0.0
    min_free_disk_gb: float = 0.0
    allow_commands: tuple[str, ...] | None = None
    settle_s: float = 0.3
    #: a job file written in place in inbox/ is taken once closed and unchanged this long (docs/settings.md)
    inbox_settle_s: float = 1.0
    rescan_s: float = 2.0
    status_s: float = 1.0
    heartbeat_s: float = 5.0
    keep_finished: int = 50
    executor: str = "local"
    slurm: dict = field(default_factory=_default_slurm)
    simulate_gpus: Path | None = None
    kill_after_s: float = 5.0
    env_passthrough: tuple[str, ...] | None = None
    window: Window | None = None  # docs/wall.md
    cost: Cost | None = None
    #: names or globs a job's env may set (None: any name, within allow_commands' rules)
    allow_env: tuple[str, ...] | None = None
    #: folders (absolute) a job's cwd may lie in under allow_commands, besides its own folder (docs/settings.md)
    allow_cwd: tuple[str, ...] = ()
    pools: dict = field(default_factory=dict)  # pool name -> max_concurrent (docs/cli.md, pools)

    def pool_limits(self) -> dict[str, int]:
        """Every pool's max_concurrent: ``default`` is max_concurrent unless pools: names it."""
        return {"default": self.max_concurrent, **self.pools}

    @classmethod
    def from_dict(cls, data: Mapping, root: Path | None = None, display: str = WATCHER_FILE) -> WatcherConfig:
        """Validate a settings mapping and build the config; relative ``simulate_gpus`` resolves against ``root``."""
        problems = foreign_value_problems(dict(data)) or sort_problems(
            schema_problems(schema_validator(SCHEMAS_DIR, WATCHER_SCHEMA), dict(data))
            + _interval_problems(data)
            + duration_problems(
                dict(data),
                (
                    *tuple((key,) for key in _DURATIONS),
                    ("slurm", "poll_s"),
                    ("slurm", "poll_max_s"),
                    ("slurm", "heartbeat_s"),
                    ("window", "freeze_before"),
                    ("window", "final_checkpoint_before"),
                ),
            )
            + _string_problems(data)
            + watcher_wall_problems(dict(data))
        )
        if problems:
            raise InvalidWatcherConfig(display, problems)
        return _build(data, root)

    def to_dict(self) -> dict:
        """The watcher.yaml form (seconds for durations); ``from_dict`` turns it back into an equal config."""
        out: dict = {
            "max_concurrent": self.max_concurrent,
            "min_free_ram_gb": self.min_free_ram_gb,
            "min_free_disk_gb": self.min_free_disk_gb,
            "keep_finished": self.keep_finished,
            "executor": self.executor,
            **{key: getattr(self, key) for key in _DURATIONS},
            "slurm": {k: v for k, v in self.slurm.items() if v is not None},
        }
        if self.gpus is not None:
            out["gpus"] = list(self.gpus)
        if self.allow_commands is not None:
            out["allow_commands"] = list(self.allow_commands)
        if self.simulate_gpus is not None:
            out["simulate_gpus"] = str(self.simulate_gpus)
        if self.env_passthrough is not None:
            out["env_passthrough"] = list(self.env_passthrough)
        if self.window is not None:
            out["window"] = {
                "ends_at": iso_utc(self.window.ends_at),
                "freeze_before": self.window.freeze_before_s,
                "final_checkpoint_before": self.window.final_checkpoint_before_s,
            }
        if self.cost is not None:
            out["cost"] = {
                "per_gpu_hour" if self.cost.per_gpu else "per_hour": self.cost.rate,
                "currency": self.cost.currency,
            }
        if self.allow_env is not None:
            out["allow_env"] = list(self.allow_env)
        if self.allow_cwd:
            out["allow_cwd"] = list(self.allow_cwd)
        if self.pools:
            out["pools"] = {name: {"max_concurrent": n} for name, n in self.pools.items()}
        return out


def _interval_problems(data: Mapping) -> list[Problem]:
    """Durations the schema allows (>= 0) but the loop cannot use (0)."""
    checks = [(key, data.get(key)) for key in _POSITIVE_DURATIONS]
    slurm = data.get("slurm")
    if isinstance(slurm, Mapping):
        checks += [(f"slurm.{key}", slurm.get(key)) for key in ("poll_s", "poll_max_s", "heartbeat_s")]
    return [
        Problem(key, f"must be a duration greater than 0 (got {shown(value)})")
        for key, value in checks
        if is_zero_duration(value)
    ]


def _string_problems(data: Mapping) -> list[Problem]:
    """Control characters in the settings that become paths or argv."""
    strings = [("simulate_gpus", data.get("simulate_gpus"))]
    for key in ("allow_commands", "env_passthrough", "allow_env", "allow_cwd"):
        if isinstance(data.get(key), list):
            strings += [(f"{key}[{i}]", item) for i, item in enumerate(data[key])]
    slurm = data.get("slurm")
    if isinstance(slurm, Mapping):
        strings.append(("slurm.partition", slurm.get("partition")))
        if isinstance(slurm.get("sbatch_args"), list):
            strings += [(f"slurm.sbatch_args[{i}]", a) for i, a in enumerate(slurm["sbatch_args"])]
    return control_problems(strings)


def _build(data: Mapping, root: Path | None) -> WatcherConfig:
    """A WatcherConfig from a valid mapping, applying the documented defaults."""
    defaults = WatcherConfig()
    slurm = {**_default_slurm(), **data.get("slurm", {})}
    slurm["poll_s"] = parse_duration_s(slurm["poll_s"])
    slurm["exit_grace_s"] = parse_duration_s(slurm["exit_grace_s"])
    for key in ("poll_max_s", "heartbeat_s"):
        if slurm.get(key) is not None:
            slurm[key] = parse_duration_s(slurm[key])
    slurm["sbatch_args"] = list(slurm["sbatch_args"])
    gpus, allowed, passthrough = data.get("gpus"), data.get("allow_commands"), data.get("env_passthrough")
    return WatcherConfig(
        max_concurrent=int(data.get("max_concurrent", defaults.max_concurrent)),
        gpus=None if gpus is None else tuple(int(g) for g in gpus),
        min_free_ram_gb=float(data.get("min_free_ram_gb", 0.0)),
        min_free_disk_gb=float(data.get("min_free_disk_gb", 0.0)),
        allow_commands=None if allowed is None else tuple(allowed),
        env_passthrough=None if passthrough is None else tuple(passthrough),
        allow_env=None if data.get("allow_env") is None else tuple(data["allow_env"]),
        allow_cwd=tuple(str(_resolve(folder, root)) for folder in data.get("allow_cwd") or ()),
        keep_finished=int(data.get("keep_finished", defaults.keep_finished)),
        executor=data.get("executor", defaults.executor),
        slurm=slurm,
        simulate_gpus=_resolve(data.get("simulate_gpus"), root),
        window=Window.from_dict(data["window"]) if data.get("window") else None,
        cost=Cost.from_dict(data["cost"]) if data.get("cost") else None,
        pools={name: int(p["max_concurrent"]) for name, p in (data.get("pools") or {}).items()},
        **{key: parse_duration_s(data.get(key, getattr(defaults, key))) for key in _DURATIONS},
    )


def _resolve(path: str | None, root: Path | None) -> Path | None:
    """``~`` expanded; a relative path is taken relative to the queue root (else the current folder)."""
    if not path:
        return None
    resolved = Path(os.path.expanduser(path))
    if not resolved.is_absolute() and root is not None:
        resolved = Path(os.path.abspath(root)) / resolved
    return Path(os.path.abspath(resolved))


def load_watcher_config(root: Path, env: Mapping[str, str]) -> WatcherConfig:
    """Read ``root/watcher.yaml`` when present (defaults otherwise); ``TRAINQ_SIMULATE_GPUS`` overrides simulate_gpus.

    Raises InvalidWatcherConfig("watcher.yaml", problems) listing every problem.
    """
    path = Path(root) / WATCHER_FILE
    config = WatcherConfig.from_dict(_read_settings(path), root) if os.path.lexists(path) else WatcherConfig()
    simulated = env.get(ENV_SIMULATE_GPUS)
    if simulated:
        # the variable is typed in a shell, so a relative path means the shell's folder, not the queue root
        config = replace(config, simulate_gpus=_resolve(simulated, None))
    logger.debug("watcher config from %s: %s", path, config)
    return config


def _read_settings(path: Path) -> dict:
    """watcher.yaml as a mapping ({} when empty); a symlink to a regular file is fine here."""
    text = read_spec_text(path, follow_symlinks=True, allow_empty=True)
    data = text if isinstance(text, Problem) else parse_mapping(text, "settings", allow_empty=True)
    if isinstance(data, Problem):
        raise InvalidWatcherConfig(WATCHER_FILE, [data])
    return data


def passed_through(env: Mapping[str, str], patterns: tuple[str, ...] | None) -> dict[str, str]:
    """The part of the watcher's environment jobs and hooks get: all of it without ``env_passthrough``,
    else the variables whose names match one of its names or globs (``*``, ``?``, ``[...]``; case matters)."""
    if patterns is None:
        return dict(env)
    return {k: v for k, v in env.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}


def check_command_allowed(
    spec: JobSpec, config: WatcherConfig, values: Mapping[str, str] | None = None, path_env: str | None = None
) -> Problem | None:
    """A Problem when a job may not start under ``allow_commands``, ``allow_env`` and ``allow_cwd`` (allow.py).

    ``values`` are the placeholder values (job_dir, job_id, ...); ``path_env`` the watcher's PATH
    (default: this process's).
    """
    path_env = os.environ.get("PATH", os.defpath) if path_env is None else path_env
    return command_problem(spec, config.allow_commands, values or {}, path_env, config.allow_env, config.allow_cwd)


# -- pools (docs/cli.md): like pueue groups or Slurm partitions --

#: a pool's name: also part of its pause flag's file name
POOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FLAG = re.compile(r"^pause\.([A-Za-z0-9_-]{1,64})\.flag$")


def pool_pause_flag(root: Path, pool: str) -> Path:
    """``ROOT/pause.POOL.flag``: present, no job of POOL starts."""
    return Path(root) / f"pause.{pool}.flag"


def paused_pools(root: Path, names: Iterable[str] | None = None) -> set[str]:
    """The pools whose pause flag is present at the root (``names``: the root's listing, when read already)."""
    if names is None:
        try:
            names = os.listdir(root)
        except OSError:
            return set()
    return {m.group(1) for m in map(_FLAG.match, names) if m}


def unknown_pool_words(pool: str, limits: dict[str, int]) -> str | None:
    """Why a job's pool cannot run here (None: watcher.yaml has it, or it is the default pool)."""
    if pool in limits:
        return None
    return f"pool {pool!r} is not in watcher.yaml pools (known: {', '.join(sorted(limits))})"


# -- watcher.yaml is live (docs/settings.md) --

#: settings held by parts built at start-up, which a running watcher cannot swap: the executor (and so
#: its Slurm options), the GPU probe that reads simulate_gpus, and the hook runner's environment
#: (env_passthrough: jobs and hooks get the same variables, so both wait for the restart)
RESTART_ONLY = ("executor", "slurm", "simulate_gpus", "env_passthrough")
#: more of them with executor: slurm, whose executor copies this when it is built
RESTART_ONLY_SLURM = ("kill_after_s",)


class LiveSettings:
    """The watcher's settings as watcher.yaml says now, within what a running watcher can apply."""

    def __init__(self, root: Path, config: WatcherConfig, env: Mapping[str, str], now: float):
        self.path = Path(root) / WATCHER_FILE
        self.root = Path(root)
        self.env = dict(env)
        self.started = config  # the start-up values of the restart-only settings
        self.config = config
        self.loaded_at = now
        self.problems: list[str] = []
        self._seen = _signature(self.path)

    def check(self, now: float) -> WatcherConfig | None:
        """The new settings when watcher.yaml changed and is valid (apply them); None otherwise."""
        seen = _signature(self.path)
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            loaded = load_watcher_config(self.root, self.env)
        except InvalidJobSpec as exc:
            first = exc.lines()[0] if exc.problems else str(exc)
            self.problems = [
                f"{WATCHER_FILE} is invalid, so the settings loaded at {iso_utc(self.loaded_at)} stay in force: "
                f"{first}" + (f" (and {len(exc.problems) - 1} more)" if len(exc.problems) > 1 else "")
            ]
            logger.warning("watcher: %s changed but is invalid; keeping the settings in force: %s", WATCHER_FILE, first)
            return None
        held = [name for name in self._restart_only() if getattr(loaded, name) != getattr(self.started, name)]
        self.config = replace(loaded, **{name: getattr(self.started, name) for name in held})
        self.problems = [
            f"restart to apply: {name} (running with {_shown(getattr(self.started, name))}, "
            f"{WATCHER_FILE} says {_shown(getattr(loaded, name))})"
            for name in held
        ]
        self.loaded_at = now
        logger.info(
            "watcher: %s re-read and applied%s", WATCHER_FILE, f"; restart to apply: {', '.join(held)}" if held else ""
        )
        return self.config

    def _restart_only(self) -> tuple[str, ...]:
        return RESTART_ONLY + (RESTART_ONLY_SLURM if self.started.executor == "slurm" else ())


def _signature(path: Path) -> tuple | None:
    """What tells a changed file: inode, size, mtime and ctime (None when there is no file)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _shown(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items() if v not in (None, [], {})) + "}"
    return str(value)
