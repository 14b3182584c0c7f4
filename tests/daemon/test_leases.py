"""The slot keeper against a scripted lease store: validity on the monotonic clock, loss, release."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import anyio
import pytest

from tests.factories import eventually, lease
from wowd import metrics
from wowd.config import LeaseSettings, ShutdownSettings, WowdSettings
from wowd.daemon.leases import HeldSlot, SlotKeeper, owner_key_for
from wowd.errors import ConfigError, LeaseLost, StorageFull
from wowd.model import AcquireResult, Owner, SlotLease

pytestmark = pytest.mark.anyio


class OneSlot:
    """A lease store of one slot, for the keeper: what a take answers is the subclass's."""

    async def acquire(
        self,
        namespace: str,
        owner: Owner,
        limit: int,
        ttl: timedelta,
        tolerance: timedelta,
        slot_offset: int = 0,
        preferred_slot: int | None = None,
    ) -> AcquireResult:
        return await self.take(namespace, owner, ttl)

    async def take(self, namespace: str, owner: Owner, ttl: timedelta) -> AcquireResult:
        raise NotImplementedError


class ScriptedLeases(OneSlot):
    """One slot; ``renew_mode``: ok | hang | lost."""

    def __init__(self) -> None:
        self.renew_mode = "ok"
        self.exhausted = False
        self.full = False
        """Acquires and renewals raise :class:`StorageFull` (counted in ``refused``) while set."""
        self.refused = 0
        self.acquire_hangs = False
        """Acquires wait forever (a store that does not answer) while set."""
        self.acquires = 0
        self.renews = 0
        self.released: list[tuple[SlotLease, int]] = []
        self._changed = anyio.Event()
        self.hung = anyio.Event()

    async def wait_acquires(self, n: int) -> None:
        while self.acquires < n:
            await self._changed.wait()

    async def take(self, namespace: str, owner: Owner, ttl: timedelta) -> AcquireResult:
        self._refuse_if_full()
        if self.acquire_hangs:
            self.hung.set()
            await anyio.sleep_forever()
        if self.exhausted:
            return AcquireResult(status="exhausted")
        self.acquires += 1
        self._changed.set()
        self._changed = anyio.Event()
        expires_at = 123 + ttl // timedelta(milliseconds=1)
        taken = lease(
            self.acquires, owner_key=owner.key, namespace=namespace, slot=1, expires_at=expires_at, written_at=123
        )
        return AcquireResult(status="acquired", lease=taken)

    def _refuse_if_full(self) -> None:
        if self.full:
            self.refused += 1
            raise StorageFull("sqlite wowd.db: database or disk is full")

    async def renew(self, lease: SlotLease, ttl: timedelta, tolerance: timedelta) -> SlotLease | None:
        self._refuse_if_full()
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


def fence_gauge(slot: int) -> float | None:
    return metrics.REGISTRY.get_sample_value("wowd_lease_fence", {"slot": str(slot)})


async def test_work_stops_at_validity_deadline_while_renew_hangs() -> None:
    store = ScriptedLeases()
    store.renew_mode = "hang"
    stopped = anyio.Event()
    times: dict[str, float] = {}
    lost_before = lost_count()

    async def work(held: HeldSlot) -> None:
        if "start" in times:  # the slot taken again: works until the stop
            await held.stop_event.wait()
            return
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
        store.renew_mode = "ok"  # the store answers again: the slot taken back is held
        with anyio.fail_after(3):
            await store.wait_acquires(2)  # reacquires after the loss
        assert lost_count() == lost_before + 1
        keeper.stop(1.0)
    # the lost lease is not released (another holder may have it); the one taken back is
    assert [lease.fence for lease, _last_issued in store.released] == [2]


