"""Atomic writes (the usual one, and one that publishes before it syncs), and small file reads that tolerate races."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from collections.abc import Callable
from json.encoder import encode_basestring, encode_basestring_ascii  # the C ones where built
from pathlib import Path
from typing import BinaryIO

from trainq.watcher.spec.text import may_hold_secret, redact_strings

#: largest JSON record read (run.json of 100 attempts is ~100 KB; a job could grow its files without bound)
MAX_JSON_BYTES = 16 * 1024 * 1024


def atomic_write(path: str | os.PathLike, data: bytes | str, *, durable: bool = True, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the new one, never a part.

    A temp file beside the target is written, flushed, fsynced (``durable``), then renamed over it.
    """
    path = os.fspath(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp, fd = _temp_holding(path, data, mode)
    try:
        if durable:
            os.fsync(fd)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    finally:
        os.close(fd)
    _rename_over(tmp, path)


def publish_then_sync(path: str | os.PathLike, data: bytes, published: Callable[[], None]) -> None:
    """Write ``data`` atomically (temp file, rename), call ``published``, then fsync the file.

    For a record someone waits on: readers see the whole file at once without waiting for the
    disk, and it is on disk before this returns. Only a power cut in the millisecond between
    the rename and the fsync can leave it empty, which readers take as "no record".
    """
    path = os.fspath(path)
    tmp, fd = _temp_holding(path, data, 0o644)
    try:
        _rename_over(tmp, path)
        published()
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_holding(path: str, data: bytes, mode: int) -> tuple[str, int]:
    """A temp file beside ``path`` with ``data`` written: its name and its still-open fd."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        _write_all(fd, data)
    except BaseException:  # a full disk, most often: the temp file must not stay behind
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    return tmp, fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_new(path: str | os.PathLike, data: str | bytes, mode: int = 0o644) -> None:
    """Create ``path`` (never following a link) holding ``data``: for a file that cannot exist yet, where a temp file
    and a rename would only add the rename. A reader racing it may find it short. FileExistsError if it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        _write_all(fd, data.encode() if isinstance(data, str) else data)
    finally:
        os.close(fd)


def remove_stale_temps(folder: str | os.PathLike[str], names: tuple[str, ...]) -> int:
    """Remove ``NAME.PID.tmp`` files of ``names`` in ``folder`` whose writer (PID) is gone or is us; how many."""
    removed = 0
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for entry in entries:
        if not entry.name.endswith(".tmp"):
            continue
        stem, _, pid = entry.name[: -len(".tmp")].rpartition(".")
        if stem in names and pid.isdigit() and (int(pid) == os.getpid() or not _pid_exists(int(pid))):
            removed += remove_quietly(entry.path)
    return removed


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rename_over(tmp: str, path: str) -> None:
    """Rename ``tmp`` over ``path``; the temp file does not outlive a failure."""
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj: object, *, durable: bool = True, redact: bool = False) -> None:
    """Serialise ``obj`` as indented JSON and write it atomically; 0600 inside a private (0700) folder, else 0644.

    ``redact``: every string in it through ``redact_text`` first (``redacted_json_text``)."""
    text = redacted_json_text(obj) if redact else json_text(obj)
    atomic_write(path, text, durable=durable, mode=mode_beside(path))


def redacted_json_text(obj: object) -> str:
    """``json_text(redact_strings(obj))``, the same text, without walking ``obj`` when nothing in it can be a secret.

    Every credential shape holds one of a few plain substrings (``may_hold_secret``), made of characters JSON never
    escapes, so a string holding one shows it in the text as well: a text without any is the redacted text already
    (most run.json files). A text with one (a token's prefix, a URL's ``user:password@``) is made again from the
    redacted values.
    """
    text = json_text(obj)
    if not may_hold_secret(text):
        return text
    return json_text(redact_strings(obj))


def json_text(obj: object, *, ensure_ascii: bool = False) -> str:
    """``obj`` as the indented JSON every record file holds, ending in a newline.

    The text is ``json.dumps(obj, indent=1)``'s, byte for byte, but made faster: with an indent the standard
    library encodes in pure Python, one generator step per token (a supervisor's records for one trivial job
    cost ~0.15 ms that way). Plain values (dicts with string keys, lists, tuples, strings, numbers, booleans,
    None) are joined here with the C string encoder; anything else (another type, a non-string key, a cycle)
    goes to ``json.dumps``, which raises or converts exactly as before.
    """
    encode = encode_basestring_ascii if ensure_ascii else encode_basestring
    try:
        text = _indented(obj, "\n", encode)
    except (_NotPlain, RecursionError):
        text = json.dumps(obj, indent=1, ensure_ascii=ensure_ascii)
    return text + "\n"


class _NotPlain(Exception):
    """A value ``_indented`` leaves to ``json.dumps``."""


_INFINITY = float("inf")


def _indented(obj: object, newline: str, encode: Callable[[str], str]) -> str:
    """``obj`` as ``json.dumps(obj, indent=1)`` writes it at the depth ``newline`` (a newline and the indent) holds."""
    kind = type(obj)
    if kind is str:
        return encode(obj)  # type: ignore[arg-type]
    if kind is dict:
        if not obj:
            return "{}"
        inner = newline + " "
        parts = []
        for key, value in obj.items():  # type: ignore[attr-defined]
            if type(key) is not str:
                raise _NotPlain
            parts.append(f"{encode(key)}: {encode(value) if type(value) is str else _indented(value, inner, encode)}")
        return "{" + inner + ("," + inner).join(parts) + newline + "}"
    if kind is list or kind is tuple:
        if not obj:
            return "[]"
        inner = newline + " "
        items = [encode(v) if type(v) is str else _indented(v, inner, encode) for v in obj]  # type: ignore[attr-defined]
        return "[" + inner + ("," + inner).join(items) + newline + "]"
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if kind is int:
        return int.__repr__(obj)
    if kind is float:
        if obj != obj:
            return "NaN"
        if obj == _INFINITY:
            return "Infinity"
        if obj == -_INFINITY:
            return "-Infinity"
        return float.__repr__(obj)
    raise _NotPlain


