"""The log feed of one held slot (docs/architecture.md).

Per batch read from the log after the views' checkpoints (:mod:`wowd.views`): quarantine
malformed entries, write the commits to each aggregate type's event sink (the index view),
project timer events into the timer store and resume the parked timers of the aggregates that
just committed (the timer view), fold snapshots where a reducer is configured (a snapshot view
per type), then save each partition's checkpoint of each view under the slot's fence. Where the stores share
a transaction (the embedded file's :class:`~wowd.stores.base.FeedWriter`), the sink, timer, parked
and checkpoint steps of a batch are that one transaction. Every step is idempotent, so a
transient failure (:class:`StorageUnavailable`, a full disk among them) retries the whole batch
after a backoff and a batch is never half-checkpointed. A refused checkpoint means another holder has the
slot: the slot's work stops (:class:`LeaseLost`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from wowd import metrics
from wowd.clock import now_ms
from wowd.config import WowdSettings
from wowd.errors import (
    ConfigError,
    InvalidInput,
    LeaseLost,
    LogBehindOplog,
    ReducerFailed,
    SlotStalled,
    StorageError,
    StorageFull,
    StorageUnavailable,
    StoreRefused,
    WowdError,
)
from wowd.model import (
    AggregateRef,
    AggregateType,
    Commit,
    HistoryRecord,
    LogBatch,
    LogEntry,
    Position,
    SnapshotRecord,
    Timer,
    TimerChange,
    TimerWrite,
    commit_to_doc,
)
from wowd.reducers import Reducer, fold_commit
from wowd.retry import Backoff, Pauses, RetryStopped, retrying
from wowd.stores.base import FEED_TRANSACTION, Backend, EventSink, FeedWriter, TimerHistory
from wowd.views import (
    FROM_START,
    INDEX,
    LEGACY_CONSUMER,
    TIMERS,
    View,
    enabled_views,
    start_positions,
    stored_checkpoints,
)

from .feed_batch import Prepared, StepFailed, field_of, prepare_batch, step
from .leases import HeldSlot
from .stall import ViewStall
from .waker import Waker, owner_key

__all__ = ["CONSUMER", "Feeder", "field_of", "prepare_batch"]

log = logging.getLogger(__name__)

CONSUMER = LEGACY_CONSUMER
"""The timer view's checkpoint consumer (and the one quarantined items name)."""


RETRY_BACKOFF = Backoff(0.1, 10.0, jitter=True)
"""The pause before retrying a batch the stores could not take (jittered: the slots of the
replicas retrying one store do not retry in step)."""
STALL_BACKOFF = Backoff(0.1, 60.0, jitter=True)
"""The pause before retrying a stalled slot's batch (at most a minute)."""
READ_AHEAD = 4
"""Batches the feed reads ahead of the one it applies."""
JOIN_WITHIN_S = 1.0
"""A view that caught up joins the shared read if it can read what it still lacks within this
(the shared read waits for it meanwhile); else it tries again when it next catches up."""
IDLE_CHECKPOINT_EVERY_S = 5.0
"""A quiet partition's checkpoint is saved at most this often (the read moves it on)."""

_Read = tuple[LogBatch, int, "Prepared | None", Exception | None]
"""A batch read ahead, its number (:meth:`Waker.reading`), what its steps need (``None`` for a
batch with no commits), or the read's failure."""


