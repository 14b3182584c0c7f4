"""The command budget of one feed batch on MongoDB, counted on the wire.

The real :class:`~wowd.daemon.feed.Feeder` feeds one held slot from the MongoDB stores (log,
timers, snapshots) on a MockupDB that answers as a 7.0 replica-set primary does, and the
Elasticsearch sink on the fake Elasticsearch 9 (``tests/elasticsearch/fake_es.py``). The change
stream delivers one batch of ``N`` commits of three aggregate types, each commit with a timer
event, a reducer configured for one type, parked timers targeting two of the committed
aggregates. Every command of the batch is counted by kind, from the change stream's answer to
the checkpoint write (the stream's ``getMore`` of the next batch, sent meanwhile, is the next
batch's read).

The budget of a batch (of up to the feed's 500 commits), whatever ``N``: one sink ``_bulk`` per
aggregate type, one timer bulk per timer collection touched, one snapshot ``find`` and one
snapshot bulk per reducer type, one checkpoint write, one bulk of the timer history's records,
plus a constant (the parked read, a check
before it, and the bulk resuming the parked timers of the one collection holding them).
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from bson import Binary, Int64, ObjectId
from bson.timestamp import Timestamp
from elasticsearch import AsyncElasticsearch
from mockupdb import MockupDB, Request
from pymongo import AsyncMongoClient

from tests.elasticsearch.fake_es import EsModel, FakeElasticsearch, serving
from tests.mongo.conftest import Wire, primary
from tests.mongo.log_support import housekeeping, token
from tests.mongo.timers_support import matches
from tests.timer_stores import mongo_timers
from wowd.config import load_settings
from wowd.daemon.feed import CONSUMER, Feeder
from wowd.daemon.leases import HeldSlot
from wowd.daemon.waker import Waker
from wowd.model import (
    AggregateRef,
    AggregateType,
    Commit,
    DomainEvent,
    SlotLease,
    TimerScheduled,
    TimerStatus,
    commit_to_doc,
    timer_event_from,
    timer_from_event,
)
from wowd.stores.base import Backend, Ddl
from wowd.stores.elasticsearch import ElasticsearchEventSink
from wowd.stores.mongo._common import MongoSharding
from wowd.stores.mongo.checkpoints import MongoCheckpoints
from wowd.stores.mongo.history import MongoTimerHistory
from wowd.stores.mongo.leases import MongoSlotLeaseStore
from wowd.stores.mongo.log import MongoLog
from wowd.stores.mongo.outbox import MongoOutbox
from wowd.stores.mongo.quarantine import MongoQuarantine
from wowd.stores.mongo.schema import timer_index_specs
from wowd.stores.mongo.snapshot_rebuilds import MongoSnapshotRebuilds
from wowd.stores.mongo.snapshots import MongoSnapshotStore
from wowd.stores.mongo.timer_docs import timer_to_doc

pytestmark = pytest.mark.anyio

DB = "wowd"
CONTEXT = "ctx"
PARTITIONS = 8
FENCE = 5
TYPES = ("order", "cart", "user")
REDUCED = "order"
"""The one type with a reducer."""
BATCH = 500
"""The feed's batch size (the most commits a batch holds)."""
T0 = 1_700_000_000_000
STREAM_ID = Int64(7_270_114_383_526_019_071)
REGISTRY = "wow_timer_aggregate"
CHECKPOINTS = f"wow_checkpoint__{CONTEXT}"
INVOICE = AggregateRef(context="billing", aggregate="invoice", id="inv-1")


class CountingReducer:
    state_revision = 1

    def fold(self, state: dict[str, Any], event: DomainEvent) -> dict[str, Any]:
        return {**state, "events": int(state.get("events", 0)) + 1}


def batch_commits(n: int) -> list[Commit]:
    """``n`` commits of the three types in turn, each an aggregate's first, each with an event
    and a timer event."""
    out = []
    for i in range(n):
        ref = AggregateRef(context=CONTEXT, aggregate=TYPES[i % len(TYPES)], id=f"{TYPES[i % len(TYPES)]}-{i}")
        timer_body = {
            "key": "remind",
            "due_at": T0 + 60_000 + i,
            "target": {"context": INVOICE.context, "aggregate": INVOICE.aggregate, "id": INVOICE.id},
            "command": {"name": "Remind", "body": {"n": i}},
        }
        out.append(
            Commit(
                ref=ref,
                version=1,
                command_id=f"cmd-{i}",
                request_id=f"req-{i}",
                create_time=T0 + i,
                events=(
                    DomainEvent(id=f"e-{i}", name="Placed", body={"n": i}),
                    DomainEvent(id=f"t-{i}", name="TimerScheduled", body_type="wowd.TimerScheduled", body=timer_body),
                ),
            )
        )
    return out


