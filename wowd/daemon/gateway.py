"""Command delivery: where a fired timer's command goes (DESIGN.md section 5, "Firing").

``CommandGateway.send(timer)`` answers one of :class:`Delivered`, :class:`Retry`, :class:`Park`,
:class:`Fail`; it never raises for a failure of the target or the transport. ``deliver`` sends a
batch and reports each outcome through a callback as soon as it is known, so a caller cancelled
mid-batch (shutdown grace, lost lease) still settles what was delivered.

- :class:`OutboxGateway` inserts into the backend's outbox (unique on the request id); it has a
  batch path (one ``put_many`` call per batch) and, on a backend whose timer store writes into
  the outbox itself (:class:`~wowd.stores.base.OutboxFiring`), a fast path
  (:class:`FusedFiring`): the due timers fired and settled in one transaction, with no claim.
- :class:`HttpGateway` POSTs to a Wow-style command endpoint with ``Command-Request-Id`` (aiohttp,
  one keep-alive connection pool), at most ``per_target_concurrency`` requests in flight per
  target and a :class:`CircuitBreaker` per target.

A *target* (:func:`target_of`) is the timer's target context and aggregate type,
``context.aggregate``: the endpoint path prefix ``{url}/[tenant/{tenant}/]{aggregate}/`` of the
service owning that aggregate, ``url`` that of the target's route (:mod:`wowd.daemon.routes`).
:class:`DeliveryLog` logs the outcomes other than Delivered, at
most one line per target and kind every 10 s.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import json
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias
from urllib.parse import quote

import anyio
import orjson

from wowd import clock, metrics
from wowd.config import GatewaySettings
from wowd.daemon.routes import Route, Routes
from wowd.errors import StorageError, StorageUnavailable
from wowd.model import DEFAULT_TENANT, AggregateRef, Command, OutboxEntry, Timer
from wowd.stores.base import FiredTimer, FireRequest, Outbox, OutboxFiring

if TYPE_CHECKING:
    import aiohttp
    import yarl

__all__ = [
    "CircuitBreaker",
    "CommandGateway",
    "Delivered",
    "DeliveryLog",
    "Fail",
    "FusedFiring",
    "HttpGateway",
    "Lane",
    "Outcome",
    "OutboxGateway",
    "Park",
    "Record",
    "Stopped",
    "Retry",
    "command_url",
    "deliver_concurrently",
    "delivery_log",
    "outcome_for_status",
    "request_parts",
    "target_of",
]

log = logging.getLogger(__name__)

OUTBOX_HOUSEKEEPING_S = 60.0
"""How often (at most) the outbox gateway trims the outbox past its retention."""

OUTBOX_CHUNK = 500
"""At most this many timers in one outbox ``put_many`` of the delivery stream."""

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
Stopped: TypeAlias = Callable[[], bool]

_DELIVERED = Delivered()
_OUTCOME_NAMES: dict[type[Any], str] = {Delivered: "delivered", Retry: "retry", Park: "park", Fail: "fail"}


def _running() -> bool:
    return False


Record: TypeAlias = Callable[[Timer, Outcome], None]


@dataclass(frozen=True, slots=True)
class Lane:
    """Where a timer waits for delivery: one queue per ``name`` (a target), at most ``limit``
    calls of it at once, each carrying up to ``chunk`` timers (1: :meth:`CommandGateway.send`;
    more: :meth:`CommandGateway.deliver` of a batch)."""

    name: str
    limit: int
    chunk: int = 1


_OUTBOX_LANE = Lane("outbox", limit=4, chunk=OUTBOX_CHUNK)


class CommandGateway(Protocol):
    def lane(self, timer: Timer) -> Lane:
        """The lane ``timer`` is delivered on."""
        ...

    async def send(self, timer: Timer) -> Outcome:
        """Delivers one timer's command; never raises for a target or transport failure."""
        ...

    async def deliver(self, timers: Sequence[Timer], record: Record, stopped: Stopped = _running) -> None:
        """Delivers a batch, calling ``record(timer, outcome)`` for each as soon as it is known.
        Once ``stopped()`` answers True no further delivery starts (those not started are not
        recorded: the caller releases them)."""
        ...

    async def aclose(self) -> None: ...