async def test_refused_renew_stops_work_at_once_and_reacquires() -> None:
    store = ScriptedLeases()
    store.renew_mode = "lost"
    cancelled = anyio.Event()

    async def work(held: HeldSlot) -> None:
        try:
            await held.stop_event.wait()
        finally:
            if held.fence == 1:
                cancelled.set()

    keeper = SlotKeeper(0, settings(ttl=1.8, tolerance=0.3), store, work, owner_key="me")  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        start = anyio.current_time()
        await tg.start(keeper.run)
        with anyio.fail_after(3):
            await cancelled.wait()
        # lost on the first renew (ttl/3 = 0.6 s), well before the 1.5 s validity
        assert anyio.current_time() - start < 1.2
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
        await anyio.sleep(0.05)  # the drain's own work
        held.check()  # still valid while draining
        drained.set()

    keeper = SlotKeeper(0, settings(ttl=5.0, tolerance=1.0), store, work, owner_key="me")  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        held = await tg.start(keeper.run)
        assert held is not None and held.owner_key == "me"
        assert fence_gauge(1) == 1.0  # the slot's fence while it is held
        keeper.stop(2.0)
    assert drained.is_set()
    ((lease, last_issued),) = store.released
    assert lease.fence == 1 and last_issued == 123
    assert fence_gauge(1) is None  # no fence for a slot no longer held


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


class HeldLeases(ScriptedLeases):
    """One slot a timer view rebuild may hold: while ``holding``, a renewal answers the lease
    held by it and a take answers exhausted."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = False
        self.released_event = anyio.Event()

    async def take(self, namespace: str, owner: Owner, ttl: timedelta) -> AcquireResult:
        if self.holding:
            return AcquireResult(status="exhausted")
        return await super().take(namespace, owner, ttl)

    async def renew(self, lease: SlotLease, ttl: timedelta, tolerance: timedelta) -> SlotLease | None:
        renewed = await super().renew(lease, ttl, tolerance)
        if renewed is not None and self.holding:
            return replace(renewed, held_by="rebuild of the timer view")
        return renewed

    async def release(self, lease: SlotLease, last_issued: int) -> bool:
        released = await super().release(lease, last_issued)
        self.released_event.set()
        return released


async def test_a_renewal_answering_the_slot_held_drains_the_work_releases_it_and_takes_it_back_after_the_hold() -> None:
    store = HeldLeases()
    drained = anyio.Event()
    fences: list[int] = []

    async def work(held: HeldSlot) -> None:
        fences.append(held.fence)
        await held.stop_event.wait()
        await anyio.sleep(0.05)  # the drain's own work
        held.check()  # still valid while draining
        if held.fence == 1:
            drained.set()

    keeper = SlotKeeper(0, settings(), store, work, owner_key="me")  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        store.holding = True  # answered at the next renewal (ttl/3 = 0.2 s)
        with anyio.fail_after(3):
            await drained.wait()
            await store.released_event.wait()
        assert [lease.fence for lease, _last_issued in store.released] == [1]
        store.holding = False
        with anyio.fail_after(3):
            await store.wait_acquires(2)  # taken back once the hold ends
        keeper.stop(1.0)
    assert fences == [1, 2]


async def test_a_hold_cancels_work_that_outlasts_the_grace_period_and_still_releases() -> None:
    store = HeldLeases()
    cancelled = anyio.Event()

    async def work(held: HeldSlot) -> None:
        if held.fence > 1:
            await held.stop_event.wait()
            return
        try:
            await anyio.sleep_forever()  # ignores the stop request
        finally:
            cancelled.set()

    s = settings().model_copy(update={"shutdown": ShutdownSettings(grace_s=0.3)})
    keeper = SlotKeeper(0, s, store, work, owner_key="me")  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        store.holding = True
        with anyio.fail_after(3):  # the lease itself is renewed all along: only the grace ends it
            await cancelled.wait()
            await store.released_event.wait()
        store.holding = False
        keeper.stop(1.0)


async def test_work_that_finds_its_lease_lost_is_not_released_and_the_slot_is_taken_again() -> None:
    """A store call of the work answered that the lease was lost (its own check, on its own
    clock): the keeper counts the loss and releases nothing (another holder may have the slot)."""
    store = ScriptedLeases()
    second = anyio.Event()
    lost_before = lost_count()

    async def work(held: HeldSlot) -> None:
        if held.fence == 1:
            raise LeaseLost("slot 1 (fence 1): the round's commit came after the lease's deadline")
        second.set()
        await held.stop_event.wait()

    keeper = SlotKeeper(0, settings(ttl=5.0, tolerance=1.0), store, work, owner_key="me")  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        with anyio.fail_after(3):
            await second.wait()
        keeper.stop(1.0)
    assert lost_count() == lost_before + 1
    assert [lease.fence for lease, _last_issued in store.released] == [2]


async def test_a_keeper_stalled_by_a_full_disk_recovers_when_a_renewal_gets_through() -> None:
    """A renewal refused for a full disk stalls the keeper at once; the next one that gets
    through, within the lease's validity, ends the stall and the work goes on."""
    store = ScriptedLeases()
    fences: list[int] = []

    async def work(held: HeldSlot) -> None:
        fences.append(held.fence)
        await held.stop_event.wait()

    keeper = SlotKeeper(0, settings(ttl=1.5, tolerance=0.5), store, work, owner_key="me")  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        store.full = True

        async def refused() -> bool:
            return store.refused >= 1

        await eventually(refused, 3, "a renewal refused")
        assert keeper.stall.stalled
        store.full = False

        async def recovered() -> bool:
            return not keeper.stall.stalled

        await eventually(recovered, 3, "the stall ended")
        assert keeper.held is not None and keeper.held.valid
        keeper.stop(1.0)
    assert fences == [1]


