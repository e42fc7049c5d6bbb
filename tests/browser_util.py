"""A headless Chromium driven over the DevTools protocol (shared by the browser tests)."""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# -- a DevTools client over --remote-debugging-pipe (no websocket library needed) --------------------------


class Browser:
    """Headless Chromium driven through the DevTools protocol on fds 3/4 (NUL-separated JSON messages)."""

    def __init__(self, profile: Path) -> None:
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def _fds_3_and_4() -> None:
            # dup first so that a pipe end already numbered 3 or 4 is not clobbered by the other dup2
            a, b = os.dup(to_child_r), os.dup(from_child_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        argv = [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--disable-default-apps",
            f"--user-data-dir={profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            argv,
            pass_fds=(3, 4),
            preexec_fn=_fds_3_and_4,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf, self._next_id, self.events = b"", 0, []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.call(f"{domain}.enable", session=True)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1200, "height": 1600, "deviceScaleFactor": 1, "mobile": False},
            session=True,
        )

    def _send(self, method: str, params: dict, session: bool) -> int:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        return self._next_id

    def _receive(self, timeout_s: float) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_child], [], [], left)[0]:
                return None
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise ConnectionError("chromium closed the DevTools pipe")
            self._buf += chunk
        message, self._buf = self._buf.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, params: dict | None = None, session: bool = False, timeout_s: float = 60) -> dict:
        """Send one command and return its result; events that arrive meanwhile are kept in ``events``."""
        wanted = self._send(method, params or {}, session)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = self._receive(deadline - time.monotonic())
            if message is None:
                break
            if message.get("id") != wanted:
                self.events.append(message)
                continue
            if "error" in message:
                raise RuntimeError(f"{method}: {message['error']}")
            return message["result"]
        raise TimeoutError(f"chromium did not answer {method} within {timeout_s}s")

    def evaluate(self, expression: str) -> object:
        """The JSON value of ``expression`` in the page; None while the page is between two loads."""
        try:
            result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=True)
        except RuntimeError:
            return None  # "execution context was destroyed": the page reloaded under us
        if "exceptionDetails" in result:
            return None
        return result["result"].get("value")

    def drain(self) -> None:
        """Collect the events already sent."""
        while (message := self._receive(0.05)) is not None:
            self.events.append(message)

    def console_problems(self) -> list[str]:
        """console.error/assert calls, uncaught exceptions and error log entries seen so far."""
        self.drain()
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params") or {}
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", ())))
            elif method == "Runtime.exceptionThrown":
                found.append(str(params.get("exceptionDetails")))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                found.append(params["entry"].get("text", ""))
        return found

    def requested_urls(self) -> list[str]:
        """Every URL the page asked for, the page itself and its reloads included."""
        self.drain()
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=True)
        path.write_bytes(base64.b64decode(data["data"]))

    def close(self) -> None:
        # chromium leaves helper processes in its session: end them all
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        os.close(self._to_child)
        os.close(self._from_child)
