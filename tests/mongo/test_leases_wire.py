"""Black-pipe tests of MongoSlotLeaseStore: the real async PyMongo driver against MockupDB.

Each test plays the server: it receives every command the store sends, asserts the document
exactly (the conditions and pipeline updates are the store's whole logic), and scripts the
answer, including lost races, duplicate keys, elections and dropped connections.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import anyio
import pytest
from bson.int64 import Int64
from bson.objectid import ObjectId
from mockupdb import MockupDB
from pymongo import AsyncMongoClient
from pymongo.write_concern import WriteConcern

from tests.mongo.conftest import Wire, primary, server_error
from tests.mongo.leases_support import (
    NS,
    T0,
    Call,
    at,
    body,
    client_times,
    equality_mismatches,
    ms,
    projected,
    reply_cursor,
    reply_value,
    slot_doc,
)
from wowd.errors import ConfigError, StorageError, StorageUnavailable
from wowd.metrics import REGISTRY
from wowd.model import AcquireResult, Owner, SlotLease
from wowd.stores.base import SlotLeaseStore
from wowd.stores.mongo.leases import MongoSlotLeaseStore, take_update

pytestmark = pytest.mark.anyio

TTL = timedelta(seconds=10)
TOL = timedelta(seconds=1)
A = Owner(key="host-a:11:aaaaaa")
B = Owner(key="host-b:22:bbbbbb")

NOT_HELD = {"$not": [{"$gt": ["$holdUntil", "$$NOW"]}]}
"""No live hold (a timer view rebuild's) on the slot."""

FREE = {
    "$and": [
        NOT_HELD,
        {
            "$or": [
                {"$eq": [{"$ifNull": ["$ownerKey", None]}, None]},
                {"$lt": [{"$add": ["$expiresAt", 1000]}, "$$NOW"]},
            ]
        },
    ]
}
"""Free: not held, and no owner or expired beyond the tolerance (1 s) by the store clock."""


def take(owner: str, ttl_ms: int = 10_000) -> list[dict[str, Any]]:
    return [
        {
            "$set": {
                "writtenAt": "$$NOW",
                "ownerKey": {"$literal": owner},
                "lastOwnerKey": {"$literal": owner},
                "fence": {"$add": [{"$ifNull": ["$fence", 0]}, 1]},
                "incarnation": {"$add": [{"$ifNull": ["$incarnation", 0]}, 1]},
            }
        },
        {
            "$set": {
                "expiresAt": {"$add": ["$writtenAt", ttl_ms]},
                "floor": {"$ifNull": ["$nextFloor", "$writtenAt"]},
            }
        },
        {"$set": {"ceiling": "$expiresAt", "nextFloor": {"$max": ["$expiresAt", "$floor"]}}},
    ]


FIELDS = {
    "_id": 0,
    "ns": 1,
    "slot": 1,
    "ownerKey": 1,
    "incarnation": 1,
    "fence": 1,
    "expiresAt": 1,
    "floor": 1,
    "ceiling": 1,
    "writtenAt": 1,
    "holdBy": 1,
    "holdUntil": 1,
}


def find_and_modify(query: dict[str, Any], update: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "findAndModify": "cosid_slot",
        "query": query,
        "update": update,
        "new": True,
        "fields": FIELDS,
        "upsert": False,
        **extra,
    }


def owner_read(owner: str, offset: int = 0, limit: int = 2) -> dict[str, Any]:
    return {
        "aggregate": "cosid_slot",
        "pipeline": [
            {"$match": {"ns": NS, "slot": {"$gte": offset, "$lt": offset + limit}}},
            {
                "$facet": {
                    "mine": [
                        {"$match": {"$or": [{"ownerKey": owner}, {"lastOwnerKey": owner}]}},
                        {"$sort": {"writtenAt": -1, "slot": 1}},
                        {
                            "$set": {
                                "live": {
                                    "$and": [
                                        {"$eq": ["$ownerKey", {"$literal": owner}]},
                                        {"$gt": ["$expiresAt", "$$NOW"]},
                                    ]
                                },
                                "storeNow": "$$NOW",
                            }
                        },
                        {"$project": {"_id": 0}},
                    ],
                    "present": [{"$project": {"_id": 0, "slot": 1}}],
                }
            },
            {"$project": {"mine": 1, "present": "$present.slot"}},
        ],
        "cursor": {},
    }


def tenure(lease: SlotLease) -> dict[str, Any]:
    return {
        "ns": lease.namespace,
        "slot": lease.slot,
        "ownerKey": lease.owner_key,
        "incarnation": lease.incarnation,
        "fence": lease.fence,
    }


def held(lease: SlotLease) -> dict[str, Any]:
    return {**tenure(lease), "$expr": {"$gt": ["$expiresAt", "$$NOW"]}}


def lease_of(doc: dict[str, Any]) -> SlotLease:
    return SlotLease(
        namespace=doc["ns"],
        slot=doc["slot"],
        owner_key=doc["ownerKey"],
        incarnation=doc["incarnation"],
        fence=doc["fence"],
        expires_at=ms(doc["expiresAt"]),
        floor=ms(doc["floor"]),
        ceiling=ms(doc["ceiling"]),
        written_at=ms(doc["writtenAt"]),
    )


@pytest.fixture(scope="module")
def mock_server() -> Iterator[MockupDB]:
    """One MockupDB for the module, overriding the conftest's per-test one. Each test still gets
    its own client (``mongo_client``) and reads every command it causes, so nothing carries over."""
    with primary() as server:
        yield server


@pytest.fixture
async def store(mongo_client: AsyncMongoClient[Any], wire: Wire) -> AsyncIterator[MongoSlotLeaseStore]:
    """A store whose indexes are in place (prepare answered on the wire)."""
    s = MongoSlotLeaseStore(mongo_client, "wowd", operation_timeout=None)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, s.prepare)
        (await wire.command("createIndexes")).ok()  # cosid_slot
        (await wire.command("createIndexes")).ok()  # cosid_replica
        await call.result()
    yield s
    await s.close()


