"""What the simulator does as a replica set does beyond one healthy primary: elections and
step-downs (the driver's retryable writes and reads, change streams resuming), the retryable
writes' transaction table, ``maxTimeMS``, index builds that take time, queries no index can answer
(``notablescan``), reads isolated from open transactions, majority reads of a new primary's stale
commit point, ``replSetGetConfig``. Each talks to it through the real (synchronous) PyMongo driver;
the rule each follows is cited where the engine makes it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from bson.timestamp import Timestamp
from pymongo import MongoClient
from pymongo.errors import OperationFailure, WriteConcernError
from pymongo.read_concern import ReadConcern

from tests.mongosim import Settings, serving
from tests.mongosim.engine import StepDownTrigger
from tests.mongosim.wire import WireServer

Client = MongoClient[dict[str, Any]]


def test_a_step_down_refuses_writes_and_primary_reads_until_the_election_and_the_driver_retries(
    server: WireServer, client: Client
) -> None:
    """Between a step-down and the election: ``hello`` says secondary (no primary); a write is
    10107 NotWritablePrimary with ``RetryableWriteError`` on a retryable write, a primary read
    13435. The driver's retryable write waits for the new primary (a new term) and succeeds."""
    engine = server.engine
    client.t.c.insert_one({"_id": 1})
    raw: Client = MongoClient(server.uri, directConnection=True)
    conn = engine.connect(None)  # the server's own answers, as a driver that still takes it for primary meets them
    try:
        engine.step_down(0.3)
        hello = raw.admin.command("hello")
        assert hello["secondary"] is True and hello["isWritablePrimary"] is False and "primary" not in hello
        lsid = {"id": b"\x01" * 16}
        write = engine.run(conn, {"insert": "c", "documents": [{"_id": 2}], "lsid": lsid, "txnNumber": 1, "$db": "t"})
        assert (write["code"], write["errorLabels"]) == (10107, ["RetryableWriteError"])
        read = engine.run(conn, {"find": "c", "$db": "t"})
        assert read["code"] == 13435 and "errorLabels" not in read
        secondary_ok = engine.run(conn, {"find": "c", "$db": "t", "$readPreference": {"mode": "secondaryPreferred"}})
        assert secondary_ok["ok"] == 1.0
        started = time.monotonic()
        client.t.c.insert_one({"_id": 3})  # retried by the driver once the new primary is elected
        assert time.monotonic() - started < 5
        assert engine.writable and engine.term == 2
        assert raw.admin.command("hello")["electionId"] != hello.get("electionId")
    finally:
        raw.close()
    assert sorted(d["_id"] for d in client.t.c.find()) == [1, 3]


def test_a_write_applied_then_its_reply_lost_is_applied_once_when_the_driver_retries_it(
    server: WireServer, client: Client
) -> None:
    """The server records each session's last retryable write (``txnNumber``) and its result: a
    retry answers that result without applying again (manual, "Retryable Writes"). The member
    steps down after the update applied and the connection closes (the reply is lost): the
    driver retries on the new primary, and the ``$inc`` counts once."""
    client.t.c.insert_one({"_id": 1, "n": 0})
    server.engine.step_down_on(StepDownTrigger("update", 0.15, after_apply=True, close_connection=True))
    client.t.c.update_one({"_id": 1}, {"$inc": {"n": 1}})
    assert client.t.c.find_one({"_id": 1}) == {"_id": 1, "n": 1}
    raw = client.t.command  # an older transaction number of the session than its last: 225
    with client.start_session() as s:
        client.t.c.insert_one({"_id": 2}, session=s)
        with pytest.raises(OperationFailure) as old:
            raw({"insert": "c", "documents": [{"_id": 9}], "txnNumber": 0}, session=s)
        assert old.value.code == 225


def test_a_majority_wait_ended_by_a_step_down_is_a_retryable_write_concern_error(server: WireServer) -> None:
    """A write waiting for ``w: majority`` when the member steps down answers the write applied
    and a write concern error 189 PrimarySteppedDown labelled ``RetryableWriteError``; without
    retries the driver raises it."""
    engine = server.engine
    c: Client = MongoClient(server.uri, retryWrites=False, w="majority")
    try:
        engine.hold_majority()
        threading.Timer(0.1, engine.step_down, args=(0.1,)).start()
        with pytest.raises(WriteConcernError) as caught:
            c.t.c.insert_one({"_id": 1})
        assert caught.value.code == 189
        assert c.t.c.count_documents({}) == 1  # applied
    finally:
        engine.release_majority()
        c.close()


