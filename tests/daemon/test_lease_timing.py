"""When the slot keeper renews its lease, how long it works under it, and when the presence record
is written (docs/concepts.md, "Slot and lease"), timed on trio's virtual clock
(``trio.testing.MockClock``, jumping ahead whenever every task waits): the renewals come at exactly
``ttl/3`` after a take or a renewal, the work stops exactly at ``sent + ttl - tolerance`` of the
last answered renewal, a wall clock stepped back renews at once (within the clock check's half
tolerance) without extending the lease, and the presence heartbeats come every ``ttl/3``. No
margin for a loaded machine is needed: the virtual clock is the one the keeper reads."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup
from trio.testing import MockClock

from tests.daemon.test_leases import WallClockLeases
from wowd.config import LeaseSettings, WowdSettings
from wowd.daemon.leases import RELEASE_TIMEOUT_S, HeldSlot, Presence, SlotKeeper
from wowd.errors import SlotStalled, StorageFull, StorageUnavailable
from wowd.model import AcquireResult, Owner, SlotLease
from wowd.stores.base import ReplicaInfo

pytestmark = pytest.mark.anyio

TTL_S, TOLERANCE_S = 3.0, 0.5
EXACT = 1e-6
"""Floating-point noise: the virtual clock moves only when every task waits."""
WALL_BASE_S = 1_700_000_000.0


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return "trio", {"clock": MockClock(autojump_threshold=0)}


def settings() -> WowdSettings:
    return WowdSettings(partitions=8, lease=LeaseSettings(limit=1, ttl_s=TTL_S, tolerance_s=TOLERANCE_S))


class VirtualLeases(WallClockLeases):
    """:class:`WallClockLeases` on a wall clock that follows the virtual one (plus ``offset_s``, a
    step the test makes); renewals are answered at once, or never (``hang``)."""

    def __init__(self) -> None:
        super().__init__()
        self.hang = False
        self.acquired_at: list[float] = []
        self.renewed_at: list[float] = []
        self.renewed = anyio.Event()

    def wall(self) -> float:
        return WALL_BASE_S + anyio.current_time() + self.offset_s

    async def acquire(self, *args: Any, **kwargs: Any) -> AcquireResult:
        self.acquired_at.append(anyio.current_time())
        return await super().acquire(*args, **kwargs)

    async def renew(self, lease: SlotLease, ttl: timedelta, tolerance: timedelta) -> SlotLease | None:
        self.renewed_at.append(anyio.current_time())
        if self.hang:
            await anyio.sleep_forever()
        renewed = await super().renew(lease, ttl, tolerance)
        assert renewed is not None
        self.renewed.set()
        self.renewed = anyio.Event()
        return renewed


class Work:
    """The slot's work: notes when it stopped."""

    def __init__(self) -> None:
        self.stopped_at: float | None = None
        self.stopped = anyio.Event()

    async def __call__(self, held: HeldSlot) -> None:
        if self.stopped.is_set():  # a later holding: wait for the test's stop
            await held.stop_event.wait()
            return
        try:
            await held.stop_event.wait()
        finally:
            self.stopped_at = anyio.current_time()
            self.stopped.set()


async def test_the_lease_is_renewed_every_third_of_the_ttl() -> None:
    store, work = VirtualLeases(), Work()
    keeper = SlotKeeper(0, settings(), store, work, owner_key="me", wall_clock=store.wall)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        while len(store.renewed_at) < 4:
            await store.renewed.wait()
        keeper.stop(1.0)
    (took,) = store.acquired_at
    gaps = [b - a for a, b in zip([took, *store.renewed_at], store.renewed_at[:4], strict=False)]
    assert all(abs(g - TTL_S / 3) < EXACT for g in gaps), gaps


async def test_the_work_stops_at_the_validity_of_the_last_renewal_answered() -> None:
    store, work = VirtualLeases(), Work()
    keeper = SlotKeeper(0, settings(), store, work, owner_key="me", wall_clock=store.wall)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        await store.renewed.wait()
        store.hang = True  # the next renewals never come back
        await work.stopped.wait()
        keeper.stop(1.0)
    answered = store.renewed_at[0]
    assert work.stopped_at is not None
    assert abs(work.stopped_at - (answered + TTL_S - TOLERANCE_S)) < EXACT


