"""TimerStore contract, the view's replay rules (docs/concepts.md): tombstones, batched writes,
claims and takeovers. A replay of the log changes nothing; a cancel is never undone by a replay."""

from __future__ import annotations

from typing import Any

import pytest

from tests.contract.conftest import PARTITIONS
from tests.contract.test_timers import T0, loaded, owner, timer
from wowd.model import IntervalRule, Timer, TimerChange, TimerStatus, TimerWrite, net_writes

pytestmark = pytest.mark.anyio

ALL = frozenset(range(PARTITIONS))


async def claim_all(store: Any, *, fence: int = 1, until: int = T0 + 10**9, owner_key: str = "k") -> list[Timer]:
    return list(await store.claim_due(ALL, until, 1000, owner_key=owner_key, fence=fence, claim_until=T0 + 10**10))


async def fire(store: Any, t: Timer, *, fence: int = 1) -> None:
    [claimed] = [c for c in await claim_all(store, fence=fence) if c.timer_id == t.timer_id]
    assert await store.settle([TimerChange.fired(claimed, fence=fence, next_due=None)]) == 1


async def test_a_fired_timer_is_not_put_again_by_a_replay(timer_store: Any) -> None:
    t = timer(owner("o-1"), version=3)
    assert await timer_store.put(t) is True
    await fire(timer_store, t)
    assert await timer_store.find(t.owner, t.key) is None
    # the replayed put (same version) and an earlier one are refused: nothing comes due again
    assert await timer_store.put(t) is False
    assert await timer_store.put(timer(t.owner, version=2)) is False
    assert await timer_store.due(ALL, T0 + 10**9, 10) == []
    # a later version is a new timer
    assert await timer_store.put(timer(t.owner, version=4)) is True
    assert [x.version for x in await timer_store.due(ALL, T0 + 10**9, 10)] == [4]


async def test_a_cancelled_timer_is_not_put_again_by_a_replay(timer_store: Any) -> None:
    ref = owner("o-1")
    await timer_store.put(timer(ref, version=2))
    assert await timer_store.cancel(ref, "remind", 5) is True
    for version in (2, 5):
        assert await timer_store.put(timer(ref, version=version)) is False
    assert await timer_store.find(ref, "remind") is None
    assert await timer_store.scan(limit=10) == []
    assert await timer_store.put(timer(ref, version=6)) is True


async def test_a_cancel_before_any_put_refuses_the_put_replayed_after_it(timer_store: Any) -> None:
    # a batch whose net effect dropped the put (put v1, cancel v2) replayed with other boundaries
    ref = owner("o-1")
    assert await timer_store.cancel(ref, "remind", 2) is False
    assert await timer_store.put(timer(ref, version=1)) is False
    assert await timer_store.due(ALL, T0 + 10**9, 10) == []


async def test_cancel_all_leaves_tombstones_that_refuse_replayed_puts(timer_store: Any) -> None:
    ref = owner("o-1")
    for key, version in (("a", 1), ("b", 2)):
        await timer_store.put(timer(ref, key, version=version))
    assert await timer_store.cancel_all(ref, 3) == 2
    assert await timer_store.put(timer(ref, "a", version=1)) is False
    assert await timer_store.put(timer(ref, "b", version=2)) is False
    assert await timer_store.scan(limit=10) == []
    assert await timer_store.cancel_all(ref, 3) == 0


async def test_a_replay_never_resets_a_claimed_failed_or_parked_timer(timer_store: Any) -> None:
    refs = [owner(f"o-{i}") for i in range(3)]
    for ref in refs:
        await timer_store.put(timer(ref, version=1))
    claimed = {c.owner: c for c in await claim_all(timer_store, fence=2)}
    await timer_store.settle(
        [
            TimerChange.fail(claimed[refs[1]], fence=2, reason="400"),
            TimerChange.park(claimed[refs[2]], fence=2, reason="404"),
        ]
    )
    before = [await loaded(timer_store, timer(ref)) for ref in refs]
    for ref in refs:
        assert await timer_store.put(timer(ref, version=1)) is True
    after = [await loaded(timer_store, timer(ref)) for ref in refs]
    assert after == before
    assert [t.status for t in after] == [TimerStatus.FIRING, TimerStatus.FAILED, TimerStatus.PARKED]


