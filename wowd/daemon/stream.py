"""Deliveries as a stream: claimed timers flow into one queue per target (a *lane*), workers
deliver them through the gateway, and each outcome is settled as it comes. Every limit of
deliveries lives here (:class:`Limits`, sized once where the replica is assembled); a gateway only
sends.

- :class:`DeliveryStream` keeps a lane per target (:attr:`Limits.lane_of`): at most the lane's
  ``limit`` deliveries of a target at once, at most ``concurrency`` in all, lanes served in turn.
  A request that hangs holds one slot of its own target until its timeout, and nothing else:
  the other targets' timers go on through the free workers. A lane of chunks (the outbox) hands
  the gateway up to ``chunk`` timers per call (:meth:`~wowd.delivery.BatchGateway.send_batch`).
- :class:`Settler` writes the outcomes in groups: as soon as :data:`SETTLE_GROUP` are waiting or
  :data:`SETTLE_LINGER_S` after the first of a group, one ``settle`` call each.
- The *window*: a delivery holds a place in it from before its request until its outcome is
  written, so at any moment at most ``concurrency + SETTLE_GROUP`` deliveries are sent and not
  settled. That is what a kill can re-send (the same request ids).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import cast

import anyio
from anyio.abc import TaskGroup

from wowd import metrics
from wowd.delivery import BatchGateway, CommandGateway, Outcome, target_of
from wowd.errors import StorageError
from wowd.model import Timer, TimerChange
from wowd.retry import Backoff, retrying

__all__ = [
    "OUTBOX_CHUNK",
    "SETTLE_GROUP",
    "SETTLE_LINGER_S",
    "DeliveryStream",
    "Lane",
    "Limits",
    "Settler",
    "batch_limits",
    "target_limits",
]

log = logging.getLogger(__name__)

SETTLE_GROUP = 64
"""A group of outcomes is settled once this many are waiting (one ``settle`` call)."""
SETTLE_LINGER_S = 0.02
"""...or this long after the first of a group was recorded."""
SETTLE_MAX = 1000
"""At most this many changes in one ``settle`` call."""
SETTLE_BACKOFF = Backoff(0.05, 2.0)
"""The pause before retrying a settle the store could not take."""
OUTBOX_CHUNK = 500
"""At most this many timers in one call of a gateway that takes chunks (one outbox write)."""
OUTBOX_LANES = 4
"""Chunks of the outbox written at once."""


@dataclass(frozen=True, slots=True)
class Lane:
    """Where a timer waits for delivery: one queue per ``name`` (a target), at most ``limit``
    calls of it at once, each carrying up to ``chunk`` timers (1: ``send``; more: ``send_batch``
    of a :class:`~wowd.delivery.BatchGateway`)."""

    name: str
    limit: int
    chunk: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Every limit of a replica's deliveries: ``concurrency`` calls in flight in all (the HTTP
    gateway's connection pool has as many connections), each timer's lane (:class:`Lane`: the
    per-target limit, from its route), and the window: at most ``concurrency + SETTLE_GROUP``
    deliveries sent and not settled, what a kill can re-send."""

    concurrency: int
    lane_of: Callable[[Timer], Lane]

    @property
    def window(self) -> int:
        return self.concurrency + SETTLE_GROUP


def target_limits(concurrency: int, per_target: Callable[[str], int]) -> Limits:
    """A lane per target (``context.aggregate``), ``per_target(target)`` calls of it at once (a
    route's ``per_target_concurrency``), one timer a call."""
    lanes: dict[str, Lane] = {}

    def lane_of(timer: Timer) -> Lane:
        name = target_of(timer)
        lane = lanes.get(name)
        if lane is None:
            lane = lanes[name] = Lane(name, min(per_target(name), concurrency))
        return lane

    return Limits(concurrency=concurrency, lane_of=lane_of)


def batch_limits(concurrency: int) -> Limits:
    """One lane for every timer, chunks of :data:`OUTBOX_CHUNK`, :data:`OUTBOX_LANES` at once
    (the outbox: one write serves a chunk)."""
    lane = Lane("outbox", min(OUTBOX_LANES, concurrency), OUTBOX_CHUNK)
    return Limits(concurrency=concurrency, lane_of=lambda _timer: lane)


