"""wowd's MongoDB stores through a step-down or an election of the simulated replica set
(:meth:`~tests.mongosim.engine.Engine.step_down`): the driver's retryable writes and reads, the
server's transaction table, a change stream resumed on the new primary, and a new primary whose
majority commit point is behind for a while (SERVER-53813, 7.0)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import anyio
import pytest
from pymongo import AsyncMongoClient

from tests.contract.test_timer_view import T0, owner, timer
from tests.helpers import tailing
from tests.mongosim import Settings, WireServer, serving
from tests.mongosim.engine import StepDownTrigger
from tests.timer_stores import mongo_timers
from wowd.model import AggregateRef, AggregateType, Commit, DomainEvent, Owner, partition
from wowd.stores.base import OwnerProbe
from wowd.stores.mongo.leases import MongoSlotLeaseStore
from wowd.stores.mongo.log import MongoLog

pytestmark = pytest.mark.anyio

TTL, TOLERANCE = timedelta(seconds=10), timedelta(seconds=1)
ORDER = AggregateType(context="ctx", aggregate="order")


@pytest.fixture
def server() -> Iterator[WireServer]:
    """One simulator per test: each leaves it in another term."""
    with serving(Settings(noop_interval=0.05)) as s:
        yield s


@pytest.fixture
async def client(server: WireServer) -> AsyncIterator[AsyncMongoClient[Any]]:
    c: AsyncMongoClient[Any] = AsyncMongoClient(server.uri, w="majority", serverSelectionTimeoutMS=10_000)
    try:
        yield c
    finally:
        await c.close()


def commit(agg_id: str, version: int, *events: DomainEvent) -> Commit:
    return Commit(
        ref=AggregateRef(context="ctx", aggregate="order", id=agg_id),
        version=version,
        command_id=f"c-{version}",
        request_id=f"r-{agg_id}-{version}",
        create_time=1,
        events=events or (DomainEvent(id=f"e-{version}", name="OrderChanged", body={}),),
    )


async def test_an_acquire_whose_reply_a_step_down_lost_takes_one_slot_not_two(
    server: WireServer, client: AsyncMongoClient[Any]
) -> None:
    """The take (``findAndModify``) applied, then the member stepped down and the connection
    closed: the driver retries it on the new primary with the same ``txnNumber``, and the server
    answers the recorded result. Run again, the take's filter (a free slot) would match the next
    slot: the owner would hold two, one of them orphaned until its lease expired."""
    leases = MongoSlotLeaseStore(client, "leases")
    server.engine.step_down_on(StepDownTrigger("findAndModify", 0.15, after_apply=True, close_connection=True))
    with anyio.fail_after(10):
        result = await leases.acquire("ns", Owner(key="o"), 2, TTL, TOLERANCE)
    assert result.lease is not None and result.lease.slot == 0
    held = [s.slot for s in await leases.slots("ns") if s.owner_key == "o"]
    assert held == [0]
    assert server.engine.term == 2


async def test_a_renewal_in_an_election_is_retried_on_the_new_primary_and_keeps_the_lease(
    server: WireServer, client: AsyncMongoClient[Any]
) -> None:
    """A renewal meets the step-down (10107, ``RetryableWriteError``): the driver waits for the
    new primary and retries; the lease is renewed, not lost."""
    leases = MongoSlotLeaseStore(client, "leases")
    lease = (await leases.acquire("ns", Owner(key="o"), 1, TTL, TOLERANCE)).lease
    assert lease is not None
    server.engine.step_down(0.15)
    with anyio.fail_after(10):
        renewed = await leases.renew(lease, TTL, TOLERANCE)
    assert renewed is not None and renewed.fence == lease.fence and renewed.expires_at >= lease.expires_at
    assert server.engine.term == 2


async def test_a_claim_whose_settle_a_step_down_interrupts_is_retried_and_claims_every_timer(
    server: WireServer, client: AsyncMongoClient[Any]
) -> None:
    """The claim's settle (an unordered bulk of single-document updates: a retryable write) is
    interrupted by the step-down (11602 InterruptedDueToReplStateChange, ``RetryableWriteError``)
    before it applied: the driver retries it on the new primary and every due timer is claimed,
    none twice."""
    timers = mongo_timers(client, "timers", context="ctx", partitions=8)
    await timers.prepare()
    due = [timer(owner(f"o-{i}")) for i in range(5)]
    for t in due:
        assert await timers.view.put(t)
    server.engine.step_down_on(StepDownTrigger("update", 0.15, after_apply=False))
    with anyio.fail_after(10):
        claimed = await timers.firing.claim_due(
            set(range(8)), T0 + 10, 10, owner_key="k", fence=1, claim_until=T0 + 10**9
        )
    assert sorted(t.timer_id for t in claimed) == sorted(t.timer_id for t in due)
    assert (
        await timers.firing.claim_due(set(range(8)), T0 + 10, 10, owner_key="k", fence=1, claim_until=T0 + 10**9) == []
    )
    assert server.engine.term == 2


async def test_the_feed_reads_on_across_a_failover_losing_and_repeating_nothing(
    server: WireServer, client: AsyncMongoClient[Any]
) -> None:
    """The primary goes away (every connection closed, its cursors with it) and another is
    elected: the change stream resumes there after the last event it returned; the appends
    made across it (retried) are each read once, in order."""
    log = MongoLog(client, "feed", context="ctx", partitions=8, max_await=timedelta(milliseconds=50))
    await log.prepare()
    agg = next(f"o-{i}" for i in range(100) if partition(f"o-{i}", 8) == 3)
    async with tailing(log, {3: None}) as tail:
        await tail.until(lambda t: t.heads > 0)
        with anyio.fail_after(10):
            for v in (1, 2, 3):
                await log.append(commit(agg, v))
            server.engine.step_down(0.15, close_connections=True)
            for v in (4, 5, 6):
                await log.append(commit(agg, v))
        await tail.until(lambda t: len(t.entries) >= 6)
    seen = tail.entries
    assert [e.commit.version for e in seen if e.commit] == [1, 2, 3, 4, 5, 6]


async def test_the_log_check_after_an_election_reads_past_what_the_feed_saw(
    server: WireServer, client: AsyncMongoClient[Any]
) -> None:
    """A cancel acknowledged with ``w: majority`` and read by the feed; then an election whose
    new primary's majority commit point is still before the cancel (a 7.0 primary may serve
    majority reads from a stale commit point after an election: SERVER-53813). The log check
    at the due time reads at or after what the change stream saw (``afterClusterTime``): it
    waits for the commit point instead of answering from before the cancel, and the timer is
    held."""
    log = MongoLog(client, "gate", context="ctx", partitions=8, max_await=timedelta(milliseconds=50))
    await log.prepare()
    agg = next(f"o-{i}" for i in range(100) if partition(f"o-{i}", 8) == 2)
    ref = AggregateRef(context="ctx", aggregate="order", id=agg)
    await log.append(commit(agg, 1))
    engine = server.engine

    def wait_for_the_election() -> bool:
        with engine.changed:
            return engine.changed.wait_for(lambda: engine.writable, 5)

    async with tailing(log, {2: None}) as tail:
        await tail.until(lambda t: t.heads > 0)  # the change stream is open: it reads the cancel
        before = engine.ct
        await log.append(commit(agg, 2, DomainEvent(id="x", name="TimerCancelled", body={"key": "k"})))
        await tail.until(lambda t: len(t.entries) >= 2)
        engine.step_down(0.05, majority_at=before, majority_for=0.3)
        with anyio.fail_after(10):
            assert await anyio.to_thread.run_sync(wait_for_the_election)
            found = await log.committed_after([OwnerProbe(ref, 1, "k")])
    assert found == {0}


async def test_an_outbox_take_whose_lease_a_failover_cut_off_still_hands_its_entries_over(
    server: WireServer, client: AsyncMongoClient[Any]
) -> None:
    """The take's lease applied, then the member stepped down and the connection closed: the
    lease is a retryable write (one statement per entry), retried on the new primary and
    answered from the server's record; the take returns its entries instead of failing and
    leaving them leased to nobody for the lease's length."""
    from wowd.model import OutboxEntry
    from wowd.stores.mongo.outbox import MongoOutbox

    outbox = MongoOutbox(client, "outbox", context="ctx")
    await outbox.prepare()
    target = AggregateRef(context="ctx", aggregate="order", id="o")
    for i in range(3):
        entry = OutboxEntry(request_id=f"r-{i}", timer_id=f"t-{i}", target=target, command="{}", scheduled_at=i,
                            fence=1, owner_key="k", created_at=i)  # fmt: skip
        assert await outbox.put(entry)
    server.engine.step_down_on(StepDownTrigger("update", 0.15, after_apply=True, close_connection=True))
    with anyio.fail_after(10):
        batch = await outbox.take(10)
    assert [e.request_id for e in batch.entries] == ["r-0", "r-1", "r-2"]
