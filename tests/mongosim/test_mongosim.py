"""The simulator answers as a replica-set primary does: what it adds to mongomock, what it
refuses, its limits, its time (cluster time, oplog, change streams, majority commit point),
transactions and ``failCommand``. Each test talks to it through the real (synchronous) PyMongo
driver over a socket."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from bson.max_key import MaxKey
from bson.min_key import MinKey
from pymongo import MongoClient
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure

from tests.mongosim import Settings, serving
from tests.mongosim.engine import Engine
from tests.mongosim.wire import WireServer

Client = MongoClient[dict[str, Any]]


def _code(exc: pytest.ExceptionInfo[OperationFailure]) -> int | None:
    return exc.value.code


# --------------------------------------------------------------------------- the additions


def test_a_projection_through_an_array_keeps_each_elements_fields(client: Client) -> None:
    """Manual, Project Fields to Return from Query: a dotted path into an array of documents
    projects each element (what the log check reads of a commit's events)."""
    coll = client.db.log
    coll.insert_one({"v": 2, "events": [{"name": "A", "id": "e1", "body": {"key": "k", "x": 1}}, {"name": "B"}]})
    [doc] = coll.find({}, {"_id": 0, "v": 1, "events.name": 1, "events.body.key": 1})
    assert doc == {"v": 2, "events": [{"name": "A", "body": {"key": "k"}}, {"name": "B"}]}


def test_union_with_appends_the_sub_pipeline_of_another_collection(client: Client) -> None:
    db = client.t
    db.a.insert_many([{"_id": 1, "x": 2}, {"_id": 2, "x": 1}])
    db.b.insert_many([{"_id": 3, "x": 0}, {"_id": 4, "x": 9}])
    got = list(
        db.a.aggregate(
            [
                {"$unionWith": {"coll": "b", "pipeline": [{"$match": {"x": {"$lt": 5}}}]}},
                {"$unionWith": {"coll": "missing"}},
                {"$sort": {"x": 1}},
            ]
        )
    )
    assert [d["_id"] for d in got] == [3, 2, 1]


def test_update_pipeline_with_now_merge_objects_replace_with_and_unset(client: Client) -> None:
    coll = client.t.c
    coll.insert_one({"_id": 1, "a": 1, "drop": True})
    before = datetime.datetime.now(datetime.UTC).replace(tzinfo=None, microsecond=0)
    coll.update_one(
        {"_id": 1},
        [
            {"$set": {"at": {"$toLong": "$$NOW"}, "when": "$$NOW", "later": {"$add": ["$$NOW", 1000]}}},
            {"$replaceWith": {"$mergeObjects": ["$$ROOT", {"b": {"$literal": "$x"}}, None]}},
            {"$unset": "drop"},
        ],
    )
    doc = coll.find_one({"_id": 1})
    assert doc is not None and "drop" not in doc and doc["b"] == "$x" and doc["a"] == 1
    assert doc["when"] >= before and doc["later"] - doc["when"] == datetime.timedelta(seconds=1)
    assert doc["at"] == int(doc["when"].replace(tzinfo=datetime.UTC).timestamp() * 1000)


def test_a_stage_outside_the_update_stages_is_refused_in_an_update(client: Client) -> None:
    client.t.c.insert_one({"_id": 1})
    with pytest.raises(OperationFailure) as exc:
        client.t.c.update_one({"_id": 1}, [{"$match": {}}])
    assert _code(exc) == 72


def test_expression_comparisons_order_a_missing_field_below_null(client: Client) -> None:
    coll = client.t.c
    coll.insert_many([{"_id": 1}, {"_id": 2, "v": None}, {"_id": 3, "v": 5}])
    got = coll.find({"$expr": {"$lte": ["$v", None]}}, sort=[("_id", 1)])
    assert [d["_id"] for d in got] == [1, 2]
    assert [d["_id"] for d in coll.find({"$expr": {"$eq": ["$v", None]}})] == [2]


def test_not_negates_the_expression_in_its_argument_array(client: Client) -> None:
    coll = client.t.c
    coll.insert_many([{"_id": 1}, {"_id": 2, "v": 0}, {"_id": 3, "v": 5}, {"_id": 4, "v": False}])
    got = coll.find({"$expr": {"$not": ["$v"]}}, sort=[("_id", 1)])
    assert [d["_id"] for d in got] == [1, 2, 4]
    # false sorts above every number (BSON order): only the missing field and 0 are not above 1
    assert [d["_id"] for d in coll.find({"$expr": {"$not": [{"$gt": ["$v", 1]}]}}, sort=[("_id", 1)])] == [1, 2]


def test_renaming_a_collection_over_another_keeps_its_documents_and_indexes(client: Client) -> None:
    client.t.a.insert_one({"_id": 1, "k": "a"})
    client.t.a.create_index("k", unique=True, name="k")
    client.t.b.insert_one({"_id": 9})
    with pytest.raises(OperationFailure) as exc:
        client.admin.command("renameCollection", "t.a", to="t.b")
    assert _code(exc) == 48  # NamespaceExists
    with pytest.raises(OperationFailure) as exc:
        client.t.command("renameCollection", "t.a", to="t.b", dropTarget=True)
    assert _code(exc) == 13  # only against admin
    client.admin.command("renameCollection", "t.a", to="t.b", dropTarget=True)
    assert list(client.t.b.find()) == [{"_id": 1, "k": "a"}]
    assert "a" not in client.t.list_collection_names()
    assert "k" in client.t.b.index_information()
    with pytest.raises(DuplicateKeyError):
        client.t.b.insert_one({"k": "a"})
    with pytest.raises(OperationFailure) as exc:
        client.admin.command("renameCollection", "t.a", to="t.c")
    assert _code(exc) == 26  # NamespaceNotFound


def test_upsert_starts_from_the_equalities_of_the_filter_not_its_or(client: Client) -> None:
    coll = client.t.c
    coll.update_one({"k": "a", "n": {"$eq": 1}, "$or": [{"v": 1}, {"v": 2}]}, {"$set": {"x": 1}}, upsert=True)
    doc = coll.find_one({}, {"_id": 0})
    assert doc == {"k": "a", "n": 1, "x": 1}


def test_partial_unique_index_only_holds_the_documents_in_its_filter(client: Client) -> None:
    coll = client.t.c
    client.t.command(
        {
            "createIndexes": "c",
            "indexes": [{"key": {"k": 1}, "name": "k", "unique": True, "partialFilterExpression": {"live": True}}],
        }
    )
    coll.insert_many([{"k": 1, "live": False}, {"k": 1, "live": False}, {"k": 1, "live": True}])
    with pytest.raises(DuplicateKeyError) as exc:
        coll.insert_one({"k": 1, "live": True})
    assert exc.value.details is not None and exc.value.details["keyPattern"] == {"k": 1}
    assert "index: k dup key" in str(exc.value)
    # an update that moves a document into the filter meets the key too
    with pytest.raises(DuplicateKeyError):
        coll.update_one({"live": False}, {"$set": {"live": True}})


def test_unique_keys_compare_numbers_by_value(client: Client) -> None:
    coll = client.t.c
    coll.create_index("n", unique=True, name="n")
    coll.insert_one({"n": 1})
    with pytest.raises(DuplicateKeyError):
        coll.insert_one({"n": 1.0})


def test_ttl_monitor_deletes_expired_documents_within_the_partial_filter(server: WireServer, client: Client) -> None:
    coll = client.t.c
    client.t.command(
        {
            "createIndexes": "c",
            "indexes": [
                {"key": {"exp": 1}, "name": "ttl", "expireAfterSeconds": 0, "partialFilterExpression": {"dead": True}}
            ],
        }
    )
    past = datetime.datetime(2020, 1, 1)
    coll.insert_many([{"_id": 1, "exp": past, "dead": True}, {"_id": 2, "exp": past, "dead": False}, {"_id": 3}])
    assert coll.count_documents({}) == 3  # the monitor has not run: nothing expires on a read
    assert server.engine.expire() == 1
    assert sorted(d["_id"] for d in coll.find()) == [2, 3]


def test_min_max_bound_the_hinted_index_in_bson_order(client: Client) -> None:
    coll = client.t.c
    coll.create_index([("p", 1), ("v", 1)], name="pv")
    coll.insert_many([{"p": 1, "v": "a"}, {"p": 1, "v": 3}, {"p": 1, "v": None}, {"p": 2, "v": 0}, {"p": 0, "v": 9}])
    got = coll.find({}, hint="pv", min={"p": 1, "v": 3}, max={"p": 2, "v": MinKey()}, sort=[("p", 1), ("v", 1)])
    assert [d["v"] for d in got] == [3, "a"]  # numbers sort before strings; the null before 3 is out
    got = coll.find({}, hint="pv", min={"p": 1, "v": MinKey()}, max={"p": 1, "v": MaxKey()})
    assert len(list(got)) == 3
    with pytest.raises(OperationFailure) as exc:
        client.t.command({"find": "c", "min": {"p": 1, "v": 3}})  # the driver checks it too; the server does
    assert _code(exc) == 51173


def test_field_indexes_follow_every_write(client: Client) -> None:
    """The simulator's field indexes (built at a field's first query) answer as a scan would
    after updates, deletes, arrays, numbers of one value and an aborted transaction."""
    coll = client.t.c
    coll.insert_many([{"_id": i, "s": "a", "n": i % 3} for i in range(6)])
    assert sorted(d["_id"] for d in coll.find({"s": "a", "n": {"$in": [0, 2]}})) == [0, 2, 3, 5]
    coll.update_one({"_id": 0}, {"$set": {"s": "b"}})
    coll.delete_one({"_id": 5})
    coll.insert_one({"_id": 6, "s": ["x", "a"], "n": 2.0})
    with client.start_session() as session:
        session.start_transaction()
        coll.update_one({"_id": 2}, {"$set": {"s": "z"}}, session=session)
        session.abort_transaction()
    assert sorted(d["_id"] for d in coll.find({"s": "a", "n": {"$in": [0, 2]}})) == [2, 3, 6]
    assert [d["_id"] for d in coll.aggregate([{"$match": {"s": "b"}}])] == [0]


# --------------------------------------------------------------------------- strictness and limits


@pytest.mark.parametrize(
    ("command", "code"),
    [
        ({"frobnicate": 1}, 59),
        ({"Find": "c"}, 59),  # command names are case-sensitive
        ({"find": "c", "filter": {"a": {"$near": 1}}}, 2),
        ({"find": "c", "frob": 1}, 40415),
        ({"aggregate": "c", "pipeline": [{"$frob": {}}], "cursor": {}}, 40324),
        ({"aggregate": "c", "pipeline": [{"$match": {}}] * 1001, "cursor": {}}, 7749501),
        ({"update": "c", "updates": [{"q": {}, "u": {"$frob": {"a": 1}}}]}, 9),
        ({"createIndexes": "c", "indexes": [{"key": {"a": 1}, "name": "a", "frob": 1}]}, 197),
        ({"insert": "c" * 300, "documents": [{}]}, 73),
    ],
)
def test_what_is_not_modelled_is_an_error_with_the_servers_code(
    client: Client, command: dict[str, Any], code: int
) -> None:
    client.t.c.insert_one({"a": 1})
    try:
        reply = client.t.command(command)
    except OperationFailure as exc:
        assert exc.code == code, exc
    else:
        errors = reply.get("writeErrors") or [{}]
        assert errors[0].get("code") == code, reply


def test_a_write_batch_over_100000_is_refused(client: Client) -> None:
    with pytest.raises(OperationFailure) as exc:
        client.t.command({"delete": "c", "deletes": [{"q": {"a": 1}, "limit": 0}] * 100_001})
    assert _code(exc) == 16


def test_a_document_over_16_mib_after_an_update_is_refused(client: Client) -> None:
    coll = client.t.c
    coll.insert_one({"_id": 1, "a": "x" * (9 * 1024 * 1024)})
    with pytest.raises(OperationFailure) as exc:
        coll.update_one({"_id": 1}, {"$set": {"b": "y" * (9 * 1024 * 1024)}})
    assert _code(exc) == 17419
    assert coll.find_one({"_id": 1}, {"b": 1}) == {"_id": 1}


def test_an_ordered_bulk_stops_at_the_first_write_error_and_names_its_index(client: Client) -> None:
    coll = client.t.c
    coll.insert_one({"_id": 1})
    with pytest.raises(BulkWriteError) as exc:
        coll.insert_many([{"_id": 2}, {"_id": 1}, {"_id": 3}])
    assert [e["index"] for e in exc.value.details["writeErrors"]] == [1]
    assert sorted(d["_id"] for d in coll.find()) == [1, 2]


# --------------------------------------------------------------------------- time and change streams


def test_cluster_time_advances_per_write_and_majority_reads_answer_the_commit_point(
    server: WireServer, client: Client
) -> None:
    db = client.t
    first = db.command("insert", "c", documents=[{}])["operationTime"]
    second = db.command("insert", "c", documents=[{}])["operationTime"]
    assert (second.time, second.inc) > (first.time, first.inc)
    server.engine.hold_majority()
    db.command("insert", "c", documents=[{}])
    majority = db.command({"find": "c", "filter": {"_id": None}, "readConcern": {"level": "majority"}})
    assert majority["operationTime"] == server.engine.majority_point()
    assert (majority["operationTime"].time, majority["operationTime"].inc) < (
        server.engine.ct.time,
        server.engine.ct.inc,
    )
    server.engine.release_majority()


def test_change_stream_tokens_resume_after_start_after_and_at_operation_time(client: Client) -> None:
    db = client.t
    start = db.command("ping")["operationTime"]
    db.c.insert_many([{"_id": i} for i in range(3)])
    with db.watch([{"$match": {"operationType": "insert"}}], start_at_operation_time=start) as s:
        events = [s.next() for _ in range(3)]
    assert [e["documentKey"]["_id"] for e in events] == [0, 1, 2]
    tokens = [e["_id"]["_data"] for e in events]
    assert tokens == sorted(tokens)  # ordered, as the server's KeyString is
    with db.watch(resume_after=events[0]["_id"], max_await_time_ms=50) as s:
        assert s.next()["documentKey"]["_id"] == 1
    with db.watch(start_after=events[1]["_id"], max_await_time_ms=50) as s:
        assert s.next()["documentKey"]["_id"] == 2
        assert s.try_next() is None
        # the empty batch's post-batch resume token is past the last event
        assert s.resume_token is not None and s.resume_token["_data"] >= events[2]["_id"]["_data"]


@pytest.mark.parametrize(
    "match",
    [
        # forms the stream's gate decides before it makes an event (a regex with options, $in)
        {"operationType": {"$in": ["insert", "update"]}, "ns.coll": {"$regex": "^LOG_", "$options": "i"}},
        # and one it leaves to the full match alone ($or at the top level)
        {"$or": [{"operationType": "insert"}, {"operationType": "update"}], "ns.coll": {"$in": ["log_a", "log_b"]}},
    ],
)
def test_a_streams_match_on_operation_type_and_collection(client: Client, match: dict[str, Any]) -> None:
    """Inserts and updates of the ``log_`` collections only: a delete, another collection's
    writes, a drop and a database's drop are not shown, whichever way the match is written."""
    db = client.t
    start = db.command("ping")["operationTime"]
    db.log_a.insert_one({"_id": 1})
    db.other.insert_one({"_id": 2})
    db.log_b.update_one({"_id": 3}, {"$set": {"x": 1}}, upsert=True)
    db.log_b.update_one({"_id": 3}, {"$set": {"x": 2}})
    db.log_a.delete_one({"_id": 1})
    db.other.update_one({"_id": 2}, {"$set": {"x": 1}})
    db.log_a.drop()
    db.log_b.insert_one({"_id": 4})
    with db.watch([{"$match": match}], start_at_operation_time=start, max_await_time_ms=50) as s:
        seen = [(e["operationType"], e["ns"]["coll"], e["documentKey"]["_id"]) for e in iter(s.try_next, None)]
    assert seen == [("insert", "log_a", 1), ("insert", "log_b", 3), ("update", "log_b", 3), ("insert", "log_b", 4)]


def test_an_empty_get_more_waits_max_await_time_ms(client: Client) -> None:
    with client.t.watch(max_await_time_ms=150) as s:
        started = time.monotonic()
        assert s.try_next() is None
        assert time.monotonic() - started >= 0.12


def test_an_insert_wakes_a_waiting_get_more(client: Client) -> None:
    with client.t.watch(max_await_time_ms=5000) as s:
        timer = threading.Timer(0.1, lambda: client.t.c.insert_one({"_id": "late"}))
        timer.start()
        started = time.monotonic()
        change = s.try_next()
        timer.join()
    assert change is not None and change["documentKey"] == {"_id": "late"}
    assert time.monotonic() - started < 2


def test_a_stream_only_shows_majority_committed_writes(server: WireServer, client: Client) -> None:
    with client.t.watch(max_await_time_ms=50) as s:
        server.engine.hold_majority()
        client.t.c.insert_one({"_id": 1})
        assert s.try_next() is None
        server.engine.release_majority()
        change = s.try_next()
    assert change is not None and change["documentKey"] == {"_id": 1}


def test_history_lost_after_the_oplog_window_and_an_unknown_token_is_fatal() -> None:
    with serving(Settings(noop_interval=0, oplog_window=60)) as server:
        client: Client = MongoClient(server.uri)
        try:
            start = client.t.command("ping")["operationTime"]
            client.t.c.insert_one({"_id": 1})
            client.t.c.insert_one({"_id": 2})
            with client.t.watch(start_at_operation_time=start) as s:
                assert s.next()["documentKey"] == {"_id": 1}  # within the window
            with server.engine.lock:
                server.engine._truncate(now=time.time() + 3600)  # an hour on: only the newest entry is left
            with pytest.raises(OperationFailure) as exc:
                client.t.watch(start_at_operation_time=start)
            assert exc.value.code == 286
            ct = server.engine.ct
            with pytest.raises(OperationFailure) as exc:
                client.t.watch(resume_after={"_data": f"82{ct.time:08X}{ct.inc:08X}8000000009"})
            assert exc.value.code == 280
        finally:
            client.close()


def test_the_no_op_writer_moves_an_idle_streams_token() -> None:
    with serving(Settings(noop_interval=0.2)) as server:
        client: Client = MongoClient(server.uri)
        try:
            with client.t.watch(max_await_time_ms=50) as s:
                assert s.try_next() is None
                first = s.resume_token
                deadline = time.monotonic() + 5
                while s.resume_token == first and time.monotonic() < deadline:
                    assert s.try_next() is None
                assert s.resume_token != first
                assert first is not None and s.resume_token is not None
                assert s.resume_token["_data"] > first["_data"]
        finally:
            client.close()


def test_no_op_only_when_nothing_else_was_written() -> None:
    engine = Engine(Settings(noop_interval=0.3))
    try:
        for _ in range(8):  # a write every 50 ms for 0.4 s (past the interval) keeps the no-op writer quiet
            with engine.changed:
                engine._append([])
            time.sleep(0.05)
        with engine.lock:
            assert not any(e.op == "n" for e in engine.oplog)
        with engine.changed:
            assert engine.changed.wait_for(lambda: any(e.op == "n" for e in engine.oplog), timeout=3)
    finally:
        engine.shutdown()


def test_split_large_event_cuts_an_event_over_16_mib_into_fragments(client: Client) -> None:
    db = client.t
    db.c.insert_one({"_id": 1})
    big = "x" * (9 * 1024 * 1024)
    with db.watch([{"$changeStreamSplitLargeEvent": {}}], full_document="updateLookup", max_await_time_ms=50) as s:
        db.c.update_one({"_id": 1}, {"$set": {"a": big}})
        # updateDescription and fullDocument each hold the 9 MiB: an 18 MiB event
        fragments = [s.next(), s.next()]
    assert [f["splitEvent"] for f in fragments] == [{"fragment": 1, "of": 2}, {"fragment": 2, "of": 2}]
    assert fragments[0]["_id"] != fragments[1]["_id"]
    assert fragments[0]["updateDescription"]["updatedFields"]["a"] == big and fragments[1]["fullDocument"]["a"] == big
    with pytest.raises(OperationFailure) as exc:
        db.watch([{"$changeStreamSplitLargeEvent": {}}, {"$match": {}}])
    assert exc.value.code == 7182802


# --------------------------------------------------------------------------- transactions, fail points


def test_a_transaction_commits_as_one_entry_and_an_abort_undoes(client: Client) -> None:
    coll = client.t.c
    coll.insert_one({"_id": 0})
    with client.start_session() as session, session.start_transaction():
        coll.insert_one({"_id": 1}, session=session)
        coll.update_one({"_id": 0}, {"$set": {"x": 1}}, session=session)
    with client.start_session() as session:
        session.start_transaction()
        coll.insert_one({"_id": 2}, session=session)
        coll.delete_one({"_id": 0}, session=session)
        session.abort_transaction()
    assert sorted(d["_id"] for d in coll.find()) == [0, 1]
    assert coll.find_one({"_id": 0}) == {"_id": 0, "x": 1}


def test_an_open_transaction_holds_only_the_documents_it_wrote(client: Client) -> None:
    """Another session reads and writes other documents at once; another transaction writing one
    of its documents meets a write conflict (112, TransientTransactionError); a write outside
    a transaction waits for it to end, then applies to what it left."""
    coll = client.t.c
    coll.insert_many([{"_id": 1, "n": 0}, {"_id": 2, "n": 0}])
    with client.start_session() as s1:
        s1.start_transaction()
        coll.update_one({"_id": 1}, {"$inc": {"n": 1}}, session=s1)
        started = time.monotonic()
        coll.update_one({"_id": 2}, {"$inc": {"n": 1}})  # another document: not held
        assert coll.find_one({"_id": 2}) == {"_id": 2, "n": 1}
        assert time.monotonic() - started < 1
        with client.start_session() as s2:
            s2.start_transaction()
            with pytest.raises(OperationFailure) as exc:
                coll.update_one({"_id": 1}, {"$inc": {"n": 10}}, session=s2)
            assert exc.value.code == 112 and exc.value.has_error_label("TransientTransactionError")
        done = threading.Event()

        def write_outside() -> None:
            coll.update_one({"_id": 1}, {"$inc": {"n": 100}})
            done.set()

        writer = threading.Thread(target=write_outside)
        writer.start()
        assert not done.wait(0.15)  # held by the open transaction
        s1.commit_transaction()
        writer.join(5)
    assert done.is_set()
    assert coll.find_one({"_id": 1}) == {"_id": 1, "n": 101}


def test_fail_command_error_code_labels_and_times(client: Client) -> None:
    client.admin.command(
        {
            "configureFailPoint": "failCommand",
            "mode": {"times": 1},
            "data": {"failCommands": ["find"], "errorCode": 2, "errorLabels": ["Custom"]},
        }
    )
    with pytest.raises(OperationFailure) as exc:
        client.t.c.find_one()
    assert exc.value.code == 2 and exc.value.has_error_label("Custom")
    assert client.t.c.find_one() is None  # once only
    reply = client.admin.command({"configureFailPoint": "failCommand", "mode": "off"})
    assert reply["count"] == 0


def test_fail_command_write_concern_error_applies_the_write(client: Client) -> None:
    client.admin.command(
        {
            "configureFailPoint": "failCommand",
            "mode": {"times": 1},
            "data": {"failCommands": ["insert"], "writeConcernError": {"code": 64, "errmsg": "waiting timed out"}},
        }
    )
    with pytest.raises(BulkWriteError) as exc:
        client.t.c.bulk_write([__import__("pymongo").InsertOne({"_id": 1})])
    assert exc.value.details["writeConcernErrors"][0]["code"] == 64
    assert client.t.c.find_one({"_id": 1}) == {"_id": 1}


def test_fail_command_block_connection_delays_the_answer(client: Client) -> None:
    client.admin.command(
        {
            "configureFailPoint": "failCommand",
            "mode": {"times": 1},
            "data": {"failCommands": ["ping"], "blockConnection": True, "blockTimeMS": 150},
        }
    )
    started = time.monotonic()
    client.t.command("ping")
    assert time.monotonic() - started >= 0.12


def test_an_unknown_fail_point_or_data_field_is_refused(client: Client) -> None:
    with pytest.raises(OperationFailure):
        client.admin.command({"configureFailPoint": "failCommand", "mode": "alwaysOn", "data": {"frob": 1}})
    with pytest.raises(OperationFailure):
        client.t.command({"configureFailPoint": "failCommand", "mode": "off"})  # admin only


# --------------------------------------------------------------------------- as a process


@pytest.mark.process
def test_python_m_tests_mongosim_serves_until_sigterm() -> None:
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.mongosim", "--port", "0", "--noop-interval", "0"],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("mongosim listening: mongodb://127.0.0.1:"), line
        uri = line.split(": ", 1)[1].strip()
        c: Client = MongoClient(uri, serverSelectionTimeoutMS=5000)
        try:
            assert c.admin.command("hello")["setName"] == "wowdsim"
            c.t.c.insert_one({"_id": 1})
            assert c.t.c.find_one() == {"_id": 1}
        finally:
            c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# --------------------------------------------------------------------------- a sharded cluster


@pytest.fixture
def sharded() -> Iterator[WireServer]:
    """A ``mongos`` of two shards whose no-op writers run only when a test calls
    ``engine.noop`` (interval 0)."""
    with serving(Settings(noop_interval=0, shards=2)) as s:
        yield s


@pytest.fixture
def mongos(sharded: WireServer) -> Iterator[Client]:
    c: Client = MongoClient(sharded.uri, serverSelectionTimeoutMS=3000)
    try:
        yield c
    finally:
        c.close()


def _token_key(token: Any) -> str:
    return str(token["_data"])[:18]  # "82", the cluster time


def _ts_data(ts: Any) -> str:
    return f"82{ts.time:08X}{ts.inc:08X}"


def test_a_sharded_simulator_answers_hello_as_a_mongos_and_lists_its_shards(mongos: Client) -> None:
    hello = mongos.admin.command("hello")
    assert hello["msg"] == "isdbgrid" and "setName" not in hello and "hosts" not in hello
    mongos.admin.command("ping")
    assert mongos.topology_description.topology_type_name == "Sharded"
    shards = mongos.admin.command("listShards")["shards"]
    assert [s["_id"] for s in shards] == ["shard0", "shard1"]
    with pytest.raises(OperationFailure) as exc:
        mongos.t.command("listShards")
    assert _code(exc) == 13  # admin only


def test_the_merged_stream_waits_for_an_idle_shard_until_its_no_op(sharded: WireServer, mongos: Client) -> None:
    engine = sharded.engine
    with mongos.t.watch(max_await_time_ms=50) as s:
        mongos.t.c.insert_one({"_id": 1})  # unsharded: on the primary shard, shard0
        assert s.try_next() is None  # shard1 has shown nothing as late: the merge holds it back
        held = s.resume_token
        assert held is not None and _token_key(held) <= _ts_data(engine.shards[1].last)
        engine.noop(0)  # the busy shard moving on does not release it
        assert s.try_next() is None
        engine.noop(1)  # the idle shard's periodic no-op does
        change = s.try_next()
    assert change is not None and change["documentKey"] == {"_id": 1}


def test_post_batch_resume_token_is_the_minimum_over_the_shards(sharded: WireServer, mongos: Client) -> None:
    engine = sharded.engine
    with mongos.t.watch(max_await_time_ms=50) as s:
        engine.noop(0)
        engine.noop(0)
        assert s.try_next() is None
        assert s.resume_token is not None
        assert _token_key(s.resume_token) <= _ts_data(engine.shards[1].last)
        assert _token_key(s.resume_token) < _ts_data(engine.shards[0].last)
        engine.noop(1)
        assert s.try_next() is None
        assert _token_key(s.resume_token) == _ts_data(engine.shards[0].last)  # now shard0 is the slower


def test_merged_events_come_in_cluster_time_order_across_shards(sharded: WireServer, mongos: Client) -> None:
    engine = sharded.engine
    mongos.admin.command("shardCollection", "t.h", key={"k": "hashed"})
    with mongos.t.watch(max_await_time_ms=50) as s:
        mongos.t.h.insert_many([{"_id": i, "k": i} for i in range(20)], ordered=True)
        engine.noop()
        events = []
        while (e := s.try_next()) is not None:
            events.append(e)
    assert [e["documentKey"]["_id"] for e in events] == list(range(20))
    times = [(e["clusterTime"].time, e["clusterTime"].inc) for e in events]
    assert times == sorted(times) and len(set(times)) == 20
    with engine.lock:
        shards = {e.shard for e in engine.oplog if e.op == "insert" and e.coll == "h"}
    assert shards == {0, 1}  # the hashed key spread them over both shards


def test_shard_collection_routes_by_chunk_and_is_idempotent(sharded: WireServer, mongos: Client) -> None:
    engine = sharded.engine
    admin = mongos.admin
    assert admin.command("shardCollection", "t.r", key={"p": 1})["collectionsharded"] == "t.r"
    admin.command("shardCollection", "t.r", key={"p": 1})  # the same key again: ok
    with pytest.raises(OperationFailure) as exc:
        admin.command("shardCollection", "t.r", key={"q": 1})
    assert _code(exc) == 23
    assert [ix["key"] for ix in mongos.t.r.list_indexes()] == [{"_id": 1}, {"p": 1}]
    mongos.t.u.create_index([("x", 1)], unique=True)
    with pytest.raises(OperationFailure) as exc:
        admin.command("shardCollection", "t.u", key={"p": 1})
    assert _code(exc) == 72  # a unique index not prefixed by the shard key
    uuid = mongos.config.collections.find_one({"_id": "t.r"})["uuid"]
    assert mongos.config.chunks.count_documents({"uuid": uuid}) == 1  # one chunk, on the primary shard
    admin.command("split", "t.r", middle={"p": 4})
    admin.command("moveRange", "t.r", min={"p": 4}, toShard="shard1")
    chunks = sorted((c["min"]["p"] == 4, c["shard"]) for c in mongos.config.chunks.find({"uuid": uuid}))
    assert chunks == [(False, "shard0"), (True, "shard1")]
    mongos.t.r.insert_many([{"p": 1}, {"p": 7}])
    with engine.lock:
        placed = {e.doc["p"]: e.shard for e in engine.oplog if e.op == "insert" and e.coll == "r" and e.doc}
    assert placed == {1: 0, 7: 1}


def test_commands_are_counted_by_client_name_and_collection(server: WireServer) -> None:
    c: Client = MongoClient(server.uri, appname="counted", serverSelectionTimeoutMS=3000)
    try:
        before = server.engine.counts()
        with c.t.watch(max_await_time_ms=50) as s:
            c.t.c.insert_many([{"_id": 1}, {"_id": 2}])
            c.t.c.find_one({"_id": 1})
            assert s.try_next() is not None
        after = server.engine.counts()
    finally:
        c.close()
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert grew[("counted", "insert", "c")] == 1
    assert grew[("counted", "find", "c")] == 1
    assert grew[("counted", "aggregate", "")] == 1  # a database stream: aggregate 1
    assert grew[("counted", "getMore", "$cmd.aggregate")] >= 1
    assert server.engine.stream_batches["counted:batches"] == 1
    assert server.engine.stream_batches["counted:events"] == 2


def test_the_plan_check_records_a_sort_needing_more_than_200_merged_scans_and_answers_it() -> None:
    with serving(Settings(noop_interval=0, plan_check=True)) as server:
        c: Client = MongoClient(server.uri, serverSelectionTimeoutMS=3000)
        try:
            coll = c.t.timers
            coll.create_index([("partition", 1), ("due_at", 1)])
            coll.insert_many([{"partition": p, "due_at": 300 - p} for p in range(250)])
            within = coll.find({"partition": {"$in": list(range(200))}}, sort=[("due_at", 1)], limit=2)
            assert [d["partition"] for d in within] == [199, 198]
            assert server.engine.plan_findings == []
            branches = {
                "$or": [{"partition": {"$in": list(range(150))}}, {"partition": {"$in": list(range(150, 201))}}]
            }
            over = list(coll.find(branches, sort=[("due_at", 1)], limit=1))
            assert [d["partition"] for d in over] == [200]  # answered, as a server answers it
            assert len(server.engine.plan_findings) == 1 and "201 index scans" in server.engine.plan_findings[0]
            pipeline = [{"$match": {"partition": {"$in": list(range(201))}}}, {"$sort": {"due_at": 1}}, {"$limit": 1}]
            assert len(list(coll.aggregate(pipeline))) == 1
            assert len(server.engine.plan_findings) == 2
            coll.create_index([("due_at", 1)])  # an index giving the order by itself: no merge needed
            list(coll.find({"partition": {"$in": list(range(201))}}, sort=[("due_at", 1)], limit=1))
            assert len(server.engine.plan_findings) == 2
        finally:
            c.close()


def test_each_shard_keeps_its_own_id_index_and_a_unique_index_starts_with_the_shard_key(
    sharded: WireServer, mongos: Client
) -> None:
    """The ``_id`` index of a sharded collection is unique per shard only (manual, "Shard Key
    Indexes"): one ``_id`` on two shards is two documents; a unique index of a sharded collection
    must have the shard key as its prefix (manual, "Create a Unique Index on Existing Sharded
    Collection": otherwise "MongoDB returns an error"; 67 CannotCreateIndex)."""
    admin = mongos.admin
    admin.command("shardCollection", "t.s", key={"k": 1})
    admin.command("split", "t.s", middle={"k": 10})
    admin.command("moveRange", "t.s", min={"k": 10}, toShard="shard1")
    mongos.t.s.insert_one({"_id": 1, "k": 1})
    mongos.t.s.insert_one({"_id": 1, "k": 11})  # shard1: its own _id index
    with pytest.raises(DuplicateKeyError):
        mongos.t.s.insert_one({"_id": 1, "k": 2})  # shard0 holds _id 1 already
    assert sorted(d["k"] for d in mongos.t.s.find({"_id": 1})) == [1, 11]
    with pytest.raises(OperationFailure) as exc:
        mongos.t.s.create_index([("x", 1)], unique=True)
    assert _code(exc) == 67 and "shard key pattern" in str(exc.value)
    mongos.t.s.create_index([("k", 1), ("x", 1)], unique=True)  # the shard key first: made
    mongos.t.s.insert_one({"_id": 2, "k": 3, "x": 1})
    with pytest.raises(DuplicateKeyError):
        mongos.t.s.insert_one({"_id": 3, "k": 3, "x": 1})


def test_the_fast_decision_of_lookups_by_key_agrees_with_mongomocks_match() -> None:
    """The simulator decides equalities, ``$in`` and integer ranges on plain values itself (the
    stores' lookups by key); the answer is mongomock's on every document, whatever its values'
    types (a bool is not 1, a float goes to mongomock, an array or a missing field too)."""
    from bson.int64 import Int64
    from bson.objectid import ObjectId

    from tests.mongosim import evaluate

    oid = ObjectId()
    values: list[Any] = [1, Int64(1), 1.0, True, "1", oid, None, [1], {"a": 1}, 2, -5, 2**40]
    docs = [{"_id": i, "p": v, "q": {"r": v}} for i, v in enumerate(values)] + [{"_id": 99}]
    filters: list[dict[str, Any]] = [
        {"p": 1},
        {"p": "1"},
        {"p": oid},
        {"p": {"$in": [1, "1", oid]}},
        {"p": {"$in": [2, 2**40]}, "q.r": {"$gte": 2}},
        {"p": {"$gt": 0, "$lte": 2}},
        {"q.r": {"$lt": 1}},
        {"p": {"$eq": 1}, "q.r": 1},
    ]
    for flt in filters:
        assert evaluate.exact_checker(flt) is not None, flt
        fast = [d["_id"] for d in evaluate.select(flt, docs)]
        slow = [d["_id"] for d in docs if evaluate.matches(flt, d)]
        assert fast == slow, flt


def test_an_or_of_lookups_by_key_reads_each_branchs_candidates_and_answers_as_mongomock(
    client: Client, server: WireServer
) -> None:
    """A top-level ``$or`` whose every branch has an equality or ``$in`` is read through each
    branch's field index (the log check's query, one branch per timer), not by a walk of the
    collection; a branch without one (``{"v": {"$gt": 1}}``) leaves every document a candidate.
    Either way the answer is mongomock's on every document."""
    from tests.mongosim import evaluate

    docs = [{"_id": i, "a": f"a{i % 50}", "t": None if i % 7 == 0 else "(0)", "v": i % 5} for i in range(1000)]
    client.db.c.insert_many(docs)
    branches = [{"a": f"a{n}", "t": {"$in": ["(0)", None]}, "v": {"$gt": 2}} for n in (3, 17, 49)]
    for flt in ({"$or": branches}, {"$or": [*branches, {"v": {"$gt": 3}}]}, {"v": 4, "$or": branches}):
        want = sorted(d["_id"] for d in docs if evaluate.matches(flt, d))
        assert sorted(d["_id"] for d in client.db.c.find(flt)) == want, flt
    engine = server.engine
    narrowed = engine._candidate_keys("db", "c", {"$or": branches})
    assert narrowed is not None and len(narrowed) == 3 * 20  # the three aggregates' documents only
    assert engine._candidate_keys("db", "c", {"$or": [*branches, {"v": {"$gt": 3}}]}) is None