class Feeder:
    """Feeds the views of one held slot (:mod:`wowd.views`) until the slot stops, at a
    batch boundary.

    The views whose checkpoints are where the lead view's are (the timer view, or the first view
    kept) share one read of the log and one write per batch where the stores share a transaction
    (the embedded file's :class:`~wowd.stores.base.FeedWriter`); each keeps its own checkpoints,
    saved together. A view other than the lead that fails a batch (its store unavailable or
    refusing, a reducer that raises) leaves the shared read: it follows the log on its own from
    its own checkpoint, stalled and retried with a backoff while its store does not take it,
    and joins the shared read again once it has caught up with it, while the lead and the other
    views go on. A lead view's failure stops the shared read (it is retried, quarantined record
    by record, or stalls the slot as a feed's failure does)."""

    def __init__(
        self,
        settings: WowdSettings,
        backend: Backend,
        *,
        reducers: Mapping[str, Reducer] | None = None,
        batch_size: int = 500,
        views: Sequence[View] | None = None,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._reducers = dict(reducers or {})
        self._batch_size = batch_size
        self.views = tuple(views) if views is not None else enabled_views(settings, self._reducers)
        if not self.views:
            raise ConfigError("feed.views_off leaves no view to feed")
        self.lead = self.views[0]
        self._current: list[View] = list(self.views)
        """The views following the shared read, in the order of :attr:`views`."""
        self._stalls: dict[View, ViewStall] = {}
        self._prepared_sinks: set[AggregateType] = set()
        self._processing = False
        self._stopping = False
        self._read_scope: anyio.CancelScope | None = None
        self._boundary = anyio.Lock()
        """Held while the shared read applies a batch: a view joining it does so between two."""
        self._positions: dict[int, Position | None] = {}
        """Where the shared read is (the lead view's positions)."""
        self._tg: anyio.abc.TaskGroup | None = None
        self._idle_saved: dict[int, float] = {}
        """When (``time.monotonic()``) each quiet partition's checkpoint was last saved."""

    # ---- state for readiness, status and tests

    @property
    def stalled(self) -> str | None:
        """Why the slot's lead view cannot progress now (``None``: it does): the slot is not
        ready while it cannot."""
        st = self._stalls.get(self.lead)
        return None if st is None or st.reason is None else f"{self.lead.name} view: {st.reason}"

    @property
    def stalled_since(self) -> float:
        st = self._stalls.get(self.lead)
        return st.since if st is not None else 0.0

    def view_stalls(self) -> dict[str, str]:
        """Each stalled view's reason, by view name (the lead's among them)."""
        return {v.name: st.reason for v, st in self._stalls.items() if st.reason is not None}

    def stalls_of(self, slot: int) -> dict[View, ViewStall]:
        """The stall state of each view, for ``slot``: only the lead's stall gives the slot up."""
        release_s = self._settings.feed.stall_release_s
        self._stalls = {v: ViewStall(slot, v, release_s=release_s if v is self.lead else None) for v in self.views}
        return self._stalls

    def following(self) -> list[str]:
        """The views following the shared read now (the others follow on their own)."""
        return [v.name for v in self._current]

    def _request_stop(self) -> None:
        self._stopping = True
        if not self._processing and self._read_scope is not None:
            self._read_scope.cancel()

    # ---- the shared read

    async def run(
        self, held: HeldSlot, waker: Waker, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        logx = logging.LoggerAdapter(log, held.log_extra())
        held.on_stop(self._request_stop)
        parts = sorted(held.partitions)
        self.stalls_of(held.slot)
        try:
            async for attempt in retrying(
                "reading checkpoints", backoff=RETRY_BACKOFF, stop=held.stop_event, logger=logx
            ):
                with attempt:
                    starts = await self._starts(held, parts)
        except RetryStopped:
            task_status.started()
            return
        self._positions = starts[self.lead]
        self._current = [v for v in self.views if starts[v] == self._positions]
        lagging = [v for v in self.views if v not in self._current]
        task_status.started()
        logx.info("feeding %d partitions into %d view(s) from their checkpoints", len(parts), len(self.views))
        logx.debug("views: %s", ", ".join(v.name for v in self.views))
        if lagging:
            logx.info("views %s are behind: they catch up on their own", ", ".join(v.name for v in lagging))
        failure: Exception | None = None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for v in lagging:
                    tg.start_soon(self._follow, held, v, starts[v], logx)
                try:
                    await self._shared(held, waker, logx)
                except Exception as exc:  # raised as it is, not in a group, once the followers stopped
                    failure = exc
                tg.cancel_scope.cancel()
            if failure is not None:
                raise failure
        finally:
            self._tg = None
        logx.info("feed stopped at a batch boundary")

    async def _starts(self, held: HeldSlot, parts: Sequence[int]) -> dict[View, dict[int, Position | None]]:
        """Where each view reads each partition from (:func:`~wowd.views.start_positions`). A
        view without a checkpoint of its own for a partition is given one at once, where it
        starts (the ``wowd`` checkpoint, or the log's start), under the slot's fence: a view that
        then falls behind keeps its place, however far the timer view's checkpoint moves on."""
        legacy, own = await stored_checkpoints(self._backend.checkpoints, self.views, parts)
        out = {v: start_positions(stored, legacy, parts) for v, stored in own.items()}
        carried: dict[int, tuple[str, ...]] = {}
        for v, stored in own.items():
            if v.consumer != LEGACY_CONSUMER:
                for p in parts:
                    if p not in stored:
                        carried[p] = (*carried.get(p, ()), v.consumer)
        by_consumers: dict[tuple[str, ...], dict[int, Position]] = {}
        for p, consumers in carried.items():
            cp = legacy.get(p)
            by_consumers.setdefault(consumers, {})[p] = cp.position if cp is not None else FROM_START
        for consumers, positions in by_consumers.items():
            held.check()
            if not await self._backend.checkpoints.save_all(list(consumers), positions, held.fence):
                raise LeaseLost(f"checkpoints of partitions {sorted(positions)} refused under fence {held.fence}")
        return out

    async def _shared(self, held: HeldSlot, waker: Waker, logx: logging.LoggerAdapter[logging.Logger]) -> None:
        lead = self._stalls[self.lead]
        pauses = Pauses(RETRY_BACKOFF, held.stop_event)
        while not self._stopping and not held.stopping:
            try:
                with anyio.CancelScope() as scope:
                    self._read_scope = scope
                    reader = self._backend.log.read(self._positions, batch_size=self._batch_size, follow=True)
                    send, receive = anyio.create_memory_object_stream[_Read](READ_AHEAD)
                    registered = [0]
                    failed: Exception | None = None
                    try:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(self._read_ahead, reader, waker, send, registered)
                            async with receive:
                                try:
                                    async for batch, number, prepared, error in receive:
                                        if error is not None:
                                            failed = error
                                            break
                                        self._processing = True
                                        async with self._boundary:
                                            await self._process(held, batch, number, prepared, waker, logx)
                                            self._positions.update(batch.positions)
                                        self._processing = False
                                        pauses.reset()
                                        if self._stopping:
                                            break
                                except Exception as exc:  # raised below, outside the task group
                                    failed = exc
                                tg.cancel_scope.cancel()  # the reader, before its stream closes
                    finally:
                        # batches read ahead and not applied are read again (registered anew)
                        waker.applied(registered[0], None)
                    if failed is not None:
                        raise failed
                self._read_scope = None
            except LogBehindOplog as exc:
                # the log's history was lost again after a re-read: re-reading at once would only
                # lose it again; stalled (not ready, an ERROR a minute) until the oplog keeps more
                self._processing = False
                self._read_scope = None
                metrics.FEED_ERRORS.labels(kind="fatal").inc()
                lead.stall(f"log read: {exc}", logx)
                await pauses.pause(STALL_BACKOFF)
            except StorageUnavailable as exc:
                self._processing = False
                metrics.FEED_ERRORS.labels(kind="transient").inc()
                lead.retrying("log read failed (will retry): %s", exc, logx)
                lead.unavailable(f"log read: {exc}", logx, full=isinstance(exc, StorageFull))
                await pauses.pause()
            except (StorageError, InvalidInput) as exc:
                # the log itself refuses (a corrupted file, no privilege): nothing can be fed
                self._processing = False
                self._read_scope = None
                metrics.FEED_ERRORS.labels(kind="fatal").inc()
                lead.stall(f"log read: {type(exc).__name__}: {exc}", logx)
                await pauses.pause(STALL_BACKOFF)

    async def _read_ahead(
        self,
        reader: AsyncIterator[LogBatch],
        waker: Waker,
        send: MemoryObjectSendStream[_Read],
        registered: list[int],
    ) -> None:
        """Reads the log while the batches before are applied (at most :data:`READ_AHEAD`
        ahead), telling the waker of each batch as soon as it is read: the timer loop may then
        deliver what it claimed once the feed has read past its due time, except timers of the
        aggregates a batch not applied yet commits to. A read failure is handed on in order.

        Each batch is also prepared here (:func:`prepare_batch`): that Python runs while the
        batch before is written, when the stores' calls do not need the interpreter."""
        s = self._settings
        async with send, aclosing(reader) as batches:  # type: ignore[type-var]
            try:
                async for batch in batches:
                    owners = {owner_key(e.commit.ref) for e in batch.entries if e.commit is not None}
                    registered[0] = waker.reading(batch.watermark, owners, batch.covers)
                    if not batch.entries and not batch.positions:
                        # nothing to apply: its read of the log's head is registered above, and a
                        # later one carries a later watermark, so it does not wait for the batches
                        # queued before it (a reader waiting here stops the read mark)
                        with contextlib.suppress(anyio.WouldBlock):
                            send.send_nowait((batch, registered[0], None, None))
                        continue
                    prepared = prepare_batch(batch.entries, s.timers, s.partitions) if batch.entries else None
                    if prepared is not None:
                        await self._plan(prepared)
                    await send.send((batch, registered[0], prepared, None))
            except (StorageError, InvalidInput) as exc:
                with contextlib.suppress(anyio.BrokenResourceError):
                    await send.send((LogBatch(entries=(), positions={}), 0, None, exc))
            except anyio.BrokenResourceError:  # the feed stopped reading
                return

    def _indexed(self, views: Sequence[View]) -> bool:
        return any(v.name == INDEX for v in views)

    async def _plan(self, prepared: Prepared) -> None:
        """The feed writer's :meth:`~FeedWriter.plan` of a batch read ahead, which the batch's
        transaction then takes ready (a failure leaves it to be made when the batch is applied)."""
        writer = self._backend.capability(FEED_TRANSACTION)
        views = self._current
        if writer is None or self._folds(prepared, views):
            return
        indexed = self._indexed(views)
        sinks = [(self._backend.sink(t), commits) for t, commits in prepared.by_type.items()] if indexed else []
        writes = prepared.timer_writes if any(v.name == TIMERS for v in views) else []
        with contextlib.suppress(WowdError):
            prepared.planned = await writer.plan(sinks, writes)
            prepared.planned_for = (indexed, bool(writes))

    async def _process(
        self,
        held: HeldSlot,
        batch: LogBatch,
        read: int,
        prepared: Prepared | None,
        waker: Waker,
        logx: logging.LoggerAdapter[logging.Logger],
    ) -> None:
        """Applies batch number ``read`` (as the waker numbered it when it was read), prepared
        when it was read, to the views following the shared read."""
        if prepared is None:  # caught up: the watermark moved on
            if batch.positions:  # quiet partitions moved on: their checkpoints follow
                try:
                    await self._idle_checkpoint(held, batch.positions, logx)
                finally:
                    waker.applied(read, batch.watermark, batch.covers)
            else:
                waker.applied(read, batch.watermark, batch.covers)
            for v in self._current:
                self._stalls[v].lag(0.0)
            return
        before = dict(self._positions)
        try:
            applied = await self._apply_until_done(held, batch, prepared, waker, logx, self.lead, self._current)
        finally:
            # applied, or given up (its commits are read again, as a later batch)
            waker.applied(read, None)
        self._leave(held, [v for v in self._current if v not in applied], before, logx)
        # metrics only once the batch is checkpointed (a retried batch counts once)
        for e in prepared.malformed:
            metrics.QUARANTINED.labels(field=field_of(e.error)).inc()
        for _c, _p, err in prepared.rejected:
            metrics.TIMER_EVENTS_REJECTED.labels(field=err.field or "unknown").inc()
            metrics.QUARANTINED.labels(field=err.field or "unknown").inc()
        last_time = 0
        for type_, commits in prepared.by_type.items():
            metrics.FEED_COMMITS.labels(aggregate=type_.aggregate).inc(len(commits))
            last_time = max(last_time, max(c.create_time for c in commits))
        lag = 0.0 if batch.watermark is not None else max(0.0, time.time() - last_time / 1000) if last_time else None
        if lag is not None:
            for v in applied:
                self._stalls[v].lag(lag)
        if batch.watermark is not None:  # caught up
            waker.advance(batch.watermark, batch.covers)

    async def _apply_until_done(
        self,
        held: HeldSlot,
        batch: LogBatch,
        prepared: Prepared,
        waker: Waker | None,
        logx: logging.LoggerAdapter[logging.Logger],
        lead: View,
        views: Sequence[View],
    ) -> list[View]:
        """Applies a batch to ``views`` until the ``lead`` view has taken it: retried after a
        transient failure, quarantined commit by commit after a refusal of some of its
        commits, stalled while the store refuses all of them. The views it was applied to
        (those of ``views`` that did not fail it: the lead among them)."""
        st = self._stalls[lead]
        pauses = Pauses(RETRY_BACKOFF, held.stop_event)
        while True:
            held.check()
            try:
                applied = await self._apply(held, batch.positions, prepared, waker, logx, lead, views)
                break
            except StoreRefused as exc:
                # the store refuses every write (a block, credentials, a privilege): a stall
                # at once, nothing set aside; the batch is retried until the store takes it
                metrics.FEED_ERRORS.labels(kind="fatal").inc()
                st.stall(f"{type(exc).__name__}: {exc}", logx)
                await pauses.pause(STALL_BACKOFF)
            except StorageUnavailable as exc:
                metrics.FEED_ERRORS.labels(kind="transient").inc()
                st.retrying("feed batch failed (retrying the batch): %s", exc, logx)
                st.unavailable(str(exc), logx, full=isinstance(exc, StorageFull))
                await pauses.pause()
            except StepFailed as failed:
                metrics.FEED_ERRORS.labels(kind="fatal").inc()
                if isinstance(failed.error, ReducerFailed):
                    # the reducer's code, not the commit: nothing set aside; retried until fixed
                    st.stall(f"{failed.step}: {failed.error}", logx)
                    await pauses.pause(STALL_BACKOFF)
                    continue
                isolated = await self._isolate(held, batch, waker, logx, lead, views)
                if isolated is not None:
                    applied = isolated
                    break
                # every record fails for the store's own reasons: nothing to quarantine
                st.stall(f"{failed.step}: {type(failed.error).__name__}: {failed.error}", logx)
                await pauses.pause(STALL_BACKOFF)
        st.progressed(logx)
        return applied

    def _leave(
        self,
        held: HeldSlot,
        failed: Sequence[View],
        positions: Mapping[int, Position | None],
        logx: logging.LoggerAdapter[logging.Logger],
    ) -> None:
        """Views that failed a batch of the shared read leave it: each follows the log on its own
        from ``positions`` (where the shared read was before the batch: its checkpoints)."""
        for v in failed:
            if v in self._current and v is not self.lead:
                self._current.remove(v)
                logx.warning("%s view falls behind: it follows the log on its own until it catches up", v.name)
                if self._tg is not None:
                    self._tg.start_soon(self._follow, held, v, dict(positions), logx)

    # ---- a view behind the shared read

    async def _follow(
        self,
        held: HeldSlot,
        view: View,
        positions: dict[int, Position | None],
        logx: logging.LoggerAdapter[logging.Logger],
    ) -> None:
        """Feeds ``view`` alone from ``positions`` until it has caught up with the shared read
        (:meth:`_join`), retrying while its store does not take a batch (stalled after a while:
        ``wowd_feed_stalled{view}``, never the slot's readiness)."""
        st = self._stalls[view]
        s = self._settings
        pauses = Pauses(RETRY_BACKOFF, held.stop_event)
        while not self._stopping and not held.stopping:
            try:
                reader = self._backend.log.read(positions, batch_size=self._batch_size, follow=True)
                async with aclosing(reader) as batches:  # type: ignore[type-var]
                    async for batch in batches:
                        if batch.entries:
                            prepared = prepare_batch(batch.entries, s.timers, s.partitions)
                            await self._apply_until_done(held, batch, prepared, None, logx, view, (view,))
                            last = max((e.commit.create_time for e in batch.entries if e.commit is not None), default=0)
                            st.lag(max(0.0, time.time() - last / 1000) if last else 0.0)
                        positions.update(batch.positions)
                        pauses.reset()
                        if (
                            batch.watermark is not None
                            and not batch.entries
                            and await self._join(held, view, positions, logx)
                        ):
                            st.lag(0.0)
                            return
                        if self._stopping or held.stopping:
                            return
            except LeaseLost:
                return  # the shared read meets it too, and stops the slot's work
            except StorageUnavailable as exc:
                st.retrying(f"{view.name} view: log read failed (will retry): %s", exc, logx)
                st.unavailable(f"log read: {exc}", logx, full=isinstance(exc, StorageFull))
                await pauses.pause()
            except (StorageError, InvalidInput) as exc:
                st.stall(f"log read: {type(exc).__name__}: {exc}", logx)
                await pauses.pause(STALL_BACKOFF)

    async def _join(
        self,
        held: HeldSlot,
        view: View,
        positions: dict[int, Position | None],
        logx: logging.LoggerAdapter[logging.Logger],
    ) -> bool:
        """Between two batches of the shared read, reads what ``view`` still lacks up to the log's
        head (at or past the shared read's position) and joins the shared read; False when that
        fails or takes longer than :data:`JOIN_WITHIN_S` (it keeps following on its own). A
        joined view may be ahead of the shared read: the batches it applies again are written
        again as they were (every view's write is idempotent)."""
        s = self._settings
        with anyio.move_on_after(JOIN_WITHIN_S):
            async with self._boundary:
                try:
                    reader = self._backend.log.read(dict(positions), batch_size=self._batch_size, follow=False)
                    async with aclosing(reader) as batches:  # type: ignore[type-var]
                        async for batch in batches:
                            if batch.entries:
                                prepared = prepare_batch(batch.entries, s.timers, s.partitions)
                                await self._apply(held, batch.positions, prepared, None, logx, view, (view,))
                            positions.update(batch.positions)
                except (LeaseLost, SlotStalled):
                    raise
                except Exception as exc:  # noqa: BLE001 - the view keeps following on its own
                    logx.debug("%s view did not join the shared read yet: %s", view.name, exc)
                    return False
                self._current = [v for v in self.views if v in self._current or v is view]
                logx.info("%s view caught up: it follows the shared read again", view.name)
                return True
        return False

    # ---- one batch

    async def _apply(
        self,
        held: HeldSlot,
        positions: Mapping[int, Position],
        prepared: Prepared,
        waker: Waker | None,
        logx: logging.LoggerAdapter[logging.Logger],
        lead: View,
        views: Sequence[View],
    ) -> list[View]:
        """Applies a batch to ``views`` (or, with no ``positions``, some of its commits without a
        checkpoint). A non-transient failure of a ``lead`` step is a :class:`StepFailed` naming
        the step, and any failure of the lead is raised; another view that fails is left out
        (its checkpoints are not saved). The views the batch was applied to."""
        backend = self._backend
        n = self._settings.partitions
        names = {v.name for v in views}
        failed: set[View] = set()
        by_name = {v.name: v for v in views}
        # 1. quarantine what cannot be read (the rest is fed): once, by the shared read's lead
        if lead is self.lead:
            with step("quarantine"):
                for e in prepared.malformed:
                    held.check()
                    logx.warning(
                        "quarantining a malformed commit of %s (partition %d): %s", e.aggregate, e.partition, e.error
                    )
                    await backend.quarantine.put(CONSUMER, e.partition, e.aggregate, e.raw, e.error or "malformed")
        if TIMERS in names:
            with step("quarantine"):
                named: set[int] = set()
                for c, p, exc in prepared.rejected:
                    if id(c) in named:
                        continue  # a commit is set aside once, naming its first rejected event
                    named.add(id(c))
                    held.check()
                    logx.warning("quarantining commit %s v%d: rejected timer event: %s", c.ref, c.version, exc)
                    await backend.quarantine.put(
                        CONSUMER, p, c.ref.type, commit_to_doc(c, n), f"rejected timer event: {exc}"
                    )
        # 2. the event sink, one write per aggregate type
        sinks: list[tuple[EventSink, Sequence[Commit]]] = []
        if INDEX in names:
            index = by_name[INDEX]
            async with self._view_step(index, lead, "sink", failed, logx):
                for type_, commits in prepared.by_type.items():
                    held.check()
                    sink = backend.sink(type_)
                    if type_ not in self._prepared_sinks:
                        await sink.prepare()
                        self._prepared_sinks.add(type_)
                    sinks.append((sink, commits))
        live = [v for v in views if v not in failed]
        # where the stores share a transaction, a whole batch in one (nothing for the steps below)
        writer = backend.capability(FEED_TRANSACTION)
        if positions and writer is not None and not self._folds(prepared, live):
            held.check()
            if await self._apply_at_once(held, writer, sinks, positions, prepared, waker, logx, live):
                return live
        if INDEX in names and by_name[INDEX] not in failed:
            async with self._view_step(by_name[INDEX], lead, "sink", failed, logx):
                for sink, of_type in sinks:
                    held.check()
                    await sink.write(of_type)
        if TIMERS in names:
            # 3. the timer projection: the batch's net effect in one write
            if prepared.timer_writes:
                held.check()
                with step("timers"):
                    answers = await backend.timers.write(prepared.timer_writes)
                if waker is not None:
                    _wake_for_puts(held, prepared.timer_writes, answers, waker)
            if prepared.history and backend.history is not None:
                await _record_history(backend.history, prepared.history, logx)
            # 4. resume the parked timers of the aggregates that just committed
            with step("parked"):
                await self._resume_parked(held, prepared, waker)
        # 5. snapshots where a reducer is configured, a view per aggregate type
        for v in views:
            if v.aggregate is not None:
                async with self._view_step(v, lead, "snapshots", failed, logx):
                    await self._snapshots(held, prepared, v.aggregate)
        # 6. checkpoints under the slot's fence, in one write
        live = [v for v in views if v not in failed]
        if positions:
            await self._checkpoint(held, positions, live)
        return live

    @contextlib.asynccontextmanager
    async def _view_step(
        self, view: View, lead: View, name: str, failed: set[View], logx: logging.LoggerAdapter[logging.Logger]
    ) -> AsyncIterator[None]:
        """A step of ``view``: the lead's failures are raised (named, :func:`~.feed_batch.step`);
        another view's failure puts it in ``failed`` (it leaves the shared read) and the batch goes on."""
        if view is lead:
            with step(name):
                yield
            return
        try:
            with step(name):
                yield
        except (LeaseLost, SlotStalled):
            raise
        except Exception as exc:  # noqa: BLE001 - a store or a reducer: the view falls behind
            error = exc.error if isinstance(exc, StepFailed) else exc
            metrics.FEED_ERRORS.labels(kind="transient" if isinstance(error, StorageUnavailable) else "fatal").inc()
            self._stalls[view].retrying(f"{view.name} view: batch failed (it falls behind): %s", exc, logx)
            failed.add(view)

    def _folds(self, prepared: Prepared, views: Sequence[View]) -> bool:
        """Whether a snapshot view of ``views`` folds commits of the batch (the snapshot step has work)."""
        folded = {v.aggregate for v in views if v.aggregate is not None}
        return bool(folded) and any(t.aggregate in folded for t in prepared.by_type)

    async def _apply_at_once(
        self,
        held: HeldSlot,
        writer: FeedWriter,
        sinks: Sequence[tuple[EventSink, Sequence[Commit]]],
        positions: Mapping[int, Position],
        prepared: Prepared,
        waker: Waker | None,
        logx: logging.LoggerAdapter[logging.Logger],
        views: Sequence[View],
    ) -> bool:
        """The batch's sink, timer, parked and checkpoint steps of ``views`` in one transaction
        (:class:`FeedWriter`); False, having written nothing, when the writer does not take it
        whole or a step refuses it: the steps one by one then name what is refused."""
        now = now_ms()
        timers = any(v.name == TIMERS for v in views)
        indexed = self._indexed(views)
        writes = prepared.timer_writes if timers else []
        planned = prepared.planned if prepared.planned_for == (indexed, bool(writes)) else None
        try:
            done = await writer.apply(
                sinks if indexed else [],
                writes,
                [v.consumer for v in views],
                positions,
                held.fence,
                now=now,
                planned=planned,
                history=prepared.history if timers and self._backend.history is not None else (),
            )
        except (StorageUnavailable, LeaseLost, SlotStalled):
            raise
        except WowdError as exc:
            logx.debug("batch not applied in one transaction (applying it step by step): %s", exc)
            return False
        if done is None:
            return False
        if not done.saved:
            raise LeaseLost(f"checkpoints of partitions {sorted(positions)} refused under fence {held.fence}")
        if waker is not None:
            _wake_for_puts(held, writes, done.timer_answers, waker)
            if done.resumed:
                _resumed(held, done.resumed, now, waker)
        return True

    async def _isolate(
        self,
        held: HeldSlot,
        batch: LogBatch,
        waker: Waker | None,
        logx: logging.LoggerAdapter[logging.Logger],
        lead: View,
        views: Sequence[View],
    ) -> list[View] | None:
        """After a step of the ``lead`` refused the batch: applies its commits one at a time, in
        log order, and quarantines each one a step refuses (with the step and the error), then
        checkpoints the batch; the views it was applied to. ``None`` (nothing quarantined, no
        checkpoint) when every commit fails for the store's own reasons: the store refuses
        everything, which is a stall, not bad input.

        A record-level refusal (:class:`InvalidInput`, :class:`SinkWriteError`: this document
        cannot be written) is quarantined even when it is the only commit."""
        s = self._settings
        failed: list[tuple[LogEntry, StepFailed]] = []
        applied = 0
        live = list(views)
        for e in batch.entries:
            held.check()
            single = prepare_batch((e,), s.timers, s.partitions)
            try:
                live = [v for v in await self._apply(held, {}, single, waker, logx, lead, live)]
                applied += 1
            except StepFailed as refused:
                failed.append((e, refused))
        if not applied and not any(f.record_level for _e, f in failed):
            return None
        n = s.partitions
        with step("quarantine"):
            for e, f in failed:
                held.check()
                reason = f"{f.step} refused it: {type(f.error).__name__}: {f.error}"
                raw = e.raw if e.commit is None else commit_to_doc(e.commit, n)
                await self._backend.quarantine.put(CONSUMER, e.partition, e.aggregate, raw, reason)
                metrics.FEED_POISON.labels(step=f.step, error=type(f.error).__name__).inc()
                where = f"{e.commit.ref} v{e.commit.version}" if e.commit is not None else f"of {e.aggregate}"
                logx.warning("quarantined commit %s (partition %d): %s", where, e.partition, reason)
        await self._checkpoint(held, batch.positions, live)
        return live

    async def _idle_checkpoint(
        self, held: HeldSlot, positions: Mapping[int, Position], logx: logging.LoggerAdapter[logging.Logger]
    ) -> None:
        """Saves, for the views following the shared read, the positions a read moved quiet
        partitions to (no commits), each partition's at most every :data:`IDLE_CHECKPOINT_EVERY_S`,
        so that its checkpoint stays in the log's history (the oplog) however long it is quiet.
        Fenced as any checkpoint; one the store does not take now is left to the partition's next
        move (a refused one: the slot is lost)."""
        t = time.monotonic()
        due = {
            p: pos
            for p, pos in positions.items()
            if t - self._idle_saved.get(p, float("-inf")) >= IDLE_CHECKPOINT_EVERY_S
        }
        if not due:
            return
        try:
            await self._checkpoint(held, due, self._current)
        except StepFailed as exc:
            metrics.FEED_ERRORS.labels(kind="fatal").inc()
            logx.warning(
                "checkpoints of quiet partitions %s not saved (saved at their next move): %s", sorted(due), exc
            )
            return
        except StorageUnavailable as exc:
            metrics.FEED_ERRORS.labels(kind="transient").inc()
            logx.debug("checkpoints of quiet partitions %s not saved (saved at their next move): %s", sorted(due), exc)
            return
        for p in due:
            self._idle_saved[p] = t

    async def _checkpoint(self, held: HeldSlot, positions: Mapping[int, Position], views: Sequence[View]) -> None:
        """The positions of ``views`` under the slot's fence, in one write; refused: another
        holder has the slot."""
        held.check()
        with step("checkpoint"):
            saved = await self._backend.checkpoints.save_all([v.consumer for v in views], positions, held.fence)
        if not saved:
            raise LeaseLost(f"checkpoints of partitions {sorted(positions)} refused under fence {held.fence}")

    async def _snapshots(self, held: HeldSlot, prepared: Prepared, aggregate: str) -> None:
        """Folds the batch's commits of ``aggregate`` into its snapshots."""
        reducer = self._reducers.get(aggregate)
        if reducer is None:
            return
        store = self._backend.snapshots
        typed = [(t, commits) for t, commits in prepared.by_type.items() if t.aggregate == aggregate]
        refs = [c.ref for _t, commits in typed for c in commits]
        if not refs:
            return
        stored = await store.load_many(refs)  # one read
        latest: dict[AggregateRef, SnapshotRecord | None] = {ref: stored.get(ref) for ref in refs}
        changed: dict[AggregateRef, SnapshotRecord] = {}
        stale: set[AggregateRef] = set()
        for _type, commits in typed:
            for c in commits:
                ref = c.ref
                if ref in stale:
                    continue
                cur = latest[ref]
                if cur is not None and cur.version >= c.version:
                    continue  # already folded (a retried or re-read batch)
                if (
                    cur is None
                    and c.version != 1
                    or cur is not None
                    and (cur.version != c.version - 1 or cur.state_revision != reducer.state_revision)
                ):
                    stale.add(ref)  # a gap or another state revision: left to a rebuild
                    continue
                snap = fold_commit(reducer, cur, c)  # ReducerFailed: the view's failure
                latest[ref] = snap
                changed[ref] = snap
        for ref in stale:
            if latest.get(ref) is not None:
                held.check()
                await store.mark_stale(ref)
        if changed:
            held.check()
            outcomes = await store.save_all(list(changed.values()))
            refused = [o for o in outcomes if o.status == "failed"]
            if refused:
                o = refused[0]
                raise StorageError(f"{len(refused)} snapshot(s) not saved, the first {o.ref} v{o.version}: {o.reason}")

    async def _resume_parked(self, held: HeldSlot, prepared: Prepared, waker: Waker | None) -> None:
        # one read over the parked index for every aggregate of the batch (nothing when none is parked)
        refs = [c.ref for commits in prepared.by_type.values() for c in commits]
        parked = await self._backend.timers.parked_many(refs)
        now = now_ms()
        changes = [TimerChange.resume(t, due_at=now) for t in parked]
        if changes:
            held.check()
            await self._backend.firing.settle(changes)
            if waker is not None:
                _resumed(held, parked, now, waker)


def _wake_for_puts(held: HeldSlot, writes: Sequence[TimerWrite], answers: Sequence[int], waker: Waker) -> None:
    """Wakes the timer loop for each timer of the slot a write put (it may be due before the
    loop's next wake-up)."""
    for w, written in zip(writes, answers, strict=True):
        if w.kind == "put" and written and w.timer is not None and w.timer.partition in held.partitions:
            waker.maybe_wake(w.timer.due_at)


async def _record_history(
    history: TimerHistory, records: Sequence[HistoryRecord], logx: logging.LoggerAdapter[logging.Logger]
) -> None:
    """The history records of a batch's timer events, one write. Unavailable: raised (the batch
    is retried, its writes are idempotent); refused: logged and counted, the batch goes on (the
    history is a record of the log, never a reason to quarantine it)."""
    try:
        await history.append(records)
    except StorageUnavailable:
        raise
    except StorageError as exc:
        metrics.HISTORY_UNRECORDED.inc(len(records))
        logx.warning("timer history: %d records of the batch's commits not written: %s", len(records), exc)


def _resumed(held: HeldSlot, timers: Sequence[Timer], now: int, waker: Waker) -> None:
    """After PARKED timers were resumed due at ``now``: the loop woken, a line per target."""
    waker.maybe_wake(now)  # a resumed timer is due at once
    for target in sorted({str(t.target) for t in timers}):
        log.info("resumed the parked timers of %s: it committed", target, extra=held.log_extra())
