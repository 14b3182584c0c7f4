"""Command delivery: where a fired timer's command goes (DESIGN.md section 5, "Firing").

``CommandGateway.send(timer)`` answers one of :class:`Delivered`, :class:`Retry`, :class:`Park`,
:class:`Fail`; it never raises for a failure of the target or the transport. ``deliver`` sends a
batch and reports each outcome through a callback as soon as it is known, so a caller cancelled
mid-batch (shutdown grace, lost lease) still settles what was delivered.

- :class:`OutboxGateway` inserts into the backend's outbox (unique on the request id); it has a
  batch path (one ``put_many`` call per batch).
- :class:`HttpGateway` POSTs to a Wow-style command endpoint with ``Command-Request-Id``.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias
from urllib.parse import quote

import anyio
import httpx

from wowd import metrics
from wowd.config import GatewaySettings
from wowd.errors import StorageError, StorageUnavailable
from wowd.model import DEFAULT_TENANT, OutboxEntry, Timer
from wowd.stores.base import Outbox

__all__ = [
    "CommandGateway",
    "Delivered",
    "Fail",
    "HttpGateway",
    "Outcome",
    "OutboxGateway",
    "Park",
    "Record",
    "Retry",
    "command_url",
    "deliver_concurrently",
    "outcome_for_status",
]

log = logging.getLogger(__name__)

OUTBOX_HOUSEKEEPING_S = 60.0
"""How often (at most) the outbox gateway trims the outbox and counts its depth."""

MAX_ANSWER_BYTES = 4096
"""How much of an answer's body is read (for an error reason); the rest is discarded."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivered:
    """The target took the command (or had it already: a re-fire with the same request id)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """Try again later; ``after_s`` is the target's hint (0: use the backoff)."""

    reason: str
    after_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Park:
    """The target cannot take the command now (e.g. it does not exist yet)."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Fail:
    """The command is refused for good."""

    reason: str


Outcome: TypeAlias = Delivered | Retry | Park | Fail
Record: TypeAlias = Callable[[Timer, Outcome], None]


class CommandGateway(Protocol):
    async def send(self, timer: Timer) -> Outcome:
        """Delivers one timer's command; never raises for a target or transport failure."""
        ...

    async def deliver(self, timers: Sequence[Timer], record: Record) -> None:
        """Delivers a batch, calling ``record(timer, outcome)`` for each as soon as it is known."""
        ...

    async def aclose(self) -> None: ...


async def deliver_concurrently(
    send: Callable[[Timer], Any], timers: Sequence[Timer], record: Record, concurrency: int
) -> None:
    """Runs ``send`` over ``timers`` with at most ``concurrency`` in flight (worker tasks, not one
    task per timer)."""
    if not timers:
        return
    it = iter(timers)

    async def worker() -> None:
        for t in it:
            record(t, await send(t))

    async with anyio.create_task_group() as tg:
        for _ in range(min(concurrency, len(timers))):
            tg.start_soon(worker)


def _now_ms() -> int:
    return int(time.time() * 1000)


def outbox_entry(timer: Timer, now_ms: int) -> OutboxEntry:
    claim = timer.claim
    return OutboxEntry(
        request_id=timer.request_id,
        timer_id=timer.timer_id,
        target=timer.target,
        command=timer.body,
        scheduled_at=timer.scheduled_at,
        fence=claim.fence if claim else 0,
        owner_key=claim.owner_key if claim else "",
        created_at=now_ms,
    )


class OutboxGateway:
    """Delivers into the backend's outbox, unique on the request id (a re-fire is a no-op).

    The fence and owner key written with each entry are those of the timer's claim; a batch is
    one ``put_many`` call. At most every :data:`OUTBOX_HOUSEKEEPING_S`, after a delivery, it
    trims the entries older than ``retention_s`` (0: none) and counts the outbox into
    ``wowd_outbox_depth``.
    """

    def __init__(self, outbox: Outbox, *, retention_s: float = 0.0) -> None:
        self._outbox = outbox
        self._retention_ms = int(retention_s * 1000)
        self._housekept_at: float | None = None

    async def housekeep(self) -> None:
        """Trims past the retention and updates ``wowd_outbox_depth``; a store failure is
        logged and left for the next time (deliveries do not depend on it)."""
        self._housekept_at = time.monotonic()
        try:
            if self._retention_ms > 0:
                trimmed = await self._outbox.trim(_now_ms() - self._retention_ms)
                if trimmed:
                    log.info("outbox: trimmed %d entries older than the retention", trimmed)
            metrics.OUTBOX_DEPTH.set(await self._outbox.count())
        except StorageError as exc:
            log.warning("outbox housekeeping failed (will retry): %s", exc)

    async def _maybe_housekeep(self) -> None:
        last = self._housekept_at
        if last is None or time.monotonic() - last >= OUTBOX_HOUSEKEEPING_S:
            await self.housekeep()

    async def send(self, timer: Timer) -> Outcome:
        try:
            await self._outbox.put(outbox_entry(timer, _now_ms()))
        except StorageUnavailable as exc:
            return Retry(reason=f"outbox unavailable: {exc}")
        except StorageError as exc:
            return Retry(reason=f"outbox error: {exc}")
        return Delivered()

    async def deliver(self, timers: Sequence[Timer], record: Record) -> None:
        """One ``put_many`` for the batch: a re-fire of a request id is not a second delivery."""
        now = _now_ms()
        outcome: Outcome
        try:
            await self._outbox.put_many([outbox_entry(t, now) for t in timers])
            outcome = Delivered()
        except StorageUnavailable as exc:
            outcome = Retry(reason=f"outbox unavailable: {exc}")
        except StorageError as exc:
            outcome = Retry(reason=f"outbox error: {exc}")
        for t in timers:
            record(t, outcome)
        await self._maybe_housekeep()

    async def aclose(self) -> None:
        return None


