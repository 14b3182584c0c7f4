"""The timer loop of one held slot (``docs/architecture.md``, "Firing").

On start it ends the claims a previous holder of the slot left (``TimerFiring.reclaim``: they
come due at once, not after ``claim_ttl_s``), and fires nothing before the feed has applied the
log up to its head. Then it runs *rounds* through the slot's
:class:`~wowd.daemon.firing.RoundStrategy` (what fires when is :mod:`wowd.daemon.firing`'s).

Between rounds the loop sleeps as :func:`plan_wait` decides: until the store's next due time
(``next_due``) or the earliest one this process put since (:class:`~wowd.daemon.waker.Waker`)
comes within the lookahead, and not before the round's ``until`` is half a lookahead away (a
steady stream is then claimed in rounds of half a lookahead, each half a lookahead before its
first timer is due), at most :data:`MAX_IDLE_S`; a put due sooner wakes it at once. A round that
left due timers for the feed (their owner has a commit it has not applied) waits for the feed's
next batch.

A store that fails a round (or the reclaim, or a settle) is retried with a capped backoff and
reported in the loop's :class:`~wowd.daemon.stall.Stall` (:attr:`TimerLoop.stall`): stalled at
once by a full disk or a store that refuses, after a minute of transient failures; readiness then
answers 503 and ``wowd_timers_stalled{slot}`` is 1 until the failing step (a round, a settle)
succeeds again. Nothing is lost meanwhile: a timer is fired, or its claim settled, only by a write
that succeeded.

On stop it claims nothing more; deliveries in flight finish (bounded by the slot's grace period)
and their outcomes are written; what was claimed and not delivered is settled back to PENDING.
The last settle runs shielded and bounded, also after the lease lapsed: each change is guarded by
the timer's revision as claimed, so it is skipped where a new holder has moved the timer on.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import anyio
from anyio.abc import TaskStatus

from wowd import metrics
from wowd.clock import now_ms
from wowd.config import TimerSettings
from wowd.errors import StorageError
from wowd.retry import Backoff, Pauses, RetryStopped, retrying
from wowd.stores.base import TimerFiring, TimerHistory

from .leases import HeldSlot
from .stall import Stall
from .timer_plan import MAX_IDLE_S, ReadFirst, Round, plan_wait, wants_next_due
from .waker import Waker

__all__ = ["MAX_IDLE_S", "ROUND", "Nudge", "RoundStrategy", "TimerLoop"]

log = logging.getLogger(__name__)
Logx = logging.LoggerAdapter[logging.Logger]

SWEEP_EVERY_S = 10.0
"""How often a loop deletes expired tombstones (a small batch each time)."""
SWEEP_BATCH = 1000
ROUND_BACKOFF = Backoff(0.1, 5.0)
"""The pause before retrying a round or a reclaim the store failed (also while stalled: a loop
resumes at most this long after the store answers again)."""
ROUND = "timer round"
"""The round step of a loop's :class:`Stall` (a round, or the reclaim before the first)."""


class Nudge(Protocol):
    def __call__(self) -> None: ...


class RoundStrategy(Protocol):
    """How the timers of a held slot are taken, delivered and settled; one per loop, chosen
    where the backend is assembled."""

    def running(self, held: HeldSlot, waker: Waker, stall: Stall, logx: Logx) -> AbstractAsyncContextManager[None]:
        """An async context for the loop's rounds: what the strategy runs beside them (delivery
        workers, the settler); on exit every timer it took is delivered or settled back."""
        ...

    async def round(self, held: HeldSlot, waker: Waker, parts: frozenset[int]) -> Round:
        """Takes the due timers of ``parts`` (and delivers them, or hands them on); raises
        :class:`~wowd.errors.StorageUnavailable` when the store does not answer."""
        ...


# --------------------------------------------------------------------------- the loop


def _storage_error(exc: BaseException) -> StorageError:
    assert isinstance(exc, StorageError)  # what the retry retries
    return exc


