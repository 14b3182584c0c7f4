"""Black-pipe tests of the MongoDB log, outbox and replica-set check: the real PyMongo driver
talks to MockupDB and each test asserts the commands on the wire and scripts the answers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from bson import ObjectId
from bson.timestamp import Timestamp
from mockupdb import MockupDB
from pydantic import SecretStr
from pymongo import AsyncMongoClient

from tests.mongo.conftest import Wire, server_error, write_concern_timeout
from tests.mongo.log_support import (
    CONTEXT,
    DB,
    ID_P3,
    ID_P5,
    ORDERS,
    PARTITIONS,
    SCAN_SORT,
    change,
    collect,
    commit,
    cursor,
    housekeeping,
    log_doc,
    majority_point,
    rs_client,
    rs_server,
    rs_wire,
    scan_bounds,
    scan_collection,
    start,
    token,
)
from wowd.config import ElasticsearchSettings, MongoSettings, WowdSettings
from wowd.errors import ConfigError, ConflictError, InvalidInput, StorageError, StorageUnavailable
from wowd.model import AggregateRef, AggregateType, LogBatch, OutboxEntry
from wowd.stores.base import Ddl, Log, Outbox
from wowd.stores.elasticsearch.options import client_options
from wowd.stores.mongo import check_replica_set, mongo_client_options, open_mongo
from wowd.stores.mongo.checkpoints import MongoCheckpoints
from wowd.stores.mongo.log import MongoLog
from wowd.stores.mongo.outbox import MongoOutbox
from wowd.stores.mongo.quarantine import MongoQuarantine

__all__ = ["rs_client", "rs_server", "rs_wire"]  # fixtures re-exported for pytest

ORDER = AggregateType(context=CONTEXT, aggregate="order")
HISTORY_LOST_MSG = "Resume of change stream was not possible, as the resume point may no longer be in the oplog."

pytestmark = pytest.mark.anyio


def make_log(client: AsyncMongoClient[Any], ddl: Ddl = Ddl.NONE) -> MongoLog:
    return MongoLog(client, DB, context=CONTEXT, partitions=PARTITIONS, ddl=ddl, operation_timeout=None)


def make_quarantine(client: AsyncMongoClient[Any], ddl: Ddl = Ddl.NONE) -> MongoQuarantine:
    return MongoQuarantine(client, DB, context=CONTEXT, ddl=ddl, operation_timeout=None)


def make_checkpoints(client: AsyncMongoClient[Any]) -> MongoCheckpoints:
    return MongoCheckpoints(client, DB, context=CONTEXT, operation_timeout=None)


def pos(ct: tuple[int, int], n: int = 0) -> dict[str, Any]:
    return {"token": token(ct, n), "cluster_time": list(ct)}


def entries_of(batches: list[LogBatch]) -> list[tuple[int, str, int]]:
    out = []
    for b in batches:
        for e in b.entries:
            assert e.commit is not None, e.error
            out.append((e.partition, e.commit.ref.id, e.commit.version))
    return out


def dup(index: int, key_pattern: dict[str, int]) -> dict[str, Any]:
    return {"index": index, "code": 11000, "errmsg": "E11000 duplicate key error", "keyPattern": key_pattern}


def expected_match(partitions: list[int]) -> dict[str, Any]:
    """The stream's filter: the partitions, and every commit without an integral partition in
    range (the one holding the aggregate id's partition keeps it)."""
    irregular = {"$not": {"$type": ["int", "long"], "$gte": 0, "$lt": PARTITIONS}}
    return {
        "ns.coll": {"$regex": "^wow_log__ctx__[a-z0-9-]+(?:_[a-z0-9-]+)*$"},
        "operationType": "insert",
        "$or": [{"fullDocument.partition": {"$in": partitions}}, {"fullDocument.partition": irregular}],
    }


# --------------------------------------------------------------------------- tailing


async def test_one_change_stream_from_the_oldest_checkpoint_skips_per_partition(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    log = make_log(rs_client)
    assert isinstance(log, Log)
    # partition 3 is checkpointed at (100, 1), partition 5 later at (105, 2)
    positions = {5: pos((105, 2)), 3: pos((100, 1))}
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read(positions, batch_size=50, follow=False)))

            agg = await rs_wire.command("aggregate")
            assert agg["aggregate"] == 1
            assert agg["$db"] == DB
            stages = agg["pipeline"]
            # one stream over the database, from the OLDEST checkpoint's cluster time (each
            # partition skips what it saw), server-side $match, large events split
            assert stages[0] == {"$changeStream": {"startAtOperationTime": Timestamp(100, 1)}}
            assert stages[1:] == [{"$match": expected_match([3, 5])}, {"$changeStreamSplitLargeEvent": {}}]
            assert agg["cursor"] == {"batchSize": 50}
            agg.ok(
                cursor(
                    [
                        change(log_doc(ID_P5, 1), (103, 1)),  # partition 5 saw it already: skipped
                        change(log_doc(ID_P3, 1), (104, 1)),
                        change(log_doc(ID_P5, 2), (105, 2), n=0),  # its own checkpoint: skipped
                    ],
                    first=True,
                )
            )
            # the getMore loop: more changes, then an empty answer ends a non-following read
            more = await rs_wire.command("getMore")
            assert more["getMore"] == 42
            assert more["collection"] == "$cmd.aggregate"
            assert more["batchSize"] == 50
            more.ok(cursor([change(log_doc(ID_P5, 3), (106, 1)), change(log_doc(ID_P3, 2), (106, 2))], first=False))
            last = await rs_wire.command("getMore")
            last.ok(cursor([], first=False, pbrt=token((107, 0))))
            await call.done.wait()
    batches = call.result()
    assert entries_of(batches) == [(3, ID_P3, 1), (5, ID_P5, 3), (3, ID_P3, 2)]
    # each batch names every partition's last position: a resume token and its cluster time
    assert batches[0].positions == {3: pos((104, 1))}
    # the server's whole batch was read: the resume token's second is the watermark
    assert batches[0].watermark == 105_000
    assert batches[-2].positions == {5: pos((106, 1)), 3: pos((106, 2))}
    # caught up: the empty answer's post-batch resume token is the watermark (its second)
    assert batches[-1] == LogBatch(entries=(), positions={}, watermark=107_000)


