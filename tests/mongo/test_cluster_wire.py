"""The MongoDB stores against the answers of a real 7.0/8.0 replica set or sharded cluster: the
change stream outside the call deadline, errors classified by code and label, the cut and the
catch-up of a long first scan, idle partitions on high-water marks only, split large events,
chunk spreading and best-effort sharding, partition groups of the due reads, and the settings
reaching every store. One MockupDB (a replica-set primary) serves the module."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import suppress
from datetime import timedelta
from typing import Any

import anyio
import pytest
from bson import ObjectId
from bson.timestamp import Timestamp
from mockupdb import MockupDB
from pydantic import SecretStr, ValidationError
from pymongo import AsyncMongoClient
from pymongo.errors import BulkWriteError, OperationFailure

from tests.mongo.conftest import CODE_NAMES, Wire, primary, server_error, unanswered, write_concern_timeout
from tests.mongo.log_support import (
    CONTEXT,
    DB,
    ID_P3,
    ID_P5,
    ORDERS,
    PARTITIONS,
    change,
    collect,
    cursor,
    housekeeping,
    log_doc,
    majority_point,
    scan_collection,
    start,
    token,
)
from tests.mongo.timers_support import calling, make_timer, registry_doc
from tests.mongo.timers_support import cursor as timers_cursor
from tests.timer_stores import MongoTimers, mongo_timers
from wowd.config import ElasticsearchSettings, MongoSettings, TimerSettings, WowdSettings, load_settings
from wowd.errors import ConfigError, StorageError, StorageUnavailable
from wowd.model import AggregateRef, AggregateType, Claim, LogBatch, SnapshotRecord
from wowd.stores.base import Ddl
from wowd.stores.mongo import open_mongo
from wowd.stores.mongo._common import MongoSharding, is_transient
from wowd.stores.mongo.checkpoints import MongoCheckpoints
from wowd.stores.mongo.log import MongoLog
from wowd.stores.mongo.log_read import CATCH_UP_AWAIT_MS
from wowd.stores.mongo.snapshots import MongoSnapshotStore
from wowd.stores.mongo.timer_docs import PIPELINE_LENGTH_LIMIT, timer_to_doc
from wowd.stores.mongo.timer_firing import MAX_SCANS_TO_EXPLODE, due_match, next_due_pipeline, settle_filter

pytestmark = pytest.mark.anyio

HISTORY_LOST_MSG = "Resume of change stream was not possible, as the resume point may no longer be in the oplog."
TIMERS = f"wow_timer__{CONTEXT}__order"
NO_PRIMARY = 'Could not find host matching read preference { mode: "primary" } for set shard01'


@pytest.fixture(scope="module")
def rs_server() -> Iterator[MockupDB]:
    """One replica-set primary for the module."""
    with primary("rs0") as server:
        server.autoresponds(housekeeping)
        yield server


@pytest.fixture(autouse=True)
def _no_leftovers(rs_server: MockupDB) -> Iterator[None]:
    """After each test, hang up on what it left unanswered: the next test starts clean."""
    yield
    for leftover in unanswered(rs_server):
        with suppress(OSError):  # a request of a connection the test's client closed already: dropped
            leftover.hangup()


@pytest.fixture
def rs_wire(rs_server: MockupDB) -> Wire:
    return Wire(rs_server)


@pytest.fixture
async def rs_client(rs_server: MockupDB) -> AsyncIterator[AsyncMongoClient[Any]]:
    """A client as ``open_mongo`` makes it: ``timeoutMS`` set (5 s)."""
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        rs_server.uri, serverSelectionTimeoutMS=3000, retryWrites=False, retryReads=False, timeoutMS=5000
    )
    try:
        yield client
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await client.close()


def make_log(client: AsyncMongoClient[Any], **kwargs: Any) -> MongoLog:
    return MongoLog(
        client, DB, context=CONTEXT, partitions=PARTITIONS, ddl=Ddl.NONE, operation_timeout=timedelta(seconds=5),
        **kwargs,
    )  # fmt: skip


def pos(ct: tuple[int, int], n: int = 0) -> dict[str, Any]:
    return {"token": token(ct, n), "cluster_time": list(ct)}


def entries_of(batches: list[LogBatch]) -> list[tuple[int, str, int]]:
    return [(e.partition, e.commit.ref.id, e.commit.version) for b in batches for e in b.entries if e.commit]


def collections_answer(*names: str) -> dict[str, Any]:
    return {"cursor": {"id": 0, "ns": f"{DB}.$cmd.listCollections", "firstBatch": [{"name": n} for n in names]}}


# --------------------------------------------------------------------------- the change stream's deadline


async def test_the_change_stream_runs_without_the_clients_timeout_but_keeps_max_await(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """With ``timeoutMS`` on the client (and an operation timeout on the store), the stream's
    ``aggregate`` goes out without ``maxTimeMS`` (a first batch over a long stretch of oplog may
    take longer) and its ``getMore`` waits ``maxAwaitTimeMS`` on the server; the other calls
    keep their deadline."""
    log = make_log(rs_client)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({3: pos((100, 1))}, follow=False)))
            agg = await rs_wire.command("aggregate")
            assert "maxTimeMS" not in agg.doc
            assert agg["pipeline"][0] == {"$changeStream": {"startAtOperationTime": Timestamp(100, 1)}}
            agg.ok(cursor([], first=True))
            more = await rs_wire.command("getMore")
            # maxAwaitTimeMS: the server's wait for new changes, short for a read that ends when
            # caught up (the log's max_await, a second, is for a read that follows)
            assert more["maxTimeMS"] == CATCH_UP_AWAIT_MS == 200
            more.ok(cursor([], first=False, pbrt=token((101, 0))))
            await call.done.wait()
            # nothing read; caught up at the post-batch token's second (the watermark)
            assert call.result() == [LogBatch(entries=(), positions={}, watermark=101_000)]

            checkpoints = MongoCheckpoints(rs_client, DB, context=CONTEXT, operation_timeout=timedelta(seconds=5))
            saved = start(tg, lambda: checkpoints.read("feed", [3]))
            find = await rs_wire.command("find")
            assert 0 < find["maxTimeMS"] <= 5000
            find.ok(cursor={"id": 0, "ns": f"{DB}.wow_checkpoint__{CONTEXT}", "firstBatch": []})
            await saved.done.wait()
            assert saved.result() == {}


# --------------------------------------------------------------------------- classification


def failure(code: int, labels: tuple[str, ...] = ()) -> OperationFailure:
    details: dict[str, Any] = {"ok": 0, "code": code, "codeName": CODE_NAMES[code], "errmsg": "x"}
    if labels:
        details["errorLabels"] = list(labels)
    return OperationFailure("x", code, details)


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (failure(43), True),  # CursorNotFound: a cursor killed by a failover
        (failure(133), True),  # FailedToSatisfyReadPreference: no primary during an election
        (failure(134), True),  # ReadConcernMajorityNotAvailableYet
        (failure(175), True),  # QueryPlanKilled
        (failure(64), True),  # WriteConcernFailed
        # the server's labels say so whatever the code (a mongos relaying a shard's failure)
        (failure(13388, ("ResumableChangeStreamError",)), True),
        (failure(112, ("TransientTransactionError",)), True),
        (failure(11601, ("RetryableWriteError",)), True),
        (failure(13), False),  # Unauthorized
        (failure(26), False),  # NamespaceNotFound
        (
            BulkWriteError(
                {
                    "writeErrors": [{"index": 0, "code": 11000, "errmsg": "E11000 duplicate key error"}],
                    "writeConcernErrors": [write_concern_timeout()],
                    "nInserted": 1,
                }
            ),
            True,
        ),
        (
            BulkWriteError(
                {"writeErrors": [{"index": 0, "code": 11000, "errmsg": "E11000"}], "writeConcernErrors": []}
            ),
            False,
        ),
    ],
    ids=[
        "43", "133", "134", "175", "64", "label-resumable", "label-transaction", "label-retryable-write",
        "13", "26", "bulk-dup-and-wce", "bulk-dup-only",
    ],
)  # fmt: skip
def test_errors_are_transient_by_code_and_by_label(error: Exception, transient: bool) -> None:
    assert is_transient(error) is transient


async def test_a_bulk_with_duplicates_and_a_write_concern_error_is_retried_whole(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """E11000 items are routine on a replay; with a write-concern error (code 64) beside them the
    bulk is unavailable (retried whole), not a permanent failure."""
    store = MongoSnapshotStore(rs_client, DB, context=CONTEXT, ddl=Ddl.NONE, sharding=MongoSharding.OFF)
    snaps = [
        SnapshotRecord(
            ref=AggregateRef(context=CONTEXT, aggregate="order", id=i), version=2, state_revision=1, state={}
        )
        for i in ("o-1", "o-2")
    ]
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: store.save_all(snaps))
            (await rs_wire.command("update")).ok(
                n=1,
                nModified=1,
                writeErrors=[
                    {
                        "index": 1,
                        "code": 11000,
                        "errmsg": f"E11000 duplicate key error collection: {DB}.wow_snapshot__ctx__order "
                        'index: _id_ dup key: { _id: { t: "(0)", a: "o-2" } }',
                        "keyPattern": {"_id": 1},
                        "keyValue": {"_id": {"t": "(0)", "a": "o-2"}},
                    }
                ],
                writeConcernError=write_concern_timeout(),
            )
            await call.done.wait()
    with pytest.raises(StorageUnavailable, match="write concern"):
        call.result()


async def test_a_resumable_getmore_error_is_resumed_then_transient(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """A mongos answers a getMore with 133 and the ResumableChangeStreamError label: the driver
    resumes once; its resume fails with 133 too (an aggregate carries no such label): the read
    is unavailable (retried), not a permanent error."""
    log = make_log(rs_client)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({3: pos((100, 1))}, follow=True)))
            (await rs_wire.command("aggregate")).ok(cursor([], first=True, pbrt=token((100, 1))))
            more = await rs_wire.command("getMore")
            assert more["maxTimeMS"] == 1000  # a read that follows waits the log's max_await
            server_error(more, 133, NO_PRIMARY, labels=("ResumableChangeStreamError",))
            resumed = await rs_wire.command("aggregate")
            assert "maxTimeMS" not in resumed.doc
            server_error(resumed, 133, NO_PRIMARY)
            await call.done.wait()
    with pytest.raises(StorageUnavailable, match="read preference"):
        call.result()


async def test_capped_position_lost_on_a_getmore_rereads_like_history_lost(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    log = make_log(rs_client)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({5: pos((10, 1))}, follow=False)))
            (await rs_wire.command("aggregate")).ok(cursor([change(log_doc(ID_P5, 1), (11, 1))], first=True))
            server_error(
                await rs_wire.command("getMore"),
                136,
                "CollectionScan died due to position in capped collection being deleted. "
                "Last seen record id: RecordId(7318321345425588225)",
            )
            await majority_point(rs_wire, (600, 1))
            (await rs_wire.command("listCollections")).ok(collections_answer(ORDERS))
            await scan_collection(rs_wire, ORDERS, 5, [log_doc(ID_P5, 1), log_doc(ID_P5, 2)])
            agg = await rs_wire.command("aggregate")
            assert agg["pipeline"][0] == {"$changeStream": {"startAtOperationTime": Timestamp(600, 1)}}
            agg.ok(cursor([], first=True))
            (await rs_wire.command("getMore")).ok(cursor([], first=False))
            await call.done.wait()
    assert entries_of(call.result()) == [(5, ID_P5, 1), (5, ID_P5, 1), (5, ID_P5, 2)]


# --------------------------------------------------------------------------- the first scan


async def test_each_partition_is_cut_then_scanned_and_caught_up_before_the_next(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """Scans that run longer than ``scan_catch_up`` (here at once) catch the partitions done so
    far up with a stream before the next cut: no cut waits for all the others' scans."""
    log = make_log(rs_client, scan_catch_up=timedelta(0))
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({3: None, 5: None}, follow=False)))
            await majority_point(rs_wire, (200, 1))  # partition 3's own cut
            (await rs_wire.command("listCollections")).ok(collections_answer(ORDERS))
            await scan_collection(rs_wire, ORDERS, 3, [log_doc(ID_P3, 1)], cut=(200, 1))  # partition 3's re-read
            # partition 3 caught up from its cut before partition 5 is cut
            catch_up = await rs_wire.command("aggregate")
            assert catch_up["pipeline"][0] == {"$changeStream": {"startAtOperationTime": Timestamp(200, 1)}}
            assert catch_up["pipeline"][1]["$match"]["$or"][0] == {"fullDocument.partition": {"$in": [3]}}
            catch_up.ok(cursor([change(log_doc(ID_P3, 2), (250, 1))], first=True))
            (await rs_wire.command("getMore")).ok(cursor([], first=False, pbrt=token((260, 0))))
            await majority_point(rs_wire, (300, 1))  # partition 5's own cut, later
            (await rs_wire.command("listCollections")).ok(collections_answer(ORDERS))
            await scan_collection(rs_wire, ORDERS, 5, [log_doc(ID_P5, 1)], cut=(300, 1))
            agg = await rs_wire.command("aggregate")  # from partition 3's caught-up position
            assert agg["pipeline"][0] == {"$changeStream": {"startAtOperationTime": Timestamp(250, 1)}}
            assert agg["pipeline"][1]["$match"]["$or"][0] == {"fullDocument.partition": {"$in": [3, 5]}}
            agg.ok(cursor([change(log_doc(ID_P5, 1), (290, 1)), change(log_doc(ID_P5, 2), (310, 1))], first=True))
            (await rs_wire.command("getMore")).ok(cursor([], first=False))
            await call.done.wait()
    batches = call.result()
    assert entries_of(batches) == [(3, ID_P3, 1), (3, ID_P3, 2), (5, ID_P5, 1), (5, ID_P5, 2)]
    with_entries = [b for b in batches if b.entries]
    assert with_entries[2].positions[5]["cluster_time"] == [300, 1]  # partition 5 scanned at its own cut