async def namespace_known(wire: Wire, limit: int = 2, offset: int = 0) -> None:
    req = await wire.command("find")
    assert body(req) == {"find": "cosid_namespace", "filter": {"_id": NS}, "limit": 1, "singleBatch": True}
    reply_cursor(req, "cosid_namespace", [{"_id": NS, "limit": limit, "toleranceMs": 1000, "slotOffset": offset}])


async def owner_read_answered(
    wire: Wire, owner: Owner, mine: list[dict[str, Any]], present: list[int] | None = None
) -> None:
    req = await wire.command("aggregate")
    assert body(req) == owner_read(owner.key)
    reply_cursor(req, "cosid_slot", [{"mine": mine, "present": [0, 1] if present is None else present}])


async def next_command_is_slots_read(wire: Wire, store: MongoSlotLeaseStore) -> None:
    """Proves the previous call sent nothing more: the next command on the wire is this one."""
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.slots, NS)
        req = await wire.command("aggregate")
        assert body(req)["pipeline"][0] == {"$match": {"ns": NS}}
        reply_cursor(req, "cosid_slot", [])
        assert await call.result() == []


# --------------------------------------------------------------------------- DDL and first use


async def test_store_implements_the_protocol(mongo_client: AsyncMongoClient[Any]) -> None:
    assert isinstance(MongoSlotLeaseStore(mongo_client, "wowd", operation_timeout=None), SlotLeaseStore)


async def test_prepare_creates_the_unique_index_on_ns_and_slot_and_the_presence_ttl_index(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    s = MongoSlotLeaseStore(mongo_client, "wowd", operation_timeout=None)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, s.prepare)
        req = await wire.command("createIndexes")
        assert body(req) == {
            "createIndexes": "cosid_slot",
            "indexes": [{"key": {"ns": 1, "slot": 1}, "name": "ns_1_slot_1", "unique": True}],
        }
        req.ok()
        req = await wire.command("createIndexes")
        assert body(req) == {
            "createIndexes": "cosid_replica",
            "indexes": [{"key": {"expiresAt": 1}, "name": "expiresAt_ttl", "expireAfterSeconds": 300}],
        }
        req.ok()
        await call.result()


async def test_concurrent_first_calls_send_one_create_indexes(mongo_client: AsyncMongoClient[Any], wire: Wire) -> None:
    s = MongoSlotLeaseStore(mongo_client, "wowd", operation_timeout=None)
    async with anyio.create_task_group() as tg:
        calls = [Call.start(tg, s.prepare) for _ in range(3)]
        for collection in ("cosid_slot", "cosid_replica"):
            req = await wire.command("createIndexes")
            assert body(req)["createIndexes"] == collection
            req.ok()
        for call in calls:
            await call.result()
    await next_command_is_slots_read(wire, s)