async def test_tombstones_are_invisible_to_every_read(timer_store: Any) -> None:
    ref = owner("o-1")
    t = timer(ref, "a", version=1)
    await timer_store.put(t)
    await timer_store.put(timer(ref, "b", version=1))
    await fire(timer_store, t)
    await timer_store.cancel(ref, "b", 1)
    await timer_store.cancel(ref, "c", 1)
    assert await timer_store.due(ALL, T0 + 10**12, 10) == []
    assert await timer_store.next_due(ALL, 0) is None
    assert await timer_store.scan(limit=10) == []
    assert await timer_store.parked(t.target) == []
    for key in "abc":
        assert await timer_store.find(ref, key) is None


async def test_write_applies_a_batch_with_single_item_answers(timer_store: Any) -> None:
    a, b = owner("o-a"), owner("o-b")
    await timer_store.put(timer(b, "x", version=1))
    writes = [
        TimerWrite.put(timer(a, "k1", version=1)),
        TimerWrite.put(timer(a, "k2", version=1)),
        TimerWrite.cancel(a, "k2", 2),
        TimerWrite.cancel_all(b, 2),
        TimerWrite.put(timer(b, "y", version=3)),
        TimerWrite.cancel(a, "none", 2),
    ]
    assert await timer_store.write(writes) == [1, 1, 1, 1, 1, 0]
    assert {(t.owner.id, t.key) for t in await timer_store.scan(limit=10)} == {("o-a", "k1"), ("o-b", "y")}
    # the same batch again (a retried batch) changes nothing and admits only the puts still live
    assert await timer_store.write(writes) == [1, 0, 0, 0, 1, 0]
    assert {(t.owner.id, t.key) for t in await timer_store.scan(limit=10)} == {("o-a", "k1"), ("o-b", "y")}
    assert await timer_store.write([]) == []


async def test_the_net_effect_of_a_batch_is_what_the_batch_in_order_leaves(timer_store: Any) -> None:
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
    await timer_store.write(net)
    assert [(t.key, t.version) for t in await timer_store.scan(limit=10)] == [("d", 5)]
    # the same log fed one write at a time (other batch boundaries) leaves the same view
    for w in log:
        await timer_store.write([w])
    assert [(t.key, t.version) for t in await timer_store.scan(limit=10)] == [("d", 5)]


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


async def test_the_writes_of_one_commit_are_applied_in_order(timer_store: Any) -> None:
    """The log's commits written as one batch, or one commit a batch: the last write of a key in
    a commit stays, a cancel_all cancels what its commit wrote before it, not after it; a replay
    in either cut changes nothing."""
    one = commits_in_order("one")
    net = net_writes([w for c in one for w in c])
    answers = await timer_store.write(net)
    assert [a for w, a in zip(net, answers, strict=True) if w.kind == "put"] == [1, 1, 1]  # the live ones
    each = commits_in_order("each")
    for c in each:
        await timer_store.write(net_writes(c))
    timers = await timer_store.scan(limit=100)
    by_prefix = {p: live_view([t for t in timers if t.owner.id.startswith(p)]) for p in ("one", "each")}
    assert by_prefix["one"] == by_prefix["each"]
    assert [(i, k, v, due) for i, k, v, due, _body in by_prefix["one"]] == [
        ("0", "remind", 2, T0 + 5),
        ("1", "remind", 1, T0 + 6),
        ("2", "a", 2, T0 + 7),
    ]
    # a replay in the other cut: nothing changes
    for c in one:
        await timer_store.write(net_writes(c))
    await timer_store.write(net_writes([w for c in each for w in c]))
    assert await timer_store.scan(limit=100) == timers
    due = await timer_store.due(ALL, T0 + 10**9, 10)
    assert sorted(t.due_at for t in due) == sorted([T0 + 5, T0 + 6, T0 + 7] * 2)


