"""TimerFiring contract (docs/concepts.md): the due timers, claims under a slot's fence, settles
filtered on the timer as loaded, the takeover's reclaim, the tombstones' sweep, and the next due
time the timer loop sleeps until."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.contract.conftest import CONTEXT, PARTITIONS
from tests.contract.test_timer_view import ALL, T0, TARGET, id_in, loaded, owner, timer
from wowd.model import (
    AggregateRef,
    Command,
    IntervalRule,
    Timer,
    TimerChange,
    TimerStatus,
    deterministic_timer_id,
    partition,
)
from wowd.stores.base import TimerFiring, TimerQueries, TimerView

pytestmark = pytest.mark.anyio


async def viewed(view: TimerView, n: int) -> list[Timer]:
    """``n`` timers of the owners ``o-0``, ``o-1``, ... due at T0, T0 + 1, ..., put in the view."""
    ts = [timer(owner(f"o-{i}"), version=1, due_at=T0 + i) for i in range(n)]
    for t in ts:
        assert await view.put(t)
    return ts


def nth_id_in(p: int, n: int = 0) -> str:
    """The ``n``-th aggregate id (of ``agg-<i>``) whose partition is ``p``."""
    found = [f"agg-{i}" for i in range(10_000) if partition(f"agg-{i}", PARTITIONS) == p]
    return found[n]


def due_timer(p: int, due_at: int, *, aggregate: str = "order", n: int = 0, key: str = "k") -> Timer:
    ref = AggregateRef(context=CONTEXT, aggregate=aggregate, id=nth_id_in(p, n), tenant_id="t1")
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


def _changes(t: Timer) -> dict[str, TimerChange]:
    return {
        "claim": TimerChange.claim(t, owner_key="host-a:1:aa", fence=4, until=T0 + 30_000),
        "fired-next": TimerChange.fired(t, fence=4, next_due=T0 + 60_000),
        "fired-last": TimerChange.fired(t, fence=4, next_due=None),
        "retry": TimerChange.retry(t, fence=4, due_at=T0 + 5_000, error="503 from target"),
        "release": TimerChange.release(t, fence=4, due_at=T0 + 6_000, reason="not delivered: stopped"),
        "park": TimerChange.park(t, fence=4, reason="404: no such aggregate", at=T0 + 8_000),
        "resume": TimerChange.resume(t, due_at=T0 + 7_000),
        "fail": TimerChange.fail(t, fence=4, reason="400: bad command"),
    }


@pytest.mark.parametrize("kind", ["claim", "fired-next", "fired-last", "retry", "release", "park", "resume", "fail"])
async def test_settle_writes_exactly_what_each_change_applies(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries, kind: str
) -> None:
    t = timer(owner("o-1"), rule=IntervalRule(every_ms=60_000))
    await timer_view.put(t)
    current = await loaded(timer_queries, t)
    # start from a claimed (or, for resume, parked) timer with attempts and an error, as in life
    prior = (
        TimerChange.park(current, fence=3, reason="404")
        if kind == "resume"
        else TimerChange.claim(current, owner_key="host-a:1:aa", fence=3, until=T0 + 1_000)
    )
    assert await timer_firing.settle([prior]) == 1
    current = await loaded(timer_queries, t)
    if kind != "resume":
        assert await timer_firing.settle([TimerChange.retry(current, fence=3, due_at=T0, error="e1")]) == 1
        current = await loaded(timer_queries, t)
        assert await timer_firing.settle([TimerChange.claim(current, owner_key="k", fence=3, until=T0 + 1)]) == 1
        current = await loaded(timer_queries, t)
    change = _changes(current)[kind]
    assert await timer_firing.settle([change]) == 1
    assert await timer_queries.find(t.owner, t.key) == change.applied()
    if kind == "release":  # a claim never sent spends no attempt
        assert change.applied().attempts == current.attempts == 1  # type: ignore[union-attr]


async def test_settle_skips_a_change_whose_timer_moved_on_and_counts_what_it_wrote(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    a, b = timer(owner("o-a")), timer(owner("o-b"))
    await timer_view.put(a)
    await timer_view.put(b)
    a0, b0 = await loaded(timer_queries, a), await loaded(timer_queries, b)
    assert await timer_firing.settle([TimerChange.claim(a0, owner_key="x", fence=1, until=T0 + 10)]) == 1
    # a change made against a0 (as loaded before the claim) is skipped; b's is written
    stale = TimerChange.fired(a0, fence=1, next_due=None)
    fresh = TimerChange.claim(b0, owner_key="x", fence=1, until=T0 + 10)
    assert await timer_firing.settle([stale, fresh]) == 1
    stored = await loaded(timer_queries, a)
    assert stored.status is TimerStatus.FIRING and stored.revision == a0.revision + 1
    assert (await loaded(timer_queries, b)).status is TimerStatus.FIRING
    # the same change twice: written once
    again = TimerChange.park(await loaded(timer_queries, b), fence=1, reason="r")
    assert await timer_firing.settle([again]) == 1
    assert await timer_firing.settle([again]) == 0
    # a put over a later version replaces the timer: a change made against the old one is skipped
    before_put = await loaded(timer_queries, b)
    assert await timer_view.put(replace(b, version=2, due_at=T0 + 99)) is True
    assert await timer_firing.settle([TimerChange.fail(before_put, fence=1, reason="r")]) == 0
    assert (await loaded(timer_queries, b)).status is TimerStatus.PENDING
    # a cancelled timer: nothing to write
    await timer_view.cancel(a.owner, a.key, a.version)
    assert await timer_firing.settle([TimerChange.fired(stored, fence=1, next_due=None)]) == 0
    assert await timer_firing.settle([]) == 0


async def test_settle_deletes_a_fired_timer_without_next_occurrence(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    t = timer(owner("o-1"))
    await timer_view.put(t)
    claimed = TimerChange.claim(await loaded(timer_queries, t), owner_key="x", fence=1, until=T0 + 10)
    assert await timer_firing.settle([claimed]) == 1
    after = claimed.applied()
    assert after is not None
    assert await timer_firing.settle([TimerChange.fired(after, fence=1, next_due=None)]) == 1
    assert await timer_queries.find(t.owner, t.key) is None
    assert await timer_firing.due(set(range(PARTITIONS)), T0 + 10**9, 10) == []


async def test_due_filters_orders_and_limits_across_aggregate_types(
    timer_view: TimerView, timer_firing: TimerFiring
) -> None:
    mine, theirs = {1, 3}, {2}
    timers: list[Timer] = []
    for p in (1, 2, 3):
        for aggregate in ("order", "cart"):
            for n, due in enumerate((T0 + 300, T0 + 100, T0 + 200, T0 + 100, T0 + 5_000)):
                ref = owner(id_in(p, f"{aggregate}{n}"), aggregate=aggregate)
                t = timer(ref, due_at=due)
                timers.append(t)
                assert await timer_view.put(t)
    until = T0 + 1_000
    expected = sorted(
        (t for t in timers if t.partition in mine and t.due_at <= until), key=lambda t: (t.due_at, t.timer_id)
    )
    assert len(expected) == 16
    got = await timer_firing.due(mine, until, 100)
    assert [t.timer_id for t in got] == [t.timer_id for t in expected]
    assert got == expected  # full timers, as stored
    assert {t.owner.aggregate for t in got} == {"order", "cart"}
    # at most limit, the first ones in (due_at, timer_id) order
    assert [t.timer_id for t in await timer_firing.due(mine, until, 5)] == [t.timer_id for t in expected[:5]]
    assert [t.timer_id for t in await timer_firing.due(frozenset(mine), until, 1)] == [expected[0].timer_id]
    # only the given partitions; due_at <= until inclusive
    only2 = await timer_firing.due(theirs, T0 + 100, 100)
    assert {t.partition for t in only2} == {2} and {t.due_at for t in only2} == {T0 + 100}
    assert len(only2) == 4
    assert await timer_firing.due(set(), until, 100) == []
    assert await timer_firing.due({5}, until, 100) == []


async def test_due_excludes_parked_failed_and_live_claims_and_includes_an_expired_claim(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    p = 4
    names = ("parked", "failed", "live-claim", "expired-claim", "pending")
    ts = {name: timer(owner(id_in(p, name)), due_at=T0) for name in names}
    for t in ts.values():
        await timer_view.put(t)
    now = T0 + 1_000
    cur = {name: await loaded(timer_queries, t) for name, t in ts.items()}
    assert (
        await timer_firing.settle(
            [
                TimerChange.park(cur["parked"], fence=1, reason="404"),
                TimerChange.fail(cur["failed"], fence=1, reason="400"),
                TimerChange.claim(cur["live-claim"], owner_key="a", fence=1, until=now + 30_000),
                TimerChange.claim(cur["expired-claim"], owner_key="dead", fence=1, until=now - 1),
            ]
        )
        == 4
    )
    due = await timer_firing.due({p}, now, 100)
    # the pending one at T0, then the abandoned claim, due again at its expiry (now - 1)
    assert [t.timer_id for t in due] == [ts["pending"].timer_id, ts["expired-claim"].timer_id]
    expired = due[1]
    assert expired.status is TimerStatus.FIRING and expired.due_at == now - 1
    assert expired.claim is not None and expired.claim.owner_key == "dead"
    # and it can be claimed again from there
    again = TimerChange.claim(expired, owner_key="b", fence=2, until=now + 30_000)
    assert await timer_firing.settle([again]) == 1
    assert [t.timer_id for t in await timer_firing.due({p}, now, 100)] == [ts["pending"].timer_id]


async def test_claim_due_claims_in_due_order_and_skips_excluded_ids(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    ts = await viewed(timer_view, 5)
    first = await timer_firing.claim_due(ALL, T0 + 10, 2, owner_key="k", fence=3, claim_until=T0 + 100)
    assert [t.timer_id for t in first] == [ts[0].timer_id, ts[1].timer_id]
    for t in first:
        assert t == await loaded(timer_queries, t)
        assert t.status is TimerStatus.FIRING and t.claim is not None and t.claim.until == T0 + 100
    # the claims expire at T0 + 100; while they are in flight the holder excludes them
    again = await timer_firing.claim_due(
        ALL, T0 + 1000, 10, owner_key="k", fence=3, claim_until=T0 + 2000, exclude={t.timer_id for t in first}
    )
    assert [t.timer_id for t in again] == [t.timer_id for t in ts[2:]]
    assert await timer_firing.claim_due(ALL, T0 + 10, 10, owner_key="k", fence=3, claim_until=T0 + 3000) == []


async def test_reclaim_ends_the_claims_of_a_lower_fence_at_once(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    ts = await viewed(timer_view, 3)
    old = await timer_firing.claim_due(ALL, T0 + 1, 2, owner_key="dead", fence=4, claim_until=T0 + 10**9)
    retried = TimerChange.retry(old[1], fence=4, due_at=T0 + 1, error="503")
    assert await timer_firing.settle([retried]) == 1
    mine = await timer_firing.claim_due(ALL, T0 + 1, 1, owner_key="me", fence=5, claim_until=T0 + 10**9)
    assert [t.timer_id for t in mine] == [ts[1].timer_id]
    # the new holder (fence 5) ends the dead one's claim; its own claim stays
    assert await timer_firing.reclaim(ALL, 5) == 1
    back = await loaded(timer_queries, ts[0])
    assert (back.status, back.due_at, back.claim, back.attempts) == (TimerStatus.PENDING, T0, None, 0)
    assert back.last_error is not None and "fence 4" in back.last_error
    assert (await loaded(timer_queries, ts[1])).claim == mine[0].claim
    assert [t.timer_id for t in await timer_firing.due(ALL, T0 + 2, 10)] == [ts[0].timer_id, ts[2].timer_id]
    assert await timer_firing.reclaim(ALL, 5) == 0


async def test_sweep_keeps_live_timers_and_the_tombstones_made_after_its_cut(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    """What every store holds; the embedded store's deletions are its own test
    (``tests/embedded/test_tombstone_sweep.py``): a store whose TTL index expires tombstones
    answers 0 to any cut."""
    ref = owner("o-1")
    await timer_view.cancel(ref, "gone", 1)
    await timer_view.put(timer(ref, "live", version=1))
    assert await timer_firing.sweep(0, 100) == 0
    assert await timer_view.put(timer(ref, "gone", version=1)) is False  # the tombstone is kept
    assert await timer_firing.sweep(2**62, 100) <= 1
    assert await timer_queries.find(ref, "live") is not None


async def test_next_due_of_nothing_is_none(timer_view: TimerView, timer_firing: TimerFiring) -> None:
    assert await timer_firing.next_due(ALL, 0) is None
    assert await timer_view.put(due_timer(1, T0))
    assert await timer_firing.next_due(frozenset(), 0) is None  # no partition asked
    assert await timer_firing.next_due({2, 3}, 0) is None  # none in those partitions
    assert await timer_firing.next_due(ALL, T0) is None  # strictly after


async def test_next_due_is_the_earliest_after_the_bound_across_types_and_partitions(
    timer_view: TimerView, timer_firing: TimerFiring
) -> None:
    timers = [
        due_timer(0, T0 + 500),
        due_timer(1, T0 + 300, aggregate="cart"),
        due_timer(2, T0 + 100),  # at or before the bound: not "next"
        due_timer(3, T0 + 200, aggregate="user"),
        due_timer(5, T0 + 250),  # a partition not asked
        due_timer(1, T0 + 120, n=1, key="other"),
    ]
    for t in timers:
        assert await timer_view.put(t)
    asked = {0, 1, 2, 3}
    assert await timer_firing.next_due(asked, T0 + 120) == T0 + 200
    assert await timer_firing.next_due(asked, T0 + 119) == T0 + 120
    assert await timer_firing.next_due(asked, T0 + 200) == T0 + 300
    assert await timer_firing.next_due(asked, T0 + 300) == T0 + 500
    assert await timer_firing.next_due(asked, T0 + 500) is None
    assert await timer_firing.next_due(ALL, T0 + 200) == T0 + 250
    assert await timer_firing.next_due({1}, T0) == T0 + 120


async def test_next_due_counts_a_claim_at_its_expiry_and_skips_parked_failed_and_settled(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    claimed, parked, failed, fired = (
        due_timer(0, T0 + 100),
        due_timer(1, T0 + 200),
        due_timer(2, T0 + 300),
        due_timer(3, T0 + 400),
    )
    late = due_timer(4, T0 + 90_000)
    for t in (claimed, parked, failed, fired, late):
        assert await timer_view.put(t)
    assert await timer_firing.next_due(ALL, T0) == T0 + 100
    changes = [
        TimerChange.claim(claimed, owner_key="me", fence=1, until=T0 + 30_000),  # FIRING until its expiry
        TimerChange.park(parked, fence=1, reason="HTTP 404"),
        TimerChange.fail(failed, fence=1, reason="HTTP 400"),
        TimerChange.fired(fired, fence=1, next_due=None),  # deleted
    ]
    assert await timer_firing.settle(changes) == 4
    # the claimed timer comes due again when its claim expires (an abandoned claim)
    assert await timer_firing.next_due(ALL, T0) == T0 + 30_000
    assert await timer_firing.next_due(ALL, T0 + 30_000) == T0 + 90_000
    # a recurring timer's next occurrence is its next due time
    [firing] = [t for t in await timer_queries.scan(limit=10) if t.timer_id == claimed.timer_id]
    assert await timer_firing.settle([TimerChange.fired(firing, fence=1, next_due=T0 + 60_000)]) == 1
    assert await timer_firing.next_due(ALL, T0) == T0 + 60_000
