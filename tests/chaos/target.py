"""An HTTP command target for the chaos harness: counts deliveries per ``Command-Request-Id``.

A Wow-style command endpoint on 127.0.0.1 (anyio TCP + h11, keep-alive), served in the harness's
own event loop. Each replica is given its own base URL, ``http://127.0.0.1:PORT/<tag>`` where the
tag names the replica's process (one tag per start), so every delivery is known by who sent it
and when it arrived (monotonic clock, the clock the harness stamps its faults with). Targets named
in ``slow`` answer only after ``slow_s`` (a target slower than the timers' claim ttl); every other
request is answered 200 at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from urllib.parse import unquote

import anyio
import h11
from anyio.abc import SocketAttribute, SocketStream, TaskStatus

__all__ = ["CommandTarget", "Delivery"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Delivery:
    request_id: str
    tag: str
    """The base-URL tag of the replica process that sent it."""
    target_id: str
    at: float
    """When the request arrived (``time.monotonic()``)."""


@dataclass(eq=False)
class CommandTarget:
    slow: Collection[str] = ()
    """Aggregate ids whose commands are answered after ``slow_s``."""
    slow_s: float = 0.0
    deliveries: list[Delivery] = field(default_factory=list)
    by_request: dict[str, list[Delivery]] = field(default_factory=dict)
    on_delivery: Callable[[Delivery], None] | None = None
    refused: list[str] = field(default_factory=list)
    """Requests that were not a command delivery (no request id, wrong path or method)."""
    port: int = 0

    def url(self, tag: str) -> str:
        return f"http://127.0.0.1:{self.port}/{tag}"

    def count(self, request_id: str) -> int:
        return len(self.by_request.get(request_id, ()))

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listens on 127.0.0.1 (a free port, :attr:`port`) until cancelled."""
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        async with listener:
            self.port = int(listener.extra(SocketAttribute.local_port))
            task_status.started()
            await listener.serve(self._connection)

    def _record(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> tuple[int, float]:
        parts = [unquote(p) for p in target.decode("ascii", "replace").split("?")[0].split("/") if p]
        rid = next((v.decode() for k, v in headers if k == b"command-request-id"), "")
        # /<tag>/<aggregate>/<id>/<command>
        if method != b"POST" or not rid or len(parts) != 4:
            self.refused.append(f"{method.decode()} {target.decode(errors='replace')} request id {rid!r}")
            return 400, 0.0
        d = Delivery(request_id=rid, tag=parts[0], target_id=parts[2], at=time.monotonic())
        self.deliveries.append(d)
        self.by_request.setdefault(rid, []).append(d)
        if self.on_delivery is not None:
            self.on_delivery(d)
        return 200, (self.slow_s if d.target_id in self.slow else 0.0)

    async def _connection(self, stream: SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        async with stream:
            try:
                while True:
                    request: h11.Request | None = None
                    while True:
                        event = conn.next_event()
                        if event is h11.NEED_DATA:
                            try:
                                data = await stream.receive(65536)
                            except (anyio.EndOfStream, anyio.BrokenResourceError):
                                data = b""
                            conn.receive_data(data)
                            continue
                        if isinstance(event, h11.Request):
                            request = event
                        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                            break
                    if request is None:
                        return
                    status, delay = self._record(request.method, request.target, list(request.headers))
                    if delay:
                        await anyio.sleep(delay)  # the slow target itself
                    body = b'{"ok":true}' if status == 200 else b'{"errorCode":"BadRequest"}'
                    out = conn.send(
                        h11.Response(
                            status_code=status,
                            headers=[("content-type", "application/json"), ("content-length", str(len(body)))],
                        )
                    )
                    for part in (h11.Data(data=body), h11.EndOfMessage()):
                        out = (out or b"") + (conn.send(part) or b"")
                    await stream.send(out)
                    if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                        return
                    conn.start_next_cycle()
            except (h11.RemoteProtocolError, h11.LocalProtocolError, anyio.BrokenResourceError, OSError) as exc:
                log.debug("target connection dropped: %s", exc)
