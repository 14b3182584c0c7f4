"""One HTTP/1.1 listener: ``/metrics``, ``/healthz``, ``/readyz`` (anyio TCP + h11, no framework),
and the paths of an ``app`` (the status page: ``/ui``, ``/api/``) handed to it whole.

Each connection serves one request and closes. Nothing a client sends, or leaves unsent, can stop
the listener or make it hold more than it bounds:

- at most ``max_connections`` connections at once: a client beyond it waits in the kernel's
  backlog, and at the cap the connection that has waited longest without a request is closed to
  make room (so a flood of idle connections never keeps a probe out);
- a client that has not sent its whole request within ``REQUEST_TIMEOUT_S`` is dropped, and so is
  one that takes more than ``WRITE_TIMEOUT_S`` to take each 64 KiB of its answer (a reader that
  does not read);
- an ``accept`` that fails for want of descriptors or memory (``EMFILE`` ...) closes the oldest
  idle connection, is logged (at most once a minute), and is tried again after a growing pause;
- a request whose ``Host`` is neither an address, ``localhost`` nor a name the settings allow is
  answered 400: a page of another site that made its name point here (DNS rebinding) reads
  nothing.

A gauge that needs a store call (the outbox depth) is refreshed right before each ``/metrics``
exposition: the listener waits at most ``REFRESH_TIMEOUT_S`` for the refresh and then serves the
last values; a refresh still running is joined by the next scrape, never started twice.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import h11
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskGroup, TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from wowd.errors import ConfigError
from wowd.metrics import HTTP_CONNECTIONS, HTTP_REFUSED, REGISTRY
from wowd.ratelog import RateLimitedLog
from wowd.retry import Backoff, Pauses
from wowd.ui.http import HttpRequest, HttpResponse

__all__ = [
    "APP_PREFIXES",
    "MAX_BODY_BYTES",
    "MAX_CONNECTIONS",
    "HttpRequest",
    "HttpResponse",
    "HttpServer",
    "host_allowed",
]

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0
"""How long a client may take to send its request (head and body): an idle or dripping one is
dropped after it."""
WRITE_TIMEOUT_S = 10.0
"""How long a client may take to take each :data:`WRITE_CHUNK` of its answer: one that does not
read is dropped after it, and its answer freed."""
WRITE_CHUNK = 64 * 1024
MAX_CONNECTIONS = 256
"""Connections served at once unless the settings say otherwise (``http.max_connections``)."""
ACCEPT_PAUSE = Backoff(0.05, 1.0)
"""After an ``accept`` that failed for want of resources with no idle connection to close, the
pause (doubling from 50 ms to 1 s while the failures last)."""
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_GONE_BEFORE_ACCEPT = frozenset({errno.ECONNABORTED, errno.ECONNRESET, errno.EPROTO, errno.EPERM})
"""What ``accept`` answers for a client that left (or a firewall refused) before it was taken."""
REFRESH_TIMEOUT_S = 1.0
"""How long a scrape waits for the gauges refreshed at scrape time before serving the last values."""
APP_PREFIXES = ("/ui", "/api/")
"""The paths given to the ``app`` (when one is set)."""
MAX_BODY_BYTES = 64 * 1024
"""The largest request body the ``app`` is given (a form); a larger one is answered 413."""
_TEXT = "text/plain; charset=utf-8"


App = Callable[[HttpRequest], Awaitable[HttpResponse]]


def host_allowed(host: str | None, allowed: Sequence[str]) -> bool:
    """Whether a request's ``Host`` header names this listener: none (HTTP/1.0), an IP address,
    ``localhost`` (or a name under it), or a name of ``allowed`` (``example.com``; ``.example.com``:
    it and every name under it; ``*``: any). A port is ignored; names compare without case and
    without a final dot."""
    if host is None:
        return True
    name = host.strip().lower()
    if name.startswith("["):  # [v6]:port
        literal, sep, _ = name[1:].partition("]")
        name = literal if sep else name
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.rstrip(".")
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if name == "localhost" or name.endswith(".localhost"):
        return True
    for entry in allowed:
        e = entry.lower().rstrip(".")
        if e == "*" or name == e or (e.startswith(".") and (name == e[1:] or name.endswith(e))):
            return True
    return False


class _Conn:
    """A connection served: ``idle`` until its request head arrived; ``scope`` cancels its work;
    ``done`` is set once it is closed."""

    __slots__ = ("done", "idle", "scope", "stream")

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.idle = True
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()


def _abort(stream: SocketStream) -> None:
    """Makes the close of ``stream`` a reset: what it still had to send is discarded by the kernel
    too (a client that does not read keeps nothing of ours)."""
    try:
        raw: socket.socket = stream.extra(SocketAttribute.raw_socket)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except (OSError, anyio.TypedAttributeLookupError):
        pass


class HttpServer:
    """Serves the health and metrics endpoints. ``ready(holding)`` decides ``/readyz``: it answers
    ``(ok, why)``; ``/readyz`` asks whether the replica functions (holder or standby),
    ``/readyz?holding=1`` whether it also holds a slot. A 503's body says why. ``refresh``, when
    given, is awaited before each ``/metrics`` exposition (at most :data:`REFRESH_TIMEOUT_S`):
    it updates the gauges read from a store, and handles its own store errors. ``app``, when
    given, answers every request under :data:`APP_PREFIXES` (its body read first, at most
    :data:`MAX_BODY_BYTES`); an exception it raises is logged and answered 500.
    ``max_connections``, ``allowed_hosts`` and the timeouts bound what a client may hold (the
    module's docstring)."""

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
        max_connections: int = MAX_CONNECTIONS,
        allowed_hosts: Sequence[str] = (),
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ) -> None:
        self._host = host
        self._port = port
        self._ready = ready
        self._registry = registry
        self._port_file = port_file
        self._refresh = refresh
        self._app = app
        self._max_connections = max_connections
        self._allowed_hosts = tuple(allowed_hosts)
        self._request_timeout_s = request_timeout_s
        self._write_timeout_s = write_timeout_s
        self._refreshing: anyio.Event | None = None
        self._refresh_late = False
        self._tasks: TaskGroup | None = None
        self._conns: dict[int, _Conn] = {}
        """The connections served now, oldest first."""
        self._freed: anyio.Event | None = None
        self._rlog = RateLimitedLog(log)
        self.bound_port: int | None = None

    @property
    def connections(self) -> int:
        """Connections served now."""
        return len(self._conns)

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Binds, reports the bound port through ``task_status`` (and the port file), serves
        until cancelled."""
        try:
            listener = await anyio.create_tcp_listener(local_host=self._host, local_port=self._port)
        except OSError as exc:
            if isinstance(exc, socket.gaierror) or exc.errno in (errno.EADDRNOTAVAIL, errno.EINVAL):
                raise ConfigError(f"WOWD_HTTP__HOST: cannot listen on {self._host!r}: {exc.strerror or exc}") from None
            if exc.errno == errno.EACCES:
                raise ConfigError(
                    f"WOWD_HTTP__PORT: port {self._port} needs a privilege this process lacks (take one above 1023)"
                ) from None
            raise
        async with listener:
            port = int(listener.extra(SocketAttribute.local_port))
            self.bound_port = port
            if self._app is not None:
                shown = "localhost" if self._host in ("0.0.0.0", "::", "") else self._host
                shown = f"[{shown}]" if ":" in shown else shown
                log.info(
                    "http listening on %s:%d: the status page at http://%s:%d/ui (its JSON under /api/v1), "
                    "/metrics /healthz /readyz",
                    self._host,
                    port,
                    shown,
                    port,
                )
            else:
                log.info("http listening on %s:%d (/metrics /healthz /readyz)", self._host, port)
            if self._port_file is not None:
                tmp = self._port_file.with_name(self._port_file.name + ".tmp")
                tmp.write_text(f"{port}\n")
                tmp.replace(self._port_file)
            task_status.started(port)
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                for one in listener.listeners:  # one per address family of the host
                    assert isinstance(one, SocketListener)
                    tasks.start_soon(self._accept_loop, one, tasks)

    async def _accept_loop(self, listener: SocketListener, tasks: TaskGroup) -> None:
        pauses = Pauses(ACCEPT_PAUSE)
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno in _GONE_BEFORE_ACCEPT:
                    continue
                if exc.errno not in _OUT_OF_RESOURCES:
                    raise
                await self._accept_failed(exc, pauses)
                continue
            pauses.reset()
            while len(self._conns) >= self._max_connections and self._close_oldest_idle() is None:
                # every connection is answering a request: the next one waits for one of them
                freed = self._freed = anyio.Event()
                await freed.wait()
            tasks.start_soon(self._serve_connection, stream)

    async def _accept_failed(self, exc: OSError, pauses: Pauses) -> None:
        """After an ``accept`` that found no descriptor (or memory): closes the oldest idle
        connection and waits until its descriptor is free, or, with none idle, pauses."""
        HTTP_REFUSED.labels(reason="accept").inc()
        closed = self._close_oldest_idle()
        self._rlog.log(
            "accept",
            logging.WARNING,
            "http: accept failed (%s) with %d connections open: %s "
            "(raise the descriptor limit, LimitNOFILE, or lower WOWD_HTTP__MAX_CONNECTIONS)",
            os.strerror(exc.errno or 0),
            len(self._conns),
            "the oldest idle one closed" if closed is not None else "none idle, accepting again after a pause",
        )
        if closed is not None:  # its descriptor is free once it is closed: accept again then
            await closed.done.wait()
            await anyio.lowlevel.checkpoint()
        else:
            await pauses.pause()

    def _close_oldest_idle(self) -> _Conn | None:
        """Closes the connection that has waited longest without a request (answers it; ``None``:
        none waits)."""
        for key, conn in self._conns.items():
            if conn.idle:
                del self._conns[key]
                HTTP_CONNECTIONS.dec()
                HTTP_REFUSED.labels(reason="cap").inc()
                _abort(conn.stream)
                conn.scope.cancel()
                return conn
        return None

    async def _serve_connection(self, stream: SocketStream) -> None:
        conn = _Conn(stream)
        key = id(conn)
        self._conns[key] = conn
        HTTP_CONNECTIONS.inc()
        try:
            with conn.scope:
                await self._handle(conn)
        finally:
            conn.done.set()
            if self._conns.pop(key, None) is not None:
                HTTP_CONNECTIONS.dec()
            if self._freed is not None:
                self._freed.set()
                self._freed = None

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

    async def _handle(self, c: _Conn) -> None:
        conn = h11.Connection(h11.SERVER)
        stream = c.stream
        try:
            async with stream:
                request: h11.Request | None = None
                with anyio.move_on_after(self._request_timeout_s) as reading:
                    request = await self._read_request(conn, stream)
                if reading.cancelled_caught:
                    HTTP_REFUSED.labels(reason="request timeout").inc()
                    _abort(stream)
                if request is None:
                    return
                c.idle = False
                method = request.method.decode("ascii", "replace")
                path = request.target.decode("ascii", "replace")
                host = next((v.decode("latin-1") for k, v in request.headers if k == b"host"), None)
                if not host_allowed(host, self._allowed_hosts):
                    HTTP_REFUSED.labels(reason="host").inc()
                    self._rlog.log(
                        "host",
                        logging.WARNING,
                        "http: %s %s refused: Host %r is not an address, localhost or a name of http.allowed_hosts "
                        "(WOWD_HTTP__ALLOWED_HOSTS)",
                        method,
                        path.partition("?")[0][:100],
                        host[:100] if host else host,
                    )
                    body = b"the Host header names no address or name this listener answers to\n"
                    await self._respond(c, conn, 400, _TEXT, body, len(body))
                    return
                if self._app is not None and path.startswith(APP_PREFIXES):
                    answer = await self._call_app(c, conn, request, method, path)
                    await self._respond(
                        c,
                        conn,
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
                await self._respond(c, conn, status, ctype, b"" if method == "HEAD" else body, len(body))
        except h11.RemoteProtocolError:
            try:
                await self._respond(c, conn, 400, _TEXT, b"bad request\n", 12)
            except (h11.LocalProtocolError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass

    async def _call_app(
        self, c: _Conn, conn: h11.Connection, request: h11.Request, method: str, path: str
    ) -> HttpResponse:
        assert self._app is not None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        body = bytearray()
        with anyio.move_on_after(self._request_timeout_s) as scope:
            while True:
                event: Any = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await c.stream.receive(65536)
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > MAX_BODY_BYTES:
                        return HttpResponse(413, _TEXT, b"request body too large\n")
                    continue
                break
        if scope.cancelled_caught:
            return HttpResponse(408, _TEXT, b"request timeout\n")
        client = c.stream.extra(SocketAttribute.remote_address, None)
        peer = str(client[0]) if isinstance(client, tuple) else str(client or "")
        try:
            return await self._app(HttpRequest(method, path, headers, bytes(body), peer))
        except Exception:
            log.exception("http: %s %s failed", method, path.partition("?")[0])
            return HttpResponse(500, _TEXT, b"internal error (logged)\n")

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

    async def _respond(
        self,
        c: _Conn,
        conn: h11.Connection,
        status: int,
        ctype: str,
        body: bytes,
        length: int,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """Sends the answer, each :data:`WRITE_CHUNK` within the write timeout; a client that
        does not take it in time is dropped (its connection reset, the answer freed)."""
        headers = [
            ("content-type", ctype),
            ("content-length", str(length)),
            ("connection", "close"),
            ("cache-control", "no-store"),
            *extra,
        ]
        parts = [conn.send(h11.Response(status_code=status, headers=headers)) or b""]
        if body:
            parts.append(conn.send(h11.Data(data=body)) or b"")
        parts.append(conn.send(h11.EndOfMessage()) or b"")
        total = sum(map(len, parts))
        sent = 0
        for part in parts:
            for start in range(0, len(part), WRITE_CHUNK):
                chunk = part[start : start + WRITE_CHUNK] if len(part) > WRITE_CHUNK else part
                with anyio.move_on_after(self._write_timeout_s) as scope:
                    await c.stream.send(chunk)
                if scope.cancelled_caught:
                    HTTP_REFUSED.labels(reason="slow reader").inc()
                    self._rlog.log(
                        "slow reader",
                        logging.WARNING,
                        "http: a client took more than %.0f s to take %d bytes of its answer (%d of %d sent): dropped",
                        self._write_timeout_s,
                        len(chunk),
                        sent,
                        total,
                    )
                    _abort(c.stream)
                    return
                sent += len(chunk)
