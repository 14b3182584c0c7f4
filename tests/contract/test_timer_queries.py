"""TimerQueries contract (docs/concepts.md): the operators' reads by key, target, status and
search, in due order; tombstones are invisible to every read."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.contract.test_timer_view import ALL, T0, TARGET, fire, id_in, loaded, owner, timer
from wowd.errors import InvalidInput
from wowd.model import AggregateRef, CronRule, IntervalRule, OnceRule, Rule, Timer, TimerChange, TimerStatus
from wowd.stores.base import TimerFiring, TimerQueries, TimerSearch, TimerView

pytestmark = pytest.mark.anyio


async def test_put_then_find_round_trips_every_field(timer_view: TimerView, timer_queries: TimerQueries) -> None:
    rules: list[Rule] = [
        OnceRule(),
        IntervalRule(every_ms=60_000, until=T0 + 3_600_000),
        CronRule(expression="0 9 * * 1-5", zone="Europe/Paris"),
    ]
    for i, rule in enumerate(rules):
        t = timer(owner(f"o-{i}"), f"k{i}", version=3, due_at=T0 + i, rule=rule)
        assert await timer_view.put(t) is True
        assert await timer_queries.find(t.owner, t.key) == t
    assert await timer_queries.find(owner("o-0"), "other") is None
    assert await timer_queries.find(owner("o-0", tenant="t2"), "k0") is None


async def test_parked_answers_the_parked_timers_of_a_target_in_every_partition(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    other_target = replace(TARGET, id="inv-2")
    parked_ids = set()
    for p in (0, 5, 7):
        for target in (TARGET, other_target):
            t = timer(owner(id_in(p, f"p{target.id}")), target=target)
            await timer_view.put(t)
            assert await timer_firing.settle([TimerChange.park(await loaded(timer_queries, t), fence=1, reason="404")])
            if target == TARGET:
                parked_ids.add(t.timer_id)
    await timer_view.put(timer(owner("pending-one"), target=TARGET))  # not parked
    got = await timer_queries.parked(TARGET)
    assert {t.timer_id for t in got} == parked_ids
    assert all(t.status is TimerStatus.PARKED and t.target == TARGET for t in got)
    assert await timer_queries.parked(replace(TARGET, tenant_id="t9")) == []
    # resumed: no longer parked
    first = got[0]
    assert await timer_firing.settle([TimerChange.resume(first, due_at=T0)]) == 1
    assert {t.timer_id for t in await timer_queries.parked(TARGET)} == parked_ids - {first.timer_id}


async def test_scan_filters_by_status_and_partitions_in_due_order(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    ts = [timer(owner(id_in(p, f"s{i}")), due_at=T0 + 10 - i) for i, p in enumerate((0, 1, 2, 3))]
    for t in ts:
        await timer_view.put(t)
    await timer_firing.settle([TimerChange.fail(await loaded(timer_queries, ts[0]), fence=1, reason="x")])
    assert [t.timer_id for t in await timer_queries.scan(limit=10)] == [t.timer_id for t in reversed(ts)]
    assert [t.timer_id for t in await timer_queries.scan(limit=2)] == [ts[3].timer_id, ts[2].timer_id]
    assert [t.timer_id for t in await timer_queries.scan(status=TimerStatus.FAILED)] == [ts[0].timer_id]
    assert [t.timer_id for t in await timer_queries.scan(partitions={ts[1].partition})] == [ts[1].timer_id]


async def test_search_filters_by_owner_status_target_and_due_time_and_pages_in_due_order(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    other = AggregateRef(context="billing", aggregate="invoice", id="inv-2", tenant_id="t1")
    ts = [
        timer(owner(id_in(p, f"q{i}")), due_at=T0 + 10 * i, target=other if i == 4 else TARGET)
        for i, p in enumerate((0, 1, 2, 3, 4, 5))
    ]
    second = timer(ts[0].owner, "second", due_at=T0 + 5)
    for t in [*ts, second]:
        await timer_view.put(t)
    await timer_firing.settle([TimerChange.fail(await loaded(timer_queries, ts[1]), fence=1, reason="refused")])
    await timer_firing.settle([TimerChange.park(await loaded(timer_queries, ts[3]), fence=1, reason="404")])
    await timer_firing.settle([TimerChange.park(await loaded(timer_queries, ts[4]), fence=1, reason="404")])

    def ids(found: list[Timer]) -> list[str]:
        return [t.timer_id for t in found]

    every = await timer_queries.search(TimerSearch(), 10)
    assert ids(every) == ids([ts[0], second, *ts[1:]])
    assert ids(await timer_queries.search(TimerSearch(status=TimerStatus.PENDING), 10)) == ids(
        [ts[0], second, ts[2], ts[5]]
    )
    assert ids(await timer_queries.search(TimerSearch(status=TimerStatus.FAILED), 10)) == [ts[1].timer_id]
    assert ids(await timer_queries.search(TimerSearch(target=TARGET), 10)) == ids([ts[1], ts[3]])
    assert ids(await timer_queries.search(TimerSearch(target=other, status=TimerStatus.PARKED), 10)) == [ts[4].timer_id]
    assert ids(await timer_queries.search(TimerSearch(owners=(ts[0].owner,)), 10)) == ids([ts[0], second])
    assert ids(await timer_queries.search(TimerSearch(owners=(ts[0].owner,), key="second"), 10)) == [second.timer_id]
    assert ids(await timer_queries.search(TimerSearch(due_from=T0 + 10, due_until=T0 + 30), 10)) == ids(ts[1:4])
    first = await timer_queries.search(TimerSearch(), 3)
    after = (first[-1].due_at, first[-1].timer_id)
    assert ids(first) + ids(await timer_queries.search(TimerSearch(after=after), 10)) == ids(every)
    with pytest.raises(InvalidInput) as refused:
        await timer_queries.search(TimerSearch(target=TARGET, status=TimerStatus.PENDING), 10)
    assert refused.value.field == "target"


async def test_tombstones_are_invisible_to_every_read(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    ref = owner("o-1")
    t = timer(ref, "a", version=1)
    await timer_view.put(t)
    await timer_view.put(timer(ref, "b", version=1))
    await fire(timer_firing, t)
    await timer_view.cancel(ref, "b", 1)
    await timer_view.cancel(ref, "c", 1)
    assert await timer_firing.due(ALL, T0 + 10**12, 10) == []
    assert await timer_firing.next_due(ALL, 0) is None
    assert await timer_queries.scan(limit=10) == []
    assert await timer_queries.parked(t.target) == []
    for key in "abc":
        assert await timer_queries.find(ref, key) is None


async def test_search_lists_claimed_timers_among_every_status_and_apart_by_their_own(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    ts = [timer(owner(id_in(p, f"c{i}")), due_at=T0 + i) for i, p in enumerate((0, 1, 2))]
    for t in ts:
        await timer_view.put(t)
    until = T0 + 1_000
    claim = TimerChange.claim(await loaded(timer_queries, ts[1]), owner_key="k", fence=1, until=until)
    assert await timer_firing.settle([claim]) == 1

    def ids(found: list[Timer]) -> list[str]:
        return [t.timer_id for t in found]

    # a claimed timer is due at its claim's expiry
    assert ids(await timer_queries.search(TimerSearch(), 10)) == ids([ts[0], ts[2], ts[1]])
    assert ids(await timer_queries.search(TimerSearch(status=TimerStatus.FIRING), 10)) == [ts[1].timer_id]
    assert ids(await timer_queries.search(TimerSearch(status=TimerStatus.PENDING), 10)) == ids([ts[0], ts[2]])


async def test_a_search_of_one_answers_the_first_timer_and_one_of_none_answers_nothing(
    timer_view: TimerView, timer_queries: TimerQueries
) -> None:
    ts = [timer(owner(id_in(p, f"l{i}")), due_at=T0 + 10 - i) for i, p in enumerate((0, 1, 2))]
    for t in ts:
        await timer_view.put(t)
    assert [t.timer_id for t in await timer_queries.search(TimerSearch(), 1)] == [ts[2].timer_id]
    assert await timer_queries.search(TimerSearch(), 0) == []


async def test_a_search_of_owners_of_other_contexts_only_answers_nothing(
    timer_view: TimerView, timer_queries: TimerQueries
) -> None:
    t = timer(owner("o-1"))
    await timer_view.put(t)
    elsewhere = replace(t.owner, context="elsewhere")
    assert await timer_queries.search(TimerSearch(owners=(elsewhere,)), 10) == []
    assert [f.timer_id for f in await timer_queries.search(TimerSearch(owners=(elsewhere, t.owner)), 10)] == [
        t.timer_id
    ]


async def test_a_search_combines_its_filters_and_pages_a_filtered_list(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    ts = [timer(owner(id_in(p, f"f{i}")), "park", due_at=T0 + i) for i, p in enumerate((0, 1, 2, 3))]
    other_key = timer(owner(id_in(4, "f4")), "other", due_at=T0 + 4)
    for t in [*ts, other_key]:
        await timer_view.put(t)
        assert await timer_firing.settle([TimerChange.park(await loaded(timer_queries, t), fence=1, reason="404")])

    def ids(found: list[Timer]) -> list[str]:
        return [t.timer_id for t in found]

    assert ids(await timer_queries.search(TimerSearch(key="park", target=TARGET), 10)) == ids(ts)
    window = TimerSearch(key="park", target=TARGET, due_from=T0 + 1, due_until=T0 + 4)
    first = await timer_queries.search(window, 2)
    assert ids(first) == ids(ts[1:3])
    after = replace(window, after=(first[-1].due_at, first[-1].timer_id))
    assert ids(await timer_queries.search(after, 2)) == [ts[3].timer_id]


async def test_scan_of_several_partitions_answers_the_timers_of_each_of_them(
    timer_view: TimerView, timer_queries: TimerQueries
) -> None:
    ts = [timer(owner(id_in(p, f"p{p}")), due_at=T0 + p) for p in (0, 1, 2, 3)]
    for t in ts:
        await timer_view.put(t)
    asked = {ts[1].partition, ts[3].partition}
    assert [t.timer_id for t in await timer_queries.scan(partitions=asked)] == [ts[1].timer_id, ts[3].timer_id]
