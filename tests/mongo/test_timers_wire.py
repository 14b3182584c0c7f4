"""The MongoDB timer stores (the view, firing, the queries) on the wire (MockupDB): the exact
commands they send and how they read answers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import bson
import pytest
from bson import ObjectId
from bson.min_key import MinKey
from bson.timestamp import Timestamp
from pymongo import AsyncMongoClient

from tests.mongo.conftest import Wire, server_error, write_concern_timeout
from tests.mongo.timers_support import (
    CONTEXT,
    DB,
    PARTITIONS,
    REGISTRY,
    answer_first_use,
    answer_update,
    calling,
    cursor,
    dup_key_error,
    key_doc,
    make_timer,
    matches,
    ref,
    registry_doc,
    registry_reloaded,
    tombstone,
)
from tests.timer_stores import MongoTimers, mongo_timers
from wowd import metrics
from wowd.errors import FormatError, InvalidInput, StorageUnavailable
from wowd.model import CronRule, Timer, TimerChange, TimerStatus
from wowd.stores.base import Ddl
from wowd.stores.mongo._common import MongoSharding, split_to_fit
from wowd.stores.mongo.schema import timer_index_specs
from wowd.stores.mongo.timer_docs import timer_to_doc, tombstone_update, union_batch_size, union_pipeline
from wowd.stores.mongo.timer_firing import due_match, settle_filter
from wowd.stores.mongo.timer_queries import timer_from_doc
from wowd.stores.mongo.timer_view import parked_many_match, put_filter

pytestmark = pytest.mark.anyio


def store_on(client: AsyncMongoClient[Any], **kwargs: Any) -> MongoTimers:
    options: dict[str, Any] = {"sharding": MongoSharding.OFF, "operation_timeout": None}
    options.update(kwargs)
    return mongo_timers(client, DB, context=CONTEXT, partitions=PARTITIONS, **options)


async def prepare(store: MongoTimers, wire: Wire, *aggregates: str) -> None:
    """``prepare`` reading a registry that records ``aggregates`` (format 6)."""
    async with calling(store.prepare) as out:
        req = await wire.command("find")
        assert req.doc["find"] == REGISTRY
        assert req.doc["filter"] == {"context": CONTEXT}
        req.ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc(a) for a in aggregates]))
    assert out.error is None, out.error


async def first_put(store: MongoTimers, wire: Wire, aggregate: str = "order") -> None:
    async with calling(lambda: store.view.put(make_timer(aggregate=aggregate))) as out:
        await answer_first_use(wire, aggregate)
        await answer_update(wire)
    assert out.value is True, out.error


@pytest.fixture
async def idle_client() -> AsyncIterator[AsyncMongoClient[Any]]:
    """A client that never connects, for calls refused before any I/O (no MockupDB to race)."""
    client: AsyncMongoClient[Any] = AsyncMongoClient("mongodb://localhost:1", connect=False)
    try:
        yield client
    finally:
        await client.close()


def stored(timer: Timer, *, aggregate: str | None = None) -> dict[str, Any]:
    """A timer document as the union read answers it (``owner.aggregate`` set by the pipeline)."""
    doc = timer_to_doc(timer)
    doc["owner"]["aggregate"] = aggregate or timer.owner.aggregate
    return doc


# --------------------------------------------------------------------------- names, documents, DDL


async def test_collection_name_follows_the_log_rule(idle_client: AsyncMongoClient[Any]) -> None:
    store = mongo_timers(idle_client, DB, context=CONTEXT, partitions=PARTITIONS)
    assert store.view.collection_name("order") == "wow_timer__ctx__order"
    with pytest.raises(ValueError):
        store.view.collection_name("Bad.Name")


def test_timer_document_round_trip_keeps_every_field() -> None:
    from wowd.model import Claim

    t = replace(
        make_timer(),
        rule=CronRule(expression="*/5 * * * *", zone="Europe/Paris"),
        status=TimerStatus.FIRING,
        claim=Claim(owner_key="host:1", fence=7, until=9_000),
        last_error="503",
        attempts=2,
        fired=3,
        revision=4,
    )
    doc = timer_to_doc(t)
    assert doc["owner"] == {"tenant_id": "(0)", "id": "order-1"}
    assert doc["rule"] == {"type": "cron", "expression": "*/5 * * * *", "zone": "Europe/Paris"}
    assert doc["body"] == t.body and isinstance(doc["due_at"], int)
    assert doc["claim"] == {"owner_key": "host:1", "fence": 7, "until": 9_000}
    assert timer_from_doc(doc, context=CONTEXT, aggregate="order") == t
    pending = timer_to_doc(make_timer())
    assert "claim" not in pending and "last_error" not in pending


def test_index_specs() -> None:
    specs = {s["name"]: s for s in timer_index_specs()}
    unique = specs["partition_owner_key"]
    assert list(unique["key"].items()) == [
        ("partition", 1),
        ("owner.tenant_id", 1),
        ("owner.id", 1),
        ("key", 1),
    ]
    assert unique["unique"] is True
    due = specs["due"]
    assert list(due["key"].items()) == [("partition", 1), ("due_at", 1), ("timer_id", 1)]
    assert due["partialFilterExpression"] == {"status": {"$in": ["PENDING", "FIRING"]}}
    assert "unique" not in due
    parked = specs["parked_target"]
    assert parked["partialFilterExpression"] == {"status": "PARKED"}


async def test_first_put_registers_creates_indexes_then_upserts(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    timer = make_timer()
    async with calling(lambda: store.view.put(timer)) as out:
        fam = await wire.command("findAndModify")
        assert fam.doc["findAndModify"] == REGISTRY
        assert fam.doc["query"] == {"_id": "wow_timer__ctx__order"}
        assert fam.doc["upsert"] is True and fam.doc["new"] is True
        insert = fam.doc["update"]["$setOnInsert"]
        assert {k: insert[k] for k in ("context", "aggregate", "format")} == {
            "context": CONTEXT,
            "aggregate": "order",
            "format": 6,
        }
        assert isinstance(insert["created_at"], int)
        fam.ok(value=registry_doc("order"), lastErrorObject={"n": 1, "updatedExisting": False})
        create = await wire.command("create")
        assert create.doc["create"] == "wow_timer__ctx__order"
        create.ok()  # 7.0+: ok on an existing collection of the same options (another replica made it)
        ci = await wire.command("createIndexes")
        assert ci.doc["createIndexes"] == "wow_timer__ctx__order"
        assert [dict(i) for i in ci.doc["indexes"]] == timer_index_specs()
        assert [list(i["key"]) for i in ci.doc["indexes"]] == [list(s["key"]) for s in timer_index_specs()]
        ci.ok()
        update = await answer_update(wire)
    assert out.error is None and out.value is True
    [op] = update["updates"]
    assert update["update"] == "wow_timer__ctx__order"
    assert op["q"] == put_filter(timer)
    assert op["q"]["partition"] == timer.partition  # the shard key is in every filter by owner
    assert op["upsert"] is True and not op.get("multi", False)
    [stage] = op["u"]
    same, kept, replaced = stage["$replaceWith"]["$cond"]
    assert (same, kept) == ({"$eq": ["$version", timer.version]}, "$$ROOT")  # a replay changes nothing
    merged = replaced["$mergeObjects"]
    assert merged[0] == {"_id": "$_id"}
    literal = timer_to_doc(timer)
    del literal["revision"]
    assert merged[1] == {"$literal": literal}

    # the type is known now: the next put is the upsert alone
    async with calling(lambda: store.view.put(make_timer(version=6))) as out2:
        await answer_update(wire, upserted=False)
    assert out2.value is True


async def test_put_refused_on_another_format(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    async with calling(lambda: store.view.put(make_timer())) as out:
        await answer_first_use(wire, "order", fmt=4)
    assert isinstance(out.error, FormatError)
    assert "format 4" in str(out.error)


async def test_first_put_drops_and_rebuilds_another_format_when_told(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client, drop_other_format=True)
    async with calling(lambda: store.view.put(make_timer())) as out:
        (await wire.command("findAndModify")).ok(value=registry_doc("order", fmt=4))
        drop = await wire.command("drop")
        assert drop.doc["drop"] == "wow_timer__ctx__order"
        drop.ok()
        delete = await wire.command("delete")
        assert delete.doc["deletes"][0]["q"] == {"_id": "wow_timer__ctx__order", "format": 4}
        delete.ok(n=1)
        await answer_first_use(wire, "order")  # registered anew at format 6, created, indexed
        await answer_update(wire)
    assert out.error is None and out.value is True


async def test_ddl_validate_checks_registry_and_indexes_and_creates_nothing(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client, ddl=Ddl.VALIDATE)
    async with calling(lambda: store.view.put(make_timer())) as out:
        reg = await wire.command("find")
        assert reg.doc["find"] == REGISTRY and reg.doc["filter"] == {"_id": "wow_timer__ctx__order"}
        reg.ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order")]))
        li = await wire.command("listIndexes")
        assert li.doc["listIndexes"] == "wow_timer__ctx__order"
        li.ok(
            **cursor(f"{DB}.wow_timer__ctx__order", [{"v": 2, "key": {"_id": 1}, "name": "_id_"}, *timer_index_specs()])
        )
        await answer_update(wire)
    assert out.error is None and out.value is True

    other = store_on(mongo_client, ddl=Ddl.VALIDATE)
    async with calling(lambda: other.view.put(make_timer())) as refused:
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order")]))
        (await wire.command("listIndexes")).ok(
            **cursor(
                f"{DB}.wow_timer__ctx__order",
                [{"v": 2, "key": {"_id": 1}, "name": "_id_"}, *timer_index_specs()[:1]],
            )
        )
    assert isinstance(refused.error, FormatError) and "due" in str(refused.error)


async def test_ddl_none_refuses_a_new_type_whose_collection_has_no_indexes(mongo_client: Any, wire: Wire) -> None:
    """``ddl=none`` creates nothing: a new aggregate type's collection must exist with its
    indexes before its first put, or the put would create it bare (no unique key: a replayed
    older put makes a second live timer of a key, delivered twice; no due index; no TTL). The
    indexes are looked at first (``listIndexes``; a missing collection answers 26 on 7.0): the
    put is refused naming the setting, and nothing is registered or written. With the indexes
    there (an administrator made them), the type registers and the put is its upsert."""
    store = store_on(mongo_client, ddl=Ddl.NONE)
    async with calling(lambda: store.view.put(make_timer())) as out:
        server_error(await wire.command("listIndexes"), 26, "ns does not exist: wowd.wow_timer__ctx__order")
    assert isinstance(out.error, FormatError), out.error
    assert "does not exist" in str(out.error) and "WOWD_MONGODB__DDL=auto" in str(out.error)
    bare = [spec for spec in timer_index_specs() if spec["name"] in ("tombstones_ttl",)]
    async with calling(lambda: store.view.put(make_timer())) as out:
        await answer_indexes(wire, "wow_timer__ctx__order", bare)
    assert isinstance(out.error, FormatError) and "partition_owner_key" in str(out.error), out.error
    without_ttl = [spec for spec in timer_index_specs() if spec["name"] != "tombstones_ttl"]
    async with calling(lambda: store.view.put(make_timer())) as out:
        await answer_indexes(wire, "wow_timer__ctx__order", without_ttl)  # a missing TTL index: logged
        (await wire.command("findAndModify")).ok(value=registry_doc("order"))
        await answer_update(wire)  # straight to the upsert
    assert out.error is None and out.value is True


async def test_ddl_none_puts_a_type_the_registry_records_straight_to_its_upsert(mongo_client: Any, wire: Wire) -> None:
    """With ``ddl=none`` a type read from the registry by ``prepare`` (format 6) is assumed to
    exist: its first put is the upsert alone. A type the registry does not record still
    registers first (another replica's due read must see it)."""
    store = store_on(mongo_client, ddl=Ddl.NONE)
    async with calling(store.prepare) as prepared:
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order")]))
        await answer_indexes(wire, "wow_timer__ctx__order", timer_index_specs())
    assert prepared.error is None, prepared.error
    async with calling(lambda: store.view.put(make_timer())) as out:
        update = await answer_update(wire)
    assert out.error is None and out.value is True
    assert update["update"] == "wow_timer__ctx__order"
    async with calling(lambda: store.view.put(make_timer(aggregate="cart", id="c1"))) as cart:
        await answer_indexes(wire, "wow_timer__ctx__cart", timer_index_specs())  # a new type: its indexes first
        fam = await wire.command("findAndModify")
        assert fam.doc["query"] == {"_id": "wow_timer__ctx__cart"}
        fam.ok(value=registry_doc("cart"))
        await answer_update(wire)
    assert cart.value is True, cart.error


async def answer_indexes(wire: Wire, name: str, specs: list[dict[str, Any]]) -> None:
    """``listIndexes`` of ``name`` as a 7.0 server answers it: ``_id_`` then ``specs``, each with
    its index version ``v: 2``."""
    req = await wire.command("listIndexes")
    assert req.doc["listIndexes"] == name
    indexes = [{"v": 2, "key": {"_id": 1}, "name": "_id_"}] + [{"v": 2, **spec} for spec in specs]
    req.ok(**cursor(f"{DB}.{name}", indexes))


async def test_ddl_none_says_at_start_that_tombstones_without_a_ttl_index_never_expire(
    mongo_client: Any, wire: Wire, caplog: pytest.LogCaptureFixture
) -> None:
    """``ddl=none`` creates nothing, and on MongoDB ``sweep`` is the TTL index's: a registered
    collection without it (manual, TTL Indexes; ``listIndexes`` answered as 7.0 does) is named
    at start, with the setting and the index to create."""
    import logging

    store = store_on(mongo_client, ddl=Ddl.NONE)
    without_ttl = [spec for spec in timer_index_specs() if spec["name"] != "tombstones_ttl"]
    with caplog.at_level(logging.WARNING, logger="wowd.stores.mongo.schema"):
        async with calling(store.prepare) as out:
            (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order")]))
            await answer_indexes(wire, "wow_timer__ctx__order", without_ttl)
    assert out.error is None, out.error
    assert "wow_timer__ctx__order has no TTL index tombstones_ttl" in caplog.text
    assert "never expire" in caplog.text and "WOWD_MONGODB__DDL=auto" in caplog.text
    async with calling(store.view.missing_ttl) as missing:  # what wowd check asks
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order")]))
        await answer_indexes(wire, "wow_timer__ctx__order", without_ttl)
    assert missing.value == ["wow_timer__ctx__order"], missing.error


async def test_wowd_check_names_the_collections_whose_tombstones_never_expire() -> None:
    from wowd.stores.mongo.operations import ttl_probe

    async def missing() -> list[str]:
        return ["wow_timer__ctx__order"]

    async def none() -> list[str]:
        return []

    with pytest.raises(FormatError, match="no TTL index tombstones_ttl on wow_timer__ctx__order") as caught:
        await ttl_probe(missing)
    assert "never expire" in str(caught.value) and "WOWD_MONGODB__DDL=auto" in str(caught.value)
    await ttl_probe(none)


async def test_ddl_none_refuses_to_upgrade_format_5_without_the_ttl_index(mongo_client: Any, wire: Wire) -> None:
    """The upgrade to format 6 is the TTL index; ``ddl=none`` would have recorded 6 without it
    (tombstones never expiring): it is refused at start, naming the index and the setting, and
    the registry is left at 5. With the index there (an operator made it), 6 is recorded."""
    store = store_on(mongo_client, ddl=Ddl.NONE)
    without_ttl = [spec for spec in timer_index_specs() if spec["name"] != "tombstones_ttl"]
    async with calling(store.prepare) as out:
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order", fmt=5)]))
        await answer_indexes(wire, "wow_timer__ctx__order", without_ttl)
    assert isinstance(out.error, FormatError), out.error
    assert "tombstones_ttl" in str(out.error) and "WOWD_MONGODB__DDL=auto" in str(out.error)

    async with calling(store.prepare) as again:
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order", fmt=5)]))
        await answer_indexes(wire, "wow_timer__ctx__order", timer_index_specs())
        up = await wire.command("update")
        assert up.doc["updates"][0]["q"] == {"_id": "wow_timer__ctx__order", "format": 5}
        up.ok(n=1, nModified=1)
    assert again.error is None, again.error


async def test_ddl_auto_still_makes_sure_of_the_indexes_of_a_registered_type(mongo_client: Any, wire: Wire) -> None:
    """A replica may register a type and die before indexing it: with ``ddl=auto`` the first put of
    a type the registry records still runs the idempotent ``create`` + ``createIndexes``, else
    puts would land in a collection without its unique key."""
    store = store_on(mongo_client)
    await prepare(store, wire, "order")
    async with calling(lambda: store.view.put(make_timer())) as out:
        await answer_first_use(wire, "order")
        await answer_update(wire)
    assert out.value is True, out.error


async def test_ddl_validate_refuses_the_due_keys_in_another_order(mongo_client: Any, wire: Wire) -> None:
    """``(due_at, partition, timer_id)`` is another index: it cannot serve a due read of a few
    partitions (no equality prefix). The key order is compared, not the set of keys."""
    swapped = [dict(s) for s in timer_index_specs()]
    [due] = [s for s in swapped if s["name"] == "due"]
    due["key"] = {"due_at": 1, "partition": 1, "timer_id": 1}
    assert due["key"] == timer_index_specs()[1]["key"]  # equal as dicts: only the order differs
    store = store_on(mongo_client, ddl=Ddl.VALIDATE)
    async with calling(lambda: store.view.put(make_timer())) as out:
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order")]))
        (await wire.command("listIndexes")).ok(**cursor(f"{DB}.wow_timer__ctx__order", swapped))
    assert isinstance(out.error, FormatError) and "due" in str(out.error)


async def test_ddl_validate_refuses_a_registered_collection_that_does_not_exist(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client, ddl=Ddl.VALIDATE)
    async with calling(lambda: store.view.put(make_timer())) as out:
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order")]))
        server_error(await wire.command("listIndexes"), 26, f"ns does not exist: {DB}.wow_timer__ctx__order")
    assert isinstance(out.error, FormatError), out.error  # not a StorageError to retry forever
    assert "lacks the index" in str(out.error)


async def test_ddl_commands_are_bounded_one_by_one_not_by_the_puts_timeout(mongo_client: Any, wire: Wire) -> None:
    """The DDL of a type's first put takes longer than one operation's timeout. Each DDL command
    gets the timeout of its own, but ``createIndexes`` none (a build is aborted when its command
    is interrupted), and the upsert a fresh one after them. The answers here are held for real
    time on purpose (time has to pass; nothing is synchronised by it)."""
    from datetime import timedelta

    import anyio

    store = store_on(mongo_client, operation_timeout=timedelta(milliseconds=500))
    async with calling(lambda: store.view.put(make_timer())) as out:
        for name in ("findAndModify", "create", "createIndexes"):
            req = await wire.command(name)
            if name == "createIndexes":
                assert "maxTimeMS" not in req.doc
            else:
                assert 0 < req.doc["maxTimeMS"] <= 500
            await anyio.sleep(0.2)  # 0.6 s of DDL in all: more than one operation's 0.5 s
            if name == "findAndModify":
                req.ok(value=registry_doc("order"))
            else:
                req.ok()
        update = await answer_update(wire)
        assert 0 < update["maxTimeMS"] <= 500
    assert out.error is None, out.error
    assert out.value is True


async def test_prepare_refuses_a_collection_of_another_format(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    async with calling(store.prepare) as out:
        req = await wire.command("find")
        req.ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order"), registry_doc("cart", fmt=4)]))
    assert isinstance(out.error, FormatError)
    assert "wow_timer__ctx__cart" in str(out.error)


async def test_prepare_drops_another_format_when_told(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client, drop_other_format=True)
    async with calling(store.prepare) as out:
        (await wire.command("find")).ok(
            **cursor(f"{DB}.{REGISTRY}", [registry_doc("order"), registry_doc("cart", fmt=4)])
        )
        drop = await wire.command("drop")
        assert drop.doc["drop"] == "wow_timer__ctx__cart"
        drop.ok()
        delete = await wire.command("delete")
        assert delete.doc["delete"] == REGISTRY
        assert [d["q"] for d in delete.doc["deletes"]] == [{"_id": "wow_timer__ctx__cart", "format": 4}]
        delete.ok(n=1)
    assert out.error is None, out.error
    # only the format-6 collection is read by due
    async with calling(lambda: store.firing.due({0}, 10, 5)) as due:
        agg = await wire.command("aggregate")
        unions = [s["$unionWith"]["coll"] for s in agg.doc["pipeline"] if "$unionWith" in s]
        assert unions == ["wow_timer__ctx__order"]
        agg.ok(**cursor(f"{DB}.{REGISTRY}", [{"registered": 1}]))
    assert due.value == []


async def answer_one_chunk(wire: Wire, ns: str) -> None:
    """``config.collections`` then ``config.chunks`` of ``ns`` as a 7.0 ``mongos`` answers them for
    a sharded collection of one chunk."""
    from uuid import UUID

    from bson.binary import Binary, UuidRepresentation

    uuid = Binary.from_uuid(UUID(int=9), UuidRepresentation.STANDARD)
    (await wire.command("find")).ok(**cursor("config.collections", [{"_id": ns, "uuid": uuid}]))
    (await wire.command("aggregate")).ok(**cursor("config.chunks", [{"_id": 1, "n": 1}]))


async def first_sharded_put(store: MongoTimers, wire: Wire, timer: Timer) -> None:
    """A type's first put on a sharded cluster: registered, created, indexed, sharded, then the
    upsert; nothing else (no ``listShards``, ``split`` or ``moveRange`` on a feed batch's path)."""
    ns = f"{DB}.wow_timer__ctx__order"
    async with calling(lambda: store.view.put(timer)) as out:
        (await wire.command("findAndModify")).ok(
            value=registry_doc("order"),
            lastErrorObject={"n": 1, "updatedExisting": False, "upserted": "wow_timer__ctx__order"},
        )
        (await wire.command("create")).ok()
        (await wire.command("createIndexes")).ok()
        (await wire.command("hello")).ok(isWritablePrimary=True, msg="isdbgrid", maxWireVersion=21)
        shard = await wire.command("shardCollection")
        assert shard.doc["shardCollection"] == ns and shard.doc["key"] == {"partition": 1}
        shard.ok(collectionsharded=ns)
        await answer_update(wire)
    assert out.value is True, out.error


async def test_sharded_cluster_gets_its_chunks_spread_off_the_put_path(mongo_client: Any, wire: Wire) -> None:
    store = mongo_timers(
        mongo_client, DB, context=CONTEXT, partitions=3, sharding=MongoSharding.AUTO, operation_timeout=None
    )
    timer = make_timer(id="a")
    await first_sharded_put(store, wire, replace(timer, partition=timer.owner.partition(3)))
    ns = f"{DB}.wow_timer__ctx__order"
    async with calling(store.view.spread_chunks) as out:
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order")]))
        (await wire.command("listShards")).ok(shards=[{"_id": "s0"}, {"_id": "s1"}])
        await answer_one_chunk(wire, ns)
        splits = []
        for _ in range(2):
            req = await wire.command("split")
            assert req.doc["split"] == ns
            splits.append(req.doc["middle"])
            req.ok()
        assert splits == [{"partition": 1}, {"partition": 2}]
        moves = []
        for _ in range(3):
            req = await wire.command("moveRange")
            moves.append((req.doc["min"]["partition"], req.doc["toShard"]))
            req.ok()
        assert moves == [(MinKey(), "s0"), (1, "s1"), (2, "s0")]
    assert out.value == {"wow_timer__ctx__order": "spread: 3 chunks over 2 shards"}, out.error


async def test_the_spread_at_the_most_partitions_is_bounded_by_the_shards(mongo_client: Any, wire: Wire) -> None:
    """65,536 partitions on two shards: 8 contiguous ranges (4 a shard), so 7 ``split`` and 8
    ``moveRange`` (never 65,535 splits), each a 7.0 ``mongos``'s ``ok``; and a spent budget
    sends nothing more (the balancer's then)."""
    from datetime import timedelta

    store = mongo_timers(
        mongo_client, DB, context=CONTEXT, partitions=65_536, sharding=MongoSharding.ON, operation_timeout=None
    )
    ns = f"{DB}.wow_timer__ctx__order"
    async with calling(store.view.spread_chunks) as out:
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order")]))
        (await wire.command("listShards")).ok(shards=[{"_id": "s0"}, {"_id": "s1"}])
        await answer_one_chunk(wire, ns)
        middles = []
        for _ in range(7):
            req = await wire.command("split")
            middles.append(req.doc["middle"]["partition"])
            req.ok()
        assert middles == [8192 * n for n in range(1, 8)]
        targets = []
        for _ in range(8):
            req = await wire.command("moveRange")
            targets.append(req.doc["toShard"])
            req.ok()
        assert targets == ["s0", "s1"] * 4
    assert out.value == {"wow_timer__ctx__order": "spread: 8 chunks over 2 shards"}, out.error

    async with calling(lambda: store.view.spread_chunks(budget=timedelta(0))) as spent:
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order")]))
        (await wire.command("listShards")).ok(shards=[{"_id": "s0"}, {"_id": "s1"}])
        await answer_one_chunk(wire, ns)
    assert spent.value == {"wow_timer__ctx__order": "partly spread: 15 of 15 commands left"}, spent.error


async def test_a_one_shard_cluster_gets_no_split(mongo_client: Any, wire: Wire) -> None:
    """A sharded cluster of one shard: the collection is sharded, but its chunk is not split
    (nothing to spread; 7.0's AutoMerger merges the chunks of a shard back, manual, "Automerger",
    so the next start would find one chunk and split it again). The answers are a 7.0
    ``mongos``'s: ``listShards`` lists the one shard."""
    store = mongo_timers(
        mongo_client, DB, context=CONTEXT, partitions=3, sharding=MongoSharding.AUTO, operation_timeout=None
    )
    timer = make_timer(id="a")
    await first_sharded_put(store, wire, replace(timer, partition=timer.owner.partition(3)))
    async with calling(store.view.spread_chunks) as out:
        (await wire.command("find")).ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order")]))
        (await wire.command("listShards")).ok(
            shards=[{"_id": "s0", "host": "s0/localhost:27018", "state": 1, "topologyTime": Timestamp(1, 1)}]
        )
    assert out.value == {"wow_timer__ctx__order": "one shard: nothing to spread"}, out.error


# --------------------------------------------------------------------------- put's guard


def stored_doc(version: int, status: str = "PENDING") -> dict[str, Any]:
    doc = timer_to_doc(make_timer(version=version))
    return doc if status in ("PENDING", "FIRING", "PARKED", "FAILED") else tombstone(doc, status)


async def test_put_refused_by_the_unique_key_is_decided_by_one_read(mongo_client: Any, wire: Wire) -> None:
    """A later version is stored: the upsert matches nothing, its insert meets the unique key
    (E11000, as a 7.0 server answers it in the ``update`` command's ``writeErrors``), and one read
    of the key tells the refusal from a racing insert: False, no error, no second upsert."""
    store = store_on(mongo_client)
    await first_put(store, wire)
    timer = make_timer(version=3)
    later = stored_doc(5)
    async with calling(lambda: store.view.put(timer)) as out:
        first = await wire.command("update")
        assert first.doc["updates"][0]["q"] == put_filter(timer)
        first.ok(n=0, nModified=0, writeErrors=[dup_key_error(0, later)])
        read = await wire.command("find")
        assert read.doc["find"] == "wow_timer__ctx__order"
        assert read.doc["filter"] == {
            "$or": [{"partition": timer.partition, "owner.tenant_id": "(0)", "owner.id": "order-1", "key": "remind"}]
        }
        assert read.doc["projection"] == {
            "_id": 0,
            "partition": 1,
            "owner": 1,
            "key": 1,
            "version": 1,
            "status": 1,
        }
        read.ok(**cursor(f"{DB}.wow_timer__ctx__order", [key_doc(later)]))
    assert out.error is None and out.value is False


async def test_put_that_lost_an_insert_race_is_admitted_over_the_winner(mongo_client: Any, wire: Wire) -> None:
    """Two puts of one new (owner, key), versions 5 and 7: the 5 inserts first, the 7's upsert
    matched nothing and met the unique key. The read finds the 5 (earlier: a race, not a refusal),
    so the 7 is sent again alone; it matches the stored 5 and replaces it."""
    store = store_on(mongo_client)
    await first_put(store, wire)
    won = stored_doc(5)
    async with calling(lambda: store.view.put(make_timer(version=7))) as out:
        (await wire.command("update")).ok(n=0, nModified=0, writeErrors=[dup_key_error(0, won)])
        (await wire.command("find")).ok(**cursor(f"{DB}.wow_timer__ctx__order", [key_doc(won)]))
        req = await wire.command("update")
        assert matches(req.doc["updates"][0]["q"], won)
        req.ok(n=1, nModified=1)
    assert out.error is None and out.value is True


async def test_a_put_alone_that_meets_the_key_with_a_write_concern_error_is_unavailable(
    mongo_client: Any, wire: Wire
) -> None:
    """The put sent again alone (a lost insert race) meets the unique key again and the write
    concern is not satisfied, both in one reply (a 7.0 server waits for the write concern also
    after a duplicate key: src/mongo/db/ops/write_ops_exec.cpp, ``LastOpFixer``). The stored
    timer the key met may roll back: StorageUnavailable, not a decision read from it."""
    store = store_on(mongo_client)
    await first_put(store, wire)
    won = stored_doc(5)
    async with calling(lambda: store.view.put(make_timer(version=7))) as out:
        (await wire.command("update")).ok(n=0, nModified=0, writeErrors=[dup_key_error(0, won)])
        (await wire.command("find")).ok(**cursor(f"{DB}.wow_timer__ctx__order", [key_doc(won)]))
        alone = await wire.command("update")
        assert len(alone.doc["updates"]) == 1 and alone.doc["updates"][0]["upsert"] is True
        alone.ok(n=0, nModified=0, writeErrors=[dup_key_error(0, won)], writeConcernError=write_concern_timeout())
    assert isinstance(out.error, StorageUnavailable), out.error
    assert "write concern" in str(out.error)


@pytest.mark.parametrize(
    ("stored_version", "status", "new", "admitted"),
    [
        (5, "PENDING", 3, False),
        (5, "PENDING", 5, True),  # the same version stored live: matched, kept as it is
        (5, "FAILED", 5, True),
        (5, "PENDING", 6, True),
        (5, "DONE", 5, False),  # a fired one-shot timer is not put again by a replay
        (5, "CANCELLED", 4, False),
        (5, "CANCELLED", 6, True),  # a later version replaces a tombstone
    ],
)
async def test_put_version_guard(
    mongo_client: Any, wire: Wire, stored_version: int, status: str, new: int, admitted: bool
) -> None:
    """The filter sent is judged against the stored document the way the server does: a match is
    updated, no match is an insert that meets the unique key (E11000), then read."""
    store = store_on(mongo_client)
    await first_put(store, wire)
    existing = stored_doc(stored_version, status)
    async with calling(lambda: store.view.put(make_timer(version=new))) as out:
        req = await wire.command("update")
        if matches(req.doc["updates"][0]["q"], existing):
            req.ok(n=1, nModified=0 if new == stored_version else 1)
        else:
            req.ok(n=0, nModified=0, writeErrors=[dup_key_error(0, existing)])
            (await wire.command("find")).ok(**cursor(f"{DB}.wow_timer__ctx__order", [key_doc(existing)]))
    assert out.error is None
    assert out.value is admitted


async def test_put_refuses_a_timer_of_another_context_or_partition(idle_client: Any) -> None:
    from wowd.model import AggregateRef

    store = store_on(idle_client)
    other = AggregateRef(context="other", aggregate="order", id="order-1")
    with pytest.raises(InvalidInput):
        await store.view.put(replace(make_timer(), owner=other))
    t = make_timer()
    with pytest.raises(InvalidInput):
        await store.view.put(replace(t, partition=(t.partition + 1) % PARTITIONS))


# --------------------------------------------------------------------------- owner reads and writes


async def test_find_cancel_cancel_all_filter_on_partition_and_owner(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    owner = ref()
    p = owner.partition(PARTITIONS)
    t = make_timer()
    key = {"partition": p, "owner.tenant_id": "(0)", "owner.id": "order-1", "key": "remind"}
    async with calling(lambda: store.queries.find(owner, "remind")) as found:
        req = await wire.command("find")
        assert req.doc["find"] == "wow_timer__ctx__order"
        assert req.doc["filter"] == {**key, "status": {"$nin": ["DONE", "CANCELLED"]}}  # no tombstone
        req.ok(**cursor(f"{DB}.wow_timer__ctx__order", [{"_id": ObjectId(), **timer_to_doc(t)}]))
    assert found.value == t

    # a cancel may upsert a tombstone: the type's first use makes sure of its collection first
    async with calling(lambda: store.view.cancel(owner, "remind", 7)) as cancelled:
        await answer_first_use(wire, "order")
        req = await wire.command("update")
        [u] = req.doc["updates"]
        assert u["q"] == {**key, "version": {"$lte": 7}, "status": {"$nin": ["DONE", "CANCELLED"]}}
        assert u["upsert"] is True and not u.get("multi", False)
        assert u["u"] == tombstone_update("CANCELLED", 7, 7 * 24 * 3600 * 1000)
        req.ok(n=1, nModified=1)  # matched: a live timer cancelled
    assert cancelled.value is True, cancelled.error

    async with calling(lambda: store.view.cancel_all(owner, 9)) as all_:
        req = await wire.command("update")
        [u] = req.doc["updates"]
        assert u["q"] == {
            "partition": p,
            "owner.tenant_id": "(0)",
            "owner.id": "order-1",
            "version": {"$lte": 9},
            "status": {"$nin": ["DONE", "CANCELLED"]},
        }
        assert u["multi"] is True and not u.get("upsert", False)
        req.ok(n=2, nModified=2)
    assert all_.value == 2


# --------------------------------------------------------------------------- settle


async def test_settle_is_one_unordered_command_per_collection_and_kind(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    a1, a2 = make_timer(id="a1", revision=2), make_timer(id="a2")
    gone = make_timer(id="a3", revision=1)
    b1 = make_timer(aggregate="cart", id="b1")
    changes = [
        TimerChange.claim(a1, owner_key="me", fence=3, until=5_000),
        TimerChange.claim(b1, owner_key="me", fence=3, until=5_000),
        TimerChange.fired(gone, fence=3, next_due=None),
        TimerChange.retry(a2, fence=3, due_at=7_000, error="503"),
    ]
    seen: dict[str, dict[str, Any]] = {}
    async with calling(lambda: store.firing.settle(changes)) as out:
        for _ in range(2):
            req = await wire.command("update")
            seen[req.doc["update"]] = dict(req.doc)
            if req.doc["update"] == "wow_timer__ctx__order":
                req.ok(n=2, nModified=2)  # one of the three moved on meanwhile
            else:
                req.ok(n=1, nModified=1)
    assert out.error is None
    assert out.value == 3
    assert set(seen) == {"wow_timer__ctx__order", "wow_timer__ctx__cart"}
    assert all(doc["ordered"] is False for doc in seen.values())
    updates = seen["wow_timer__ctx__order"]["updates"]
    assert [u["q"] for u in updates] == [settle_filter(a1), settle_filter(gone), settle_filter(a2)]
    assert updates[0]["q"]["timer_id"] == a1.timer_id and updates[0]["q"]["revision"] == 2
    assert updates[0]["q"]["partition"] == a1.partition
    claimed = changes[0].applied()
    assert claimed is not None
    # an update of the fields the claim changes (the oplog holds those, not the whole document
    # with its body, as a replacement's entry would): the status, the claim's expiry as due_at,
    # the claim, the revision; nothing else
    assert dict(updates[0]["u"]) == {
        "$set": {"status": "FIRING", "due_at": 5_000, "claim": {"owner_key": "me", "fence": 3, "until": 5_000},
                 "revision": 3},
    }  # fmt: skip
    assert timer_to_doc(claimed) == {**timer_to_doc(a1), **updates[0]["u"]["$set"]}
    retried = changes[3].applied()
    assert retried is not None and "claim" not in timer_to_doc(retried)
    assert set(updates[2]["u"]["$set"]) <= {"status", "due_at", "attempts", "last_error", "revision"}
    assert not any(u.get("upsert") for u in updates)
    # a fired one-shot timer is not deleted: it becomes a DONE tombstone at its version
    assert updates[1]["u"] == tombstone_update("DONE", None, 7 * 24 * 3600 * 1000)
    assert not updates[1].get("multi", False)
    [cart] = seen["wow_timer__ctx__cart"]["updates"]
    assert cart["q"] == settle_filter(b1)


async def test_settle_of_nothing_sends_nothing(idle_client: Any) -> None:
    assert await store_on(idle_client).firing.settle([]) == 0


# --------------------------------------------------------------------------- due


async def test_due_is_one_aggregate_with_a_union_per_collection(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    await prepare(store, wire, "order", "cart", "user")
    o1 = make_timer(id="o1", due_at=300)
    c1 = make_timer(aggregate="cart", id="c1", due_at=100)
    u1 = make_timer(aggregate="user", id="u1", due_at=200)
    async with calling(lambda: store.firing.due({3, 1}, 500, 10)) as out:
        agg = await wire.command("aggregate")
        assert agg.doc["aggregate"] == REGISTRY
        # the count document and at most 10 timers, with room for the server to meet EOF in the
        # first batch (a batch filled exactly stays open and costs a getMore)
        assert agg.doc["cursor"] == {"batchSize": 12}
        pipeline = agg.doc["pipeline"]
        assert pipeline[:2] == [{"$match": {"context": CONTEXT}}, {"$count": "registered"}]
        unions = [s["$unionWith"] for s in pipeline[2:5]]
        assert [u["coll"] for u in unions] == [f"wow_timer__ctx__{a}" for a in ("cart", "order", "user")]
        for u, aggregate in zip(unions, ["cart", "order", "user"], strict=True):
            assert u["pipeline"] == [
                {
                    "$match": {
                        "partition": {"$in": [1, 3]},
                        "status": {"$in": ["PENDING", "FIRING"]},
                        "due_at": {"$lte": 500},
                    }
                },
                {"$sort": {"due_at": 1, "timer_id": 1}},
                {"$limit": 10},
                {"$set": {"owner.aggregate": {"$literal": aggregate}}},
                {"$unset": "_id"},
            ]
        assert pipeline[5:] == [{"$sort": {"due_at": 1, "timer_id": 1}}, {"$limit": 11}]
        agg.ok(**cursor(f"{DB}.{REGISTRY}", [{"registered": 3}, stored(c1), stored(u1), stored(o1)]))
    assert out.error is None, out.error
    assert out.value == [c1, u1, o1]
    assert [t.owner.aggregate for t in out.value] == ["cart", "user", "order"]


def test_due_sub_pipeline_is_covered_by_the_partial_index() -> None:
    """An explain by the manual's rules, on the documents the store sends.

    - Partial index: used only when the query predicate implies the ``partialFilterExpression``
      (the query contains it or a subset of it); ``status: {$in: [PENDING, FIRING]}`` must be
      present with no value outside the index's set.
    - Bounds: an equality or ``$in`` on the first key (``partition``: point intervals), then a range
      on the next (``due_at``), keep the scan inside the matching keys.
    - Sort: a sort on the keys that follow an equality prefix is provided by the index; with a
      ``$in`` prefix the index is sorted only within each point, so the planner explodes the
      scan into one per point (up to 200) and merges them with SORT_MERGE (no blocking SORT),
      and the ``$limit`` ends the merge early.
    """
    [due] = [s for s in timer_index_specs() if s["name"] == "due"]
    keys = list(due["key"].items())
    sub = union_pipeline(CONTEXT, {"wow_timer__ctx__order": "order"}, due_match({5, 1, 7}, 900), 50)[2]
    match, sort, limit = (stage for stage in sub["$unionWith"]["pipeline"][:3])
    predicate = match["$match"]
    # partial filter implied: the same field, values a subset of the index's
    pfe = due["partialFilterExpression"]["status"]["$in"]
    assert set(predicate["status"]["$in"]) <= set(pfe)
    # first key: point intervals; second key: a range; nothing else filtered outside the index
    assert keys[0] == ("partition", 1) and set(predicate["partition"]) == {"$in"}
    assert predicate["partition"]["$in"] == [1, 5, 7] and len(predicate["partition"]["$in"]) <= 200
    assert keys[1] == ("due_at", 1) and set(predicate["due_at"]) == {"$lte"}
    assert set(predicate) - {k for k, _ in keys} == {"status"}  # only the partial filter's field
    # sort: the index keys after the $in prefix, same directions (SORT_MERGE of the points)
    assert list(sort["$sort"].items()) == keys[1:]
    assert limit == {"$limit": 50}


async def test_due_reloads_the_registry_when_its_count_differs(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    await prepare(store, wire, "order")
    c1 = make_timer(aggregate="cart", id="c1", due_at=100)
    o1 = make_timer(id="o1", due_at=300)
    async with calling(lambda: store.firing.due({0, 1, 2}, 500, 10)) as out:
        first = await wire.command("aggregate")
        assert [s["$unionWith"]["coll"] for s in first.doc["pipeline"] if "$unionWith" in s] == [
            "wow_timer__ctx__order"
        ]
        first.ok(**cursor(f"{DB}.{REGISTRY}", [{"registered": 2}, stored(o1)]))  # another replica added cart
        second = await registry_reloaded(wire)  # another replica registered cart
        second.ok(**cursor(f"{DB}.{REGISTRY}", [{"registered": 2}, stored(c1), stored(o1)]))
    assert out.error is None, out.error
    assert out.value == [c1, o1]


def test_union_batch_size_leaves_room_to_meet_eof() -> None:
    """The server closes the first batch's cursor only when it met EOF while filling it (a batch
    filled exactly stays open): at most ``limit + 1`` documents (the count and ``limit`` timers),
    so ``limit + 2``. No limit (the parked read): the server's default, read on by getMore."""
    assert union_batch_size(1) == 3
    assert union_batch_size(1000) == 1002
    assert union_batch_size(None) is None


async def test_due_reads_on_when_the_server_splits_its_answer(mongo_client: Any, wire: Wire) -> None:
    """A first batch cut at 16 MiB leaves the cursor open: the store reads the rest (getMore)
    before it compares the count, so no due timer is dropped."""
    store = store_on(mongo_client)
    await prepare(store, wire, "order")
    t1, t2 = make_timer(id="o1", due_at=100), make_timer(id="o2", due_at=200)
    async with calling(lambda: store.firing.due({0, 1, 2, 3, 4, 5, 6, 7}, 500, 10)) as out:
        agg = await wire.command("aggregate")
        agg.ok(cursor={"id": 42, "ns": f"{DB}.{REGISTRY}", "firstBatch": [{"registered": 1}, stored(t1)]})
        more = await wire.command("getMore")
        assert more.doc["getMore"] == 42 and more.doc["collection"] == REGISTRY
        more.ok(cursor={"id": 0, "ns": f"{DB}.{REGISTRY}", "nextBatch": [stored(t2)]})
    assert out.error is None, out.error
    assert out.value == [t1, t2]


async def test_due_with_no_collection_counts_zero(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    async with calling(lambda: store.firing.due({0}, 500, 10)) as out:
        agg = await wire.command("aggregate")
        assert agg.doc["pipeline"] == [
            {"$match": {"context": CONTEXT}},
            {"$count": "registered"},
            {"$sort": {"due_at": 1, "timer_id": 1}},
            {"$limit": 11},
        ]
        agg.ok(**cursor(f"{DB}.{REGISTRY}", []))  # $count emits nothing for no input
    assert out.value == []


async def test_parked_reads_every_collection_by_target(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    await prepare(store, wire, "order", "cart")
    t = replace(make_timer(), status=TimerStatus.PARKED, last_error="404")
    async with calling(lambda: store.queries.parked(t.target)) as out:
        agg = await wire.command("aggregate")
        for stage in agg.doc["pipeline"][2:4]:
            sub = stage["$unionWith"]["pipeline"]
            assert sub[0] == {
                "$match": {
                    "target.id": "inv-9",
                    "target.tenant_id": "(0)",
                    "target.aggregate": "invoice",
                    "target.context": "billing",
                    "status": "PARKED",
                }
            }
            assert not any("$limit" in s for s in sub)
        agg.ok(**cursor(f"{DB}.{REGISTRY}", [{"registered": 2}, stored(t)]))
    assert out.value == [t]


async def test_a_search_of_an_owner_is_one_union_and_keeps_the_owners_aggregate_only(
    mongo_client: Any, wire: Wire
) -> None:
    """An owner's timers: the union matches the owner keys in every collection; a timer of the
    same id in another aggregate type's collection is not the owner's and is left out."""
    from wowd.stores.base import TimerSearch

    store = store_on(mongo_client)
    await prepare(store, wire, "order", "cart")
    mine = make_timer(key="a", due_at=10)
    other = make_timer(aggregate="cart", key="b", due_at=5)
    async with calling(lambda: store.queries.search(TimerSearch(owners=(mine.owner,)), 10)) as out:
        agg = await wire.command("aggregate")
        sub = agg.doc["pipeline"][2]["$unionWith"]["pipeline"]
        assert sub[0]["$match"]["$and"][0] == {
            "$or": [{"partition": mine.partition, "owner.tenant_id": "(0)", "owner.id": "order-1"}]
        }
        assert {"$limit": 10} in sub
        agg.ok(**cursor(f"{DB}.{REGISTRY}", [{"registered": 2}, stored(other), stored(mine)]))
    assert out.error is None and out.value == [mine]


# --------------------------------------------------------------------------- errors and timeouts


async def test_not_writable_primary_is_storage_unavailable(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    await first_put(store, wire)
    counted = metrics.STORE_UNAVAILABLE.labels("timers", "put")
    before = counted._value.get()
    async with calling(lambda: store.view.put(make_timer(version=6))) as out:
        server_error(await wire.command("update"), 10107, "not primary")
    assert isinstance(out.error, StorageUnavailable)
    assert "timers.put" in str(out.error)
    # counted under the same store label as the embedded twin (one dashboard for both backends)
    assert counted._value.get() == before + 1


async def test_hangup_is_storage_unavailable(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    async with calling(lambda: store.firing.due({0}, 1, 1)) as out:
        (await wire.command("aggregate")).hangup()
    assert isinstance(out.error, StorageUnavailable)


async def test_operation_timeout_bounds_each_command(mongo_client: Any, wire: Wire) -> None:
    from datetime import timedelta

    store = store_on(mongo_client, operation_timeout=timedelta(seconds=5))
    async with calling(lambda: store.queries.find(ref(), "remind")) as out:
        req = await wire.command("find")
        assert 0 < req.doc["maxTimeMS"] <= 5_000
        req.ok(**cursor(f"{DB}.wow_timer__ctx__order", []))
    assert out.error is None and out.value is None


# --------------------------------------------------------------------------- parked_many

DRIVER_FIELDS = {"$db", "lsid", "$clusterTime", "maxTimeMS", "$readPreference"}
"""What the driver adds to every command beside what the store asks for."""


def parked_clause(ids: list[str], tenant: str = "(0)", context: str = "billing") -> dict[str, Any]:
    return {
        "target.id": {"$in": ids},
        "target.tenant_id": tenant,
        "target.aggregate": "invoice",
        "target.context": context,
        "status": "PARKED",
    }


async def test_parked_many_is_one_aggregation_over_every_collection(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    await prepare(store, wire, "order", "cart")
    target = make_timer().target
    t1 = replace(make_timer(id="o1", due_at=300), status=TimerStatus.PARKED, last_error="404")
    t2 = replace(make_timer(aggregate="cart", id="c1", due_at=100), status=TimerStatus.PARKED, last_error="503")
    t3 = replace(t1, timer_id="other-tenant", target=replace(target, tenant_id="t2"), due_at=200)
    asked = [
        target,
        replace(target, id="inv-1"),
        replace(target, tenant_id="t2"),
        replace(target, context="shipping"),
        target,
    ]
    match = {
        "$or": [
            parked_clause(["inv-1", "inv-9"]),
            parked_clause(["inv-9"], tenant="t2"),
            parked_clause(["inv-9"], context="shipping"),
        ]
    }
    async with calling(lambda: store.view.parked_many(asked)) as out:
        agg = await wire.command("aggregate")
        assert {k: v for k, v in agg.doc.items() if k not in DRIVER_FIELDS} == {
            "aggregate": REGISTRY,
            "pipeline": [
                {"$match": {"context": CONTEXT}},
                {"$count": "registered"},
                *(
                    {
                        "$unionWith": {
                            "coll": f"wow_timer__{CONTEXT}__{aggregate}",
                            "pipeline": [
                                {"$match": match},
                                {"$sort": {"due_at": 1, "timer_id": 1}},
                                {"$set": {"owner.aggregate": {"$literal": aggregate}}},
                                {"$unset": "_id"},
                            ],
                        }
                    }
                    for aggregate in ("cart", "order")
                ),
                {"$sort": {"due_at": 1, "timer_id": 1}},
            ],
            "cursor": {},  # no limit: the server's default first batch, then getMore
        }
        docs = [{"registered": 2}, stored(t2), stored(t3), stored(t1)]
        agg.ok(cursor={"firstBatch": docs, "id": 0, "ns": f"{DB}.{REGISTRY}"})
    assert out.error is None, out.error
    assert out.value == [t2, t3, t1]


async def test_parked_many_reads_on_past_the_first_batch(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    await prepare(store, wire, "order")
    t1 = replace(make_timer(id="o1", due_at=100), status=TimerStatus.PARKED)
    t2 = replace(make_timer(id="o2", due_at=200), status=TimerStatus.PARKED)
    async with calling(lambda: store.view.parked_many([t1.target])) as out:
        agg = await wire.command("aggregate")
        agg.ok(cursor={"firstBatch": [{"registered": 1}, stored(t1)], "id": 5_120_447_110, "ns": f"{DB}.{REGISTRY}"})
        more = await wire.command("getMore")
        assert more.doc["getMore"] == 5_120_447_110 and more.doc["collection"] == REGISTRY
        more.ok(cursor={"nextBatch": [stored(t2)], "id": 0, "ns": f"{DB}.{REGISTRY}"})
    assert out.error is None, out.error
    assert out.value == [t1, t2]


async def test_parked_many_reloads_the_registry_when_it_counts_another_number(mongo_client: Any, wire: Wire) -> None:
    store = store_on(mongo_client)
    await prepare(store, wire, "order")
    t = replace(make_timer(aggregate="cart", id="c1"), status=TimerStatus.PARKED)
    async with calling(lambda: store.view.parked_many([t.target])) as out:
        first = await wire.command("aggregate")
        assert len(first.doc["pipeline"]) == 4  # match, count, the order collection, sort
        first.ok(**cursor(f"{DB}.{REGISTRY}", [{"registered": 2}]))
        reload = await wire.command("find")
        assert reload.doc["find"] == REGISTRY
        reload.ok(**cursor(f"{DB}.{REGISTRY}", [registry_doc("order"), registry_doc("cart")]))
        second = await wire.command("aggregate")
        assert [s["$unionWith"]["coll"] for s in second.doc["pipeline"][2:4]] == [
            "wow_timer__ctx__cart",
            "wow_timer__ctx__order",
        ]
        second.ok(**cursor(f"{DB}.{REGISTRY}", [{"registered": 2}, stored(t)]))
    assert out.error is None, out.error
    assert out.value == [t]


async def test_parked_many_of_no_target_sends_nothing(idle_client: AsyncMongoClient[Any]) -> None:
    assert await store_on(idle_client).view.parked_many([]) == []


def test_parked_many_targets_are_split_to_fit_one_command() -> None:
    target = make_timer().target
    targets = [replace(target, id=f"invoice-{i:06d}", tenant_id=f"tenant-{i % 5}") for i in range(5_000)]
    known = {f"wow_timer__ctx__type{i}": f"type{i}" for i in range(3)}

    def command(part: Any) -> dict[str, Any]:
        return {"pipeline": union_pipeline(CONTEXT, known, parked_many_match(part), None)}

    assert split_to_fit(targets, command) == [targets]  # a feed batch and far more: one command
    limit = 256 * 1024
    parts = split_to_fit(targets, command, limit)
    assert len(parts) > 1 and [t for p in parts for t in p] == targets
    assert all(len(bson.encode(command(p))) <= limit for p in parts)


def test_a_search_matches_on_the_index_keys_of_what_it_names() -> None:
    from wowd.model import AggregateRef, partition
    from wowd.stores.base import TimerSearch
    from wowd.stores.mongo.timer_queries import search_match

    owner = AggregateRef(context="ctx", aggregate="order", id="o-1", tenant_id="t1")
    target = AggregateRef(context="ctx", aggregate="order", id="o-2")
    p = partition("o-1", 8)
    assert search_match(TimerSearch(owners=(owner,), key="k"), 8) == {
        "$and": [
            {"$or": [{"partition": p, "owner.tenant_id": "t1", "owner.id": "o-1"}]},
            {"key": "k"},
            {"status": {"$in": ["PENDING", "FIRING", "PARKED", "FAILED"]}},
        ]
    }
    assert search_match(TimerSearch(status=TimerStatus.FAILED), 8) == {"status": "FAILED"}
    assert search_match(TimerSearch(status=TimerStatus.PENDING), 4) == {
        "$and": [
            {"partition": {"$in": [0, 1, 2, 3]}, "status": {"$in": ["PENDING", "FIRING"]}},
            {"status": "PENDING"},
        ]
    }
    assert search_match(TimerSearch(target=target, due_from=5, due_until=9, after=(6, "x")), 8) == {
        "$and": [
            {"status": {"$in": ["PARKED", "FAILED"]}},
            {
                "target.id": "o-2",
                "target.tenant_id": target.tenant_id,
                "target.aggregate": "order",
                "target.context": "ctx",
            },
            {"due_at": {"$gte": 5, "$lte": 9}},
            {"$or": [{"due_at": {"$gt": 6}}, {"due_at": 6, "timer_id": {"$gt": "x"}}]},
        ]
    }
    with pytest.raises(InvalidInput) as refused:
        search_match(TimerSearch(target=target, status=TimerStatus.PENDING), 8)
    assert refused.value.field == "target"
