"""A rebuild of the timer view on MongoDB, while the replicas run (``wowd timers rebuild``;
docs/operations.md, "Recovery"; the collections' side is :mod:`wowd.stores.mongo.timer_rebuild`).

1. **Lock.** The context's rebuild lock (one rebuild at a time; another one is refused naming
   the holder), renewed at every progress line.
2. **Replay.** The context's log from its start (every partition, in log order per aggregate)
   through the feed's own projection into shadow collections beside the live ones, written with
   the timer store's own writes.
3. **Carry-over.** A change stream on the live timer collections is opened first; then the old
   view is copied over the shadow (the same or a later version of each key wins), one-shot
   timers the outbox holds become DONE tombstones and those due before the tombstone retention
   "expired, state unknown" (FAILED, not fired, unless ``fire_expired``).
4. **Hold.** Every slot of the replicas' lease namespace is held: each holder learns of it at
   its next renewal (within a third of the lease ttl), drains its slot's work (deliveries in
   flight are settled) and releases the slot; the rebuild waits until no slot is held by a
   replica. Deliveries pause from here.
5. **Swap.** The shadow catches up to the log's head (what the feed applied since the replay),
   the old view's timers written since step 3 (the change stream's) are carried again, and each
   shadow collection is renamed over its live one. The hold is lifted: the replicas take their
   slots back within a fraction of a second.

A dry run does steps 1-3 and the catch-up without holding anything, counts, and drops the
shadow. A rebuild interrupted anywhere leaves the live view as it was (the shadow is dropped,
the hold lifted or left to lapse); run it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import anyio

from wowd.config import WowdSettings
from wowd.errors import StorageError
from wowd.model import LogEntry, Position, TimerWrite
from wowd.stores.base import Backend
from wowd.stores.mongo.leases import MongoSlotLeaseStore
from wowd.stores.mongo.timer_rebuild import MongoTimerRebuild
from wowd.stores.mongo.timers import MongoTimerStore
from wowd.stores.timer_rebuild import Finished, SlotsNotReleased

from .timer_rebuild import LOCK_TTL_S, PROGRESS_EVERY_S, SO_FAR, TimerRebuildReport, project_for

__all__ = ["HOLD_POLL_S", "HOLD_TTL_S", "REPLAY_BATCH", "MongoTimerRebuilder"]

log = logging.getLogger(__name__)

REPLAY_BATCH = 500
"""Commits read per batch of the replay, whose timer writes go in one bulk per collection: a
rebuild shares the server with the replicas, whose lease renewals must not wait behind it."""
HOLD_TTL_S = 30.0
"""How long the slots stay held without a renewal (a rebuild killed holds them no longer)."""
HOLD_POLL_S = 0.2
"""How often the rebuild reads the slots while it waits for their holders to release them."""


class MongoTimerRebuilder:
    """Rebuilds one context's timer view on MongoDB (module docstring)."""

    def __init__(
        self,
        settings: WowdSettings,
        backend: Backend,
        *,
        progress: Callable[[str], None] = lambda _line: None,
        batch_size: int = REPLAY_BATCH,
        progress_every_s: float = PROGRESS_EVERY_S,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._progress = progress
        self._batch_size = batch_size
        self._every_s = progress_every_s
        timers, leases = backend.timers, backend.leases
        assert isinstance(timers, MongoTimerStore) and isinstance(leases, MongoSlotLeaseStore)
        self._leases = leases
        self._engine = MongoTimerRebuild(timers, database_name=settings.mongodb.database)
        self._held = False
        self._hold_renewed = 0.0

    async def run(
        self, *, aggregate: str | None = None, dry_run: bool = False, fire_expired: bool = False
    ) -> TimerRebuildReport:
        """The rebuild; raises :class:`~wowd.stores.timer_rebuild.RebuildRunning` when another
        one runs, :class:`~wowd.errors.LeaseLost` when another took the lock meanwhile,
        :class:`~wowd.stores.timer_rebuild.SlotsNotReleased` when a replica does not release its slot."""
        report = TimerRebuildReport(context=self._settings.context, aggregate=aggregate, dry_run=dry_run)
        engine = self._engine
        await engine.acquire(LOCK_TTL_S)
        try:
            await self._rebuild(aggregate, fire_expired, dry_run, report)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await engine.drop_shadow()
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._lift()
                await engine.release()
        return report

    async def _rebuild(
        self, aggregate: str | None, fire_expired: bool, dry_run: bool, report: TimerRebuildReport
    ) -> None:
        s, engine = self._settings, self._engine
        project = project_for(s, aggregate)
        await engine.begin()
        self._progress(
            f"rebuild of the timer view of context {s.context!r}"
            + (f", aggregate {aggregate!r}" if aggregate else "")
            + ": replaying the log into the shadow collections wow_timer_shadow__*"
        )
        positions: dict[int, Position | None] = dict.fromkeys(range(s.partitions))
        report.commits = await self._replay(
            positions, project, report, await engine.majority_time_ms(), catching_up=False
        )
        result = Finished()
        async with engine.changes(s.context) as changes:
            if not fire_expired:
                await engine.expire(int(time.time() * 1000 - s.timers.tombstone_retention_s * 1000))
            await engine.outbox_fired(result)
            names = await engine.live_names(aggregate)
            result.old_view = await engine.old_view_exists(names)
            await engine.carry(names, result)
            started = time.monotonic()
            if not dry_run:
                await self._hold()
            bound = await engine.majority_time_ms()  # every commit the feeds applied is below it
            report.caught_up = await self._replay(positions, project, report, bound, catching_up=True)
            await self._renew_hold()
            await engine.mark(changes)
            names = await engine.live_names(aggregate)
            await engine.carry(names, result, ids=changes.ids)
            await engine.outbox_fired(result)
            await engine.count(aggregate, result)
            if not dry_run:
                await self._renew_hold()
                await engine.swap(aggregate)
                result.swapped = True
                await self._lift()
            else:
                await engine.drop_shadow()
            report.finish_s = time.monotonic() - started
        report.finished(result, context=s.context)

    async def _replay(
        self,
        positions: dict[int, Position | None],
        project: Callable[[Sequence[LogEntry]], list[TimerWrite]],
        report: TimerRebuildReport,
        bound_ms: int,
        *,
        catching_up: bool,
    ) -> int:
        """The log after ``positions`` into the shadow until every partition's read has passed
        ``bound_ms`` (a watermark at or past it: every commit before it was read) or the read
        is at the log's head, whichever first (producers go on appending meanwhile);
        ``positions`` moves on. Answers the commits read."""
        read = 0
        shown = time.monotonic()
        everyone = frozenset(positions)
        passed: set[int] = set()
        batches = self._backend.log.read(dict(positions), batch_size=self._batch_size, follow=False)
        try:
            async for batch in batches:
                positions.update(batch.positions)
                read += len(batch.entries)
                writes = project([e for e in batch.entries if e.commit is not None])
                if writes:
                    await self._engine.shadow.write(writes)
                now = time.monotonic()
                if now - shown >= self._every_s:
                    shown = now
                    await self._engine.renew(LOCK_TTL_S)
                    await self._renew_hold()
                    if not catching_up:
                        live = await self._engine.live_count()
                        self._progress(f"rebuild: {report.commits + read} commits read, {live} {SO_FAR}")
                if batch.watermark is not None and batch.watermark >= bound_ms:
                    passed |= batch.covers if batch.covers is not None else everyone
                    if passed >= everyone:
                        break
        finally:
            await batches.aclose()  # type: ignore[attr-defined]
        if not catching_up:
            live = await self._engine.live_count()
            self._progress(f"rebuild: {read} commits read, {live} {SO_FAR}")
        return read

    # ---- the hold of the slots

    def _namespace(self) -> str:
        return self._settings.lease_namespace

    def _hold_by(self) -> str:
        """Who holds the slots, as ``wowd status`` names it."""
        return f"timer view rebuild {self._engine.owner}"

    async def _hold(self) -> None:
        """Holds every slot and waits until no replica holds one (module docstring, step 4);
        raises :class:`SlotsNotReleased` naming the holders still there after a lease ttl, a third
        of it and the shutdown grace period (a replica of a version that knows no hold)."""
        s = self._settings
        self._held = True
        await self._leases.hold(self._namespace(), self._hold_by(), timedelta(seconds=HOLD_TTL_S))
        self._hold_renewed = time.monotonic()
        self._progress(f"rebuild: holding the slots of {self._namespace()}: their replicas drain and release them")
        tolerance_ms = int(s.lease.tolerance_s * 1000)
        limit = time.monotonic() + s.lease.ttl_s * 4 / 3 + s.shutdown.grace_s + s.lease.tolerance_s
        while True:
            states = await self._leases.slots(self._namespace())
            busy = [st for st in states if st.owner_key is not None and st.expires_at + tolerance_ms >= st.store_now]
            if not busy:
                return
            if time.monotonic() > limit:
                named = ", ".join(f"slot {st.slot} by {st.owner_key}" for st in busy)
                raise SlotsNotReleased(
                    f"the slots were not released within {limit - self._hold_renewed:.0f} s: {named} (a replica of "
                    "a wowd version that does not release held slots: upgrade it, or stop it for the rebuild)"
                )
            await self._renew_hold()
            await anyio.sleep(HOLD_POLL_S)

    async def _renew_hold(self) -> None:
        if self._held and time.monotonic() - self._hold_renewed >= HOLD_TTL_S / 3:
            await self._leases.hold(self._namespace(), self._hold_by(), timedelta(seconds=HOLD_TTL_S))
            self._hold_renewed = time.monotonic()

    async def _lift(self) -> None:
        if not self._held:
            return
        self._held = False
        try:
            await self._leases.lift(self._namespace(), self._hold_by())
        except StorageError as exc:
            log.warning("the hold of the slots could not be lifted (it lapses within %.0f s): %s", HOLD_TTL_S, exc)
