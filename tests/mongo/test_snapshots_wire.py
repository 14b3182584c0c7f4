"""Black-pipe tests of MongoSnapshotStore: the commands on the wire and the answers it reads.

The real PyMongo async driver talks to MockupDB (``tests/mongo/conftest.py``); each test starts
a store call in a task group, receives each command, asserts its document and scripts the reply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Iterator
from decimal import Decimal
from typing import Any

import anyio
import bson
import pytest
from bson.decimal128 import Decimal128
from mockupdb import MockupDB
from prometheus_client import REGISTRY
from pymongo import AsyncMongoClient

from tests.mongo.conftest import Wire, server_error, serving, unanswered, write_concern_timeout
from wowd.errors import FormatError, InvalidInput, StorageError, StorageUnavailable
from wowd.model import AggregateRef, AggregateType, SnapshotRecord, SnapshotTable
from wowd.stores.base import Ddl, SnapshotRebuildStore, SnapshotStore
from wowd.stores.mongo._common import MongoSharding, split_to_fit
from wowd.stores.mongo.schema import snapshot_index_specs
from wowd.stores.mongo.snapshot_rebuilds import MongoSnapshotRebuilds
from wowd.stores.mongo.snapshots import (
    TABLES,
    MongoSnapshotStore,
    conditional_upsert_filter,
    load_many_filter,
    snapshot_pipeline,
)

pytestmark = pytest.mark.anyio

DB = "wowd_wire"
CTX = "ctx"
ORDERS = "wow_snapshot__ctx__order"
CARTS = "wow_snapshot__ctx__cart"
E11000 = {
    "index": 0,
    "code": 11000,
    "errmsg": "E11000 duplicate key error collection: wowd_wire.x index: _id_",
}


def ref(id: str, aggregate: str = "order", tenant: str = "(0)") -> AggregateRef:
    return AggregateRef(context=CTX, aggregate=aggregate, tenant_id=tenant, id=id)


def snap(id: str, version: int = 3, revision: int = 2, aggregate: str = "order", **kw: Any) -> SnapshotRecord:
    state = kw.pop("state", {"total": Decimal("12.50"), "note": "$not-a-path", "lines": [{"qty": 2}]})
    return SnapshotRecord(ref=ref(id, aggregate), version=version, state_revision=revision, state=state, **kw)


class Call:
    """A store call running in the background while the test plays the server."""

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = anyio.Event()

    async def run(self, awaitable: Awaitable[Any]) -> None:
        try:
            self.value = await awaitable
        except Exception as exc:
            self.error = exc
        finally:
            self.done.set()

    async def result(self) -> Any:
        with anyio.fail_after(10):
            await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


@pytest.fixture(scope="module")
def mock_server() -> Iterator[MockupDB]:
    """One MockupDB for the module; each test still gets its own client, and consumes every
    command its call sends."""
    server = MockupDB(auto_ismaster={"maxWireVersion": 21}, verbose=False)
    server.autoresponds("endSessions")
    with serving(server):
        yield server


@pytest.fixture(autouse=True)
def _no_leftovers(mock_server: MockupDB) -> Iterator[None]:
    """After each test (its client closed), hang up on any request it left unanswered, so a
    failing test does not hand its commands to the next one on the shared server."""
    yield
    for leftover in unanswered(mock_server):
        leftover.hangup()


@pytest.fixture
async def store(mongo_client: AsyncMongoClient[Any]) -> AsyncIterator[MongoSnapshotStore]:
    """DDL off: each test sees only the commands of the call it makes."""
    s = MongoSnapshotStore(mongo_client, DB, context=CTX, ddl=Ddl.NONE, sharding=MongoSharding.OFF)
    yield s
    await s.close()


@pytest.fixture
def rebuilds(store: MongoSnapshotStore, mongo_client: AsyncMongoClient[Any]) -> MongoSnapshotRebuilds:
    """The rebuilds' control plane on the store's collections."""
    return MongoSnapshotRebuilds(
        mongo_client, DB, context=CTX, ddl=Ddl.NONE, sharding=MongoSharding.OFF, shared_with=store
    )


def upsert_reply(n: int = 1) -> dict[str, Any]:
    return {
        "n": n,
        "nModified": 0,
        "upserted": [{"index": i, "_id": {"t": "(0)", "a": str(i)}} for i in range(n)],
    }


def updates(req: Any) -> list[dict[str, Any]]:
    return [dict(u) for u in req.doc["updates"]]


async def test_the_stores_implement_their_protocols(store: MongoSnapshotStore, rebuilds: MongoSnapshotRebuilds) -> None:
    assert isinstance(store, SnapshotStore)
    assert isinstance(rebuilds, SnapshotRebuildStore)


async def test_save_is_one_guarded_upsert_with_a_pipeline(store: MongoSnapshotStore, wire: Wire) -> None:
    s = snap("o-1", version=3, revision=2, owner_id="u1", space_id="s1", tags=("a",), access_version=2)
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save(s))
        req = await wire.command("update")
        assert req.doc["update"] == ORDERS
        [u] = updates(req)
        assert u["q"] == {
            "_id": {"t": "(0)", "a": "o-1"},
            "tenant_id": "(0)",
            "aggregate_id": "o-1",
            "version": {"$lt": 3},
            "state_revision": {"$lte": 2},
        }
        assert u["upsert"] is True
        assert not u.get("multi")
        [stage] = u["u"]
        doc = stage["$replaceWith"]
        assert doc["_id"] == {"$literal": {"t": "(0)", "a": "o-1"}}
        # the replacement keeps the filter's _id to the field order: on an update another _id
        # (documents compare field by field, so {a, t} is another one) is error 66 ImmutableField,
        # and t before a is the key order pending pages by
        assert list(u["q"]["_id"]) == list(doc["_id"]["$literal"]) == ["t", "a"]
        assert doc["tenant_id"] == {"$literal": "(0)"} and doc["aggregate_id"] == {"$literal": "o-1"}
        assert doc["version"] == {"$literal": 3} and doc["state_revision"] == {"$literal": 2}
        # the state is data (a "$..." string is not a field path) and its decimal is Decimal128
        state = doc["state"]["$literal"]
        assert state["note"] == "$not-a-path"
        assert state["total"] == Decimal128("12.50")
        assert doc["owner_id"] == {"$literal": "u1"} and doc["space_id"] == {"$literal": "s1"}
        assert doc["access"] == {"$literal": {"owner_id": "u1", "space_id": "s1", "tags": ["a"]}}
        assert doc["deleted"] == {"$literal": False}
        # a stale mark of a version up to its own is cleared in the same write
        assert doc["stale_version"] == {"$cond": [{"$gt": ["$stale_version", 3]}, "$stale_version", "$$REMOVE"]}
        req.replies(upsert_reply())
        assert await call.result() is True


async def test_save_refused_by_a_higher_state_revision_marks_it_stale(store: MongoSnapshotStore, wire: Wire) -> None:
    s = snap("o-1", version=5, revision=1)
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save(s))
        (await wire.command("update")).replies({"n": 0, "nModified": 0, "writeErrors": [E11000]})
        req = await wire.command("update")
        [u] = updates(req)
        assert u["q"] == {
            "_id": {"t": "(0)", "a": "o-1"},
            "tenant_id": "(0)",
            "aggregate_id": "o-1",
            "state_revision": {"$gt": 1},
            "version": {"$lt": 5},
        }
        assert u["u"] == {"$max": {"stale_version": 5}}
        assert not u.get("upsert")
        req.replies({"n": 1, "nModified": 1})
        assert await call.result() is False


async def test_save_that_meets_the_key_with_a_write_concern_error_is_unavailable(
    store: MongoSnapshotStore, wire: Wire
) -> None:
    """The duplicate key and the write concern error in one reply (a 7.0 server waits for the
    write concern also after a duplicate key: src/mongo/db/ops/write_ops_exec.cpp,
    ``LastOpFixer``): the stored snapshot the key met may roll back, so the save is not decided
    as refused from it: StorageUnavailable, retried."""
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save(snap("o-1", version=2, revision=2)))
        (await wire.command("update")).replies(
            {"n": 0, "nModified": 0, "writeErrors": [E11000], "writeConcernError": write_concern_timeout()}
        )
        with pytest.raises(StorageUnavailable, match="write concern"):
            await call.result()


async def test_save_refused_by_a_later_version_answers_false(store: MongoSnapshotStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save(snap("o-1", version=2, revision=2)))
        (await wire.command("update")).replies({"n": 0, "nModified": 0, "writeErrors": [E11000]})
        (await wire.command("update")).replies({"n": 0, "nModified": 0})  # not a higher revision
        req = await wire.command("find")
        assert req.doc["filter"] == {
            "_id": {"t": "(0)", "a": "o-1"},
            "tenant_id": "(0)",
            "aggregate_id": "o-1",
        }
        req.replies({"cursor": {"id": 0, "ns": f"{DB}.{ORDERS}", "firstBatch": [{"version": 7, "state_revision": 2}]}})
        assert await call.result() is False


async def test_save_tries_again_when_a_concurrent_insert_of_a_lower_version_won(
    store: MongoSnapshotStore, wire: Wire
) -> None:
    s = snap("o-1", version=4, revision=2)
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save(s))
        (await wire.command("update")).replies({"n": 0, "nModified": 0, "writeErrors": [E11000]})
        (await wire.command("update")).replies({"n": 0, "nModified": 0})
        (await wire.command("find")).replies(
            {"cursor": {"id": 0, "ns": f"{DB}.{ORDERS}", "firstBatch": [{"version": 1, "state_revision": 2}]}}
        )
        req = await wire.command("update")
        assert updates(req)[0]["q"] == conditional_upsert_filter(s)
        req.replies({"n": 1, "nModified": 1})
        assert await call.result() is True


async def test_save_all_of_one_type_is_one_unordered_update(store: MongoSnapshotStore, wire: Wire) -> None:
    batch = [snap("o-1"), snap("o-2", version=9), snap("o-3")]
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save_all(batch))
        req = await wire.command("update")
        assert req.doc["update"] == ORDERS
        assert req.doc["ordered"] is False
        sent = updates(req)
        assert [u["q"] for u in sent] == [conditional_upsert_filter(s) for s in batch]
        assert all(u["upsert"] is True for u in sent)
        assert sent[1]["u"][0]["$replaceWith"]["version"] == {"$literal": 9}
        req.replies({"n": 3, "nModified": 1, "upserted": [{"index": 0, "_id": 1}, {"index": 2, "_id": 3}]})
        outcomes = await call.result()
    assert [(o.ref.id, o.version, o.status) for o in outcomes] == [
        ("o-1", 3, "saved"),
        ("o-2", 9, "saved"),
        ("o-3", 3, "saved"),
    ]


async def test_save_all_sends_one_update_per_type_and_one_per_round(store: MongoSnapshotStore, wire: Wire) -> None:
    batch = [snap("o-1", version=1), snap("c-1", aggregate="cart"), snap("o-1", version=2), snap("o-2")]
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save_all(batch))
        first = await wire.command("update")
        assert (first.doc["update"], first.doc["ordered"]) == (ORDERS, False)
        assert [u["q"]["_id"]["a"] for u in updates(first)] == ["o-1", "o-2"]
        assert updates(first)[0]["q"]["version"] == {"$lt": 1}
        first.replies(upsert_reply(2))
        second = await wire.command("update")
        assert (second.doc["update"], second.doc["ordered"]) == (CARTS, False)
        second.replies(upsert_reply(1))
        third = await wire.command("update")  # the second round: o-1 at version 2
        assert (third.doc["update"], third.doc["ordered"]) == (ORDERS, False)
        assert [u["q"]["version"] for u in updates(third)] == [{"$lt": 2}]
        third.replies({"n": 1, "nModified": 1})
        outcomes = await call.result()
    assert [(o.ref.aggregate, o.ref.id, o.version, o.status) for o in outcomes] == [
        ("order", "o-1", 1, "saved"),
        ("cart", "c-1", 3, "saved"),
        ("order", "o-1", 2, "saved"),
        ("order", "o-2", 3, "saved"),
    ]


async def test_save_all_saves_an_item_that_met_the_key_again_alone(store: MongoSnapshotStore, wire: Wire) -> None:
    batch = [snap("o-1"), snap("o-2", version=6, revision=1), snap("o-3")]
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save_all(batch))
        bulk = await wire.command("update")
        assert len(updates(bulk)) == 3
        bulk.replies({"n": 2, "nModified": 0, "writeErrors": [{**E11000, "index": 1}]})
        alone = await wire.command("update")  # o-2 again, alone, as save would
        assert [u["q"] for u in updates(alone)] == [conditional_upsert_filter(batch[1])]
        assert updates(alone)[0]["upsert"] is True
        alone.replies({"n": 0, "nModified": 0, "writeErrors": [E11000]})
        stale = await wire.command("update")  # a higher state revision is stored: marked stale
        assert updates(stale)[0]["u"] == {"$max": {"stale_version": 6}}
        stale.replies({"n": 1, "nModified": 1})
        outcomes = await call.result()
    assert [(o.ref.id, o.status) for o in outcomes] == [
        ("o-1", "saved"),
        ("o-2", "unchanged"),
        ("o-3", "saved"),
    ]


async def test_save_all_fails_an_item_the_server_refused_and_saves_the_rest(
    store: MongoSnapshotStore, wire: Wire
) -> None:
    batch = [snap("o-1"), snap("o-2"), snap("o-3")]
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save_all(batch))
        bulk = await wire.command("update")
        bulk.replies(
            {
                "n": 2,
                "nModified": 0,
                "upserted": [{"index": 0, "_id": 1}, {"index": 2, "_id": 3}],
                "writeErrors": [{"index": 1, "code": 17419, "errmsg": "Resulting document after update is larger"}],
            }
        )
        outcomes = await call.result()
    assert [(o.ref.id, o.status) for o in outcomes] == [("o-1", "saved"), ("o-2", "failed"), ("o-3", "saved")]
    assert outcomes[1].reason is not None and "17419" in outcomes[1].reason
    assert "larger" in outcomes[1].reason


async def test_save_all_fails_a_state_bson_cannot_hold_and_sends_the_rest(
    store: MongoSnapshotStore, wire: Wire
) -> None:
    batch = [snap("o-1"), snap("o-2", state={"n": 2**70}), snap("o-3", state={"d": Decimal("1" * 35)})]
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save_all([*batch, snap("o-4")]))
        bulk = await wire.command("update")
        assert [u["q"]["_id"]["a"] for u in updates(bulk)] == ["o-1", "o-4"]
        bulk.replies(upsert_reply(2))
        outcomes = await call.result()
    assert [o.status for o in outcomes] == ["saved", "failed", "failed", "saved"]
    assert all(o.reason and "not BSON" in o.reason for o in outcomes[1:3])


async def test_save_of_a_state_bson_cannot_hold_raises_invalid_input(store: MongoSnapshotStore) -> None:
    with pytest.raises(InvalidInput, match="not BSON"):
        await store.save(snap("o-1", state={"x": object()}))


async def test_pending_filter_sort_and_limit(rebuilds: MongoSnapshotRebuilds, wire: Wire) -> None:
    type = AggregateType(context=CTX, aggregate="order")
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, rebuilds.pending(type, 3, ref("o-5", tenant="t1"), 2))
        req = await wire.command("find")
        assert req.doc["find"] == ORDERS
        assert req.doc["filter"] == {"state_revision": {"$lt": 3}, "_id": {"$gt": {"t": "t1", "a": "o-5"}}}
        assert list(req.doc["filter"]["_id"]["$gt"]) == ["t", "a"]  # key order: tenant, then id
        assert req.doc["sort"] == {"_id": 1}
        assert req.doc["limit"] == 2
        assert req.doc["projection"] == {"_id": 1}
        req.replies(
            {
                "cursor": {
                    "id": 0,
                    "ns": f"{DB}.{ORDERS}",
                    "firstBatch": [{"_id": {"t": "t1", "a": "o-6"}}, {"_id": {"t": "t2", "a": "a"}}],
                }
            }
        )
        assert await call.result() == [ref("o-6", tenant="t1"), ref("a", tenant="t2")]


async def test_pending_from_the_start_has_no_key_bound(rebuilds: MongoSnapshotRebuilds, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, rebuilds.pending(AggregateType(context=CTX, aggregate="order"), 1, None, 10))
        req = await wire.command("find")
        assert req.doc["filter"] == {"state_revision": {"$lt": 1}}
        req.replies({"cursor": {"id": 0, "ns": f"{DB}.{ORDERS}", "firstBatch": []}})
        assert await call.result() == []


async def test_first_touch_records_the_format_and_creates_the_indexes(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    store = MongoSnapshotStore(mongo_client, DB, context=CTX, sharding=MongoSharding.OFF)
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.load(ref("o-1")))
        fam = await wire.command("findAndModify")
        assert fam.doc["findAndModify"] == TABLES
        assert fam.doc["query"] == {"_id": ORDERS}
        assert fam.doc["upsert"] is True and fam.doc["new"] is True
        [stage] = fam.doc["update"]
        assert stage["$set"]["format"] == {"$ifNull": ["$format", 5]}
        assert stage["$set"]["context"] == {"$literal": CTX}
        assert stage["$set"]["aggregate"] == {"$literal": "order"}
        fam.replies({"value": {"_id": ORDERS, "format": 5}})
        create = await wire.command("create")
        assert create.doc["create"] == ORDERS
        create.replies({})
        indexes = await wire.command("createIndexes")
        assert indexes.doc["createIndexes"] == ORDERS
        assert [dict(i) for i in indexes.doc["indexes"]] == [
            {
                "key": {"tenant_id": 1, "owner_id": 1},
                "name": "tenant_id_1_owner_id_1",
                "partialFilterExpression": {"deleted": False},
            },
            {
                "key": {"tenant_id": 1, "space_id": 1},
                "name": "tenant_id_1_space_id_1",
                "partialFilterExpression": {"deleted": False},
            },
        ]
        assert [dict(i) for i in indexes.doc["indexes"]] == snapshot_index_specs()
        indexes.replies({})
        (await wire.command("find")).replies({"cursor": {"id": 0, "ns": f"{DB}.{ORDERS}", "firstBatch": []}})
        assert await call.result() is None
        # once per store: the next call goes straight to its own command
        call = Call()
        tg.start_soon(call.run, store.load(ref("o-2")))
        (await wire.command("find")).replies({"cursor": {"id": 0, "ns": f"{DB}.{ORDERS}", "firstBatch": []}})
        assert await call.result() is None


async def test_concurrent_first_touches_create_the_collection_once(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    store = MongoSnapshotStore(mongo_client, DB, context=CTX, sharding=MongoSharding.OFF)
    empty = {"cursor": {"id": 0, "ns": f"{DB}.{ORDERS}", "firstBatch": []}}
    async with anyio.create_task_group() as tg:
        first, second = Call(), Call()
        tg.start_soon(first.run, store.load(ref("o-1")))
        tg.start_soon(second.run, store.load(ref("o-2")))
        (await wire.command("findAndModify")).replies({"value": {"_id": ORDERS, "format": 5}})
        (await wire.command("create")).replies({})
        (await wire.command("createIndexes")).replies({})
        (await wire.command("find")).replies(empty)
        (await wire.command("find")).replies(empty)
        assert (await first.result(), await second.result()) == (None, None)


async def test_an_existing_collection_is_not_an_error(mongo_client: AsyncMongoClient[Any], wire: Wire) -> None:
    store = MongoSnapshotStore(mongo_client, DB, context=CTX, sharding=MongoSharding.OFF)
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.create_collection("order"))
        (await wire.command("findAndModify")).replies({"value": {"_id": ORDERS, "format": 5}})
        # 7.0+ answers 48 only when the existing collection has other options (a validator, ...)
        server_error(
            await wire.command("create"),
            48,
            f"namespace {DB}.{ORDERS} already exists, but with different options: "
            "{ validator: { tenant_id: { $exists: true } } }",
        )
        (await wire.command("createIndexes")).replies({})
        await call.result()


async def test_a_collection_recorded_in_another_format_is_refused(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    store = MongoSnapshotStore(mongo_client, DB, context=CTX, sharding=MongoSharding.OFF)
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.create_collection("order"))
        (await wire.command("findAndModify")).replies({"value": {"_id": ORDERS, "format": 4}})
        with pytest.raises(FormatError, match="format 4"):
            await call.result()


async def test_validate_requires_the_record_and_the_indexes(mongo_client: AsyncMongoClient[Any], wire: Wire) -> None:
    store = MongoSnapshotStore(mongo_client, DB, context=CTX, ddl=Ddl.VALIDATE, sharding=MongoSharding.OFF)
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.create_collection("order"))
        req = await wire.command("find")
        assert (req.doc["find"], req.doc["filter"]) == (TABLES, {"_id": ORDERS})
        req.replies({"cursor": {"id": 0, "ns": f"{DB}.{TABLES}", "firstBatch": [{"_id": ORDERS, "format": 5}]}})
        listed = await wire.command("listIndexes")
        assert listed.doc["listIndexes"] == ORDERS
        owner = {**snapshot_index_specs()[0], "v": 2}
        listed.replies(
            {
                "cursor": {
                    "id": 0,
                    "ns": f"{DB}.{ORDERS}",
                    "firstBatch": [{"key": {"_id": 1}, "name": "_id_"}, owner],
                }
            }
        )
        with pytest.raises(FormatError, match="tenant_id_1_space_id_1"):
            await call.result()
        # nothing is created under validate: no record is a refusal
        call = Call()
        tg.start_soon(call.run, store.create_collection("order"))
        (await wire.command("find")).replies({"cursor": {"id": 0, "ns": f"{DB}.{TABLES}", "firstBatch": []}})
        with pytest.raises(FormatError, match="no format record"):
            await call.result()


async def test_a_sharded_collection_is_sharded_on_tenant_and_hashed_id(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    store = MongoSnapshotStore(mongo_client, DB, context=CTX, sharding=MongoSharding.ON)
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.create_collection("order"))
        (await wire.command("findAndModify")).replies({"value": {"_id": ORDERS, "format": 5}})
        (await wire.command("create")).replies({})
        indexes = await wire.command("createIndexes")
        assert [dict(i) for i in indexes.doc["indexes"]][2:] == [
            {"key": {"tenant_id": 1, "aggregate_id": "hashed"}, "name": "tenant_id_1_aggregate_id_hashed"}
        ]
        indexes.replies({})
        shard = await wire.command("shardCollection")
        assert shard.doc["shardCollection"] == f"{DB}.{ORDERS}"
        assert shard.doc["key"] == {"tenant_id": 1, "aggregate_id": "hashed"}
        assert shard.doc["$db"] == "admin"
        shard.replies({})
        await call.result()


async def test_claim_is_one_atomic_upsert_answering_the_table(rebuilds: MongoSnapshotRebuilds, wire: Wire) -> None:
    type = AggregateType(context=CTX, aggregate="order")
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, rebuilds.claim(type, 4))
        req = await wire.command("findAndModify")
        assert req.doc["findAndModify"] == TABLES
        assert req.doc["query"] == {"_id": ORDERS}
        assert req.doc["upsert"] is True and req.doc["new"] is True
        stages = req.doc["update"]
        assert stages[0] == {
            "$set": {
                "_claim": {
                    "$or": [
                        {"$eq": [{"$ifNull": ["$revision", None]}, None]},
                        {"$lt": [{"$ifNull": ["$revision", None]}, 4]},
                    ]
                }
            }
        }
        assert stages[1]["$set"]["revision"] == {"$cond": ["$_claim", 4, "$revision"]}
        assert stages[-1] == {"$unset": "_claim"}
        req.replies(
            {
                "value": {
                    "_id": ORDERS,
                    "revision": 4,
                    "rebuilding": False,
                    "backfilled": False,
                    "updated_at": 1700000000000,
                }
            }
        )
        assert await call.result() == SnapshotTable(type=type, revision=4, updated_at=1700000000000)


async def test_mark_sets_the_flags_given_at_the_claimed_revision(rebuilds: MongoSnapshotRebuilds, wire: Wire) -> None:
    type = AggregateType(context=CTX, aggregate="order")
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, rebuilds.mark(type, 4, backfilled=True))
        req = await wire.command("findAndModify")
        assert req.doc["query"] == {"_id": ORDERS, "revision": 4}
        assert not req.doc.get("upsert")
        assert req.doc["update"] == [{"$set": {"updated_at": {"$toLong": "$$NOW"}, "backfilled": True}}]
        req.replies({"value": None})
        assert await call.result() is None


async def test_mark_stale_sets_version_plus_one_unless_later(store: MongoSnapshotStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.mark_stale(ref("o-1")))
        req = await wire.command("update")
        [u] = updates(req)
        assert u["q"] == {"_id": {"t": "(0)", "a": "o-1"}, "tenant_id": "(0)", "aggregate_id": "o-1"}
        assert u["u"] == [
            {"$set": {"stale_version": {"$max": [{"$ifNull": ["$stale_version", 0]}, {"$add": ["$version", 1]}]}}}
        ]
        req.replies({"n": 0, "nModified": 0})
        assert await call.result() is False


async def test_rewrite_is_a_guarded_upsert_clearing_the_stale_mark(rebuilds: MongoSnapshotRebuilds, wire: Wire) -> None:
    s = snap("o-1", version=5, revision=3)
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, rebuilds.rewrite(s))
        req = await wire.command("update")
        [u] = updates(req)
        assert u["q"] == {
            "_id": {"t": "(0)", "a": "o-1"},
            "tenant_id": "(0)",
            "aggregate_id": "o-1",
            "$or": [
                {"state_revision": {"$lt": 3}, "version": {"$lte": 5}},
                {"state_revision": 3, "version": {"$lt": 5}},
            ],
        }
        assert u["upsert"] is True
        doc = u["u"][0]["$replaceWith"]
        assert doc["version"] == {"$literal": 5} and doc["state_revision"] == {"$literal": 3}
        assert doc["stale_version"] == "$$REMOVE"
        req.replies({"n": 1, "nModified": 1})
        assert await call.result() is True
        # refused by the guard: the upsert meets the key
        call = Call()
        tg.start_soon(call.run, rebuilds.rewrite(s))
        (await wire.command("update")).replies({"n": 0, "nModified": 0, "writeErrors": [E11000]})
        assert await call.result() is False


def test_a_save_keeps_a_later_stale_mark_of_its_own_record() -> None:
    s = snap("o-1", version=5, stale_version=8)
    mark = {"$max": ["$stale_version", 8]}
    assert snapshot_pipeline(s)[0]["$replaceWith"]["stale_version"] == {"$cond": [{"$gt": [mark, 5]}, mark, "$$REMOVE"]}


async def test_load_reads_decimals_back_exactly(store: MongoSnapshotStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.load(ref("o-1")))
        req = await wire.command("find")
        req.replies(
            {
                "cursor": {
                    "id": 0,
                    "ns": f"{DB}.{ORDERS}",
                    "firstBatch": [
                        {
                            "_id": {"t": "(0)", "a": "o-1"},
                            "tenant_id": "(0)",
                            "aggregate_id": "o-1",
                            "version": 4,
                            "state_revision": 2,
                            "state": {"total": Decimal128("-0.10"), "n": 1},
                            "owner_id": "u1",
                            "space_id": "",
                            "access": {"owner_id": "u1", "space_id": "", "tags": ["x"]},
                            "access_version": 3,
                            "deleted": False,
                            "event_time": 17,
                            "stale_version": 6,
                        }
                    ],
                }
            }
        )
        record = await call.result()
    assert record == SnapshotRecord(
        ref=ref("o-1"),
        version=4,
        state_revision=2,
        state={"total": Decimal("-0.10"), "n": 1},
        owner_id="u1",
        tags=("x",),
        access_version=3,
        event_time=17,
        stale_version=6,
    )
    assert str(record.state["total"]) == "-0.10"


def unavailable(operation: str) -> float:
    labels = {"store": "snapshots", "operation": operation}
    return REGISTRY.get_sample_value("wowd_store_unavailable_total", labels) or 0.0


async def test_a_network_error_is_storage_unavailable_and_counted(store: MongoSnapshotStore, wire: Wire) -> None:
    before = unavailable("save")
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save(snap("o-1")))
        (await wire.command("update")).hangup()
        with pytest.raises(StorageUnavailable):
            await call.result()
    assert unavailable("save") == before + 1


async def test_a_write_concern_error_of_a_bulk_raises_storage_unavailable(
    store: MongoSnapshotStore, wire: Wire
) -> None:
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save_all([snap("o-1"), snap("o-2")]))
        (await wire.command("update")).replies(
            {
                "n": 2,
                "nModified": 2,
                "writeConcernError": write_concern_timeout(),
            }
        )
        with pytest.raises(StorageUnavailable, match="replication"):
            await call.result()


@pytest.mark.parametrize(
    ("code", "errmsg"),
    [
        (10107, "Not-primary error while processing 'update' operation on 'wowd_wire' database"),
        (11602, "operation was interrupted because of a replica set state change"),
        (50, "operation exceeded time limit"),
    ],
    ids=["NotWritablePrimary", "InterruptedDueToReplStateChange", "MaxTimeMSExpired"],
)
async def test_an_election_or_timeout_in_a_bulks_write_errors_is_storage_unavailable(
    store: MongoSnapshotStore, wire: Wire, code: int, errmsg: str
) -> None:
    """A stepdown or the operation timeout met part way through an unordered bulk comes back per
    item in writeErrors (PyMongo does not retry those): the batch is retried whole by the caller,
    not its snapshots reported failed (and dropped)."""
    before = unavailable("save_all")
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save_all([snap("o-1"), snap("o-2"), snap("o-3")]))
        (await wire.command("update")).replies(
            {
                "n": 1,
                "nModified": 0,
                "upserted": [{"index": 0, "_id": {"t": "(0)", "a": "o-1"}}],
                "writeErrors": [{"index": 1, "code": code, "errmsg": errmsg}, {**E11000, "index": 2}],
            }
        )
        with pytest.raises(StorageUnavailable, match=f"error {code}"):
            await call.result()
    assert unavailable("save_all") == before + 1


async def test_save_all_fails_an_item_of_another_context_alone(store: MongoSnapshotStore, wire: Wire) -> None:
    other = SnapshotRecord(
        ref=AggregateRef(context="other", aggregate="order", id="o-9"), version=1, state_revision=1, state={}
    )
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.save_all([other, snap("o-1")]))
        bulk = await wire.command("update")
        assert [u["q"]["_id"]["a"] for u in updates(bulk)] == ["o-1"]
        bulk.replies(upsert_reply(1))
        outcomes = await call.result()
    assert [o.status for o in outcomes] == ["failed", "saved"]


async def test_another_server_error_is_a_storage_error(rebuilds: MongoSnapshotRebuilds, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, rebuilds.table(AggregateType(context=CTX, aggregate="order")))
        server_error(
            await wire.command("find"),
            13,
            f'not authorized on {DB} to execute command {{ find: "{TABLES}", filter: {{ _id: "{ORDERS}" }} }}',
        )
        with pytest.raises(StorageError, match="not authorized") as info:
            await call.result()
        assert not isinstance(info.value, StorageUnavailable)


# --------------------------------------------------------------------------- load_many


def stored_doc(s: SnapshotRecord) -> dict[str, Any]:
    """A snapshot document as a save leaves it (what a find answers)."""
    r = s.ref
    return {
        "_id": {"t": r.tenant_id, "a": r.id},
        "tenant_id": r.tenant_id,
        "aggregate_id": r.id,
        "version": s.version,
        "state_revision": s.state_revision,
        "state": {k: Decimal128(v) if isinstance(v, Decimal) else v for k, v in s.state.items()},
        "owner_id": s.owner_id,
        "space_id": s.space_id,
        "access": {"owner_id": s.owner_id, "space_id": s.space_id, "tags": list(s.tags)},
        "access_version": s.access_version,
        "deleted": s.deleted,
        "event_time": s.event_time,
    }


DRIVER_FIELDS = {"$db", "lsid", "$clusterTime", "maxTimeMS", "$readPreference"}
"""What the driver adds to every command beside what the store asks for."""


async def test_load_many_is_one_find_per_type_with_in_on_the_key(store: MongoSnapshotStore, wire: Wire) -> None:
    o1, o2, o3 = snap("o-1", state={"total": Decimal("1.10")}), snap("o-2", version=9), snap("o-3")
    other_tenant = SnapshotRecord(ref=ref("o-1", tenant="t2"), version=2, state_revision=2, state={})
    cart = snap("c-1", aggregate="cart", owner_id="u1", tags=("a",))
    asked = [o1.ref, o2.ref, cart.ref, o3.ref, other_tenant.ref, o1.ref, ref("c-2", aggregate="cart")]
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.load_many(asked))
        orders = await wire.command("find")
        assert {k: v for k, v in orders.doc.items() if k not in DRIVER_FIELDS} == {
            "find": ORDERS,
            "filter": {
                "_id": {
                    "$in": [
                        {"t": "(0)", "a": "o-1"},
                        {"t": "(0)", "a": "o-2"},
                        {"t": "(0)", "a": "o-3"},
                        {"t": "t2", "a": "o-1"},
                    ]
                },
                "tenant_id": {"$in": ["(0)", "t2"]},
                "aggregate_id": {"$in": ["o-1", "o-2", "o-3"]},
            },
            # the limit is the refs asked; the driver asks one more in the batch so that the
            # server meets the end inside the first batch and closes the cursor there
            "limit": 4,
            "batchSize": 5,
        }
        assert all(list(k) == ["t", "a"] for k in orders.doc["filter"]["_id"]["$in"])  # the key's field order
        # o-3 has no snapshot: the server answers the others, in the index's order, and closes the cursor
        orders.replies(
            {
                "cursor": {
                    "firstBatch": [stored_doc(o1), stored_doc(o2), stored_doc(other_tenant)],
                    "id": 0,
                    "ns": f"{DB}.{ORDERS}",
                },
                "ok": 1.0,
            }
        )
        carts = await wire.command("find")
        assert carts.doc["find"] == CARTS
        assert carts.doc["filter"] == {
            "_id": {"$in": [{"t": "(0)", "a": "c-1"}, {"t": "(0)", "a": "c-2"}]},
            "tenant_id": {"$in": ["(0)"]},
            "aggregate_id": {"$in": ["c-1", "c-2"]},
        }
        assert (carts.doc["limit"], carts.doc["batchSize"]) == (2, 3)
        carts.replies({"cursor": {"firstBatch": [stored_doc(cart)], "id": 0, "ns": f"{DB}.{CARTS}"}, "ok": 1.0})
        got = await call.result()
    assert got == {o1.ref: o1, o2.ref: o2, other_tenant.ref: other_tenant, cart.ref: cart}
    assert got[o1.ref].state == {"total": Decimal("1.10")}


async def test_load_many_reads_on_when_the_server_cuts_its_first_batch(store: MongoSnapshotStore, wire: Wire) -> None:
    """A server answers at most 16 MiB a batch: a first batch cut there leaves the cursor open
    (its id), and the store reads the rest with getMore."""
    snaps = [snap(f"o-{i}") for i in range(3)]
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.load_many([s.ref for s in snaps]))
        find = await wire.command("find")
        first = {"firstBatch": [stored_doc(snaps[0])], "id": 7_431_862_091, "ns": f"{DB}.{ORDERS}"}
        find.replies({"cursor": first, "ok": 1.0})
        more = await wire.command("getMore")
        assert more.doc["getMore"] == 7_431_862_091 and more.doc["collection"] == ORDERS
        assert more.doc["batchSize"] == 2  # what the limit leaves
        more.replies(
            {"cursor": {"nextBatch": [stored_doc(s) for s in snaps[1:]], "id": 0, "ns": f"{DB}.{ORDERS}"}, "ok": 1.0}
        )
        got = await call.result()
    assert got == {s.ref: s for s in snaps}


async def test_load_many_of_nothing_sends_nothing(store: MongoSnapshotStore, mock_server: MockupDB) -> None:
    assert await store.load_many([]) == {}
    with pytest.raises(InvalidInput):
        await store.load_many([ref("o-1"), AggregateRef(context="other", aggregate="order", id="o-1")])
    with pytest.raises(AssertionError):  # nothing came: receives() finds no request
        mock_server.receives(timeout=0)


async def test_load_many_network_error_is_storage_unavailable(store: MongoSnapshotStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call()
        tg.start_soon(call.run, store.load_many([ref("o-1")]))
        (await wire.command("find")).hangup()
        with pytest.raises(StorageUnavailable, match="load_many"):
            await call.result()


def test_load_many_filters_are_split_to_fit_one_command() -> None:
    refs = [ref(f"order-{i:06d}", tenant=f"tenant-{i % 7}") for i in range(5_000)]
    whole = split_to_fit(refs, load_many_filter)
    assert whole == [refs]  # a feed batch and far more: one command
    limit = 64 * 1024
    parts = split_to_fit(refs, load_many_filter, limit)
    assert len(parts) > 1 and [r for p in parts for r in p] == refs
    assert all(len(bson.encode(load_many_filter(p))) <= limit for p in parts)
    assert split_to_fit([], load_many_filter) == []
