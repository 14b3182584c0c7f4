"""The http gateway: POSTs to a Wow-style command endpoint with ``Command-Request-Id`` (aiohttp,
one keep-alive connection pool) behind a :class:`~wowd.delivery.breaker.CircuitBreaker` per
target; each target goes by its route (:mod:`wowd.delivery.routes`): URL, credential, time
limit, TLS context, signing secrets. It only sends: how many requests are in flight, in all and
per target, is the delivery stream's to decide (the pool is sized to its limit).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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
    OUTCOME_NAMES,
    Delivered,
    Fail,
    Outcome,
    Retry,
    is_target_failure,
    outcome_for_status,
    target_of,
)

MAX_ANSWER_BYTES = 4096
"""How much of an answer's body is read (for an error reason); the rest is discarded."""
ANSWER_BYTES = 256
"""How much of an answer an outcome keeps for the timer's history (masked): of a 2xx answer,
what arrived with its head (never waited for)."""


def _transport_reason(exc: BaseException) -> str:
    """The error's kind and, for a socket error, the OS's word for it (never a URL or a header)."""
    name = type(exc).__name__
    os_error = getattr(exc, "os_error", None)
    err = os_error if isinstance(os_error, OSError) else exc if isinstance(exc, OSError) else None
    if err is not None and err.strerror:
        return f"transport error: {name} ({err.strerror})"
    return f"transport error: {name}"