async def test_changes_of_one_transaction_share_a_cluster_time_and_are_ordered_by_token(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    log = make_log(rs_client)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            # checkpointed at the 2nd change of a transaction committed at (100, 1)
            call = start(tg, lambda: collect(log.read({3: pos((100, 1), n=1)}, follow=False)))
            (await rs_wire.command("aggregate")).ok(
                cursor(
                    [
                        change(log_doc(ID_P3, 1), (100, 1), n=0),
                        change(log_doc(ID_P3, 2), (100, 1), n=1),
                        change(log_doc(ID_P3, 3), (100, 1), n=2),
                    ],
                    first=True,
                )
            )
            (await rs_wire.command("getMore")).ok(cursor([], first=False))
            await call.done.wait()
    batches = call.result()
    assert entries_of(batches) == [(3, ID_P3, 3)]
    assert batches[0].positions == {3: pos((100, 1), n=2)}


async def test_a_partition_without_checkpoint_is_read_from_its_collections_first(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    log = make_log(rs_client)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({3: None}, batch_size=10, follow=False)))
            # 1. the cluster time, taken BEFORE the scan: the majority commit point
            await majority_point(rs_wire, (200, 3))
            # 2. the context's log collections
            lc = await rs_wire.command("listCollections")
            # the context's own collections: an aggregate part with no "__" (another context's has)
            assert lc["filter"] == {"name": {"$regex": "^wow_log__ctx__[a-z0-9-]+(?:_[a-z0-9-]+)*$"}}
            lc.ok(
                cursor={
                    "id": 0,
                    "ns": f"{DB}.$cmd.listCollections",
                    "firstBatch": [{"name": ORDERS, "type": "collection"}],
                }
            )
            # 3. the partition's history in (aggregate_id, version) order, over the partition_order
            # index: the commits stored without a partition and those of its own range merged, then
            # the ranges of the commits stored with a partition that is no integer in range
            no_partition = {k: v for k, v in log_doc(ID_P3, 4).items() if k != "partition"}
            elsewhere = {k: v for k, v in log_doc(ID_P5, 4).items() if k != "partition"}
            # it reads majority-committed data at or after that cluster time (causally
            # consistent): on every shard it sees each commit at or before the cut
            mine = [log_doc(ID_P3, 1), log_doc(ID_P3, 2)]
            await scan_collection(rs_wire, ORDERS, 3, mine, missing=[no_partition, elsewhere], cut=(200, 3))
            # 4. the stream starts at that cluster time, not "now"; what is AT it the scan read
            agg = await rs_wire.command("aggregate")
            assert agg["pipeline"][0] == {"$changeStream": {"startAtOperationTime": Timestamp(200, 3)}}
            agg.ok(cursor([change(log_doc(ID_P3, 2), (200, 3)), change(log_doc(ID_P3, 3), (200, 4))], first=True))
            (await rs_wire.command("getMore")).ok(cursor([], first=False))
            await call.done.wait()
    batches = call.result()
    # the commit without a partition is read in its aggregate id's (3), in version order among the
    # others; another's is not
    assert entries_of(batches) == [(3, ID_P3, 1), (3, ID_P3, 2), (3, ID_P3, 4), (3, ID_P3, 3)]
    scanned = batches[0].positions[3]
    assert scanned["cluster_time"] == [200, 3]
    # where each merged range goes on: the one without a partition after the last commit read,
    # the partition's own read to its end
    last = [None, ID_P3, 4, log_doc(ID_P3, 4)["_id"], True]
    assert scanned["scan"] == {"c": ORDERS, "r": 0, "k": [last, None], "s": 2}
    assert [b for b in batches if b.entries][-1].positions == {3: pos((200, 4))}


async def test_a_scan_position_resumes_the_scan_after_its_document(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """The resumed ``find`` of each merged range is bounded on the ``partition_order`` index from
    the scan key to the range's end (the find command's ``hint``, ``min`` inclusive and ``max``
    exclusive: manual, find command and cursor.min(), "index bounds", a hint required since 4.2):
    the scan starts at the key instead of reading the partition from its start; the filter on
    ``_id`` leaves out the document read last (the other range goes on at its next document,
    inclusive). The answers are a 7.0 server's."""
    log = make_log(rs_client)
    cart = "wow_log__ctx__cart"
    read, following = {"t": "(0)", "a": ID_P3, "v": 2}, {"t": "(0)", "a": ID_P3, "v": 3}
    last = {"c": cart, "r": 0, "k": [[None, ID_P3, 2, read, True], [3, ID_P3, 3, following, False]], "s": 2}
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({3: {"cluster_time": [70, 1], "scan": last}}, follow=False)))
            await majority_point(rs_wire, (90, 1))
            (await rs_wire.command("listCollections")).ok(
                cursor={
                    "id": 0,
                    "ns": f"{DB}.$cmd.listCollections",
                    "firstBatch": [{"name": ORDERS}, {"name": cart}, {"name": "wow_log__ctx__account"}],
                }
            )
            # "account" sorts before the scan's collection: done already; "cart" from the key
            bounds = scan_bounds(3)
            for (_lower, upper), (*key, exclusive) in zip(bounds[:2], last["k"], strict=True):
                find = await rs_wire.command("find")
                assert (find["find"], find["sort"], find["hint"]) == (cart, SCAN_SORT, "partition_order")
                assert find["filter"] == ({"_id": {"$ne": key[3]}} if exclusive else {})
                assert list(find["min"].values()) == key and list(find["max"].values()) == upper
                find.ok(cursor={"id": 0, "ns": f"{DB}.{cart}", "firstBatch": []})
            for lower, _upper in bounds[2:]:  # the other ranges, from their start
                find = await rs_wire.command("find")
                assert (find["find"], find["filter"], list(find["min"].values())) == (cart, {}, lower)
                find.ok(cursor={"id": 0, "ns": f"{DB}.{cart}", "firstBatch": []})
            await scan_collection(rs_wire, ORDERS, 3, [])  # "order" from its start
            # the stream starts at the cluster time the ORIGINAL scan took
            agg = await rs_wire.command("aggregate")
            assert agg["pipeline"][0] == {"$changeStream": {"startAtOperationTime": Timestamp(70, 1)}}
            agg.ok(cursor([], first=True))
            (await rs_wire.command("getMore")).ok(cursor([], first=False))
            await call.done.wait()
    assert call.result() == []


async def test_a_scan_position_of_an_older_wowd_reads_its_collection_again(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """A scan key without the scheme (``{c, r, p, a, v, id}``, an older wowd's) resumes its
    collection from the start: re-reading is safe (every view is idempotent), guessing its ranges
    is not."""
    log = make_log(rs_client)
    last = {"c": ORDERS, "r": 1, "p": 3, "a": ID_P3, "v": 2, "id": log_doc(ID_P3, 2)["_id"]}
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({3: {"cluster_time": [70, 1], "scan": last}}, follow=False)))
            await majority_point(rs_wire, (90, 1))
            (await rs_wire.command("listCollections")).ok(
                cursor={"id": 0, "ns": f"{DB}.$cmd.listCollections", "firstBatch": [{"name": ORDERS}]}
            )
            await scan_collection(rs_wire, ORDERS, 3, [log_doc(ID_P3, 1), log_doc(ID_P3, 2)])
            (await rs_wire.command("aggregate")).ok(cursor([], first=True))
            (await rs_wire.command("getMore")).ok(cursor([], first=False))
            await call.done.wait()
    assert entries_of(call.result()) == [(3, ID_P3, 1), (3, ID_P3, 2)]


async def test_following_waits_on_the_server_and_moves_quiet_partitions_to_the_resume_token(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    log = make_log(rs_client)
    got = anyio.Event()
    batches: list[LogBatch] = []

    async def tail() -> None:
        async for batch in log.read({3: pos((1000, 1)), 5: pos((1070, 1))}, follow=True):
            batches.append(batch)
            got.set()

    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            tg.start_soon(tail)
            (await rs_wire.command("aggregate")).ok(cursor([], first=True, pbrt=token((1000, 1))))
            more = await rs_wire.command("getMore")
            assert more["maxTimeMS"] == 1000  # the server waits for changes: no busy poll
            # nothing for partition 3 for over a minute: it moves to the post-batch resume token
            more.ok(cursor([], first=False, pbrt=token((1090, 0))))
            await got.wait()
            (await rs_wire.command("getMore")).ok(cursor([], first=False, pbrt=token((1091, 0))))
            tg.cancel_scope.cancel()
    # the quiet partition moves on, and the post-batch token's second is the watermark
    assert batches == [LogBatch(entries=(), positions={3: pos((1090, 0))}, watermark=1_090_000)]


async def test_a_stream_the_server_closed_is_an_error_not_a_busy_loop(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """After an invalidate (dropDatabase) the server closes the cursor (id 0); PyMongo's
    try_next then answers None at once forever: a follower must stop, not spin."""
    log = make_log(rs_client)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({3: pos((10, 1))}, follow=True)))
            (await rs_wire.command("aggregate")).ok(cursor([], first=True))
            (await rs_wire.command("getMore")).ok(cursor([], first=False, cursor_id=0))
            await call.done.wait()
    with pytest.raises(StorageError, match="closed by the server"):
        call.result()


