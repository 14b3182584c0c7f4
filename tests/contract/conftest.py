"""Contract suites: every implementation of a protocol runs the same tests.

``embedded`` and ``mongo-sim`` (the MongoDB stores on the simulator of ``tests/mongosim``, one
per test session, a fresh database per test) always; ``mongo`` when ``WOWD_TEST_MONGODB_URI`` is
set and ``elasticsearch`` (the sink) when ``WOWD_TEST_ELASTICSEARCH_URL`` is set. The sink suite also runs against
``fake-elasticsearch`` (``tests/elasticsearch/fake_es.py``, the stateful model the black-pipe
tests rely on), so that the fake is held to the same contract as a real server. With the
variable set and the server absent the fixture fails (it never skips). Each test gets a fresh
database / file / index prefix.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from wowd.model import AggregateType
from wowd.stores.base import Log, Outbox, SlotLeaseStore, SnapshotStore, TimerHistory, TimerStore

MONGO_URI = os.environ.get("WOWD_TEST_MONGODB_URI")
ES_URL = os.environ.get("WOWD_TEST_ELASTICSEARCH_URL")

CONTEXT = "ctx"
PARTITIONS = 8

MONGO_IMPLS: list[Any] = ["embedded", "mongo-sim"] + (
    [pytest.param("mongo", marks=pytest.mark.mongo)] if MONGO_URI else []
)
"""With ``WOWD_TEST_MONGODB_URI`` set, the real server's runs are marked ``mongo``: ``pytest -m
mongo tests/contract`` runs them alone."""
SHARDED_IMPLS = [*MONGO_IMPLS, "mongo-sim-sharded"]
"""The log (checkpoints included) and timer suites also run through a simulated ``mongos`` of
two shards: the stores shard what they shard, and the log's stream is the shards' merged one."""
SINK_IMPLS: list[Any] = ["embedded", "fake-elasticsearch"] + (
    [pytest.param("elasticsearch", marks=pytest.mark.elasticsearch)] if ES_URL else []
)
"""With ``WOWD_TEST_ELASTICSEARCH_URL`` set, the real server's runs are marked ``elasticsearch``."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "wowd.db"


TABLE_SCAN_LIMIT = 20
"""The contract suites' simulators refuse a query no index can answer on a collection of more
documents than this (as ``notablescan``): a missing or unused index fails the test that sent it."""

_SIMULATORS: list[Any] = []
"""The engines of the session's simulators (their plan checks are read after each test)."""


@pytest.fixture(scope="session")
def mongosim_uri() -> Iterator[str]:
    """The URI of a MongoDB simulator serving the whole test session, its plan check on."""
    from tests.mongosim import Settings, serving

    with serving(Settings(plan_check=True, table_scan_limit=TABLE_SCAN_LIMIT)) as server:
        _SIMULATORS.append(server.engine)
        yield server.uri


@pytest.fixture(autouse=True)
def _plan_check() -> Iterator[None]:
    """Fails a test that sent the simulator a sorted query a server could not sort through its
    index (more than ``internalQueryMaxScansToExplode`` point scans to merge): the server would
    answer it, by a sort in memory, so the simulator answers it too and this fixture tells."""
    seen = [len(e.plan_findings) for e in _SIMULATORS]
    yield
    found = [
        f
        for e, n in zip(_SIMULATORS, seen + [0] * (len(_SIMULATORS) - len(seen)), strict=True)
        for f in e.plan_findings[n:]
    ]
    assert not found, f"a sorted query the index cannot sort: {found}"


@pytest.fixture(scope="session")
def mongosim_sharded_uri() -> Iterator[str]:
    """The URI of a simulated ``mongos`` of two shards serving the whole test session. Its
    shards' no-op writers run every 50 ms: a merged stream waits for its idlest shard's no-op,
    and the suites should not wait the 10 s of a default deployment for it."""
    from tests.mongosim import Settings, serving

    with serving(Settings(shards=2, noop_interval=0.05, plan_check=True, table_scan_limit=TABLE_SCAN_LIMIT)) as server:
        _SIMULATORS.append(server.engine)
        yield server.uri