def test_max_time_ms_bounds_the_majority_wait_and_a_slow_read() -> None:
    """The write concern wait counts against ``maxTimeMS`` (a write concern error 50, the write
    applied), and so does a read's work (50 MaxTimeMSExpired)."""
    with serving(Settings(noop_interval=0, scan_seconds_per_doc=0.01)) as slow:
        c: Client = MongoClient(slow.uri)
        try:
            c.t.c.insert_many([{"_id": i} for i in range(50)])  # a scan: 0.5 s
            with pytest.raises(OperationFailure) as read:
                c.t.command("find", "c", filter={"x": 1}, maxTimeMS=100)
            assert read.value.code == 50
            assert c.t.command("find", "c", filter={"_id": 3})["cursor"]["firstBatch"] == [{"_id": 3}]  # one examined
            slow.engine.hold_majority()
            reply = c.t.command(
                {"insert": "c", "documents": [{"_id": 99}], "writeConcern": {"w": "majority"}, "maxTimeMS": 100}
            )
            assert reply["writeConcernError"]["code"] == 50 and "errorLabels" not in reply
            slow.engine.release_majority()
        finally:
            c.close()


def test_an_index_build_takes_time_and_its_max_time_ms_aborts_it() -> None:
    with serving(Settings(noop_interval=0, index_build_seconds_per_doc=0.002)) as slow:
        c: Client = MongoClient(slow.uri)
        try:
            c.t.c.insert_many([{"_id": i, "x": i} for i in range(100)])  # 0.2 s a build
            with pytest.raises(OperationFailure) as aborted:
                c.t.command("createIndexes", "c", indexes=[{"key": {"x": 1}, "name": "x"}], maxTimeMS=50)
            assert aborted.value.code == 50
            assert [ix["name"] for ix in c.t.c.list_indexes()] == ["_id_"]
            started = time.monotonic()
            c.t.command("createIndexes", "c", indexes=[{"key": {"x": 1}, "name": "x"}])
            assert time.monotonic() - started >= 0.2
            assert [ix["name"] for ix in c.t.c.list_indexes()] == ["_id_", "x"]
        finally:
            c.close()


def test_a_query_no_index_answers_is_refused_beyond_a_small_collection() -> None:
    """As ``notablescan``, past ``table_scan_limit`` documents: a filter no index bounds (291),
    a partial index used only when the filter implies its partial filter, an ``$or`` only when
    every branch has one; a small collection is scanned."""
    with serving(Settings(noop_interval=0, table_scan_limit=10)) as s:
        c: Client = MongoClient(s.uri)
        try:
            coll = c.t.c
            coll.insert_many([{"_id": i, "x": i, "y": i, "s": "A" if i % 2 else "B"} for i in range(20)])
            coll.create_index([("x", 1)])
            coll.create_index([("y", 1)], partialFilterExpression={"s": "A"})
            assert coll.count_documents({"x": {"$gte": 5}}) == 15
            assert len(list(coll.find({"y": 3, "s": "A"}))) == 1  # the partial index: its filter implied
            assert len(list(coll.find({"$or": [{"x": 1}, {"_id": 2}]}))) == 2
            assert len(list(coll.find({}).sort("x", 1))) == 20  # the index gives the order
            for flt in ({"y": 3}, {"s": "A"}, {"$or": [{"x": 1}, {"s": "B"}]}, {"$expr": {"$eq": ["$x", 1]}}):
                with pytest.raises(OperationFailure) as refused:
                    list(coll.find(flt))
                assert refused.value.code == 291 and "notablescan" in str(refused.value), flt
            c.t.small.insert_many([{"_id": i} for i in range(10)])
            assert c.t.small.count_documents({"z": 1}) == 0  # scanned: a small collection
        finally:
            c.close()