async def test_history_lost_rereads_the_partitions_and_restarts_at_the_cluster_time_before(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    log = make_log(rs_client)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({3: pos((10, 1))}, follow=False)))
            agg = await rs_wire.command("aggregate")
            assert agg["pipeline"][0] == {"$changeStream": {"startAtOperationTime": Timestamp(10, 1)}}
            server_error(agg, 286, HISTORY_LOST_MSG)
            await majority_point(rs_wire, (500, 7))  # the cluster time before the re-read
            lc = await rs_wire.command("listCollections")
            lc.ok(
                cursor={
                    "id": 0,
                    "ns": f"{DB}.$cmd.listCollections",
                    "firstBatch": [{"name": ORDERS, "type": "collection"}],
                }
            )
            await scan_collection(rs_wire, ORDERS, 3, [log_doc(ID_P3, 1)])
            agg = await rs_wire.command("aggregate")
            assert agg["pipeline"][0] == {"$changeStream": {"startAtOperationTime": Timestamp(500, 7)}}
            assert agg["pipeline"][1] == {"$match": expected_match([3])}
            agg.ok(cursor([], first=True))
            (await rs_wire.command("getMore")).ok(cursor([], first=False))
            await call.done.wait()
    batches = call.result()
    assert entries_of(batches) == [(3, ID_P3, 1)]
    assert batches[0].positions[3]["cluster_time"] == [500, 7]


async def test_history_lost_rereads_only_the_partitions_at_the_oldest_position(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """Partition 3's checkpoint fell off the oplog, partition 5's did not: only 3 is re-read, and
    the stream restarts after 5's checkpoint (older than the re-read's cluster time)."""
    log = make_log(rs_client)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({3: pos((10, 1)), 5: pos((500, 1))}, follow=False)))
            agg = await rs_wire.command("aggregate")
            assert agg["pipeline"][0] == {"$changeStream": {"startAtOperationTime": Timestamp(10, 1)}}
            server_error(agg, 286, HISTORY_LOST_MSG)
            await majority_point(rs_wire, (600, 1))
            (await rs_wire.command("listCollections")).ok(
                cursor={"id": 0, "ns": f"{DB}.$cmd.listCollections", "firstBatch": [{"name": ORDERS}]}
            )
            await scan_collection(rs_wire, ORDERS, 3, [log_doc(ID_P3, 1), log_doc(ID_P3, 2)])
            agg = await rs_wire.command("aggregate")
            assert agg["pipeline"][0] == {"$changeStream": {"startAtOperationTime": Timestamp(500, 1)}}
            assert agg["pipeline"][1] == {"$match": expected_match([3, 5])}
            agg.ok(cursor([change(log_doc(ID_P3, 2), (550, 1)), change(log_doc(ID_P5, 2), (601, 1))], first=True))
            (await rs_wire.command("getMore")).ok(cursor([], first=False))
            await call.done.wait()
    # partition 3 skips what its re-read (at 600,1) covered; partition 5 goes on after (500, 1)
    assert entries_of(call.result()) == [(3, ID_P3, 1), (3, ID_P3, 2), (5, ID_P5, 2)]


async def test_history_lost_on_a_getmore_also_rereads(rs_client: AsyncMongoClient[Any], rs_wire: Wire) -> None:
    log = make_log(rs_client)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({5: pos((10, 1))}, follow=False)))
            (await rs_wire.command("aggregate")).ok(cursor([change(log_doc(ID_P5, 1), (11, 1))], first=True))
            server_error(await rs_wire.command("getMore"), 286, HISTORY_LOST_MSG)
            await majority_point(rs_wire, (600, 1))
            (await rs_wire.command("listCollections")).ok(
                cursor={"id": 0, "ns": f"{DB}.$cmd.listCollections", "firstBatch": []}
            )
            agg = await rs_wire.command("aggregate")
            assert agg["pipeline"][0] == {"$changeStream": {"startAtOperationTime": Timestamp(600, 1)}}
            agg.ok(cursor([], first=True))
            (await rs_wire.command("getMore")).ok(cursor([], first=False))
            await call.done.wait()
    assert entries_of(call.result()) == [(5, ID_P5, 1)]


async def test_history_lost_again_while_following_stalls_with_log_behind_oplog(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """The stream answered, lost its history on a ``getMore`` (286, as a 7.0 server answers a
    resume point truncated from the oplog, message and all:
    src/mongo/db/pipeline/document_source_change_stream_check_resumability.cpp; the
    ``NonResumableChangeStreamError`` label: src/mongo/db/error_labels.cpp), was re-read,
    answered again and lost it again: the reader is slower than the oplog window. The read
    stops with LogBehindOplog (a StorageUnavailable the feed stalls the slot on), naming the
    oplog window, instead of re-reading the partition for ever."""
    from wowd.errors import LogBehindOplog

    log = make_log(rs_client)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({5: pos((10, 1))}, follow=True)))
            (await rs_wire.command("aggregate")).ok(cursor([change(log_doc(ID_P5, 1), (11, 1))], first=True))
            server_error(
                await rs_wire.command("getMore"), 286, HISTORY_LOST_MSG, labels=("NonResumableChangeStreamError",)
            )
            await majority_point(rs_wire, (600, 1))
            (await rs_wire.command("listCollections")).ok(
                cursor={"id": 0, "ns": f"{DB}.$cmd.listCollections", "firstBatch": []}
            )
            (await rs_wire.command("aggregate")).ok(cursor([change(log_doc(ID_P5, 2), (601, 1))], first=True))
            server_error(
                await rs_wire.command("getMore"), 286, HISTORY_LOST_MSG, labels=("NonResumableChangeStreamError",)
            )
            await call.done.wait()
    with pytest.raises(LogBehindOplog, match="oplog window") as caught:
        call.result()
    assert isinstance(caught.value, StorageUnavailable) and caught.value.partitions == (5,)
    assert "oplogMinRetentionHours" in str(caught.value)


async def test_a_resume_token_not_found_also_rereads(rs_client: AsyncMongoClient[Any], rs_wire: Wire) -> None:
    """Code 280 (the oplog covers the token's time but not its event: a rolled-back write, a
    token of another deployment) cannot resume either: the partition is re-read."""
    log = make_log(rs_client)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({5: pos((10, 1))}, follow=False)))
            server_error(
                await rs_wire.command("aggregate"),
                280,
                'cannot resume stream; the resume token was not found. {_data: "8200000064000000012B02000004"}',
            )
            await majority_point(rs_wire, (700, 2))
            (await rs_wire.command("listCollections")).ok(
                cursor={"id": 0, "ns": f"{DB}.$cmd.listCollections", "firstBatch": [{"name": ORDERS}]}
            )
            await scan_collection(rs_wire, ORDERS, 5, [log_doc(ID_P5, 1)])
            agg = await rs_wire.command("aggregate")
            assert agg["pipeline"][0] == {"$changeStream": {"startAtOperationTime": Timestamp(700, 2)}}
            agg.ok(cursor([], first=True))
            (await rs_wire.command("getMore")).ok(cursor([], first=False))
            await call.done.wait()
    assert entries_of(call.result()) == [(5, ID_P5, 1)]


