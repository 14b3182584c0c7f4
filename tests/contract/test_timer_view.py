"""TimerView contract (docs/concepts.md): the view the feed writes, puts and cancels by key and
version, tombstones, batched writes, the parked timers a commit resumes. A replay of the log
changes nothing; a cancel is never undone by a replay."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tests.contract.conftest import CONTEXT, PARTITIONS
from wowd.model import (
    AggregateRef,
    Command,
    IntervalRule,
    OnceRule,
    Rule,
    Timer,
    TimerChange,
    TimerStatus,
    TimerWrite,
    deterministic_timer_id,
    net_writes,
    partition,
)
from wowd.stores.base import TimerFiring, TimerQueries, TimerView

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


ALL = frozenset(range(PARTITIONS))


async def claim_all(store: Any, *, fence: int = 1, until: int = T0 + 10**9, owner_key: str = "k") -> list[Timer]:
    return list(await store.claim_due(ALL, until, 1000, owner_key=owner_key, fence=fence, claim_until=T0 + 10**10))


async def fire(store: Any, t: Timer, *, fence: int = 1) -> None:
    [claimed] = [c for c in await claim_all(store, fence=fence) if c.timer_id == t.timer_id]
    assert await store.settle([TimerChange.fired(claimed, fence=fence, next_due=None)]) == 1


async def test_collection_name(timer_view: TimerView) -> None:
    assert timer_view.collection_name("order") == f"wow_timer__{CONTEXT}__order"


async def test_put_is_refused_below_the_stored_version_and_changes_nothing_at_it(
    timer_view: TimerView, timer_queries: TimerQueries
) -> None:
    ref = owner("o-1")
    assert await timer_view.put(timer(ref, version=5, due_at=T0)) is True
    # a replay of an earlier commit does not overwrite the later timer
    assert await timer_view.put(timer(ref, version=3, due_at=T0 + 1)) is False
    stored = await loaded(timer_queries, timer(ref))
    assert (stored.version, stored.due_at) == (5, T0)
    # the same version is admitted (an idempotent replay) and changes nothing
    assert await timer_view.put(timer(ref, version=5, due_at=T0 + 2)) is True
    assert (await loaded(timer_queries, timer(ref))).due_at == T0
    assert await timer_view.put(timer(ref, version=7, due_at=T0 + 3)) is True
    stored = await loaded(timer_queries, timer(ref))
    assert (stored.version, stored.due_at) == (7, T0 + 3)
    # one timer per (owner, key)
    assert len(await timer_queries.scan(limit=10)) == 1


async def test_put_distinguishes_tenants_and_aggregate_types(
    timer_view: TimerView, timer_queries: TimerQueries
) -> None:
    refs = [owner("same"), owner("same", tenant="t2"), owner("same", aggregate="cart")]
    for i, ref in enumerate(refs):
        assert await timer_view.put(timer(ref, version=1, due_at=T0 + i))
    for i, ref in enumerate(refs):
        assert (await loaded(timer_queries, timer(ref))).due_at == T0 + i


async def test_cancel_is_version_guarded(timer_view: TimerView, timer_queries: TimerQueries) -> None:
    ref = owner("o-1")
    await timer_view.put(timer(ref, version=5))
    assert await timer_view.cancel(ref, "remind", 4) is False
    assert await timer_queries.find(ref, "remind") is not None
    assert await timer_view.cancel(ref, "remind", 5) is True
    assert await timer_queries.find(ref, "remind") is None
    assert await timer_view.cancel(ref, "remind", 9) is False


async def test_cancel_all_removes_the_owners_timers_at_or_below_the_version(
    timer_view: TimerView, timer_queries: TimerQueries
) -> None:
    ref, other = owner("o-1"), owner("o-2")
    for key, version in (("a", 3), ("b", 5), ("c", 7)):
        await timer_view.put(timer(ref, key, version=version))
    await timer_view.put(timer(other, "a", version=1))
    assert await timer_view.cancel_all(ref, 5) == 2
    assert [t.key for t in await timer_queries.scan(limit=10) if t.owner == ref] == ["c"]
    assert await timer_queries.find(other, "a") is not None
    assert await timer_view.cancel_all(ref, 5) == 0


async def test_parked_many_answers_the_parked_timers_of_any_target_once_in_due_order(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
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
                await timer_view.put(t)
                assert await timer_firing.settle(
                    [TimerChange.park(await loaded(timer_queries, t), fence=1, reason="404")]
                )
                parked[target].add(t.timer_id)
    await timer_view.put(timer(owner("pending-one"), target=TARGET))  # not parked
    asked = [TARGET, other_tenant, other_context, TARGET, replace(TARGET, id="inv-9")]
    got = await timer_view.parked_many(asked)
    each = [t for target in (TARGET, other_tenant, other_context) for t in await timer_queries.parked(target)]
    assert got == sorted(each, key=lambda t: (t.due_at, t.timer_id))
    assert {t.timer_id for t in got} == parked[TARGET] | parked[other_tenant] | parked[other_context]
    assert all(t.status is TimerStatus.PARKED for t in got)
    assert await timer_view.parked_many([]) == []
    assert await timer_view.parked_many([replace(TARGET, id="inv-9")]) == []
    # resumed: no longer parked
    first = got[0]
    assert await timer_firing.settle([TimerChange.resume(first, due_at=T0)]) == 1
    assert {t.timer_id for t in await timer_view.parked_many(asked)} == {t.timer_id for t in got[1:]}


async def test_parked_many_reads_a_whole_feed_batch_of_targets(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    targets = [replace(TARGET, id=f"inv-{i}", tenant_id=f"t{i % 3}") for i in range(600)]
    want = set()
    for i in range(0, 600, 37):
        t = timer(owner(f"o-{i}"), target=targets[i], due_at=T0 + i)
        await timer_view.put(t)
        assert await timer_firing.settle([TimerChange.park(await loaded(timer_queries, t), fence=1, reason="404")])
        want.add(t.timer_id)
    got = await timer_view.parked_many(targets)
    assert {t.timer_id for t in got} == want and len(got) == len(want)


async def test_parked_many_of_one_target_answers_its_parked_timers(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    t = timer(owner("o-1"), target=TARGET)
    await timer_view.put(t)
    assert await timer_firing.settle([TimerChange.park(await loaded(timer_queries, t), fence=1, reason="404")])
    assert [p.timer_id for p in await timer_view.parked_many([TARGET])] == [t.timer_id]


async def test_a_fired_timer_is_not_put_again_by_a_replay(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    t = timer(owner("o-1"), version=3)
    assert await timer_view.put(t) is True
    await fire(timer_firing, t)
    assert await timer_queries.find(t.owner, t.key) is None
    # the replayed put (same version) and an earlier one are refused: nothing comes due again
    assert await timer_view.put(t) is False
    assert await timer_view.put(timer(t.owner, version=2)) is False
    assert await timer_firing.due(ALL, T0 + 10**9, 10) == []
    # a later version is a new timer
    assert await timer_view.put(timer(t.owner, version=4)) is True
    assert [x.version for x in await timer_firing.due(ALL, T0 + 10**9, 10)] == [4]


async def test_a_cancelled_timer_is_not_put_again_by_a_replay(
    timer_view: TimerView, timer_queries: TimerQueries
) -> None:
    ref = owner("o-1")
    await timer_view.put(timer(ref, version=2))
    assert await timer_view.cancel(ref, "remind", 5) is True
    for version in (2, 5):
        assert await timer_view.put(timer(ref, version=version)) is False
    assert await timer_queries.find(ref, "remind") is None
    assert await timer_queries.scan(limit=10) == []
    assert await timer_view.put(timer(ref, version=6)) is True


async def test_a_cancel_before_any_put_refuses_the_put_replayed_after_it(
    timer_view: TimerView, timer_firing: TimerFiring
) -> None:
    # a batch whose net effect dropped the put (put v1, cancel v2) replayed with other boundaries
    ref = owner("o-1")
    assert await timer_view.cancel(ref, "remind", 2) is False
    assert await timer_view.put(timer(ref, version=1)) is False
    assert await timer_firing.due(ALL, T0 + 10**9, 10) == []


async def test_cancel_all_leaves_tombstones_that_refuse_replayed_puts(
    timer_view: TimerView, timer_queries: TimerQueries
) -> None:
    ref = owner("o-1")
    for key, version in (("a", 1), ("b", 2)):
        await timer_view.put(timer(ref, key, version=version))
    assert await timer_view.cancel_all(ref, 3) == 2
    assert await timer_view.put(timer(ref, "a", version=1)) is False
    assert await timer_view.put(timer(ref, "b", version=2)) is False
    assert await timer_queries.scan(limit=10) == []
    assert await timer_view.cancel_all(ref, 3) == 0


async def test_a_replay_never_resets_a_claimed_failed_or_parked_timer(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    refs = [owner(f"o-{i}") for i in range(3)]
    for ref in refs:
        await timer_view.put(timer(ref, version=1))
    claimed = {c.owner: c for c in await claim_all(timer_firing, fence=2)}
    await timer_firing.settle(
        [
            TimerChange.fail(claimed[refs[1]], fence=2, reason="400"),
            TimerChange.park(claimed[refs[2]], fence=2, reason="404"),
        ]
    )
    before = [await loaded(timer_queries, timer(ref)) for ref in refs]
    for ref in refs:
        assert await timer_view.put(timer(ref, version=1)) is True
    after = [await loaded(timer_queries, timer(ref)) for ref in refs]
    assert after == before
    assert [t.status for t in after] == [TimerStatus.FIRING, TimerStatus.FAILED, TimerStatus.PARKED]


async def test_write_applies_a_batch_with_single_item_answers(
    timer_view: TimerView, timer_queries: TimerQueries
) -> None:
    a, b = owner("o-a"), owner("o-b")
    await timer_view.put(timer(b, "x", version=1))
    writes = [
        TimerWrite.put(timer(a, "k1", version=1)),
        TimerWrite.put(timer(a, "k2", version=1)),
        TimerWrite.cancel(a, "k2", 2),
        TimerWrite.cancel_all(b, 2),
        TimerWrite.put(timer(b, "y", version=3)),
        TimerWrite.cancel(a, "none", 2),
    ]
    assert await timer_view.write(writes) == [1, 1, 1, 1, 1, 0]
    assert {(t.owner.id, t.key) for t in await timer_queries.scan(limit=10)} == {("o-a", "k1"), ("o-b", "y")}
    # the same batch again (a retried batch) changes nothing and admits only the puts still live
    assert await timer_view.write(writes) == [1, 0, 0, 0, 1, 0]
    assert {(t.owner.id, t.key) for t in await timer_queries.scan(limit=10)} == {("o-a", "k1"), ("o-b", "y")}
    assert await timer_view.write([]) == []


async def test_a_retried_batch_answers_each_write_in_order_after_a_cancel(
    timer_view: TimerView, timer_queries: TimerQueries
) -> None:
    a, b = owner("o-a"), owner("o-b")
    await timer_view.put(timer(b, "x", version=1))
    writes = [
        TimerWrite.cancel(b, "x", 2),
        TimerWrite.put(timer(a, "k1", version=1)),
        TimerWrite.put(timer(a, "k2", version=1)),
        TimerWrite.cancel(a, "k2", 2),
    ]
    assert await timer_view.write(writes) == [1, 1, 1, 1]
    # again: the cancels find tombstones, the first put is stored live at its version, the
    # second is refused by its tombstone
    assert await timer_view.write(writes) == [0, 1, 0, 0]
    assert [(t.owner.id, t.key) for t in await timer_queries.scan(limit=10)] == [("o-a", "k1")]


async def test_the_net_effect_of_a_batch_is_what_the_batch_in_order_leaves(
    timer_view: TimerView, timer_queries: TimerQueries
) -> None:
    ref = owner("o-1")
    log = [
        TimerWrite.put(timer(ref, "a", version=1)),
        TimerWrite.put(timer(ref, "b", version=1)),
        TimerWrite.cancel(ref, "a", 2),
        TimerWrite.put(timer(ref, "a", version=3, due_at=T0 + 5)),
        TimerWrite.put(timer(ref, "c", version=3)),
        TimerWrite.cancel_all(ref, 4),
        TimerWrite.put(timer(ref, "d", version=5)),
    ]
    net = net_writes(log)
    assert [(w.kind, w.key, w.version) for w in net] == [
        ("cancel_all", "", 4),
        ("cancel", "a", 4),
        ("cancel", "b", 4),
        ("cancel", "c", 4),
        ("put", "d", 5),
    ]
    await timer_view.write(net)
    assert [(t.key, t.version) for t in await timer_queries.scan(limit=10)] == [("d", 5)]
    # the same log fed one write at a time (other batch boundaries) leaves the same view
    for w in log:
        await timer_view.write([w])
    assert [(t.key, t.version) for t in await timer_queries.scan(limit=10)] == [("d", 5)]


def commits_in_order(prefix: str) -> list[list[TimerWrite]]:
    """Commits (each the timer writes of one commit, in order) that write one key twice, or
    cancel every timer of their aggregate before or after a schedule."""
    o = [owner(f"{prefix}-{i}") for i in range(4)]
    return [
        [TimerWrite.put(timer(o[0], version=1, due_at=T0 + 100))],
        # cancelled and scheduled again in one command handler: the new timer is live
        [TimerWrite.cancel(o[0], "remind", 2), TimerWrite.put(timer(o[0], version=2, due_at=T0 + 5))],
        # scheduled twice in one commit: the second stays
        [
            TimerWrite.put(timer(o[1], version=1, due_at=T0 + 100)),
            TimerWrite.put(timer(o[1], version=1, due_at=T0 + 6)),
        ],
        [TimerWrite.put(timer(o[2], "a", version=1)), TimerWrite.put(timer(o[2], "b", version=1))],
        # every timer cancelled, then one scheduled: that one is live
        [TimerWrite.cancel_all(o[2], 2), TimerWrite.put(timer(o[2], "a", version=2, due_at=T0 + 7))],
        [TimerWrite.put(timer(o[3], "a", version=1))],
        # scheduled, then every timer cancelled (a deleted aggregate): none is live
        [TimerWrite.put(timer(o[3], "b", version=2)), TimerWrite.cancel_all(o[3], 2)],
    ]


def live_view(timers: list[Timer]) -> list[tuple[str, str, int, int, str]]:
    """The live timers without their owners' prefix: (owner number, key, version, due time, command)."""
    return sorted((t.owner.id.split("-")[1], t.key, t.version, t.due_at, t.body) for t in timers)