async def test_first_acquire_creates_index_namespace_and_slots_then_takes_the_first_free(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    s = MongoSlotLeaseStore(mongo_client, "wowd", operation_timeout=None)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, s.acquire, NS, A, 2, TTL, TOL)
        (await wire.command("createIndexes")).ok()

        req = await wire.command("find")
        reply_cursor(req, "cosid_namespace", [])
        req = await wire.command("insert")
        assert body(req) == {
            "insert": "cosid_namespace",
            "ordered": True,
            "documents": [{"_id": NS, "limit": 2, "toleranceMs": 1000, "slotOffset": 0}],
        }
        req.ok(n=1)

        req = await wire.command("aggregate")
        assert body(req) == owner_read(A.key)
        reply_cursor(req, "cosid_slot", [{"mine": [], "present": []}])

        req = await wire.command("insert")
        sent = body(req)
        assert all(isinstance(d.pop("_id"), ObjectId) for d in sent["documents"])
        never_held = {
            "ownerKey": None,
            "incarnation": 0,
            "lastOwnerKey": None,
            "fence": 0,
            "expiresAt": None,
            "floor": None,
            "ceiling": None,
            "nextFloor": None,
            "writtenAt": None,
        }
        assert sent == {
            "insert": "cosid_slot",
            "ordered": False,
            "documents": [{"ns": NS, "slot": 0, **never_held}, {"ns": NS, "slot": 1, **never_held}],
        }
        req.ok(n=2)

        req = await wire.command("findAndModify")
        assert body(req) == find_and_modify(
            {"ns": NS, "slot": {"$gte": 0, "$lt": 2}, "$expr": FREE}, take(A.key), sort={"slot": 1}
        )
        taken = slot_doc(0, owner=A.key, incarnation=1, fence=1)
        reply_value(req, projected(taken))

        result = await call.result()
    assert result == AcquireResult(status="acquired", lease=lease_of(taken))
    assert result.lease is not None and result.lease.expires_at == ms(T0) + 10_000


async def test_only_missing_slot_documents_are_created(store: MongoSlotLeaseStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, A, 2, TTL, TOL)
        await namespace_known(wire)
        await owner_read_answered(wire, A, [], present=[0])
        req = await wire.command("insert")
        assert [(d["ns"], d["slot"]) for d in body(req)["documents"]] == [(NS, 1)]
        req.ok(n=1)
        reply_value(await wire.command("findAndModify"), None)
        assert (await call.result()).status == "exhausted"


async def test_duplicate_key_on_slot_creation_is_a_race_not_an_error(store: MongoSlotLeaseStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, A, 2, TTL, TOL)
        await namespace_known(wire)
        await owner_read_answered(wire, A, [], present=[])
        req = await wire.command("insert")
        req.ok(
            n=1,
            writeErrors=[
                {
                    "index": 0,
                    "code": 11000,
                    "errmsg": "E11000 duplicate key error collection: wowd.cosid_slot",
                }
            ],
        )
        req = await wire.command("findAndModify")
        assert body(req)["query"] == {"ns": NS, "slot": {"$gte": 0, "$lt": 2}, "$expr": FREE}
        taken = slot_doc(1, owner=A.key)
        reply_value(req, projected(taken))
        assert (await call.result()).lease == lease_of(taken)


async def test_another_error_on_slot_creation_is_a_storage_error(store: MongoSlotLeaseStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, A, 2, TTL, TOL)
        await namespace_known(wire)
        await owner_read_answered(wire, A, [], present=[])
        (await wire.command("insert")).ok(
            n=0, writeErrors=[{"index": 0, "code": 121, "errmsg": "Document failed validation"}]
        )
        err = await call.error()
    assert type(err) is StorageError
    assert "Document failed validation" in str(err)


async def test_namespace_insert_race_reads_the_winner(store: MongoSlotLeaseStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, A, 2, TTL, TOL)
        reply_cursor(await wire.command("find"), "cosid_namespace", [])
        # a duplicate key is a write error of an ok answer, not a command error
        (await wire.command("insert")).ok(
            n=0,
            writeErrors=[
                {
                    "index": 0,
                    "code": 11000,
                    "errmsg": f"E11000 duplicate key error collection: wowd.cosid_namespace index: _id_ dup key: "
                    f'{{ _id: "{NS}" }}',
                    "keyPattern": {"_id": 1},
                    "keyValue": {"_id": NS},
                }
            ],
        )
        req = await wire.command("find")
        assert body(req)["filter"] == {"_id": NS}
        reply_cursor(req, "cosid_namespace", [{"_id": NS, "limit": 4, "toleranceMs": 1000, "slotOffset": 0}])
        result = await call.result()
    assert result.status == "refused"
    assert result.reason is not None and "limit=4" in result.reason