async def deliver_concurrently(
    send: Callable[[Timer], Any],
    timers: Sequence[Timer],
    record: Record,
    concurrency: int,
    stopped: Stopped = _running,
) -> None:
    """Runs ``send`` over ``timers`` with at most ``concurrency`` in flight (worker tasks, not one
    task per timer); none starts once ``stopped()``."""
    if not timers:
        return
    it = iter(timers)

    async def worker() -> None:
        for t in it:
            if stopped():
                return
            record(t, await send(t))

    async with anyio.create_task_group() as tg:
        for _ in range(min(concurrency, len(timers))):
            tg.start_soon(worker)


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


class FusedFiring(Protocol):
    """A gateway's fast path: it fires the due timers itself, delivery and settle in one step."""

    async def fire_due(self, request: FireRequest) -> list[FiredTimer]:
        """Delivers and settles, all or nothing, the timers of ``request`` as a claim under its
        owner key and fence, then a ``deliver`` answering Delivered and a fired ``settle`` would;
        answers the timers fired. Raises :class:`~wowd.errors.StorageUnavailable` (nothing
        written; retry) and :class:`~wowd.errors.LeaseLost` when it could not commit before the
        request's deadline. With a ``check``, a due timer the log may have changed since the
        feed's checkpoint is left (:class:`~wowd.stores.base.LogCheck`)."""
        ...

    async def fired_elsewhere(self) -> None:
        """Timers were fired into this gateway's outbox by the feed's own transaction
        (:class:`~wowd.stores.base.FeedFiring`): the housekeeping that follows a delivery."""
        ...


class OutboxGateway:
    """Delivers into the backend's outbox, unique on the request id (a re-fire is a no-op).

    The fence and owner key written with each entry are those of the timer's claim; a batch is
    one ``put_many`` call. At most every :data:`OUTBOX_HOUSEKEEPING_S`, after a delivery, it
    trims the entries older than ``retention_s`` (0: none). :meth:`count_depth` counts the
    outbox into ``wowd_outbox_depth`` (the HTTP listener calls it before each ``/metrics``).

    Given ``firing``, the timer store's own writer into this outbox (the embedded backend: one
    file), it is also a :class:`FusedFiring` (:attr:`fused`): the timers due now are read,
    written to the outbox under the firer's fence and owner key and settled as fired in one
    transaction, without a claim. The entries, request ids and settled timers are those of the
    claim, deliver and settle steps.
    """

    def __init__(self, outbox: Outbox, *, retention_s: float = 0.0, firing: OutboxFiring | None = None) -> None:
        self._outbox = outbox
        self._retention_ms = int(retention_s * 1000)
        self._housekept_at: float | None = None
        self._firing = firing
        self._counted_at = time.monotonic()
        self._count_failed = False

    @property
    def fused(self) -> FusedFiring | None:
        """This gateway's fast path (itself) when it was given the store's ``firing``."""
        return self if self._firing is not None else None

    async def fire_due(self, request: FireRequest) -> list[FiredTimer]:
        """:class:`FusedFiring` through the store's ``fire_into_outbox`` (the entries those of
        :func:`outbox_entry` under the request's fence and owner key); housekeeps after it as
        after a delivery."""
        if self._firing is None:
            raise RuntimeError("this outbox gateway has no fast path (no firing given)")
        fired = await self._firing.fire_into_outbox(request)
        if fired:
            await self._maybe_housekeep()
        return fired

    async def fired_elsewhere(self) -> None:
        await self._maybe_housekeep()

    async def housekeep(self) -> None:
        """Trims past the retention; a store failure is logged and left for the next time
        (deliveries do not depend on it)."""
        self._housekept_at = time.monotonic()
        if self._retention_ms <= 0:
            return
        try:
            trimmed = await self._outbox.trim(clock.now_ms() - self._retention_ms)
            if trimmed:
                log.info("outbox: trimmed %d entries older than the retention", trimmed)
        except StorageError as exc:
            log.warning("outbox housekeeping failed (will retry): %s", exc)

    async def count_depth(self) -> None:
        """Counts the outbox (its entries not acknowledged nor trimmed yet) into
        ``wowd_outbox_depth``. A store failure is logged (once until a count succeeds again) and
        leaves the last count, whose age :meth:`depth_age` tells."""
        try:
            depth = await self._outbox.count()
        except StorageError as exc:
            if not self._count_failed:
                log.warning(
                    "outbox: depth not counted (wowd_outbox_depth keeps the count of %.0f s ago): %s",
                    self.depth_age(),
                    exc,
                )
            self._count_failed = True
            return
        metrics.OUTBOX_DEPTH.set(depth)
        self._counted_at = time.monotonic()
        if self._count_failed:
            log.info("outbox: depth counted again (%d)", depth)
        self._count_failed = False

    def depth_age(self) -> float:
        """Seconds since :meth:`count_depth` last counted (since this gateway was made, before
        its first count): ``wowd_outbox_depth_age_seconds``."""
        return time.monotonic() - self._counted_at

    async def _maybe_housekeep(self) -> None:
        last = self._housekept_at
        if last is None or time.monotonic() - last >= OUTBOX_HOUSEKEEPING_S:
            await self.housekeep()

    def lane(self, timer: Timer) -> Lane:
        """One lane for every timer: batches of :data:`OUTBOX_CHUNK`, a few at once."""
        return _OUTBOX_LANE

    async def send(self, timer: Timer) -> Outcome:
        try:
            await self._outbox.put(outbox_entry(timer, clock.now_ms()))
        except StorageUnavailable as exc:
            return Retry(reason=f"outbox unavailable: {exc}")
        except StorageError as exc:
            return Retry(reason=f"outbox error: {exc}")
        return Delivered()

    async def deliver(self, timers: Sequence[Timer], record: Record, stopped: Stopped = _running) -> None:
        """One ``put_many`` for the batch: a re-fire of a request id is not a second delivery."""
        if stopped():
            return
        now = clock.now_ms()
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