class TimerLoop:
    """Fires the due timers of one held slot until the slot stops, in rounds of its strategy."""

    def __init__(
        self,
        settings: TimerSettings,
        store: TimerFiring,
        strategy: RoundStrategy,
        nudge: Nudge,
        *,
        history: TimerHistory | None = None,
    ) -> None:
        self._settings = settings
        self._store = store
        self._history = history
        self._nudge = nudge
        self.strategy = strategy
        self._next_sweep = 0.0
        self.stall: Stall | None = None
        """Whether the loop's rounds fail (set when it runs, for its slot: readiness reads it)."""

    async def run(
        self, held: HeldSlot, waker: Waker, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        logx = logging.LoggerAdapter(log, held.log_extra())
        stall = self.stall = Stall(
            f"timer loop of slot {held.slot}", metrics.TIMERS_STALLED.labels(slot=str(held.slot))
        )
        held.on_stop(waker.wake)
        parts = frozenset(held.partitions)
        task_status.started()
        await self._reclaim(held, parts, stall, logx)
        pauses = Pauses(ROUND_BACKOFF, held.stop_event)
        async with self.strategy.running(held, waker, stall, logx):
            while not held.stopping:
                held.check()
                if waker.watermark is None or waker.read_mark is None:
                    # the feed has not applied the log up to its head since the slot was taken
                    self._nudge()
                    await waker.wait(MAX_IDLE_S, float("-inf"), want_watermark=float("-inf"))
                    continue
                mark, applied = waker.mark(), waker.applied_batches
                try:
                    r = await self.strategy.round(held, waker, parts)
                except StorageError as exc:  # a full disk, a store that refuses: stalled, retried
                    stall.failed(ROUND, exc, logx)
                    await pauses.pause()
                    continue
                pauses.reset()
                stall.progressed(logx, ROUND)
                if r.full:
                    continue  # more are due now
                waker.covered(r.until, mark)
                if not held.stopping:
                    await self._sweep(logx)
                    await self._wait(held, waker, parts, r, applied, logx)
        logx.info("timer loop stopped")

    async def _wait(
        self, held: HeldSlot, waker: Waker, parts: frozenset[int], r: Round, applied: int, logx: Logx
    ) -> None:
        """Sleeps after a round that read every timer due by ``r.until`` (:func:`plan_wait`)."""
        if r.skipped:
            # due, but the log holds a commit of their aggregate the feed has not applied yet:
            # taken again once it has applied its next batch
            self._nudge()
            await waker.wait_applied(applied, MAX_IDLE_S)
            return
        put_next = waker.earliest()
        stored_next = await self._next_due(parts, r.until, logx) if wants_next_due(r, put_next) else None
        now = now_ms()
        w = plan_wait(now, r, (stored_next, waker.earliest()), self._settings.lookahead_ms)
        if isinstance(w, ReadFirst):
            self._nudge()
            if waker.watermark is None or waker.watermark < w.want_watermark:
                await waker.wait(MAX_IDLE_S, w.first, want_watermark=w.want_watermark)
            return
        await waker.wait((w.wake_at - now) / 1000, w.wake_before)

    async def _reclaim(self, held: HeldSlot, parts: frozenset[int], stall: Stall, logx: Logx) -> None:
        """Ends the claims an earlier holding of the slot left: a previous holder's (a lower
        fence), or this holder's own before its lease lapsed and was taken back (this fence)."""
        # claims under this very fence too: none is in flight (this slot's work starts now);
        # they were left by this holder's earlier work on the slot, whose lease lapsed and was
        # taken back with the same fence
        try:
            async for attempt in retrying(
                "ending a previous holder's claims",
                backoff=ROUND_BACKOFF,
                stop=held.stop_event,
                logger=None,  # the stall logs
                retry_on=StorageError,
                on_failure=lambda exc: stall.failed(ROUND, _storage_error(exc), logx),
            ):
                with attempt:
                    held.check()
                    n = await self._store.reclaim(parts, held.fence + 1)
        except RetryStopped:
            return
        stall.progressed(logx, ROUND)
        if n:
            logx.info("%d timers claimed by an earlier holding of the slot are due again", n)

    async def _sweep(self, logx: Logx) -> None:
        """Deletes a small batch of expired tombstones (and of expired history records), at most
        every :data:`SWEEP_EVERY_S`."""
        t = time.monotonic()
        if t < self._next_sweep:
            return
        self._next_sweep = t + SWEEP_EVERY_S
        now = now_ms()
        try:
            await self._store.sweep(now - self._settings.tombstone_retention_s * 1000, SWEEP_BATCH)
            if self._history is not None:
                await self._history.sweep(now, SWEEP_BATCH)
        except StorageError as exc:  # nothing waits for it: retried at the next sweep
            stalled = self.stall is not None and self.stall.stalled
            logx.log(logging.DEBUG if stalled else logging.WARNING, "tombstone sweep failed (will retry): %s", exc)

    async def _next_due(self, parts: frozenset[int], after: int, logx: Logx) -> int | None:
        """The store's next due time after ``after``; ``None`` when it does not answer (the loop
        then reads again after an idle period)."""
        try:
            return await self._store.next_due(parts, after)
        except StorageError as exc:
            stalled = self.stall is not None and self.stall.stalled
            logx.log(logging.DEBUG if stalled else logging.WARNING, "next due time not read (polling instead): %s", exc)
            return None