# --------------------------------------------------------------------------- namespace parameters


@pytest.mark.parametrize(
    ("recorded", "limit", "offset"),
    [({"limit": 3, "slotOffset": 0}, 2, 0), ({"limit": 2, "slotOffset": 4}, 2, 0), ({"limit": 2}, 2, 2)],
    ids=["other-limit", "other-offset", "old-document-reads-offset-0"],
)
async def test_refused_when_the_namespace_is_recorded_otherwise(
    store: MongoSlotLeaseStore, wire: Wire, recorded: dict[str, int], limit: int, offset: int
) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, A, limit, TTL, TOL, offset)
        reply_cursor(await wire.command("find"), "cosid_namespace", [{"_id": NS, "toleranceMs": 1000, **recorded}])
        result = await call.result()
    assert result.status == "refused" and result.lease is None
    assert result.reason is not None and NS in result.reason
    await next_command_is_slots_read(wire, store)  # nothing taken, nothing rewritten


async def test_namespace_without_slot_offset_reads_as_0_and_is_never_rewritten(
    store: MongoSlotLeaseStore, wire: Wire
) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, A, 2, TTL, TOL)
        reply_cursor(await wire.command("find"), "cosid_namespace", [{"_id": NS, "limit": 2, "toleranceMs": 1000}])
        await owner_read_answered(wire, A, [])  # straight to the slots: no update of the namespace
        reply_value(await wire.command("findAndModify"), projected(slot_doc(0, owner=A.key)))
        assert (await call.result()).acquired


# --------------------------------------------------------------------------- acquire paths


async def test_idempotent_acquire_returns_the_live_lease_unchanged_without_a_write(
    store: MongoSlotLeaseStore, wire: Wire
) -> None:
    """The answer is the stored lease, unchanged, seen at the read's ``$$NOW``: 9.6 s into a
    10 s lease the holder has 0.4 s left, not a fresh ttl."""
    mine = slot_doc(1, owner=A.key, incarnation=3, fence=5)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, A, 2, TTL, TOL)
        await namespace_known(wire)
        await owner_read_answered(wire, A, [{**mine, "live": True, "storeNow": at(9.6)}])
        result = await call.result()
    assert result == AcquireResult(status="acquired", lease=lease_of(mine))
    assert result.lease is not None
    assert result.lease.store_now == ms(at(9.6)) and result.lease.remaining_ms == 400
    await next_command_is_slots_read(wire, store)


async def test_a_take_answers_its_own_write_time_as_the_store_now(store: MongoSlotLeaseStore, wire: Wire) -> None:
    """A take's ``writtenAt`` is its ``$$NOW``: the holder counts the whole ttl from it."""
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, A, 2, TTL, TOL)
        await namespace_known(wire)
        await owner_read_answered(wire, A, [])
        req = await wire.command("findAndModify")
        assert body(req) == find_and_modify(
            {"ns": NS, "slot": {"$gte": 0, "$lt": 2}, "$expr": FREE}, take(A.key), sort={"slot": 1}
        )
        taken = slot_doc(0, owner=A.key, written=at(3))
        reply_value(req, projected(taken))
        result = await call.result()
    assert result.lease is not None and result.lease.remaining_ms == 10_000


async def test_sticky_takes_the_last_slot_guarded_by_the_fence_read(store: MongoSlotLeaseStore, wire: Wire) -> None:
    released = slot_doc(1, owner=None, last_owner=A.key, incarnation=3, fence=5)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, A, 2, TTL, TOL, 0, 0)  # preferred 0 comes after sticky
        await namespace_known(wire)
        await owner_read_answered(wire, A, [{**released, "live": False, "storeNow": at(20)}])
        req = await wire.command("findAndModify")
        assert body(req) == find_and_modify(
            {
                "ns": NS,
                "slot": 1,
                "fence": 5,
                "$expr": {
                    "$or": [
                        FREE,
                        {
                            "$and": [
                                NOT_HELD,
                                {"$eq": ["$ownerKey", {"$literal": A.key}]},
                                {"$lte": ["$expiresAt", "$$NOW"]},
                            ]
                        },
                    ]
                },
            },
            take(A.key),
        )
        taken = slot_doc(1, owner=A.key, incarnation=4, fence=6, written=at(30))
        reply_value(req, projected(taken))
        result = await call.result()
    assert result.lease == lease_of(taken)


