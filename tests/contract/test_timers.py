"""TimerStore contract (docs/concepts.md): every implementation passes these."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tests.contract.conftest import CONTEXT, PARTITIONS
from wowd.errors import InvalidInput
from wowd.model import (
    AggregateRef,
    Command,
    CronRule,
    IntervalRule,
    OnceRule,
    Rule,
    Timer,
    TimerChange,
    TimerStatus,
    deterministic_timer_id,
    partition,
)
from wowd.stores.base import TimerSearch

pytestmark = pytest.mark.anyio

T0 = 1_700_000_000_000
TARGET = AggregateRef(context="billing", aggregate="invoice", id="inv-1", tenant_id="t1")


def owner(id: str, aggregate: str = "order", tenant: str = "t1") -> AggregateRef:
    return AggregateRef(context=CONTEXT, aggregate=aggregate, id=id, tenant_id=tenant)


def timer(
    ref: AggregateRef,
    key: str = "remind",
    *,
    version: int = 1,
    due_at: int = T0,
    rule: Rule | None = None,
    target: AggregateRef = TARGET,
    timer_id: str | None = None,
) -> Timer:
    return Timer(
        timer_id=timer_id or deterministic_timer_id(ref, key, version),
        partition=partition(ref.id, PARTITIONS),
        owner=ref,
        key=key,
        version=version,
        due_at=due_at,
        scheduled_at=due_at,
        target=target,
        body=Command(name="Remind", body={"n": version}).to_json(),
        rule=rule or OnceRule(),
    )


def id_in(p: int, prefix: str = "agg") -> str:
    """An aggregate id whose partition is ``p``."""
    n = 0
    while partition(f"{prefix}-{n}", PARTITIONS) != p:
        n += 1
    return f"{prefix}-{n}"


async def loaded(store: Any, t: Timer) -> Timer:
    found = await store.find(t.owner, t.key)
    assert found is not None
    return found  # type: ignore[no-any-return]


async def test_collection_name(timer_store: Any) -> None:
    assert timer_store.collection_name("order") == f"wow_timer__{CONTEXT}__order"


async def test_put_then_find_round_trips_every_field(timer_store: Any) -> None:
    rules: list[Rule] = [
        OnceRule(),
        IntervalRule(every_ms=60_000, until=T0 + 3_600_000),
        CronRule(expression="0 9 * * 1-5", zone="Europe/Paris"),
    ]
    for i, rule in enumerate(rules):
        t = timer(owner(f"o-{i}"), f"k{i}", version=3, due_at=T0 + i, rule=rule)
        assert await timer_store.put(t) is True
        assert await timer_store.find(t.owner, t.key) == t
    assert await timer_store.find(owner("o-0"), "other") is None
    assert await timer_store.find(owner("o-0", tenant="t2"), "k0") is None


async def test_put_is_refused_below_the_stored_version_and_changes_nothing_at_it(timer_store: Any) -> None:
    ref = owner("o-1")
    assert await timer_store.put(timer(ref, version=5, due_at=T0)) is True
    # a replay of an earlier commit does not overwrite the later timer
    assert await timer_store.put(timer(ref, version=3, due_at=T0 + 1)) is False
    stored = await loaded(timer_store, timer(ref))
    assert (stored.version, stored.due_at) == (5, T0)
    # the same version is admitted (an idempotent replay) and changes nothing
    assert await timer_store.put(timer(ref, version=5, due_at=T0 + 2)) is True
    assert (await loaded(timer_store, timer(ref))).due_at == T0
    assert await timer_store.put(timer(ref, version=7, due_at=T0 + 3)) is True
    stored = await loaded(timer_store, timer(ref))
    assert (stored.version, stored.due_at) == (7, T0 + 3)
    # one timer per (owner, key)
    assert len(await timer_store.scan(limit=10)) == 1


async def test_put_distinguishes_tenants_and_aggregate_types(timer_store: Any) -> None:
    refs = [owner("same"), owner("same", tenant="t2"), owner("same", aggregate="cart")]
    for i, ref in enumerate(refs):
        assert await timer_store.put(timer(ref, version=1, due_at=T0 + i))
    for i, ref in enumerate(refs):
        assert (await loaded(timer_store, timer(ref))).due_at == T0 + i


async def test_cancel_is_version_guarded(timer_store: Any) -> None:
    ref = owner("o-1")
    await timer_store.put(timer(ref, version=5))
    assert await timer_store.cancel(ref, "remind", 4) is False
    assert await timer_store.find(ref, "remind") is not None
    assert await timer_store.cancel(ref, "remind", 5) is True
    assert await timer_store.find(ref, "remind") is None
    assert await timer_store.cancel(ref, "remind", 9) is False


async def test_cancel_all_removes_the_owners_timers_at_or_below_the_version(timer_store: Any) -> None:
    ref, other = owner("o-1"), owner("o-2")
    for key, version in (("a", 3), ("b", 5), ("c", 7)):
        await timer_store.put(timer(ref, key, version=version))
    await timer_store.put(timer(other, "a", version=1))
    assert await timer_store.cancel_all(ref, 5) == 2
    assert [t.key for t in await timer_store.scan(limit=10) if t.owner == ref] == ["c"]
    assert await timer_store.find(other, "a") is not None
    assert await timer_store.cancel_all(ref, 5) == 0


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
async def test_settle_writes_exactly_what_each_change_applies(timer_store: Any, kind: str) -> None:
    t = timer(owner("o-1"), rule=IntervalRule(every_ms=60_000))
    await timer_store.put(t)
    current = await loaded(timer_store, t)
    # start from a claimed (or, for resume, parked) timer with attempts and an error, as in life
    prior = (
        TimerChange.park(current, fence=3, reason="404")
        if kind == "resume"
        else TimerChange.claim(current, owner_key="host-a:1:aa", fence=3, until=T0 + 1_000)
    )
    assert await timer_store.settle([prior]) == 1
    current = await loaded(timer_store, t)
    if kind != "resume":
        assert await timer_store.settle([TimerChange.retry(current, fence=3, due_at=T0, error="e1")]) == 1
        current = await loaded(timer_store, t)
        assert await timer_store.settle([TimerChange.claim(current, owner_key="k", fence=3, until=T0 + 1)]) == 1
        current = await loaded(timer_store, t)
    change = _changes(current)[kind]
    assert await timer_store.settle([change]) == 1
    assert await timer_store.find(t.owner, t.key) == change.applied()
    if kind == "release":  # a claim never sent spends no attempt
        assert change.applied().attempts == current.attempts == 1  # type: ignore[union-attr]


async def test_settle_skips_a_change_whose_timer_moved_on_and_counts_what_it_wrote(timer_store: Any) -> None:
    a, b = timer(owner("o-a")), timer(owner("o-b"))
    await timer_store.put(a)
    await timer_store.put(b)
    a0, b0 = await loaded(timer_store, a), await loaded(timer_store, b)
    assert await timer_store.settle([TimerChange.claim(a0, owner_key="x", fence=1, until=T0 + 10)]) == 1
    # a change made against a0 (as loaded before the claim) is skipped; b's is written
    stale = TimerChange.fired(a0, fence=1, next_due=None)
    fresh = TimerChange.claim(b0, owner_key="x", fence=1, until=T0 + 10)
    assert await timer_store.settle([stale, fresh]) == 1
    stored = await loaded(timer_store, a)
    assert stored.status is TimerStatus.FIRING and stored.revision == a0.revision + 1
    assert (await loaded(timer_store, b)).status is TimerStatus.FIRING
    # the same change twice: written once
    again = TimerChange.park(await loaded(timer_store, b), fence=1, reason="r")
    assert await timer_store.settle([again]) == 1
    assert await timer_store.settle([again]) == 0
    # a put over a later version replaces the timer: a change made against the old one is skipped
    before_put = await loaded(timer_store, b)
    assert await timer_store.put(replace(b, version=2, due_at=T0 + 99)) is True
    assert await timer_store.settle([TimerChange.fail(before_put, fence=1, reason="r")]) == 0
    assert (await loaded(timer_store, b)).status is TimerStatus.PENDING
    # a cancelled timer: nothing to write
    await timer_store.cancel(a.owner, a.key, a.version)
    assert await timer_store.settle([TimerChange.fired(stored, fence=1, next_due=None)]) == 0
    assert await timer_store.settle([]) == 0


async def test_settle_deletes_a_fired_timer_without_next_occurrence(timer_store: Any) -> None:
    t = timer(owner("o-1"))
    await timer_store.put(t)
    claimed = TimerChange.claim(await loaded(timer_store, t), owner_key="x", fence=1, until=T0 + 10)
    assert await timer_store.settle([claimed]) == 1
    after = claimed.applied()
    assert after is not None
    assert await timer_store.settle([TimerChange.fired(after, fence=1, next_due=None)]) == 1
    assert await timer_store.find(t.owner, t.key) is None
    assert await timer_store.due(set(range(PARTITIONS)), T0 + 10**9, 10) == []


async def test_due_filters_orders_and_limits_across_aggregate_types(timer_store: Any) -> None:
    mine, theirs = {1, 3}, {2}
    timers: list[Timer] = []
    for p in (1, 2, 3):
        for aggregate in ("order", "cart"):
            for n, due in enumerate((T0 + 300, T0 + 100, T0 + 200, T0 + 100, T0 + 5_000)):
                ref = owner(id_in(p, f"{aggregate}{n}"), aggregate=aggregate)
                t = timer(ref, due_at=due)
                timers.append(t)
                assert await timer_store.put(t)
    until = T0 + 1_000
    expected = sorted(
        (t for t in timers if t.partition in mine and t.due_at <= until), key=lambda t: (t.due_at, t.timer_id)
    )
    assert len(expected) == 16
    got = await timer_store.due(mine, until, 100)
    assert [t.timer_id for t in got] == [t.timer_id for t in expected]
    assert got == expected  # full timers, as stored
    assert {t.owner.aggregate for t in got} == {"order", "cart"}
    # at most limit, the first ones in (due_at, timer_id) order
    assert [t.timer_id for t in await timer_store.due(mine, until, 5)] == [t.timer_id for t in expected[:5]]
    assert [t.timer_id for t in await timer_store.due(frozenset(mine), until, 1)] == [expected[0].timer_id]
    # only the given partitions; due_at <= until inclusive
    only2 = await timer_store.due(theirs, T0 + 100, 100)
    assert {t.partition for t in only2} == {2} and {t.due_at for t in only2} == {T0 + 100}
    assert len(only2) == 4
    assert await timer_store.due(set(), until, 100) == []
    assert await timer_store.due({5}, until, 100) == []


async def test_due_excludes_parked_failed_and_live_claims_and_includes_an_expired_claim(timer_store: Any) -> None:
    p = 4
    names = ("parked", "failed", "live-claim", "expired-claim", "pending")
    ts = {name: timer(owner(id_in(p, name)), due_at=T0) for name in names}
    for t in ts.values():
        await timer_store.put(t)
    now = T0 + 1_000
    cur = {name: await loaded(timer_store, t) for name, t in ts.items()}
    assert (
        await timer_store.settle(
            [
                TimerChange.park(cur["parked"], fence=1, reason="404"),
                TimerChange.fail(cur["failed"], fence=1, reason="400"),
                TimerChange.claim(cur["live-claim"], owner_key="a", fence=1, until=now + 30_000),
                TimerChange.claim(cur["expired-claim"], owner_key="dead", fence=1, until=now - 1),
            ]
        )
        == 4
    )
    due = await timer_store.due({p}, now, 100)
    # the pending one at T0, then the abandoned claim, due again at its expiry (now - 1)
    assert [t.timer_id for t in due] == [ts["pending"].timer_id, ts["expired-claim"].timer_id]
    expired = due[1]
    assert expired.status is TimerStatus.FIRING and expired.due_at == now - 1
    assert expired.claim is not None and expired.claim.owner_key == "dead"
    # and it can be claimed again from there
    again = TimerChange.claim(expired, owner_key="b", fence=2, until=now + 30_000)
    assert await timer_store.settle([again]) == 1
    assert [t.timer_id for t in await timer_store.due({p}, now, 100)] == [ts["pending"].timer_id]


async def test_parked_answers_the_parked_timers_of_a_target_in_every_partition(timer_store: Any) -> None:
    other_target = replace(TARGET, id="inv-2")
    parked_ids = set()
    for p in (0, 5, 7):
        for target in (TARGET, other_target):
            t = timer(owner(id_in(p, f"p{target.id}")), target=target)
            await timer_store.put(t)
            assert await timer_store.settle([TimerChange.park(await loaded(timer_store, t), fence=1, reason="404")])
            if target == TARGET:
                parked_ids.add(t.timer_id)
    await timer_store.put(timer(owner("pending-one"), target=TARGET))  # not parked
    got = await timer_store.parked(TARGET)
    assert {t.timer_id for t in got} == parked_ids
    assert all(t.status is TimerStatus.PARKED and t.target == TARGET for t in got)
    assert await timer_store.parked(replace(TARGET, tenant_id="t9")) == []
    # resumed: no longer parked
    first = got[0]
    assert await timer_store.settle([TimerChange.resume(first, due_at=T0)]) == 1
    assert {t.timer_id for t in await timer_store.parked(TARGET)} == parked_ids - {first.timer_id}


async def test_parked_many_answers_the_parked_timers_of_any_target_once_in_due_order(timer_store: Any) -> None:
    other_id, other_tenant = replace(TARGET, id="inv-2"), replace(TARGET, tenant_id="t2")
    other_type, other_context = replace(TARGET, aggregate="receipt"), replace(TARGET, context="shipping")
    targets = (TARGET, other_id, other_tenant, other_type, other_context)
    parked: dict[AggregateRef, set[str]] = {t: set() for t in targets}
    due = T0
    for p in (0, 3, 7):
        for aggregate in ("order", "cart"):
            for n, target in enumerate(targets):
                due -= 1  # later puts due earlier: the answer's order is not the put order
                t = timer(owner(id_in(p, f"{aggregate}{n}"), aggregate=aggregate), target=target, due_at=due)
                await timer_store.put(t)
                assert await timer_store.settle([TimerChange.park(await loaded(timer_store, t), fence=1, reason="404")])
                parked[target].add(t.timer_id)
    await timer_store.put(timer(owner("pending-one"), target=TARGET))  # not parked
    asked = [TARGET, other_tenant, other_context, TARGET, replace(TARGET, id="inv-9")]
    got = await timer_store.parked_many(asked)
    each = [t for target in (TARGET, other_tenant, other_context) for t in await timer_store.parked(target)]
    assert got == sorted(each, key=lambda t: (t.due_at, t.timer_id))
    assert {t.timer_id for t in got} == parked[TARGET] | parked[other_tenant] | parked[other_context]
    assert all(t.status is TimerStatus.PARKED for t in got)
    assert await timer_store.parked_many([]) == []
    assert await timer_store.parked_many([replace(TARGET, id="inv-9")]) == []
    # resumed: no longer parked
    first = got[0]
    assert await timer_store.settle([TimerChange.resume(first, due_at=T0)]) == 1
    assert {t.timer_id for t in await timer_store.parked_many(asked)} == {t.timer_id for t in got[1:]}


async def test_parked_many_reads_a_whole_feed_batch_of_targets(timer_store: Any) -> None:
    targets = [replace(TARGET, id=f"inv-{i}", tenant_id=f"t{i % 3}") for i in range(600)]
    want = set()
    for i in range(0, 600, 37):
        t = timer(owner(f"o-{i}"), target=targets[i], due_at=T0 + i)
        await timer_store.put(t)
        assert await timer_store.settle([TimerChange.park(await loaded(timer_store, t), fence=1, reason="404")])
        want.add(t.timer_id)
    got = await timer_store.parked_many(targets)
    assert {t.timer_id for t in got} == want and len(got) == len(want)


async def test_scan_filters_by_status_and_partitions_in_due_order(timer_store: Any) -> None:
    ts = [timer(owner(id_in(p, f"s{i}")), due_at=T0 + 10 - i) for i, p in enumerate((0, 1, 2, 3))]
    for t in ts:
        await timer_store.put(t)
    await timer_store.settle([TimerChange.fail(await loaded(timer_store, ts[0]), fence=1, reason="x")])
    assert [t.timer_id for t in await timer_store.scan(limit=10)] == [t.timer_id for t in reversed(ts)]
    assert [t.timer_id for t in await timer_store.scan(limit=2)] == [ts[3].timer_id, ts[2].timer_id]
    assert [t.timer_id for t in await timer_store.scan(status=TimerStatus.FAILED)] == [ts[0].timer_id]
    assert [t.timer_id for t in await timer_store.scan(partitions={ts[1].partition})] == [ts[1].timer_id]


async def test_search_filters_by_owner_status_target_and_due_time_and_pages_in_due_order(timer_store: Any) -> None:
    other = AggregateRef(context="billing", aggregate="invoice", id="inv-2", tenant_id="t1")
    ts = [
        timer(owner(id_in(p, f"q{i}")), due_at=T0 + 10 * i, target=other if i == 4 else TARGET)
        for i, p in enumerate((0, 1, 2, 3, 4, 5))
    ]
    second = timer(ts[0].owner, "second", due_at=T0 + 5)
    for t in [*ts, second]:
        await timer_store.put(t)
    await timer_store.settle([TimerChange.fail(await loaded(timer_store, ts[1]), fence=1, reason="refused")])
    await timer_store.settle([TimerChange.park(await loaded(timer_store, ts[3]), fence=1, reason="404")])
    await timer_store.settle([TimerChange.park(await loaded(timer_store, ts[4]), fence=1, reason="404")])

    def ids(found: list[Timer]) -> list[str]:
        return [t.timer_id for t in found]

    every = await timer_store.search(TimerSearch(), 10)
    assert ids(every) == ids([ts[0], second, *ts[1:]])
    assert ids(await timer_store.search(TimerSearch(status=TimerStatus.PENDING), 10)) == ids(
        [ts[0], second, ts[2], ts[5]]
    )
    assert ids(await timer_store.search(TimerSearch(status=TimerStatus.FAILED), 10)) == [ts[1].timer_id]
    assert ids(await timer_store.search(TimerSearch(target=TARGET), 10)) == ids([ts[1], ts[3]])
    assert ids(await timer_store.search(TimerSearch(target=other, status=TimerStatus.PARKED), 10)) == [ts[4].timer_id]
    assert ids(await timer_store.search(TimerSearch(owners=(ts[0].owner,)), 10)) == ids([ts[0], second])
    assert ids(await timer_store.search(TimerSearch(owners=(ts[0].owner,), key="second"), 10)) == [second.timer_id]
    assert ids(await timer_store.search(TimerSearch(due_from=T0 + 10, due_until=T0 + 30), 10)) == ids(ts[1:4])
    first = await timer_store.search(TimerSearch(), 3)
    after = (first[-1].due_at, first[-1].timer_id)
    assert ids(first) + ids(await timer_store.search(TimerSearch(after=after), 10)) == ids(every)
    with pytest.raises(InvalidInput) as refused:
        await timer_store.search(TimerSearch(target=TARGET, status=TimerStatus.PENDING), 10)
    assert refused.value.field == "target"
