"""The log feed of one held slot (docs/architecture.md).

Per batch read from the log after the slot's checkpoints: quarantine malformed entries, write the
commits to each aggregate type's event sink, project timer events into the timer store, fold
snapshots where a reducer is configured, resume the parked timers of the aggregates that just
committed, then save each partition's checkpoint under the slot's fence. Where the stores share
a transaction (the embedded file's :class:`~wowd.stores.base.FeedWriter`), the sink, timer, parked
and checkpoint steps of a batch are that one transaction. Every step is idempotent, so a
transient failure (:class:`StorageUnavailable`, a full disk among them) retries the whole batch
after a backoff and a batch is never half-checkpointed. A refused checkpoint means another holder has the
slot: the slot's work stops (:class:`LeaseLost`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from wowd import metrics
from wowd.clock import now_ms
from wowd.config import WowdSettings
from wowd.delivery import FusedFiring
from wowd.errors import (
    InvalidInput,
    LeaseLost,
    LogBehindOplog,
    SinkWriteError,
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
    LogBatch,
    LogEntry,
    Position,
    SnapshotRecord,
    Timer,
    TimerCancelled,
    TimerChange,
    TimerScheduled,
    TimerWrite,
    commit_to_doc,
    net_writes,
    timer_event_from,
    timer_from_event,
)
from wowd.reducers import Reducer, fold_commit
from wowd.retry import Backoff, Pauses, RetryStopped, retrying
from wowd.stores.base import Backend, EventSink, FeedFiring, FeedWriter

from .leases import HeldSlot
from .stall import LOG_EVERY_S, STALL_AFTER_UNAVAILABLE_S
from .waker import Waker, owner_key

__all__ = ["CONSUMER", "Feeder", "field_of"]

log = logging.getLogger(__name__)

CONSUMER = "wowd"
"""The checkpoint consumer name of the daemon's feed."""

_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def field_of(error: str | None) -> str:
    """The field an :class:`InvalidInput` message names (``"field: reason"``), else ``unknown``."""
    m = _FIELD.match(error or "")
    return m.group(1) if m else "unknown"


RETRY_BACKOFF = Backoff(0.1, 10.0)
"""The pause before retrying a batch the stores could not take."""
STALL_BACKOFF = Backoff(0.1, 60.0)
"""The pause before retrying a stalled slot's batch (at most a minute)."""
STALL_LOG_EVERY_S = LOG_EVERY_S
"""A stalled slot's ERROR line comes at most this often (as any stalled work's)."""
READ_AHEAD = 4
"""Batches the feed reads ahead of the one it applies."""
IDLE_CHECKPOINT_EVERY_S = 5.0
"""A quiet partition's checkpoint is saved at most this often (the read moves it on)."""

_Read = tuple[LogBatch, int, "_Prepared | None", Exception | None]
"""A batch read ahead, its number (:meth:`Waker.reading`), what its steps need (``None`` for a
batch with no commits), or the read's failure."""


class _StepFailed(Exception):
    """A feed step's non-transient failure (``error``); ``record_level`` when the error is about
    the record itself (this document cannot be written), not the store."""

    def __init__(self, step: str, error: WowdError) -> None:
        super().__init__(f"{step}: {error}")
        self.step = step
        self.error = error
        self.record_level = isinstance(error, InvalidInput | SinkWriteError)


@contextmanager
def _step(name: str) -> Iterator[None]:
    """Names the step of a non-transient failure; transient ones and a lost lease pass."""
    try:
        yield
    except (StorageUnavailable, LeaseLost, SlotStalled):
        raise
    except WowdError as exc:
        raise _StepFailed(name, exc) from exc


@dataclass(slots=True)
class _Prepared:
    """A batch read into what each step needs (pure: computed once, reused across retries)."""

    malformed: list[LogEntry]
    rejected: list[tuple[Commit, int, InvalidInput]]
    by_type: dict[AggregateType, list[Commit]]
    timer_writes: list[TimerWrite]
    """The net effect of the batch's timer events (:func:`~wowd.model.net_writes`)."""
    planned: object = None
    """:meth:`FeedWriter.plan` of the batch, when the backend has a feed writer."""


