"""Helpers for the `trainq serve` tests: a real server process on a loopback ephemeral port, and a raw SSE reader."""

from __future__ import annotations

import http.client
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CHATTY = REPO / "tests" / "fake_trainers" / "chatty.py"


class Server:
    """``python -m trainq.watcher serve`` on 127.0.0.1; ``port``, ``token`` and ``url`` read back from its first
    line. Requests carry the token (``Authorization: Bearer``) unless ``auth=False``."""

    def __init__(self, root: Path, *args: str, port: int = 0) -> None:
        argv = [sys.executable, "-m", "trainq.watcher", "--root", str(root), "serve", "--port", str(port), *args]
        self.log = root.parent / "serve.stderr"
        self.proc = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=open(self.log, "ab"), text=True
        )
        first = self.proc.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:(\d+)/\?token=(\S+))", first)
        if not found:
            self.stop()
            raise AssertionError(f"trainq serve did not start: {first!r}\n{self.log.read_text()[-2000:]}")
        self.url, self.port, self.token = found.group(1), int(found.group(2)), found.group(3)

    def headers(self, headers: dict | None, auth: bool) -> dict:
        """``headers`` plus the bearer token (unless ``auth`` is False or they name Authorization)."""
        given = dict(headers or {})
        if auth and not any(k.lower() == "authorization" for k in given):
            given["Authorization"] = f"Bearer {self.token}"
        return given

    def get(
        self, path: str, headers: dict | None = None, method: str = "GET", auth: bool = True
    ) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, headers=self.headers(headers, auth))
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def stream(self, path: str, headers: dict | None = None, auth: bool = True) -> SseReader:
        return SseReader(self.port, path, self.headers(headers, auth))

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self.proc.stdout.close()


@dataclass
class Event:
    kind: str
    id: str | None
    data: str


@dataclass
class SseReader:
    """One server-sent-events response, read event by event (comments kept apart)."""

    port: int
    path: str
    headers: dict
    comments: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        self.conn.request("GET", self.path, headers=self.headers)
        self.resp = self.conn.getresponse()
        self.status = self.resp.status

    def next(self) -> Event | None:
        """The next event; None at the end of the stream."""
        kind, event_id, data = "message", None, []
        while True:
            raw = self.resp.readline()
            if not raw:
                return None
            line = raw.decode("utf-8").rstrip("\n")
            if line == "":
                if data or event_id is not None:
                    return Event(kind, event_id, "\n".join(data))
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "":
                self.comments.append(value)
            elif name == "event":
                kind = value
            elif name == "id":
                event_id = value
            elif name == "data":
                data.append(value)

    def until(self, pred, limit: int = 100_000) -> list[Event]:
        """Events up to and including the first for which ``pred`` holds (or the end of the stream)."""
        got = []
        for _ in range(limit):
            event = self.next()
            if event is None:
                break
            got.append(event)
            if pred(event):
                break
        return got

    def close(self) -> None:
        self.conn.close()


def chatty_job(*args: str, **fields: object) -> str:
    """An approved job file running tests/fake_trainers/chatty.py with ``args``."""
    job = {"approved": True, "command": [sys.executable, str(CHATTY), *args], **fields}
    return yaml.safe_dump(job, sort_keys=False)
