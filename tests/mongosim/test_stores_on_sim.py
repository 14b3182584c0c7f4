"""What the simulator found in the MongoDB stores: races a wire script cannot show, each ordered
with ``failCommand`` as a real server started with test commands would order it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import anyio
import pytest
from pymongo import AsyncMongoClient

from tests.contract.test_timer_view import T0, owner, timer
from tests.mongosim import Settings, WireServer, serving
from tests.timer_stores import mongo_timers
from wowd.errors import FormatError, StorageError
from wowd.model import AggregateType
from wowd.stores.base import Ddl
from wowd.stores.mongo._common import quarantine_collection
from wowd.stores.mongo.log import MongoLog
from wowd.stores.mongo.quarantine import MongoQuarantine, counted_seq

pytestmark = pytest.mark.anyio

ALL = frozenset(range(8))


@pytest.fixture
async def server() -> AsyncIterator[WireServer]:
    with serving(Settings(noop_interval=0)) as s:
        yield s


async def test_a_claim_that_lost_a_timer_to_a_cancel_claims_the_others(server: WireServer) -> None:
    """Two timers due; the claim's settle is held back (``blockConnection`` on its ``update``)
    while a cancel of one of them lands: the settle matches the other only, and the read-back of
    the claims meets the CANCELLED tombstone at the claim's revision (the cancel raised the
    revision as the claim would have). The claim answers the other timer alone; the timer round
    does not fail on the tombstone."""
    uri = server.uri
    claimer: AsyncMongoClient[Any] = AsyncMongoClient(uri, appname="claimer")
    other: AsyncMongoClient[Any] = AsyncMongoClient(uri)
    claims = mongo_timers(claimer, "db", context="ctx", partitions=8)
    cancels = mongo_timers(other, "db", context="ctx", partitions=8)
    try:
        await claims.prepare()
        await cancels.prepare()
        t, kept = timer(owner("o-1")), timer(owner("o-2"))
        assert await cancels.view.put(t) and await cancels.view.put(kept)
        await other.admin.command(
            {
                "configureFailPoint": "failCommand",
                "mode": {"times": 1},
                "data": {"failCommands": ["update"], "appName": "claimer", "blockConnection": True, "blockTimeMS": 500},
            }
        )
        claimed: list[Any] = []

        async def claim() -> None:
            claimed.extend(
                await claims.firing.claim_due(ALL, T0 + 10, 10, owner_key="k", fence=1, claim_until=T0 + 10**9)
            )

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(claim)
                engine = server.engine

                def held() -> bool:  # the claim's settle met the fail point: it is held from now
                    with engine.changed:
                        return engine.changed.wait_for(lambda: "failCommand" not in engine.failpoints, 5)

                assert await anyio.to_thread.run_sync(held)
                assert await cancels.view.cancel(t.owner, t.key, t.version)
        assert [c.timer_id for c in claimed] == [kept.timer_id]
        assert await claims.queries.find(t.owner, t.key) is None
    finally:
        await claims.close()
        await cancels.close()
        await claimer.close()
        await other.close()


ORDER = AggregateType(context="ctx", aggregate="order")


async def test_a_quarantine_abandoned_by_a_killed_replica_does_not_stall_the_others(server: WireServer) -> None:
    """A replica of an earlier version (which draws ``seq`` with ``$inc`` on the counter inside a
    transaction) killed between that update and its commit: the server keeps the transaction, and
    its write on the counter, until the lifetime limit (60 s). A quarantine of this version holds
    nothing across commands: it draws past the last item and inserts; only its raise of the
    counter waits, for its operation timeout, and is logged. It succeeds within a second."""
    killed: AsyncMongoClient[Any] = AsyncMongoClient(server.uri)
    other: AsyncMongoClient[Any] = AsyncMongoClient(server.uri)
    quarantine = MongoQuarantine(other, "db", context="ctx", operation_timeout=timedelta(milliseconds=500))
    try:
        await quarantine.prepare()
        session = killed.start_session()
        await session.start_transaction()
        await killed["db"][quarantine_collection("ctx")].find_one_and_update(
            {"_id": "seq"}, {"$inc": {"n": 1}}, upsert=True, session=session
        )
        # the process dies here: no commit, no abort, no endSessions
        with anyio.fail_after(1):
            await quarantine.put("wowd", 1, ORDER, {"_id": "x"}, "bad")
        assert [i["raw"] for i in await quarantine.items()] == [{"_id": "x"}]
    finally:
        await quarantine.close()
        await killed.close()
        await other.close()


async def test_quarantines_at_once_take_distinct_numbers_in_the_order_they_become_visible(server: WireServer) -> None:
    """A quarantine draws its number and is then held on its insert (``blockConnection``);
    another draws the same number meanwhile and inserts first. The held one meets E11000 on
    ``seq`` and draws again, past the other's item: the listing's order is the order in which the
    items became visible, and a listing paged after the first item finds the second."""
    slow_client: AsyncMongoClient[Any] = AsyncMongoClient(server.uri, appname="slow")
    fast_client: AsyncMongoClient[Any] = AsyncMongoClient(server.uri)
    slow = MongoQuarantine(slow_client, "db", context="ctx")
    fast = MongoQuarantine(fast_client, "db", context="ctx")
    try:
        await fast.prepare()
        await fast_client.admin.command(
            {
                "configureFailPoint": "failCommand",
                "mode": {"times": 1},
                "data": {"failCommands": ["insert"], "appName": "slow", "blockConnection": True, "blockTimeMS": 300},
            }
        )
        engine = server.engine
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(slow.put, "wowd", 1, ORDER, {"_id": "held"}, "bad")

                def held() -> bool:  # the slow one drew its number and its insert is held from now
                    with engine.changed:
                        return engine.changed.wait_for(lambda: "failCommand" not in engine.failpoints, 5)

                assert await anyio.to_thread.run_sync(held)
                await fast.put("wowd", 2, ORDER, {"_id": "first"}, "bad")
                first = await fast.items()
                assert [i["raw"]["_id"] for i in first] == ["first"]
        items = await fast.items()
        assert [i["raw"]["_id"] for i in items] == ["first", "held"]
        assert [i["id"] for i in items] == [str(counted_seq(1)), str(counted_seq(2))]
        assert [i["raw"]["_id"] for i in await fast.items(after=first[0]["id"])] == ["held"]
    finally:
        await slow.close()
        await fast.close()
        await slow_client.close()
        await fast_client.close()


async def test_a_released_id_never_names_another_item(server: WireServer) -> None:
    """The highest item released, including one whose writer died before it raised the counter
    (inserted here without the raise): the next quarantine draws past it, so a stale id given to
    ``quarantine retry`` or ``release`` names nothing rather than a newer item."""
    client: AsyncMongoClient[Any] = AsyncMongoClient(server.uri)
    quarantine = MongoQuarantine(client, "db", context="ctx")
    coll = client["db"][quarantine_collection("ctx")]
    try:
        await quarantine.prepare()
        for key in ("a", "b"):
            await quarantine.put("wowd", 1, ORDER, {"_id": key}, "bad")
        assert (await coll.find_one({"_id": "seq"}) or {}).get("n") == 2
        await coll.insert_one({"_id": {"consumer": "wowd", "aggregate": "order", "key": "c"}, "seq": counted_seq(3)})
        assert await quarantine.release([str(counted_seq(2)), str(counted_seq(3))]) == 2
        await quarantine.put("wowd", 1, ORDER, {"_id": "d"}, "bad")
        items = await quarantine.items()
        assert [(i["raw"]["_id"], i["id"]) for i in items] == [("a", str(counted_seq(1))), ("d", str(counted_seq(4)))]
        # quarantined again: the stored item keeps its id and takes the new reason
        await quarantine.put("wowd", 1, ORDER, {"_id": "d"}, "again")
        [_, d] = await quarantine.items()
        assert (d["id"], d["reason"]) == (str(counted_seq(4)), "again")
    finally:
        await quarantine.close()
        await client.close()


async def test_validate_refuses_a_quarantine_without_its_unique_seq_index(server: WireServer) -> None:
    """``DDL=validate`` on a quarantine made by an earlier version (``seq`` indexed, not unique):
    the start is refused naming the missing index, since without it two quarantines could take
    one id; after an ``auto`` run it passes."""
    client: AsyncMongoClient[Any] = AsyncMongoClient(server.uri)
    coll = client["db"][quarantine_collection("ctx")]
    try:
        await coll.create_index([("quarantined_at", 1), ("seq", 1)], name="quarantined_at")
        await coll.create_index([("seq", 1)], name="seq")
        strict = MongoQuarantine(client, "db", context="ctx", ddl=Ddl.VALIDATE)
        with pytest.raises(FormatError, match="seq_unique"):
            await strict.prepare()
        await MongoQuarantine(client, "db", context="ctx").prepare()
        await strict.prepare()
    finally:
        await client.close()


async def test_a_held_slot_is_released_by_its_holder_and_taken_by_nobody_until_lifted(server: WireServer) -> None:
    """A hold (a timer view rebuild's) on the slots of a namespace: the holder's renewal still
    succeeds and answers who holds it; once released, no owner takes the slot, not even the
    holder's own key; lifted, it is taken again. Another rebuild's hold is refused."""
    from wowd.model import Owner
    from wowd.stores.mongo.leases import MongoSlotLeaseStore

    store = MongoSlotLeaseStore(server.uri, "db")
    ttl, tol = timedelta(seconds=30), timedelta(seconds=1)
    a, b = Owner(key="a"), Owner(key="b")
    try:
        got = await store.acquire("ns", a, 2, ttl, tol)
        assert got.lease is not None and got.lease.held_by is None
        states = await store.hold("ns", "rebuild-1", timedelta(seconds=30))
        assert [s.held for s in states] == [True, True]  # both slots, one of them never taken yet
        renewed = await store.renew(got.lease, ttl, tol)
        assert renewed is not None and renewed.held_by == "rebuild-1"  # still the holder's, asked to go
        assert await store.release(renewed, renewed.written_at)
        assert (await store.acquire("ns", a, 2, ttl, tol)).status == "exhausted"
        assert (await store.acquire("ns", b, 2, ttl, tol)).status == "exhausted"
        with pytest.raises(StorageError, match="held by rebuild-1"):
            await store.hold("ns", "rebuild-2", timedelta(seconds=30))
        assert await store.lift("ns", "rebuild-1") == 2
        again = await store.acquire("ns", a, 2, ttl, tol)
        assert again.acquired and again.lease is not None and again.lease.held_by is None
        assert again.lease.fence > got.lease.fence  # a new tenure: what the one before wrote is fenced
    finally:
        await store.close()


async def test_a_hold_not_renewed_lapses(server: WireServer) -> None:
    from wowd.model import Owner
    from wowd.stores.mongo.leases import MongoSlotLeaseStore

    store = MongoSlotLeaseStore(server.uri, "db")
    ttl, tol = timedelta(seconds=30), timedelta(seconds=1)
    try:
        first = await store.acquire("ns", Owner(key="a"), 1, ttl, tol)
        assert first.lease is not None and await store.release(first.lease, first.lease.written_at)
        await store.hold("ns", "rebuild-killed", timedelta(milliseconds=300))
        assert (await store.acquire("ns", Owner(key="a"), 1, ttl, tol)).status == "exhausted"
        with anyio.fail_after(5):  # the hold ends 300 ms later on the store clock
            while True:
                if (await store.acquire("ns", Owner(key="a"), 1, ttl, tol)).acquired:
                    break
                await anyio.sleep(0.05)
    finally:
        await store.close()


async def test_the_due_query_over_many_partitions_stays_within_the_planners_merge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over 200 partitions the timer store splits the due query's ``$in`` into groups the planner
    still merges in due order (``internalQueryMaxScansToExplode``); the simulator's plan check
    holds it to that: with one group of 256 it finds a sort a server would do in memory."""
    import dataclasses

    from wowd.model import partition
    from wowd.stores.mongo import timer_firing

    with serving(Settings(noop_interval=0, plan_check=True)) as server:
        client: AsyncMongoClient[Any] = AsyncMongoClient(server.uri)
        store = mongo_timers(client, "plan", context="ctx", partitions=256)
        try:
            await store.prepare()
            t = timer(owner("o-1"))
            t = dataclasses.replace(t, partition=partition(t.owner.id, 256))
            assert await store.view.put(t) is True
            every = frozenset(range(256))
            assert [d.timer_id for d in await store.firing.due(every, T0 + 1, 10)] == [t.timer_id]
            assert server.engine.plan_findings == []
            monkeypatch.setattr(timer_firing, "MAX_SCANS_TO_EXPLODE", 256)
            assert [d.timer_id for d in await store.firing.due(every, T0 + 1, 10)] == [t.timer_id]
            assert len(server.engine.plan_findings) == 1
            assert "256 index scans" in server.engine.plan_findings[0]
        finally:
            await store.close()
            await client.close()


async def test_a_read_that_does_not_follow_ends_while_commits_keep_coming(server: WireServer) -> None:
    """A producer appends every 20 ms to the one partition, so no ``getMore`` ever comes back
    empty: the read still ends, once its stream has passed what was committed when it began,
    having yielded at least that."""
    import uuid

    from wowd.model import AggregateRef, Commit, DomainEvent

    log = MongoLog(server.uri, "db", context="ctx", partitions=1, max_await=timedelta(milliseconds=500))

    def commit(i: int) -> Commit:
        ref = AggregateRef(context="ctx", aggregate="order", id=f"o-{i}")
        events = (DomainEvent(id=uuid.uuid4().hex, name="Placed", body={}),)
        return Commit(
            ref=ref, version=1, command_id=uuid.uuid4().hex, request_id=uuid.uuid4().hex, create_time=1, events=events
        )

    try:
        await log.prepare()
        await log.append_many([commit(i) for i in range(50)])
        stop = anyio.Event()
        appended = 50

        async def produce() -> None:
            nonlocal appended
            while not stop.is_set():
                await log.append(commit(appended))
                appended += 1
                with anyio.move_on_after(0.02):
                    await stop.wait()

        read: set[str] = set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            with anyio.fail_after(10):
                async for batch in log.read({0: None}, follow=False):
                    read |= {e.commit.ref.id for e in batch.entries if e.commit is not None}
            stop.set()
        # (a commit may come twice, from the scan and the stream after it: a feed's writes are idempotent)
        assert {f"o-{i}" for i in range(50)} <= read
    finally:
        await log.close()


async def test_a_claim_of_the_old_view_settled_after_a_rebuild_swap_leaves_a_newer_row_alone(
    server: WireServer,
) -> None:
    """A rebuild's replay read a cancel the feed had not applied: the shadow's document is newer
    than the claimed one, its revision moved past it in the carry-over; the claim settled after
    the swap (a late settle of the old holder) writes nothing and the cancel stands."""
    from wowd.model import TimerChange, TimerWrite
    from wowd.stores.mongo.timer_rebuild import MongoTimerRebuild
    from wowd.stores.timer_rebuild import Finished

    client: AsyncMongoClient[Any] = AsyncMongoClient(server.uri)
    store = mongo_timers(client, "rebuild", context="ctx", partitions=8)
    try:
        await store.prepare()
        t = timer(owner("o-1"), due_at=T0)
        await store.view.write([TimerWrite.put(t)])
        (claimed,) = await store.firing.claim_due(ALL, T0, 10, owner_key="a", fence=1, claim_until=T0 + 60_000)
        log = MongoLog(client, "rebuild", context="ctx", partitions=8)
        engine = MongoTimerRebuild(store.view, log, database_name="rebuild", project=lambda _e: [], aggregate=None)
        await engine.begin()
        # the replay writes the put and, in a later batch, the cancel (v2) the feed has not applied
        await engine.shadow_view.write([TimerWrite.put(t)])
        await engine.shadow_view.write([TimerWrite.cancel(t.owner, t.key, 2)])
        result = Finished()
        await engine.carry(await engine.live_names(None), result)
        await engine.swap(None)
        release = TimerChange.release(claimed, fence=1, due_at=T0, reason="changed")
        assert await store.firing.settle([release]) == 0
        (doc,) = await client["rebuild"][store.view.collection_name("order")].find({}).to_list(None)
        assert (doc["version"], doc["status"]) == (2, "CANCELLED") and doc["revision"] > claimed.revision
        assert await store.firing.claim_due(ALL, T0, 10, owner_key="a", fence=1, claim_until=T0 + 60_000) == []
    finally:
        await client.close()


async def test_the_mongodb_backend_holds_nothing_per_aggregate_type(
    server: WireServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MongoDB's side of "nothing grows with the number of types": the log, the timer view and the
    sinks of 60 aggregate types go through the backend's one client (no client, connection or
    cursor of a type's own: the descriptors of this process, the simulator's included, stay as
    they were) and the backend keeps at most ``SINKS_KEPT`` sinks."""
    import os

    from tests.contract.test_timer_view import CONTEXT
    from wowd.config import WowdSettings
    from wowd.model import AggregateRef, Commit, DomainEvent
    from wowd.stores import base
    from wowd.stores.mongo import open_mongo

    monkeypatch.setattr(base, "SINKS_KEPT", 16)
    settings = WowdSettings(
        context=CONTEXT, partitions=8, backend="mongo", sink="none", mongodb={"uri": server.uri, "database": "types"}
    )
    backend = await open_mongo(settings)
    made: list[AggregateType] = []

    class Sink:  # what a sink holds of its own: nothing (the Elasticsearch sinks share the client)
        def __init__(self, type_: AggregateType) -> None:
            made.append(type_)

        async def close(self) -> None:
            pass

    backend.sink_factory = Sink  # type: ignore[assignment]
    try:

        async def one_type(i: int) -> None:
            ref = AggregateRef(context=CONTEXT, aggregate=f"type-{i}", id=f"a-{i}")
            event = DomainEvent(id=f"e-{i}", name="Created", body={})
            commit = Commit(ref=ref, version=1, command_id="c", request_id=f"r-{i}", create_time=T0, events=(event,))
            await backend.log.append(commit)
            assert await backend.timers.put(timer(owner(f"a-{i}", aggregate=f"type-{i}")))
            backend.sink(ref.type)

        await one_type(0)
        descriptors = len(os.listdir("/proc/self/fd"))
        for i in range(1, 60):
            await one_type(i)
        assert len(os.listdir("/proc/self/fd")) <= descriptors + 2
        assert len(backend._sinks) == 16 and len(made) == 60
        due = await backend.firing.due(ALL, T0 + 1, 100)
        assert len(due) == 60  # one read over every type's collection
    finally:
        await backend.close()
