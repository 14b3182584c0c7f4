"""The fire gate on MongoDB: a due timer is delivered at its due time after one read of the log on
the primary (``majority`` read concern), not when the change stream's post-batch resume token
reaches its due time, which an idle replica set or an idle shard holds back for seconds; a
cancel committed before the due time always wins. Also: a watermark is the lowest of the slot's
partitions' (a catch-up stream's holds for the partitions it reads only), and a quiet partition's
position is checkpointed.

The log is a :class:`MongoLog` over the wire to MockupDB, answered as a MongoDB 7.0 primary (or
``mongos``) answers: :class:`FakeCluster` serves the feed's change stream (each empty ``getMore``
held for ``maxAwaitTimeMS``, its post-batch resume token frozen unless a test moves it), the
checkpoints, the scans and the log check. The timer view, the event sink and the slot are the
embedded backend's (the feed and the timer loop drive them as they drive MongoDB's).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from bson.min_key import MinKey
from bson.timestamp import Timestamp
from mockupdb import MockupDB, Request
from pymongo import AsyncMongoClient

from tests.factories import Recorder
from tests.helpers import held_slot, timer_loop
from tests.mongo.conftest import Wire, primary, serving
from tests.mongo.log_support import CONTEXT, DB, ORDERS, housekeeping, token
from wowd.backends import opened_backend
from wowd.config import EmbeddedSettings, LeaseSettings, WowdSettings
from wowd.daemon.feed import CONSUMER, Feeder
from wowd.daemon.leases import HeldSlot
from wowd.daemon.waker import Waker
from wowd.metrics import REGISTRY
from wowd.model import (
    AggregateRef,
    Command,
    Commit,
    DomainEvent,
    Timer,
    commit_to_doc,
    deterministic_timer_id,
    partition,
)
from wowd.stores.base import Backend, Ddl
from wowd.stores.mongo.checkpoints import MongoCheckpoints
from wowd.stores.mongo.log import MongoLog

pytestmark = pytest.mark.anyio

PARTS = 2
MAX_AWAIT_S = 0.2
CHECKPOINTS = f"wow_checkpoint__{CONTEXT}"


def now_ms() -> int:
    return int(time.time() * 1000)


def id_in(p: int) -> str:
    """An order id of partition ``p`` (of :data:`PARTS`)."""
    return next(f"order-{i}" for i in range(100) if partition(f"order-{i}", PARTS) == p)


def ref(agg_id: str) -> AggregateRef:
    return AggregateRef(context=CONTEXT, aggregate="order", id=agg_id)


def timer(agg_id: str, due_at: int) -> Timer:
    """The one-shot timer ``k`` of order ``agg_id``, put by its version 1, aimed at itself."""
    return Timer(
        timer_id=deterministic_timer_id(ref(agg_id), "k", 1),
        partition=partition(agg_id, PARTS),
        owner=ref(agg_id),
        key="k",
        version=1,
        due_at=due_at,
        scheduled_at=due_at,
        target=ref(agg_id),
        body=Command(name="expire").to_json(),
    )


def put_doc(agg_id: str, due_at: int) -> dict[str, Any]:
    """The log document of the commit (version 1) that schedules :func:`timer`."""
    event = DomainEvent(
        id=f"put-{agg_id}",
        name="TimerScheduled",
        body={
            "key": "k",
            "due_at": due_at,
            "target": {"context": CONTEXT, "aggregate": "order", "id": agg_id},
            "command": {"name": "expire", "body": {}},
        },
    )
    c = Commit(ref=ref(agg_id), version=1, command_id="c1", request_id=f"r1-{agg_id}", create_time=due_at - 60_000,
               events=(event,))  # fmt: skip
    return commit_to_doc(c, PARTS)


def cancel_doc(agg_id: str, at: int) -> dict[str, Any]:
    """The log document of the commit (version 2) that cancels :func:`timer`."""
    event = DomainEvent(id=f"cancel-{agg_id}", name="TimerCancelled", body={"key": "k"})
    c = Commit(ref=ref(agg_id), version=2, command_id="c2", request_id=f"r2-{agg_id}", create_time=at, events=(event,))
    return commit_to_doc(c, PARTS)


def insert_event(doc: dict[str, Any], ct: tuple[int, int]) -> dict[str, Any]:
    """The change event of the insert of ``doc`` at cluster time ``ct``."""
    return {
        "_id": token(ct),
        "operationType": "insert",
        "clusterTime": Timestamp(*ct),
        "ns": {"db": DB, "coll": ORDERS},
        "documentKey": {"_id": doc["_id"]},
        "fullDocument": doc,
    }


def position(ct: tuple[int, int]) -> dict[str, Any]:
    return {"token": token(ct), "cluster_time": list(ct)}


# --------------------------------------------------------------------------- the server


class FakeCluster:
    """Answers the log's commands as a MongoDB 7.0 primary or ``mongos`` does.

    ``pbrt``: the cluster time of the post-batch resume token of every empty stream answer (an
    idle cluster's: frozen unless a test moves it). ``events``: change events the next
    ``getMore`` returns. ``checkpoints``: the stored checkpoint documents by partition (the
    feed's upserts update them). ``scans``: the documents of each partition a scan reads.
    ``check_answer``: the documents the log check's ``find`` returns. ``hold``: a request it
    answers True for waits until the test calls :meth:`answer_held`."""

    def __init__(self, wire: Wire, pbrt: tuple[int, int]) -> None:
        self.wire = wire
        self.pbrt = pbrt
        self.events: list[dict[str, Any]] = []
        self.checkpoints: dict[int, dict[str, Any]] = {}
        self.scans: dict[int, list[dict[str, Any]]] = {}
        self.check_answer: list[dict[str, Any]] = []
        self.checks: list[tuple[int, Request]] = []
        """Each log check (``find`` on a log collection with an ``$or``) with when it came (ms)."""
        self.scanned: list[int] = []
        self.streams: list[Request] = []
        self.saved: list[Request] = []
        self.unexpected: list[str] = []
        self.hold: Callable[[Request], bool] = lambda _r: False
        self._held: list[Request] = []
        self._getmores: list[tuple[float, Request]] = []
        self.changed = anyio.Event()

    def _tell(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    async def until(self, what: Callable[[], bool]) -> None:
        while not what():
            await self.changed.wait()

    def answer_held(self) -> None:
        held, self._held = self._held, []
        for r in held:
            self._answer(r)

    async def serve(self) -> None:
        while True:
            try:
                req = await self.wire.receives(timeout=0.02)
            except AssertionError:
                req = None
            t = time.monotonic()
            due = [g for g in self._getmores if g[0] <= t or self.events]
            for g in due:
                self._getmores.remove(g)
                with suppress(OSError):  # the client hung up (the feed stopped)
                    self._answer_getmore(g[1])
            if req is None:
                continue
            if self.hold(req):
                self._held.append(req)
            elif req.command_name == "getMore" and not self.events:
                # an empty getMore waits maxAwaitTimeMS on the server
                self._getmores.append((t + req["maxTimeMS"] / 1000, req))
            else:
                with suppress(OSError):
                    self._answer(req)
            self._tell()

    def _answer_getmore(self, req: Request) -> None:
        batch, self.events = self.events, []
        pbrt = batch[-1]["_id"] if batch else token(self.pbrt)
        req.ok(cursor={"id": req["getMore"], "ns": f"{DB}.$cmd.aggregate", "nextBatch": batch,
                       "postBatchResumeToken": pbrt})  # fmt: skip
        self._tell()

    def _answer(self, req: Request) -> None:
        name = req.command_name
        if name == "getMore":
            self._answer_getmore(req)
        elif name == "aggregate" and req["aggregate"] == 1:
            self.streams.append(req)
            req.ok(cursor={"id": 42 + len(self.streams), "ns": f"{DB}.$cmd.aggregate", "firstBatch": [],
                           "postBatchResumeToken": token(self.pbrt)})  # fmt: skip
        elif name == "find" and req["find"] == CHECKPOINTS and req["filter"] == {"_id": None}:
            # the cut before a scan: the majority commit point
            req.ok(cursor={"id": 0, "ns": f"{DB}.{CHECKPOINTS}", "firstBatch": []}, operationTime=Timestamp(*self.pbrt))
        elif name == "find" and req["find"] == CHECKPOINTS:
            wanted = [i["partition"] for i in req["filter"]["_id"]["$in"]]
            docs = [self.checkpoints[p] for p in wanted if p in self.checkpoints]
            req.ok(cursor={"id": 0, "ns": f"{DB}.{CHECKPOINTS}", "firstBatch": docs})
        elif name == "update" and req["update"] == CHECKPOINTS:
            self.saved.append(req)
            for u in req["updates"]:
                p = u["q"]["_id"]["partition"]
                pos = u["u"][0]["$set"]["position"]["$literal"]
                fence = u["u"][0]["$set"]["fence"]
                self.checkpoints[p] = {"_id": u["q"]["_id"], "position": pos, "fence": fence, "written_at": now_ms()}
            n = len(req["updates"])
            req.ok(n=n, nModified=n)
        elif name == "listCollections":
            req.ok(cursor={"id": 0, "ns": f"{DB}.$cmd.listCollections",
                           "firstBatch": [{"name": ORDERS, "type": "collection"}]})  # fmt: skip
        elif name == "find" and req["find"] == ORDERS and "$or" in req["filter"]:
            self.checks.append((now_ms(), req))
            req.ok(cursor={"id": 0, "ns": f"{DB}.{ORDERS}", "firstBatch": self.check_answer})
        elif name == "find" and req["find"] == ORDERS:
            # a re-read's range: only a partition's own (from its lowest key) holds commits here
            p = req["min"]["partition"]
            own = isinstance(p, int) and p < PARTS and isinstance(req["min"]["aggregate_id"], MinKey)
            if own:
                self.scanned.append(p)
            req.ok(cursor={"id": 0, "ns": f"{DB}.{ORDERS}", "firstBatch": self.scans.get(p, []) if own else []})
        else:
            self.unexpected.append(f"{name}: {req.doc}")
            req.fail(f"unexpected {name}")


@contextmanager
def mongos() -> Iterator[MockupDB]:
    """A MockupDB answering ``hello`` as a MongoDB 7.0 ``mongos``."""
    hello = {"ismaster": True, "msg": "isdbgrid", "minWireVersion": 0, "maxWireVersion": 21,
             "logicalSessionTimeoutMinutes": 30}  # fmt: skip
    with serving(MockupDB(auto_ismaster=hello, verbose=False)) as server:
        yield server


@pytest.fixture(params=["replica set", "sharded cluster"])
def server(request: pytest.FixtureRequest) -> Iterator[MockupDB]:
    """A replica set's primary, or a ``mongos`` of a sharded cluster one of whose shards is idle
    (the merged stream's post-batch resume token waits for it: frozen as an idle replica set's)."""
    with primary("rs0") if request.param == "replica set" else mongos() as s:
        s.autoresponds(housekeeping)
        yield s


@pytest.fixture
def rs_server() -> Iterator[MockupDB]:
    with primary("rs0") as s:
        s.autoresponds(housekeeping)
        yield s


async def client_of(server: MockupDB) -> AsyncMongoClient[Any]:
    return AsyncMongoClient(server.uri, serverSelectionTimeoutMS=3000, retryWrites=False, retryReads=False,
                            timeoutMS=5000)  # fmt: skip


def make_log(client: AsyncMongoClient[Any], **kwargs: Any) -> MongoLog:
    return MongoLog(client, DB, context=CONTEXT, partitions=PARTS, ddl=Ddl.NONE,
                    max_await=timedelta(seconds=MAX_AWAIT_S), **kwargs)  # fmt: skip


def settings(tmp_path: Path) -> WowdSettings:
    return WowdSettings(context=CONTEXT, partitions=PARTS, embedded=EmbeddedSettings(path=tmp_path / "wowd.db"),
                        lease=LeaseSettings(limit=1))  # fmt: skip


class Slot:
    """A held slot's feed (over the fake cluster's log) and timer loop (embedded view)."""

    def __init__(self, tmp_path: Path, backend: Backend, log: MongoLog) -> None:
        self.settings = settings(tmp_path)
        # the log and its checkpoints on the cluster; the rest of the stores embedded
        checkpoints = MongoCheckpoints(log.client, DB, context=CONTEXT)
        self.backend = dataclasses.replace(backend, log=log, checkpoints=checkpoints, offers=())
        self.log = log
        self.gateway = Recorder()
        self.held: HeldSlot | None = None
        self.waker = Waker(partitions=range(PARTS))
        self.loop = timer_loop(backend.firing, self.gateway, self.settings.timers, nudge=log.nudge,
                               gate=log.committed_after)  # fmt: skip

    async def run(
        self, *, loop: bool = True, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        self.held = held_slot(PARTS)
        async with anyio.create_task_group() as tg:
            if loop:
                await tg.start(self.loop.run, self.held, self.waker)
            await tg.start(Feeder(self.settings, self.backend).run, self.held, self.waker)
            task_status.started()


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[Backend]:
    async with opened_backend(settings(tmp_path)) as b:
        yield b


async def stop(slot: Slot) -> None:
    assert slot.held is not None
    slot.held.request_stop()


def waiting(reason: str) -> float:
    """``wowd_timers_waiting`` of slot 0 for ``reason``."""
    value = REGISTRY.get_sample_value("wowd_timers_waiting", {"slot": "0", "reason": reason})
    return value or 0.0


# --------------------------------------------------------------------------- a due timer, idle log


async def test_a_timer_on_an_idle_cluster_fires_at_its_due_time_after_one_log_check(
    server: MockupDB, backend: Backend, tmp_path: Path
) -> None:
    """The post-batch resume token never moves (an idle replica set between its no-op writes, or
    an idle shard holding the merged stream back): the timer is delivered at its due time (here
    within a second, a margin for a loaded machine: the wait it replaces is 5 to 22 s; the bench
    measures the lag), after one majority read of its log collection on the primary, filtered by
    its partition."""
    agg = id_in(1)
    idle_since = (int(time.time()) - 5, 1)
    fake = FakeCluster(Wire(server), idle_since)
    fake.checkpoints = {p: {"_id": {"consumer": CONSUMER, "partition": p}, "position": position(idle_since),
                            "fence": 1, "written_at": 0} for p in range(PARTS)}  # fmt: skip
    due = now_ms() + 400
    await backend.timers.put(timer(agg, due))
    client = await client_of(server)
    slot = Slot(tmp_path, backend, make_log(client))
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as outer:
                outer.start_soon(fake.serve)
                async with anyio.create_task_group() as tg:
                    await tg.start(slot.run)
                    with anyio.fail_after((due - now_ms()) / 1000 + 1.0):
                        await slot.gateway.until_fired(1)
                    await stop(slot)
                outer.cancel_scope.cancel()
    finally:
        await client.close()
    (fired, at), = slot.gateway.fired  # fmt: skip
    assert fired.owner.id == agg
    assert due <= at <= due + 1000, f"delivered {at - due} ms after its due time"
    assert len(fake.checks) == 1
    checked_at, check = fake.checks[0]
    assert checked_at >= due  # asked after the due time: every commit acknowledged before it is seen
    assert check["readConcern"] == {"level": "majority"}
    assert check.doc.get("$readPreference", {"mode": "primary"}) == {"mode": "primary"}
    (branch,) = check["filter"]["$or"]
    # the partition, or none stored (the schema leaves it out); the default tenant, or none stored
    assert {k: branch[k] for k in ("partition", "aggregate_id", "tenant_id", "version")} == {
        "partition": {"$in": [1, None]}, "aggregate_id": agg, "tenant_id": {"$in": ["(0)", None]},
        "version": {"$gt": 1},
    }  # fmt: skip
    assert fake.unexpected == []


async def test_a_cancel_committed_before_the_due_time_wins_on_an_idle_cluster(
    server: MockupDB, backend: Backend, tmp_path: Path
) -> None:
    """The cancel (version 2) was acknowledged before the due time; the feed has not read it yet
    (a sharded cluster's merged stream holds it back until the idle shard moves on). The log
    check at the due time finds it: the timer is not delivered, and once the feed reads and
    applies the cancel it never is."""
    agg = id_in(0)
    idle_since = (int(time.time()) - 5, 1)
    fake = FakeCluster(Wire(server), idle_since)
    fake.checkpoints = {p: {"_id": {"consumer": CONSUMER, "partition": p}, "position": position(idle_since),
                            "fence": 1, "written_at": 0} for p in range(PARTS)}  # fmt: skip
    due = now_ms() + 400
    await backend.timers.put(timer(agg, due))
    cancel = cancel_doc(agg, due - 300)
    fake.check_answer = [
        {"tenant_id": cancel["tenant_id"], "aggregate_id": agg, "version": 2, "deleted": False,
         "events": [{"name": "TimerCancelled", "body": {"key": "k"}}]}
    ]  # fmt: skip
    client = await client_of(server)
    slot = Slot(tmp_path, backend, make_log(client))
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as outer:
                outer.start_soon(fake.serve)
                async with anyio.create_task_group() as tg:
                    await tg.start(slot.run)
                    await fake.until(lambda: len(fake.checks) == 1)
                    await fake.until(lambda: waiting("log_check") == 1)  # held for the feed, claimed
                    # the feed reads the cancel after the check: the timer is settled back
                    fake.events = [insert_event(cancel, ((due - 300) // 1000, 7))]
                    await fake.until(lambda: len(fake.saved) >= 1)  # the cancel applied, then checkpointed
                    await fake.until(lambda: waiting("log_check") == 0)
                    # cancelled: the view holds no live timer of the key (a tombstone)
                    assert await backend.timer_queries.find(ref(agg), "k") is None
                    await stop(slot)
                outer.cancel_scope.cancel()
    finally:
        await client.close()
    assert slot.gateway.fired == []
    assert len(fake.checks) == 1 and fake.checks[0][0] >= due
    assert fake.unexpected == []


# --------------------------------------------------------------------------- scans, quiet partitions


def checkpoint_docs(ct: tuple[int, int]) -> dict[int, dict[str, Any]]:
    return {
        p: {"_id": {"consumer": CONSUMER, "partition": p}, "position": position(ct), "fence": 1, "written_at": 0}
        for p in range(PARTS)
    }


async def test_a_long_scan_gives_no_watermark_before_every_partition_is_scanned(
    rs_server: MockupDB, backend: Backend, tmp_path: Path
) -> None:
    """No checkpoints: both partitions are scanned, and with ``scan_catch_up`` 0 the partition
    scanned first is caught up by a stream before the second's scan. That stream's watermark
    holds for the first partition only: nothing reaches the timer loop before the second
    partition is scanned, and the cancel the second partition holds wins."""
    agg = id_in(1)  # scanned last
    due = now_ms() - 1000
    await backend.timers.put(timer(agg, due))  # a previous holder's view
    fake = FakeCluster(Wire(rs_server), (int(time.time()), 1))
    fake.scans = {1: [put_doc(agg, due), cancel_doc(agg, due - 5000)]}
    cuts: list[Request] = []
    marks_at_second_cut: list[tuple[int | None, int | None]] = []

    def hold_second_cut(req: Request) -> bool:
        if req.command_name == "find" and req["find"] == CHECKPOINTS and req["filter"] == {"_id": None}:
            cuts.append(req)
            if len(cuts) == 2:
                marks_at_second_cut.append((slot.waker.read_mark, slot.waker.watermark))
                return True
        return False

    fake.hold = hold_second_cut
    client = await client_of(rs_server)
    slot = Slot(tmp_path, backend, make_log(client, scan_catch_up=timedelta(0)))
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as outer:
                outer.start_soon(fake.serve)
                async with anyio.create_task_group() as tg:
                    await tg.start(slot.run)
                    await fake.until(lambda: len(cuts) == 2)
                    # while the second partition waits for its scan, the timer loop has nothing:
                    # a loop given the catch-up's watermark would deliver within an idle period
                    with anyio.move_on_after(0.8):  # four idle periods
                        await slot.gateway.until_fired(1)
                    assert slot.waker.watermark is None
                    fake.answer_held()
                    await fake.until(lambda: fake.scanned == [0, 1] and len(fake.streams) == 2)
                    await fake.until(lambda: slot.waker.watermark is not None)
                    # the loop's rounds now read a view where the cancel is applied
                    assert await backend.timer_queries.find(ref(agg), "k") is None
                    await stop(slot)
                outer.cancel_scope.cancel()
    finally:
        await client.close()
    assert marks_at_second_cut == [(None, None)]
    assert slot.gateway.fired == []
    assert fake.streams[0]["pipeline"][1]["$match"]["$or"][0] == {"fullDocument.partition": {"$in": [0]}}  # catch-up
    assert fake.unexpected == []


async def test_a_quiet_partition_is_checkpointed_and_a_restart_resumes_there_without_a_scan(
    rs_server: MockupDB, backend: Backend, tmp_path: Path
) -> None:
    """The partitions' checkpoints are an hour old and nothing was committed since: the stream's
    post-batch resume token an hour later moves them on, and the feed saves those positions
    (fenced). A restart then starts its stream there: no scan, nothing re-read."""
    hour_ago = (int(time.time()) - 3600, 1)
    now_ct = (int(time.time()), 3)
    fake = FakeCluster(Wire(rs_server), now_ct)
    fake.checkpoints = checkpoint_docs(hour_ago)
    client = await client_of(rs_server)
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as outer:
                outer.start_soon(fake.serve)
                first = Slot(tmp_path, backend, make_log(client))
                async with anyio.create_task_group() as tg:
                    await tg.start(first.run)
                    await fake.until(lambda: len(fake.saved) == 1)
                    await stop(first)
                (saved,) = fake.saved
                # the views following the shared read (the timer view and the index), in one write
                assert [u["q"] for u in saved["updates"]] == [
                    {"_id": {"consumer": c, "partition": p}, "fence": {"$lte": 1}}
                    for c in (CONSUMER, "wowd.index")
                    for p in range(PARTS)
                ]
                assert {u["u"][0]["$set"]["position"]["$literal"]["cluster_time"][0] for u in saved["updates"]} == {
                    now_ct[0]
                }
                again = Slot(tmp_path, backend, make_log(client))
                async with anyio.create_task_group() as tg:
                    await tg.start(again.run)
                    await fake.until(lambda: len(fake.streams) == 2)
                    await stop(again)
                outer.cancel_scope.cancel()
    finally:
        await client.close()
    assert fake.streams[0]["pipeline"][0]["$changeStream"] == {"startAtOperationTime": Timestamp(*hour_ago)}
    assert fake.streams[1]["pipeline"][0]["$changeStream"] == {"startAtOperationTime": Timestamp(*now_ct)}
    assert fake.scanned == []  # no partition re-read from the collections
    assert fake.unexpected == []
