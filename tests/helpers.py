"""Small helpers shared by test modules."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import anyio

from wowd.daemon.leases import HeldSlot
from wowd.daemon.waker import Waker
from wowd.model import AggregateRef, Command, LogEntry, Position, SlotLease, Timer, deterministic_timer_id, partition
from wowd.stores.base import Log

FAR_FUTURE_MS = 2**62


def caught_up_waker() -> Waker:
    """A waker whose feed has applied every commit (a timer loop tested without its feed)."""
    waker = Waker()
    waker.advance(FAR_FUTURE_MS)
    return waker


def once_timer(context: str, id: str, partitions: int, due_at: int) -> Timer:
    """The one-shot timer ``k`` (version 1) of order ``id``, due at ``due_at``, aimed at itself."""
    owner = AggregateRef(context=context, aggregate="order", id=id)
    return Timer(
        timer_id=deterministic_timer_id(owner, "k", 1),
        partition=partition(id, partitions),
        owner=owner,
        key="k",
        version=1,
        due_at=due_at,
        scheduled_at=due_at,
        target=owner,
        body=Command(name="go").to_json(),
    )


def held_slot(partitions: int, *, fence: int = 1, slot: int = 0, valid_for: float = 60) -> HeldSlot:
    """Slot ``slot`` of namespace ``t`` held by owner key ``me`` under ``fence``, over partitions
    ``0 .. partitions - 1``, its lease valid ``valid_for`` seconds more (call it in a task)."""
    lease = SlotLease(
        namespace="t", slot=slot, owner_key="me", incarnation=1, fence=fence, expires_at=0, floor=0, ceiling=0,
        written_at=0,
    )  # fmt: skip
    return HeldSlot(
        lease=lease, partitions=frozenset(range(partitions)), valid_until=anyio.current_time() + valid_for,
        owner_key="me",
    )  # fmt: skip


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