async def test_lost_races_fall_through_sticky_preferred_then_free(store: MongoSlotLeaseStore, wire: Wire) -> None:
    mine = slot_doc(0, owner=None, last_owner=A.key, incarnation=2, fence=2)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, A, 3, TTL, TOL, 0, 2)
        await namespace_known(wire, limit=3)
        req = await wire.command("aggregate")
        assert body(req) == owner_read(A.key, limit=3)
        reply_cursor(req, "cosid_slot", [{"mine": [{**mine, "live": False, "storeNow": at(20)}], "present": [0, 1, 2]}])

        req = await wire.command("findAndModify")
        assert (body(req)["query"]["slot"], body(req)["query"]["fence"]) == (0, 2)
        reply_value(req, None)  # B took slot 0 meanwhile
        req = await wire.command("findAndModify")
        assert body(req) == find_and_modify({"ns": NS, "slot": 2, "$expr": FREE}, take(A.key))
        reply_value(req, None)  # preferred slot 2 is held
        req = await wire.command("findAndModify")
        assert body(req) == find_and_modify(
            {"ns": NS, "slot": {"$gte": 0, "$lt": 3}, "$expr": FREE}, take(A.key), sort={"slot": 1}
        )
        taken = slot_doc(1, owner=A.key, fence=4)
        reply_value(req, projected(taken))
        result = await call.result()
    assert result.lease == lease_of(taken)


async def test_preferred_slot_before_the_first_free(store: MongoSlotLeaseStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, B, 2, TTL, TOL, 0, 1)
        await namespace_known(wire)
        await owner_read_answered(wire, B, [])
        req = await wire.command("findAndModify")
        assert body(req) == find_and_modify({"ns": NS, "slot": 1, "$expr": FREE}, take(B.key))
        taken = slot_doc(1, owner=B.key)
        reply_value(req, projected(taken))
        assert (await call.result()).lease == lease_of(taken)


async def test_preferred_slot_outside_the_range_is_ignored(store: MongoSlotLeaseStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, B, 2, TTL, TOL, 0, 7)
        await namespace_known(wire)
        await owner_read_answered(wire, B, [])
        req = await wire.command("findAndModify")
        assert body(req)["query"]["slot"] == {"$gte": 0, "$lt": 2}
        reply_value(req, projected(slot_doc(0, owner=B.key)))
        assert (await call.result()).acquired


async def test_expired_lease_of_another_owner_is_taken_with_the_next_fence(
    store: MongoSlotLeaseStore, wire: Wire
) -> None:
    """The slot of A expired beyond the tolerance: B's free step takes it (fence 7 -> 8)."""
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, B, 2, timedelta(seconds=30), timedelta(milliseconds=2500), 4)
        await namespace_known(wire, offset=4)
        req = await wire.command("aggregate")
        assert body(req) == owner_read(B.key, offset=4)
        reply_cursor(req, "cosid_slot", [{"mine": [], "present": [4, 5]}])
        req = await wire.command("findAndModify")
        expired_beyond_2500ms = {
            "$and": [
                NOT_HELD,
                {
                    "$or": [
                        {"$eq": [{"$ifNull": ["$ownerKey", None]}, None]},
                        {"$lt": [{"$add": ["$expiresAt", 2500]}, "$$NOW"]},
                    ]
                },
            ]
        }
        assert body(req) == find_and_modify(
            {"ns": NS, "slot": {"$gte": 4, "$lt": 6}, "$expr": expired_beyond_2500ms},
            take(B.key, ttl_ms=30_000),
            sort={"slot": 1},
        )
        taken = slot_doc(4, owner=B.key, incarnation=5, fence=8, written=at(60), ttl_s=30, floor=at(10))
        reply_value(req, projected(taken))
        result = await call.result()
    assert result.lease == lease_of(taken)
    assert result.lease is not None and result.lease.floor == ms(at(10)) < result.lease.written_at


async def test_exhausted_when_no_slot_is_free(store: MongoSlotLeaseStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, B, 2, TTL, TOL)
        await namespace_known(wire)
        await owner_read_answered(wire, B, [])
        reply_value(await wire.command("findAndModify"), None)
        result = await call.result()
    assert result.status == "exhausted" and result.lease is None
    await next_command_is_slots_read(wire, store)


async def test_owner_keys_go_into_expressions_as_literals() -> None:
    sets = take_update("$ownerKey", 1000)[0]["$set"]
    assert sets["ownerKey"] == {"$literal": "$ownerKey"}
    assert sets["lastOwnerKey"] == {"$literal": "$ownerKey"}


