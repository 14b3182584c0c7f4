"""Black-pipe tests of MongoTimerHistory: the real async PyMongo driver against MockupDB, each
command asserted and answered as a 7.0 server answers it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import anyio
import pytest
from pymongo import AsyncMongoClient

from tests.mongo.conftest import Wire, write_concern_timeout
from tests.mongo.leases_support import Call, body, reply_cursor
from wowd.errors import StorageError, StorageUnavailable
from wowd.model import (
    AggregateRef,
    Command,
    Commit,
    CronRule,
    DomainEvent,
    Timer,
    TimerCancelled,
    TimerScheduled,
    attempt_record,
    commit_records,
)
from wowd.stores.base import Ddl
from wowd.stores.mongo.history import MongoTimerHistory, history_doc

pytestmark = pytest.mark.anyio

COLLECTION = "wow_timer_history__ctx"
T0 = 1_800_000_000_000
DAY = 86_400_000
OWNER = AggregateRef(context="ctx", aggregate="order", id="o-1")


def store(client: AsyncMongoClient[Any], ddl: Ddl = Ddl.NONE) -> MongoTimerHistory:
    return MongoTimerHistory(client, "wowd", context="ctx", ddl=ddl, operation_timeout=None)


def _date(ms: int) -> datetime:
    """A Date as the server receives it (MockupDB decodes it naive, in UTC)."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).replace(tzinfo=None)


async def test_prepare_creates_the_key_request_and_ttl_indexes(mongo_client: AsyncMongoClient[Any], wire: Wire) -> None:
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store(mongo_client, Ddl.AUTO).prepare)
        req = await wire.command("createIndexes")
        assert body(req) == {
            "createIndexes": COLLECTION,
            "indexes": [
                {
                    "key": {"owner_id": 1, "aggregate": 1, "tenant_id": 1, "key": 1, "at": 1},
                    "name": "key",
                    "partialFilterExpression": {"slot": {"$lt": 0}},
                },
                {"key": {"request_id": 1, "at": 1}, "name": "request_id"},
                {"key": {"expires_at": 1}, "name": "expires_ttl", "expireAfterSeconds": 0},
            ],
            "commitQuorum": "majority",
        }
        req.ok(numIndexesBefore=1, numIndexesAfter=4, createdCollectionAutomatically=True)
        await call.result()


async def test_append_is_one_unordered_bulk_of_upserts_and_the_end_of_open_schedules(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    """A record is a ``replaceOne`` upsert of its ``_id`` (written again: the same document); a
    cancel also ends the open schedules of its key, in the same ``update`` command."""
    daily = TimerScheduled(
        key="k", due_at=T0, rule=CronRule(expression="0 0 * * *"), target=OWNER, command=Command(name="go")
    )
    first = Commit(ref=OWNER, version=1, command_id="c1", request_id="r1", create_time=T0,
                   events=(DomainEvent(id="e", name="x"),))  # fmt: skip
    cancel = Commit(ref=OWNER, version=2, command_id="c2", request_id="r2", create_time=T0 + 5,
                    events=(DomainEvent(id="e", name="x"),))  # fmt: skip
    (scheduled,) = commit_records(first, [daily], DAY, position=None)
    (cancelled,) = commit_records(cancel, [TimerCancelled(key="k")], DAY)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store(mongo_client).append, [scheduled, cancelled])
        req = await wire.command("update")
        doc = body(req)
        assert doc["update"] == COLLECTION and doc["ordered"] is False
        assert doc["updates"] == [
            {
                "q": {"_id": f"{scheduled.timer_id}:-1"},
                "u": {
                    "_id": f"{scheduled.timer_id}:-1",
                    "timer_id": scheduled.timer_id,
                    "slot": -1,
                    "kind": "scheduled",
                    "aggregate": "order",
                    "tenant_id": "(0)",
                    "owner_id": "o-1",
                    "key": "k",
                    "at": T0,
                    "version": 1,
                    "request_id": "r1",
                    "scheduled_at": T0,
                },
                "upsert": True,
            },
            {
                "q": {"_id": f"{cancelled.timer_id}:-2"},
                "u": {
                    "_id": f"{cancelled.timer_id}:-2",
                    "timer_id": cancelled.timer_id,
                    "slot": -2,
                    "kind": "cancelled",
                    "aggregate": "order",
                    "tenant_id": "(0)",
                    "owner_id": "o-1",
                    "key": "k",
                    "at": T0 + 5,
                    "version": 2,
                    "request_id": "r2",
                    "expires_at": _date(T0 + 5 + DAY),
                },
                "upsert": True,
            },
            {
                "q": {
                    "owner_id": "o-1",
                    "aggregate": "order",
                    "tenant_id": "(0)",
                    "key": "k",
                    "slot": -1,
                    "version": {"$lt": 2},
                    "expires_at": {"$exists": False},
                },
                "u": {"$set": {"expires_at": _date(T0 + 5 + DAY)}},
                "multi": True,
            },
        ]
        req.ok(n=3, nModified=1, upserted=[{"index": 0, "_id": doc["updates"][0]["q"]["_id"]}])
        await call.result()