def prepare_batch(entries: Sequence[LogEntry], max_body_bytes: int, partitions: int) -> _Prepared:
    """What the steps need of ``entries``. The timer writes of each commit are its timer events in
    order, then a ``cancel_all`` when it deletes its aggregate; their net effect applies the writes
    of a commit in that order (:func:`~wowd.model.net_writes`)."""
    malformed: list[LogEntry] = []
    rejected: list[tuple[Commit, int, InvalidInput]] = []
    by_type: dict[AggregateType, list[Commit]] = {}
    writes: list[TimerWrite] = []
    last_type: AggregateType | None = None
    of_type: list[Commit] = []
    for e in entries:
        c = e.commit
        if c is None:
            malformed.append(e)
            continue
        if e.aggregate is not last_type:  # a log read shares one type object per aggregate type
            last_type = e.aggregate
            of_type = by_type.setdefault(last_type, [])
        of_type.append(c)
        for ev in c.events:
            try:
                te = timer_event_from(ev, max_body_bytes=max_body_bytes)
            except InvalidInput as exc:
                rejected.append((c, e.partition, exc))
                continue
            if isinstance(te, TimerScheduled):
                writes.append(TimerWrite.put(timer_from_event(c, te, partitions)))
            elif isinstance(te, TimerCancelled):
                writes.append(TimerWrite.cancel(c.ref, te.key, c.version))
        if c.deleted:
            writes.append(TimerWrite.cancel_all(c.ref, c.version))
    return _Prepared(malformed=malformed, rejected=rejected, by_type=by_type, timer_writes=net_writes(writes))


