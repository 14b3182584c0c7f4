"""A target's bad answers become an outcome, never a crash: the http gateway against scripted
targets on a real local socket (non-JSON, truncated, huge, trickled, endless, not HTTP, a hang-up,
no answer, a refused connection), each bounded by the gateway's timeout, its reason kept small."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
from anyio.abc import SocketStream

from tests.delivery.conftest import claimed
from wowd.config import GatewaySettings


async def _drain_request(stream: SocketStream) -> None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += await stream.receive(65536)
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(rest) < length:
        rest += await stream.receive(65536)


def answer(status: int, body: bytes, *, ctype: bytes = b"application/json", trickle: float = 0.0) -> Any:
    async def behave(stream: SocketStream) -> None:
        head = b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (status, ctype, len(body))
        await stream.send(head)
        if trickle:
            for i in range(len(body)):
                await stream.send(body[i : i + 1])
                await anyio.sleep(trickle)  # a target that answers too slowly (not a synchronisation)
        else:
            await stream.send(body)

    return behave


async def never_answers(stream: SocketStream) -> None:
    await anyio.sleep_forever()


async def garbage(stream: SocketStream) -> None:
    await stream.send(b"\x00\xffTHIS IS NOT HTTP\r\n\r\n")


async def hangs_up(stream: SocketStream) -> None:
    await stream.aclose()


async def chunked_forever(stream: SocketStream) -> None:
    await stream.send(b"HTTP/1.1 503 X\r\ntransfer-encoding: chunked\r\n\r\n")
    while True:
        await stream.send(b"400\r\n" + b"y" * 1024 + b"\r\n")


@pytest.fixture
async def target() -> AsyncIterator[Callable[[Any], Awaitable[int]]]:
    """Starts scripted targets in the test's task group; answers their ports."""
    async with anyio.create_task_group() as tg:

        async def start(behave: Any) -> int:
            listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)

            async def handle(stream: SocketStream) -> None:
                async with stream:
                    try:
                        await _drain_request(stream)
                        await behave(stream)
                    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        pass

            async def serve() -> None:
                async with listener:
                    await listener.serve(handle)

            tg.start_soon(serve)
            return int(listener.extra(anyio.abc.SocketAttribute.local_port))

        yield start
        tg.cancel_scope.cancel()


HUGE = b"<html>" + b"z" * 8_000_000 + b"</html>"

GATEWAY_CASES: list[tuple[str, Any, str]] = [
    ("non-JSON 500", answer(500, b"<html>Internal Error</html>", ctype=b"text/html"), "Retry"),
    ("non-JSON 200", answer(200, b"OK!!", ctype=b"text/plain"), "Delivered"),
    ("truncated JSON 404", answer(404, b'{"errorMsg": "no such ord'), "Park"),
    ("JSON list 400", answer(400, b"[1, 2, 3]"), "Fail"),
    ("huge 503", answer(503, HUGE, ctype=b"text/html"), "Retry"),
    ("huge 422", answer(422, HUGE, ctype=b"text/html"), "Fail"),
    ("huge 200", answer(200, HUGE), "Delivered"),
    ("slow: no answer", never_answers, "Retry"),
    ("slow: trickled 500 body", answer(500, b"x" * 10_000, trickle=0.01), "Retry"),
    ("endless chunked 503", chunked_forever, "Retry"),
    ("not HTTP", garbage, "Retry"),
    ("hang-up", hangs_up, "Retry"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("case", "behave", "expected"), GATEWAY_CASES, ids=[c[0] for c in GATEWAY_CASES])
async def test_gateway_answers_become_an_outcome_never_a_crash(
    target: Callable[[Any], Awaitable[int]], case: str, behave: Any, expected: str
) -> None:
    from wowd.delivery import HttpGateway

    port = await target(behave)
    timeout_s = 0.2 if case.startswith("slow") else 0.5  # the slow ones end at the timeout
    gw = HttpGateway(GatewaySettings(kind="http", url=f"http://127.0.0.1:{port}/api", timeout_s=timeout_s), pool_size=4)
    try:
        with anyio.fail_after(5):  # bounded by the gateway's own timeout, whatever the target does
            outcome = await gw.send(claimed())
    finally:
        await gw.aclose()
    assert type(outcome).__name__ == expected, (case, outcome)
    reason = getattr(outcome, "reason", "")
    assert len(reason) < 300, "the reason (kept as the timer's last_error) stays small"


@pytest.mark.anyio
async def test_a_refused_connection_is_a_retry() -> None:
    from wowd.delivery import HttpGateway, Retry

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = int(listener.extra(anyio.abc.SocketAttribute.local_port))
    await listener.aclose()  # nobody listens there now
    gw = HttpGateway(GatewaySettings(kind="http", url=f"http://127.0.0.1:{port}", timeout_s=0.5), pool_size=4)
    try:
        with anyio.fail_after(5):
            assert isinstance(await gw.send(claimed()), Retry)
    finally:
        await gw.aclose()