def mode_beside(path: str | os.PathLike) -> int:
    """A file is as private as its folder: 0600 where the folder grants nothing to group and others."""
    try:
        folder_mode = os.stat(os.path.dirname(os.fspath(path)) or ".").st_mode
    except OSError:
        return 0o644
    return 0o600 if not folder_mode & 0o077 else 0o644


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks (checkpoints and deliveries may be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def exists(path: str | os.PathLike) -> bool:
    """Whether ``path`` names something (a symlink is followed), as ``os.path.exists`` says, without raising and
    catching an OSError when it does not: ~1.5 us less for each of the dozen missing flags and files a job's
    passes look for (stop.flag, adapter/, ...)."""
    return os.access(path, os.F_OK)


def read_kernel_file(path: str | os.PathLike, limit: int = 1 << 20) -> bytes:
    """A /proc or /sys file's text, up to ``limit`` bytes: such files say size 0, so read until a read is empty.

    Three system calls and a few reads, where ``open(path).read()`` built a buffered file object (an ioctl, two
    seeks and two fstats more) for each of the lists and counters the loop and the supervisors read every job.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        size = 0
        while size < limit:
            chunk = os.read(fd, min(65536, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def process_start_ticks(pid: int) -> int:
    """When ``pid`` started, in clock ticks after boot: field 22 of /proc/PID/stat (the fields after the command's
    closing parenthesis count from field 3). OSError, ValueError or IndexError where there is no such file or it
    reads otherwise."""
    return int(read_kernel_file(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[19])


def append_line(path: str | os.PathLike, line: str) -> bool:
    """Append ``line`` (one newline at its end) to a text file, creating it; False when the write failed."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line.rstrip("\n") + "\n")
    except OSError:
        return False
    return True


def read_regular(path: str | os.PathLike, limit: int, *, tail: bool = False) -> tuple[bytes, int]:
    """The first (``tail``: last) ``limit`` bytes of a regular file, not through a symlink, and the file's size;
    (b"", 0) for a FIFO, a folder or a device (never waited on). OSError where it cannot be opened.

    One read of the size fstat gives: ``f.read(limit)`` allocated ``limit`` bytes first (16 MiB for every record
    read_json read, 13 us of each small one's 18)."""
    fd = os.open(path, NO_FOLLOW_READ)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return b"", 0
        size = st.st_size
        return os.pread(fd, min(size, limit), max(0, size - limit) if tail else 0), size
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike) -> dict | None:
    """Return the JSON object in ``path``, or None when it is missing, a symlink, or not a JSON object."""
    try:
        obj = json.loads(read_regular(path, MAX_JSON_BYTES)[0])
    except (
        FileNotFoundError,
        NotADirectoryError,
        IsADirectoryError,
        json.JSONDecodeError,
        UnicodeDecodeError,
        RecursionError,
    ):  # RecursionError: '[' * 200,000, written by a job into its folder
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EAGAIN, errno.ENXIO):
            return None  # a symlink or a FIFO put in a job folder: never followed, never waited on
        raise
    return obj if isinstance(obj, dict) else None


#: ``os.open`` flags for reading a file a job could replace (``open_no_follow``)
NO_FOLLOW_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_no_follow(path: str | os.PathLike) -> BinaryIO:
    """Open for reading a file a job could replace (output.log, metrics.jsonl, run.json, ...).

    O_NOFOLLOW: a symlink raises OSError(ELOOP) instead of letting the watcher read a file the
    job's owner cannot; O_NONBLOCK: a FIFO never blocks the loop.
    """
    fd = os.open(path, NO_FOLLOW_READ)
    return os.fdopen(fd, "rb")


def drain(fd: int) -> bool:
    """Read away everything waiting on the non-blocking pipe ``fd``; True at end of file (no writer left).

    A read shorter than asked found the pipe empty: it stops there, without a last read to raise and catch
    EAGAIN (what is written later makes ``fd`` readable again, an end of file included)."""
    try:
        while True:
            got = len(os.read(fd, 4096))
            if got == 0:
                return True
            if got < 4096:
                return False
    except BlockingIOError:
        return False


def touch(path: str | os.PathLike) -> None:
    """Create ``path`` if missing (like ``touch``), leaving an existing file's content alone."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    os.close(fd)


def raise_flag(path: str | os.PathLike, word: str) -> bool:
    """Create the flag ``path`` holding ``word`` (whole, by rename) unless one is there: the first request wins.

    True when this call raised it. The watcher's stop.flag says why it stops the job (docs/contract.md, why a job stopped).
    """
    if os.path.lexists(path):
        return False
    atomic_write(path, word + "\n", durable=False)
    return True


def _unlink_quietly(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_quietly(path: str | os.PathLike) -> bool:
    """Unlink ``path``; True if it existed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def same_filesystem(*paths: Path) -> bool:
    """True when every path lives on one filesystem (so ``rename`` between them is atomic)."""
    return len({os.stat(p).st_dev for p in paths}) <= 1


def is_locked(path: str | os.PathLike) -> bool:
    """True while some process holds a flock on ``path`` (a runner's liveness lock). Probes with a fresh open file
    and a shared lock, released at once, so two probes never see each other; never follows a link or blocks."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False
