"""A replica's parts run in-process by the tests: a held slot (:func:`held_slot`, or one taken from
the store, :func:`hold_slot`), how a replica fires (:func:`firing`, its timer loop, the firing of
``wowd run``'s assembly), a delivery stream run to its end, a following read of a log, a log
whose reads are held back, and an event sink that refuses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio

from tests.factories import CONTEXT, lease
from wowd.config import TimerSettings, WowdSettings
from wowd.daemon.firing import Firing, LogGate
from wowd.daemon.leases import HeldSlot
from wowd.daemon.replica import delivery, replica_of
from wowd.daemon.stream import DeliveryStream, Limits, batch_limits, target_limits
from wowd.daemon.timers import Nudge, TimerLoop
from wowd.daemon.waker import Waker
from wowd.delivery import CommandGateway, OutboxGateway, Outcome
from wowd.errors import InvalidInput, StorageError, StorageFull
from wowd.model import AggregateType, Commit, LogBatch, LogEntry, Owner, Position, Timer
from wowd.stores.base import Backend, EventSink, Log, OutboxShortcut, TimerFiring
from wowd.stores.embedded.sqlite import sqlite3

FAR_FUTURE_MS = 2**62


def caught_up_waker() -> Waker:
    """A waker whose feed has applied every commit (a timer loop tested without its feed)."""
    waker = Waker()
    waker.advance(FAR_FUTURE_MS)
    return waker


def held_slot(partitions: int, *, fence: int = 1, slot: int = 0, valid_for: float = 60) -> HeldSlot:
    """Slot ``slot`` of namespace ``t`` held by owner key ``me`` under ``fence``, over partitions
    ``0 .. partitions - 1``, its lease valid ``valid_for`` seconds more (call it in a task)."""
    return HeldSlot(
        lease=lease(fence, slot=slot, incarnation=1),
        partitions=frozenset(range(partitions)),
        valid_until=anyio.current_time() + valid_for,
        owner_key="me",
    )


async def hold_slot(b: Backend, partitions: int, key: str = "a", *, valid_for: float = 60) -> HeldSlot:
    """Slot 0 of namespace ``ns``, taken by ``key`` for a minute (after the previous holder's
    lease was released), over partitions ``0 .. partitions - 1``, valid ``valid_for`` seconds more
    on this process's clock: for the tests that run a slot's loops in-process."""
    res = await b.leases.acquire("ns", Owner(key=key), 1, timedelta(seconds=60), timedelta(seconds=1))
    assert res.lease is not None
    return HeldSlot(
        lease=res.lease,
        partitions=frozenset(range(partitions)),
        valid_until=anyio.current_time() + valid_for,
        owner_key=key,
    )


def firing(
    store: TimerFiring,
    gateway: CommandGateway,
    settings: TimerSettings | None = None,
    *,
    gate: LogGate | None = None,
    nudge: Nudge = lambda: None,
    limits: Limits | None = None,
    shortcut: OutboxShortcut | None = None,
) -> Firing:
    """How a replica of these collaborators fires (the object the replica's assembly chooses):
    claim, deliver and settle through ``gateway`` under ``limits`` (default: 64 deliveries in
    flight, 16 per target; the outbox's chunks for an :class:`OutboxGateway`), the log asked at
    the due times with ``gate``; the outbox shortcut's rounds with ``shortcut``."""
    if limits is None:
        limits = batch_limits(64) if isinstance(gateway, OutboxGateway) else target_limits(64, lambda _target: 16)
    return Firing(
        settings=settings or TimerSettings(),
        timers=store,
        gateway=gateway,
        limits=limits,
        nudge=nudge,
        gate=gate,
        shortcut=shortcut,
    )


def timer_loop(
    store: TimerFiring, gateway: CommandGateway, settings: TimerSettings | None = None, **kw: Any
) -> TimerLoop:
    """The timer loop of one slot of :func:`firing` of these collaborators."""
    return firing(store, gateway, settings, **kw).loop()


async def stream_all(
    gw: CommandGateway, batches: list[list[Timer]], record: Callable[[Timer, Outcome], None], limits: Limits
) -> None:
    """Every timer of ``batches`` (each put on the stream at once) through one delivery stream
    under ``limits``, each outcome written at once; returns when every one was delivered."""
    async with anyio.create_task_group() as tg:

        def recorded(t: Timer, o: Outcome) -> None:
            record(t, o)
            stream.settled(1)

        stream = DeliveryStream(gw, limits, recorded, stopped=lambda: False)
        stream.bind(tg)
        for batch in batches:
            stream.put(batch)


def replica_firing(settings: WowdSettings, backend: Backend) -> Firing:
    """How ``wowd run`` of ``settings`` on ``backend`` fires (its gateway made by the replica's
    assembly)."""
    return replica_of(settings, backend, delivery(settings, backend)).firing


class Tail:
    """What a following read of a log has yielded so far (:func:`tailing`)."""

    def __init__(self) -> None:
        self.entries: list[LogEntry] = []
        self.heads = 0
        """Batches that said the read is at the log's head (a watermark for all its partitions)."""
        self._moved = anyio.Event()

    async def _follow(self, log: Log, positions: Mapping[int, Position | None]) -> None:
        async for batch in log.read(positions, follow=True):
            self.entries.extend(batch.entries)
            if batch.watermark is not None and batch.covers is None:
                self.heads += 1
            self._moved.set()
            self._moved = anyio.Event()

    async def until(self, reached: Callable[[Tail], bool], timeout: float = 10) -> None:  # noqa: ASYNC109
        """Returns once ``reached(self)`` holds (checked as batches come), else fails the test."""
        with anyio.fail_after(timeout):
            while not reached(self):
                await self._moved.wait()


class HeldReads:
    """A log's reads (put in place of ``log.read``) whose batches are held back while
    :attr:`held` (with ``hold_after_first``: from the first batch with commits on), until
    :meth:`release`: what the log holds meanwhile reaches the reader only then, as it reaches a
    feed behind a slow store. :attr:`first_read` is set once a batch with commits was read."""

    def __init__(self, read: Any, *, hold_after_first: bool = False) -> None:
        self._read = read
        self._hold_after_first = hold_after_first
        self.held = False
        self.go = anyio.Event()
        self.first_read = anyio.Event()

    def __call__(self, positions: Mapping[int, Position | None], **kwargs: Any) -> AsyncIterator[LogBatch]:
        return self._reading(positions, **kwargs)

    async def _reading(self, positions: Mapping[int, Position | None], **kwargs: Any) -> AsyncIterator[LogBatch]:
        reader = self._read(positions, **kwargs)
        try:
            while True:
                try:
                    batch = await reader.__anext__()
                except StopAsyncIteration:
                    return
                if self.held:
                    await self.go.wait()
                if batch.entries and not self.first_read.is_set():
                    self.first_read.set()
                    self.held = self.held or self._hold_after_first
                yield batch
        finally:
            await reader.aclose()

    def release(self) -> None:
        self.held = False
        self.go.set()


@asynccontextmanager
async def tailing(log: Log, positions: Mapping[int, Position | None]) -> AsyncIterator[Tail]:
    """A following read of ``positions`` in a task of its own, stopped on exit."""
    tail = Tail()
    async with anyio.create_task_group() as tg:
        tg.start_soon(tail._follow, log, positions)
        try:
            yield tail
        finally:
            tg.cancel_scope.cancel()


class RefusingSink:
    """An event sink that refuses the commits of some aggregates (or every commit)."""

    def __init__(self, inner: EventSink, *, refuse: set[str] | None = None, broken: bool = False) -> None:
        self._inner = inner
        self.type = inner.type
        self.refuse = refuse or set()
        self.broken = broken
        self.full_after: int | None = None
        """Writes taken before the disk is full (``None``: never full)."""

    async def prepare(self) -> None:
        await self._inner.prepare()

    async def write(self, records: Sequence[Commit]) -> None:
        if self.broken:
            raise StorageError("sqlite wowd.db: database disk image is malformed")
        if self.full_after is not None:
            if self.full_after <= 0:
                raise StorageFull("sqlite wowd.db: database or disk is full")
            self.full_after -= 1
        for r in records:
            if r.ref.id in self.refuse:
                raise InvalidInput(f"{r.ref} v{r.version}: mapper_parsing_exception", field="events")
        await self._inner.write(records)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def refusing(backend: Backend, **kwargs: Any) -> RefusingSink:
    """Puts a :class:`RefusingSink` (``kwargs``: what it refuses) in front of the backend's event
    sink of order, for every aggregate type; answers it."""
    inner = backend.sink_factory
    sink = RefusingSink(inner(AggregateType(context=CONTEXT, aggregate="order")), **kwargs)
    backend.sink_factory = lambda _type: sink  # type: ignore[assignment,return-value]
    backend._sinks.clear()
    return sink


def sql(path: Path, statement: str, params: tuple[Any, ...] = ()) -> list[Any]:
    """One statement on the embedded file ``path`` by a connection of its own, committed: its rows."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(statement, params).fetchall()
        conn.commit()
        return rows
    finally:
        conn.close()
