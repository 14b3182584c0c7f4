"""Store faults on the black-pipe servers, and the retry that follows them: nothing is lost.

MongoDB (MockupDB behind the real async driver): a connection dropped in the middle of a bulk,
NotWritablePrimary, a call past its timeout. Each is :class:`StorageUnavailable`; the caller's
retry sends the very same idempotent documents, and what the first attempt already wrote is
recognised (skipped by the settle's revision guard, answered ``duplicate``/``False`` by the unique
indexes) instead of written twice or lost. A small in-test model of the server applies the writes
the driver sends, so "nothing lost, nothing twice" is checked on the resulting documents.

Elasticsearch (the fake ES 9 server): 429 for a while, then a bulk with mixed items; the retry of
the whole write succeeds and its 409s count as written (``wowd_sink_items_total{status="409"}``),
both for the sink alone and for the daemon's feed, which retries the whole batch and checkpoints
it once.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
from bson import ObjectId
from elasticsearch import AsyncElasticsearch
from pymongo import AsyncMongoClient

from tests.elasticsearch import fake_es
from tests.elasticsearch.fake_es import FakeElasticsearch, serving
from tests.helpers import caught_up_waker, timer_loop
from tests.mongo import conftest as black_pipe
from tests.mongo.conftest import Wire, server_error
from wowd import metrics
from wowd.errors import StorageUnavailable
from wowd.model import (
    AggregateRef,
    AggregateType,
    Claim,
    Commit,
    DomainEvent,
    SlotLease,
    Timer,
    TimerChange,
    TimerStatus,
    deterministic_timer_id,
    partition,
)
from wowd.retry import Backoff, retrying
from wowd.stores.base import Ddl
from wowd.stores.mongo._common import MongoSharding
from wowd.stores.mongo.timer_docs import timer_to_doc

pytestmark = pytest.mark.anyio

# the black-pipe fixtures of tests/mongo (MockupDB behind the real async driver), used here too
mock_server = black_pipe.mock_server
wire = black_pipe.wire
mongo_client = black_pipe.mongo_client

T = TypeVar("T")
DB = "wowd"
CONTEXT = "ctx"
PARTITIONS = 8


# --------------------------------------------------------------------------- helpers


@dataclass
class Call:
    """A store call running in a task while the test scripts the server's answers."""

    value: Any = None
    error: BaseException | None = None
    done: anyio.Event | None = None

    @classmethod
    def start(cls, tg: Any, fn: Callable[[], Awaitable[Any]]) -> Call:
        call = cls(done=anyio.Event())

        async def run() -> None:
            try:
                call.value = await fn()
            except Exception as exc:  # asserted by the test
                call.error = exc
            finally:
                assert call.done is not None
                call.done.set()

        tg.start_soon(run)
        return call

    async def result(self) -> Any:
        assert self.done is not None
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


async def wowd_retry(fn: Callable[[], Awaitable[T]]) -> T:
    """``fn`` under wowd's own retry (``wowd.retry.retrying``), on :class:`StorageUnavailable`,
    as the daemon's loops retry a store call (after a dropped connection the driver needs a
    heartbeat before it selects the server again); the test's ``fail_after`` bounds it."""
    async for attempt in retrying("the store call", backoff=Backoff(0.05, 1.0), logger=None):
        with attempt:
            return await fn()
    raise AssertionError("unreachable")


def unavailable(operation: str) -> float:
    """``wowd_store_unavailable_total`` of ``operation``, whatever the store label."""
    return sum(
        s.value
        for m in metrics.STORE_UNAVAILABLE.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels.get("operation") == operation
    )


