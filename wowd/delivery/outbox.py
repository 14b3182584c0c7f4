"""The outbox gateway: delivers into the backend's outbox (unique on the request id), one
``put_many`` per chunk the delivery stream hands it; and the outbox's housekeeping (its depth for
the metrics, its retention).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from wowd import clock, metrics
from wowd.delivery.outcomes import DELIVERED, Outcome, Retry
from wowd.errors import StorageError, StorageUnavailable
from wowd.fmt import span
from wowd.model import OutboxEntry, Timer
from wowd.stores.base import Outbox

log = logging.getLogger(__name__)

OUTBOX_HOUSEKEEPING_S = 60.0
"""How often the replica trims the outbox past its retention (:meth:`OutboxGateway.housekeep`)."""


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

    The fence and owner key written with each entry are those of the timer's claim; a chunk is
    one ``put_many`` call. :meth:`housekeep` trims the entries older than ``retention_s`` (0:
    none); :meth:`count_depth` counts the outbox into ``wowd_outbox_depth`` (the HTTP listener
    calls it before each ``/metrics``).
    """

    def __init__(self, outbox: Outbox, *, retention_s: float = 0.0) -> None:
        self._outbox = outbox
        self._retention_ms = int(retention_s * 1000)
        self._counted_at = time.monotonic()
        self._count_failed = False

    async def housekeep(self) -> None:
        """Trims past the retention, counted (``wowd_outbox_trimmed_total``) and said (WARNING):
        every entry still in the outbox is one no consumer acknowledged, so a trimmed entry is a
        command lost. A store failure is logged and left for the next time (deliveries do not
        depend on it)."""
        if self._retention_ms <= 0:
            return
        try:
            trimmed = await self._outbox.trim(clock.now_ms() - self._retention_ms)
        except StorageError as exc:
            log.warning("outbox housekeeping failed (will retry): %s", exc)
            return
        if trimmed:
            metrics.OUTBOX_TRIMMED.inc(trimmed)
            log.warning(
                "outbox: %d entries older than the retention of %s (WOWD_OUTBOX__RETENTION_S) trimmed, "
                "unacknowledged: no consumer took their commands, which are lost",
                trimmed,
                span(self._retention_ms),
            )

    async def count_depth(self) -> None:
        """Counts the outbox (its entries not acknowledged nor trimmed yet) into
        ``wowd_outbox_depth``, and the age of its oldest entry into
        ``wowd_outbox_oldest_age_seconds`` (beside the retention that trims it,
        ``wowd_outbox_retention_seconds``). A store failure is logged (once until a count succeeds
        again) and leaves the last count, whose age :meth:`depth_age` tells."""
        metrics.OUTBOX_RETENTION.set(self._retention_ms / 1000)
        try:
            depth = await self._outbox.count()
            oldest = await self._outbox.entries(limit=1) if depth else []
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
        metrics.OUTBOX_OLDEST_AGE.set(max(0, clock.now_ms() - oldest[0].created_at) / 1000 if oldest else 0)
        self._counted_at = time.monotonic()
        if self._count_failed:
            log.info("outbox: depth counted again (%d)", depth)
        self._count_failed = False

    def depth_age(self) -> float:
        """Seconds since :meth:`count_depth` last counted (since this gateway was made, before
        its first count): ``wowd_outbox_depth_age_seconds``."""
        return time.monotonic() - self._counted_at

    async def send(self, timer: Timer) -> Outcome:
        return await self.send_batch((timer,))

    async def send_batch(self, timers: Sequence[Timer]) -> Outcome:
        """One ``put_many``: a re-fire of a request id is not a second delivery."""
        now = clock.now_ms()
        try:
            await self._outbox.put_many([outbox_entry(t, now) for t in timers])
        except StorageUnavailable as exc:
            return Retry(reason=f"outbox unavailable: {exc}")
        except StorageError as exc:
            return Retry(reason=f"outbox error: {exc}")
        return DELIVERED

    async def aclose(self) -> None:
        return None
