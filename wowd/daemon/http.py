"""One HTTP/1.1 listener: ``/metrics``, ``/healthz``, ``/readyz`` (anyio TCP + h11, no framework),
and the paths of an ``app`` (the status page: ``/ui``, ``/api/``) handed to it whole.

Each connection serves one request and closes. A slow or malformed client is dropped after
``REQUEST_TIMEOUT_S``; nothing a client sends can stop the listener.

A gauge that needs a store call (the outbox depth) is refreshed right before each ``/metrics``
exposition: the listener waits at most ``REFRESH_TIMEOUT_S`` for the refresh and then serves the
last values; a refresh still running is joined by the next scrape, never started twice.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import h11
from anyio.abc import SocketAttribute, SocketStream, TaskGroup, TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from wowd.metrics import REGISTRY
from wowd.ui.http import HttpRequest, HttpResponse

__all__ = ["APP_PREFIXES", "HttpRequest", "HttpResponse", "HttpServer", "MAX_BODY_BYTES"]

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0
REFRESH_TIMEOUT_S = 1.0
"""How long a scrape waits for the gauges refreshed at scrape time before serving the last values."""
APP_PREFIXES = ("/ui", "/api/")
"""The paths given to the ``app`` (when one is set)."""
MAX_BODY_BYTES = 64 * 1024
"""The largest request body the ``app`` is given (a form); a larger one is answered 413."""


App = Callable[[HttpRequest], Awaitable[HttpResponse]]


class HttpServer:
    """Serves the health and metrics endpoints. ``ready(holding)`` decides ``/readyz``: it answers
    ``(ok, why)``; ``/readyz`` asks whether the replica functions (holder or standby),
    ``/readyz?holding=1`` whether it also holds a slot. A 503's body says why. ``refresh``, when
    given, is awaited before each ``/metrics`` exposition (at most :data:`REFRESH_TIMEOUT_S`):
    it updates the gauges read from a store, and handles its own store errors. ``app``, when
    given, answers every request under :data:`APP_PREFIXES` (its body read first, at most
    :data:`MAX_BODY_BYTES`); an exception it raises is logged and answered 500."""

    def __init__(
        self,
        host: str,
        port: int,
        ready: Callable[[bool], tuple[bool, str]],
        *,
        registry: CollectorRegistry = REGISTRY,
        port_file: Path | None = None,
        refresh: Callable[[], Awaitable[None]] | None = None,
        app: App | None = None,
    ) -> None:
        self._host = host
        self._port = port
        self._ready = ready
        self._registry = registry
        self._port_file = port_file
        self._refresh = refresh
        self._app = app
        self._refreshing: anyio.Event | None = None
        self._refresh_late = False
        self._tasks: TaskGroup | None = None
        self.bound_port: int | None = None

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Binds, reports the bound port through ``task_status`` (and the port file), serves
        until cancelled."""
        listener = await anyio.create_tcp_listener(local_host=self._host, local_port=self._port)
        async with listener:
            port = int(listener.extra(SocketAttribute.local_port))
            self.bound_port = port
            log.info("http listening on %s:%d (/metrics /healthz /readyz)", self._host, port)
            if self._port_file is not None:
                tmp = self._port_file.with_name(self._port_file.name + ".tmp")
                tmp.write_text(f"{port}\n")
                tmp.replace(self._port_file)
            task_status.started(port)
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                await listener.serve(self._handle, task_group=tasks)

    async def _refreshed(self) -> None:
        """Runs ``refresh`` (or joins the one running) and waits for it, within
        :data:`REFRESH_TIMEOUT_S`; one that takes longer goes on and serves a later scrape."""
        if self._refresh is None or self._tasks is None:
            return
        done = self._refreshing
        if done is None:
            done = self._refreshing = anyio.Event()
            self._tasks.start_soon(self._run_refresh, self._refresh, done)
        with anyio.move_on_after(REFRESH_TIMEOUT_S):
            await done.wait()
            self._refresh_late = False
            return
        if not self._refresh_late:
            log.warning(
                "metrics: a store gauge was not refreshed within %.1f s; serving its last value", REFRESH_TIMEOUT_S
            )
        self._refresh_late = True

    async def _run_refresh(self, refresh: Callable[[], Awaitable[None]], done: anyio.Event) -> None:
        try:
            await refresh()
        except Exception:
            log.exception("metrics: refreshing the store gauges failed")
        finally:
            self._refreshing = None
            done.set()

    def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", b"method not allowed\n"
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        if path == "/healthz":
            return 200, "text/plain; charset=utf-8", b"ok\n"
        route, _, query = path.partition("?")
        if route == "/readyz":
            holding = "holding=1" in query.split("&")
            ok, why = self._ready(holding)
            if ok:
                return 200, "text/plain; charset=utf-8", f"ready: {why}\n".encode()
            return 503, "text/plain; charset=utf-8", f"not ready: {why}\n".encode()
        return 404, "text/plain; charset=utf-8", b"not found\n"

    async def _handle(self, stream: SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            async with stream:
                request: h11.Request | None = None
                with anyio.move_on_after(REQUEST_TIMEOUT_S):
                    request = await self._read_request(conn, stream)
                if request is None:
                    return
                method = request.method.decode("ascii", "replace")
                path = request.target.decode("ascii", "replace")
                if self._app is not None and path.startswith(APP_PREFIXES):
                    answer = await self._call_app(conn, stream, request, method, path)
                    await self._respond(
                        conn,
                        stream,
                        answer.status,
                        answer.content_type,
                        b"" if method == "HEAD" else answer.body,
                        len(answer.body),
                        answer.headers,
                    )
                    return
                if path == "/metrics" and method in ("GET", "HEAD"):
                    await self._refreshed()
                status, ctype, body = self._route(method, path)
                await self._respond(conn, stream, status, ctype, b"" if method == "HEAD" else body, len(body))
        except h11.RemoteProtocolError:
            try:
                await self._respond(conn, stream, 400, "text/plain; charset=utf-8", b"bad request\n", 12)
            except (h11.LocalProtocolError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass

    async def _call_app(
        self, conn: h11.Connection, stream: SocketStream, request: h11.Request, method: str, path: str
    ) -> HttpResponse:
        assert self._app is not None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        body = bytearray()
        with anyio.move_on_after(REQUEST_TIMEOUT_S) as scope:
            while True:
                event: Any = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive(65536)
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > MAX_BODY_BYTES:
                        return HttpResponse(413, "text/plain; charset=utf-8", b"request body too large\n")
                    continue
                break
        if scope.cancelled_caught:
            return HttpResponse(408, "text/plain; charset=utf-8", b"request timeout\n")
        try:
            return await self._app(HttpRequest(method, path, headers, bytes(body)))
        except Exception:
            log.exception("http: %s %s failed", method, path.partition("?")[0])
            return HttpResponse(500, "text/plain; charset=utf-8", b"internal error (logged)\n")

    @staticmethod
    async def _read_request(conn: h11.Connection, stream: SocketStream) -> h11.Request | None:
        while True:
            event: Any = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await stream.receive(65536)
                except anyio.EndOfStream:
                    data = b""
                conn.receive_data(data)
                if not data and conn.their_state is h11.MUST_CLOSE:
                    return None
                continue
            if isinstance(event, h11.Request):
                return event
            if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                return None

    @staticmethod
    async def _respond(
        conn: h11.Connection,
        stream: SocketStream,
        status: int,
        ctype: str,
        body: bytes,
        length: int,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> None:
        headers = [
            ("content-type", ctype),
            ("content-length", str(length)),
            ("connection", "close"),
            ("cache-control", "no-store"),
            *extra,
        ]
        data = conn.send(h11.Response(status_code=status, headers=headers))
        if data:
            await stream.send(data)
        if body:
            chunk = conn.send(h11.Data(data=body))
            if chunk:
                await stream.send(chunk)
        end = conn.send(h11.EndOfMessage())
        if end:
            await stream.send(end)