async def test_bad_parameters_are_refused_before_any_io(store: MongoSlotLeaseStore) -> None:
    with pytest.raises(ConfigError):
        await store.acquire(NS, A, 0, TTL, TOL)
    with pytest.raises(ConfigError):
        await store.acquire(NS, A, 2, timedelta(0), TOL)
    with pytest.raises(ConfigError):
        await store.acquire(NS, A, 2, TTL, -TOL)
    with pytest.raises(ConfigError):
        await store.acquire(NS, A, 2, TTL, TOL, -1)


# --------------------------------------------------------------------------- renew and release

LEASE = SlotLease(
    namespace=NS,
    slot=1,
    owner_key=A.key,
    incarnation=3,
    fence=5,
    expires_at=ms(at(10)),
    floor=ms(T0),
    ceiling=ms(at(10)),
    written_at=ms(T0),
)


async def test_renew_matches_the_held_lease_and_extends_it_from_the_store_clock(
    store: MongoSlotLeaseStore, wire: Wire
) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.renew, LEASE, TTL, TOL)
        req = await wire.command("findAndModify")
        assert body(req) == find_and_modify(
            held(LEASE),
            [
                {"$set": {"writtenAt": "$$NOW"}},
                {"$set": {"expiresAt": {"$add": ["$writtenAt", 10_000]}}},
                {
                    "$set": {
                        "ceiling": "$expiresAt",
                        "nextFloor": {"$max": ["$expiresAt", "$floor", "$nextFloor"]},
                    }
                },
            ],
        )
        renewed = slot_doc(1, owner=A.key, incarnation=3, fence=5, written=at(4), floor=T0)
        reply_value(req, projected(renewed))
        result = await call.result()
    assert result == lease_of(renewed)
    assert result is not None and result.expires_at == ms(at(14)) and result.floor == LEASE.floor


async def test_release_clears_the_owner_and_records_the_next_floor(store: MongoSlotLeaseStore, wire: Wire) -> None:
    last_issued = ms(at(3))
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.release, LEASE, last_issued)
        req = await wire.command("update")
        assert body(req) == {
            "update": "cosid_slot",
            "ordered": True,
            "updates": [
                {
                    "q": tenure(LEASE),  # no expiry: an expired lease nobody took can be handed back
                    "u": [
                        {
                            "$set": {
                                "ownerKey": None,
                                "writtenAt": "$$NOW",
                                "expiresAt": {"$min": ["$expiresAt", "$$NOW"]},
                                "nextFloor": {"$max": [{"$toDate": last_issued + 1}, "$floor"]},
                            }
                        }
                    ],
                    "multi": False,
                    "upsert": False,
                }
            ],
        }
        req.ok(n=1, nModified=1)
        assert await call.result() is True


async def test_release_sends_last_issued_as_a_long_for_to_date(store: MongoSlotLeaseStore, wire: Wire) -> None:
    """``$toDate`` converts a long, not an int: a small ``last_issued`` must still go as int64."""
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.release, LEASE, 0)
        req = await wire.command("update")
        to_date = req.doc["updates"][0]["u"][0]["$set"]["nextFloor"]["$max"][0]["$toDate"]
        assert type(to_date) is Int64 and to_date == 1
        req.ok(n=0, nModified=0)
        assert await call.result() is False


# --------------------------------------------------------------------------- the CosId gaps wowd closes


async def test_expiry_is_decided_by_the_store_clock_never_a_client_clock(
    store: MongoSlotLeaseStore, wire: Wire
) -> None:
    """CosId compares client wall clocks; here every condition and stamp is ``$$NOW``, so a
    client clock skewed by any amount changes nothing that is sent."""
    mine = slot_doc(0, owner=A.key, incarnation=2, fence=2)
    sent: list[dict[str, Any]] = []
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, A, 2, TTL, TOL, 0, 1)
        await namespace_known(wire)
        req = await wire.command("aggregate")
        sent.append(body(req))
        reply_cursor(req, "cosid_slot", [{"mine": [{**mine, "live": False, "storeNow": at(20)}], "present": [0, 1]}])
        for _ in ("sticky", "preferred", "free"):
            req = await wire.command("findAndModify")
            sent.append(body(req))
            reply_value(req, None)
        assert (await call.result()).status == "exhausted"
    async with anyio.create_task_group() as tg:
        call2 = Call.start(tg, store.renew, LEASE, TTL, TOL)
        req = await wire.command("findAndModify")
        sent.append(body(req))
        reply_value(req, None)
        assert await call2.result() is None
    for command in sent:
        assert client_times(command) == [], command
        assert "$$NOW" in repr(command)