async def test_a_wall_clock_stepped_back_renews_at_once_and_extends_nothing() -> None:
    """The step back is noticed at the next clock check (every half tolerance) and renewed then,
    long before the ``ttl/3`` renewal; the work goes on, under the renewal's validity and no
    longer: when the renewals after it hang, it stops ``ttl - tolerance`` after that one."""
    store, work = VirtualLeases(), Work()
    keeper = SlotKeeper(0, settings(), store, work, owner_key="me", wall_clock=store.wall)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        held = await tg.start(keeper.run)
        assert held is not None
        await anyio.sleep(0.1)
        stepped = anyio.current_time()
        store.offset_s -= 3600.0
        await store.renewed.wait()
        (renewed,) = store.renewed_at
        assert renewed - stepped <= TOLERANCE_S / 2 + EXACT  # not at the scheduled ttl/3 (1 s)
        assert held.valid and keeper.held is held
        store.hang = True
        await work.stopped.wait()
        keeper.stop(1.0)
    assert work.stopped_at is not None
    assert abs(work.stopped_at - (renewed + TTL_S - TOLERANCE_S)) < EXACT


class Heartbeats:
    def __init__(self) -> None:
        self.at: list[float] = []
        self.beat = anyio.Event()

    async def heartbeat(self, namespace: str, owner_key: str, info: ReplicaInfo, ttl: timedelta) -> None:
        self.at.append(anyio.current_time())
        self.beat.set()
        self.beat = anyio.Event()

    async def leave(self, namespace: str, owner_key: str) -> bool:
        return True


async def test_the_presence_record_is_written_at_once_then_every_third_of_the_ttl() -> None:
    store = Heartbeats()
    presence = Presence(settings(), store, list, owner_key="me", host="h", pid=7)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        started = anyio.current_time()
        await tg.start(presence.run)
        while len(store.at) < 4:
            await store.beat.wait()
        presence.stop()
    assert abs(store.at[0] - started) < EXACT
    gaps = [b - a for a, b in zip(store.at, store.at[1:4], strict=False)]
    assert all(abs(g - TTL_S / 3) < EXACT for g in gaps), gaps


class SlowStore(VirtualLeases):
    """Releases and presence deletes take the store a moment (``hangs``: an hour)."""

    def __init__(self) -> None:
        super().__init__()
        self.hangs = False
        self.released: list[int] = []
        self.left: list[str] = []

    async def _answer(self) -> None:
        await anyio.sleep(3600.0 if self.hangs else 0.01)

    async def release(self, lease: SlotLease, last_issued: int) -> bool:
        await self._answer()
        self.released.append(lease.fence)
        return await super().release(lease, last_issued)

    async def heartbeat(self, namespace: str, owner_key: str, info: ReplicaInfo, ttl: timedelta) -> None:
        return None

    async def leave(self, namespace: str, owner_key: str) -> bool:
        await self._answer()
        self.left.append(owner_key)
        return True


@asynccontextmanager
async def keeper_and_presence(store: SlowStore) -> AsyncIterator[tuple[TaskGroup, SlotKeeper, Presence]]:
    """A slot keeper and a presence of the replica ``me`` on ``store``, started in a task group
    that ends with the block."""
    keeper = SlotKeeper(0, settings(), store, Work(), owner_key="me", wall_clock=store.wall)  # type: ignore[arg-type]
    presence = Presence(settings(), store, list, owner_key="me", host="h", pid=7)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        await tg.start(presence.run)
        yield tg, keeper, presence


async def test_a_keeper_and_a_presence_cancelled_from_outside_still_release_the_slot_and_delete_the_record() -> None:
    store = SlowStore()
    async with keeper_and_presence(store) as (tg, _keeper, _presence):
        tg.cancel_scope.cancel()
    assert store.released == [1]
    assert store.left == ["me"]


