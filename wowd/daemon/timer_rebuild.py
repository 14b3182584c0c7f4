"""A rebuild of the timer view from the log, beside the live view, swapped in while the replicas
run (``wowd timers rebuild``; docs/operations.md, "Recovery"), on any backend that offers it
(:data:`~wowd.stores.base.TIMER_VIEW_REBUILD`).

1. **Lock.** The backend's rebuild lock of the context (one rebuild at a time; another one is
   refused naming the holder), renewed at every progress line.
2. **Replay.** The context's log from its start, in log order per aggregate and in batches, into
   a shadow of the view beside the live one, through the feed's own projection of commits into
   timer writes (:func:`~wowd.daemon.feed.prepare_batch`), written with the timer view's own
   writes: the shadow is the view the feed would have built (cancels leave their tombstones).
3. **Carry-over.** What the old view holds that the log does not (tombstones, attempts, PARKED,
   FAILED and their reasons, claims, occurrences of recurring timers) is carried over, one-shot
   timers the outbox knows of become tombstones, and one-shot timers due before the tombstone
   retention with no tombstone are "expired, state unknown" (FAILED, not fired, unless
   ``fire_expired``); the replicas go on meanwhile.
4. **Pause.** A backend whose swap needs it has every slot of the replicas' lease namespace held
   (:data:`~wowd.stores.base.SLOT_HOLD`): each holder learns of it at its next renewal (within a
   third of the lease ttl), drains its slot's work (deliveries in flight are settled) and
   releases the slot; the rebuild waits until no slot is held by a replica. Another pauses the
   replicas' writes itself (the embedded file's write lock, in its finishing transaction).
   Deliveries pause from here.
5. **Finish.** The shadow catches up to what the feed applied since the replay, what the old
   view was written meanwhile is carried again, and the shadow replaces the view; the hold is
   lifted.

A dry run does all of it but the hold and the swap: the counts, nothing changed. A rebuild
interrupted anywhere leaves the live view as it was (the shadow dropped, a hold lifted or left to
lapse); run it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import anyio

from wowd.config import TimerSettings, WowdSettings
from wowd.errors import ConfigError, StorageError
from wowd.model import LogEntry, TimerWrite
from wowd.stores.base import SLOT_HOLD, TIMER_VIEW_REBUILD, Backend, SlotHold, TimerViewRebuild
from wowd.stores.timer_rebuild import Finished, SlotsNotReleased
from wowd.views import TIMERS, view_named

from .feed import prepare_batch

__all__ = [
    "HOLD_POLL_S",
    "HOLD_TTL_S",
    "FeedProjection",
    "TimerRebuildReport",
    "TimerRebuilder",
    "project_for",
    "timer_view_consumer",
]

SO_FAR = "timers scheduled and not cancelled so far (the summary counts those live once the fired ones are known)"
"""What a progress line's count is: the summary's live timers are fewer by the one-shot timers
found fired at the end (in the outbox, or the old view's tombstones)."""

log = logging.getLogger(__name__)

LOCK_TTL_S = 60.0
"""How long the rebuild lock holds without a renewal (renewed at every progress line)."""
PROGRESS_EVERY_S = 1.0
"""A progress line at most this often."""
COUNT_SHARE = 0.05
"""The most of the replay's time the progress lines spend counting live timers (a count reads
the whole shadow: a line between two counts shows the last one)."""
HOLD_TTL_S = 30.0
"""How long the slots stay held without a renewal (a rebuild killed holds them no longer)."""
HOLD_POLL_S = 0.2
"""How often the rebuild reads the slots while it waits for their holders to release them."""


def timer_view_consumer() -> str:
    """The checkpoint consumer whose checkpoints say how far the timer view has applied the log
    (its own: no other view is replayed): the one a rebuilt view is made consistent with before
    it is swapped in."""
    return view_named(TIMERS).consumer


@dataclass(slots=True)
class TimerRebuildReport:
    """What a rebuild read, found and did."""

    context: str
    aggregate: str | None
    commits: int = 0
    """Commits replayed before the finish."""
    caught_up: int = 0
    """Commits read in the finish (applied by the feed since the replay read them)."""
    total: int | None = None
    """Commits of the log when the replay started (where the backend counts them at once)."""
    statuses: dict[str, int] = field(default_factory=dict)
    """Timers of the new view per status (tombstones as DONE and CANCELLED)."""
    carried: int = 0
    old_view: bool = True
    unreadable: list[int] = field(default_factory=list)
    fired_in_outbox: int = 0
    expired: int = 0
    expired_listed: list[tuple[str, str, str, int]] = field(default_factory=list)
    """``(timer_id, owner, key, due_at)`` of the first expired timers."""
    swapped: bool = False
    dry_run: bool = False
    finish_s: float = 0.0
    """How long the finish paused the replicas (the write lock or the slots held)."""
    pause: str = ""
    """What the finish held, as the summary names it."""

    @property
    def live(self) -> int:
        return sum(n for s, n in self.statuses.items() if s not in ("DONE", "CANCELLED"))

    def finished(self, found: Finished, *, context: str) -> None:
        """Takes what the finish found and did, and logs the rebuild's end."""
        self.caught_up = found.caught_up
        self.statuses = found.statuses
        self.carried = found.carried
        self.old_view = found.old_view
        self.unreadable = found.unreadable
        self.fired_in_outbox = found.fired_in_outbox
        self.expired = found.expired
        self.expired_listed = [(e.timer_id, e.owner, e.key, e.due_at) for e in found.expired_listed]
        self.swapped = found.swapped
        log.info(
            "timer view of %s rebuilt%s: %d commits, %d live, %d expired, swapped %s",
            context,
            " (dry run)" if self.dry_run else "",
            self.commits + self.caught_up,
            self.live,
            self.expired,
            self.swapped,
        )


@dataclass(frozen=True, slots=True)
class FeedProjection:
    """The feed's projection of log entries into the timer view's writes (only ``aggregate``'s
    commits when given); picklable, so that a backend may run it in processes of its own."""

    limits: TimerSettings
    partitions: int
    aggregate: str | None = None

    def __call__(self, entries: Sequence[LogEntry]) -> list[TimerWrite]:
        if self.aggregate is not None:
            entries = [e for e in entries if e.aggregate.aggregate == self.aggregate]
        if not entries:
            return []
        return prepare_batch(entries, self.limits, self.partitions).timer_writes


def project_for(settings: WowdSettings, aggregate: str | None) -> FeedProjection:
    """The feed's projection of log entries into the timer view's writes under ``settings``
    (only ``aggregate``'s commits when given)."""
    return FeedProjection(settings.timers, settings.partitions, aggregate)


class TimerRebuilder:
    """Rebuilds one context's timer view (module docstring) with the backend's
    :data:`~wowd.stores.base.TIMER_VIEW_REBUILD`. ``batch_size``: commits per batch of the replay
    (``None``: the backend's); ``workers``: processes that project the replay where the backend
    uses them (``None``: as many as fit)."""

    def __init__(
        self,
        settings: WowdSettings,
        backend: Backend,
        *,
        progress: Callable[[str], None] = lambda _line: None,
        batch_size: int | None = None,
        progress_every_s: float = PROGRESS_EVERY_S,
        workers: int | None = None,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._progress = progress
        self._batch_size = batch_size
        self._every_s = progress_every_s
        self._workers = workers
        self._live = 0
        self._count_at = 0.0
        self._ticked = 0.0
        self._hold: SlotHold | None = None
        self._held = False
        self._hold_renewed = 0.0
        self._owner = ""
        self._engine: TimerViewRebuild | None = None

    async def run(
        self, *, aggregate: str | None = None, dry_run: bool = False, fire_expired: bool = False
    ) -> TimerRebuildReport:
        """The rebuild; raises :class:`~wowd.stores.timer_rebuild.RebuildRunning` when another
        one runs, :class:`~wowd.errors.LeaseLost` when another took the lock meanwhile,
        :class:`~wowd.stores.timer_rebuild.SlotsNotReleased` when a replica does not release its
        slot, :class:`~wowd.errors.ConfigError` on a backend that offers no rebuild."""
        s, backend = self._settings, self._backend
        rebuilds = backend.capability(TIMER_VIEW_REBUILD)
        if rebuilds is None:
            raise ConfigError(f"no timer view rebuild on the {backend.name} backend")
        engine = rebuilds.rebuild(
            project=project_for(s, aggregate), consumer=timer_view_consumer(), aggregate=aggregate
        )
        if engine.holds_slots:
            self._hold = backend.capability(SLOT_HOLD)
            if self._hold is None:
                raise ConfigError(f"the timer view rebuild of the {backend.name} backend holds slots its leases cannot")
        report = TimerRebuildReport(context=s.context, aggregate=aggregate, dry_run=dry_run, pause=engine.pause)
        self._engine = engine
        self._owner = f"timer view rebuild {engine.owner}"
        try:
            await engine.acquire(LOCK_TTL_S)
            try:
                await self._rebuild(engine, aggregate, fire_expired, dry_run, report)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await engine.abort()
                raise
            finally:
                with anyio.CancelScope(shield=True):
                    await self._lift()
                    await engine.release()
        finally:
            await engine.close()
        return report

    async def _rebuild(
        self,
        engine: TimerViewRebuild,
        aggregate: str | None,
        fire_expired: bool,
        dry_run: bool,
        report: TimerRebuildReport,
    ) -> None:
        s = self._settings
        report.total = await engine.begin()
        replaying = f"{report.total} commits" if report.total is not None else "the log"
        self._progress(
            f"rebuild of the timer view of context {s.context!r}"
            + (f", aggregate {aggregate!r}" if aggregate else "")
            + f": replaying {replaying} into {engine.shadow}"
        )
        shown = self._ticked = time.monotonic()
        async for n in engine.replay(batch_size=self._batch_size, workers=self._workers):
            report.commits += n
            now = time.monotonic()
            if now - shown >= self._every_s:
                shown = now
                await self._tick()
                await self._line(engine, report)
        await self._line(engine, report, last=True)
        retention_ms = s.timers.tombstone_retention_s * 1000
        expired_before = None if fire_expired else int(time.time() * 1000) - retention_ms
        result = Finished()
        async with engine.finishing(expired_before=expired_before, result=result):
            started = time.monotonic()
            if engine.holds_slots and not dry_run:
                await self._hold_slots()
            await engine.finish(swap=not dry_run, result=result, tick=self._tick)
            report.finish_s = time.monotonic() - started
            await self._lift()
        report.finished(result, context=s.context)

    async def _tick(self) -> None:
        """Between batches: the lock renewed (at most every progress interval) and the hold."""
        now = time.monotonic()
        if now - self._ticked >= self._every_s:
            self._ticked = now
            await self._renew_lock()
        await self._renew_hold()

    async def _renew_lock(self) -> None:
        engine = self._engine
        if engine is not None:
            await engine.renew(LOCK_TTL_S)

    async def _line(self, engine: TimerViewRebuild, report: TimerRebuildReport, *, last: bool = False) -> None:
        """A progress line; the live timers counted again when the counting has taken no more
        than :data:`COUNT_SHARE` of the time since the last count (it reads the whole shadow),
        and on the ``last`` line."""
        now = time.monotonic()
        if last or now >= self._count_at:
            self._live = await engine.live_count()
            took = time.monotonic() - now
            self._count_at = now + took / COUNT_SHARE
        if report.total is None:
            self._progress(f"rebuild: {report.commits} commits read, {self._live} {SO_FAR}")
            return
        if report.commits > report.total:  # commits appended since the replay began are read too
            grew = f"the log held {report.total} when the replay began"
            self._progress(f"rebuild: {report.commits} commits read ({grew}), {self._live} {SO_FAR}")
            return
        share = f" ({100 * report.commits // report.total}%)" if report.total else ""
        self._progress(f"rebuild: {report.commits} of {report.total} commits read{share}, {self._live} {SO_FAR}")

    # ---- the hold of the slots

    async def _hold_slots(self) -> None:
        """Holds every slot and waits until no replica holds one (module docstring, step 4);
        raises :class:`SlotsNotReleased` naming the holders still there after a lease ttl, a third
        of it and the shutdown grace period (a replica of a version that knows no hold)."""
        s, hold = self._settings, self._hold
        assert hold is not None
        namespace = s.lease_namespace
        self._held = True
        await hold.hold(namespace, self._owner, timedelta(seconds=HOLD_TTL_S))
        self._hold_renewed = time.monotonic()
        self._progress(f"rebuild: holding the slots of {namespace}: their replicas drain and release them")
        tolerance_ms = int(s.lease.tolerance_s * 1000)
        limit = time.monotonic() + s.lease.ttl_s * 4 / 3 + s.shutdown.grace_s + s.lease.tolerance_s
        while True:
            states = await self._backend.leases.slots(namespace)
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
        if self._held and self._hold is not None and time.monotonic() - self._hold_renewed >= HOLD_TTL_S / 3:
            await self._hold.hold(self._settings.lease_namespace, self._owner, timedelta(seconds=HOLD_TTL_S))
            self._hold_renewed = time.monotonic()

    async def _lift(self) -> None:
        if not self._held or self._hold is None:
            return
        self._held = False
        try:
            await self._hold.lift(self._settings.lease_namespace, self._owner)
        except StorageError as exc:
            log.warning("the hold of the slots could not be lifted (it lapses within %.0f s): %s", HOLD_TTL_S, exc)
