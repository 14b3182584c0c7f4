"""TimerStore.next_due contract: the earliest due time after a bound, what the timer loop sleeps
until. Every implementation passes these (embedded always, MongoDB with WOWD_TEST_MONGODB_URI)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.contract.conftest import CONTEXT, PARTITIONS
from wowd.model import AggregateRef, Command, Timer, TimerChange, deterministic_timer_id, partition

pytestmark = pytest.mark.anyio

T0 = 1_700_000_000_000
TARGET = AggregateRef(context="billing", aggregate="invoice", id="inv-1", tenant_id="t1")
ALL = frozenset(range(PARTITIONS))


def id_in(p: int, n: int = 0) -> str:
    """The ``n``-th aggregate id (of ``agg-<i>``) whose partition is ``p``."""
    found = [f"agg-{i}" for i in range(10_000) if partition(f"agg-{i}", PARTITIONS) == p]
    return found[n]


def timer(p: int, due_at: int, *, aggregate: str = "order", n: int = 0, key: str = "k") -> Timer:
    ref = AggregateRef(context=CONTEXT, aggregate=aggregate, id=id_in(p, n), tenant_id="t1")
    return Timer(
        timer_id=deterministic_timer_id(ref, key, 1),
        partition=p,
        owner=ref,
        key=key,
        version=1,
        due_at=due_at,
        scheduled_at=due_at,
        target=TARGET,
        body=Command(name="Remind").to_json(),
    )


async def test_next_due_of_nothing_is_none(timer_store: Any) -> None:
    assert await timer_store.next_due(ALL, 0) is None
    assert await timer_store.put(timer(1, T0))
    assert await timer_store.next_due(frozenset(), 0) is None  # no partition asked
    assert await timer_store.next_due({2, 3}, 0) is None  # none in those partitions
    assert await timer_store.next_due(ALL, T0) is None  # strictly after


async def test_next_due_is_the_earliest_after_the_bound_across_types_and_partitions(timer_store: Any) -> None:
    timers = [
        timer(0, T0 + 500),
        timer(1, T0 + 300, aggregate="cart"),
        timer(2, T0 + 100),  # at or before the bound: not "next"
        timer(3, T0 + 200, aggregate="user"),
        timer(5, T0 + 250),  # a partition not asked
        timer(1, T0 + 120, n=1, key="other"),
    ]
    for t in timers:
        assert await timer_store.put(t)
    asked = {0, 1, 2, 3}
    assert await timer_store.next_due(asked, T0 + 120) == T0 + 200
    assert await timer_store.next_due(asked, T0 + 119) == T0 + 120
    assert await timer_store.next_due(asked, T0 + 200) == T0 + 300
    assert await timer_store.next_due(asked, T0 + 300) == T0 + 500
    assert await timer_store.next_due(asked, T0 + 500) is None
    assert await timer_store.next_due(ALL, T0 + 200) == T0 + 250
    assert await timer_store.next_due({1}, T0) == T0 + 120


async def test_next_due_counts_a_claim_at_its_expiry_and_skips_parked_failed_and_settled(timer_store: Any) -> None:
    claimed, parked, failed, fired = timer(0, T0 + 100), timer(1, T0 + 200), timer(2, T0 + 300), timer(3, T0 + 400)
    late = timer(4, T0 + 90_000)
    for t in (claimed, parked, failed, fired, late):
        assert await timer_store.put(t)
    assert await timer_store.next_due(ALL, T0) == T0 + 100
    changes = [
        TimerChange.claim(claimed, owner_key="me", fence=1, until=T0 + 30_000),  # FIRING until its expiry
        TimerChange.park(parked, fence=1, reason="HTTP 404"),
        TimerChange.fail(failed, fence=1, reason="HTTP 400"),
        TimerChange.fired(fired, fence=1, next_due=None),  # deleted
    ]
    assert await timer_store.settle(changes) == 4
    # the claimed timer comes due again when its claim expires (an abandoned claim)
    assert await timer_store.next_due(ALL, T0) == T0 + 30_000
    assert await timer_store.next_due(ALL, T0 + 30_000) == T0 + 90_000
    # a recurring timer's next occurrence is its next due time
    [firing] = [t for t in await timer_store.scan(limit=10) if t.timer_id == claimed.timer_id]
    assert await timer_store.settle([TimerChange.fired(firing, fence=1, next_due=T0 + 60_000)]) == 1
    assert await timer_store.next_due(ALL, T0) == T0 + 60_000
