"""The outbox gateway: delivers into the backend's outbox (unique on the request id), one
``put_many`` per batch; on a backend whose timer store writes into the outbox itself
(:class:`~wowd.stores.base.OutboxFiring`) also a fast path (:class:`FusedFiring`): the due timers
fired and settled in one transaction, with no claim.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from wowd import clock, metrics
from wowd.delivery.outcomes import Delivered, FusedFiring, Lane, Outcome, Record, Retry, Stopped, never_stopped
from wowd.errors import StorageError, StorageUnavailable
from wowd.model import OutboxEntry, Timer
from wowd.stores.base import FiredTimer, FireRequest, Outbox, OutboxFiring

log = logging.getLogger(__name__)

OUTBOX_HOUSEKEEPING_S = 60.0
"""How often (at most) the outbox gateway trims the outbox past its retention."""

OUTBOX_CHUNK = 500
"""At most this many timers in one outbox ``put_many`` of the delivery stream."""

_OUTBOX_LANE = Lane("outbox", limit=4, chunk=OUTBOX_CHUNK)


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

    async def deliver(self, timers: Sequence[Timer], record: Record, stopped: Stopped = never_stopped) -> None:
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
