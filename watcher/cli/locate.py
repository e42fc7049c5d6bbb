"""Which queue root a command works on: ``--root``, else ``$TRAINQ_ROOT``, else ``./queue``, else the user's config.

The user config is ``config.yaml`` in platformdirs' user config folder for ``trainq``
(``$XDG_CONFIG_HOME/trainq/config.yaml``, by default ``~/.config/trainq/config.yaml``) and holds
one key, ``root: /srv/trainq/queue`` (a relative path is taken from the config file's folder).
When none of these names a queue, the error lists every place that was looked at.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trainq.watcher.spec.contract import ENV_ROOT

#: the queue a command uses when nothing else names one, relative to the working directory
DEFAULT_ROOT = Path("queue")
#: the one key the user config file may hold
CONFIG_KEY = "root"


class RootNotFound(Exception):
    """Raised when no queue root was named and none exists where trainq looks."""

    def __init__(self, looked: list[str]):
        self.looked = looked
        super().__init__(
            "no queue found; looked at "
            + "; ".join(looked)
            + ". Create one with `trainq init DIR`, or pass --root DIR (or set TRAINQ_ROOT)"
        )


class BadUserConfig(Exception):
    """Raised when the user config file exists but does not name a root as ``root: PATH``."""


@dataclass(frozen=True)
class Located:
    """A queue root and how it was found (``--root``, ``TRAINQ_ROOT``, ``./queue`` or the config file)."""

    path: Path
    source: str


def user_config_path(env: dict | os._Environ = os.environ) -> Path:
    """``$XDG_CONFIG_HOME/trainq/config.yaml`` (platformdirs' user config folder on other systems)."""
    xdg = env.get("XDG_CONFIG_HOME")
    if xdg:
        return Path(xdg) / "trainq" / "config.yaml"
    import platformdirs

    return Path(platformdirs.user_config_dir("trainq", appauthor=False)) / "config.yaml"


def locate_root(
    option: str | None, env: dict | os._Environ = os.environ, cwd: Path | None = None, must_exist: bool = True
) -> Located:
    """The queue root to use; RootNotFound (naming where it looked) when ``must_exist`` and none is found."""
    if option:
        return Located(Path(option), "--root")
    if env.get(ENV_ROOT):
        return Located(Path(env[ENV_ROOT]), ENV_ROOT)
    local = (cwd or Path.cwd()) / DEFAULT_ROOT
    if local.is_dir():
        return Located(DEFAULT_ROOT, "./queue")
    config = user_config_path(env)
    configured = read_user_config(config)
    if configured is not None and (configured.is_dir() or not must_exist):
        return Located(configured, str(config))
    if not must_exist:
        return Located(DEFAULT_ROOT, "./queue")
    looked = [
        "--root (not given)",
        f"${ENV_ROOT} (not set)",
        f"./queue ({local} does not exist)",
        f"{config} ({'names ' + str(configured) + ', which does not exist' if configured else 'no such file'})",
    ]
    raise RootNotFound(looked)


def read_user_config(path: Path) -> Path | None:
    """The root the user config names, or None when the file does not exist; BadUserConfig when it is wrong."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadUserConfig(f"{path}: cannot read ({exc})") from None
    from trainq.watcher.spec.yaml12 import load_yaml12

    try:
        data = load_yaml12(text)
    except Exception as exc:  # any YAML error: the message names the line
        raise BadUserConfig(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict) or not isinstance(data.get(CONFIG_KEY), str) or not data[CONFIG_KEY].strip():
        raise BadUserConfig(f"{path}: {CONFIG_KEY}: expected the queue root as a path, e.g. `root: ~/queue`")
    unknown = sorted(set(data) - {CONFIG_KEY})
    if unknown:
        raise BadUserConfig(f"{path}: {unknown[0]}: unknown key (the file holds only `{CONFIG_KEY}: PATH`)")
    root = Path(os.path.expanduser(data[CONFIG_KEY].strip()))
    return root if root.is_absolute() else path.parent / root
