"""The MongoDB log against what the published commit schema allows and what it refuses, on the
simulator: a commit whose ``partition`` is missing is read in its aggregate id's partition, one
whose ``partition`` is anything but that integer is read there (or in the range its number names)
and comes as an entry naming ``partition``, to be quarantined: none is dropped, by a re-read
from the collections or by the change stream. (A commit without ``tenant_id`` or ``partition``
is the contract suite's: the embedded log reads it the same.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from tests.helpers import tailing
from tests.mongosim import Settings, serving
from wowd.model import AggregateType, LogEntry, partition
from wowd.stores.mongo.log import MongoLog
from wowd.stores.mongo.quarantine import MongoQuarantine

pytestmark = pytest.mark.anyio

PARTITIONS = 8
QUICK = timedelta(milliseconds=50)
"""The change stream's empty ``getMore`` wait: a read at the log's head says so soon."""
ORDER = AggregateType(context="ctx", aggregate="order")


@pytest.fixture
async def log(sim_client: AsyncMongoClient[Any], request: pytest.FixtureRequest) -> AsyncIterator[MongoLog]:
    store = MongoLog(
        sim_client, f"schema_{request.node.name[:40]}", context="ctx", partitions=PARTITIONS, max_await=QUICK
    )
    try:
        await store.prepare()
        yield store
    finally:
        await store.close()


def id_in(p: int) -> str:
    return next(f"a-{i}" for i in range(1000) if partition(f"a-{i}", PARTITIONS) == p)


def doc(agg_id: str, version: int, **fields: Any) -> dict[str, Any]:
    return {
        "aggregate_id": agg_id,
        "version": version,
        "request_id": f"r-{agg_id}-{version}",
        "create_time": 1,
        "events": [],
        **fields,
    }


async def test_every_partition_the_schema_refuses_is_read_and_named_never_dropped(log: MongoLog) -> None:
    a = id_in(2)
    bad = [
        doc(a, 1, partition="2"),  # not a number: the aggregate id's partition
        doc(a, 2, partition=99),  # out of range: the aggregate id's
        doc(a, 3, partition=-1),
        doc(a, 4, partition=2.5),  # a number in range: its floor's, not an integer
        doc(a, 5, partition=5),  # another partition's: read there, its aggregate id's is 2
        doc(a, 6),  # none: the aggregate id's, and nothing wrong
        doc(a, 7, partition=2.0),  # the number 2: nothing wrong
    ]
    for d in bad:
        await log.insert_raw(ORDER, d)

    def seen(entries: list[LogEntry], version_base: int) -> dict[int, tuple[int, str | None]]:
        return {e.raw["version"] - version_base: (e.partition, e.error) for e in entries}

    def expected(version_base: int) -> dict[int, tuple[int, str | None]]:
        return {
            1: (2, "partition: is '2', not an integer in [0, 8)"),
            2: (2, "partition: is 99, not an integer in [0, 8)"),
            3: (2, "partition: is -1, not an integer in [0, 8)"),
            4: (2, "partition: is 2.5, not an integer"),
            5: (5, "partition: is 5, but the aggregate id belongs to partition 2 of 8"),
            6: (2, None),
            7: (2, None),
        }

    async with tailing(log, {0: None, 2: None, 5: None}) as tail:
        await tail.until(lambda t: t.heads > 0)  # re-read from the collections, and the change stream answered
        assert seen(tail.entries, 0) == expected(0)
        for d in bad:  # the same again, read by the change stream
            await log.insert_raw(ORDER, {**d, "version": d["version"] + 10, "request_id": d["request_id"] + "+"})
        await tail.until(lambda t: len(t.entries) == 2 * len(bad))
    entries = tail.entries
    assert seen(entries[len(bad) :], 10) == expected(10)


async def test_a_context_never_reads_another_contexts_log_as_its_own(sim_client: AsyncMongoClient[Any]) -> None:
    """Collection names join the context and the aggregate with ``__``: a context name with ``__``
    in it (or ``_`` at an end) would name another's collections (``shop__eu``'s ``order`` and
    ``shop``'s ``eu__order``: one log, one timer collection, each context firing the other's
    timers). Such a name is refused; and a context never takes a collection whose aggregate part
    could not be its own (one another deployment wrote) for one of its types, by listing or
    by stream."""
    from tests.timer_stores import mongo_timers
    from wowd.errors import ConfigError

    client = sim_client
    for bad in ("shop__eu", "shop_", "_shop"):
        with pytest.raises(ConfigError, match="cannot be told apart"):
            MongoLog(client, "ctxs", context=bad, partitions=PARTITIONS)
        with pytest.raises(ConfigError, match="cannot be told apart"):
            mongo_timers(client, "ctxs", context=bad, partitions=PARTITIONS)
    shop = MongoLog(client, "ctxs", context="shop", partitions=PARTITIONS, max_await=QUICK)
    a = id_in(1)
    await client["ctxs"]["wow_log__shop__eu__order"].insert_one({**doc(a, 1), "partition": 1})  # shop__eu's
    await shop.insert_raw(AggregateType(context="shop", aggregate="order"), {**doc(a, 1), "partition": 1})
    assert await shop.aggregate_types() == [AggregateType(context="shop", aggregate="order")]
    async with tailing(shop, {1: None}) as tail:
        await tail.until(lambda t: t.heads > 0)
        await client["ctxs"]["wow_log__shop__eu__order"].insert_one({**doc(a, 2), "partition": 1})
        await shop.insert_raw(AggregateType(context="shop", aggregate="order"), {**doc(a, 2), "partition": 1})
        await tail.until(lambda t: len(t.entries) >= 2)
    entries = tail.entries
    assert [(e.aggregate.aggregate, e.raw["version"]) for e in entries] == [("order", 1), ("order", 2)]
    await shop.close()


async def test_on_a_sharded_cluster_the_log_is_sharded_on_the_hashed_aggregate_id() -> None:
    """``ddl=auto`` on a ``mongos`` shards a log collection on ``{aggregate_id: "hashed"}``: the
    unique index ``{aggregate_id, request_id}`` starts with it, and an aggregate's commits (and
    their ``_id``, unique per shard) are on one shard. A collection an operator sharded on
    ``{partition: 1}`` cannot hold that unique index (the server refuses it, 67): the log says
    so, naming the key to use, instead of failing on the driver's error."""
    from wowd.errors import ConfigError

    with serving(Settings(shards=2, noop_interval=0.05)) as sharded:
        client: AsyncMongoClient[Any] = AsyncMongoClient(sharded.uri)
        try:
            log = MongoLog(client, "sharded", context="ctx", partitions=PARTITIONS)
            await log.prepare()
            await log.insert_raw(ORDER, doc(id_in(1), 1, partition=1))
            coll = await client.config.collections.find_one({"_id": "sharded.wow_log__ctx__order"})
            assert coll is not None and coll["key"] == {"aggregate_id": "hashed"}
            await client.admin.command("shardCollection", "sharded.wow_log__ctx__cart", key={"partition": 1})
            with pytest.raises(ConfigError, match="aggregate_id"):
                await log.insert_raw(AggregateType(context="ctx", aggregate="cart"), doc(id_in(1), 1, partition=1))
            await log.close()
        finally:
            await client.close()


async def test_a_commit_near_the_document_limit_is_quarantined_by_the_fields_that_name_it(log: MongoLog) -> None:
    """A quarantine item holds the document, its reason and the rest: with a commit near 16 MiB
    it would be over the server's limit (10334) and the commit could never be set aside. The
    item keeps the fields that name the commit and its size; the reason says where it stays."""
    big = {**doc(id_in(1), 1, partition=1), "events": "x" * (16 * 1024 * 1024 - 4096)}  # events: not a list
    await log.insert_raw(ORDER, big)
    stored = await log._db[log.collection_name("order")].find_one({"version": 1})  # as the feed reads it
    assert stored is not None
    quarantine = MongoQuarantine(log.client, log._db.name, context="ctx")
    await quarantine.prepare()
    await quarantine.put("feed", 1, ORDER, stored, "events: must be an array")
    [item] = await quarantine.items()
    assert item["raw"]["aggregate_id"] == big["aggregate_id"] and item["raw"]["version"] == 1
    assert "events" not in item["raw"] and item["raw"]["raw_bytes"] > 16 * 1024 * 1024 - 4096
    assert "too large to keep whole" in item["reason"] and "wow_log__ctx__order" in item["reason"]
