"""``trainq serve``: a separate, read-only process that streams the queue's files over HTTP (server-sent events).

The watcher neither starts nor knows it; it reads what the watcher and the jobs write. Every request
carries a token (docs/serve.md): ``--token``/``--token-file``, or else a fresh one written to
``ROOT/.trainq-serve.token`` (mode 0600: only the queue's owner reads it), and the URL it prints
carries it. Loopback by default; any other address needs a token given on the command line. The web
stack (starlette, uvicorn) is the optional ``serve`` extra, imported only when the command runs.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import secrets
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from trainq.watcher.spec.fsutil import atomic_write_json, remove_quietly

#: exit statuses (as cli/main.py)
EXIT_OK, EXIT_ERROR, EXIT_INVALID = 0, 1, 2
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
#: a token shorter than this is refused: it guards a network port
MIN_TOKEN_CHARS = 16
#: where a generated token is written, in the queue root (mode 0600)
TOKEN_FILE = ".trainq-serve.token"
#: bytes of randomness in a generated token (hex: twice as many characters)
TOKEN_BYTES = 24


class ServeRefused(Exception):
    """Raised when the options would open the queue's files to the network unprotected, or are unusable."""


def add_serve_command(sub: argparse._SubParsersAction, root_of: Callable[[argparse.Namespace], Path]) -> None:
    """Register ``trainq serve``; ``root_of`` resolves the queue root as cli/main.py does."""
    p = sub.add_parser(
        "serve",
        help="serve status and live streams (server-sent events) of the queue's files, "
        "read-only (needs the serve extra)",
    )
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to bind (default {DEFAULT_HOST}); a non-loopback address needs --token or --token-file",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks a free one)")
    token = p.add_mutually_exclusive_group()
    token.add_argument(
        "--token",
        help="the token every request must carry (visible in ps: prefer --token-file); "
        f"default: a fresh one in ROOT/{TOKEN_FILE}",
    )
    token.add_argument("--token-file", metavar="FILE", help="read the token from the first line of FILE")
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let pages from ORIGIN read the streams (CORS), e.g. an IDE's webview; repeatable",
    )
    p.add_argument("--keepalive-s", type=float, default=15.0, help="seconds between keepalive comments (default 15)")
    p.add_argument(
        "--polling",
        action="store_true",
        help="poll instead of inotify (network filesystems; jobs writing on other machines, as with Slurm)",
    )
    p.set_defaults(func=lambda args: cmd_serve(args, root_of))


def cmd_serve(args: argparse.Namespace, root_of: Callable[[argparse.Namespace], Path]) -> int:
    root = root_of(args)
    try:
        token = read_token(args.token, args.token_file)
        check_bind(args.host, token)
        if not 0 <= args.port <= 65535 or args.keepalive_s <= 0:
            raise ServeRefused(
                f"--port must be 0-65535 and --keepalive-s positive (got {args.port}, {args.keepalive_s})"
            )
        if not root.is_dir():
            raise ServeRefused(f"{root}: no queue here; create one with `trainq init {root}`")
    except ServeRefused as exc:
        print(f"trainq serve: {exc}", file=sys.stderr)
        return EXIT_INVALID
    try:
        import uvicorn

        from trainq.watcher.cli.serve.app import create_app
    except ImportError as exc:
        print(
            f"trainq serve: needs the serve extra ({exc.name} is missing): pip install 'trainq[serve]'", file=sys.stderr
        )
        return EXIT_ERROR
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        print(f"trainq serve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    if token is None:
        try:
            token = write_token(root)
        except OSError as exc:
            sock.close()
            print(f"trainq serve: cannot write {root / TOKEN_FILE}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_ERROR
    app = create_app(
        root,
        token=token,
        local_only=is_loopback(args.host),
        keepalive_s=args.keepalive_s,
        allow_origins=args.allow_origin,
        polling=args.polling,
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    record = announce(root, f"http://{shown}:{port}/")  # before the URL is printed: whoever reads it finds the record
    try:
        print(f"trainq serve: {root} on http://{shown}:{port}/?token={token} (read-only); Ctrl-C stops", flush=True)
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1, lifespan="on")
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        remove_quietly(record)
    return EXIT_OK


def announce(root: Path, url: str) -> Path:
    """ROOT/.trainq-serve.json: the page's URL (never the token) and this pid, so status.html links the page."""
    from trainq.watcher.faces.status import SERVE_RECORD

    path = root / SERVE_RECORD
    try:
        atomic_write_json(path, {"url": url, "pid": os.getpid()}, durable=False)
    except OSError:
        pass  # a read-only queue: the page just is not linked
    return path


def read_token(token: str | None, token_file: str | None) -> str | None:
    """The token from --token or the first line of --token-file; ServeRefused when empty or too short."""
    if token_file is not None:
        try:
            lines = Path(token_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ServeRefused(f"--token-file {token_file}: cannot read it ({exc})") from None
        token = lines[0].strip() if lines else ""
        where = f"--token-file {token_file}"
    else:
        where = "--token"
    if token is None:
        return None
    if len(token.strip()) < MIN_TOKEN_CHARS or any(c.isspace() for c in token.strip()):
        raise ServeRefused(
            f"{where}: the token must be at least {MIN_TOKEN_CHARS} characters without spaces "
            f"(e.g. `openssl rand -hex 16`)"
        )
    return token.strip()


def write_token(root: Path) -> str:
    """A fresh token in ``root/.trainq-serve.token``, mode 0600 from its creation (never readable by others)."""
    token = secrets.token_hex(TOKEN_BYTES)
    path = root / TOKEN_FILE
    tmp = root / f"{TOKEN_FILE}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a killed server that had this pid
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1); any other name or address is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse a non-loopback address without a token: the queue's logs would be open to the network."""
    if not is_loopback(host) and not token:
        raise ServeRefused(
            f"--host {host} is not a loopback address: refusing to serve the queue to the network "
            "without a token; give --token-file FILE (or --token T), clients then send "
            "Authorization: Bearer T"
        )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: the kernel picks a free one; the caller reads it back)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