def command_url(base: str, timer: Timer, command: Command | None = None) -> str:
    """``{base}/[tenant/{tenant_id}/]{aggregate}/{id}/{command}`` (Wow's REST shape); each path
    part percent-encoded; the tenant part only for a tenant other than the default. ``command``:
    the timer's, when already read."""
    return _command_url(base, timer.target, (command or timer.command).name)


def _command_url(base: str, target: AggregateRef, name: str) -> str:
    return _url_prefix(base, target.tenant_id, target.aggregate) + _segment(target.id) + "/" + _segment(name)


_UNRESERVED = re.compile(r"[A-Za-z0-9_.~-]+").fullmatch
"""A path segment ``quote(..., safe="")`` leaves as it is."""


def _segment(part: str) -> str:
    """``part`` percent-encoded as one path segment."""
    return part if _UNRESERVED(part) else quote(part, safe="")


@functools.lru_cache(maxsize=1024)
def _url_prefix(base: str, tenant_id: str, aggregate: str) -> str:
    parts = ["tenant", tenant_id] if tenant_id != DEFAULT_TENANT else []
    parts.append(aggregate)
    return base.rstrip("/") + "/" + "".join(_segment(p) + "/" for p in parts)


class _NotJson(ValueError):
    """NaN or an infinity in a command body (the standard encoder writes them as they were)."""


def _refuse_constant(name: str) -> Any:
    raise _NotJson(name)


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def request_parts(text: str) -> tuple[str, bytes, str | None]:
    """A timer's command JSON text (``{name, body_type?, body}``) as the request's name, body
    (compact JSON bytes) and ``Command-Type``; raises ``ValueError``, ``KeyError`` or
    ``TypeError`` for an unreadable one. Numbers keep their precision (integers of any size)."""
    try:
        doc = _DECODER.decode(text)
    except _NotJson:
        command = Command.from_json(text)
        body_text = json.dumps(dict(command.body), separators=(",", ":"))
        return command.name, body_text.encode(), command.body_type
    name = doc["name"]
    body = doc.get("body", {})
    if type(body) is not dict:
        body = dict(body)
    try:
        payload = orjson.dumps(body)
    except TypeError:  # an integer beyond 64 bits, a lone surrogate: the standard encoder
        payload = json.dumps(body, separators=(",", ":")).encode()
    return name, payload, doc.get("body_type")


def _retry_after(value: str | None) -> float:
    if not value:
        return 0.0
    try:
        return max(0.0, min(float(value), 3600.0))
    except ValueError:
        return 0.0