async def test_a_stalled_keeper_whose_slot_another_replica_took_is_a_healthy_standby() -> None:
    store = ScriptedLeases()

    async def work(held: HeldSlot) -> None:
        await held.stop_event.wait()

    keeper = SlotKeeper(0, settings(), store, work, owner_key="me")  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        store.full = True

        async def lapsed_and_refused() -> bool:
            return keeper.held is None and store.refused >= 3

        await eventually(lapsed_and_refused, 5, "the lease lapsed, the acquires refused")
        assert keeper.stall.stalled
        store.exhausted, store.full = True, False  # another replica took the slot meanwhile

        async def standing_by() -> bool:
            return keeper.standby and not keeper.stall.stalled

        await eventually(standing_by, 5, "a standby, no longer stalled")
        keeper.stop(1.0)


class Asked(OneSlot):
    """Records what each acquire asks for; answers ``answer``."""

    def __init__(self, answer: AcquireResult) -> None:
        self.answer = answer
        self.asked: list[tuple[str, int, int]] = []

    async def acquire(
        self,
        namespace: str,
        owner: Owner,
        limit: int,
        ttl: timedelta,
        tolerance: timedelta,
        slot_offset: int = 0,
        preferred_slot: int | None = None,
    ) -> AcquireResult:
        self.asked.append((namespace, limit, slot_offset))
        return self.answer


async def test_a_keeper_asks_for_its_configured_slot_range_and_a_refused_configuration_stops_it() -> None:
    store = Asked(AcquireResult(status="refused", reason="namespace 'wowd.t' is recorded with limit 4"))
    s = WowdSettings(partitions=8, lease=LeaseSettings(limit=2, slot_offset=6, ttl_s=0.6, tolerance_s=0.2))

    async def work(held: HeldSlot) -> None:
        raise AssertionError("no slot to work under")

    keeper = SlotKeeper(0, s, store, work, owner_key="me")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="refused this configuration: namespace 'wowd.t' is recorded with limit 4"):
        with anyio.fail_after(3):
            await keeper.run()
    ((_namespace, limit, offset),) = store.asked
    assert (limit, offset) == (2, 6)


class WornLeases(ScriptedLeases):
    """Renewals refused; the first re-acquire hands the lease back unchanged with 0.1 s left (less
    than the tolerance), the later ones take the slot afresh."""

    def __init__(self) -> None:
        super().__init__()
        self.renew_mode = "lost"
        self.taken: SlotLease | None = None
        self.worn = 0

    async def take(self, namespace: str, owner: Owner, ttl: timedelta) -> AcquireResult:
        if self.taken is not None and not self.worn:
            self.worn += 1
            return AcquireResult(status="acquired", lease=replace(self.taken, store_now=self.taken.expires_at - 100))
        result = await super().take(namespace, owner, ttl)
        self.taken = result.lease
        return result