async def test_history_lost_right_after_a_scan_names_the_oplog_window(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """The cut taken before the scan left the oplog while the scan ran: scanning again would
    lose it again, forever. The read stops with an error that says what to change."""
    log = make_log(rs_client)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({3: None}, follow=False)))
            await majority_point(rs_wire, (200, 1))
            (await rs_wire.command("listCollections")).ok(collections_answer(ORDERS))
            await scan_collection(rs_wire, ORDERS, 3, [log_doc(ID_P3, 1)])
            server_error(await rs_wire.command("aggregate"), 286, HISTORY_LOST_MSG)
            await call.done.wait()
    with pytest.raises(StorageError, match="oplogMinRetentionHours"):
        call.result()


# --------------------------------------------------------------------------- idle partitions, large events


async def test_an_idle_partition_moves_only_to_a_high_water_mark_never_another_partitions_event(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """Partition 3 is quiet, partition 5 busy. A batch whose post-batch resume token is the token
    of partition 5's last event does not move partition 3 (a stream filtered on partition 3 would
    never meet that event: 280); the next high-water mark does."""
    log = make_log(rs_client)
    got = anyio.Event()
    batches: list[LogBatch] = []

    async def tail() -> None:
        async for batch in log.read({3: pos((1000, 1)), 5: pos((1000, 2))}, follow=True):
            batches.append(batch)
            if not batch.entries:
                got.set()

    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            tg.start_soon(tail)
            (await rs_wire.command("aggregate")).ok(cursor([], first=True, pbrt=token((1000, 2))))
            event = change(log_doc(ID_P5, 1), (1090, 1))
            (await rs_wire.command("getMore")).ok(cursor([event], first=False, pbrt=event["_id"]))
            (await rs_wire.command("getMore")).ok(cursor([], first=False, pbrt=token((1091, 0))))
            await got.wait()
            tg.cancel_scope.cancel()
    assert entries_of(batches) == [(5, ID_P5, 1)]
    moved = [b.positions for b in batches if not b.entries]
    assert moved == [{3: pos((1091, 0))}]


async def test_an_event_over_16_mib_comes_split_and_is_joined(rs_client: AsyncMongoClient[Any], rs_wire: Wire) -> None:
    log = make_log(rs_client)
    whole = change(log_doc(ID_P3, 1), (50, 1))
    first = {k: whole[k] for k in ("operationType", "clusterTime", "ns", "documentKey")}
    fragments = [
        {"_id": token((50, 1), 1), "splitEvent": {"fragment": 1, "of": 2}, **first},
        {"_id": token((50, 1), 2), "splitEvent": {"fragment": 2, "of": 2}, "fullDocument": whole["fullDocument"]},
    ]
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({3: pos((40, 1))}, follow=False)))
            agg = await rs_wire.command("aggregate")
            assert agg["pipeline"][-1] == {"$changeStreamSplitLargeEvent": {}}
            agg.ok(cursor(fragments[:1], first=True))
            (await rs_wire.command("getMore")).ok(cursor(fragments[1:], first=False))
            (await rs_wire.command("getMore")).ok(cursor([], first=False))
            await call.done.wait()
    batches = call.result()
    assert entries_of(batches) == [(3, ID_P3, 1)]
    assert batches[0].positions[3] == {"token": token((50, 1), 2), "cluster_time": [50, 1]}