class Feeder:
    """Feeds the partitions of one held slot until the slot stops (at a batch boundary)."""

    def __init__(
        self,
        settings: WowdSettings,
        backend: Backend,
        *,
        reducers: Mapping[str, Reducer] | None = None,
        batch_size: int = 500,
        fused: FusedFiring | None = None,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._fused = fused
        """The gateway's fast path into the backend's outbox, when a batch applied in one
        transaction fires the due timers it puts (:class:`~wowd.stores.base.FeedFiring`)."""
        self._reducers = dict(reducers or {})
        self._batch_size = batch_size
        self._prepared_sinks: set[AggregateType] = set()
        self._processing = False
        self._stopping = False
        self._read_scope: anyio.CancelScope | None = None
        self.stalled: str | None = None
        """Why the slot's feed cannot progress now (``None``: it does)."""
        self.stalled_since = 0.0
        self._stall_logged_at = float("-inf")
        self._unavailable_since: float | None = None
        self._idle_saved: dict[int, float] = {}
        """When (``time.monotonic()``) each quiet partition's checkpoint was last saved."""

    def _request_stop(self) -> None:
        self._stopping = True
        if not self._processing and self._read_scope is not None:
            self._read_scope.cancel()

    async def run(
        self, held: HeldSlot, waker: Waker, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        logx = logging.LoggerAdapter(log, held.log_extra())
        held.on_stop(self._request_stop)
        parts = sorted(held.partitions)
        positions: dict[int, Position | None] = {p: None for p in parts}
        try:
            async for attempt in retrying(
                "reading checkpoints", backoff=RETRY_BACKOFF, stop=held.stop_event, logger=logx
            ):
                with attempt:
                    cps = await self._backend.log.checkpoints(CONSUMER, parts)
        except RetryStopped:
            task_status.started()
            return
        pauses = Pauses(RETRY_BACKOFF, held.stop_event)
        for p, cp in cps.items():
            positions[p] = cp.position
        task_status.started()
        logx.info("feeding partitions from %d checkpoints", len(cps))
        while not self._stopping and not held.stopping:
            try:
                with anyio.CancelScope() as scope:
                    self._read_scope = scope
                    reader = self._backend.log.read(positions, batch_size=self._batch_size, follow=True)
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
                                        await self._process(held, batch, number, prepared, waker, logx)
                                        self._processing = False
                                        positions.update(batch.positions)
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
                self._stall(held, f"log read: {exc}", logx)
                await pauses.pause(STALL_BACKOFF)
            except StorageUnavailable as exc:
                self._processing = False
                metrics.FEED_ERRORS.labels(kind="transient").inc()
                self._retrying("log read failed (will retry): %s", exc, logx)
                self._unavailable(held, f"log read: {exc}", logx, full=isinstance(exc, StorageFull))
                await pauses.pause()
            except (StorageError, InvalidInput) as exc:
                # the log itself refuses (a corrupted file, no privilege): nothing can be fed
                self._processing = False
                self._read_scope = None
                metrics.FEED_ERRORS.labels(kind="fatal").inc()
                self._stall(held, f"log read: {type(exc).__name__}: {exc}", logx)
                await pauses.pause(STALL_BACKOFF)
        logx.info("feed stopped at a batch boundary")

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
                    prepared = (
                        prepare_batch(batch.entries, s.timers.max_body_bytes, s.partitions) if batch.entries else None
                    )
                    if prepared is not None:
                        await self._plan(prepared)
                    await send.send((batch, registered[0], prepared, None))
            except (StorageError, InvalidInput) as exc:
                with contextlib.suppress(anyio.BrokenResourceError):
                    await send.send((LogBatch(entries=(), positions={}), 0, None, exc))
            except anyio.BrokenResourceError:  # the feed stopped reading
                return

    async def _plan(self, prepared: _Prepared) -> None:
        """The feed writer's :meth:`~FeedWriter.plan` of a batch read ahead, which the batch's
        transaction then takes ready (a failure leaves it to be made when the batch is applied)."""
        writer = self._backend.feed_writer
        if writer is None or self._folds(prepared):
            return
        sinks = [(self._backend.sink(t), commits) for t, commits in prepared.by_type.items()]
        with contextlib.suppress(WowdError):
            prepared.planned = await writer.plan(sinks, prepared.timer_writes)

    # ---- stalled: the slot's feed cannot progress

    def _retrying(self, msg: str, exc: StorageError, logx: logging.LoggerAdapter[logging.Logger]) -> None:
        """A transient failure's line: WARNING, DEBUG while stalled (the stall's ERROR line says it)."""
        logx.log(logging.DEBUG if self.stalled is not None else logging.WARNING, msg, exc)

    def _unavailable(
        self, held: HeldSlot, reason: str, logx: logging.LoggerAdapter[logging.Logger], *, full: bool = False
    ) -> None:
        """A transient failure: the slot is stalled once the store has been unavailable for
        :data:`STALL_AFTER_UNAVAILABLE_S`, at once when it is ``full`` (:class:`StorageFull`: a
        full disk is freed by an operator, not in seconds). Nothing is quarantined for it: the
        batch is retried whole until the store takes it."""
        now = time.monotonic()
        if self._unavailable_since is None:
            self._unavailable_since = now
        if full or now - self._unavailable_since >= STALL_AFTER_UNAVAILABLE_S:
            self._stall(held, reason, logx)

    def _stall(self, held: HeldSlot, reason: str, logx: logging.LoggerAdapter[logging.Logger]) -> None:
        """Records that the slot's feed cannot progress (readiness 503, ``wowd_feed_stalled`` 1,
        an ERROR line at most once a minute); after ``feed.stall_release_s`` raises
        :class:`SlotStalled` so that the slot is given up for another replica to try."""
        now = time.monotonic()
        if self.stalled is None:
            self.stalled_since = now
        self.stalled = reason
        metrics.FEED_STALLED.labels(slot=str(held.slot)).set(1)
        if now - self._stall_logged_at >= STALL_LOG_EVERY_S:
            self._stall_logged_at = now
            logx.error("feed of slot %d stalled (retrying): %s", held.slot, reason)
        if now - self.stalled_since >= self._settings.feed.stall_release_s:
            raise SlotStalled(f"slot {held.slot}: feed stalled for {now - self.stalled_since:.0f} s: {reason}")

    def _progressed(self, held: HeldSlot, logx: logging.LoggerAdapter[logging.Logger]) -> None:
        self._unavailable_since = None
        if self.stalled is not None:
            stalled_s = time.monotonic() - self.stalled_since
            logx.info("feed of slot %d progresses again (stalled %.0f s)", held.slot, stalled_s)
            self.stalled = None
            self._stall_logged_at = float("-inf")
        metrics.FEED_STALLED.labels(slot=str(held.slot)).set(0)

    async def _process(
        self,
        held: HeldSlot,
        batch: LogBatch,
        read: int,
        prepared: _Prepared | None,
        waker: Waker,
        logx: logging.LoggerAdapter[logging.Logger],
    ) -> None:
        """Applies batch number ``read`` (as the waker numbered it when it was read), prepared
        when it was read."""
        if prepared is None:  # caught up: the watermark moved on
            try:
                if batch.positions:  # quiet partitions moved on: their checkpoints follow
                    await self._idle_checkpoint(held, batch.positions, logx)
            finally:
                waker.applied(read, batch.watermark, batch.covers)
            metrics.FEED_LAG.labels(slot=str(held.slot)).set(0.0)
            return
        pauses = Pauses(RETRY_BACKOFF, held.stop_event)
        try:
            while True:
                held.check()
                try:
                    await self._apply(held, batch.positions, prepared, waker, logx)
                    break
                except StoreRefused as exc:
                    # the store refuses every write (a block, credentials, a privilege): a stall
                    # at once, nothing set aside; the batch is retried until the store takes it
                    metrics.FEED_ERRORS.labels(kind="fatal").inc()
                    self._stall(held, f"{type(exc).__name__}: {exc}", logx)
                    await pauses.pause(STALL_BACKOFF)
                except StorageUnavailable as exc:
                    metrics.FEED_ERRORS.labels(kind="transient").inc()
                    self._retrying("feed batch failed (retrying the batch): %s", exc, logx)
                    self._unavailable(held, str(exc), logx, full=isinstance(exc, StorageFull))
                    await pauses.pause()
                except _StepFailed as failed:
                    metrics.FEED_ERRORS.labels(kind="fatal").inc()
                    if await self._isolate(held, batch, waker, logx):
                        break
                    # every record fails for the store's own reasons: nothing to quarantine
                    self._stall(held, f"{failed.step}: {type(failed.error).__name__}: {failed.error}", logx)
                    await pauses.pause(STALL_BACKOFF)
        finally:
            # applied, or given up (its commits are read again, as a later batch)
            waker.applied(read, None)
        self._progressed(held, logx)
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
        if batch.watermark is not None:  # caught up
            metrics.FEED_LAG.labels(slot=str(held.slot)).set(0.0)
            waker.advance(batch.watermark, batch.covers)
        elif last_time:
            metrics.FEED_LAG.labels(slot=str(held.slot)).set(max(0.0, time.time() - last_time / 1000))

    async def _apply(
        self,
        held: HeldSlot,
        positions: Mapping[int, Position],
        prepared: _Prepared,
        waker: Waker,
        logx: logging.LoggerAdapter[logging.Logger],
    ) -> None:
        """Applies a batch (or, with no ``positions``, some of its commits without a checkpoint).
        A step's non-transient failure is a :class:`_StepFailed` naming the step."""
        backend = self._backend
        n = self._settings.partitions
        # 1. quarantine what cannot be read (the rest is fed)
        with _step("quarantine"):
            for e in prepared.malformed:
                held.check()
                logx.warning(
                    "quarantining a malformed commit of %s (partition %d): %s", e.aggregate, e.partition, e.error
                )
                await backend.log.quarantine(CONSUMER, e.partition, e.aggregate, e.raw, e.error or "malformed")
            for c, p, exc in prepared.rejected:
                held.check()
                logx.warning("quarantining commit %s v%d: rejected timer event: %s", c.ref, c.version, exc)
                await backend.log.quarantine(
                    CONSUMER, p, c.ref.type, commit_to_doc(c, n), f"rejected timer event: {exc}"
                )
        # 2. the event sink, one write per aggregate type
        with _step("sink"):
            sinks = []
            for type_, commits in prepared.by_type.items():
                held.check()
                sink = backend.sink(type_)
                if type_ not in self._prepared_sinks:
                    await sink.prepare()
                    self._prepared_sinks.add(type_)
                sinks.append((sink, commits))
        # where the stores share a transaction, a whole batch in one (nothing for the steps below)
        if positions and backend.feed_writer is not None and not self._folds(prepared):
            held.check()
            if await self._apply_at_once(held, backend.feed_writer, sinks, positions, prepared, waker, logx):
                return
        with _step("sink"):
            for sink, commits in sinks:
                held.check()
                await sink.write(commits)
        # 3. the timer projection: the batch's net effect in one write
        if prepared.timer_writes:
            held.check()
            with _step("timers"):
                answers = await backend.timers.write(prepared.timer_writes)
            _wake_for_puts(held, prepared.timer_writes, answers, waker)
        # 4. snapshots where a reducer is configured
        with _step("snapshots"):
            await self._snapshots(held, prepared, logx)
        # 5. resume the parked timers of the aggregates that just committed
        with _step("parked"):
            await self._resume_parked(held, prepared, waker)
        # 6. checkpoints under the slot's fence, in one write
        if positions:
            await self._checkpoint(held, positions)

    def _folds(self, prepared: _Prepared) -> bool:
        """Whether a reducer folds commits of the batch (the snapshot step has work)."""
        return bool(self._reducers) and any(t.aggregate in self._reducers for t in prepared.by_type)

    async def _apply_at_once(
        self,
        held: HeldSlot,
        writer: FeedWriter,
        sinks: Sequence[tuple[EventSink, Sequence[Commit]]],
        positions: Mapping[int, Position],
        prepared: _Prepared,
        waker: Waker,
        logx: logging.LoggerAdapter[logging.Logger],
    ) -> bool:
        """The batch's sink, timer, parked and checkpoint steps in one transaction
        (:class:`FeedWriter`); False, having written nothing, when the writer does not take it
        whole or a step refuses it: the steps one by one then name what is refused."""
        now = now_ms()
        fire = None
        if self._fused is not None:
            fire = FeedFiring(held.owner_key, held.deadline(), self._settings.timers.batch)
        try:
            done = await writer.apply(
                sinks,
                prepared.timer_writes,
                CONSUMER,
                positions,
                held.fence,
                now=now,
                fire=fire,
                planned=prepared.planned,
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
        answers = done.timer_answers
        if done.fired:
            metrics.count_fired((f.aggregate, f.scheduled_at, now) for f in done.fired)
            fired = {f.timer_id for f in done.fired}
            # a timer fired here needs no wake-up of the loop
            answers = [
                0 if w.timer is not None and w.timer.timer_id in fired else a
                for w, a in zip(prepared.timer_writes, answers, strict=True)
            ]
        _wake_for_puts(held, prepared.timer_writes, answers, waker)
        if done.resumed:
            _resumed(held, done.resumed, now, waker)
        if done.fired and self._fused is not None:
            await self._fused.fired_elsewhere()
        return True

    async def _isolate(
        self, held: HeldSlot, batch: LogBatch, waker: Waker, logx: logging.LoggerAdapter[logging.Logger]
    ) -> bool:
        """After a step refused the batch: applies its commits one at a time, in log order, and
        quarantines each one a step refuses (with the step and the error), then checkpoints the
        batch. False (nothing quarantined, no checkpoint) when every commit fails for the store's
        own reasons: the store refuses everything, which is a stall, not bad input.

        A record-level refusal (:class:`InvalidInput`, :class:`SinkWriteError`: this document
        cannot be written) is quarantined even when it is the only commit."""
        s = self._settings
        failed: list[tuple[LogEntry, _StepFailed]] = []
        applied = 0
        for e in batch.entries:
            held.check()
            single = prepare_batch((e,), s.timers.max_body_bytes, s.partitions)
            try:
                await self._apply(held, {}, single, waker, logx)
                applied += 1
            except _StepFailed as refused:
                failed.append((e, refused))
        if not applied and not any(f.record_level for _e, f in failed):
            return False
        n = s.partitions
        with _step("quarantine"):
            for e, f in failed:
                held.check()
                reason = f"{f.step} refused it: {type(f.error).__name__}: {f.error}"
                raw = e.raw if e.commit is None else commit_to_doc(e.commit, n)
                await self._backend.log.quarantine(CONSUMER, e.partition, e.aggregate, raw, reason)
                metrics.FEED_POISON.labels(step=f.step, error=type(f.error).__name__).inc()
                where = f"{e.commit.ref} v{e.commit.version}" if e.commit is not None else f"of {e.aggregate}"
                logx.warning("quarantined commit %s (partition %d): %s", where, e.partition, reason)
        await self._checkpoint(held, batch.positions)
        return True

    async def _idle_checkpoint(
        self, held: HeldSlot, positions: Mapping[int, Position], logx: logging.LoggerAdapter[logging.Logger]
    ) -> None:
        """Saves the positions a read moved quiet partitions to (no commits), each partition's at
        most every :data:`IDLE_CHECKPOINT_EVERY_S`, so that its checkpoint stays in the log's
        history (the oplog) however long it is quiet. Fenced as any checkpoint; one the store does
        not take now is left to the partition's next move (a refused one: the slot is lost)."""
        t = time.monotonic()
        due = {
            p: pos
            for p, pos in positions.items()
            if t - self._idle_saved.get(p, float("-inf")) >= IDLE_CHECKPOINT_EVERY_S
        }
        if not due:
            return
        try:
            await self._checkpoint(held, due)
        except _StepFailed as exc:
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

    async def _checkpoint(self, held: HeldSlot, positions: Mapping[int, Position]) -> None:
        """The positions under the slot's fence, in one write; refused: another holder has it."""
        held.check()
        with _step("checkpoint"):
            saved = await self._backend.log.save_checkpoints(CONSUMER, positions, held.fence)
        if not saved:
            raise LeaseLost(f"checkpoints of partitions {sorted(positions)} refused under fence {held.fence}")

    async def _snapshots(
        self, held: HeldSlot, prepared: _Prepared, logx: logging.LoggerAdapter[logging.Logger]
    ) -> None:
        if not self._reducers:
            return
        store = self._backend.snapshots
        refs = [c.ref for t, commits in prepared.by_type.items() if t.aggregate in self._reducers for c in commits]
        if not refs:
            return
        stored = await store.load_many(refs)  # one read per reducer type
        latest: dict[AggregateRef, SnapshotRecord | None] = {ref: stored.get(ref) for ref in refs}
        changed: dict[AggregateRef, SnapshotRecord] = {}
        stale: set[AggregateRef] = set()
        for type_, commits in prepared.by_type.items():
            reducer = self._reducers.get(type_.aggregate)
            if reducer is None:
                continue
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
                snap = fold_commit(reducer, cur, c)
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

    async def _resume_parked(self, held: HeldSlot, prepared: _Prepared, waker: Waker) -> None:
        timers = self._backend.timers
        # one read over the parked index for every aggregate of the batch (nothing when none is parked)
        parked = await timers.parked_many([c.ref for commits in prepared.by_type.values() for c in commits])
        now = now_ms()
        changes = [TimerChange.resume(t, due_at=now) for t in parked]
        if changes:
            held.check()
            await timers.settle(changes)
            _resumed(held, parked, now, waker)


def _wake_for_puts(held: HeldSlot, writes: Sequence[TimerWrite], answers: Sequence[int], waker: Waker) -> None:
    """Wakes the timer loop for each timer of the slot a write put (it may be due before the
    loop's next wake-up)."""
    for w, written in zip(writes, answers, strict=True):
        if w.kind == "put" and written and w.timer is not None and w.timer.partition in held.partitions:
            waker.maybe_wake(w.timer.due_at)


def _resumed(held: HeldSlot, timers: Sequence[Timer], now: int, waker: Waker) -> None:
    """After PARKED timers were resumed due at ``now``: the loop woken, a line per target."""
    waker.maybe_wake(now)  # a resumed timer is due at once
    for target in sorted({str(t.target) for t in timers}):
        log.info("resumed the parked timers of %s: it committed", target, extra=held.log_extra())