class _Target:
    """What the gateway keeps per target: its circuit and its short-circuit counter."""

    __slots__ = ("_short_circuited", "breaker", "name")

    def __init__(self, name: str, breaker: CircuitBreaker) -> None:
        self.name = name
        self.breaker = breaker
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

    A target's endpoint, credential, time limit and TLS context are those of its route
    (:class:`~wowd.delivery.routes.Routes`: the first of ``routes`` matching it, else ``url``); a
    timer whose target has no route fails without a request ("no route for ...",
    ``wowd_gateway_unrouted_total``). The credential (``token``) goes as ``Authorization:
    Bearer`` or, with ``api_key_header``, in that header; it is never logged nor put in a reason
    (a target echoing it has it masked). With signing secrets, each request is signed
    (:mod:`wowd.signing`: ``webhook-id`` is the request id). TLS verification is on unless
    disabled; ``ca_certs`` names a CA bundle, else the system's CAs; ``client_cert`` (and
    ``client_key``) is presented to a target asking for one. Each exchange is bounded by
    ``timeout_s``; at most :data:`MAX_ANSWER_BYTES` of an answer are read (an answer left unread
    closes its connection). One keep-alive connection pool of ``pool_size`` connections (the
    delivery stream's limit of requests in flight); a :class:`CircuitBreaker` per target. The
    session is opened on the first send (in the running loop) and closed by :meth:`aclose` unless
    it was given. Its requests ask for no compression (``Accept-Encoding: identity``) and it keeps
    no cookies.
    """

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        pool_size: int,
        session: aiohttp.ClientSession | None = None,
        outcomes: DeliveryLog | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not settings.url and not settings.routes:
            raise ValueError("gateway url or routes are required for the http gateway")
        self._settings = settings
        self._pool_size = pool_size
        headers = {"content-type": "application/json", "accept": "application/json", "accept-encoding": "identity"}
        self._headers = headers
        self._owns = session is None
        self._session = session
        self._outcomes = outcomes or delivery_log
        self._clock = clock
        self._targets: dict[str, _Target] = {}
        self._options: dict[str, dict[str, Any]] = {}
        # the client is loaded and the TLS contexts built (CA bundles, client certificates and
        # keys read) here, at start-up: it takes a tenth of a second or more, which the first
        # delivery would otherwise wait, and an unreadable file is a ConfigError naming its setting
        import aiohttp  # an http gateway's own dependency: an outbox replica never loads it

        self._client_timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
        # an owned session sends the constant headers itself; a given one has them per request
        self._routes = Routes(settings, base_headers={} if self._owns else headers)
        self._secrets = sorted({r.secret for r in self._routes.all if r.secret}, key=len, reverse=True)

    def _open_session(self) -> aiohttp.ClientSession:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self._pool_size, limit_per_host=0)
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
            t = self._targets[name] = _Target(name, breaker)
        return t

    def breaker(self, target: str) -> CircuitBreaker:
        """The circuit of ``target`` (created closed)."""
        return self._target(target).breaker

    async def send(self, timer: Timer) -> Outcome:
        target = self._target(target_of(timer))
        request_id = timer.request_id
        route = self._routes.route(target.name)
        if route is None:
            metrics.GATEWAY_UNROUTED.labels(target=target.name).inc()
            unrouted = Fail(reason=f"no route for {target.name}")
            self._outcomes.outcome(target.name, unrouted, timer)
            return unrouted
        try:
            name, body, body_type = request_parts(timer.body)
            url = route.origin.with_path(target_command_url(route.path, timer.target, name), encoded=True)
        except (ValueError, KeyError, TypeError) as exc:
            unsafe = isinstance(exc, UnsafeSegment)
            unreadable = Fail(reason=f"refused: {exc}" if unsafe else f"unreadable command: {exc}")
            self._outcomes.outcome(route.target_label(target.name), unreadable, timer)
            return unreadable
        breaker = target.breaker
        admission = breaker.admit()
        if admission is Admission.REFUSE:
            refused = target.short_circuit(breaker.refusing() or 0.0)
            self._outcomes.outcome(route.target_label(target.name), refused, timer)
            return refused
        trial = admission is Admission.TRIAL
        headers = {**route.headers, "command-request-id": request_id}
        if body_type:
            headers["command-type"] = body_type
        if route.signer is not None:
            headers.update(route.signer.headers(request_id, body))
        try:
            outcome, failed = await self._post(route, url, body, headers)
        except BaseException:
            if trial:
                breaker.abandon_trial()
            raise
        route.counted[OUTCOME_NAMES[type(outcome)]].inc()
        breaker.record(not failed, trial=trial)
        if outcome.__class__ is not Delivered:
            self._outcomes.outcome(route.target_label(target.name), outcome, timer)
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
        clock = time.perf_counter
        started = clock()
        try:
            async with session.post(
                url, data=body, headers=headers, allow_redirects=False, **self._request_options(route)
            ) as resp:
                status = resp.status
                latency_ms = (clock() - started) * 1000
                if 200 <= status < 300:
                    head = resp.content.read_nowait(ANSWER_BYTES)  # what arrived: never waited for
                    return Delivered(status=status, latency_ms=latency_ms, answer=self._masked(head)), False
                detail, read = await self._read_detail(resp)
                outcome = outcome_for_status(
                    status,
                    resp.headers.get("retry-after"),
                    detail,
                    latency_ms=latency_ms,
                    answer=self._masked(read[:ANSWER_BYTES]),
                )
                return outcome, is_target_failure(status)
        except TimeoutError:
            return Retry(reason=f"timeout after {route.timeout_s:g}s", latency_ms=(clock() - started) * 1000), True
        except aiohttp.InvalidURL:
            return Fail(reason="request refused: invalid URL"), False
        except (aiohttp.ClientError, OSError) as exc:
            return Retry(reason=_transport_reason(exc), latency_ms=(clock() - started) * 1000), True
        except (ValueError, UnicodeError) as exc:
            return Fail(reason=f"request refused: {type(exc).__name__}"), False

    def _masked(self, head: bytes) -> str | None:
        """The first bytes of an answer as text, every secret of the routes masked (also one a
        JSON escape spells); ``None`` for none."""
        if not head:
            return None
        text = head.decode("utf-8", "replace")
        return redact(unescaped(text), self._secrets) if self._secrets else text

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

    async def _read_detail(self, resp: aiohttp.ClientResponse) -> tuple[str, bytes]:
        """The reason an answer gives, from at most :data:`MAX_ANSWER_BYTES` of its body (what
        arrived when the body ends early, stalls past the timeout or breaks), and those bytes."""
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
            return " ".join(redact(unescaped(text), self._secrets).split())[:200], buf
        if isinstance(doc, dict):
            msg = doc.get("errorMsg") or doc.get("message") or doc.get("errorCode") or ""
            return redact(str(msg), self._secrets)[:200], buf  # decoded first, then masked
        return "", buf

    async def aclose(self) -> None:
        if self._owns and self._session is not None:
            await self._session.close()
            self._session = None