# --------------------------------------------------------------------------- timers on a sharded cluster


def sharded_timers(client: AsyncMongoClient[Any], sharding: MongoSharding = MongoSharding.AUTO) -> MongoTimers:
    return mongo_timers(
        client, DB, context=CONTEXT, partitions=3, sharding=sharding, operation_timeout=timedelta(seconds=5)
    )


def timer3() -> Any:
    from dataclasses import replace

    t = make_timer(id="a")
    return replace(t, partition=t.owner.partition(3))


async def answer_put(rs_wire: Wire) -> None:
    (await rs_wire.command("update")).ok(n=1, nModified=0, upserted=[{"index": 0, "_id": ObjectId()}])


async def test_a_put_never_splits_or_moves_chunks(rs_client: AsyncMongoClient[Any], rs_wire: Wire) -> None:
    """``create`` answers ok on an existing collection (mongos since 4.0, mongod since 7.0): the
    type is sharded again (idempotent) and the put goes on: the chunks are spread off the feed's
    path (``spread_chunks``), never by a put."""
    store = sharded_timers(rs_client)
    async with calling(lambda: store.view.put(timer3())) as out:
        (await rs_wire.command("findAndModify")).ok(
            value=registry_doc("order"), lastErrorObject={"n": 1, "updatedExisting": True}
        )
        (await rs_wire.command("create")).ok()
        (await rs_wire.command("createIndexes")).ok(
            numIndexesBefore=4, numIndexesAfter=4, note="all indexes already exist"
        )
        (await rs_wire.command("hello")).ok(isWritablePrimary=True, msg="isdbgrid", maxWireVersion=21)
        (await rs_wire.command("shardCollection")).ok(collectionsharded=f"{DB}.{TIMERS}")
        await answer_put(rs_wire)  # no listShards, no split, no moveRange: straight to the put
    assert out.error is None and out.value is True