async def test_malformed_document_is_an_entry_with_an_error_then_quarantined(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    log = make_log(rs_client)
    quarantine = make_quarantine(rs_client)
    bad = {"_id": {"t": "(0)", "a": ID_P3, "v": 2}, "aggregate_id": ID_P3, "partition": 3, "version": "two"}
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({3: pos((1, 1))}, follow=False)))
            (await rs_wire.command("aggregate")).ok(
                cursor([change(log_doc(ID_P3, 1), (2, 1)), change(bad, (2, 2))], first=True)
            )
            (await rs_wire.command("getMore")).ok(cursor([], first=False))
            await call.done.wait()
        entries = [e for b in call.result() for e in b.entries]
        assert entries[0].commit is not None
        assert entries[1].commit is None and entries[1].raw == bad
        assert entries[1].error is not None and entries[1].error.startswith("events:")

        async with anyio.create_task_group() as tg:
            q = start(tg, lambda: quarantine.put("feed", 3, ORDER, bad, entries[1].error or ""))
            await answer_last_drawn(rs_wire, counter=None, last=None)
            insert = await rs_wire.command("insert")
            assert insert["insert"] == f"wow_quarantine__{CONTEXT}"
            assert "txnNumber" not in insert and "startTransaction" not in insert  # no transaction
            doc = insert.docs[0]["documents"][0]
            assert doc["_id"] == {"consumer": "feed", "aggregate": "order", "key": bad["_id"]}
            assert (doc["consumer"], doc["partition"], doc["aggregate"], doc["raw"]) == ("feed", 3, "order", bad)
            assert doc["reason"] == entries[1].error
            assert doc["seq"] == ObjectId("ffffffff0000000000000001")
            insert.ok(n=1)
            raised = await rs_wire.command("update")
            assert raised["updates"] == [{"q": {"_id": "seq"}, "u": {"$max": {"n": 1}}, "multi": False, "upsert": True}]
            raised.ok(n=1, nModified=0, upserted=[{"index": 0, "_id": "seq"}])
            await q.done.wait()
            q.result()
            # quarantining it again is idempotent: the duplicate key on _id is not an error, the
            # stored item gets the new reason
            again = start(tg, lambda: quarantine.put("feed", 3, ORDER, bad, "again"))
            await answer_last_drawn(rs_wire, counter=1, last=1)
            (await rs_wire.command("insert")).ok(n=0, writeErrors=[dup(0, {"_id": 1})])
            found = await rs_wire.command("find")
            assert found["filter"] == {"_id": doc["_id"]}
            found.ok(cursor={"id": 0, "ns": f"{DB}.wow_quarantine__{CONTEXT}", "firstBatch": [{"_id": doc["_id"]}]})
            update = await rs_wire.command("update")
            assert update["update"] == f"wow_quarantine__{CONTEXT}"
            assert update["updates"] == [
                {"q": {"_id": doc["_id"]}, "u": {"$set": {"reason": "again"}}, "multi": False, "upsert": False}
            ]
            update.ok(n=1, nModified=1)
            await again.done.wait()
            again.result()


async def answer_last_drawn(wire: Wire, *, counter: int | None, last: int | None) -> None:
    """Answers a quarantine's two reads of the highest number drawn: the counter document by
    ``_id``, then the last counted item down the ``seq`` index."""
    ns = f"{DB}.wow_quarantine__{CONTEXT}"
    find = await wire.command("find")
    assert (find["filter"], find["projection"]) == ({"_id": "seq"}, {"n": 1})
    find.ok(cursor={"id": 0, "ns": ns, "firstBatch": [] if counter is None else [{"_id": "seq", "n": counter}]})
    find = await wire.command("find")
    assert find["filter"] == {"seq": {"$gte": ObjectId("ffffffff0000000000000000")}}
    assert (find["sort"], find["projection"], find["limit"]) == ({"seq": -1}, {"seq": 1}, 1)
    top = [] if last is None else [{"_id": {"consumer": "wowd"}, "seq": counted(last)}]
    find.ok(cursor={"id": 0, "ns": ns, "firstBatch": top})


def counted(n: int) -> ObjectId:
    return ObjectId(b"\xff\xff\xff\xff" + n.to_bytes(8, "big"))