def parked_timers(commits: Sequence[Commit]) -> list[dict[str, Any]]:
    """Three PARKED timers (as stored) owned by an order: two target aggregates that commit in
    the batch (the first order and the first cart), one an aggregate that does not."""
    targets = [commits[0].ref, commits[1].ref, AggregateRef(context=CONTEXT, aggregate="cart", id="quiet")]
    docs = []
    for i, target in enumerate(targets):
        owner = AggregateRef(context=CONTEXT, aggregate="order", id=f"waiting-{i}")
        event = DomainEvent(
            id=f"p-{i}",
            name="TimerScheduled",
            body={
                "key": "retry",
                "due_at": T0 - 1_000 + i,
                "target": {"context": target.context, "aggregate": target.aggregate, "id": target.id},
                "command": {"name": "Retry", "body": {}},
            },
        )
        scheduled = timer_event_from(event)
        assert isinstance(scheduled, TimerScheduled)
        commit = Commit(ref=owner, version=3, command_id="c", request_id=f"r-{i}", create_time=T0, events=(event,))
        doc = timer_to_doc(timer_from_event(commit, scheduled, PARTITIONS))
        doc.update(status=TimerStatus.PARKED.value, attempts=5, last_error="404 Not Found", revision=4)
        docs.append(doc)
    return docs


def cluster_time(t: int, i: int) -> dict[str, Any]:
    """The ``$clusterTime`` and ``operationTime`` a replica-set member adds to every reply."""
    ts = Timestamp(t, i)
    return {
        "$clusterTime": {"clusterTime": ts, "signature": {"hash": Binary(bytes(20)), "keyId": Int64(0)}},
        "operationTime": ts,
    }


