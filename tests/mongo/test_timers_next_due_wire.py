"""MongoTimerFiring.next_due on the wire (MockupDB): one aggregation on the registry, the exact
pipeline, and how its answer is read."""

from __future__ import annotations

from typing import Any

import pytest
from pymongo import AsyncMongoClient

from tests.mongo.conftest import Wire, server_error
from tests.mongo.timers_support import (
    CONTEXT,
    DB,
    PARTITIONS,
    REGISTRY,
    calling,
    cursor,
    registry_doc,
    registry_reloaded,
)
from tests.timer_stores import MongoTimers, mongo_timers
from wowd.errors import StorageUnavailable
from wowd.stores.mongo._common import MongoSharding
from wowd.stores.mongo.schema import timer_index_specs
from wowd.stores.mongo.timer_firing import next_due_match, next_due_pipeline

pytestmark = pytest.mark.anyio


def store_on(client: AsyncMongoClient[Any]) -> MongoTimers:
    return mongo_timers(
        client, DB, context=CONTEXT, partitions=PARTITIONS, sharding=MongoSharding.OFF, operation_timeout=None
    )


async def prepare(store: MongoTimers, wire: Wire, *aggregates: str) -> None:
    async with calling(store.prepare) as out:
        req = await wire.command("find")
        req.ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc(a) for a in aggregates]))
    assert out.error is None, out.error


def sub_pipeline(partitions: list[int], after: int) -> list[dict[str, Any]]:
    return [
        {
            "$match": {
                "partition": {"$in": partitions},
                "status": {"$in": ["PENDING", "FIRING"]},
                "due_at": {"$gt": after},
            }
        },
        {"$sort": {"due_at": 1}},
        {"$limit": 1},
        {"$project": {"_id": 0, "due_at": 1}},
    ]


async def test_next_due_is_one_aggregate_with_a_first_due_time_per_collection(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    await prepare(store, wire, "order", "cart")
    async with calling(lambda: store.firing.next_due({3, 1}, 500)) as out:
        agg = await wire.command("aggregate")
        assert agg.doc["aggregate"] == REGISTRY
        assert agg.doc["pipeline"] == [
            {"$match": {"context": CONTEXT}},
            {"$count": "registered"},
            {"$unionWith": {"coll": "wow_timer__ctx__cart", "pipeline": sub_pipeline([1, 3], 500)}},
            {"$unionWith": {"coll": "wow_timer__ctx__order", "pipeline": sub_pipeline([1, 3], 500)}},
            {"$group": {"_id": None, "registered": {"$sum": "$registered"}, "next_due": {"$min": "$due_at"}}},
        ]
        agg.ok(**cursor(f"{DB}.{REGISTRY}", [{"_id": None, "registered": 2, "next_due": 700}]))
    assert out.error is None, out.error
    assert out.value == 700


def test_next_due_sub_pipeline_is_served_by_the_partial_due_index() -> None:
    """By the manual's rules (as the due read): the predicate implies the partial filter
    (``status`` ``$in`` the index's statuses), ``partition`` ``$in`` gives point intervals on the
    first key and ``due_at`` ``$gt`` a range on the second; the sort ``{due_at: 1}`` is the key
    after the points (one scan per partition, SORT_MERGE, no blocking sort), so ``$limit: 1``
    stops after one key per partition. ``$project`` keeps one field."""
    [due] = [s for s in timer_index_specs() if s["name"] == "due"]
    keys = list(due["key"].items())
    match = next_due_match([7, 2, 2], 42)
    assert set(match["status"]["$in"]) <= set(due["partialFilterExpression"]["status"]["$in"])
    assert keys[0] == ("partition", 1) and match["partition"] == {"$in": [2, 7]}
    assert keys[1] == ("due_at", 1) and match["due_at"] == {"$gt": 42}
    assert set(match) - {k for k, _ in keys} == {"status"}
    [union] = [s["$unionWith"] for s in next_due_pipeline(CONTEXT, ["c"], {7, 2}, 42) if "$unionWith" in s]
    stages = union["pipeline"]
    assert stages[0] == {"$match": match}
    assert list(stages[1]["$sort"].items()) == keys[1:2]
    assert stages[2] == {"$limit": 1}


async def test_next_due_of_no_timer_is_none(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    await prepare(store, wire, "order")
    async with calling(lambda: store.firing.next_due({0}, 500)) as out:
        agg = await wire.command("aggregate")
        # $min over no due_at is null; the count document alone reaches the group
        agg.ok(**cursor(f"{DB}.{REGISTRY}", [{"_id": None, "registered": 1, "next_due": None}]))
    assert out.error is None, out.error
    assert out.value is None


async def test_next_due_with_no_collection_reads_the_count_alone(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    async with calling(lambda: store.firing.next_due({0, 1}, 500)) as out:
        agg = await wire.command("aggregate")
        assert agg.doc["pipeline"] == [
            {"$match": {"context": CONTEXT}},
            {"$count": "registered"},
            {"$group": {"_id": None, "registered": {"$sum": "$registered"}, "next_due": {"$min": "$due_at"}}},
        ]
        agg.ok(**cursor(f"{DB}.{REGISTRY}", []))  # $group by null emits nothing for no input
    assert out.error is None, out.error
    assert out.value is None


async def test_next_due_reloads_the_registry_when_its_count_differs(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    await prepare(store, wire, "order")
    async with calling(lambda: store.firing.next_due({0, 1}, 500)) as out:
        first = await wire.command("aggregate")
        first.ok(**cursor(f"{DB}.{REGISTRY}", [{"_id": None, "registered": 2, "next_due": 900}]))
        second = await registry_reloaded(wire)  # another replica registered cart
        second.ok(**cursor(f"{DB}.{REGISTRY}", [{"_id": None, "registered": 2, "next_due": 600}]))
    assert out.error is None, out.error
    assert out.value == 600


async def test_next_due_of_no_partition_sends_nothing() -> None:
    client: AsyncMongoClient[Any] = AsyncMongoClient("mongodb://localhost:1", connect=False)
    try:
        assert await store_on(client).firing.next_due(frozenset(), 0) is None
    finally:
        await client.close()


async def test_next_due_not_writable_primary_is_storage_unavailable(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    async with calling(lambda: store.firing.next_due({0}, 0)) as out:
        server_error(await wire.command("aggregate"), 10107, "not primary")
    assert isinstance(out.error, StorageUnavailable), out.error
    assert "timers.next_due" in str(out.error)
