"""What a delivery answers and the protocols of a command gateway.

``CommandGateway.send(timer)`` answers one of :class:`Delivered`, :class:`Retry`, :class:`Park`,
:class:`Fail`; it never raises for a failure of the target or the transport. ``deliver`` sends a
batch and reports each outcome through a callback as soon as it is known, so a caller cancelled
mid-batch (shutdown grace, lost lease) still settles what was delivered. A *target*
(:func:`target_of`) is the timer's target context and aggregate type, ``context.aggregate``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import anyio

from wowd.model import Timer
from wowd.stores.base import FiredTimer, FireRequest


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivered:
    """The target took the command (or had it already: a re-fire with the same request id)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """Try again later; ``after_s`` is the target's hint (0: use the backoff)."""

    reason: str
    after_s: float = 0.0

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


@dataclass(frozen=True, slots=True, kw_only=True)
class Fail:
    """The command is refused for good."""

    reason: str


Outcome: TypeAlias = Delivered | Retry | Park | Fail
Stopped: TypeAlias = Callable[[], bool]

DELIVERED = Delivered()
OUTCOME_NAMES: dict[type[Any], str] = {Delivered: "delivered", Retry: "retry", Park: "park", Fail: "fail"}


def never_stopped() -> bool:
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


class CommandGateway(Protocol):
    def lane(self, timer: Timer) -> Lane:
        """The lane ``timer`` is delivered on."""
        ...

    async def send(self, timer: Timer) -> Outcome:
        """Delivers one timer's command; never raises for a target or transport failure."""
        ...

    async def deliver(self, timers: Sequence[Timer], record: Record, stopped: Stopped = never_stopped) -> None:
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
    stopped: Stopped = never_stopped,
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
        return DELIVERED
    reason = f"HTTP {status}" + (f": {detail}" if detail else "")
    if status == 404:
        return Park(reason=reason)
    if status in (408, 409, 425, 429) or status >= 500:
        return Retry(reason=reason, after_s=_retry_after(retry_after))
    return Fail(reason=reason)


def is_target_failure(status: int) -> bool:
    """A status that counts against the target's circuit: it is overloaded or broken (a 409 or
    425 is an answer about the command, the target works)."""
    return status >= 500 or status in (408, 429)


def target_of(timer: Timer) -> str:
    """The delivery target of ``timer``: ``context.aggregate`` of its target aggregate."""
    t = timer.target
    return f"{t.context}.{t.aggregate}"