async def test_replaying_a_partition_from_its_start_changes_nothing(timer_store: Any) -> None:
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
        await timer_store.write([w])
    claimed = {c.owner: c for c in await claim_all(timer_store, until=T0)}
    await timer_store.settle(
        [
            TimerChange.fired(claimed[ref[0]], fence=1, next_due=None),
            TimerChange.fired(claimed[ref[1]], fence=1, next_due=T0 + 1000),
            TimerChange.fail(claimed[ref[2]], fence=1, reason="400"),
            TimerChange.park(claimed[ref[3]], fence=1, reason="404"),
        ]
    )
    view = await timer_store.scan(limit=100)
    await timer_store.write(net_writes(log))
    for w in log:
        await timer_store.write([w])
    assert await timer_store.scan(limit=100) == view
    assert [t.owner for t in await timer_store.due(ALL, T0 + 10**9, 10)] == [ref[1]]


async def test_claim_due_claims_in_due_order_and_skips_excluded_ids(timer_store: Any) -> None:
    ts = [timer(owner(f"o-{i}"), version=1, due_at=T0 + i) for i in range(5)]
    for t in ts:
        await timer_store.put(t)
    first = await timer_store.claim_due(ALL, T0 + 10, 2, owner_key="k", fence=3, claim_until=T0 + 100)
    assert [t.timer_id for t in first] == [ts[0].timer_id, ts[1].timer_id]
    for t in first:
        assert t == await loaded(timer_store, t)
        assert t.status is TimerStatus.FIRING and t.claim is not None and t.claim.until == T0 + 100
    # the claims expire at T0 + 100; while they are in flight the holder excludes them
    again = await timer_store.claim_due(
        ALL, T0 + 1000, 10, owner_key="k", fence=3, claim_until=T0 + 2000, exclude={t.timer_id for t in first}
    )
    assert [t.timer_id for t in again] == [t.timer_id for t in ts[2:]]
    assert await timer_store.claim_due(ALL, T0 + 10, 10, owner_key="k", fence=3, claim_until=T0 + 3000) == []


async def test_reclaim_ends_the_claims_of_a_lower_fence_at_once(timer_store: Any) -> None:
    ts = [timer(owner(f"o-{i}"), version=1, due_at=T0 + i) for i in range(3)]
    for t in ts:
        await timer_store.put(t)
    old = await timer_store.claim_due(ALL, T0 + 1, 2, owner_key="dead", fence=4, claim_until=T0 + 10**9)
    retried = TimerChange.retry(old[1], fence=4, due_at=T0 + 1, error="503")
    assert await timer_store.settle([retried]) == 1
    mine = await timer_store.claim_due(ALL, T0 + 1, 1, owner_key="me", fence=5, claim_until=T0 + 10**9)
    assert [t.timer_id for t in mine] == [ts[1].timer_id]
    # the new holder (fence 5) ends the dead one's claim; its own claim stays
    assert await timer_store.reclaim(ALL, 5) == 1
    back = await loaded(timer_store, ts[0])
    assert (back.status, back.due_at, back.claim, back.attempts) == (TimerStatus.PENDING, T0, None, 0)
    assert back.last_error is not None and "fence 4" in back.last_error
    assert (await loaded(timer_store, ts[1])).claim == mine[0].claim
    assert [t.timer_id for t in await timer_store.due(ALL, T0 + 2, 10)] == [ts[0].timer_id, ts[2].timer_id]
    assert await timer_store.reclaim(ALL, 5) == 0


async def test_sweep_keeps_live_timers_and_the_tombstones_made_after_its_cut(timer_store: Any) -> None:
    """What every store holds; the embedded store's deletions are its own test
    (``tests/embedded/test_tombstone_sweep.py``): a store whose TTL index expires tombstones
    answers 0 to any cut."""
    ref = owner("o-1")
    await timer_store.cancel(ref, "gone", 1)
    await timer_store.put(timer(ref, "live", version=1))
    assert await timer_store.sweep(0, 100) == 0
    assert await timer_store.put(timer(ref, "gone", version=1)) is False  # the tombstone is kept
    assert await timer_store.sweep(2**62, 100) <= 1
    assert await timer_store.find(ref, "live") is not None