async def test_renew_after_the_slot_changed_hands_matches_nothing(store: MongoSlotLeaseStore, wire: Wire) -> None:
    """CosId lets a lost owner keep working; here B's take moved the fence on, so A's renewal
    (fence 5) cannot match the document and A learns it lost the slot."""
    now_held_by_b = slot_doc(1, owner=B.key, incarnation=4, fence=6, written=at(12))
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.renew, LEASE, TTL, TOL)
        req = await wire.command("findAndModify")
        query = body(req)["query"]
        assert equality_mismatches(query, now_held_by_b) == {
            "ownerKey": (A.key, B.key),
            "incarnation": (3, 4),
            "fence": (5, 6),
        }
        reply_value(req, None)
        assert await call.result() is None


async def test_a_restarted_owner_gets_a_new_incarnation_and_the_old_renewal_fails(
    store: MongoSlotLeaseStore, wire: Wire
) -> None:
    """Same owner key after a restart: the take bumps incarnation (and fence), so a renewal or a
    release from the previous process of that key misses."""
    old = slot_doc(1, owner=A.key, incarnation=3, fence=5)  # LEASE's document, expired
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, A, 2, TTL, TOL)
        await namespace_known(wire)
        await owner_read_answered(wire, A, [{**old, "live": False, "storeNow": at(11)}])
        req = await wire.command("findAndModify")
        assert body(req)["query"]["fence"] == 5
        assert body(req)["update"][0]["$set"]["incarnation"] == {"$add": [{"$ifNull": ["$incarnation", 0]}, 1]}
        restarted = slot_doc(1, owner=A.key, incarnation=4, fence=6, written=at(11))
        reply_value(req, projected(restarted))
        result = await call.result()
    assert result.lease is not None and (result.lease.incarnation, result.lease.fence) == (4, 6)

    async with anyio.create_task_group() as tg:
        renew = Call.start(tg, store.renew, LEASE, TTL, TOL)
        req = await wire.command("findAndModify")
        assert equality_mismatches(body(req)["query"], restarted) == {"incarnation": (3, 4), "fence": (5, 6)}
        reply_value(req, None)
        assert await renew.result() is None
    async with anyio.create_task_group() as tg:
        release = Call.start(tg, store.release, LEASE, ms(at(5)))
        req = await wire.command("update")
        assert equality_mismatches(body(req)["updates"][0]["q"], restarted) == {
            "incarnation": (3, 4),
            "fence": (5, 6),
        }
        req.ok(n=0, nModified=0)
        assert await release.result() is False


async def test_a_lost_holder_cannot_renew_an_expired_lease_nobody_took(store: MongoSlotLeaseStore, wire: Wire) -> None:
    """CosId renews an expired slot silently; here the document is unchanged (every equality
    matches) and only ``expiresAt > $$NOW`` stands between the late renewal and a write."""
    untouched = slot_doc(1, owner=A.key, incarnation=3, fence=5)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.renew, LEASE, TTL, TOL)
        req = await wire.command("findAndModify")
        query = body(req)["query"]
        assert equality_mismatches(query, untouched) == {}
        assert query["$expr"] == {"$gt": ["$expiresAt", "$$NOW"]}
        reply_value(req, None)  # the store clock is past expiresAt
        assert await call.result() is None


# --------------------------------------------------------------------------- options and failures


async def test_write_concern_and_max_time_ms_on_the_wire_when_configured(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    s = MongoSlotLeaseStore(
        mongo_client, "wowd", operation_timeout=timedelta(seconds=4), write_concern=WriteConcern("majority")
    )
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, s.acquire, NS, A, 2, TTL, TOL)
        for name in ("createIndexes", "find", "aggregate", "findAndModify"):
            req = await wire.command(name)
            assert 0 < req.doc["maxTimeMS"] <= 4000, name
            if name == "find":
                reply_cursor(req, "cosid_namespace", [{"_id": NS, "limit": 2, "toleranceMs": 1000, "slotOffset": 0}])
            elif name == "aggregate":
                assert "writeConcern" not in req.doc
                reply_cursor(req, "cosid_slot", [{"mine": [], "present": [0, 1]}])
            elif name == "findAndModify":
                assert req.doc["writeConcern"] == {"w": "majority"}
                reply_value(req, projected(slot_doc(0, owner=A.key)))
            else:
                assert req.doc["writeConcern"] == {"w": "majority"}
                req.ok()
        assert (await call.result()).acquired
    async with anyio.create_task_group() as tg:
        release = Call.start(tg, s.release, LEASE, 0)
        req = await wire.command("update")
        assert req.doc["writeConcern"] == {"w": "majority"} and 0 < req.doc["maxTimeMS"] <= 4000
        req.ok(n=1, nModified=1)
        assert await release.result() is True