@dataclass
class Deployment:
    """What the replica set holds for the scenario, and its answers to each command, as a 7.0
    primary sends them. ``kinds`` counts the commands of the batch by kind."""

    commits: list[Commit]
    parked: list[dict[str, Any]]
    kinds: Counter[str] = field(default_factory=Counter)
    resumed: list[str] = field(default_factory=list)
    """The ``timer_id`` of each timer the batch resumed."""
    in_batch: bool = False
    clock: int = 2_000
    next_reads: list[Request] = field(default_factory=list)
    """The change stream's ``getMore`` of the batch after this one (not this batch's)."""

    def reply(self, req: Request, **fields: Any) -> None:
        self.clock += 1
        req.ok(**fields, **cluster_time(self.clock, 1))

    def write_reply(self, req: Request, **fields: Any) -> None:
        """A write's answer: a primary adds its ``opTime`` and ``electionId``."""
        self.clock += 1
        op_time = {"ts": Timestamp(self.clock, 1), "t": Int64(3)}
        electionId = ObjectId("7fffffff0000000000000003")
        req.ok(**fields, opTime=op_time, electionId=electionId, **cluster_time(self.clock, 1))

    def cursor(self, req: Request, ns: str, docs: list[dict[str, Any]], **extra: Any) -> None:
        self.reply(req, cursor={"firstBatch": docs, "id": Int64(0), "ns": ns, **extra})

    def answer(self, req: Request) -> str:
        """Answers ``req``; its kind (counted once the change stream answered)."""
        name = req.command_name
        coll = req.doc.get(name)
        kind = f"{name} {coll}"
        if name == "find" and coll == REGISTRY:
            docs = [
                {"_id": f"wow_timer__{CONTEXT}__{a}", "context": CONTEXT, "aggregate": a, "format": 6, "created_at": 1}
                for a in TYPES
            ]
            self.cursor(req, f"{DB}.{REGISTRY}", docs)
        elif name == "listIndexes" and str(coll).startswith(f"wow_timer__{CONTEXT}__"):
            # ddl=none looks at the indexes of each registered type at prepare
            self.cursor(
                req,
                f"{DB}.{coll}",
                [{"v": 2, "key": {"_id": 1}, "name": "_id_"}, *({"v": 2, **s} for s in timer_index_specs())],
            )
        elif name == "find" and coll == CHECKPOINTS:
            # each view's checkpoints: the timer view's (``wowd``), where the others, which have
            # none of their own yet, start too
            [consumer] = {i["consumer"] for i in req.doc["filter"]["_id"]["$in"]}
            assert req.doc["filter"]["_id"]["$in"] == [
                {"consumer": consumer, "partition": p} for p in range(PARTITIONS)
            ]
            position = {"token": token((1_000, 0)), "cluster_time": [1_000, 0]}
            docs = [
                {"_id": {"consumer": CONSUMER, "partition": p}, "position": position, "fence": FENCE, "written_at": T0}
                for p in range(PARTITIONS)
            ]
            self.cursor(req, f"{DB}.{CHECKPOINTS}", docs if consumer == CONSUMER else [])
        elif name == "aggregate" and coll == 1:
            kind = self.change_stream(req)
        elif name == "getMore" and req.doc.get("collection") == "$cmd.aggregate":
            # the next batch's read, sent while this one is applied (the feed reads ahead): a
            # primary with no newer event holds it up to its maxTimeMS; left unanswered here
            assert req.doc["getMore"] == STREAM_ID and req.doc["batchSize"] == BATCH
            self.next_reads.append(req)
            return "next read"
        elif name == "find" and str(coll).startswith(f"wow_snapshot__{CONTEXT}__"):
            kind = "snapshot find"
            self.cursor(req, f"{DB}.{coll}", [])  # no aggregate of the batch has a snapshot yet
        elif name == "update" and str(coll).startswith(f"wow_snapshot__{CONTEXT}__"):
            kind = "snapshot bulk"
            self.upserted(req)
        elif name == "update" and str(coll).startswith(f"wow_timer__{CONTEXT}__"):
            updates = req.doc["updates"]
            if all(u.get("upsert") for u in updates):
                kind = "timer bulk"
                self.upserted(req)
            else:  # the settle of the resumed timers: replacements of the documents as loaded
                kind = "resume bulk"
                assert not any(u.get("upsert") for u in updates)
                self.resumed += [u["q"]["timer_id"] for u in updates]
                self.write_reply(req, n=len(updates), nModified=len(updates))
        elif name == "update" and coll == f"wow_timer_history__{CONTEXT}":
            kind = "history bulk"  # the records of the batch's timer events: upserts by _id, each
            # schedule ending the open schedules of its key (a recurring timer it replaces)
            assert all(u.get("upsert") and set(u["q"]) == {"_id"} or u.get("multi") for u in req.doc["updates"])
            self.upserted(req)
        elif name == "aggregate" and coll == REGISTRY:
            kind = "parked read"
            self.cursor(req, f"{DB}.{REGISTRY}", self.union(req.doc["pipeline"]))
        elif name == "update" and coll == CHECKPOINTS:
            kind = "checkpoint write"
            updates = req.doc["updates"]
            assert all(u["q"]["fence"] == {"$lte": FENCE} for u in updates)
            consumers = {u["q"]["_id"]["consumer"] for u in updates}
            if self.in_batch:  # every view's checkpoints, in the one write
                assert consumers == {CONSUMER, "wowd.index", "wowd.snapshots.order"}
            else:  # at start: the views without checkpoints of their own get the timer view's
                assert consumers == {"wowd.index", "wowd.snapshots.order"}
            self.write_reply(req, n=len(updates), nModified=len(updates))
        else:
            raise AssertionError(f"unexpected command: {req.doc}")
        if self.in_batch:
            self.kinds[kind] += 1
        self.in_batch = self.in_batch or kind == "change stream"  # the batch's commands come after it
        return kind

    def change_stream(self, req: Request) -> str:
        """The stream's first answer: every commit of the batch as an insert event, in one batch
        (up to the ``batchSize`` the log asks for). A batch the server ended at the oplog's end
        has a high-water mark past its events as ``postBatchResumeToken``; a full one, the last
        event's token."""
        [stage, *_] = req.doc["pipeline"]
        assert stage["$changeStream"]["startAtOperationTime"] == Timestamp(1_000, 0)
        assert req.doc["cursor"] == {"batchSize": BATCH}
        events = []
        for i, c in enumerate(self.commits):
            doc = commit_to_doc(c, PARTITIONS)
            events.append(
                {
                    "_id": token((1_001, i + 1)),
                    "operationType": "insert",
                    "clusterTime": Timestamp(1_001, i + 1),
                    "wallTime": datetime.datetime.fromtimestamp(1_001, tz=datetime.UTC),
                    "fullDocument": doc,
                    "ns": {"db": DB, "coll": f"wow_log__{CONTEXT}__{c.ref.aggregate}"},
                    "documentKey": {"_id": doc["_id"]},
                }
            )
        pbrt = events[-1]["_id"] if len(events) == BATCH else token((1_001, len(events) + 1))
        self.reply(
            req,
            cursor={"firstBatch": events, "postBatchResumeToken": pbrt, "id": STREAM_ID, "ns": f"{DB}.$cmd.aggregate"},
        )
        return "change stream"

    def upserted(self, req: Request) -> None:
        """Each conditional upsert met no document: each inserted (the batch's first versions)."""
        updates = req.doc["updates"]
        upserted = [{"index": i, "_id": ObjectId()} for i in range(len(updates))]
        self.write_reply(req, n=len(updates), nModified=0, upserted=upserted)

    def union(self, pipeline: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The registry aggregation of the timer reads over the parked timers (all stored in the
        order collection): the count of the context's collections, then each ``$unionWith``."""
        assert pipeline[:2] == [{"$match": {"context": CONTEXT}}, {"$count": "registered"}]
        out: list[dict[str, Any]] = [{"registered": len(TYPES)}]
        limit: int | None = None
        for stage in pipeline[2:]:
            if "$unionWith" in stage:
                coll, sub = stage["$unionWith"]["coll"], stage["$unionWith"]["pipeline"]
                docs = [dict(d) for d in self.parked if coll == f"wow_timer__{CONTEXT}__order"]
                for step in sub:
                    if "$match" in step:
                        docs = [d for d in docs if matches(step["$match"], d)]
                    elif "$sort" in step:
                        docs.sort(key=lambda d: (d["due_at"], d["timer_id"]))
                    elif "$limit" in step:
                        docs = docs[: step["$limit"]]
                    elif "$set" in step:
                        aggregate = step["$set"]["owner.aggregate"]["$literal"]
                        docs = [{**d, "owner": {**d["owner"], "aggregate": aggregate}} for d in docs]
                    elif "$unset" in step:
                        docs = [{k: v for k, v in d.items() if k != step["$unset"]} for d in docs]
                out += docs
            elif "$limit" in stage:
                limit = stage["$limit"]
        out[1:] = sorted(out[1:], key=lambda d: (d["due_at"], d["timer_id"]))
        return out if limit is None else out[:limit]


@pytest.fixture(scope="module")
def rs_server() -> Iterator[MockupDB]:
    """One MockupDB for the module answering ``hello`` as the primary of replica set ``rs0``
    (change streams need one); each run has its own client and consumes every command."""
    with primary("rs0") as server:  # stopped on a thread of its own
        server.autoresponds(housekeeping)
        yield server


@pytest.fixture(autouse=True)
def _no_leftovers(rs_server: MockupDB) -> Iterator[None]:
    """After each test, hang up on any request it left unanswered, so that a failing test does
    not hand its commands to the next one on the shared server."""
    yield
    while True:
        try:
            leftover = rs_server.receives(timeout=0)
        except AssertionError:
            return
        leftover.hangup()


@pytest.fixture
def fake() -> Iterator[FakeElasticsearch]:
    with serving() as server:
        server.model = EsModel()
        yield server


@pytest.fixture
async def es(fake: FakeElasticsearch) -> AsyncIterator[AsyncElasticsearch]:
    client = AsyncElasticsearch(fake.url, max_retries=0, request_timeout=10)
    try:
        yield client
    finally:
        await client.close()


@dataclass
class Measured:
    kinds: Counter[str]
    """The MongoDB commands of the batch by kind, and the sink's ``_bulk`` requests."""
    resumed: list[str]
    parked: list[dict[str, Any]]
    es_other: list[str]
    """The Elasticsearch requests of the batch other than its ``_bulk`` ones."""


async def feed_one_batch(rs_server: MockupDB, es: AsyncElasticsearch, fake: FakeElasticsearch, n: int) -> Measured:
    """Runs the feeder of a slot holding every partition over one change-stream batch of ``n``
    commits and stops it once the batch's checkpoints are written."""
    commits = batch_commits(n)
    deployment = Deployment(commits=commits, parked=parked_timers(commits))
    wire = Wire(rs_server)
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        rs_server.uri, serverSelectionTimeoutMS=3000, retryWrites=False, retryReads=False
    )
    options: dict[str, Any] = {"ddl": Ddl.NONE, "sharding": MongoSharding.OFF}
    timers = mongo_timers(client, DB, context=CONTEXT, partitions=PARTITIONS, **options)
    snapshots = MongoSnapshotStore(client, DB, context=CONTEXT, **options)
    backend = Backend(
        name="mongodb",
        log=MongoLog(client, DB, context=CONTEXT, partitions=PARTITIONS, ddl=Ddl.NONE),
        checkpoints=MongoCheckpoints(client, DB, context=CONTEXT),
        quarantine=MongoQuarantine(client, DB, context=CONTEXT, ddl=Ddl.NONE),
        leases=MongoSlotLeaseStore(client, DB),
        timers=timers.view,
        firing=timers.firing,
        timer_queries=timers.queries,
        snapshots=snapshots,
        rebuilds=MongoSnapshotRebuilds(client, DB, context=CONTEXT, **options, shared_with=snapshots),
        outbox=MongoOutbox(client, DB, context=CONTEXT, ddl=Ddl.NONE),
        history=MongoTimerHistory(client, DB, context=CONTEXT, ddl=Ddl.NONE),
        sink_factory=lambda type_: ElasticsearchEventSink(es, type_),
    )
    settings = load_settings(context=CONTEXT, partitions=PARTITIONS)
    held = HeldSlot(
        lease=SlotLease(
            namespace="wowd.ctx",
            slot=0,
            owner_key="me",
            incarnation=1,
            fence=FENCE,
            expires_at=0,
            floor=0,
            ceiling=0,
            written_at=0,
        ),
        partitions=frozenset(range(PARTITIONS)),
        valid_until=anyio.current_time() + 600,
        owner_key="me",
    )
    feeder = Feeder(settings, backend, reducers={REDUCED: CountingReducer()}, batch_size=BATCH)
    try:
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(timers.prepare)
                assert deployment.answer(await wire.receives()) == f"find {REGISTRY}"
                for type_ in sorted(TYPES):
                    assert deployment.answer(await wire.receives()) == f"listIndexes wow_timer__{CONTEXT}__{type_}"
            for type_ in TYPES:  # the indices made before the batch: its requests are the batch's
                await backend.sink(AggregateType(context=CONTEXT, aggregate=type_)).prepare()
            fake.take()
            async with anyio.create_task_group() as tg:
                tg.start_soon(feeder.run, held, Waker())
                # the batch's checkpoint write (not the one at start: the views' own checkpoints)
                while deployment.answer(await wire.receives()) != "checkpoint write" or not deployment.in_batch:
                    pass
                held.request_stop()  # during the batch: the feed stops after it, reading no more
    finally:
        await backend.close()
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await client.close()
    assert feeder.stalled is None
    requests = fake.take()
    kinds = deployment.kinds
    kinds["sink _bulk"] = sum(1 for r in requests if r.path.endswith("/_bulk"))
    others = [f"{r.method} {r.path}" for r in requests if not r.path.endswith("/_bulk")]
    return Measured(kinds=kinds, resumed=deployment.resumed, parked=deployment.parked, es_other=others)


