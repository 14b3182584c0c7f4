"""What the delivery tests share: a claimed timer as the stream hands it to a gateway, and local
HTTP targets (aiohttp.web over sockets) answering as a test scripts them."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from aiohttp import web

from tests.factories import ref, timer
from wowd.model import Claim, Command, Timer, TimerStatus


def claimed(
    tenant: str = "(0)", agg_id: str = "order-1", name: str = "expire-order", aggregate: str = "order"
) -> Timer:
    """Timer ``t1`` of ``aggregate`` ``agg_id`` (of ``tenant``), claimed under fence 7, sending
    ``name`` (typed ``demo.Expire``, its body ``{"reason": "late"}``) to itself."""
    return timer(
        owner=ref(agg_id, aggregate=aggregate, tenant=tenant),
        due_at=1000,
        scheduled_at=900,
        timer_id="t1",
        partition=3,
        command=Command(name=name, body={"reason": "late"}, body_type="demo.Expire"),
        status=TimerStatus.FIRING,
        claim=Claim(owner_key="host:1:abc", fence=7, until=1000),
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Target:
    """A local HTTP server (aiohttp.web on 127.0.0.1) answering every path with ``handler``;
    ``gate`` holds the handlers that wait on it (set before the server stops)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.gate = anyio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append((request.method, request.path_qs, {k.lower(): v for k, v in request.headers.items()}, body))
        return await self.handler(request)


@asynccontextmanager
async def serving(handler: Handler, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[tuple[Target, str]]:
    """A :class:`Target` of ``handler`` serving (TLS with ``ssl_context``); answers it and its
    base URL."""
    target = Target(handler)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", target.handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    port = runner.addresses[0][1]
    scheme = "https" if ssl_context else "http"
    try:
        yield target, f"{scheme}://127.0.0.1:{port}/api"
    finally:
        target.gate.set()
        await runner.cleanup()


def status(code: int, **kw: Any) -> Handler:
    """A handler answering every request ``code`` (``kw``: the response's body and type)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=code, **kw)

    return handler
