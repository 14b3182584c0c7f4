"""What a delivery answers and the protocols of a command gateway.

``CommandGateway.send(timer)`` answers one of :class:`Delivered`, :class:`Retry`, :class:`Park`,
:class:`Fail`; it never raises for a failure of the target or the transport. A
:class:`BatchGateway` also sends a chunk of timers in one write (the outbox). A gateway only
sends; the delivery stream decides when and how many at once. A *target* (:func:`target_of`) is
the timer's target context and aggregate type, ``context.aggregate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, runtime_checkable

from wowd.model import Timer


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivered:
    """The target took the command (or had it already: a re-fire with the same request id).

    Every outcome may say what the gateway saw of the exchange, for the timer's history:
    ``status`` (the HTTP status), ``latency_ms`` (from sending the request to its answer's
    status line, or to its failure) and ``answer`` (the answer's first characters, masked)."""

    status: int | None = None
    latency_ms: float | None = None
    answer: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """Try again later; ``after_s`` is the target's hint (0: use the backoff)."""

    reason: str
    after_s: float = 0.0
    status: int | None = None
    latency_ms: float | None = None
    answer: str | None = None

    @property
    def circuit_open(self) -> bool:
        """Whether no request was sent: the target's circuit is open (:data:`CIRCUIT_OPEN`)."""
        return self.reason.startswith(CIRCUIT_OPEN)


CIRCUIT_OPEN = "circuit open for "
"""The reason of a :class:`Retry` a gateway answers without a request: the target's circuit is
open (followed by the target)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Park:
    """The target cannot take the command now (e.g. it does not exist yet)."""

    reason: str
    status: int | None = None
    latency_ms: float | None = None
    answer: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Fail:
    """The command is refused for good."""

    reason: str
    status: int | None = None
    latency_ms: float | None = None
    answer: str | None = None


Outcome: TypeAlias = Delivered | Retry | Park | Fail

DELIVERED = Delivered()
OUTCOME_NAMES: dict[type[Any], str] = {Delivered: "delivered", Retry: "retry", Park: "park", Fail: "fail"}


class CommandGateway(Protocol):
    """Sends a timer's command where it goes and answers what became of it. A gateway only sends:
    what is sent when, how many at once and to whom (every limit) is the delivery stream's
    (:class:`~wowd.daemon.stream.DeliveryStream`)."""

    async def send(self, timer: Timer) -> Outcome:
        """Delivers one timer's command; never raises for a target or transport failure."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class BatchGateway(CommandGateway, Protocol):
    """A gateway where one write serves many commands (the outbox): the stream hands it chunks."""

    async def send_batch(self, timers: Sequence[Timer]) -> Outcome:
        """Delivers every timer of ``timers`` in one write; the one outcome is each one's."""
        ...


def _retry_after(value: str | None) -> float:
    if not value:
        return 0.0
    try:
        return max(0.0, min(float(value), 3600.0))
    except ValueError:
        return 0.0


def outcome_for_status(
    status: int,
    retry_after: str | None = None,
    detail: str = "",
    *,
    latency_ms: float | None = None,
    answer: str | None = None,
) -> Outcome:
    """2xx delivered; 404 park; 408, 409, 425, 429 and 5xx retry (``Retry-After`` in seconds is
    the hint); any other status (3xx, the other 4xx) fails. ``latency_ms`` and ``answer`` as
    :class:`Delivered` takes them."""
    if 200 <= status < 300:
        return Delivered(status=status, latency_ms=latency_ms, answer=answer)
    reason = f"HTTP {status}" + (f": {detail}" if detail else "")
    if status == 404:
        return Park(reason=reason, status=status, latency_ms=latency_ms, answer=answer)
    if status in (408, 409, 425, 429) or status >= 500:
        after_s = _retry_after(retry_after)
        return Retry(reason=reason, after_s=after_s, status=status, latency_ms=latency_ms, answer=answer)
    return Fail(reason=reason, status=status, latency_ms=latency_ms, answer=answer)


def is_target_failure(status: int) -> bool:
    """A status that counts against the target's circuit: it is overloaded or broken (a 409 or
    425 is an answer about the command, the target works)."""
    return status >= 500 or status in (408, 429)


def target_of(timer: Timer) -> str:
    """The delivery target of ``timer``: ``context.aggregate`` of its target aggregate."""
    t = timer.target
    return f"{t.context}.{t.aggregate}"
