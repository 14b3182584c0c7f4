"""Black-pipe tests of the presence records of MongoSlotLeaseStore (``cosid_replica``): the real
async PyMongo driver against MockupDB. Each test plays the server, asserts every command exactly
and scripts the answer a 7.0 server gives."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import anyio
import pytest
from mockupdb import MockupDB
from pymongo import AsyncMongoClient
from pymongo.write_concern import WriteConcern

from tests.mongo.conftest import Wire, primary, server_error
from tests.mongo.leases_support import NS, Call, at, body, client_times, ms, reply_cursor
from wowd.errors import FormatError, StorageError, StorageUnavailable
from wowd.metrics import REGISTRY
from wowd.stores.base import Ddl, ReplicaInfo
from wowd.stores.mongo.leases import MongoSlotLeaseStore, heartbeat_update

pytestmark = pytest.mark.anyio

TTL = timedelta(seconds=10)
KEY = "host-a:11:aaaaaa"
INFO = ReplicaInfo(instance="inst-1", host="host-a", pid=11, version="1.2.3", slots=(2, 0))
ID = {"ns": NS, "ownerKey": KEY}

TTL_INDEX = {"key": {"expiresAt": 1}, "name": "expiresAt_ttl", "expireAfterSeconds": 300}
"""Deletes a record 300 s (the retention) after it expired."""


def heartbeat_command(info: ReplicaInfo = INFO, ttl_ms: int = 10_000) -> dict[str, Any]:
    return {
        "update": "cosid_replica",
        "ordered": True,
        "updates": [
            {
                "q": {"_id": ID},
                "u": [
                    {
                        "$set": {
                            "ns": {"$literal": NS},
                            "ownerKey": {"$literal": KEY},
                            "startedAt": {
                                "$cond": [{"$eq": ["$instance", {"$literal": info.instance}]}, "$startedAt", "$$NOW"]
                            },
                            "instance": {"$literal": info.instance},
                            "host": {"$literal": info.host},
                            "pid": {"$literal": info.pid},
                            "version": {"$literal": info.version},
                            "state": {"$literal": info.state},
                            "slots": {"$literal": sorted(info.slots)},
                            "seenAt": "$$NOW",
                        }
                    },
                    {"$set": {"expiresAt": {"$add": ["$seenAt", ttl_ms]}}},
                ],
                "multi": False,
                "upsert": True,
            }
        ],
    }


def upserted(req: Any) -> None:
    """The answer of an upsert that inserted the record."""
    req.ok(n=1, nModified=0, upserted=[{"index": 0, "_id": ID}])


def record(
    owner: str,
    *,
    seen: float,
    started: float = 0,
    ttl_s: float = 10,
    state: str = "standby",
    slots: list[int] | None = None,
) -> dict[str, Any]:
    """A presence document as the store keeps it (dates of the store clock)."""
    return {
        "ns": NS,
        "ownerKey": owner,
        "instance": f"inst-{owner}",
        "host": "host-a",
        "pid": 11,
        "version": "1.2.3",
        "state": state,
        "slots": slots or [],
        "startedAt": at(started),
        "seenAt": at(seen),
        "expiresAt": at(seen + ttl_s),
    }


@pytest.fixture(scope="module")
def mock_server() -> Iterator[MockupDB]:
    """One MockupDB for the module; each test reads every command it causes."""
    with primary() as server:
        yield server


@pytest.fixture
async def store(mongo_client: AsyncMongoClient[Any], wire: Wire) -> AsyncIterator[MongoSlotLeaseStore]:
    """A store whose indexes are in place (prepare answered on the wire)."""
    s = MongoSlotLeaseStore(mongo_client, "wowd", operation_timeout=None)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, s.prepare)
        (await wire.command("createIndexes")).ok()
        (await wire.command("createIndexes")).ok()
        await call.result()
    yield s
    await s.close()


async def next_command_is_replicas_read(wire: Wire, store: MongoSlotLeaseStore) -> None:
    """Proves the previous call sent nothing more: the next command on the wire is this one."""
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.replicas, NS)
        req = await wire.command("aggregate")
        assert body(req)["aggregate"] == "cosid_replica"
        reply_cursor(req, "cosid_replica", [])
        assert await call.result() == []


# --------------------------------------------------------------------------- heartbeat


async def test_the_first_heartbeat_creates_the_ttl_index_then_upserts_by_id(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    s = MongoSlotLeaseStore(mongo_client, "wowd", operation_timeout=None)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, s.heartbeat, NS, KEY, INFO, TTL)
        req = await wire.command("createIndexes")
        assert body(req) == {"createIndexes": "cosid_replica", "indexes": [TTL_INDEX]}
        req.ok()
        req = await wire.command("update")
        assert body(req) == heartbeat_command()
        assert list(req.doc["updates"][0]["q"]["_id"]) == ["ns", "ownerKey"]  # an _id matches in field order
        upserted(req)
        assert await call.result() is None
    async with anyio.create_task_group() as tg:  # the index once per store
        call = Call.start(tg, s.heartbeat, NS, KEY, INFO, TTL)
        req = await wire.command("update")
        assert body(req) == heartbeat_command()
        req.ok(n=1, nModified=1)
        await call.result()
    await next_command_is_replicas_read(wire, s)


async def test_a_standby_heartbeat_says_so_with_no_slot(store: MongoSlotLeaseStore, wire: Wire) -> None:
    standby = ReplicaInfo(instance="inst-1", host="host-a", pid=11, version="1.2.3")
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.heartbeat, NS, KEY, standby, timedelta(seconds=2))
        req = await wire.command("update")
        assert body(req) == heartbeat_command(standby, ttl_ms=2000)
        first = req.doc["updates"][0]["u"][0]["$set"]
        assert first["state"] == {"$literal": "standby"} and first["slots"] == {"$literal": []}
        upserted(req)
        await call.result()


async def test_presence_times_are_the_store_clock_never_a_client_clock(store: MongoSlotLeaseStore, wire: Wire) -> None:
    sent: list[dict[str, Any]] = []
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.heartbeat, NS, KEY, INFO, TTL)
        req = await wire.command("update")
        sent.append(body(req))
        upserted(req)
        await call.result()
        read = Call.start(tg, store.replicas, NS)
        req = await wire.command("aggregate")
        sent.append(body(req))
        reply_cursor(req, "cosid_replica", [])
        await read.result()
    for command in sent:
        assert client_times(command) == [], command
        assert "$$NOW" in repr(command)


async def test_what_the_replica_says_goes_in_as_literals() -> None:
    """An owner key, host or version starting with ``$`` is a value, never a field path."""
    odd = ReplicaInfo(instance="$instance", host="$host", pid=1, version="$$NOW")
    (first, _) = heartbeat_update("$ns", "$ownerKey", odd, 1000)
    values = first["$set"]
    for field, value in (("ns", "$ns"), ("ownerKey", "$ownerKey"), ("host", "$host"), ("version", "$$NOW")):
        assert values[field] == {"$literal": value}
    assert values["startedAt"]["$cond"][0] == {"$eq": ["$instance", {"$literal": "$instance"}]}


async def test_a_failed_heartbeat_is_storage_unavailable_and_counted(store: MongoSlotLeaseStore, wire: Wire) -> None:
    labels = {"store": "leases", "operation": "heartbeat"}
    before = REGISTRY.get_sample_value("wowd_store_unavailable_total", labels) or 0.0
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.heartbeat, NS, KEY, INFO, TTL)
        server_error(await wire.command("update"), 10107, "not primary", labels=("RetryableWriteError",))
        err = await call.error()
    assert isinstance(err, StorageUnavailable) and "not primary" in str(err)
    assert REGISTRY.get_sample_value("wowd_store_unavailable_total", labels) == before + 1


async def test_heartbeat_and_leave_write_with_the_configured_concern(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    s = MongoSlotLeaseStore(
        mongo_client,
        "wowd",
        operation_timeout=timedelta(seconds=4),
        write_concern=WriteConcern("majority"),
        ddl=Ddl.NONE,
    )
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, s.heartbeat, NS, KEY, INFO, TTL)
        req = await wire.command("update")  # ddl=none: no index step
        assert req.doc["writeConcern"] == {"w": "majority"} and 0 < req.doc["maxTimeMS"] <= 4000
        upserted(req)
        await call.result()
        leave = Call.start(tg, s.leave, NS, KEY)
        req = await wire.command("delete")
        assert req.doc["writeConcern"] == {"w": "majority"} and 0 < req.doc["maxTimeMS"] <= 4000
        req.ok(n=1)
        assert await leave.result() is True


# --------------------------------------------------------------------------- ddl=validate


async def test_validate_refuses_a_missing_ttl_index(mongo_client: AsyncMongoClient[Any], wire: Wire) -> None:
    s = MongoSlotLeaseStore(mongo_client, "wowd", operation_timeout=None, ddl=Ddl.VALIDATE)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, s.heartbeat, NS, KEY, INFO, TTL)
        req = await wire.command("listIndexes")
        assert body(req) == {"listIndexes": "cosid_replica", "cursor": {}}
        server_error(req, 26, "ns does not exist: wowd.cosid_replica")  # no collection yet
        err = await call.error()
    assert isinstance(err, FormatError) and "expiresAt_ttl" in str(err)


async def test_validate_refuses_a_ttl_index_with_another_retention(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    s = MongoSlotLeaseStore(mongo_client, "wowd", operation_timeout=None, ddl=Ddl.VALIDATE)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, s.heartbeat, NS, KEY, INFO, TTL)
        req = await wire.command("listIndexes")
        indexes = [{"v": 2, "key": {"_id": 1}, "name": "_id_"}, {"v": 2, **TTL_INDEX, "expireAfterSeconds": 0}]
        reply_cursor(req, "cosid_replica", indexes)
        assert isinstance(await call.error(), FormatError)


async def test_validate_accepts_the_ttl_index_and_creates_nothing(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    s = MongoSlotLeaseStore(mongo_client, "wowd", operation_timeout=None, ddl=Ddl.VALIDATE)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, s.heartbeat, NS, KEY, INFO, TTL)
        req = await wire.command("listIndexes")
        reply_cursor(req, "cosid_replica", [{"v": 2, "key": {"_id": 1}, "name": "_id_"}, {"v": 2, **TTL_INDEX}])
        req = await wire.command("update")
        upserted(req)
        await call.result()


# --------------------------------------------------------------------------- replicas and leave


async def test_replicas_reads_the_live_and_recently_expired_records_with_the_store_now(
    store: MongoSlotLeaseStore, wire: Wire
) -> None:
    holder = record("a", seen=4, started=1, state="holding", slots=[0, 1])
    killed = record("b", seen=-20, started=-100)  # expired 10 s before the store's now
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.replicas, NS)
        req = await wire.command("aggregate")
        assert body(req) == {
            "aggregate": "cosid_replica",
            "pipeline": [
                {"$match": {"ns": NS, "$expr": {"$gt": [{"$add": ["$expiresAt", 300_000]}, "$$NOW"]}}},
                {"$sort": {"ownerKey": 1}},
                {"$set": {"storeNow": "$$NOW"}},
                {"$project": {"_id": 0}},
            ],
            "cursor": {},
        }
        reply_cursor(req, "cosid_replica", [{**holder, "storeNow": at(5)}, {**killed, "storeNow": at(5)}])
        replicas = await call.result()
    a, b = replicas
    assert (a.owner_key, a.state, a.slots, a.live, a.pid, a.version) == ("a", "holding", (0, 1), True, 11, "1.2.3")
    assert (a.started_at, a.seen_at, a.expires_at, a.store_now) == (ms(at(1)), ms(at(4)), ms(at(14)), ms(at(5)))
    assert (b.owner_key, b.state, b.live) == ("b", "standby", False)


async def test_a_malformed_record_is_a_storage_error(store: MongoSlotLeaseStore, wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store.replicas, NS)
        req = await wire.command("aggregate")
        reply_cursor(req, "cosid_replica", [{**record("a", seen=0), "slots": "0,1", "storeNow": at(1)}])
        err = await call.error()
    assert type(err) is StorageError and "slots" in str(err)


async def test_leave_deletes_the_record_by_id(store: MongoSlotLeaseStore, wire: Wire) -> None:
    for n, answer in ((1, True), (0, False)):
        async with anyio.create_task_group() as tg:
            call = Call.start(tg, store.leave, NS, KEY)
            req = await wire.command("delete")
            assert body(req) == {
                "delete": "cosid_replica",
                "ordered": True,
                "deletes": [{"q": {"_id": ID}, "limit": 1}],
            }
            req.ok(n=n)
            assert await call.result() is answer