def test_reads_do_not_see_another_sessions_uncommitted_writes(client: Client) -> None:
    """Manual, "Transactions": until a transaction commits, its writes are not visible outside
    it; the transaction itself reads them."""
    coll = client.t.c
    coll.insert_one({"_id": 1, "n": 0})
    with client.start_session() as s:
        s.start_transaction()
        coll.update_one({"_id": 1}, {"$set": {"n": 1}}, session=s)
        coll.insert_one({"_id": 2}, session=s)
        assert coll.find_one({"_id": 1}, session=s) == {"_id": 1, "n": 1}
        assert list(coll.find()) == [{"_id": 1, "n": 0}]
        assert coll.count_documents({}) == 1
        assert list(coll.aggregate([{"$match": {}}])) == [{"_id": 1, "n": 0}]
        s.commit_transaction()
    assert sorted(d["_id"] for d in coll.find()) == [1, 2]


def test_a_new_primary_may_answer_majority_reads_from_a_stale_commit_point_for_a_while(
    server: WireServer, client: Client
) -> None:
    """After an election a 7.0 primary may serve majority reads from a commit point older than
    writes the old primary acknowledged with ``w: majority`` (SERVER-53813, fixed in 8.0), until
    its own term's first write commits. A majority read with ``afterClusterTime`` past that point
    waits for it (manual, "Read Concern": afterClusterTime)."""
    engine = server.engine
    coll = client.t.c
    coll.insert_one({"_id": 1})
    before: Timestamp = engine.ct
    coll.insert_one({"_id": 2})  # acknowledged w: majority by the old primary
    after: Timestamp = engine.ct
    engine.step_down(0.05, majority_at=before, majority_for=0.4)
    majority = coll.with_options(read_concern=ReadConcern("majority"))
    deadline = time.monotonic() + 5
    while not engine.writable and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(d["_id"] for d in majority.find()) == [1]  # the stale commit point
    assert sorted(d["_id"] for d in coll.find()) == [1, 2]  # a local read sees it
    reply = client.t.command("find", "c", readConcern={"level": "majority", "afterClusterTime": after}, maxTimeMS=5000)
    assert sorted(d["_id"] for d in reply["cursor"]["firstBatch"]) == [1, 2]  # waited for the point


def test_a_change_stream_resumes_on_the_new_primary_across_a_failover(server: WireServer, client: Client) -> None:
    """The member goes away (its connections close, its cursors with it) and a new primary is
    elected: the driver resumes the stream there after the last event it returned (a network
    error is resumable: the change streams specification), losing and repeating nothing."""
    coll = client.t.c
    with coll.watch(max_await_time_ms=50) as stream:
        coll.insert_one({"_id": 1})
        first = stream.try_next()
        while first is None:
            first = stream.try_next()
        server.engine.step_down(0.15, close_connections=True)
        coll.insert_one({"_id": 2})  # retried on the new primary
        seen = []
        deadline = time.monotonic() + 5
        while len(seen) < 1 and time.monotonic() < deadline:
            change = stream.try_next()
            if change is not None:
                seen.append(change["documentKey"]["_id"])
    assert first["documentKey"]["_id"] == 1 and seen == [2]


def test_repl_set_get_config_answers_the_election_timeout(server: WireServer, client: Client) -> None:
    config = client.admin.command("replSetGetConfig")["config"]
    assert config["_id"] == "wowdsim" and config["settings"]["electionTimeoutMillis"] == 10_000
    with pytest.raises(OperationFailure) as exc:
        client.t.command("replSetGetConfig")
    assert exc.value.code == 13


def test_type_takes_an_array_of_types(client: Client) -> None:
    """Manual, "$type", "Querying by Multiple Data Types"."""
    client.t.c.insert_many([{"_id": 1, "p": 1}, {"_id": 2, "p": "1"}, {"_id": 3, "p": 1.5}, {"_id": 4}])
    assert sorted(d["_id"] for d in client.t.c.find({"p": {"$type": ["int", "string"]}})) == [1, 2]
    assert sorted(d["_id"] for d in client.t.c.find({"p": {"$not": {"$type": ["int", "long"], "$gte": 0}}})) == [
        2,
        3,
        4,
    ]
