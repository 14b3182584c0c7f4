"""The http gateway: POSTs to a Wow-style command endpoint with ``Command-Request-Id`` (aiohttp,
one keep-alive connection pool), at most ``per_target_concurrency`` requests in flight per target
and a :class:`~wowd.delivery.breaker.CircuitBreaker` per target; each target goes by its route
(:mod:`wowd.delivery.routes`): URL, credential, time limit, TLS context, signing secrets.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from wowd import metrics
from wowd.config import GatewaySettings, url_shown
from wowd.delivery.routes import Route, Routes
from wowd.errors import StorageUnavailable
from wowd.model import Timer
from wowd.redaction import redact, unescaped

if TYPE_CHECKING:
    import aiohttp
    import yarl


from wowd.delivery.breaker import Admission, CircuitBreaker
from wowd.delivery.commands import UnsafeSegment, request_parts, target_command_url
from wowd.delivery.log import DeliveryLog, delivery_log
from wowd.delivery.outcomes import (
    CIRCUIT_OPEN,
    DELIVERED,
    OUTCOME_NAMES,
    Fail,
    Lane,
    Outcome,
    Record,
    Retry,
    Stopped,
    is_target_failure,
    never_stopped,
    outcome_for_status,
    target_of,
)

MAX_ANSWER_BYTES = 4096
"""How much of an answer's body is read (for an error reason); the rest is discarded."""


def _transport_reason(exc: BaseException) -> str:
    """The error's kind and, for a socket error, the OS's word for it (never a URL or a header)."""
    name = type(exc).__name__
    os_error = getattr(exc, "os_error", None)
    err = os_error if isinstance(os_error, OSError) else exc if isinstance(exc, OSError) else None
    if err is not None and err.strerror:
        return f"transport error: {name} ({err.strerror})"
    return f"transport error: {name}"


class _Slots:
    """A counting limit for one event loop: :meth:`take` answers at once whether a slot was free
    (no coroutine, no task switch), :meth:`wait` queues in order; :meth:`give` hands a slot to the
    first waiter. A waiter cancelled after it was handed a slot passes it on."""

    __slots__ = ("_free", "_waiters")

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiters: deque[asyncio.Future[None]] = deque()

    def take(self) -> bool:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        return False

    async def wait(self) -> None:
        """Until a slot is this caller's (:meth:`take` answered False)."""
        if self.take():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.give()  # handed a slot, then cancelled before it resumed
            else:
                fut.cancel()  # left in the queue: give() skips it
            raise

    def give(self) -> None:
        waiters = self._waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1


class _Target:
    """What the gateway keeps per target: its circuit, its slots and its short-circuit counter."""

    __slots__ = ("_short_circuited", "breaker", "name", "slots")

    def __init__(self, name: str, breaker: CircuitBreaker, slots: int) -> None:
        self.name = name
        self.breaker = breaker
        self.slots = _Slots(slots)
        self._short_circuited: Any = None

    def short_circuit(self, after_s: float) -> Outcome:
        """Counts a send answered without a request (the series appears at the first)."""
        counter = self._short_circuited
        if counter is None:
            counter = self._short_circuited = metrics.GATEWAY_SHORT_CIRCUITED.labels(target=self.name)
        counter.inc()
        return Retry(reason=f"{CIRCUIT_OPEN}{self.name}", after_s=after_s)