class Settler:
    """Writes timer changes in groups (:data:`SETTLE_GROUP`, :data:`SETTLE_LINGER_S`), retrying
    a store that is unavailable; ``on_written(changes, written)`` follows each write.

    Changes are queued with :meth:`add`, or counted with :meth:`note` and made in bulk by
    ``collect`` when a group is taken (the outcomes of deliveries: one conversion per group, not
    per outcome). A group is removed from the queue only once it is written, so :meth:`drain`
    (shielded, at a stop or a cancellation) writes whatever a cancelled write left: each change is
    guarded by the timer's revision as claimed, so a change written twice is skipped the second
    time."""

    def __init__(
        self,
        write: Callable[[list[TimerChange]], Awaitable[int]],
        on_written: Callable[[list[TimerChange], int], None],
        *,
        group: int = SETTLE_GROUP,
        linger_s: float = SETTLE_LINGER_S,
        logx: logging.Logger | logging.LoggerAdapter[logging.Logger] = log,
        on_failure: Callable[[StorageError], None] | None = None,
        on_success: Callable[[], None] | None = None,
        collect: Callable[[], list[TimerChange]] | None = None,
    ) -> None:
        self._write = write
        self._collect = collect
        self._noted = 0
        self._on_written = on_written
        self._group = group
        self._linger_s = linger_s
        self._log = logx
        self._on_failure = on_failure
        self._on_success = on_success
        self._queue: list[TimerChange] = []
        self._arrived = anyio.Event()
        self._full = anyio.Event()
        self.failing: str | None = None
        """The store's answer while settles fail (``None`` once one is written)."""

    def __len__(self) -> int:
        return len(self._queue) + self._noted

    def add(self, changes: Sequence[TimerChange]) -> None:
        if not changes:
            return
        self._queue.extend(changes)
        self._arrived.set()
        if len(self) >= self._group:
            self._full.set()

    def note(self) -> None:
        """One more change for ``collect`` to make when the group is taken."""
        self._noted += 1
        self._arrived.set()
        if len(self) >= self._group:
            self._full.set()

    def _take_noted(self) -> None:
        if self._noted and self._collect is not None:
            self._noted = 0
            self._queue.extend(self._collect())

    async def run(self) -> None:
        """Writes groups until cancelled; what is left then is for :meth:`drain`."""
        while True:
            if not len(self):
                await self._arrived.wait()
                self._arrived = anyio.Event()
                continue
            if len(self) < self._group:
                with anyio.move_on_after(self._linger_s):
                    await self._full.wait()
            self._full = anyio.Event()
            await self._write_some()

    async def drain(self, timeout_s: float) -> None:
        """Writes everything queued, shielded, within ``timeout_s`` (a store that does not answer
        leaves the claims to expire: their timers come due again)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout_s):
            while len(self):
                await self._write_some()

    async def _write_some(self) -> None:
        """Writes the first group (retried while the store is unavailable; an error retrying
        will not fix gives it up: its claims expire and the timers come due again)."""
        self._take_noted()
        n = min(len(self._queue), SETTLE_MAX)
        batch = self._queue[:n]
        written = -1
        try:
            async for attempt in retrying("settle", backoff=SETTLE_BACKOFF, logger=None, on_failure=self._failed):
                with attempt:
                    written = await self._write(batch)
        except StorageError as exc:
            self._log.error("settle failed: %s (claims will expire and re-fire)", exc)
            if self._on_failure is not None:
                self._on_failure(exc)
        else:
            if self._on_success is not None:
                self._on_success()
        self.failing = None
        del self._queue[:n]
        self._on_written(batch, written)

    def _failed(self, exc: BaseException) -> None:
        if self._on_failure is not None and isinstance(exc, StorageError):
            self._on_failure(exc)  # logs it
        elif self.failing is None:
            self._log.warning("settle failed (will retry): %s", exc)
        self.failing = str(exc)


@dataclass(slots=True, eq=False)
class _LaneState:
    spec: Lane
    queue: deque[Timer]
    active: int = 0
    ready: bool = False

    def deliverable(self) -> int:
        """How many calls could start on this lane now."""
        chunk = self.spec.chunk
        return min(-(-len(self.queue) // chunk), self.spec.limit - self.active)


class DeliveryStream:
    """Per-target queues and up to ``limits.concurrency`` workers (tasks in the bound task group,
    started as timers arrive, ending when nothing is left to deliver); each outcome goes to
    ``record``.

    Before each call a worker waits for room in the window: calls in flight plus outcomes
    recorded and not yet written (:meth:`settled` says when they are) stay within
    ``limits.window``.
    No delivery starts once ``stopped()``; the timers still queued then are the caller's to
    release (:meth:`left`), and so is a call cancelled in flight (it records nothing). A timer
    ``skip`` answers True for when its turn comes is not sent: ``skip`` queues its change itself
    (an occurrence past its misfire grace), which holds a place in the window as an outcome does
    until :meth:`settled`."""

    def __init__(
        self,
        gateway: CommandGateway,
        limits: Limits,
        record: Callable[[Timer, Outcome], None],
        *,
        stopped: Callable[[], bool],
        skip: Callable[[Timer], bool] | None = None,
    ) -> None:
        self._gateway = gateway
        self._lane_of = limits.lane_of
        self._skip = skip
        self._record = record
        self._concurrency = limits.concurrency
        self._window = limits.window
        self._stopped = stopped
        self._lanes: dict[str, _LaneState] = {}
        self._ready: deque[_LaneState] = deque()
        self._workers = 0
        self._starting = 0
        self._calls = 0
        self._unsettled = 0
        self._room = anyio.Event()
        self._tg: TaskGroup | None = None
        self.queued = 0

    def bind(self, tg: TaskGroup) -> None:
        """The task group the workers run in."""
        self._tg = tg

    @property
    def open(self) -> int:
        """Calls in flight plus outcomes recorded and not yet written."""
        return self._calls + self._unsettled

    def put(self, timers: Sequence[Timer]) -> None:
        """Queues ``timers`` on their targets' lanes (in this order) and starts workers."""
        lanes = self._lanes
        lane_of = self._lane_of
        for t in timers:
            spec = lane_of(t)
            lane = lanes.get(spec.name)
            if lane is None:
                lane = lanes[spec.name] = _LaneState(spec, deque())
            lane.queue.append(t)
            if not lane.ready and lane.active < spec.limit:
                lane.ready = True
                self._ready.append(lane)
        self.queued += len(timers)
        metrics.DELIVERIES_QUEUED.set(self.queued)
        self._spawn()

    def settled(self, n: int) -> None:
        """``n`` recorded outcomes were written (or given up): room in the window."""
        self._unsettled -= n
        self._room.set()

    def wake(self) -> None:
        """Wakes the workers waiting for room (a stop)."""
        self._room.set()

    def left(self) -> list[Timer]:
        """Takes the timers still queued (after a stop)."""
        out = [t for lane in self._lanes.values() for t in lane.queue]
        for lane in self._lanes.values():
            lane.queue.clear()
            lane.ready = False
        self._ready.clear()
        self.queued = 0
        metrics.DELIVERIES_QUEUED.set(0)
        return out

    def _spawn(self) -> None:
        tg = self._tg
        assert tg is not None, "bind() the stream to a task group first"
        want = sum(lane.deliverable() for lane in self._ready)
        while self._workers < self._concurrency and self._starting < want:
            self._workers += 1
            self._starting += 1
            tg.start_soon(self._worker)

    def _take(self) -> tuple[_LaneState, list[Timer]] | None:
        """The next lane in turn with something to deliver and a free slot, and what to send."""
        ready = self._ready
        while ready:
            lane = ready.popleft()
            lane.ready = False
            if not lane.queue or lane.active >= lane.spec.limit:
                continue
            n = min(lane.spec.chunk, len(lane.queue))
            queue = lane.queue
            batch = [queue.popleft() for _ in range(n)]
            self.queued -= n
            lane.active += 1
            if queue and lane.active < lane.spec.limit:
                lane.ready = True
                ready.append(lane)
            return lane, batch
        return None

    async def _worker(self) -> None:
        starting = True
        try:
            while not self._stopped():
                while self._calls + self._unsettled >= self._window:
                    if self._room.is_set():
                        self._room = anyio.Event()
                    await self._room.wait()
                    if self._stopped():
                        return
                taken = self._take()
                if starting:
                    starting = False
                    self._starting -= 1
                if taken is None:
                    return
                lane, batch = taken
                metrics.DELIVERIES_QUEUED.set(self.queued)
                if self._skip is not None:
                    kept = [t for t in batch if not self._skip(t)]
                    self._unsettled += len(batch) - len(kept)  # settled by ``skip``: their changes are queued
                    batch = kept
                    if not batch:
                        self._done(lane)
                        continue
                self._calls += 1
                try:
                    await self._call(lane.spec, batch)
                finally:
                    self._calls -= 1
                    self._done(lane)
        finally:
            if starting:
                self._starting -= 1
            self._workers -= 1

    def _done(self, lane: _LaneState) -> None:
        """A call of ``lane`` ended: its slot is free for the next of its queue."""
        lane.active -= 1
        if lane.queue and not lane.ready:
            lane.ready = True
            self._ready.append(lane)
            self._spawn()

    async def _call(self, lane: Lane, batch: list[Timer]) -> None:
        """One request (a lane of chunks: one batch call); outcomes are recorded as they come."""
        record = self._record

        def recorded(t: Timer, outcome: Outcome) -> None:
            self._unsettled += 1
            record(t, outcome)

        if lane.chunk == 1:
            (t,) = batch
            recorded(t, await self._gateway.send(t))
            return
        # a lane of chunks is a batch gateway's (the replica's assembly pairs them: batch_limits)
        outcome = await cast(BatchGateway, self._gateway).send_batch(batch)
        for t in batch:
            recorded(t, outcome)