async def test_a_release_and_a_delete_the_store_does_not_answer_are_given_up_after_five_seconds() -> None:
    store = SlowStore()
    async with keeper_and_presence(store) as (_tg, keeper, presence):
        store.hangs = True
        stopped = anyio.current_time()
        keeper.stop(1.0)
        presence.stop()
    assert abs(anyio.current_time() - stopped - RELEASE_TIMEOUT_S) < EXACT
    assert store.released == [] and store.left == []


async def test_a_slot_whose_work_gives_up_is_released_and_taken_again_after_twice_the_ttl() -> None:
    """The slot's feed made no progress and gave it up (``SlotStalled``) for another replica to
    try: the slot is released and this keeper stands by for ``max(2 * ttl, 10 s)`` before it
    acquires again."""
    store = VirtualLeases()
    s = WowdSettings(partitions=8, lease=LeaseSettings(limit=1, ttl_s=6.0, tolerance_s=TOLERANCE_S))
    again = anyio.Event()

    async def work(held: HeldSlot) -> None:
        if held.fence == 1:
            raise SlotStalled("the feed of slot 0 made no progress for 300 s")
        again.set()
        await held.stop_event.wait()

    keeper = SlotKeeper(0, s, store, work, owner_key="me", wall_clock=store.wall)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        await anyio.sleep(6.0)  # halfway through the stand-by
        assert keeper.standby and keeper.held is None
        with anyio.fail_after(60):
            await again.wait()
        keeper.stop(1.0)
    first, second = store.acquired_at
    assert abs(second - first - 12.0) < EXACT


class FailingRenewals(VirtualLeases):
    """Renewals the store fails (``failures`` of them, each answered after 10 ms), then answered."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def renew(self, lease: SlotLease, ttl: timedelta, tolerance: timedelta) -> SlotLease | None:
        if self.failures:
            self.failures -= 1
            self.renewed_at.append(anyio.current_time())
            await anyio.sleep(0.01)
            raise StorageUnavailable("sqlite wowd.db: database is locked")
        return await super().renew(lease, ttl, tolerance)


async def test_a_renewal_the_store_fails_is_retried_every_quarter_of_the_renewal_period() -> None:
    """Not at once (a store that fails is not hammered), not at the next period (the lease would
    lapse): ``ttl/12`` after each failure, here 0.25 s; the work goes on under the lease renewed."""
    store, work = FailingRenewals(3), Work()
    keeper = SlotKeeper(0, settings(), store, work, owner_key="me", wall_clock=store.wall)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        held = await tg.start(keeper.run)
        while len(store.renewed_at) < 4:
            await store.renewed.wait()
        assert held is not None and held.valid and not work.stopped.is_set()
        keeper.stop(1.0)
    (took,) = store.acquired_at
    assert abs(store.renewed_at[0] - took - TTL_S / 3) < EXACT
    gaps = [b - a for a, b in zip(store.renewed_at, store.renewed_at[1:4], strict=False)]
    assert all(abs(g - (0.01 + TTL_S / 12)) < EXACT for g in gaps), gaps


class FillingDisk(VirtualLeases):
    """Writes (takes, renewals) stamp the lease :data:`WRITE_S` after they are sent, and fail with
    :class:`StorageFull` while ``full``; an acquire while the owner's lease is live by the store
    clock reads that lease back, with the store's now and no write, as both stores do."""

    WRITE_S = 0.2

    def __init__(self) -> None:
        super().__init__()
        self.full = False

    async def acquire(
        self, namespace: str, owner: Owner, limit: int, ttl: timedelta, *args: Any, **kwargs: Any
    ) -> AcquireResult:
        self.acquired_at.append(anyio.current_time())
        now = self.now_ms()
        if self.lease is not None and self.lease.owner_key == owner.key and self.lease.expires_at > now:
            return AcquireResult(status="acquired", lease=replace(self.lease, store_now=now))
        await anyio.sleep(self.WRITE_S)
        if self.full:
            raise StorageFull("sqlite wowd.db: database or disk is full")
        return await self.take(namespace, owner, ttl)

    async def renew(self, lease: SlotLease, ttl: timedelta, tolerance: timedelta) -> SlotLease | None:
        await anyio.sleep(self.WRITE_S)
        if self.full:
            self.renewed_at.append(anyio.current_time())
            raise StorageFull("sqlite wowd.db: database or disk is full")
        return await super().renew(lease, ttl, tolerance)