async def test_a_lease_handed_back_with_less_than_the_tolerance_left_is_not_worked_under() -> None:
    store = WornLeases()
    fences: list[int] = []
    second = anyio.Event()

    async def work(held: HeldSlot) -> None:
        fences.append(held.fence)
        if held.fence == 2:
            second.set()
        await held.stop_event.wait()

    keeper = SlotKeeper(0, settings(), store, work, owner_key="me")  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        with anyio.fail_after(3):
            await second.wait()
        store.renew_mode = "ok"
        keeper.stop(1.0)
    assert store.worn == 1
    assert fences == [1, 2]  # the worn lease was waited out, not worked under


def test_each_keeper_of_a_replica_has_an_owner_key_of_its_own() -> None:
    """An owner key holds one slot (acquire is idempotent per key): keeper ``i`` of a replica
    that holds several slots takes them under ``key#i``."""
    assert [owner_key_for("host-a:1:aa", i) for i in range(3)] == ["host-a:1:aa", "host-a:1:aa#1", "host-a:1:aa#2"]


async def test_a_held_slots_deadline_is_its_validity_on_the_monotonic_clock() -> None:
    """What a store call that checks the lease from a thread of its own is handed."""
    held = HeldSlot(lease=lease(1), partitions=frozenset({1}), valid_until=anyio.current_time() + 2.0, owner_key="me")
    assert abs(held.deadline() - (time.monotonic() + 2.0)) < 0.5