def outcome_for_status(status: int, retry_after: str | None = None, detail: str = "") -> Outcome:
    """2xx delivered; 404 park; 408, 409, 425, 429 and 5xx retry (``Retry-After`` in seconds is
    the hint); any other status (3xx, the other 4xx) fails."""
    if 200 <= status < 300:
        return _DELIVERED
    reason = f"HTTP {status}" + (f": {detail}" if detail else "")
    if status == 404:
        return Park(reason=reason)
    if status in (408, 409, 425, 429) or status >= 500:
        return Retry(reason=reason, after_s=_retry_after(retry_after))
    return Fail(reason=reason)


def _is_target_failure(status: int) -> bool:
    """A status that counts against the target's circuit: it is overloaded or broken (a 409 or
    425 is an answer about the command, the target works)."""
    return status >= 500 or status in (408, 429)


def target_of(timer: Timer) -> str:
    """The delivery target of ``timer``: ``context.aggregate`` of its target aggregate."""
    t = timer.target
    return f"{t.context}.{t.aggregate}"


# --------------------------------------------------------------------------- outcome log


class DeliveryLog:
    """Logs delivery outcomes other than Delivered: WARNING for a Retry, ERROR for a Fail, INFO
    for a Park, with the target, the reason (status or error) and the request id.

    At most one line per target and kind every ``every_s``; the next line written says how many
    were left out since the previous one. A Fail is never hidden by a burst of Retries of the same
    target (each kind has its own window). The http gateway logs through :data:`delivery_log`;
    a caller deciding an outcome itself (e.g. a spent retry budget) can log it there too.
    """

    _LEVELS: dict[type[Any], tuple[int, str]] = {
        Retry: (logging.WARNING, "delivery to %s will be retried: %s (request id %s)%s"),
        Fail: (logging.ERROR, "delivery to %s failed for good: %s (request id %s)%s"),
        Park: (logging.INFO, "delivery to %s parked: %s (request id %s)%s"),
    }

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger or log
        self._every = every_s
        self._clock = clock
        self._windows: dict[tuple[str, type[Any]], list[float]] = {}  # [last line at, left out since]

    def outcome(self, target: str, outcome: Outcome, request_id: str) -> None:
        """Logs ``outcome`` of a delivery to ``target`` (nothing for Delivered), rate-limited."""
        kind = type(outcome)
        spec = self._LEVELS.get(kind)
        if spec is None or not self._log.isEnabledFor(spec[0]):
            return
        now = self._clock()
        window = self._windows.get((target, kind))
        if window is not None and now - window[0] < self._every:
            window[1] += 1
            return
        left_out = int(window[1]) if window is not None else 0
        self._windows[(target, kind)] = [now, 0]
        more = f"; {left_out} more like it left out of the log in the last {self._every:g}s" if left_out else ""
        level, msg = spec
        self._log.log(level, msg, target, getattr(outcome, "reason", ""), request_id, more)


delivery_log = DeliveryLog()
"""The process's delivery log (one window per target and kind for every caller)."""


# --------------------------------------------------------------------------- circuit breaker


class Admission(enum.Enum):
    SEND = "send"
    TRIAL = "trial"
    REFUSE = "refuse"