async def test_spread_chunks_leaves_a_collection_of_several_chunks_to_the_balancer(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """A registered collection whose chunks the balancer has split and moved already is left as
    it is (``config.chunks`` counts two; answers as a 7.0 ``mongos`` gives them)."""
    from uuid import UUID

    from bson.binary import Binary, UuidRepresentation

    store = sharded_timers(rs_client)
    async with calling(store.view.spread_chunks) as out:
        (await rs_wire.command("find")).ok(**timers_cursor(f"{DB}.wow_timer_aggregate", [registry_doc("order")]))
        (await rs_wire.command("hello")).ok(isWritablePrimary=True, msg="isdbgrid", maxWireVersion=21)
        (await rs_wire.command("listShards")).ok(shards=[{"_id": "s0"}, {"_id": "s1"}])
        coll = await rs_wire.command("find")
        assert (coll["find"], coll["$db"], coll["filter"]) == ("collections", "config", {"_id": f"{DB}.{TIMERS}"})
        uuid = Binary.from_uuid(UUID(int=7), UuidRepresentation.STANDARD)
        coll.ok(**timers_cursor("config.collections", [{"_id": f"{DB}.{TIMERS}", "uuid": uuid}]))
        count = await rs_wire.command("aggregate")
        assert (count["aggregate"], count["$db"]) == ("chunks", "config")
        assert count["pipeline"][0] == {"$match": {"uuid": uuid}}
        count.ok(**timers_cursor("config.chunks", [{"_id": 1, "n": 2}]))
    assert out.error is None, out.error
    assert out.value == {TIMERS: "left to the balancer (not a single chunk, or not sharded)"}


async def test_check_prepare_runs_the_spread_and_prints_what_it_did(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire, capsys: pytest.CaptureFixture[str]
) -> None:
    """``wowd check --prepare`` spreads the chunks off the feed's path; here the cluster has one
    shard (``listShards`` as a 7.0 ``mongos`` answers it), so it says there is nothing to do."""
    from types import SimpleNamespace

    from wowd.cli.check import _prepare
    from wowd.stores.base import CHUNK_PREPARATION

    store = sharded_timers(rs_client, MongoSharding.ON)
    # the backend's chunk preparation: the MongoDB operations object's, which spreads the timers'
    chunks = SimpleNamespace(prepare_chunks=store.view.spread_chunks)
    backend = SimpleNamespace(capability=lambda kind: chunks if kind is CHUNK_PREPARATION else None)
    async with calling(lambda: _prepare(backend, [])) as out:  # type: ignore[arg-type]
        (await rs_wire.command("find")).ok(**timers_cursor(f"{DB}.wow_timer_aggregate", [registry_doc("order")]))
        (await rs_wire.command("listShards")).ok(shards=[{"_id": "s0", "host": "s0/h:27018", "state": 1}])
    assert out.value == 0, out.error
    assert f"ok   prepare {TIMERS}: one shard: nothing to spread" in capsys.readouterr().out


async def test_auto_sharding_without_the_privilege_leaves_the_collection_unsharded(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire, caplog: pytest.LogCaptureFixture
) -> None:
    store = sharded_timers(rs_client)
    ns = f"{DB}.{TIMERS}"
    with caplog.at_level(logging.WARNING, logger="wowd.stores.mongo.schema"):
        async with calling(lambda: store.view.put(timer3())) as out:
            (await rs_wire.command("findAndModify")).ok(
                value=registry_doc("order"), lastErrorObject={"n": 1, "updatedExisting": False, "upserted": TIMERS}
            )
            (await rs_wire.command("create")).ok()
            (await rs_wire.command("createIndexes")).ok(numIndexesBefore=1, numIndexesAfter=4)
            (await rs_wire.command("hello")).ok(isWritablePrimary=True, msg="isdbgrid", maxWireVersion=21)
            server_error(
                await rs_wire.command("shardCollection"),
                13,
                f'not authorized on admin to execute command {{ shardCollection: "{ns}", key: {{ partition: 1 }} }}',
            )
            await answer_put(rs_wire)  # the feed goes on
    assert out.error is None and out.value is True
    assert "left unsharded" in caplog.text and "enableSharding" in caplog.text


async def test_sharding_on_without_the_privilege_is_a_config_error(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    store = sharded_timers(rs_client, MongoSharding.ON)
    async with calling(lambda: store.view.put(timer3())) as out:
        (await rs_wire.command("findAndModify")).ok(
            value=registry_doc("order"), lastErrorObject={"n": 1, "updatedExisting": False, "upserted": TIMERS}
        )
        (await rs_wire.command("create")).ok()
        (await rs_wire.command("createIndexes")).ok(numIndexesBefore=1, numIndexesAfter=4)
        server_error(await rs_wire.command("shardCollection"), 13, "not authorized on admin to execute command")
    assert isinstance(out.error, ConfigError) and "WOWD_MONGODB__SHARDING" in str(out.error)


async def test_snapshots_auto_sharding_without_the_privilege_is_best_effort(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    store = MongoSnapshotStore(rs_client, DB, context=CONTEXT, sharding=MongoSharding.AUTO)
    name = f"wow_snapshot__{CONTEXT}__order"
    async with calling(lambda: store.create_collection("order")) as out:
        (await rs_wire.command("findAndModify")).ok(
            value={"_id": name, "format": 5}, lastErrorObject={"n": 1, "updatedExisting": True}
        )
        (await rs_wire.command("create")).ok()
        (await rs_wire.command("hello")).ok(isWritablePrimary=True, msg="isdbgrid", maxWireVersion=21)
        (await rs_wire.command("createIndexes")).ok(numIndexesBefore=1, numIndexesAfter=4)
        server_error(await rs_wire.command("shardCollection"), 13, "not authorized on admin to execute command")
    assert out.error is None


async def test_more_partitions_than_the_planner_explodes_are_read_in_groups(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """Above ``internalQueryMaxScansToExplode`` (200) point intervals the planner sorts the whole
    match: the due read sends one ``$unionWith`` per collection and group of at most 200."""
    store = mongo_timers(rs_client, DB, context=CONTEXT, partitions=512, sharding=MongoSharding.OFF)
    async with calling(store.prepare) as out:
        (await rs_wire.command("find")).ok(**timers_cursor(f"{DB}.wow_timer_aggregate", [registry_doc("order")]))
    assert out.error is None
    partitions = set(range(450))
    async with calling(lambda: store.firing.due(partitions, 10, 5)) as due:
        agg = await rs_wire.command("aggregate")
        unions = [s["$unionWith"] for s in agg["pipeline"] if "$unionWith" in s]
        groups = [u["pipeline"][0]["$match"]["partition"]["$in"] for u in unions]
        assert [u["coll"] for u in unions] == [TIMERS] * 3
        assert groups == [list(range(200)), list(range(200, 400)), list(range(400, 450))]
        assert agg["pipeline"][-2:] == [{"$sort": {"due_at": 1, "timer_id": 1}}, {"$limit": 6}]
        agg.ok(**timers_cursor(f"{DB}.wow_timer_aggregate", [{"registered": 1}]))
    assert due.value == []
    pipeline = next_due_pipeline(CONTEXT, [TIMERS], range(MAX_SCANS_TO_EXPLODE + 1), 0)
    assert [len(s["$unionWith"]["pipeline"][0]["$match"]["partition"]["$in"]) for s in pipeline[2:-1]] == [200, 1]


async def aggregation_within_the_length_limit(wire: Wire) -> Any:
    """The next ``aggregate``, answered as a 7.0 server does when its pipeline (or one of its
    ``$unionWith`` sub-pipelines) has more than ``internalPipelineLengthLimit`` (1,000) stages:
    code 7749501 before parsing (src/mongo/db/pipeline/pipeline.cpp, ``Pipeline::parseCommon``;
    once parsed, ``validateCommon`` answers FailedToParse with the same message). Answers None
    then; else the request, for the test to answer."""
    agg = await wire.command("aggregate")
    pipelines = [agg["pipeline"]] + [s["$unionWith"]["pipeline"] for s in agg["pipeline"] if "$unionWith" in s]
    if any(len(p) > PIPELINE_LENGTH_LIMIT for p in pipelines):
        server_error(agg, 7749501, f"Pipeline length must be no longer than {PIPELINE_LENGTH_LIMIT} stages.")
        return None
    return agg


async def test_due_and_next_due_at_the_most_partitions_and_ten_types_stay_within_the_pipeline_length(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """65,536 partitions are 328 groups of at most 200 (one ``$unionWith`` each per type): with 10
    types, 3,280 unions, more than a pipeline of 1,000 stages holds (manual, Aggregation Pipeline
    Limits: "Number of Stages"; the server's ``internalPipelineLengthLimit``). The reads are split
    into aggregations that each fit, and their answers merged: the first timers of all, the
    least next due time."""
    types = [f"t{n}" for n in range(10)]
    store = mongo_timers(rs_client, DB, context=CONTEXT, partitions=65_536, sharding=MongoSharding.OFF)
    async with calling(store.prepare) as out:
        (await rs_wire.command("find")).ok(
            **timers_cursor(f"{DB}.wow_timer_aggregate", [registry_doc(t) for t in types])
        )
    assert out.error is None
    everything = set(range(65_536))

    def timer_doc(aggregate: str, due_at: int) -> dict[str, Any]:
        doc = timer_to_doc(make_timer(aggregate=aggregate, id=f"{aggregate}-{due_at}", due_at=due_at))
        return {**doc, "owner": {**doc["owner"], "aggregate": aggregate}}

    seen: list[str] = []
    async with calling(lambda: store.firing.due(everything, 10_000, 3)) as due:
        for n in range(4):  # ceil(3,280 / 990)
            agg = await aggregation_within_the_length_limit(rs_wire)
            assert agg is not None, f"aggregation {n} is longer than the server takes"
            unions = [s["$unionWith"]["coll"] for s in agg["pipeline"] if "$unionWith" in s]
            seen += unions
            assert agg["pipeline"][:2] == [{"$match": {"context": CONTEXT}}, {"$count": "registered"}]
            # each answers its own first timers: later ones come first in the later aggregations
            agg.ok(
                **timers_cursor(f"{DB}.wow_timer_aggregate", [{"registered": 10}, timer_doc(unions[-1][-2:], 400 - n)])
            )
    assert due.error is None, due.error
    assert len(seen) == 3_280 and sorted(set(seen)) == [f"wow_timer__{CONTEXT}__{t}" for t in types]
    assert [t.due_at for t in due.value] == [397, 398, 399]

    async with calling(lambda: store.firing.next_due(everything, 0)) as next_due:
        for n in range(4):
            agg = await aggregation_within_the_length_limit(rs_wire)
            assert agg is not None
            agg.ok(**timers_cursor(f"{DB}.wow_timer_aggregate", [{"_id": None, "registered": 10, "next_due": 50 - n}]))
    assert next_due.error is None, next_due.error
    assert next_due.value == 47


async def test_claim_due_reads_more_partitions_than_the_planner_explodes_in_groups(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """The claim's due read is grouped as the due read is (at most 200 partitions per
    ``$unionWith``), keeps each ``_id`` and over-reads by the excluded ids; the timers it answers
    are claimed in one settle."""
    store = mongo_timers(rs_client, DB, context=CONTEXT, partitions=512, sharding=MongoSharding.OFF)
    async with calling(store.prepare) as out:
        (await rs_wire.command("find")).ok(**timers_cursor(f"{DB}.wow_timer_aggregate", [registry_doc("order")]))
    assert out.error is None
    due = make_timer(id="o1", due_at=5)
    stored = {"_id": ObjectId(), **timer_to_doc(due), "owner": {**timer_to_doc(due)["owner"], "aggregate": "order"}}
    call = lambda: store.firing.claim_due(  # noqa: E731
        set(range(450)), 10, 2, owner_key="me", fence=4, claim_until=9_000, exclude={"in-flight"}
    )
    async with calling(call) as claimed:
        agg = await rs_wire.command("aggregate")
        unions = [s["$unionWith"] for s in agg["pipeline"] if "$unionWith" in s]
        assert [u["coll"] for u in unions] == [TIMERS] * 3
        assert [u["pipeline"][0]["$match"] for u in unions] == [
            due_match(range(200), 10),
            due_match(range(200, 400), 10),
            due_match(range(400, 450), 10),
        ]
        assert all({"$limit": 3} in u["pipeline"] and {"$unset": "_id"} not in u["pipeline"] for u in unions)
        assert agg["pipeline"][-2:] == [{"$sort": {"due_at": 1, "timer_id": 1}}, {"$limit": 4}]
        agg.ok(**timers_cursor(f"{DB}.wow_timer_aggregate", [{"registered": 1}, stored]))
        settle = await rs_wire.command("update")
        assert settle["update"] == TIMERS
        assert [u["q"] for u in settle["updates"]] == [settle_filter(due)]
        settle.ok(n=1, nModified=1)
    assert claimed.error is None, claimed.error
    assert [(t.timer_id, t.claim) for t in claimed.value or []] == [
        (due.timer_id, Claim(owner_key="me", fence=4, until=9_000))
    ]


# --------------------------------------------------------------------------- settings


def test_ddl_and_sharding_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WOWD_MONGODB__DDL", "validate")
    monkeypatch.setenv("WOWD_MONGODB__SHARDING", "off")
    settings = load_settings()
    assert (settings.mongodb.ddl, settings.mongodb.sharding) == ("validate", "off")
    monkeypatch.setenv("WOWD_MONGODB__DDL", "sometimes")
    with pytest.raises(ConfigError, match="mongodb.ddl"):
        load_settings()


async def test_open_mongo_gives_every_store_the_timeout_and_the_ddl_mode(rs_server: MockupDB, rs_wire: Wire) -> None:
    """``ddl=none``: no store creates anything (a user with ``readWrite`` only); the timer store
    reads its registry. Every store runs its calls under ``timeout_ms``."""
    settings = WowdSettings(
        backend="mongo",
        mongodb=MongoSettings(uri=SecretStr(rs_server.uri), timeout_ms=2500, ddl="none", sharding="off"),
        elasticsearch=ElasticsearchSettings(url="http://127.0.0.1:9"),
        timers=TimerSettings(tombstone_retention_s=3600),
    )
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: open_mongo(settings))
            (await rs_wire.command("hello")).ok(isWritablePrimary=True, setName="rs0", maxWireVersion=21)
            await answer_election_timeout(rs_wire)
            registry = await rs_wire.command("find")  # the one command of ddl=none
            assert registry["find"] == "wow_timer_aggregate"
            assert 0 < registry["maxTimeMS"] <= 2500
            registry.ok(cursor={"id": 0, "ns": f"{DB}.wow_timer_aggregate", "firstBatch": []})
            await call.done.wait()
    backend = call.result()
    try:
        b = backend
        stores = [b.log, b.checkpoints, b.quarantine, b.leases, b.timers, b.firing, b.timer_queries, b.snapshots,
                  b.rebuilds, b.outbox]  # fmt: skip
        timeouts = {s.operation_timeout for s in stores}  # type: ignore[attr-defined]
        assert timeouts == {timedelta(milliseconds=2500)}
        assert backend.timers.ddl is Ddl.NONE and backend.timers.sharding is MongoSharding.OFF  # type: ignore[attr-defined]
        assert backend.timers.tombstone_retention == timedelta(hours=1)  # type: ignore[attr-defined]
    finally:
        await backend.close()


async def test_the_mongo_backend_runs_without_elasticsearch_when_it_keeps_no_index(
    rs_server: MockupDB, rs_wire: Wire
) -> None:
    """``sink = "none"``: no Elasticsearch setting is needed and no client is made; the backend
    has no sink, and the feed keeps no index view."""
    from wowd.views import enabled_views

    with pytest.raises(ValidationError, match="elasticsearch.url"):
        WowdSettings(backend="mongo", mongodb=MongoSettings(uri=SecretStr(rs_server.uri)))
    settings = WowdSettings(
        backend="mongo", sink="none", mongodb=MongoSettings(uri=SecretStr(rs_server.uri), ddl="none", sharding="off")
    )
    assert [v.name for v in enabled_views(settings, ())] == ["timers"]
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: open_mongo(settings))
            (await rs_wire.command("hello")).ok(isWritablePrimary=True, setName="rs0", maxWireVersion=21)
            await answer_election_timeout(rs_wire)
            registry = await rs_wire.command("find")
            registry.ok(cursor={"id": 0, "ns": f"{DB}.wow_timer_aggregate", "firstBatch": []})
            await call.done.wait()
    backend = call.result()
    try:
        assert not backend.has_sink
        with pytest.raises(ConfigError, match="no event index"):
            backend.sink(AggregateType(context="demo", aggregate="order"))
    finally:
        await backend.close()


# --------------------------------------------------------------------------- privileges

READ_WRITE_70 = [
    "changeStream",
    "collStats",
    "compactStructuredEncryptionData",
    "convertToCapped",
    "createCollection",
    "createIndex",
    "dbHash",
    "dbStats",
    "dropCollection",
    "dropIndex",
    "find",
    "insert",
    "killCursors",
    "listCollections",
    "listIndexes",
    "listSearchIndexes",
    "planCacheRead",
    "remove",
    "renameCollectionSameDB",
    "update",
]
"""The actions of the built-in ``readWrite`` role on its database in 7.0 (manual, Built-In Roles,
readWrite; src/mongo/db/auth/builtin_roles.yml)."""


async def answer_election_timeout(wire: Wire, timeout_ms: int = 10_000) -> None:
    """``replSetGetConfig`` (at start, the lease's ttl against the election timeout), on ``admin``,
    answered as 7.0 does (the settings a default replica set has)."""
    req = await wire.command("replSetGetConfig")
    assert req["$db"] == "admin"
    req.ok(config={"_id": "rs0", "version": 1, "term": 1, "members": [{"_id": 0, "host": "localhost:27017"}],
                   "settings": {"electionTimeoutMillis": timeout_ms, "heartbeatIntervalMillis": 2000}})  # fmt: skip


def connection_status(privileges: list[dict[str, Any]], roles: list[dict[str, str]]) -> dict[str, Any]:
    """``connectionStatus`` with ``showPrivileges`` as 7.0 answers it for user ``wowd`` of ``admin``."""
    return {
        "authInfo": {
            "authenticatedUsers": [{"user": "wowd", "db": "admin"}],
            "authenticatedUserRoles": roles,
            "authenticatedUserPrivileges": privileges,
        }
    }


async def test_privileges_of_read_write_on_a_mongos_lack_the_sharding_actions_by_name(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """A user with ``readWrite`` on the wowd database, on a ``mongos`` (``sharding=auto``): every
    store's data and DDL actions are there; what sharding and the chunk spread need is not, and
    each is named with its resource: ``listShards`` on the cluster (``clusterMonitor`` has it),
    ``enableSharding``, ``splitChunk``, ``moveChunk``, the ``config`` reads."""
    from wowd.stores.mongo.privileges import check_user

    call = lambda: check_user(rs_client, DB, CONTEXT, ddl=Ddl.AUTO, sharding=MongoSharding.AUTO)  # noqa: E731
    async with calling(call) as out:
        (await rs_wire.command("hello")).ok(isWritablePrimary=True, msg="isdbgrid", maxWireVersion=21)
        status = await rs_wire.command("connectionStatus")
        assert status["showPrivileges"] is True
        status.ok(
            **connection_status(
                [{"resource": {"db": DB, "collection": ""}, "actions": READ_WRITE_70}],
                [{"role": "readWrite", "db": DB}],
            )
        )
    assert out.error is None, out.error
    named = {(action, need.resource) for need, action in out.value}
    assert named == {
        ("enableSharding", f"every collection of {DB}"),
        ("listShards", "the cluster"),
        ("find", "config.collections"),
        ("find", "config.chunks"),
        ("splitChunk", f"every collection of {DB}"),
        ("moveChunk", f"every collection of {DB}"),
    }


async def test_privileges_of_a_custom_role_name_each_missing_action_and_clusterMonitor_fills_listShards(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """A custom role granting collection by collection, without ``remove`` on the outbox (``ack``
    and ``trim`` would fail), plus ``clusterMonitor`` (``listShards`` on the cluster, ``find``
    on the ``config`` database's collections): only the outbox's ``remove`` and the DDL of
    ``ddl=validate`` (``listIndexes``) are missing. Without an authenticated user (no access
    control) nothing is compared."""
    from wowd.stores.mongo.privileges import check_user

    data = ["find", "insert", "update", "remove"]
    privileges = [
        {
            "resource": {"db": DB, "collection": ""},
            "actions": ["find", "insert", "update", "listCollections", "changeStream"],
        },
        {"resource": {"db": DB, "collection": f"wow_outbox__{CONTEXT}"}, "actions": ["find", "insert", "update"]},
        *(
            {"resource": {"db": DB, "collection": c}, "actions": data}
            for c in (f"wow_quarantine__{CONTEXT}", "cosid_slot", "cosid_replica", "wow_timer_aggregate")
        ),
        {"resource": {"db": DB, "collection": ""}, "actions": ["enableSharding", "splitChunk", "moveChunk"]},
        {"resource": {"cluster": True}, "actions": ["listShards", "serverStatus", "connPoolStats"]},
        {"resource": {"db": "config", "collection": ""}, "actions": ["find", "collStats", "dbStats"]},
    ]
    call = lambda: check_user(rs_client, DB, CONTEXT, ddl=Ddl.VALIDATE, sharding=MongoSharding.ON)  # noqa: E731
    async with calling(call) as out:
        (await rs_wire.command("connectionStatus")).ok(
            **connection_status(
                privileges, [{"role": "wowd", "db": "admin"}, {"role": "clusterMonitor", "db": "admin"}]
            )
        )
    assert out.error is None, out.error
    named = sorted((action, need.resource) for need, action in out.value)
    assert named == [("listIndexes", f"every collection of {DB}"), ("remove", f"{DB}.wow_outbox__{CONTEXT}")]

    async with calling(call) as off:
        (await rs_wire.command("connectionStatus")).ok(
            authInfo={"authenticatedUsers": [], "authenticatedUserRoles": [], "authenticatedUserPrivileges": []}
        )
    assert off.error is None and off.value is None


async def test_wowd_check_names_the_missing_privileges(
    rs_server: MockupDB, rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """``wowd check``'s probe: one ConfigError naming each action missing, its resource and what
    it is for. Here a custom role with ``readWrite``'s actions on the database but ``remove``
    only on some collections, on a replica set with ``ddl=auto``: the outbox's ``remove`` (its
    ``ack`` and ``trim``) is the one named."""
    from wowd.stores.mongo.operations import privileges_probe

    settings = WowdSettings(
        backend="mongo",
        mongodb=MongoSettings(uri=SecretStr(rs_server.uri), ddl="auto", sharding="off", database=DB),
        elasticsearch=ElasticsearchSettings(url="http://127.0.0.1:9"),
        context=CONTEXT,
    )
    everything_but_remove = [a for a in READ_WRITE_70 if a != "remove"]
    privileges = [
        {"resource": {"db": DB, "collection": ""}, "actions": everything_but_remove},
        *(
            {"resource": {"db": DB, "collection": c}, "actions": ["remove"]}
            for c in (f"wow_quarantine__{CONTEXT}", "cosid_slot", "cosid_replica", "wow_timer_aggregate")
        ),
    ]
    async with calling(lambda: privileges_probe(rs_client, settings)) as out:
        (await rs_wire.command("connectionStatus")).ok(
            **connection_status(privileges, [{"role": "wowd", "db": "admin"}])
        )
    assert isinstance(out.error, ConfigError), out.error
    assert str(out.error).startswith("the user lacks 1 privilege action(s): remove on ")
    assert f"remove on {DB}.wow_outbox__{CONTEXT} (outbox: put, take (its leases), ack, trim)" in str(out.error)