async def test_quarantine_draws_the_number_after_the_highest_and_again_when_another_took_it(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """Two quarantines at once, no transaction: each draws the number after the highest drawn
    (the counter document's ``n``, raised by a release, or the last item's), and the insert claims
    it through the unique ``seq_unique`` index. The one that inserts second meets E11000 on
    ``seq`` (``keyPattern`` as a 7.0 server answers it) and draws again past the other's item,
    which is visible by then: ``seq`` order is commit order, so a listing paged by ``seq`` passes
    no item committed after it. The counter is then raised to the number; that write timing out
    (a replica of an earlier version holding the counter in an abandoned transaction) is logged,
    not raised: the item is stored."""
    quarantine = make_quarantine(rs_client)
    raw = {"_id": {"t": "(0)", "a": ID_P3, "v": 9}, "aggregate_id": ID_P3, "partition": 3, "version": "x"}
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            q = start(tg, lambda: quarantine.put("feed", 3, ORDER, raw, "unreadable"))
            await answer_last_drawn(rs_wire, counter=7, last=5)  # items 6 and 7 released
            insert = await rs_wire.command("insert")
            assert insert.docs[0]["documents"][0]["seq"] == counted(8)
            taken = {
                "index": 0,
                "code": 11000,
                "errmsg": "E11000 duplicate key error collection: wowd."
                f"wow_quarantine__{CONTEXT} index: seq_unique dup key: {{ seq: ObjectId('ffffffff0000000000000008') }}",
                "keyPattern": {"seq": -1},
                "keyValue": {"seq": counted(8)},
            }
            insert.ok(n=0, writeErrors=[taken])
            await answer_last_drawn(rs_wire, counter=7, last=8)
            insert = await rs_wire.command("insert")
            assert insert.docs[0]["documents"][0]["seq"] == counted(9)
            insert.ok(n=1)
            raised = await rs_wire.command("update")
            assert raised["updates"] == [{"q": {"_id": "seq"}, "u": {"$max": {"n": 9}}, "multi": False, "upsert": True}]
            server_error(raised, 50, "operation exceeded time limit")
            await q.done.wait()
    q.result()
    # the listing without a cursor reads items only (an ObjectId seq), not the counter document
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            page = start(tg, lambda: quarantine.items())
            find = await rs_wire.command("find")
            assert find["filter"] == {
                "seq": {"$gt": ObjectId("000000000000000000000000")},
                "dismissed": {"$exists": False},
            }
            find.ok(cursor={"id": 0, "ns": f"{DB}.wow_quarantine__{CONTEXT}", "firstBatch": []})
            await page.done.wait()
    assert page.result() == []


def quarantine_stored(seq: ObjectId, agg_id: str, reason: str) -> dict[str, Any]:
    """A quarantine document as the server returns it (dates come back naive, in UTC)."""
    raw = {"_id": {"t": "(0)", "a": agg_id, "v": 1}, "aggregate_id": agg_id, "partition": 3}
    return {
        "_id": {"consumer": "wowd", "aggregate": "order", "key": raw["_id"]},
        "consumer": "wowd",
        "partition": 3,
        "aggregate": "order",
        "raw": raw,
        "reason": reason,
        "quarantined_at": datetime(2025, 3, 1, 12, 0, 0, 250_000),
        "seq": seq,
    }


async def test_quarantined_pages_by_seq_and_release_deletes_by_seq(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    quarantine = make_quarantine(rs_client)
    a, b = ObjectId("67c2f8a0aaaaaaaaaaaaaaa1"), ObjectId("67c2f8a0aaaaaaaaaaaaaaa2")
    ns = f"{DB}.wow_quarantine__{CONTEXT}"
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            page = start(tg, lambda: quarantine.items(limit=2, after=str(a)))
            find = await rs_wire.command("find")
            assert find["find"] == f"wow_quarantine__{CONTEXT}"
            assert find["filter"] == {"seq": {"$gt": a}, "dismissed": {"$exists": False}}
            assert find["sort"] == {"seq": 1}
            assert find["limit"] == 2
            find.ok(cursor={"id": 0, "ns": ns, "firstBatch": [quarantine_stored(b, ID_P3, "sink refused it: x")]})
            await page.done.wait()
            [item] = page.result()
            assert item["id"] == str(b)
            assert item["created_at"] == int(datetime(2025, 3, 1, 12, 0, 0, 250_000, tzinfo=UTC).timestamp() * 1000)
            assert (item["consumer"], item["partition"], item["aggregate"], item["reason"]) == (
                "wowd",
                3,
                "order",
                "sink refused it: x",
            )
            assert item["raw"]["aggregate_id"] == ID_P3
            assert item["dismissed"] is None

            # by ids: an id that is not an ObjectId names nothing and is not sent
            picked = start(tg, lambda: quarantine.items(ids=[str(b), "nope", str(a)]))
            find = await rs_wire.command("find")
            assert find["filter"] == {"seq": {"$in": [a, b]}}
            find.ok(cursor={"id": 0, "ns": ns, "firstBatch": []})
            await picked.done.wait()
            assert picked.result() == []

            # release: the items found, the counter raised past the highest counted one (an id
            # never names another item), then the delete of what was found
            c = counted(12)
            released = start(tg, lambda: quarantine.release([str(a), str(b), str(c), "12"]))
            find = await rs_wire.command("find")
            assert (find["filter"], find["projection"]) == ({"seq": {"$in": [a, b, c]}}, {"seq": 1})
            find.ok(
                cursor={"id": 0, "ns": ns, "firstBatch": [{"_id": {"k": 1}, "seq": b}, {"_id": {"k": 2}, "seq": c}]}
            )
            raised = await rs_wire.command("update")
            assert raised["updates"] == [
                {"q": {"_id": "seq"}, "u": {"$max": {"n": 12}}, "multi": False, "upsert": True}
            ]
            raised.ok(n=1, nModified=1)
            delete = await rs_wire.command("delete")
            assert delete["delete"] == f"wow_quarantine__{CONTEXT}"
            assert delete["deletes"] == [{"q": {"seq": {"$in": [b, c]}}, "limit": 0}]
            delete.ok(n=2)
            await released.done.wait()
            assert released.result() == 2
            # items of an earlier version (client-made ObjectIds) raise nothing
            released = start(tg, lambda: quarantine.release([str(a)]))
            find = await rs_wire.command("find")
            find.ok(cursor={"id": 0, "ns": ns, "firstBatch": [{"_id": {"k": 0}, "seq": a}]})
            delete = await rs_wire.command("delete")
            assert delete["deletes"] == [{"q": {"seq": {"$in": [a]}}, "limit": 0}]
            delete.ok(n=1)
            await released.done.wait()
            assert released.result() == 1
    # nothing to send: no id is an ObjectId; an unreadable cursor is refused before any command
    assert await quarantine.release(["12", "x"]) == 0
    assert await quarantine.items(ids=["x"]) == []
    with pytest.raises(InvalidInput, match="after"):
        await quarantine.items(after="12")


async def test_a_dismissal_marks_the_items_not_dismissed_yet_and_the_listing_of_the_dismissed_reads_them(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    quarantine = make_quarantine(rs_client)
    a, b = ObjectId("67c2f8a0aaaaaaaaaaaaaaa1"), ObjectId("67c2f8a0aaaaaaaaaaaaaaa2")
    ns = f"{DB}.wow_quarantine__{CONTEXT}"
    before = datetime.now(UTC).replace(microsecond=0)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            # one update by seq of the items not dismissed yet (an id that is not one is not sent)
            dismissed = start(tg, lambda: quarantine.dismiss([str(b), "12", str(a)], " test data ", "ops@host"))
            update = await rs_wire.command("update")
            assert update["update"] == f"wow_quarantine__{CONTEXT}"
            [u] = update["updates"]
            assert u["q"] == {"seq": {"$in": [a, b]}, "dismissed": {"$exists": False}}
            assert (u["multi"], u.get("upsert", False)) == (True, False)
            mark = u["u"]["$set"]["dismissed"]
            assert (mark["reason"], mark["by"]) == ("test data", "ops@host")
            assert before <= mark["at"].replace(tzinfo=UTC) <= datetime.now(UTC)
            update.ok(n=1, nModified=1)
            await dismissed.done.wait()
            assert dismissed.result() == 1

            # the listing of the dismissed: the same find with the other side of dismissed
            page = start(tg, lambda: quarantine.items(dismissed=True))
            find = await rs_wire.command("find")
            assert find["filter"] == {
                "seq": {"$gt": ObjectId("000000000000000000000000")},
                "dismissed": {"$exists": True},
            }
            stored = {
                **quarantine_stored(b, ID_P3, "events: is missing"),
                "dismissed": {"at": datetime(2025, 3, 2, 8, 0, 0, 500_000), "reason": "test data", "by": "ops@host"},
            }
            find.ok(cursor={"id": 0, "ns": ns, "firstBatch": [stored]})
            await page.done.wait()
            [item] = page.result()
            assert item["dismissed"] == {
                "at": int(datetime(2025, 3, 2, 8, 0, 0, 500_000, tzinfo=UTC).timestamp() * 1000),
                "reason": "test data",
                "by": "ops@host",
            }
    # nothing to send: no id is an ObjectId; a blank reason is refused before any command
    assert await quarantine.dismiss(["12", "x"], "why", "ops") == 0
    with pytest.raises(InvalidInput, match="reason"):
        await quarantine.dismiss([str(a)], " ", "ops")


async def test_prepare_creates_the_quarantine_seq_index(rs_client: AsyncMongoClient[Any], rs_wire: Wire) -> None:
    quarantine = make_quarantine(rs_client, ddl=Ddl.AUTO)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, quarantine.prepare)
            create = await rs_wire.command("createIndexes")
            assert create["createIndexes"] == f"wow_quarantine__{CONTEXT}"
            assert create["indexes"] == [
                {"key": {"quarantined_at": 1, "seq": 1}, "name": "quarantined_at"},
                {"key": {"seq": 1}, "name": "seq"},
                {
                    "key": {"seq": -1},
                    "name": "seq_unique",
                    "unique": True,
                    "partialFilterExpression": {"seq": {"$type": "objectId"}},
                },
            ]
            create.ok(numIndexesBefore=2, numIndexesAfter=4, createdCollectionAutomatically=False)
            await call.done.wait()
            call.result()


async def test_a_standalone_server_refusing_the_change_stream_is_a_config_error(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    log = make_log(rs_client)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: collect(log.read({3: pos((1, 1))}, follow=False)))
            server_error(
                await rs_wire.command("aggregate"), 40573, "The $changeStream stage is only supported on replica sets"
            )
            await call.done.wait()
    with pytest.raises(ConfigError, match="replica set"):
        call.result()


# --------------------------------------------------------------------------- checkpoints


async def test_checkpoint_save_is_one_upsert_guarded_by_the_fence(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    checkpoints = make_checkpoints(rs_client)
    position = pos((300, 4))
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            saved = start(tg, lambda: checkpoints.save("feed", 3, position, 7))
            upd = await rs_wire.command("update")
            assert upd["update"] == f"wow_checkpoint__{CONTEXT}"
            (u,) = upd.docs[0]["updates"]
            assert u["q"] == {"_id": {"consumer": "feed", "partition": 3}, "fence": {"$lte": 7}}
            assert u["upsert"] is True
            assert u["u"] == [
                {"$set": {"position": {"$literal": position}, "fence": 7, "written_at": {"$toLong": "$$NOW"}}}
            ]
            upd.ok(n=1, nModified=1)
            await saved.done.wait()
            assert saved.result() is True

            # a higher fence holds it: the upsert's insert meets the _id -> refused, not raised
            refused = start(tg, lambda: checkpoints.save("feed", 3, position, 6))
            upd = await rs_wire.command("update")
            assert upd.docs[0]["updates"][0]["q"]["fence"] == {"$lte": 6}
            upd.ok(n=0, nModified=0, writeErrors=[dup(0, {"_id": 1})])
            await refused.done.wait()
            assert refused.result() is False

            loaded = start(tg, lambda: checkpoints.read("feed", [3, 5]))
            find = await rs_wire.command("find")
            assert find["filter"] == {
                "_id": {"$in": [{"consumer": "feed", "partition": 3}, {"consumer": "feed", "partition": 5}]}
            }
            find.ok(
                cursor={
                    "id": 0,
                    "ns": f"{DB}.wow_checkpoint__ctx",
                    "firstBatch": [
                        {
                            "_id": {"consumer": "feed", "partition": 3},
                            "position": position,
                            "fence": 7,
                            "written_at": 123,
                        }
                    ],
                }
            )
            await loaded.done.wait()
    cps = loaded.result()
    assert list(cps) == [3]
    assert (cps[3].position, cps[3].fence, cps[3].written_at) == (position, 7, 123)


async def test_a_duplicate_with_a_write_concern_error_is_not_answered_as_there(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """``log.append``, ``checkpoints.save`` and ``outbox.put`` each met a duplicate key and a
    write concern error in the same reply: the document the key met may roll back, so none
    answers "duplicate" / "refused" / "already there": each raises StorageUnavailable (retried).
    A 7.0 server waits for the write concern also when the write failed on a duplicate key
    (src/mongo/db/ops/write_ops_exec.cpp, ``LastOpFixer``: the client's last optime is set to the
    system's, so the wait covers the document the key met) and answers both in one reply,
    ``writeErrors`` and ``writeConcernError`` (manual, Write Concern, "writeConcernError")."""
    log = make_log(rs_client)
    checkpoints = make_checkpoints(rs_client)
    outbox = MongoOutbox(rs_client, DB, context=CONTEXT, ddl=Ddl.NONE)
    log._ensured.add(ORDERS)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            appended = start(tg, lambda: log.append(commit(ID_P3, 1)))
            insert = await rs_wire.command("insert")
            assert len(insert.docs[0]["documents"]) == 1  # one document, as insert_one sends it
            insert.ok(
                n=0,
                writeErrors=[dup(0, {"aggregate_id": 1, "request_id": 1})],
                writeConcernError=write_concern_timeout(),
            )
            await appended.done.wait()
            with pytest.raises(StorageUnavailable, match="write concern"):
                appended.result()

            saved = start(tg, lambda: checkpoints.save("feed", 3, pos((300, 4)), 6))
            upd = await rs_wire.command("update")
            assert upd.docs[0]["updates"][0]["upsert"] is True
            upd.ok(n=0, nModified=0, writeErrors=[dup(0, {"_id": 1})], writeConcernError=write_concern_timeout())
            await saved.done.wait()
            with pytest.raises(StorageUnavailable, match="write concern"):
                saved.result()

            put = start(tg, lambda: outbox.put(_outbox_entry("r1")))
            insert = await rs_wire.command("insert")
            insert.ok(n=0, writeErrors=[dup(0, {"request_id": 1})], writeConcernError=write_concern_timeout())
            await put.done.wait()
            with pytest.raises(StorageUnavailable, match="write concern"):
                put.result()

            # the same duplicate without a write concern error: durable as asked, answered so
            put = start(tg, lambda: outbox.put(_outbox_entry("r1")))
            (await rs_wire.command("insert")).ok(n=0, writeErrors=[dup(0, {"request_id": 1})])
            await put.done.wait()
            assert put.result() is False


async def test_a_batchs_checkpoints_are_one_unordered_bulk_and_one_refused_item_is_false(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    checkpoints = make_checkpoints(rs_client)
    positions = {5: pos((300, 4)), 3: pos((300, 2))}
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            saved = start(tg, lambda: checkpoints.save_all("feed", positions, 7))
            upd = await rs_wire.command("update")
            assert upd["ordered"] is False
            qs = [u["q"] for u in upd.docs[0]["updates"]]
            assert qs == [
                {"_id": {"consumer": "feed", "partition": 3}, "fence": {"$lte": 7}},
                {"_id": {"consumer": "feed", "partition": 5}, "fence": {"$lte": 7}},
            ]
            assert all(u["upsert"] is True for u in upd.docs[0]["updates"])
            upd.ok(n=2, nModified=2)
            await saved.done.wait()
            assert saved.result() is True

            # partition 5 is held under a higher fence: its upsert meets the _id
            refused = start(tg, lambda: checkpoints.save_all("feed", positions, 6))
            upd = await rs_wire.command("update")
            upd.ok(n=1, nModified=1, writeErrors=[dup(1, {"_id": 1})])
            await refused.done.wait()
            assert refused.result() is False
    assert await checkpoints.save_all("feed", {}, 6) is True


# --------------------------------------------------------------------------- appends


async def test_append_e11000_on_request_id_is_duplicate_and_on_id_with_another_request_is_conflict(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    log = make_log(rs_client)
    c = commit(ID_P3, 4)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            ok = start(tg, lambda: log.append(c))
            insert = await rs_wire.command("insert")
            assert insert["insert"] == ORDERS
            assert insert.docs[0]["documents"][0] == log_doc(ID_P3, 4)
            insert.ok(n=1)
            await ok.done.wait()
            assert ok.result() == "appended"

            repeat = start(tg, lambda: log.append(c))
            (await rs_wire.command("insert")).ok(n=0, writeErrors=[dup(0, {"aggregate_id": 1, "request_id": 1})])
            await repeat.done.wait()
            assert repeat.result() == "duplicate"

            other = commit(ID_P3, 4, request_id="someone-else")
            conflict = start(tg, lambda: log.append(other))
            (await rs_wire.command("insert")).ok(n=0, writeErrors=[dup(0, {"_id": 1})])
            find = await rs_wire.command("find")
            assert find["filter"] == {"_id": {"$in": [{"t": "(0)", "a": ID_P3, "v": 4}]}}
            find.ok(
                cursor={
                    "id": 0,
                    "ns": f"{DB}.{ORDERS}",
                    "firstBatch": [{"_id": {"t": "(0)", "a": ID_P3, "v": 4}, "request_id": c.request_id}],
                }
            )
            await conflict.done.wait()
            with pytest.raises(ConflictError):
                conflict.result()

            # the same commit meeting its own _id (retried insert) is a duplicate, not a conflict
            same = start(tg, lambda: log.append(c))
            (await rs_wire.command("insert")).ok(n=0, writeErrors=[dup(0, {"_id": 1})])
            (await rs_wire.command("find")).ok(
                cursor={
                    "id": 0,
                    "ns": f"{DB}.{ORDERS}",
                    "firstBatch": [{"_id": {"t": "(0)", "a": ID_P3, "v": 4}, "request_id": c.request_id}],
                }
            )
            await same.done.wait()
            assert same.result() == "duplicate"


async def test_append_many_is_one_unordered_insert_with_an_outcome_per_commit(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    log = make_log(rs_client)
    commits = [commit(ID_P3, 1), commit(ID_P3, 2), commit(ID_P5, 1, request_id="new")]
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: log.append_many(commits))
            insert = await rs_wire.command("insert")
            assert insert["ordered"] is False
            assert len(insert.docs[0]["documents"]) == 3
            insert.ok(n=1, writeErrors=[dup(1, {"aggregate_id": 1, "request_id": 1}), dup(2, {"_id": 1})])
            find = await rs_wire.command("find")
            find.ok(
                cursor={
                    "id": 0,
                    "ns": f"{DB}.{ORDERS}",
                    "firstBatch": [{"_id": {"t": "(0)", "a": ID_P5, "v": 1}, "request_id": "older"}],
                }
            )
            await call.done.wait()
    assert call.result() == ["appended", "duplicate", "conflict"]


async def test_auto_ddl_creates_the_log_indexes_before_the_first_append(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    log = make_log(rs_client, Ddl.AUTO)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: log.append(commit(ID_P3, 1)))
            # sharding=auto: is the server a mongos? (a replica set's member: the log is not sharded)
            (await rs_wire.command("hello")).ok(isWritablePrimary=True, setName="rs0", maxWireVersion=21)
            ci = await rs_wire.command("createIndexes")
            assert ci["createIndexes"] == ORDERS
            assert "aggregate_hashed" not in {i["name"] for i in ci["indexes"]}
            indexes = {i["name"]: i for i in ci["indexes"]}
            assert indexes["aggregate_request"]["key"] == {"aggregate_id": 1, "request_id": 1}
            assert indexes["aggregate_request"]["unique"] is True
            assert indexes["partition_order"]["key"] == {"partition": 1, "aggregate_id": 1, "version": 1, "_id": 1}
            ci.ok()
            (await rs_wire.command("insert")).ok(n=1)
            await call.done.wait()
    assert call.result() == "appended"


async def test_the_log_indexes_of_an_existing_collection_are_built_with_no_deadline(
    rs_server: MockupDB, rs_wire: Wire
) -> None:
    """``prepare`` makes sure of the indexes of the log collections there already, which may be
    large: a client with ``timeoutMS`` (the deployment's) sends no ``maxTimeMS`` with their
    ``createIndexes`` (an interrupted build is aborted: manual, createIndexes; server
    src/mongo/db/commands/create_indexes_cmd.cpp)."""
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        rs_server.uri, serverSelectionTimeoutMS=3000, retryWrites=False, retryReads=False, timeoutMS=10_000
    )
    try:
        log = MongoLog(client, DB, context=CONTEXT, partitions=PARTITIONS, ddl=Ddl.AUTO)
        with anyio.fail_after(15):
            async with anyio.create_task_group() as tg:
                call = start(tg, log.prepare)
                lc = await rs_wire.command("listCollections")
                lc.ok(cursor={"id": 0, "ns": f"{DB}.$cmd.listCollections", "firstBatch": [{"name": ORDERS}]})
                (await rs_wire.command("hello")).ok(isWritablePrimary=True, setName="rs0", maxWireVersion=21)
                ci = await rs_wire.command("createIndexes")
                assert ci["createIndexes"] == ORDERS and "maxTimeMS" not in ci
                ci.ok(numIndexesBefore=2, numIndexesAfter=3, createdCollectionAutomatically=False)
                await call.done.wait()
        assert call.result() is None
    finally:
        await client.close()


# --------------------------------------------------------------------------- outbox, replica-set check


async def test_outbox_is_unique_on_the_request_id(rs_client: AsyncMongoClient[Any], rs_wire: Wire) -> None:
    outbox = MongoOutbox(rs_client, DB, context=CONTEXT)
    assert isinstance(outbox, Outbox)
    entry = OutboxEntry(
        request_id="r1",
        timer_id="t1",
        target=AggregateRef(context="ctx", aggregate="order", id="o1"),
        command='{"body":{},"name":"Pay"}',
        scheduled_at=5,
        fence=2,
        owner_key="host:1",
        created_at=6,
    )
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            put = start(tg, lambda: outbox.put(entry))
            ci = await rs_wire.command("createIndexes")
            assert ci["createIndexes"] == f"wow_outbox__{CONTEXT}"
            assert ci["indexes"] == [
                {"key": {"request_id": 1}, "name": "request_id", "unique": True},
                {"key": {"created_at": 1}, "name": "created_at"},  # the retention's trim
            ]
            ci.ok()
            insert = await rs_wire.command("insert")
            assert insert.docs[0]["documents"][0]["request_id"] == "r1"
            insert.ok(n=1)
            await put.done.wait()
            assert put.result() is True

            refire = start(tg, lambda: outbox.put(entry))
            (await rs_wire.command("insert")).ok(n=0, writeErrors=[dup(0, {"request_id": 1})])
            await refire.done.wait()
            assert refire.result() is False


async def test_outbox_put_many_is_one_unordered_insert(rs_client: AsyncMongoClient[Any], rs_wire: Wire) -> None:
    outbox = MongoOutbox(rs_client, DB, context=CONTEXT, ddl=Ddl.NONE)
    target = AggregateRef(context="ctx", aggregate="order", id="o1")
    batch = [
        OutboxEntry(
            request_id=r,
            timer_id="t",
            target=target,
            command="{}",
            scheduled_at=1,
            fence=1,
            owner_key="k",
            created_at=2,
        )
        for r in ("r1", "r2", "r1")
    ]
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: outbox.put_many(batch))
            insert = await rs_wire.command("insert")
            assert insert["ordered"] is False
            assert [d["request_id"] for d in insert.docs[0]["documents"]] == ["r1", "r2", "r1"]
            insert.ok(n=2, writeErrors=[dup(2, {"request_id": 1})])
            await call.done.wait()
    assert call.result() == [True, True, False]


async def test_outbox_put_many_with_a_write_concern_error_is_unavailable(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """Duplicates plus a write concern error: the batch is not known durable, so it is not
    answered as if it were (the retry answers the written ones as repeats)."""
    outbox = MongoOutbox(rs_client, DB, context=CONTEXT, ddl=Ddl.NONE)
    target = AggregateRef(context="ctx", aggregate="order", id="o1")
    batch = [
        OutboxEntry(
            request_id=r,
            timer_id="t",
            target=target,
            command="{}",
            scheduled_at=1,
            fence=1,
            owner_key="k",
            created_at=2,
        )
        for r in ("r1", "r1")
    ]
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: outbox.put_many(batch))
            (await rs_wire.command("insert")).ok(
                n=1,
                writeErrors=[dup(1, {"request_id": 1})],
                writeConcernError=write_concern_timeout(),
            )
            await call.done.wait()
    with pytest.raises(StorageUnavailable, match="write concern"):
        call.result()


def _outbox_doc(oid: ObjectId, request_id: str) -> dict[str, Any]:
    return {
        "_id": oid,
        "request_id": request_id,
        "timer_id": "t",
        "target": {"context": "ctx", "aggregate": "order", "tenant_id": "(0)", "id": "o1"},
        "command": "{}",
        "scheduled_at": 1,
        "fence": 1,
        "owner_key": "k",
        "created_at": 2,
    }


def _outbox_entry(request_id: str) -> OutboxEntry:
    target = AggregateRef(context="ctx", aggregate="order", id="o1")
    return OutboxEntry(
        request_id=request_id,
        timer_id="t",
        target=target,
        command="{}",
        scheduled_at=1,
        fence=1,
        owner_key="k",
        created_at=2,
    )


def _first_batch(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": 0, "ns": f"{DB}.wow_outbox__{CONTEXT}", "firstBatch": docs}


async def test_outbox_take_skips_no_entry_a_writer_committed_behind_the_taken_ones(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """Writer A makes its entry's ``_id`` first and commits it last; writer B's later ``_id``
    is taken before A's entry exists. ObjectIds are made by each client and "are not necessarily
    monotonic" (manual, BSON Types, ObjectId: one-second resolution, clients' own clocks), so a
    take after B's ``_id`` would never see A's entry: a take reads every entry not acknowledged
    and not leased, whatever its ``_id``, and leases what it read (``$$NOW``: manual, Aggregation
    Variables; a pipeline update: manual, Updates with Aggregation Pipeline). Each answer is what
    a 7.0 server gives: an update whose filter no longer matches (another take leased the entry)
    answers ``n: 0``."""
    writer_a = MongoOutbox(rs_client, DB, context=CONTEXT, ddl=Ddl.NONE)
    writer_b = MongoOutbox(rs_client, DB, context=CONTEXT, ddl=Ddl.NONE)
    consumer = MongoOutbox(rs_client, DB, context=CONTEXT, ddl=Ddl.NONE)
    free = {"$expr": {"$lte": ["$lease_until", "$$NOW"]}}

    async def take(found: list[dict[str, Any]], modified: int, held: list[dict[str, Any]]) -> tuple[Any, str | None]:
        find = await rs_wire.command("find")
        assert find["find"] == f"wow_outbox__{CONTEXT}"
        assert find["filter"] == free  # no cursor: an entry behind the taken ones is found
        assert find["sort"] == {"_id": 1} and find["limit"] == 10 and find["projection"] == {"_id": 1}
        find.ok(cursor=_first_batch([{"_id": d["_id"]} for d in found]))
        if not found:
            return None, None
        update = await rs_wire.command("update")
        ids = [d["_id"] for d in found]
        # one statement per entry, each free again (a retryable write: no multi), unordered
        assert [u["q"] for u in update.docs[0]["updates"]] == [{"_id": i, **free} for i in ids]
        assert update.docs[0]["ordered"] is False and not any(u.get("multi") for u in update.docs[0]["updates"])
        lease_id = update.docs[0]["updates"][0]["u"][0]["$set"]["lease"]
        for u in update.docs[0]["updates"]:
            assert u["u"] == [{"$set": {"lease_until": {"$add": ["$$NOW", 30_000]}, "lease": lease_id}}]
        update.ok(n=modified, nModified=modified)
        readback = await rs_wire.command("find")
        assert readback["filter"] == {"_id": {"$in": ids}, "lease": lease_id}
        readback.ok(cursor=_first_batch([{**d, "lease": lease_id} for d in held]))
        return update, lease_id

    lease = timedelta(seconds=30)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            put_a = start(tg, lambda: writer_a.put_many([_outbox_entry("r-a")]))
            insert_a = await rs_wire.command("insert")  # held: A commits last
            put_b = start(tg, lambda: writer_b.put(_outbox_entry("r-b")))
            insert_b = await rs_wire.command("insert")
            insert_b.ok(n=1)
            a, b = insert_a.docs[0]["documents"][0], insert_b.docs[0]["documents"][0]
            assert a["_id"] < b["_id"]
            await put_b.done.wait()

            first = start(tg, lambda: consumer.take(10, lease=lease))
            _, first_lease = await take([b], 1, [b])
            await first.done.wait()
            assert [e.request_id for e in first.result().entries] == ["r-b"]
            assert first.result().cursor == first_lease

            insert_a.ok(n=1)  # A's entry commits now, its _id before the one taken
            await put_a.done.wait()
            assert put_a.result() == [True]

            second = start(tg, lambda: consumer.take(10, lease=lease))
            _, second_lease = await take([a], 1, [a])  # r-b is held: the server does not match it
            await second.done.wait()
            assert [e.request_id for e in second.result().entries] == ["r-a"]
            assert second_lease != first_lease

            # two takes found r-a free at once; the other leased it first: this one gets nothing
            third = start(tg, lambda: consumer.take(10, lease=lease))
            await take([a], 0, [])
            await third.done.wait()
            assert third.result().entries == () and third.result().cursor is None

            # every entry held: one find, nothing leased
            fourth = start(tg, lambda: consumer.take(10, lease=lease))
            await take([], 0, [])
            await fourth.done.wait()
            assert fourth.result().entries == ()


async def test_outbox_ack_and_trim_are_one_delete_many_each(rs_client: AsyncMongoClient[Any], rs_wire: Wire) -> None:
    outbox = MongoOutbox(rs_client, DB, context=CONTEXT, ddl=Ddl.NONE)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            ack = start(tg, lambda: outbox.ack(["r1", "r2"]))
            delete = await rs_wire.command("delete")
            assert delete["delete"] == f"wow_outbox__{CONTEXT}"
            assert delete.docs[0]["deletes"] == [{"q": {"request_id": {"$in": ["r1", "r2"]}}, "limit": 0}]
            delete.ok(n=1)
            await ack.done.wait()
            assert ack.result() == 1

            trim = start(tg, lambda: outbox.trim(2_000))
            delete = await rs_wire.command("delete")
            assert delete.docs[0]["deletes"] == [{"q": {"created_at": {"$lt": 2_000}}, "limit": 0}]
            delete.ok(n=7)
            await trim.done.wait()
            assert trim.result() == 7


async def test_last_version_reads_one_version_over_the_partition_order_index(
    rs_client: AsyncMongoClient[Any], rs_wire: Wire
) -> None:
    """Two point intervals on the index's first key (the partition, and none stored: the schema
    leaves ``partition`` out), one on its second, merged in version order, of the integer versions
    (a string sorts above every number in BSON order); the default tenant also matches a commit
    stored without ``tenant_id`` (the schema's default)."""
    log = make_log(rs_client)
    ref = AggregateRef(context=CONTEXT, aggregate="order", id=ID_P3, tenant_id="t1")
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: log.last_version(ref))
            find = await rs_wire.command("find")
            assert find["find"] == ORDERS
            assert find["filter"] == {
                "partition": {"$in": [3, None]},
                "aggregate_id": ID_P3,
                "tenant_id": "t1",
                "version": {"$type": ["int", "long"]},
            }
            assert find["sort"] == {"version": -1} and find["limit"] == 1
            assert find["projection"] == {"_id": 0, "version": 1}
            find.ok(cursor={"id": 0, "ns": f"{DB}.{ORDERS}", "firstBatch": [{"version": 4}]})
            await call.done.wait()
            assert call.result() == 4

            none = start(tg, lambda: log.last_version(AggregateRef(context=CONTEXT, aggregate="order", id=ID_P3)))
            find = await rs_wire.command("find")
            assert find["filter"]["tenant_id"] == {"$in": ["(0)", None]}
            find.ok(cursor={"id": 0, "ns": f"{DB}.{ORDERS}", "firstBatch": []})
            await none.done.wait()
            assert none.result() == 0


async def test_check_replica_set_refuses_a_standalone(mongo_client: AsyncMongoClient[Any], wire: Wire) -> None:
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: check_replica_set(mongo_client))
            (await wire.command("hello")).ok(isWritablePrimary=True, maxWireVersion=21)
            await call.done.wait()
    with pytest.raises(ConfigError, match="standalone.*replica set"):
        call.result()


async def test_check_replica_set_accepts_a_replica_set_member(rs_client: AsyncMongoClient[Any], rs_wire: Wire) -> None:
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: check_replica_set(rs_client))
            (await rs_wire.command("hello")).ok(isWritablePrimary=True, setName="rs0")
            await call.done.wait()
    call.result()


async def test_open_mongo_on_a_standalone_says_so_and_closes_what_it_opened(mock_server: MockupDB, wire: Wire) -> None:
    mock_server.autoresponds(housekeeping)
    settings = WowdSettings(
        backend="mongo",
        mongodb=MongoSettings(uri=SecretStr(mock_server.uri), timeout_ms=5000),
        elasticsearch=ElasticsearchSettings(url="http://127.0.0.1:9"),
    )
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = start(tg, lambda: open_mongo(settings))
            (await wire.command("hello")).ok(isWritablePrimary=True, maxWireVersion=21)
            await call.done.wait()
    with pytest.raises(ConfigError, match="standalone"):
        call.result()


def test_client_options_from_the_settings() -> None:
    mongo = MongoSettings(uri=SecretStr("mongodb://db/?replicaSet=rs0"), timeout_ms=2500, write_concern="1")
    assert mongo_client_options(mongo) == {"w": 1, "timeoutMS": 2500}
    basic = client_options(
        ElasticsearchSettings(
            url="https://es:9200", username="elastic", password=SecretStr("pw"), ca_certs=Path("/ca.pem")
        )
    )
    assert basic["basic_auth"] == ("elastic", "pw")
    assert basic["verify_certs"] is True  # TLS verification stays on unless switched off
    assert basic["ca_certs"] == "/ca.pem"
    keyed = client_options(ElasticsearchSettings(url="https://es:9200", api_key=SecretStr("k"), verify_certs=False))
    assert (keyed["api_key"], keyed["verify_certs"], "basic_auth" in keyed) == ("k", False, False)
    with pytest.raises(ConfigError, match="password"):
        client_options(ElasticsearchSettings(url="https://es:9200", username="u"))