def _get(doc: Mapping[str, Any], path: str) -> Any:
    value: Any = doc
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _tombstone(doc: Mapping[str, Any], pipeline: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The one update pipeline a settle sends (a fired one-shot timer's DONE tombstone): literal
    ``status``, ``expires_at`` from the server's clock, revision + 1, the claim, command, target
    and rule unset."""
    [set_stage, unset_stage] = pipeline
    fields = set_stage["$set"]
    out = {k: v for k, v in doc.items() if k not in unset_stage["$unset"]}
    out["status"] = fields["status"]
    out["expires_at"] = datetime.now(UTC)
    out["revision"] = doc["revision"] + 1
    return out


def _admits(put_filter: Mapping[str, Any], doc: Mapping[str, Any]) -> bool:
    """Whether a put's conditional upsert matches ``doc``: its key equalities and one clause of
    its ``$or`` (an earlier version, or the same version not a tombstone)."""
    key = {k: v for k, v in put_filter.items() if k != "$or"}
    earlier, same = put_filter["$or"]
    return _matches(key, doc) and (
        doc["version"] < earlier["version"]["$lt"]
        or (doc["version"] == same["version"] and doc["status"] not in same["status"]["$nin"])
    )


def _matches(flt: Mapping[str, Any], doc: Mapping[str, Any]) -> bool:
    """Equality filters on dotted paths (what the settle and the outbox send)."""
    return all(_get(doc, k) == v for k, v in flt.items())


class Collection:
    """The server side of one collection: applies the update (``$set``/``$unset``, or the
    tombstone's pipeline) and delete statements it is sent."""

    def __init__(self, docs: list[dict[str, Any]]) -> None:
        self.docs = [copy.deepcopy(d) for d in docs]

    def update(self, statements: list[Mapping[str, Any]]) -> int:
        n = 0
        for st in statements:
            for i, d in enumerate(self.docs):
                if _matches(st["q"], d):
                    u = st["u"]
                    if isinstance(u, list):
                        self.docs[i] = _tombstone(d, u)
                    else:
                        kept = {k: v for k, v in d.items() if k not in u.get("$unset", {})}
                        self.docs[i] = {**kept, **u.get("$set", {})}
                    n += 1
                    break
        return n

    def delete(self, statements: list[Mapping[str, Any]]) -> int:
        n = 0
        for st in statements:
            for i, d in enumerate(self.docs):
                if _matches(st["q"], d):
                    del self.docs[i]
                    n += 1
                    break
        return n


def owner(id: str) -> AggregateRef:
    return AggregateRef(context=CONTEXT, aggregate="order", id=id)


def claimed_timer(id: str, revision: int = 1) -> Timer:
    o = owner(id)
    return Timer(
        timer_id=deterministic_timer_id(o, "remind", 1),
        partition=partition(id, PARTITIONS),
        owner=o,
        key="remind",
        version=1,
        due_at=2_000,
        scheduled_at=1_000,
        target=o,
        body='{"body":{},"name":"Remind"}',
        status=TimerStatus.FIRING,
        claim=Claim(owner_key="me", fence=3, until=2_000),
        revision=revision,
    )


async def open_timer_store(client: AsyncMongoClient[Any], wire: Wire, operation_timeout: timedelta) -> Any:
    """The MongoDB timer stores whose registry records the ``order`` collection (read by ``prepare``)."""
    from tests.timer_stores import mongo_timers
    from wowd.stores.mongo.schema import timer_index_specs

    store = mongo_timers(
        client,
        DB,
        context=CONTEXT,
        partitions=PARTITIONS,
        sharding=MongoSharding.OFF,
        ddl=Ddl.NONE,
        operation_timeout=operation_timeout,
    )
    registry = {"_id": "wow_timer__ctx__order", "context": CONTEXT, "aggregate": "order", "format": 6}
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            call = Call.start(tg, store.prepare)
            req = await wire.command("find")
            req.ok(cursor={"id": 0, "ns": f"{DB}.wow_timer_aggregate", "firstBatch": [registry]})
            # ddl=none looks at the indexes of each registered collection once
            indexes = [{"v": 2, "key": {"_id": 1}, "name": "_id_"}, *({"v": 2, **spec} for spec in timer_index_specs())]
            (await wire.command("listIndexes")).ok(
                cursor={"id": 0, "ns": f"{DB}.wow_timer__ctx__order", "firstBatch": indexes}
            )
            await call.result()
    return store


async def put_update(wire: Wire) -> Any:
    """The put's ``update``, after the registry upsert of the type's first use if the store sends
    one (a store that read the type in ``prepare`` does not)."""
    req = await wire.receives()
    if req.command_name == "findAndModify":
        registry = {"_id": "wow_timer__ctx__order", "context": CONTEXT, "aggregate": "order", "format": 6}
        req.ok(value=registry, lastErrorObject={"n": 1, "updatedExisting": True})
        req = await wire.receives()
    assert req.command_name == "update", req.doc
    return req


@pytest.fixture
async def timers_store(mongo_client: AsyncMongoClient[Any], wire: Wire) -> AsyncIterator[Any]:
    store = await open_timer_store(mongo_client, wire, timedelta(seconds=3))
    yield store
    await store.close()


# --------------------------------------------------------------------------- MongoDB: timers


async def test_a_settle_cut_off_mid_bulk_is_retried_and_every_change_lands_once(timers_store: Any, wire: Wire) -> None:
    """The connection drops after the server applied the first update of the bulk. The retry
    sends the same statements; the one already applied no longer matches (its revision moved on)
    and is skipped, the others apply: each change lands exactly once."""

    timers = [claimed_timer(f"order-{i}") for i in range(3)]
    server = Collection([{"_id": ObjectId(), **timer_to_doc(t)} for t in timers])
    changes = [
        TimerChange.fired(timers[0], fence=3, next_due=None),  # its DONE tombstone (an update)
        TimerChange.fired(timers[1], fence=3, next_due=5_000),  # an update (recurring)
        TimerChange.retry(timers[2], fence=3, due_at=9_000, error="HTTP 503"),  # an update
    ]
    first: dict[str, Any] = {}
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = Call.start(tg, lambda: timers_store.firing.settle(changes))
            req = await wire.command("update")
            first = copy.deepcopy(dict(req.doc))
            server.update(req.doc["updates"][:1])  # the server applied the first statement...
            req.hangup()  # ...and the connection dropped
            with pytest.raises(StorageUnavailable, match="timers.settle"):
                await call.result()

            call = Call.start(tg, lambda: wowd_retry(lambda: timers_store.firing.settle(changes)))
            req = await wire.command("update")
            assert req.doc["updates"] == first["updates"], "the retry sends the same guarded statements"
            n = server.update(req.doc["updates"])
            req.ok(n=n, nModified=n)
            written = await call.result()
    assert written == 2, "the statement applied before the drop is skipped, not written twice"
    by_id = {doc["timer_id"]: doc for doc in server.docs}
    done = by_id[timers[0].timer_id]
    assert (done["status"], done["revision"], "claim" in done) == ("DONE", timers[0].revision + 1, False)
    assert by_id[timers[1].timer_id]["due_at"] == 5_000 and by_id[timers[1].timer_id]["fired"] == 1
    assert by_id[timers[1].timer_id]["revision"] == timers[1].revision + 1
    retried = by_id[timers[2].timer_id]
    assert retried["attempts"] == 1 and retried["last_error"] == "HTTP 503"
    assert by_id[timers[2].timer_id]["revision"] == timers[2].revision + 1


async def test_a_put_refused_by_a_not_writable_primary_is_retried_unchanged(timers_store: Any, wire: Wire) -> None:
    before = unavailable("put")
    t = replace(claimed_timer("order-9", revision=0), status=TimerStatus.PENDING, claim=None, due_at=1_000)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = Call.start(tg, lambda: timers_store.view.put(t))
            req = await put_update(wire)
            first = copy.deepcopy(dict(req.doc))
            server_error(req, 10107, "not primary")
            with pytest.raises(StorageUnavailable, match="not primary"):
                await call.result()

            call = Call.start(tg, lambda: wowd_retry(lambda: timers_store.view.put(t)))
            req = await wire.command("update")
            assert req.doc["updates"] == first["updates"]
            assert req.doc["updates"][0]["upsert"] is True
            req.ok(n=1, nModified=0, upserted=[{"index": 0, "_id": ObjectId()}])
            assert await call.result() is True
    assert unavailable("put") == before + 1, "the transient failure is counted"


async def test_a_put_past_its_timeout_is_retried_and_the_landed_write_matches(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    """The first put reached the server but its answer did not come back in time: the retry's
    conditional upsert finds the stored timer at the same version and answers True (no second
    document, no error)."""
    store = await open_timer_store(mongo_client, wire, timedelta(milliseconds=400))
    t = replace(claimed_timer("order-7", revision=0), status=TimerStatus.PENDING, claim=None, due_at=1_000)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = Call.start(tg, lambda: store.view.put(t))
            req = await put_update(wire)
            first = copy.deepcopy(req.doc["updates"])
            assert 0 < req.doc["maxTimeMS"] <= 400, "the server is told the deadline too"
            with pytest.raises(StorageUnavailable):
                await call.result()  # never answered

            call = Call.start(tg, lambda: wowd_retry(lambda: store.view.put(t)))
            req = await wire.command("update")
            assert req.doc["updates"] == first
            landed = {"_id": ObjectId(), **timer_to_doc(t)}
            assert _admits(first[0]["q"], landed), "admits the timer it wrote itself"
            req.ok(n=1, nModified=0)  # matched, kept as it is
            assert await call.result() is True
    await store.close()


# --------------------------------------------------------------------------- MongoDB: outbox and log


async def test_an_outbox_put_that_landed_before_the_drop_is_delivered_once(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    """Through the outbox gateway: the drop is a Retry of the timer; the re-fire carries the same
    request id, meets the unique index, and is Delivered without a second entry."""
    from wowd.delivery import Delivered, OutboxGateway, Retry
    from wowd.stores.mongo.outbox import MongoOutbox

    box = MongoOutbox(mongo_client, DB, context=CONTEXT, ddl=Ddl.NONE)
    gw = OutboxGateway(box)
    t = claimed_timer("order-3")
    stored: list[dict[str, Any]] = []
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = Call.start(tg, lambda: gw.send(t))
            req = await wire.command("insert")
            stored.extend(req.doc["documents"])  # written, then the connection dropped
            req.hangup()
            assert isinstance(await call.result(), Retry)

            call = Call.start(tg, lambda: gw.send(t))
            req = await wire.command("insert", timeout=1)
            (doc,) = req.doc["documents"]
            assert doc["request_id"] == stored[0]["request_id"] == t.request_id
            assert doc["fence"] == 3 and doc["owner_key"] == "me"
            req.ok(
                n=0,
                writeErrors=[
                    {
                        "index": 0,
                        "code": 11000,
                        "errmsg": "E11000 duplicate key error collection: wowd.wow_outbox__ctx index: request_id",
                        "keyPattern": {"request_id": 1},
                        "keyValue": {"request_id": t.request_id},
                    }
                ],
            )
            assert isinstance(await call.result(), Delivered)
    assert len(stored) == 1


def log_commit(id: str, version: int = 1) -> Commit:
    return Commit(
        ref=owner(id),
        version=version,
        command_id=f"cmd-{id}",
        request_id=f"req-{id}-{version}",
        create_time=1_700_000_000_000,
        events=(DomainEvent(id=f"ev-{id}", name="OrderCreated", body={"n": 1}),),
    )


async def test_an_append_cut_off_mid_bulk_is_retried_as_duplicates_and_appends(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    """The first commit of an unordered insert landed before the drop; the retry answers it
    ``duplicate`` (its request id is there) and appends the rest: the producer loses nothing and
    writes nothing twice."""
    from wowd.stores.mongo.log import MongoLog

    log = MongoLog(mongo_client, DB, context=CONTEXT, partitions=PARTITIONS, ddl=Ddl.NONE, operation_timeout=None)
    commits = [log_commit("order-1"), log_commit("order-2"), log_commit("order-3")]
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = Call.start(tg, lambda: log.append_many(commits))
            req = await wire.command("insert")
            first = copy.deepcopy(req.doc["documents"])
            req.hangup()
            with pytest.raises(StorageUnavailable):
                await call.result()

            call = Call.start(tg, lambda: wowd_retry(lambda: log.append_many(commits)))
            req = await wire.command("insert")
            assert req.doc["documents"] == first
            assert req.doc["ordered"] is False
            req.ok(
                n=2,
                writeErrors=[
                    {
                        "index": 0,
                        "code": 11000,
                        "errmsg": "E11000 duplicate key error collection: wowd.wow_log__ctx__order "
                        "index: aggregate_request dup key",
                        "keyPattern": {"aggregate_id": 1, "request_id": 1},
                        "keyValue": {"aggregate_id": "order-1", "request_id": "req-order-1-1"},
                    }
                ],
            )
            assert await call.result() == ["duplicate", "appended", "appended"]


async def test_a_checkpoint_cut_off_is_retried_with_the_same_fenced_update(
    mongo_client: AsyncMongoClient[Any], wire: Wire
) -> None:
    from wowd.stores.mongo.checkpoints import MongoCheckpoints

    checkpoints = MongoCheckpoints(mongo_client, DB, context=CONTEXT, operation_timeout=None)
    position = {"token": {"_data": "8263"}, "cluster_time": 7}
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            call = Call.start(tg, lambda: checkpoints.save("wowd", 3, position, 4))
            req = await wire.command("update")
            first = copy.deepcopy(req.doc["updates"])
            assert first[0]["q"] == {"_id": {"consumer": "wowd", "partition": 3}, "fence": {"$lte": 4}}
            server_error(req, 10107, "not primary")
            with pytest.raises(StorageUnavailable):
                await call.result()

            call = Call.start(tg, lambda: wowd_retry(lambda: checkpoints.save("wowd", 3, position, 4)))
            req = await wire.command("update")
            assert req.doc["updates"] == first, "the retry is the same fence-guarded upsert"
            req.ok(n=1, nModified=1)
            assert await call.result() is True

            # meanwhile a new holder (fence 5) wrote it: the old holder's retry is refused
            call = Call.start(tg, lambda: checkpoints.save("wowd", 3, position, 4))
            req = await wire.command("update")
            req.ok(
                n=0,
                nModified=0,  # a 7.0 server's update reply always counts what it modified
                writeErrors=[
                    {
                        "index": 0,
                        "code": 11000,
                        "errmsg": "E11000 duplicate key error collection: wowd.wow_checkpoint__ctx index: _id_",
                        "keyPattern": {"_id": 1},
                        "keyValue": {"_id": {"consumer": "wowd", "partition": 3}},
                    }
                ],
            )
            assert await call.result() is False


# --------------------------------------------------------------------------- Elasticsearch


@pytest.fixture
def fake() -> Iterator[FakeElasticsearch]:
    with serving() as server:
        yield server


@pytest.fixture
async def es(fake: FakeElasticsearch) -> AsyncIterator[AsyncElasticsearch]:
    client = AsyncElasticsearch(fake.url, max_retries=0, request_timeout=5)
    try:
        yield client
    finally:
        await client.close()


SINK_TYPE = AggregateType(context=CONTEXT, aggregate="order")
BULK = "/wow.ctx.order.events/_bulk"
MAPPING = "/wow.ctx.order.events/_mapping"


def mapping_answer() -> dict[str, Any]:
    """The index as the sink made it (``ddl none`` checks the mapping of an existing index)."""
    from wowd.stores.elasticsearch import events_mapping

    return {"wow.ctx.order.events": {"mappings": fake_es.stored_mapping(events_mapping())}}


def items(status: str) -> float:
    value = metrics.SINK_ITEMS.labels(status=status)._value.get()
    assert isinstance(value, float)
    return value


def busy() -> dict[str, Any]:
    return fake_es.error(429, "es_rejected_execution_exception", "rejected execution of coordinating op")


async def test_the_sink_retried_after_429s_counts_409s_as_written_and_sends_only_what_was_not(
    es: AsyncElasticsearch, fake: FakeElasticsearch
) -> None:
    from wowd.stores.elasticsearch import ElasticsearchEventSink

    sink = ElasticsearchEventSink(es, SINK_TYPE, ddl=Ddl.NONE)
    commits = [log_commit("order-1"), log_commit("order-2"), log_commit("order-3")]
    fake.on("GET", MAPPING, body=mapping_answer())
    fake.on("PUT", BULK, 429, busy())
    fake.on("PUT", BULK, 429, busy())
    fake.on("PUT", BULK, body=fake_es.bulk_answer(201, 409, 429))  # written, written before, rejected
    fake.on("PUT", BULK, body=fake_es.bulk_answer(201))  # the retry: only the item rejected
    before = {s: items(s) for s in ("201", "409", "429")}
    attempts = 0
    with anyio.fail_after(10):
        while True:
            attempts += 1
            try:
                await sink.write(commits)
                break
            except StorageUnavailable:
                continue
    assert attempts == 4
    bulks = [r for r in fake.take() if r.path == BULK]
    assert len(bulks) == 4
    assert all(b.ndjson() == bulks[0].ndjson() for b in bulks[:3]), "the whole write while nothing was written"
    assert bulks[3].ndjson() == bulks[0].ndjson()[4:], "then what was not written only"
    assert items("409") == before["409"] + 1, "the 409s count as written"
    assert items("201") == before["201"] + 2
    assert items("429") == before["429"] + 1


@pytest.fixture
async def feed_backend(tmp_path: Path, es: AsyncElasticsearch) -> AsyncIterator[tuple[Any, Any]]:
    """The embedded stores with the Elasticsearch sink on the fake server."""
    from wowd.config import load_settings
    from wowd.stores.elasticsearch import ElasticsearchEventSink
    from wowd.stores.embedded import open_embedded

    settings = load_settings(context=CONTEXT, partitions=PARTITIONS, embedded={"path": tmp_path / "wowd.db"})
    backend = await open_embedded(settings)
    backend.sink_factory = lambda type_: ElasticsearchEventSink(es, type_, ddl=Ddl.NONE)
    try:
        yield settings, backend
    finally:
        await backend.close()


async def test_the_feed_retries_the_whole_batch_through_429s_and_checkpoints_it_once(
    feed_backend: tuple[Any, Any], fake: FakeElasticsearch
) -> None:
    from wowd.daemon.feed import CONSUMER, Feeder
    from wowd.daemon.leases import HeldSlot
    from wowd.daemon.waker import Waker
    from wowd.views import view_named

    INDEX_CONSUMER = view_named("index").consumer

    settings, backend = feed_backend
    commits = [log_commit("order-1"), log_commit("order-2"), log_commit("order-3")]
    assert await backend.log.append_many(commits) == ["appended"] * 3
    fake.on("GET", MAPPING, body=mapping_answer())
    fake.on("PUT", BULK, 429, busy())
    fake.on("PUT", BULK, body=fake_es.bulk_answer(201, 429, 201))
    fake.on("PUT", BULK, body=fake_es.bulk_answer(201))  # the retry: only the item rejected
    transient = metrics.FEED_ERRORS.labels(kind="transient")._value.get()
    conflicts = items("409")
    lease = SlotLease(
        namespace="t",
        slot=0,
        owner_key="me",
        incarnation=1,
        fence=5,
        expires_at=0,
        floor=0,
        ceiling=0,
        written_at=0,
    )
    held = HeldSlot(
        lease=lease,
        partitions=frozenset(range(PARTITIONS)),
        valid_until=anyio.current_time() + 60,
        owner_key="me",
    )
    feeder = Feeder(settings, backend)
    parts = sorted({c.partition(PARTITIONS) for c in commits})
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(feeder.run, held, Waker())
            while True:  # polls the store (inside fail_after) until the index checkpointed each partition
                cps = await backend.checkpoints.read(INDEX_CONSUMER, parts)
                if sum(1 for cp in cps.values() if cp.position) == len(parts):
                    break
                await anyio.sleep(0.02)
            held.request_stop()
    assert feeder.stalled is None
    assert len(await backend.checkpoints.read(CONSUMER, parts)) == len(parts)
    cps = await backend.checkpoints.read(INDEX_CONSUMER, parts)
    assert {cp.fence for cp in cps.values()} == {5}
    bulks = [r for r in fake.take() if r.path == BULK]
    assert len(bulks) == 3 and bulks[1].ndjson() == bulks[0].ndjson()
    assert bulks[2].ndjson() == bulks[0].ndjson()[2:4], "the retry sends only what was not written"
    assert metrics.FEED_ERRORS.labels(kind="transient")._value.get() == transient + 2
    assert items("409") == conflicts


# --------------------------------------------------------------------------- the daemon's retries


class FlakyTimers:
    """A firing store whose ``due`` and ``settle`` fail transiently on the calls numbered in
    ``fail_on`` (1-based, per method), as a store behind a dropped connection would."""

    def __init__(self, store: Any, fail_on: dict[str, set[int]]) -> None:
        self._store = store
        self._fail_on = fail_on
        self.calls: Counter[str] = Counter()
        self.failures = 0

    def _maybe_fail(self, method: str) -> None:
        self.calls[method] += 1
        if self.calls[method] in self._fail_on.get(method, set()):
            self.failures += 1
            raise StorageUnavailable(f"mongodb timers.{method}: connection closed (injected)")

    async def due(self, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail("due")
        return await self._store.due(*args, **kwargs)

    async def settle(self, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail("settle")
        return await self._store.settle(*args, **kwargs)

    async def claim_due(self, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail("claim_due")
        return await self._store.claim_due(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def test_the_timer_loop_retries_through_store_faults_and_fires_each_timer_once(tmp_path: Path) -> None:
    """Two claims and an outcome settle fail transiently: the loop backs off, retries, and every
    timer is delivered (one outbox entry per request id) and settled (done)."""
    from tests.timer_stores import embedded_timers
    from wowd.config import TimerSettings
    from wowd.daemon.leases import HeldSlot
    from wowd.delivery import OutboxGateway
    from wowd.stores.embedded.outbox import EmbeddedOutbox

    db = tmp_path / "wowd.db"
    store = embedded_timers(db, context=CONTEXT, partitions=PARTITIONS)
    await store.prepare()
    box = EmbeddedOutbox(db)
    await box.prepare()
    now = int(time.time() * 1000)
    timers = [
        replace(claimed_timer(f"order-{i}", revision=0), status=TimerStatus.PENDING, claim=None, due_at=now)
        for i in range(20)
    ]
    timers = [replace(t, scheduled_at=now) for t in timers]
    for t in timers:
        assert await store.view.put(t)
    flaky = FlakyTimers(store.firing, {"claim_due": {1, 2}, "settle": {1}})  # two claims, the first outcomes
    lease = SlotLease(
        namespace="t", slot=0, owner_key="me", incarnation=1, fence=2, expires_at=0, floor=0, ceiling=0,
        written_at=0,
    )  # fmt: skip
    held = HeldSlot(
        lease=lease,
        partitions=frozenset(range(PARTITIONS)),
        valid_until=anyio.current_time() + 60,
        owner_key="me",
    )
    settings = TimerSettings(backoff_base_s=0.05)
    loop = timer_loop(flaky, OutboxGateway(box), settings)  # type: ignore[arg-type]
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await tg.start(loop.run, held, caught_up_waker())
                while True:  # polls the stores (inside fail_after) until every timer is settled
                    if await box.count() == len(timers) and not await store.queries.scan(limit=100):
                        break
                    await anyio.sleep(0.05)
                held.request_stop()
        assert flaky.failures == 3
        entries = await box.entries()
        assert sorted(e.request_id for e in entries) == sorted(t.request_id for t in timers)
        assert {e.fence for e in entries} == {2}
    finally:
        await store.close()
        await box.close()
