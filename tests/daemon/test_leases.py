"""The slot keeper against a scripted lease store: validity on the monotonic clock, loss, release."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import anyio
import pytest

from wowd import metrics
from wowd.config import LeaseSettings, WowdSettings
from wowd.daemon.leases import HeldSlot, SlotKeeper
from wowd.errors import LeaseLost
from wowd.model import AcquireResult, Owner, SlotLease

pytestmark = pytest.mark.anyio


class ScriptedLeases:
    """One slot; ``renew_mode``: ok | hang | lost."""

    def __init__(self) -> None:
        self.renew_mode = "ok"
        self.exhausted = False
        self.acquires = 0
        self.renews = 0
        self.released: list[tuple[SlotLease, int]] = []
        self._changed = anyio.Event()

    async def wait_acquires(self, n: int) -> None:
        while self.acquires < n:
            await self._changed.wait()

    async def acquire(
        self, namespace: str, owner: Owner, limit: int, ttl: timedelta, tolerance: timedelta,
        slot_offset: int = 0, preferred_slot: int | None = None,
    ) -> AcquireResult:
        if self.exhausted:
            return AcquireResult(status="exhausted")
        self.acquires += 1
        self._changed.set()
        self._changed = anyio.Event()
        lease = SlotLease(namespace=namespace, slot=1, owner_key=owner.key, incarnation=self.acquires,
                          fence=self.acquires, expires_at=123 + ttl // timedelta(milliseconds=1), floor=0,
                          ceiling=0, written_at=123)
        return AcquireResult(status="acquired", lease=lease)

    async def renew(self, lease: SlotLease, ttl: timedelta, tolerance: timedelta) -> SlotLease | None:
        self.renews += 1
        if self.renew_mode == "hang":
            await anyio.sleep_forever()
        if self.renew_mode == "lost":
            return None
        return lease

    async def release(self, lease: SlotLease, last_issued: int) -> bool:
        self.released.append((lease, last_issued))
        return True


def settings(ttl: float = 0.6, tolerance: float = 0.2) -> WowdSettings:
    return WowdSettings(partitions=8, lease=LeaseSettings(limit=2, ttl_s=ttl, tolerance_s=tolerance))


def lost_count() -> float:
    return float(metrics.LEASE_LOST._value.get())


async def test_work_stops_at_validity_deadline_while_renew_hangs() -> None:
    store = ScriptedLeases()
    store.renew_mode = "hang"
    stopped = anyio.Event()
    times: dict[str, float] = {}
    lost_before = lost_count()

    async def work(held: HeldSlot) -> None:
        if "start" in times:
            await anyio.sleep_forever()
        times["start"] = anyio.current_time()
        assert held.partitions == frozenset({1, 3, 5, 7})
        try:
            await anyio.sleep_forever()
        finally:
            times["stop"] = anyio.current_time()
            assert not held.valid
            with pytest.raises(LeaseLost):
                held.check()
            stopped.set()

    keeper = SlotKeeper(0, settings(), store, work, owner_key="me")  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        held = await tg.start(keeper.run)
        assert held is not None and held.fence == 1
        with anyio.fail_after(3):
            await stopped.wait()
        # validity = sent + ttl - tolerance = 0.4 s after the acquire was sent, renew still in flight
        assert 0.3 <= times["stop"] - times["start"] <= 0.55
        with anyio.fail_after(3):
            await store.wait_acquires(2)  # reacquires after the loss
        assert lost_count() == lost_before + 1
        keeper.stop(1.0)
    assert not store.released or store.released[-1][0].fence == 2


async def test_refused_renew_stops_work_at_once_and_reacquires() -> None:
    store = ScriptedLeases()
    store.renew_mode = "lost"
    cancelled = anyio.Event()

    async def work(held: HeldSlot) -> None:
        try:
            await anyio.sleep_forever()
        finally:
            if held.fence == 1:
                cancelled.set()

    keeper = SlotKeeper(0, settings(ttl=3.0, tolerance=0.5), store, work, owner_key="me")  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        start = anyio.current_time()
        await tg.start(keeper.run)
        with anyio.fail_after(3):
            await cancelled.wait()
        # lost on the first renew (ttl/3 = 1 s), well before the 2.5 s validity
        assert anyio.current_time() - start < 2.0
        store.renew_mode = "ok"
        with anyio.fail_after(3):
            await store.wait_acquires(2)
        keeper.stop(1.0)
    assert store.released and store.released[-1][0].fence == 2


async def test_stop_drains_work_then_releases_with_last_issued() -> None:
    store = ScriptedLeases()
    drained = anyio.Event()

    async def work(held: HeldSlot) -> None:
        await held.stop_event.wait()
        held.check()  # still valid while draining
        drained.set()

    keeper = SlotKeeper(0, settings(ttl=5.0, tolerance=1.0), store, work, owner_key="me")  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        keeper.stop(2.0)
    assert drained.is_set()
    (lease, last_issued), = store.released
    assert lease.fence == 1 and last_issued == 123


async def test_grace_period_cancels_slow_work_and_still_releases() -> None:
    store = ScriptedLeases()

    async def work(held: HeldSlot) -> None:
        await anyio.sleep_forever()  # ignores the stop request

    keeper = SlotKeeper(0, settings(ttl=5.0, tolerance=1.0), store, work, owner_key="me")  # type: ignore[arg-type]
    with anyio.fail_after(3):
        async with anyio.create_task_group() as tg:
            await tg.start(keeper.run)
            keeper.stop(0.2)
    assert len(store.released) == 1


async def test_exhausted_is_standby_then_takes_a_freed_slot() -> None:
    store = ScriptedLeases()
    store.exhausted = True
    got = anyio.Event()

    async def work(held: HeldSlot) -> None:
        got.set()
        await held.stop_event.wait()

    keeper = SlotKeeper(0, settings(), store, work, owner_key="me")  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        held: Any = await tg.start(keeper.run)
        assert held is None and keeper.standby
        store.exhausted = False
        with anyio.fail_after(3):
            await got.wait()
        assert not keeper.standby
        keeper.stop(1.0)