class WallClockLeases(OneSlot):
    """One slot whose expiry is decided on a wall clock the test can step, as the embedded store
    decides it on SQLite's ``now``."""

    def __init__(self) -> None:
        self.offset_s = 0.0
        self.lease: SlotLease | None = None
        self.renews: list[SlotLease | None] = []
        self.changed = anyio.Event()

    def wall(self) -> float:
        return time.time() + self.offset_s

    def keeper(self, work: Callable[[HeldSlot], Awaitable[None]]) -> SlotKeeper:
        """A keeper of the slot over this store (a lease of 6 s), on this store's wall clock."""
        s = settings(ttl=6.0, tolerance=0.5)
        return SlotKeeper(0, s, self, work, owner_key="me", wall_clock=self.wall)  # type: ignore[arg-type]

    def now_ms(self) -> int:
        return int(self.wall() * 1000)

    async def take(self, namespace: str, owner: Owner, ttl: timedelta) -> AcquireResult:
        now = self.now_ms()
        fence = self.lease.fence if self.lease else 0
        expires_at = now + ttl // timedelta(milliseconds=1)
        self.lease = lease(
            fence + 1,
            owner_key=owner.key,
            namespace=namespace,
            expires_at=expires_at,
            floor=now,
            ceiling=now,
            written_at=now,
        )
        return AcquireResult(status="acquired", lease=self.lease)

    async def renew(self, lease: SlotLease, ttl: timedelta, tolerance: timedelta) -> SlotLease | None:
        now = self.now_ms()
        renewed = None
        if self.lease == lease and lease.expires_at > now:
            renewed = self.lease = replace(lease, written_at=now, expires_at=now + ttl // timedelta(milliseconds=1))
        self.renews.append(renewed)
        self.changed.set()
        self.changed = anyio.Event()
        return renewed

    async def release(self, lease: SlotLease, last_issued: int) -> bool:
        return self.lease == lease


async def test_a_wall_clock_step_forward_renews_at_once_and_a_refused_renew_stops_the_work() -> None:
    """The store decides expiry on the wall clock: a step forward past the lease's expiry ends
    it in the store. The keeper notices the step within half the tolerance, renews at once, is
    refused and stops the work, long before its next renew (ttl/3) or its validity."""
    store = WallClockLeases()
    stopped = anyio.Event()
    times: dict[str, float] = {}

    async def work(held: HeldSlot) -> None:
        if held.fence > 1:
            await anyio.sleep_forever()
        try:
            await anyio.sleep_forever()
        finally:
            times["stopped"] = anyio.current_time()
            stopped.set()

    keeper = store.keeper(work)
    async with anyio.create_task_group() as tg:
        held = await tg.start(keeper.run)
        assert held is not None and held.fence == 1
        store.offset_s += 10.0  # an NTP step forward past the 6 s lease
        stepped = anyio.current_time()
        with anyio.fail_after(3):
            await stopped.wait()
        assert store.renews[0] is None
        assert times["stopped"] - stepped < 1.0  # next renew was due at 2 s, validity at 5.5 s
        keeper.stop(1.0)


async def test_a_wall_clock_step_back_renews_at_once_and_the_work_goes_on() -> None:
    store = WallClockLeases()

    async def work(held: HeldSlot) -> None:
        await held.stop_event.wait()
        held.check()

    keeper = store.keeper(work)
    async with anyio.create_task_group() as tg:
        held = await tg.start(keeper.run)
        assert held is not None
        store.offset_s -= 3600.0
        stepped = anyio.current_time()
        with anyio.fail_after(3):
            while not store.renews:
                await store.changed.wait()
        assert anyio.current_time() - stepped < 1.0  # not at the scheduled 2 s
        renewed = store.renews[0]
        assert renewed is not None and held.lease == renewed and held.valid
        assert keeper.held is held
        keeper.stop(1.0)
    assert len(store.renews) == 1  # one step, one re-validation: the new offset is the baseline


async def test_a_slewing_wall_clock_is_no_step() -> None:
    """Drift below the tolerance (NTP slewing, reading two clocks) triggers nothing."""
    store = WallClockLeases()

    async def work(held: HeldSlot) -> None:
        await held.stop_event.wait()

    keeper = store.keeper(work)
    async with anyio.create_task_group() as tg:
        await tg.start(keeper.run)
        store.offset_s += 0.4
        with anyio.move_on_after(0.6):  # more than two clock checks (every 0.25 s)
            await store.changed.wait()
        assert store.renews == []
        keeper.stop(1.0)


async def test_a_keeper_stopped_before_it_runs_starts_as_a_standby_and_ends() -> None:
    """A SIGTERM during the start stops the keepers before their first acquire: each still
    reports started (no slot), takes nothing, and ends, so the replica exits 0."""
    store = ScriptedLeases()

    async def work(held: HeldSlot) -> None:
        raise AssertionError("no slot is taken after a stop")

    keeper = SlotKeeper(0, settings(), store, work, owner_key="me")  # type: ignore[arg-type]
    keeper.stop(1.0)
    with anyio.fail_after(3):
        async with anyio.create_task_group() as tg:
            assert await tg.start(keeper.run) is None
    assert not store.released


async def test_a_stop_ends_a_standby_whose_acquire_hangs() -> None:
    """A SIGTERM while a standby's acquire waits on a store that does not answer: the acquire is
    given up at once (a standby has nothing to drain), so the replica exits within its grace
    rather than after the store call's timeout."""
    store = ScriptedLeases()
    store.exhausted = True

    async def work(held: HeldSlot) -> None:
        raise AssertionError("no slot is taken")

    keeper = SlotKeeper(0, settings(), store, work, owner_key="me")  # type: ignore[arg-type]
    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            assert await tg.start(keeper.run) is None
            store.acquire_hangs = True
            await store.hung.wait()
            keeper.stop(5.0)
    assert not store.released


async def test_a_full_disk_stalls_the_keeper_until_a_lease_write_succeeds() -> None:
    """Renewals refused for a full disk: the keeper is stalled at once (``wowd_timers_stalled`` of
    its slot 1), its lease lapses, its acquires are refused too and it stays stalled, alive; once
    space returns it takes the slot back by itself and is no longer stalled."""
    store = ScriptedLeases()
    fences: list[int] = []

    async def work(held: HeldSlot) -> None:
        fences.append(held.fence)
        await held.stop_event.wait()

    keeper = SlotKeeper(0, settings(), store, work, owner_key="me")  # type: ignore[arg-type]
    gauge = metrics.TIMERS_STALLED.labels(slot="1")
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(keeper.run)
            store.full = True

            async def lapsed_and_refused() -> bool:
                return keeper.held is None and store.refused >= 3

            await eventually(lapsed_and_refused, 5, "the lease lapsed, the acquires refused")
            assert keeper.stall.stalled and "database or disk is full" in (keeper.stall.reason or "")
            assert gauge._value.get() == 1
            store.full = False

            async def taken_back() -> bool:
                return keeper.held is not None

            await eventually(taken_back, 5, "the slot taken back")
            assert not keeper.stall.stalled and gauge._value.get() == 0
            keeper.stop(1.0)
    assert fences == [1, 2]
