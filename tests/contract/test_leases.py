"""SlotLeaseStore contract (docs/concepts.md): every implementation passes these.

Time-dependent tests use short ttls and wait by polling the store's own answer (its clock)
inside ``anyio.fail_after``; nothing here reads a client clock.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import anyio
import pytest

from tests.factories import eventually
from wowd.model import AcquireResult, Owner, SlotLease

pytestmark = pytest.mark.anyio

NS = "wowd.test"
LONG = timedelta(seconds=60)
SHORT = timedelta(milliseconds=200)
TOL = timedelta(0)

A, B, C = Owner(key="host-a:1:aa"), Owner(key="host-b:2:bb"), Owner(key="host-c:3:cc")


async def acquire(store: Any, owner: Owner, limit: int = 1, **kw: Any) -> AcquireResult:
    kw.setdefault("ttl", LONG)
    kw.setdefault("tolerance", TOL)
    result: AcquireResult = await store.acquire(NS, owner, limit, **kw)
    return result


async def held(store: Any, owner: Owner, limit: int = 1, **kw: Any) -> SlotLease:
    result = await acquire(store, owner, limit, **kw)
    assert result.status == "acquired", result
    assert result.lease is not None
    return result.lease


async def expired(store: Any, lease: SlotLease) -> None:
    """Waits until the store's clock is past the lease's expiry (and a zero tolerance)."""

    async def check() -> bool:
        states = {s.slot: s for s in await store.slots(lease.namespace)}
        return bool(states[lease.slot].store_now > lease.expires_at)

    await eventually(check, 5, "the store's clock past the lease's expiry", every=0.01)


# --------------------------------------------------------------------------- acquire


async def test_acquire_stamps_the_lease_on_the_store_clock(lease_store: Any) -> None:
    lease = await held(lease_store, A, limit=2, ttl=timedelta(seconds=30))
    assert lease.namespace == NS and lease.owner_key == A.key and lease.slot == 0
    assert lease.expires_at - lease.written_at == 30_000
    assert lease.ceiling == lease.expires_at
    assert lease.floor <= lease.written_at  # a fresh slot's floor is the store's now
    assert lease.incarnation >= 1 and lease.fence >= 1


async def test_acquire_is_idempotent_for_the_same_owner_key(lease_store: Any) -> None:
    first = await held(lease_store, A, limit=3)
    again = await held(lease_store, A, limit=3, preferred_slot=2)
    assert again == first  # unchanged: same slot, incarnation, fence, expiry


async def test_a_take_counts_the_whole_ttl_from_its_own_write(lease_store: Any) -> None:
    lease = await held(lease_store, A, ttl=timedelta(seconds=30))
    assert lease.store_now is None and lease.remaining_ms == 30_000


async def test_idempotent_acquire_answers_the_time_left_on_the_store_clock(lease_store: Any) -> None:
    """The lease handed back unchanged is seen at the store's now of the read: its holder
    counts what is left of it, never a fresh ttl."""
    first = await held(lease_store, A, ttl=timedelta(seconds=30))

    async def moved_on() -> bool:
        states = await lease_store.slots(NS)
        return bool(states[0].store_now >= first.written_at + 20)

    await eventually(moved_on, 5, "the store's clock 20 ms on", every=0.01)
    again = await held(lease_store, A, ttl=timedelta(seconds=30))
    assert again == first
    assert again.store_now is not None and again.store_now >= first.written_at + 20
    assert again.remaining_ms == first.expires_at - again.store_now <= 30_000 - 20


async def test_renew_counts_the_whole_ttl_from_its_own_write(lease_store: Any) -> None:
    lease = await held(lease_store, A, ttl=timedelta(seconds=30))
    renewed = await lease_store.renew(lease, timedelta(seconds=20), TOL)
    assert renewed is not None and renewed.store_now is None and renewed.remaining_ms == 20_000


async def test_slots_lists_every_slot_of_the_namespace(lease_store: Any) -> None:
    lease = await held(lease_store, A, limit=3)
    states = await lease_store.slots(NS)
    assert [s.slot for s in states] == [0, 1, 2]
    mine = states[0]
    assert mine.owner_key == A.key and mine.live and mine.fence == lease.fence
    assert mine.incarnation == lease.incarnation and mine.expires_at == lease.expires_at
    assert [s.owner_key for s in states[1:]] == [None, None]
    assert not any(s.live for s in states[1:])


async def test_slot_offset_shifts_the_range(lease_store: Any) -> None:
    a = await held(lease_store, A, limit=2, slot_offset=10)
    b = await held(lease_store, B, limit=2, slot_offset=10)
    assert {a.slot, b.slot} == {10, 11}
    assert (await acquire(lease_store, C, limit=2, slot_offset=10)).status == "exhausted"


async def test_slots_lists_the_slots_of_the_namespace_asked_and_its_range_only(lease_store: Any) -> None:
    await held(lease_store, A, limit=2, slot_offset=10)
    other = await lease_store.acquire("wowd.other", B, 1, LONG, TOL)
    assert other.status == "acquired"
    states = await lease_store.slots(NS)
    assert [(s.namespace, s.slot) for s in states] == [(NS, 10), (NS, 11)]
    assert [(s.namespace, s.slot, s.owner_key) for s in await lease_store.slots("wowd.other")] == [
        ("wowd.other", 0, B.key)
    ]


async def test_preferred_slot_is_taken_when_free(lease_store: Any) -> None:
    lease = await held(lease_store, A, limit=4, preferred_slot=2)
    assert lease.slot == 2
    # held by A: B falls back to the first free slot in slot order
    other = await held(lease_store, B, limit=4, preferred_slot=2)
    assert other.slot == 0


async def test_exhausted_when_all_slots_are_live(lease_store: Any) -> None:
    await held(lease_store, A, limit=2)
    await held(lease_store, B, limit=2)
    result = await acquire(lease_store, C, limit=2)
    assert result.status == "exhausted" and result.lease is None and not result.acquired


async def test_a_live_slot_is_never_handed_to_another_owner(lease_store: Any) -> None:
    lease = await held(lease_store, A, ttl=SHORT, tolerance=timedelta(seconds=60))
    assert (await acquire(lease_store, B, preferred_slot=0)).status == "exhausted"
    # expired by the store clock but within the tolerance: still not free for B
    await expired(lease_store, lease)
    assert (await acquire(lease_store, B, tolerance=timedelta(seconds=60))).status == "exhausted"
    state = (await lease_store.slots(NS))[0]
    assert state.owner_key == A.key and state.fence == lease.fence


async def test_concurrent_acquires_never_share_a_slot(lease_store: Any) -> None:
    owners = [Owner(key=f"racer-{i}") for i in range(8)]
    results: dict[str, AcquireResult] = {}

    async def one(owner: Owner) -> None:
        results[owner.key] = await acquire(lease_store, owner, limit=3)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for owner in owners:
                tg.start_soon(one, owner)
    won = [r.lease for r in results.values() if r.lease is not None]
    assert sorted(lease.slot for lease in won) == [0, 1, 2]
    assert sum(r.status == "exhausted" for r in results.values()) == 5
    states = await lease_store.slots(NS)
    assert {s.owner_key for s in states} == {lease.owner_key for lease in won}


async def test_expired_slot_is_taken_over_with_the_next_fence(lease_store: Any) -> None:
    old = await held(lease_store, A, ttl=SHORT)
    await expired(lease_store, old)
    new = await held(lease_store, B)
    assert new.slot == old.slot
    assert new.fence == old.fence + 1
    assert new.incarnation > old.incarnation
    # the lost owner can neither renew nor release, and does not get the slot back
    assert await lease_store.renew(old, LONG, TOL) is None
    assert await lease_store.release(old, old.floor) is False
    assert (await acquire(lease_store, A)).status == "exhausted"


async def test_refuses_a_namespace_recorded_with_another_limit_or_offset(lease_store: Any) -> None:
    await held(lease_store, A, limit=2)
    refused = await acquire(lease_store, B, limit=3)
    assert refused.status == "refused" and refused.lease is None and refused.reason
    assert (await acquire(lease_store, B, limit=2, slot_offset=1)).status == "refused"
    assert (await acquire(lease_store, B, limit=2)).status == "acquired"


# --------------------------------------------------------------------------- renew


async def test_renew_extends_a_live_lease(lease_store: Any) -> None:
    lease = await held(lease_store, A, ttl=timedelta(seconds=5))
    renewed = await lease_store.renew(lease, timedelta(seconds=30), TOL)
    assert renewed is not None
    assert (renewed.slot, renewed.fence, renewed.incarnation) == (lease.slot, lease.fence, lease.incarnation)
    assert renewed.expires_at - renewed.written_at == 30_000
    assert renewed.expires_at > lease.expires_at and renewed.ceiling == renewed.expires_at
    assert renewed.floor == lease.floor


async def test_renew_fails_after_expiry(lease_store: Any) -> None:
    lease = await held(lease_store, A, ttl=SHORT)
    await expired(lease_store, lease)
    assert await lease_store.renew(lease, LONG, TOL) is None


async def test_renew_fails_after_the_slot_changed_hands(lease_store: Any) -> None:
    lease = await held(lease_store, A, limit=1)
    assert await lease_store.release(lease, lease.floor)
    taken = await held(lease_store, B, limit=1)
    assert taken.slot == lease.slot and taken.fence == lease.fence + 1
    assert await lease_store.renew(lease, LONG, TOL) is None
    assert await lease_store.renew(taken, LONG, TOL) is not None


async def test_a_restarted_owner_gets_a_new_incarnation(lease_store: Any) -> None:
    before = await held(lease_store, A, limit=2, ttl=SHORT)
    await expired(lease_store, before)  # the first process died without renewing
    after = await held(lease_store, A, limit=2)  # same owner key, new process
    assert after.slot == before.slot
    assert after.incarnation == before.incarnation + 1
    assert after.fence == before.fence + 1  # not an idempotent re-acquire: the slot changed hands
    assert await lease_store.renew(before, LONG, TOL) is None
    assert await lease_store.release(before, before.floor) is False
    assert await lease_store.renew(after, LONG, TOL) is not None


# --------------------------------------------------------------------------- release


async def test_release_is_sticky_for_the_last_owner(lease_store: Any) -> None:
    lease = await held(lease_store, A, limit=3, preferred_slot=1)
    assert await lease_store.release(lease, lease.floor)
    state = {s.slot: s for s in await lease_store.slots(NS)}[1]
    assert state.owner_key is None and state.last_owner_key == A.key and not state.live
    again = await held(lease_store, A, limit=3)  # no preference: its last slot, not slot 0
    assert again.slot == 1
    assert again.incarnation == lease.incarnation + 1
    assert again.fence == lease.fence + 1  # a new tenure, even for the same owner key


async def test_a_released_slot_is_free_for_others(lease_store: Any) -> None:
    lease = await held(lease_store, A)
    assert await lease_store.release(lease, lease.floor)
    assert (await held(lease_store, B)).slot == lease.slot


async def test_release_twice_answers_false(lease_store: Any) -> None:
    lease = await held(lease_store, A)
    assert await lease_store.release(lease, lease.floor) is True
    assert await lease_store.release(lease, lease.floor) is False


async def test_release_stores_next_floor_for_the_next_holder(lease_store: Any) -> None:
    lease = await held(lease_store, A)
    last_issued = lease.floor + 12_345
    assert await lease_store.release(lease, last_issued)
    state = (await lease_store.slots(NS))[0]
    assert state.next_floor == last_issued + 1
    assert state.expires_at <= state.store_now  # released: over at once
    successor = await held(lease_store, B)
    assert successor.floor == last_issued + 1


async def test_release_never_lowers_next_floor_below_the_floor(lease_store: Any) -> None:
    lease = await held(lease_store, A)
    assert await lease_store.release(lease, lease.floor - 1_000)
    assert (await lease_store.slots(NS))[0].next_floor == lease.floor
    assert (await held(lease_store, B)).floor == lease.floor


async def test_takeover_floor_is_at_least_the_lost_holders_ceiling(lease_store: Any) -> None:
    old = await held(lease_store, A, ttl=SHORT)
    await expired(lease_store, old)
    new = await held(lease_store, B)
    # the lost holder may have issued up to its ceiling: the next one starts above it
    assert new.floor >= old.ceiling