async def test_a_lease_read_back_after_it_lapsed_on_a_full_disk_leaves_the_keeper_stalled() -> None:
    """Its renewals refused, the keeper stops the work at its own, earlier, reckoning of the
    lease's end; its next acquire reads the same lease back from the store (still live there), and
    it works under it again. No write succeeded: it stays stalled (``/readyz`` 503 naming the full
    disk) until a renewal is written."""
    store, work = FillingDisk(), Work()
    holdings: list[HeldSlot] = []
    held_again = anyio.Event()

    def changed() -> None:
        held = keeper.held
        if held is not None and all(held is not h for h in holdings):
            holdings.append(held)
            if len(holdings) == 2:
                held_again.set()

    keeper = SlotKeeper(0, settings(), store, work, owner_key="me", on_change=changed, wall_clock=store.wall)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        first = await tg.start(keeper.run)
        assert first is not None
        await store.renewed.wait()
        store.full = True
        await work.stopped.wait()
        with anyio.fail_after(TTL_S):
            await held_again.wait()
        again = holdings[1]
        assert again.fence == first.fence and again.lease.store_now is not None
        assert keeper.stall.stalled and "renew of slot 0: StorageFull" in str(keeper.stall.reason)
        store.full = False
        await store.renewed.wait()
        assert not keeper.stall.stalled
        keeper.stop(1.0)


class NoFreeSlot(VirtualLeases):
    async def acquire(self, *args: Any, **kwargs: Any) -> AcquireResult:
        self.acquired_at.append(anyio.current_time())
        return AcquireResult(status="exhausted")


async def test_a_standby_asks_again_at_once_then_backs_off_to_a_third_of_the_ttl_with_jitter_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A slot freed is taken soon (the second ask within 0.1 s), the store is not hammered (the
    pauses grow to ``ttl/3``, never past it), standbys of several replicas do not ask in step
    (each pause scaled at random), and the replica says once that it stands by."""
    caplog.set_level(logging.INFO, logger="wowd.daemon.leases")
    store, changes = NoFreeSlot(), []
    keeper = SlotKeeper(
        0, settings(), store, Work(), owner_key="me", on_change=lambda: changes.append(keeper.standby),
        wall_clock=store.wall,
    )  # type: ignore[arg-type]  # fmt: skip
    async with anyio.create_task_group() as tg:
        assert await tg.start(keeper.run) is None
        await anyio.sleep(30.0)
        keeper.stop(1.0)
    gaps = [b - a for a, b in zip(store.acquired_at, store.acquired_at[1:], strict=False)]
    assert 0.05 - EXACT <= gaps[0] <= 0.1 + EXACT
    assert max(gaps) <= TTL_S / 3 + EXACT
    capped = gaps[10:]
    assert all(g >= TTL_S / 6 - EXACT for g in capped) and len({round(g, 9) for g in capped}) > 1
    assert changes == [True]
    standing_by = [r for r in caplog.records if "no free slot" in r.getMessage()]
    assert len(standing_by) == 1


async def test_a_standby_keeper_stops_at_once() -> None:
    """However long it has stood by (its pauses grow to ``ttl/3``), a stop ends it at once."""
    store = NoFreeSlot()
    keeper = SlotKeeper(0, settings(), store, Work(), owner_key="me", wall_clock=store.wall)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        assert await tg.start(keeper.run) is None
        await anyio.sleep(30.5)
        stopped = anyio.current_time()
        keeper.stop(1.0)
    assert abs(anyio.current_time() - stopped) < EXACT
    assert len(store.acquired_at) > 20  # it kept asking meanwhile