def command_url(base: str, timer: Timer) -> str:
    """``{base}/[tenant/{tenant_id}/]{aggregate}/{id}/{command}`` (Wow's REST shape); each path
    part percent-encoded; the tenant part only for a tenant other than the default."""
    t = timer.target
    parts: list[str] = []
    if t.tenant_id != DEFAULT_TENANT:
        parts += ["tenant", t.tenant_id]
    parts += [t.aggregate, t.id, timer.command.name]
    return base.rstrip("/") + "/" + "/".join(quote(p, safe="") for p in parts)


def _retry_after(value: str | None) -> float:
    if not value:
        return 0.0
    try:
        return max(0.0, min(float(value), 3600.0))
    except ValueError:
        return 0.0


def outcome_for_status(status: int, retry_after: str | None = None, detail: str = "") -> Outcome:
    """2xx delivered; 404 park; 409, 429, 5xx retry; any other status fails."""
    reason = f"HTTP {status}" + (f": {detail}" if detail else "")
    if 200 <= status < 300:
        return Delivered()
    if status == 404:
        return Park(reason=reason)
    if status in (408, 409, 425, 429) or status >= 500:
        return Retry(reason=reason, after_s=_retry_after(retry_after))
    return Fail(reason=reason)


def _ssl_verify(settings: GatewaySettings) -> ssl.SSLContext | bool:
    if not settings.verify_certs:
        return False
    if settings.ca_certs is not None:
        return ssl.create_default_context(cafile=str(settings.ca_certs))
    return True


class HttpGateway:
    """POSTs each command to its target's endpoint, ``Command-Request-Id: timer.request_id``.

    The credential (``token``) goes as ``Authorization: Bearer`` or, with ``api_key_header``, in
    that header; it is never logged nor put in a reason. TLS verification is on unless disabled;
    ``ca_certs`` names a CA bundle. The whole exchange is bounded by ``timeout_s``; at most
    :data:`MAX_ANSWER_BYTES` of an answer are read.
    """

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        concurrency: int = 64,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        if not settings.url:
            raise ValueError("gateway url is required for the http gateway")
        self._base = settings.url
        self._timeout = settings.timeout_s
        self._concurrency = concurrency
        headers = {"content-type": "application/json", "accept": "application/json"}
        if settings.token is not None:
            secret = settings.token.get_secret_value()
            if settings.api_key_header:
                headers[settings.api_key_header] = secret
            else:
                headers["authorization"] = f"Bearer {secret}"
        self._owns = client is None
        self._client = client or httpx.AsyncClient(
            verify=_ssl_verify(settings),
            timeout=httpx.Timeout(settings.timeout_s),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            follow_redirects=False,
        )
        self._headers = headers

    async def send(self, timer: Timer) -> Outcome:
        try:
            command = timer.command
            url = command_url(self._base, timer)
            body = json.dumps(dict(command.body), separators=(",", ":")).encode()
        except (ValueError, KeyError, TypeError) as exc:
            return Fail(reason=f"unreadable command: {exc}")
        headers = dict(self._headers)
        headers["command-request-id"] = timer.request_id
        if command.body_type:
            headers["command-type"] = command.body_type
        try:
            with anyio.fail_after(self._timeout):
                async with self._client.stream("POST", url, content=body, headers=headers) as resp:
                    detail = ""
                    if not 200 <= resp.status_code < 300:
                        detail = await self._read_detail(resp)
                    return outcome_for_status(resp.status_code, resp.headers.get("retry-after"), detail)
        except TimeoutError:
            return Retry(reason=f"timeout after {self._timeout}s")
        except httpx.TimeoutException:
            return Retry(reason="timeout")
        except httpx.TransportError as exc:
            return Retry(reason=f"transport error: {type(exc).__name__}")
        except httpx.HTTPError as exc:
            return Retry(reason=f"http error: {type(exc).__name__}")
        except (ValueError, UnicodeError) as exc:
            return Fail(reason=f"request refused: {type(exc).__name__}")

    async def probe(self) -> int:
        """One ``HEAD`` of the base URL with the credentials and TLS settings of a delivery;
        answers the HTTP status (any status: the endpoint answers). Raises
        :class:`~wowd.errors.StorageUnavailable` when nothing answers (connection, TLS, timeout)."""
        try:
            with anyio.fail_after(self._timeout):
                resp = await self._client.head(self._base, headers=self._headers)
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise StorageUnavailable(f"gateway {self._base}: no answer within {self._timeout}s") from exc
        except httpx.HTTPError as exc:
            raise StorageUnavailable(f"gateway {self._base}: {type(exc).__name__}: {exc}") from exc
        return resp.status_code

    @staticmethod
    async def _read_detail(resp: httpx.Response) -> str:
        buf = b""
        try:
            if resp.is_stream_consumed:
                buf = resp.content[:MAX_ANSWER_BYTES]
            else:
                async for chunk in resp.aiter_bytes():
                    buf += chunk
                    if len(buf) >= MAX_ANSWER_BYTES:
                        break
        except httpx.HTTPError:
            return ""
        text = buf[:MAX_ANSWER_BYTES].decode("utf-8", "replace")
        try:
            doc = json.loads(text)
        except ValueError:
            return " ".join(text.split())[:200]
        if isinstance(doc, dict):
            msg = doc.get("errorMsg") or doc.get("message") or doc.get("errorCode") or ""
            return str(msg)[:200]
        return ""

    async def deliver(self, timers: Sequence[Timer], record: Record) -> None:
        await deliver_concurrently(self.send, timers, record, self._concurrency)

    async def aclose(self) -> None:
        if self._owns:
            await self._client.aclose()