BUDGET = {
    "sink _bulk": len(TYPES),
    "timer bulk": len(TYPES),
    "snapshot find": 1,
    "snapshot bulk": 1,
    "checkpoint write": 1,
    "history bulk": 1,
}
"""The per-kind budget of the scenario's batch: three types (each a timer collection touched),
one reducer type; the timer history's records of the batch in one bulk."""
CONSTANT = {"parked read": 2, "resume bulk": 1}
"""The constant: the parked read (and a check before it); the resumed timers' bulk (one
collection holds them)."""


@pytest.mark.parametrize("n", [10, BATCH])
async def test_a_batch_writes_the_sink_timers_snapshots_and_checkpoints_in_a_bulk_each(
    rs_server: MockupDB, es: AsyncElasticsearch, fake: FakeElasticsearch, n: int
) -> None:
    m = await feed_one_batch(rs_server, es, fake, n)
    for kind in ("sink _bulk", "timer bulk", "snapshot bulk", "checkpoint write", "history bulk"):
        assert m.kinds[kind] == BUDGET[kind], (kind, m.kinds)
    assert m.kinds["resume bulk"] == CONSTANT["resume bulk"], m.kinds
    assert m.es_other == []
    # the two parked timers whose target committed are resumed, the third is left parked
    assert sorted(m.resumed) == sorted(d["timer_id"] for d in m.parked[:2])
    known = {*BUDGET, *CONSTANT}
    assert set(m.kinds) <= known, m.kinds


async def test_a_batch_stays_within_its_command_budget_whatever_its_size(
    rs_server: MockupDB, es: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    runs = {n: (await feed_one_batch(rs_server, es, fake, n)).kinds for n in (10, BATCH)}
    for n, kinds in runs.items():
        for kind, most in {**BUDGET, **CONSTANT}.items():
            assert kinds[kind] <= most, (n, kind, kinds)
        assert kinds["snapshot find"] == BUDGET["snapshot find"], (n, kinds)
        assert set(kinds) <= {*BUDGET, *CONSTANT}, (n, kinds)
        assert sum(kinds.values()) <= sum(BUDGET.values()) + sum(CONSTANT.values()), (n, kinds)
    assert runs[10] == runs[BATCH], "the commands of a batch do not grow with its commits"