class HttpGateway:
    """POSTs each command to its target's endpoint, ``Command-Request-Id: timer.request_id``.

    A target's endpoint, credential, time limit, TLS context and per-target limit are those of
    its route (:class:`~wowd.delivery.routes.Routes`: the first of ``routes`` matching it, else
    ``url``); a timer whose target has no route fails without a request ("no route for ...",
    ``wowd_gateway_unrouted_total``). The credential (``token``) goes as
    ``Authorization: Bearer`` or, with ``api_key_header``, in that header; it is never logged nor
    put in a reason (a target echoing it has it masked). With signing secrets, each request is
    signed (:mod:`wowd.signing`: ``webhook-id`` is the request id). TLS verification is on unless
    disabled; ``ca_certs`` names a CA bundle, else the system's CAs; ``client_cert`` (and
    ``client_key``) is presented to a target asking for one. Each exchange is bounded by
    ``timeout_s``; at most :data:`MAX_ANSWER_BYTES` of an answer are read (an answer left unread
    closes its connection). One connection pool, keep-alive, at most ``concurrency``
    connections and requests in flight, at most ``per_target_concurrency`` per target; a
    :class:`CircuitBreaker` per target. The session is opened on the first send (in the
    running loop) and closed by :meth:`aclose` unless it was given. Its requests ask for no
    compression (``Accept-Encoding: identity``) and it keeps no cookies.
    """

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        concurrency: int = 64,
        session: aiohttp.ClientSession | None = None,
        outcomes: DeliveryLog | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not settings.url and not settings.routes:
            raise ValueError("gateway url or routes are required for the http gateway")
        self._settings = settings
        self._concurrency = concurrency
        headers = {"content-type": "application/json", "accept": "application/json", "accept-encoding": "identity"}
        self._headers = headers
        self._owns = session is None
        self._session = session
        self._outcomes = outcomes or delivery_log
        self._clock = clock
        self._in_flight = _Slots(concurrency)
        self._targets: dict[str, _Target] = {}
        self._lanes: dict[str, Lane] = {}
        self._options: dict[str, dict[str, Any]] = {}
        # the client is loaded and the TLS contexts built (CA bundles, client certificates and
        # keys read) here, at start-up: it takes a tenth of a second or more, which the first
        # delivery would otherwise wait, and an unreadable file is a ConfigError naming its setting
        import aiohttp  # an http gateway's own dependency: an outbox replica never loads it

        self._client_timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
        # an owned session sends the constant headers itself; a given one has them per request
        self._routes = Routes(settings, base_headers={} if self._owns else headers)
        self._secrets = sorted({r.secret for r in self._routes.all if r.secret}, key=len, reverse=True)
        # deliver starts up to this many workers per target; each holds one of the target's slots
        self._per_target = max(r.per_target_concurrency for r in self._routes.all)

    def _open_session(self) -> aiohttp.ClientSession:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self._concurrency, limit_per_host=0)
        self._session = aiohttp.ClientSession(
            connector=connector,
            headers=self._headers,
            timeout=self._client_timeout,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            trust_env=False,
        )
        return self._session

    @property
    def routes(self) -> list[Route]:
        """Every route, the fallback (``url``) last."""
        return self._routes.all

    def _target(self, name: str) -> _Target:
        t = self._targets.get(name)
        if t is None:
            breaker = CircuitBreaker(
                name,
                failures=self._settings.breaker_failures,
                open_s=self._settings.breaker_open_s,
                clock=self._clock,
            )
            route = self._routes.route(name)
            slots = route.per_target_concurrency if route is not None else 1
            t = self._targets[name] = _Target(name, breaker, slots)
        return t

    def lane(self, timer: Timer) -> Lane:
        """A lane per target, its route's ``per_target_concurrency`` requests of it at once."""
        name = target_of(timer)
        lane = self._lanes.get(name)
        if lane is None:
            route = self._routes.route(name)
            limit = route.per_target_concurrency if route is not None else 1
            lane = self._lanes[name] = Lane(name, limit)
        return lane

    def breaker(self, target: str) -> CircuitBreaker:
        """The circuit of ``target`` (created closed)."""
        return self._target(target).breaker

    async def send(self, timer: Timer) -> Outcome:
        return await self._send(timer, self._target(target_of(timer)))

    async def _send(self, timer: Timer, target: _Target, *, holding: bool = False) -> Outcome:
        """``holding``: the caller holds one of the target's slots for this send."""
        request_id = timer.request_id
        route = self._routes.route(target.name)
        if route is None:
            metrics.GATEWAY_UNROUTED.labels(target=target.name).inc()
            unrouted = Fail(reason=f"no route for {target.name}")
            self._outcomes.outcome(target.name, unrouted, request_id)
            return unrouted
        breaker = target.breaker
        refusing = breaker.refusing()
        if refusing is not None:
            outcome = target.short_circuit(refusing)
            self._outcomes.outcome(route.target_label(target.name), outcome, request_id)
            return outcome
        import yarl

        try:
            name, body, body_type = request_parts(timer.body)
            url = yarl.URL(target_command_url(route.url, timer.target, name), encoded=True)
        except (ValueError, KeyError, TypeError) as exc:
            unsafe = isinstance(exc, UnsafeSegment)
            outcome = Fail(reason=f"refused: {exc}" if unsafe else f"unreadable command: {exc}")
            self._outcomes.outcome(route.target_label(target.name), outcome, request_id)
            return outcome
        headers = {**route.headers, "command-request-id": request_id}
        if body_type:
            headers["command-type"] = body_type
        if route.signer is not None:
            headers.update(route.signer.headers(request_id, body))
        slots = target.slots
        if not holding and not slots.take():
            await slots.wait()
        try:
            admission = breaker.admit()  # the circuit may have opened while this send waited
            if admission is Admission.REFUSE:
                outcome = target.short_circuit(breaker.refusing() or 0.0)
            else:
                trial = admission is Admission.TRIAL
                in_flight = self._in_flight
                try:
                    if not in_flight.take():
                        await in_flight.wait()
                    try:
                        outcome, failed = await self._post(route, url, body, headers)
                        route.counted[OUTCOME_NAMES[type(outcome)]].inc()
                    finally:
                        in_flight.give()
                except BaseException:
                    if trial:
                        breaker.abandon_trial()
                    raise
                breaker.record(not failed, trial=trial)
        finally:
            if not holding:
                slots.give()
        if outcome is not DELIVERED:
            self._outcomes.outcome(route.target_label(target.name), outcome, request_id)
        return outcome

    async def probe(self, route: Route | None = None) -> int:
        """One ``HEAD`` of ``route``'s URL (default: the first of :attr:`routes`) with the
        credentials and TLS settings of a delivery; answers the HTTP status (any status: the
        endpoint answers). Raises :class:`~wowd.errors.StorageUnavailable` when nothing answers
        (connection, TLS, timeout)."""
        import aiohttp

        r = route or self._routes.all[0]
        session = self._session or self._open_session()
        try:
            async with session.head(
                r.url,
                headers=r.headers,
                allow_redirects=False,
                proxy=r.proxy,
                ssl=r.ssl,
                timeout=r.client_timeout,
            ) as resp:
                return resp.status
        except TimeoutError as exc:
            raise StorageUnavailable(f"gateway {url_shown(r.url)}: no answer within {r.timeout_s:g}s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise StorageUnavailable(f"gateway {url_shown(r.url)}: {_transport_reason(exc)}") from exc

    async def _post(self, route: Route, url: yarl.URL, body: bytes, headers: dict[str, str]) -> tuple[Outcome, bool]:
        """One exchange on ``route``: the outcome and whether it counts against the target's
        circuit."""
        import aiohttp

        session = self._session or self._open_session()
        try:
            async with session.post(
                url, data=body, headers=headers, allow_redirects=False, **self._request_options(route)
            ) as resp:
                status = resp.status
                if 200 <= status < 300:
                    return DELIVERED, False
                detail = await self._read_detail(resp)
                outcome = outcome_for_status(status, resp.headers.get("retry-after"), detail)
                return outcome, is_target_failure(status)
        except TimeoutError:
            return Retry(reason=f"timeout after {route.timeout_s:g}s"), True
        except aiohttp.InvalidURL:
            return Fail(reason="request refused: invalid URL"), False
        except (aiohttp.ClientError, OSError) as exc:
            return Retry(reason=_transport_reason(exc)), True
        except (ValueError, UnicodeError) as exc:
            return Fail(reason=f"request refused: {type(exc).__name__}"), False

    def _request_options(self, route: Route) -> dict[str, Any]:
        """What a request of ``route`` sets beyond the session's defaults (its proxy, its TLS
        context on an https URL, its own time limit): each option given costs aiohttp work per
        request, so only what differs is given."""
        options = self._options.get(route.name)
        if options is None:
            options = {}
            if route.proxy is not None:
                options["proxy"] = route.proxy
            if route.url.startswith("https:"):  # the connector's default verifies: give ours, also False
                options["ssl"] = route.ssl
            if route.timeout_s != self._settings.timeout_s:
                options["timeout"] = route.client_timeout
            self._options[route.name] = options
        return options

    async def _read_detail(self, resp: aiohttp.ClientResponse) -> str:
        """The reason an answer gives, from at most :data:`MAX_ANSWER_BYTES` of its body; what
        arrived when the body ends early, stalls past the timeout or breaks."""
        import aiohttp

        buf = b""
        try:
            while len(buf) < MAX_ANSWER_BYTES:
                chunk = await resp.content.read(MAX_ANSWER_BYTES - len(buf))
                if not chunk:
                    break
                buf += chunk
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass
        text = buf.decode("utf-8", "replace")
        try:
            doc = json.loads(text)
        except ValueError:  # masked as it reads: a JSON escape (\/, \u0041) does not hide a secret
            return " ".join(redact(unescaped(text), self._secrets).split())[:200]
        if isinstance(doc, dict):
            msg = doc.get("errorMsg") or doc.get("message") or doc.get("errorCode") or ""
            return redact(str(msg), self._secrets)[:200]  # decoded first, then masked
        return ""

    async def deliver(self, timers: Sequence[Timer], record: Record, stopped: Stopped = never_stopped) -> None:
        """Per target, up to ``per_target_concurrency`` workers (a slow target's timers do not
        hold up the other targets'), each holding one of the target's slots while it sends its
        timers one after the other (a batch delivered at the same time as another waits for those
        slots instead of adding requests); at most ``concurrency`` requests in flight in all; none
        starts once ``stopped()``."""
        if not timers:
            return
        groups: dict[str, list[Timer]] = {}
        for t in timers:
            groups.setdefault(target_of(t), []).append(t)
        send = self._send

        async def worker(target: _Target, group: Iterator[Timer]) -> None:
            slots = target.slots
            if not slots.take():
                await slots.wait()
            try:
                for t in group:
                    if stopped():
                        return
                    record(t, await send(t, target, holding=True))
            finally:
                slots.give()

        async with anyio.create_task_group() as tg:
            for name, group in groups.items():
                target = self._target(name)
                it = iter(group)
                for _ in range(min(len(group), self._per_target, self._concurrency)):
                    tg.start_soon(worker, target, it)

    async def aclose(self) -> None:
        if self._owns and self._session is not None:
            await self._session.close()
            self._session = None