async def test_the_writes_of_one_commit_are_applied_in_order(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    """The log's commits written as one batch, or one commit a batch: the last write of a key in
    a commit stays, a cancel_all cancels what its commit wrote before it, not after it; a replay
    in either cut changes nothing."""
    one = commits_in_order("one")
    net = net_writes([w for c in one for w in c])
    answers = await timer_view.write(net)
    assert [a for w, a in zip(net, answers, strict=True) if w.kind == "put"] == [1, 1, 1]  # the live ones
    each = commits_in_order("each")
    for c in each:
        await timer_view.write(net_writes(c))
    timers = await timer_queries.scan(limit=100)
    by_prefix = {p: live_view([t for t in timers if t.owner.id.startswith(p)]) for p in ("one", "each")}
    assert by_prefix["one"] == by_prefix["each"]
    assert [(i, k, v, due) for i, k, v, due, _body in by_prefix["one"]] == [
        ("0", "remind", 2, T0 + 5),
        ("1", "remind", 1, T0 + 6),
        ("2", "a", 2, T0 + 7),
    ]
    # a replay in the other cut: nothing changes
    for c in one:
        await timer_view.write(net_writes(c))
    await timer_view.write(net_writes([w for c in each for w in c]))
    assert await timer_queries.scan(limit=100) == timers
    due = await timer_firing.due(ALL, T0 + 10**9, 10)
    assert sorted(t.due_at for t in due) == sorted([T0 + 5, T0 + 6, T0 + 7] * 2)


async def test_replaying_a_partition_from_its_start_changes_nothing(
    timer_view: TimerView, timer_firing: TimerFiring, timer_queries: TimerQueries
) -> None:
    """Fires, cancels, failures, parks and interval occurrences, then the whole log again."""
    ref = [owner(f"o-{i}") for i in range(6)]
    log = [
        TimerWrite.put(timer(ref[0], version=1)),  # fired (one-shot)
        TimerWrite.put(timer(ref[1], version=1, rule=IntervalRule(every_ms=1000))),  # fired once, recurs
        TimerWrite.put(timer(ref[2], version=1)),  # failed
        TimerWrite.put(timer(ref[3], version=1)),  # parked
        TimerWrite.put(timer(ref[4], version=1)),
        TimerWrite.cancel(ref[4], "remind", 2),  # cancelled
        TimerWrite.put(timer(ref[5], version=1)),
        TimerWrite.cancel_all(ref[5], 2),  # deleted aggregate
    ]
    for w in log:
        await timer_view.write([w])
    claimed = {c.owner: c for c in await claim_all(timer_firing, until=T0)}
    await timer_firing.settle(
        [
            TimerChange.fired(claimed[ref[0]], fence=1, next_due=None),
            TimerChange.fired(claimed[ref[1]], fence=1, next_due=T0 + 1000),
            TimerChange.fail(claimed[ref[2]], fence=1, reason="400"),
            TimerChange.park(claimed[ref[3]], fence=1, reason="404"),
        ]
    )
    view = await timer_queries.scan(limit=100)
    await timer_view.write(net_writes(log))
    for w in log:
        await timer_view.write([w])
    assert await timer_queries.scan(limit=100) == view
    assert [t.owner for t in await timer_firing.due(ALL, T0 + 10**9, 10)] == [ref[1]]