def _attempt() -> Any:
    t = Timer(timer_id="t-1", partition=0, owner=OWNER, key="k", version=1, due_at=T0, scheduled_at=T0, target=OWNER,
              body=Command(name="go").to_json(), revision=33)  # fmt: skip
    return attempt_record(t, "delivered", T0 + 1, DAY, status=200, latency_ms=1.25, answer="{}")


async def test_a_write_concern_error_is_unavailable_and_a_refused_record_an_error(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    record = _attempt()
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store(mongo_client).append, [record])
        req = await wire.command("update")
        assert body(req)["updates"][0]["q"] == {"_id": "t-1:1"}  # revision 33: slot 1 of the ring
        req.ok(n=1, nModified=1, writeConcernError=write_concern_timeout())
        assert isinstance(await call.error(), StorageUnavailable)
        call = Call.start(tg, store(mongo_client).append, [record])
        req = await wire.command("update")
        req.ok(n=0, nModified=0, writeErrors=[{"index": 0, "code": 121, "errmsg": "Document failed validation"}])
        error = await call.error()
        assert isinstance(error, StorageError) and not isinstance(error, StorageUnavailable)


async def test_reads_by_key_by_request_id_and_by_timer_are_sorted_by_time_over_their_index(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    """By key: the key's schedule and cancel records over the partial index (its filter repeated),
    then every record of the timers they name, by ``_id`` ranges."""
    record = _attempt()
    doc = history_doc(record)
    async with anyio.create_task_group() as tg:
        call = Call.start(tg, store(mongo_client).of_key, OWNER, "k", 50)
        req = await wire.command("find")
        assert body(req) == {
            "find": COLLECTION,
            "filter": {
                "owner_id": "o-1",
                "aggregate": "order",
                "tenant_id": "(0)",
                "key": {"$in": ["k", ""]},
                "slot": {"$lt": 0},
            },
            "projection": {"_id": 0, "timer_id": 1},
            "sort": {"at": -1},
            "limit": 50,
        }
        reply_cursor(req, COLLECTION, [{"timer_id": "t-1"}, {"timer_id": "t-0"}])
        req = await wire.command("find")
        assert body(req) == {
            "find": COLLECTION,
            "filter": {
                "$or": [
                    {"_id": {"$gte": "t-1:", "$lt": "t-1;"}, "timer_id": "t-1"},
                    {"_id": {"$gte": "t-0:", "$lt": "t-0;"}, "timer_id": "t-0"},
                ]
            },
            "sort": {"at": -1, "version": -1},
            "limit": 50,
        }
        reply_cursor(req, COLLECTION, [doc])
        assert await call.result() == [record]
        call = Call.start(tg, store(mongo_client).of_request, record.request_id, 10)
        req = await wire.command("find")
        assert body(req) == {
            "find": COLLECTION,
            "filter": {"request_id": record.request_id},
            "sort": {"at": -1},
            "limit": 10,
        }
        reply_cursor(req, COLLECTION, [doc])
        assert await call.result() == [record]
        call = Call.start(tg, store(mongo_client).of_timer, "t-1")
        req = await wire.command("find")
        assert body(req)["filter"] == {"_id": {"$gte": "t-1:", "$lt": "t-1;"}, "timer_id": "t-1"}
        reply_cursor(req, COLLECTION, [])
        assert await call.result() == []
