"""The `trainq serve` web app (starlette): status, the live page, and server-sent event streams of the files.

Read-only by construction: every route is GET (HEAD), and nothing here opens a file for writing.
A stream reads the job's file from an offset, sends whole lines, then sleeps until inotify says the
folder changed (or the keepalive is due). Ids are looked up in the four state folders by name only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trainq.watcher.cli.serve.feed import JobFeed
from trainq.watcher.cli.serve.watch import QueueWatch
from trainq.watcher.faces.live import live_page
from trainq.watcher.faces.stream import (
    READ_BYTES,
    JobPlace,
    file_size,
    find_job,
    read_from,
    resume_offset,
    split_log,
    split_records,
    sse,
)
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.fsutil import read_json

#: seconds between keepalive comments on an idle stream (proxies and browsers drop silent connections)
KEEPALIVE_S = 15.0
#: how long a browser waits before it reconnects a dropped stream (ms; sent as the SSE ``retry:`` field)
RETRY_MS = 1000
#: reads kept for other streams of the same job, and the largest kept (a client catching up reads alone)
SHARED_READS = 256
SHARED_READ_BYTES = 64 * 1024
#: host names a loopback-bound server answers to (others are DNS rebinding from a web page)
LOCAL_HOSTS = ["127.0.0.1", "localhost", "::1", "[::1]"]
#: how long the token's cookie lasts in the browser (seconds); a fresh token (a restart) invalidates it sooner
COOKIE_MAX_AGE_S = 7 * 24 * 3600
#: headers of every stream: no caching, no proxy buffering
_SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


class _BearerToken:
    """ASGI middleware: every request carries the token (docs/serve.md; Jupyter's token login is the model).

    ``Authorization: Bearer T``; or ``?token=T`` (what the printed URL carries; EventSource cannot send
    headers), which also sets a cookie (HttpOnly, SameSite=Strict; an HMAC of the token, never the token)
    so the page opened from that URL, and a later visit to the bare address, need no token in the URL.
    """

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token.encode()
        self.cookie_value = hmac.new(self.token, b"trainq-serve-cookie", hashlib.sha256).hexdigest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        how = self._allowed(request)
        if how is None:
            response = PlainTextResponse(
                "trainq serve: missing or wrong token (open the URL trainq serve printed, or send "
                "Authorization: Bearer TOKEN; without --token it is in ROOT/.trainq-serve.token)\n",
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        if how != "query":
            await self.app(scope, receive, send)
            return
        cookie = (
            f"{_cookie_name(scope)}={self.cookie_value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={COOKIE_MAX_AGE_S}"
        )

        async def send_with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_cookie)

    def _allowed(self, request: Request) -> str | None:
        """How the request proved it holds the token ("header", "query", "cookie"), or None."""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            return "header" if hmac.compare_digest(given.strip().encode(), self.token) else None
        query = request.query_params.get("token")
        if query is not None:
            return "query" if hmac.compare_digest(query.strip().encode(), self.token) else None
        cookie = request.cookies.get(_cookie_name(request.scope), "")
        return "cookie" if hmac.compare_digest(cookie.encode(), self.cookie_value.encode()) else None


def _cookie_name(scope: Scope) -> str:
    """One cookie per port: browsers share cookies between the ports of a host."""
    server = scope.get("server") or ("", 0)
    return f"trainq-serve-{server[1]}"


class ServeApp:
    """The routes, over one queue root; ``watch`` and ``feed`` exist while the app runs (lifespan)."""

    def __init__(self, root: Path, keepalive_s: float = KEEPALIVE_S, polling: bool = False) -> None:
        self.root = Path(root)
        self.keepalive_s = keepalive_s
        self.polling = polling
        #: recent reads shared by streams at the same offset (insertion order: the oldest go first)
        self._reads: dict[tuple, tuple[bytes, str, int]] = {}
        self.watch: QueueWatch | None = None
        self.feed: JobFeed | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self.watch = QueueWatch(self.root, asyncio.get_running_loop(), polling=self.polling)
        self.watch.start()
        self.feed = JobFeed(self.root)
        tasks = [
            asyncio.create_task(self.feed.run(self.watch)),
            asyncio.create_task(self.watch.keep_alive(self.keepalive_s)),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            self.watch.stop()

    # -- plain files ---------------------------------------------------------------------------------

    async def status(self, _request: Request) -> Response:
        try:
            data = (self.root / "status.json").read_bytes()
        except OSError:
            return _no_status(self.root, "status.json")
        return Response(data, media_type="application/json", headers={"Cache-Control": "no-store"})

    async def page(self, _request: Request) -> Response:
        try:
            page = (self.root / "status.html").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return _no_status(self.root, "status.html")
        return HTMLResponse(live_page(page), headers={"Cache-Control": "no-store"})

    # -- streams -------------------------------------------------------------------------------------

    async def log(self, request: Request) -> Response:
        return self._file_stream(request, lambda p: p.log, split_log_events)

    async def metrics(self, request: Request) -> Response:
        return self._file_stream(request, lambda p: p.metrics, split_metric_events)

    def _file_stream(self, request: Request, file_of: Callable[[JobPaths], Path], split) -> Response:
        job_id = request.path_params["job_id"]
        place = find_job(self.root, job_id)
        if place is None:
            return PlainTextResponse(f"no job {job_id!r} in {self.root}\n", status_code=404)
        path = file_of(place.paths)
        start = resume_offset(
            request.headers.get("last-event-id"),
            request.query_params.get("from"),
            path,
            request.query_params.get("tail"),
        )
        if place.ended and not read_from(path, start, 1):
            return Response(status_code=204)  # ended, and the client has it all: EventSource stops here
        return StreamingResponse(
            self._follow_file(place, file_of, split, start), media_type="text/event-stream", headers=_SSE_HEADERS
        )

    async def _follow_file(self, place: JobPlace, file_of, split, offset: int) -> AsyncIterator[str]:
        assert self.watch is not None
        follower = self.watch.follow(place.job_id)
        follower.moved = True  # look again once subscribed: the job may have moved since the request came in
        try:
            yield f"retry: {RETRY_MS}\n\n"
            while True:
                if follower.moved:
                    follower.moved = False
                    moved_to = find_job(self.root, place.job_id)
                    if moved_to is None:
                        yield sse(json.dumps({"id": follower.job_id, "state": None, "status": "removed"}), "end")
                        return
                    place = moved_to
                follower.watch(place.paths.dir)
                ended = place.ended  # read before the file: once ended, nothing writes to it any more
                data, events, used = self._read(place, file_of, split, offset, ended)
                if not data and offset and file_size(file_of(place.paths)) < offset:
                    # shorter than what was sent: the job moved on (its folder is elsewhere now), or
                    # the file was truncated or replaced (never by trainq): then the new one from its start
                    now = find_job(self.root, place.job_id)
                    if now is None or now.state != place.state:
                        follower.moved = True
                        continue
                    if file_of(place.paths).exists():
                        offset = 0
                        self.watch.generation += 1  # a change no event reported yet: reads kept are stale
                        continue
                if events:
                    yield events
                offset += used
                if len(data) >= READ_BYTES:
                    continue
                if ended:
                    yield sse(json.dumps(_end(place)), "end")
                    return
                if not await follower.wait():
                    yield ": keepalive\n\n"
        finally:
            follower.close()

    def _read(self, place: JobPlace, file_of, split, offset: int, ended: bool) -> tuple[bytes, str, int]:
        """Bytes from ``offset``, their events and the bytes they used; one read serves every stream of the
        job waiting at the same offset, until a job folder reports another change."""
        assert self.watch is not None  # streams run only once start() made it
        path = file_of(place.paths)
        key = (str(path), offset, ended, split, self.watch.generation)
        if key in self._reads:
            return self._reads[key]
        data = read_from(path, offset)
        events, used = split(data, offset, ended and len(data) < READ_BYTES)
        if len(data) <= SHARED_READ_BYTES:
            self._reads[key] = (data, events, used)
            while len(self._reads) > SHARED_READS:
                self._reads.pop(next(iter(self._reads)))
        return data, events, used

    async def events(self, request: Request) -> Response:
        return StreamingResponse(
            self._follow_feed(request.headers.get("last-event-id")),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )

    async def _follow_feed(self, last_event_id: str | None) -> AsyncIterator[str]:
        assert self.feed is not None
        listener, first = self.feed.subscribe(last_event_id)
        try:
            yield f"retry: {RETRY_MS}\n\n" + "".join(sse(data, kind, event_id) for kind, event_id, data in first)
            while True:
                try:
                    kind, event_id, data = await asyncio.wait_for(listener.queue.get(), self.keepalive_s)
                except asyncio.TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                if listener.overflowed:
                    return  # too far behind: the client reconnects and catches up from its Last-Event-ID
                yield sse(data, kind, event_id)
        finally:
            self.feed.unsubscribe(listener)


def split_log_events(data: bytes, offset: int, final: bool) -> tuple[str, int]:
    """SSE text for the log pieces in ``data`` (read at ``offset``), and the bytes consumed."""
    pieces, used = split_log(data, offset, final)
    return "".join(sse(p.text, p.kind, p.end) for p in pieces), used


def split_metric_events(data: bytes, offset: int, final: bool) -> tuple[str, int]:
    """SSE text for the metrics records in ``data`` (read at ``offset``), and the bytes consumed."""
    records, used = split_records(data, offset, final)
    return "".join(sse(record, None, end) for end, record in records), used


def _end(place: JobPlace) -> dict:
    run = None
    with contextlib.suppress(OSError):
        run = read_json(place.paths.run)
    status = run.get("status") if isinstance(run, dict) else None
    return {"id": place.job_id, "state": place.state, "status": status or place.state}


async def _no_icon(_request: Request) -> Response:
    return Response(status_code=204)


def _no_status(root: Path, name: str) -> Response:
    return PlainTextResponse(
        f"{root / name} does not exist yet: is `trainq watch` running on {root}?\n", status_code=503
    )


def create_app(
    root: Path,
    *,
    token: str | None = None,
    local_only: bool = True,
    keepalive_s: float = KEEPALIVE_S,
    allow_origins: list[str] | None = None,
    polling: bool = False,
) -> Starlette:
    """The ASGI app for ``root``: token check, host check on a loopback bind, CORS for the origins named."""
    serve = ServeApp(root, keepalive_s, polling)
    routes = [
        Route("/", serve.page, methods=["GET"]),
        Route("/status", serve.status, methods=["GET"]),
        Route("/jobs/{job_id}/log", serve.log, methods=["GET"]),
        Route("/jobs/{job_id}/metrics", serve.metrics, methods=["GET"]),
        Route("/events", serve.events, methods=["GET"]),
        Route("/favicon.ico", _no_icon, methods=["GET"]),  # browsers ask; a 404 would be logged as an error
    ]
    middleware = []
    if allow_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=allow_origins,
                allow_methods=["GET"],
                allow_headers=["Authorization", "Last-Event-ID"],
            )
        )
    if local_only:
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=LOCAL_HOSTS))
    if token:
        middleware.append(Middleware(_BearerToken, token=token))
    return Starlette(routes=routes, middleware=middleware, lifespan=serve.lifespan)