class CircuitBreaker:
    """One target's circuit: closed (requests go out) -> open after ``failures`` consecutive
    failures (each send answers Retry without a request for ``open_s``) -> half-open (one trial
    request; the others still answer Retry) -> closed when the trial succeeds, open again for
    ``open_s`` when it fails. Outcomes of requests sent before the circuit opened do not change
    an open circuit. One event loop: no locks."""

    def __init__(
        self, target: str, *, failures: int, open_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.target = target
        self._limit = failures
        self._open_s = open_s
        self._clock = clock
        self._consecutive = 0
        self._open_until: float | None = None
        self._trial = False

    @property
    def is_open(self) -> bool:
        """Open or half-open (not every send goes out)."""
        return self._open_until is not None

    def refusing(self) -> float | None:
        """Without changing the state: ``None`` when a send may go out now, else the seconds
        until a trial may (0 while a trial is in flight)."""
        if self._open_until is None:
            return None
        if self._trial:
            return 0.0
        left = self._open_until - self._clock()
        return left if left > 0 else None

    def admit(self) -> Admission:
        """Whether a send goes out now: SEND (closed), TRIAL (this send is the half-open trial;
        report it with ``trial=True``) or REFUSE."""
        if self._open_until is None:
            return Admission.SEND
        if self._trial or self._clock() < self._open_until:
            return Admission.REFUSE
        self._trial = True
        return Admission.TRIAL

    def record(self, ok: bool, *, trial: bool = False) -> None:
        """The outcome of an admitted send: ``ok`` unless it timed out, met a transport error or
        a status counting against the target (408, 429, 5xx)."""
        if trial:
            self._trial = False
            if ok:
                self._close()
            else:
                self._open("its trial request failed")
            return
        if self._open_until is not None:
            return
        if ok:
            self._consecutive = 0
            return
        self._consecutive += 1
        if self._consecutive >= self._limit:
            self._open(f"{self._consecutive} consecutive failures")

    def abandon_trial(self) -> None:
        """The trial request was cancelled: the next send after this one may be the trial."""
        self._trial = False

    def _open(self, why: str) -> None:
        self._open_until = self._clock() + self._open_s
        self._consecutive = 0
        metrics.GATEWAY_CIRCUIT_OPEN.labels(target=self.target).set(1)
        log.warning(
            "circuit of %s opened (%s): its deliveries answer Retry without a request for %gs",
            self.target,
            why,
            self._open_s,
        )

    def _close(self) -> None:
        self._open_until = None
        self._consecutive = 0
        metrics.GATEWAY_CIRCUIT_OPEN.labels(target=self.target).set(0)
        log.info("circuit of %s closed: its trial request succeeded", self.target)


# --------------------------------------------------------------------------- http


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
        return Retry(reason=f"circuit open for {self.name}", after_s=after_s)


class HttpGateway:
    """POSTs each command to its target's endpoint, ``Command-Request-Id: timer.request_id``.

    A target's endpoint, credential, time limit, TLS context and per-target limit are those of
    its route (:class:`~wowd.daemon.routes.Routes`: the first of ``routes`` matching it, else
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
            url = yarl.URL(_command_url(route.url, timer.target, name), encoded=True)
        except (ValueError, KeyError, TypeError) as exc:
            outcome = Fail(reason=f"unreadable command: {exc}")
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
                        route.counted[_OUTCOME_NAMES[type(outcome)]].inc()
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
        if outcome is not _DELIVERED:
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
            raise StorageUnavailable(f"gateway {r.url}: no answer within {r.timeout_s:g}s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise StorageUnavailable(f"gateway {r.url}: {_transport_reason(exc)}") from exc

    async def _post(self, route: Route, url: yarl.URL, body: bytes, headers: dict[str, str]) -> tuple[Outcome, bool]:
        """One exchange on ``route``: the outcome and whether it counts against the target's
        circuit."""
        import aiohttp

        session = self._session or self._open_session()
        try:
            async with session.post(
                url,
                data=body,
                headers=headers,
                allow_redirects=False,
                proxy=route.proxy,
                ssl=route.ssl,
                timeout=route.client_timeout,
            ) as resp:
                status = resp.status
                if 200 <= status < 300:
                    return _DELIVERED, False
                detail = await self._read_detail(resp)
                outcome = outcome_for_status(status, resp.headers.get("retry-after"), detail)
                return outcome, _is_target_failure(status)
        except TimeoutError:
            return Retry(reason=f"timeout after {route.timeout_s:g}s"), True
        except aiohttp.InvalidURL:
            return Fail(reason="request refused: invalid URL"), False
        except (aiohttp.ClientError, OSError) as exc:
            return Retry(reason=_transport_reason(exc)), True
        except (ValueError, UnicodeError) as exc:
            return Fail(reason=f"request refused: {type(exc).__name__}"), False

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
        for secret in self._secrets:
            text = text.replace(secret, "***")
        try:
            doc = json.loads(text)
        except ValueError:
            return " ".join(text.split())[:200]
        if isinstance(doc, dict):
            msg = doc.get("errorMsg") or doc.get("message") or doc.get("errorCode") or ""
            return str(msg)[:200]
        return ""

    async def deliver(self, timers: Sequence[Timer], record: Record, stopped: Stopped = _running) -> None:
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