async def test_no_write_concern_or_max_time_ms_unless_configured(store: MongoSlotLeaseStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.renew, LEASE, TTL, TOL)
        req = await wire.command("findAndModify")
        assert "writeConcern" not in req.doc and "maxTimeMS" not in req.doc
        reply_value(req, None)
        await call.result()


async def test_unacknowledged_write_concern_is_refused(mongo_client: AsyncMongoClient[Any]) -> None:
    with pytest.raises(ConfigError):
        MongoSlotLeaseStore(mongo_client, "wowd", write_concern=WriteConcern(w=0))


async def test_not_writable_primary_is_storage_unavailable(store: MongoSlotLeaseStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.acquire, NS, A, 2, TTL, TOL)
        await namespace_known(wire)
        await owner_read_answered(wire, A, [])
        server_error(await wire.command("findAndModify"), 10107, "not primary")
        err = await call.error()
    assert isinstance(err, StorageUnavailable)
    assert "not primary" in str(err)


async def test_a_dropped_connection_is_storage_unavailable_and_counted(store: MongoSlotLeaseStore, wire: Wire) -> None:
    labels = {"store": "leases", "operation": "renew"}
    before = REGISTRY.get_sample_value("wowd_store_unavailable_total", labels) or 0.0
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.renew, LEASE, TTL, TOL)
        (await wire.command("findAndModify")).hangup()
        err = await call.error()
    assert isinstance(err, StorageUnavailable)
    assert REGISTRY.get_sample_value("wowd_store_unavailable_total", labels) == before + 1


async def test_a_call_past_its_timeout_is_storage_unavailable(mongo_client: AsyncMongoClient[Any], wire: Wire) -> None:
    s = MongoSlotLeaseStore(mongo_client, "wowd", operation_timeout=timedelta(milliseconds=300))
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, s.renew, LEASE, TTL, TOL)
        req = await wire.command("findAndModify")
        assert 0 < req.doc["maxTimeMS"] <= 300
        err = await call.error()  # the server never answers
    assert isinstance(err, StorageUnavailable)


async def test_another_server_error_is_a_storage_error_with_its_message(store: MongoSlotLeaseStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.release, LEASE, 0)
        # an update's failure is a write error of an ok answer (241 ConversionFailure)
        (await wire.command("update")).ok(
            n=0,
            nModified=0,
            writeErrors=[
                {
                    "index": 0,
                    "code": 241,
                    "errmsg": "Failed to optimize pipeline :: caused by :: Unsupported conversion from int "
                    "to date in $convert with no onError value",
                }
            ],
        )
        err = await call.error()
    assert type(err) is StorageError
    assert "Unsupported conversion from int to date" in str(err)


# --------------------------------------------------------------------------- status


async def test_slots_reads_every_slot_with_the_store_now(store: MongoSlotLeaseStore, wire: Wire) -> None:
    held_by_a = slot_doc(0, owner=A.key, incarnation=2, fence=3)
    released = {**slot_doc(1, owner=None, last_owner=B.key, fence=4), "nextFloor": at(8)}
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.slots, NS)
        req = await wire.command("aggregate")
        assert body(req) == {
            "aggregate": "cosid_slot",
            "pipeline": [
                {"$match": {"ns": NS}},
                {"$sort": {"slot": 1}},
                {"$set": {"storeNow": "$$NOW"}},
                {"$project": {"_id": 0}},
            ],
            "cursor": {},
        }
        reply_cursor(req, "cosid_slot", [{**held_by_a, "storeNow": at(5)}, {**released, "storeNow": at(5)}])
        states = await call.result()
    assert [(s.slot, s.owner_key, s.last_owner_key, s.fence, s.live) for s in states] == [
        (0, A.key, A.key, 3, True),
        (1, None, B.key, 4, False),
    ]
    assert states[0].store_now == ms(at(5)) and states[0].expires_at == ms(at(10))
    assert states[1].next_floor == ms(at(8))