@asynccontextmanager
async def _fresh_database(uri: str) -> AsyncIterator[Any]:
    """A fresh database on the server of ``uri``; fails if it does not answer."""
    from pymongo import AsyncMongoClient

    # 5 s to find the server, unless the URI says otherwise
    timeout = {} if "serverselectiontimeoutms=" in uri.lower() else {"serverSelectionTimeoutMS": 5000}
    client: AsyncMongoClient[Any] = AsyncMongoClient(uri, **timeout)
    try:
        await client.admin.command("ping")  # raises (fails the test) when the server is absent
        name = f"wowd_test_{uuid.uuid4().hex[:12]}"
        try:
            yield client[name]
        finally:
            await client.drop_database(name)
    finally:
        await client.close()


@pytest.fixture
async def mongo_db() -> AsyncIterator[Any]:
    """A fresh database on the server of WOWD_TEST_MONGODB_URI; fails if it does not answer."""
    assert MONGO_URI, "WOWD_TEST_MONGODB_URI is not set"
    async with _fresh_database(MONGO_URI) as db:
        yield db


async def _closing(store: Any) -> AsyncIterator[Any]:
    try:
        yield store
    finally:
        await store.close()


@dataclass(frozen=True, slots=True)
class Where:
    """Where a test's stores live: the embedded file, or a fresh MongoDB database."""

    path: Path
    mongo: Any = None
    """The test's ``AsyncDatabase`` (MongoDB only)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreFactories:
    """How one backend makes each store of the contract suites (``prepare`` is the fixture's)."""

    lease_store: Callable[[Where], SlotLeaseStore]
    timer_store: Callable[[Where], TimerStore]
    snapshot_store: Callable[[Where], SnapshotStore]
    log: Callable[[Where], Log]
    outbox: Callable[[Where], Outbox]
    history: Callable[[Where], TimerHistory]


def _embedded() -> StoreFactories:
    from wowd.stores.embedded.history import EmbeddedTimerHistory
    from wowd.stores.embedded.leases import EmbeddedSlotLeaseStore
    from wowd.stores.embedded.log import EmbeddedLog
    from wowd.stores.embedded.outbox import EmbeddedOutbox
    from wowd.stores.embedded.snapshots import EmbeddedSnapshotStore
    from wowd.stores.embedded.timers import EmbeddedTimerStore

    return StoreFactories(
        lease_store=lambda w: EmbeddedSlotLeaseStore(w.path),
        timer_store=lambda w: EmbeddedTimerStore(w.path, context=CONTEXT, partitions=PARTITIONS),
        snapshot_store=lambda w: EmbeddedSnapshotStore(w.path, context=CONTEXT),
        log=lambda w: EmbeddedLog(w.path, context=CONTEXT, partitions=PARTITIONS),
        outbox=lambda w: EmbeddedOutbox(w.path),
        history=lambda w: EmbeddedTimerHistory(w.path, context=CONTEXT),
    )


def _mongo() -> StoreFactories:
    from wowd.stores.mongo.history import MongoTimerHistory
    from wowd.stores.mongo.leases import MongoSlotLeaseStore
    from wowd.stores.mongo.log import MongoLog
    from wowd.stores.mongo.outbox import MongoOutbox
    from wowd.stores.mongo.snapshots import MongoSnapshotStore
    from wowd.stores.mongo.timers import MongoTimerStore

    return StoreFactories(
        lease_store=lambda w: MongoSlotLeaseStore(w.mongo.client, w.mongo.name),
        timer_store=lambda w: MongoTimerStore(w.mongo.client, w.mongo.name, context=CONTEXT, partitions=PARTITIONS),
        snapshot_store=lambda w: MongoSnapshotStore(w.mongo.client, w.mongo.name, context=CONTEXT),
        log=lambda w: MongoLog(w.mongo.client, w.mongo.name, context=CONTEXT, partitions=PARTITIONS),
        outbox=lambda w: MongoOutbox(w.mongo.client, w.mongo.name, context=CONTEXT),
        history=lambda w: MongoTimerHistory(w.mongo.client, w.mongo.name, context=CONTEXT),
    )


def _mongo_sim() -> StoreFactories:
    """The MongoDB stores, the log's empty ``getMore`` held 50 ms (not 1 s): a read that is
    caught up ends after one empty wait, and the suite waits less on the simulator."""
    from datetime import timedelta

    from wowd.stores.mongo.log import MongoLog

    mongo = _mongo()
    return StoreFactories(
        lease_store=mongo.lease_store,
        timer_store=mongo.timer_store,
        snapshot_store=mongo.snapshot_store,
        log=lambda w: MongoLog(
            w.mongo.client, w.mongo.name, context=CONTEXT, partitions=PARTITIONS, max_await=timedelta(milliseconds=50)
        ),
        outbox=mongo.outbox,
        history=mongo.history,
    )


BACKENDS: dict[str, Callable[[], StoreFactories]] = {
    "embedded": _embedded,
    "mongo": _mongo,
    "mongo-sim": _mongo_sim,
    "mongo-sim-sharded": _mongo_sim,
}
"""The store factories of each backend the suites run on (a backend's modules load when used)."""


async def _store(request: pytest.FixtureRequest, db_path: Path, kind: str, *, prepare: bool) -> AsyncIterator[Any]:
    backend = request.param
    uri = {
        "mongo": MONGO_URI,
        "mongo-sim": request.getfixturevalue("mongosim_uri") if backend == "mongo-sim" else None,
        "mongo-sim-sharded": request.getfixturevalue("mongosim_sharded_uri")
        if backend == "mongo-sim-sharded"
        else None,
    }
    if backend in uri:
        assert uri[backend], "WOWD_TEST_MONGODB_URI is not set"
        async with _fresh_database(str(uri[backend])) as db:
            async for s in _opened(BACKENDS[backend](), kind, Where(db_path, db), prepare=prepare):
                yield s
        return
    async for s in _opened(BACKENDS[backend](), kind, Where(db_path), prepare=prepare):
        yield s


async def _opened(factories: StoreFactories, kind: str, where: Where, *, prepare: bool) -> AsyncIterator[Any]:
    store = getattr(factories, kind)(where)
    if prepare:
        await store.prepare()
    async for s in _closing(store):
        yield s


@pytest.fixture(params=MONGO_IMPLS)
async def lease_store(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[SlotLeaseStore]:
    async for s in _store(request, db_path, "lease_store", prepare=False):
        yield s


@pytest.fixture(params=SHARDED_IMPLS)
async def timer_store(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[TimerStore]:
    async for s in _store(request, db_path, "timer_store", prepare=True):
        yield s


@pytest.fixture(params=SHARDED_IMPLS)
async def snapshot_store(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[SnapshotStore]:
    """A SnapshotStore that is also its own SnapshotRebuildStore."""
    async for s in _store(request, db_path, "snapshot_store", prepare=True):
        yield s


@pytest.fixture(params=SHARDED_IMPLS)
async def log(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[Log]:
    async for s in _store(request, db_path, "log", prepare=True):
        yield s


@pytest.fixture(params=MONGO_IMPLS)
async def outbox(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[Outbox]:
    async for s in _store(request, db_path, "outbox", prepare=False):
        yield s


@pytest.fixture(params=MONGO_IMPLS)
async def history(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[TimerHistory]:
    async for s in _store(request, db_path, "history", prepare=True):
        yield s


SINK_TYPE = AggregateType(context=CONTEXT, aggregate="order")


@pytest.fixture(params=SINK_IMPLS)
async def sink(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[Any]:
    """The event sink of ``ctx.order`` (refresh on, for reads right after writes)."""
    if request.param == "embedded":
        from wowd.stores.embedded.sink import EmbeddedEventSink

        store: Any = EmbeddedEventSink(db_path, SINK_TYPE)
    elif request.param == "fake-elasticsearch":
        from elasticsearch import AsyncElasticsearch

        from tests.elasticsearch.fake_es import EsModel, serving
        from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

        with serving() as fake:
            fake.model = EsModel()
            client = AsyncElasticsearch(fake.url, request_timeout=5)
            store = ElasticsearchEventSink(client, SINK_TYPE, refresh=True, owns_client=True)
            await store.prepare()
            async for s in _closing(store):
                yield s
        return
    else:
        from elasticsearch import AsyncElasticsearch

        from wowd.stores.elasticsearch.sink import ElasticsearchEventSink

        assert ES_URL
        client = AsyncElasticsearch(ES_URL)
        try:
            await client.info()  # fails the test when the server is absent
        except BaseException:
            await client.close()
            raise
        prefix = f"t{uuid.uuid4().hex[:10]}"
        store = ElasticsearchEventSink(
            client, AggregateType(context=prefix, aggregate="order"), refresh=True, owns_client=True
        )
    await store.prepare()
    async for s in _closing(store):
        yield s
